//! One served model's loop: requests in, the request scheduler's decisions carried out,
//! answers out. A batch runs as a task of its own so arrivals and ticks are handled while
//! it runs; the scheduler starts no second batch until the first has finished.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use salus_core::serving::{
    AppId, BatchCost, BatchId, Request, RequestAction, RequestEvent, RequestId, RequestScheduler,
    RequestSchedulerKind, ServingConfig,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::shapes::{self, Shapes};
use super::{DecodeSpec, InferAnswer, InferRequest, ServeError, ServeSpec, ServingStats};
use crate::auth::Principal;
use crate::engine::{Command, Engine, EngineError, RunResult};

/// The deadline of a request without an SLO: far enough never to matter, near enough for
/// the schedulers' arithmetic.
const NO_DEADLINE: Duration = Duration::from_secs(3600);

type Reply = oneshot::Sender<Result<InferAnswer, ServeError>>;

/// What a served model's batches need to run: each batch's task owns a copy.
#[derive(Clone)]
pub(super) struct BatchJob {
    pub engine: Engine,
    pub principal: Principal,
    pub session: u64,
    pub shapes: Arc<Shapes>,
    pub decode: Option<DecodeSpec>,
}

/// A request's rows out of its batch.
struct Rows {
    fetches: Vec<Vec<u8>>,
    steps: u32,
    done: bool,
}

type Outcome = Vec<Result<Rows, Arc<EngineError>>>;

impl BatchJob {
    async fn run(&self, program: u32, feeds: Vec<Vec<u8>>) -> Result<RunResult, EngineError> {
        self.engine
            .ask(|reply| Command::Run {
                principal: self.principal,
                session: self.session,
                program,
                feeds,
                writes: Vec::new(),
                fetch_lengths: Vec::new(),
                reply,
            })
            .await
    }

    /// Runs `requests` ((variant, rows)) as one batch of `size` at `variant`.
    async fn batch(
        &self,
        variant: usize,
        size: usize,
        requests: &[(usize, &[Vec<u8>])],
    ) -> Result<Vec<Rows>, EngineError> {
        let at = &self.shapes.variants[variant];
        let mut feeds: Vec<Vec<u8>> = at
            .feeds
            .iter()
            .map(|ty| vec![0; size * shapes::row_bytes(ty)])
            .collect();
        for (i, (v, rows)) in requests.iter().enumerate() {
            let own = &self.shapes.variants[*v];
            for ((f, _), row) in self.shapes.request_feeds(variant).zip(rows.iter()) {
                let n = shapes::row_bytes(&at.feeds[f]);
                shapes::pad_into(
                    row,
                    &own.feeds[f],
                    &at.feeds[f],
                    &mut feeds[f][i * n..(i + 1) * n],
                );
            }
        }
        if let Some(f) = self.shapes.variant_feed {
            // Each request's own variant; padding rows run the batch's.
            let values: Vec<usize> = (0..size)
                .map(|i| requests.get(i).map_or(variant, |r| r.0))
                .collect();
            feeds[f] = shapes::variant_indices(&values, at.feeds[f].dtype);
        }
        let program = at.program(size);
        let cut = |fetches: &[Vec<u8>], i: usize, v: usize| -> Vec<Vec<u8>> {
            let own = &self.shapes.variants[v];
            fetches
                .iter()
                .zip(at.fetches.iter().zip(&own.fetches))
                .map(|(bytes, (ty, mine))| {
                    let n = shapes::row_bytes(ty);
                    shapes::cut(&bytes[i * n..(i + 1) * n], ty, mine)
                })
                .collect()
        };
        let Some(decode) = &self.decode else {
            let result = self.run(program, feeds).await?;
            return Ok((0..requests.len())
                .map(|i| Rows {
                    fetches: cut(&result.fetches, i, requests[i].0),
                    steps: 1,
                    done: true,
                })
                .collect());
        };
        let mut answers: Vec<Option<Rows>> = (0..requests.len()).map(|_| None).collect();
        let done_ty = &at.fetches[decode.done];
        // Carried feeds move into each step; the others are sent again.
        let carried: Vec<bool> = (0..feeds.len())
            .map(|f| decode.carry.iter().any(|c| c.1 == f))
            .collect();
        for step in 1..=decode.max_steps {
            let inputs = feeds
                .iter_mut()
                .zip(&carried)
                .map(|(bytes, &moved)| {
                    if moved {
                        std::mem::take(bytes)
                    } else {
                        bytes.clone()
                    }
                })
                .collect();
            let result = self.run(program, inputs).await?;
            let flags = &result.fetches[decode.done];
            for (i, answer) in answers.iter_mut().enumerate() {
                if answer.is_none() && shapes::flag(flags, done_ty.dtype, i) {
                    *answer = Some(Rows {
                        fetches: cut(&result.fetches, i, requests[i].0),
                        steps: step,
                        done: true,
                    });
                }
            }
            if answers.iter().all(Option::is_some) || step == decode.max_steps {
                return Ok(answers
                    .into_iter()
                    .enumerate()
                    .map(|(i, a)| {
                        a.unwrap_or_else(|| Rows {
                            fetches: cut(&result.fetches, i, requests[i].0),
                            steps: step,
                            done: false,
                        })
                    })
                    .collect());
            }
            let mut fetches = result.fetches;
            for &(fetch, feed) in &decode.carry {
                feeds[feed] = std::mem::take(&mut fetches[fetch]);
            }
        }
        unreachable!("the loop returns at max_steps, which is at least 1")
    }

    /// Runs a batch; when a batch of several fails in the program (one request's values
    /// can make it fail), runs each request alone, so that only the one at fault fails.
    async fn execute(
        self,
        variant: usize,
        size: usize,
        requests: Vec<(usize, Vec<Vec<u8>>)>,
    ) -> Outcome {
        let views: Vec<(usize, &[Vec<u8>])> =
            requests.iter().map(|(v, r)| (*v, r.as_slice())).collect();
        match self.batch(variant, size, &views).await {
            Ok(rows) => rows.into_iter().map(Ok).collect(),
            Err(error @ EngineError::Exec(salus_exec::ExecError::Node { .. }))
                if views.len() > 1 =>
            {
                tracing::info!(session = self.session, %error, "a batch failed; its requests run alone");
                let smallest = self.shapes.batch_sizes[0];
                let mut outcome = Vec::with_capacity(views.len());
                for view in &views {
                    outcome.push(
                        self.batch(view.0, smallest, std::slice::from_ref(view))
                            .await
                            .map(|mut rows| rows.remove(0))
                            .map_err(Arc::new),
                    );
                }
                outcome
            }
            Err(error) => {
                let error = Arc::new(error);
                views.iter().map(|_| Err(error.clone())).collect()
            }
        }
    }
}

/// Runs each program times `Serve` measures, after one to warm up.
const CALIBRATION_RUNS: usize = 5;

impl BatchJob {
    /// Times every program on a batch of zeros (the median of [`CALIBRATION_RUNS`] after
    /// one to warm up): (variant, batch size, time). Waits for the session's admission.
    pub(super) async fn calibrate(&self) -> Result<Vec<(usize, usize, Duration)>, ServeError> {
        let mut times = Vec::new();
        for (v, variant) in self.shapes.variants.iter().enumerate() {
            for &(size, program) in &variant.programs {
                let zeros = || {
                    variant
                        .feeds
                        .iter()
                        .map(|ty| vec![0; size * shapes::row_bytes(ty)])
                        .collect::<Vec<_>>()
                };
                self.run(program, zeros()).await?;
                let mut runs = Vec::with_capacity(CALIBRATION_RUNS);
                for _ in 0..CALIBRATION_RUNS {
                    let started = Instant::now();
                    self.run(program, zeros()).await?;
                    runs.push(started.elapsed());
                }
                runs.sort_unstable();
                times.push((v, size, runs[CALIBRATION_RUNS / 2]));
            }
        }
        Ok(times)
    }
}

/// `BatchCost` fitted to the costliest variant's times: a batch of `k` takes
/// `a + c·k` times a batch of one, least squares, neither negative.
fn fit_cost(times: &[(usize, usize, Duration)], variants: usize) -> BatchCost {
    let last: Vec<(f64, f64)> = times
        .iter()
        .filter(|t| t.0 == variants - 1)
        .map(|t| (t.1 as f64, t.2.as_secs_f64()))
        .collect();
    let one = last
        .iter()
        .find(|p| p.0 == 1.0)
        .or(last.first())
        .map_or(1.0, |p| p.1 / p.0);
    let ratios: Vec<(f64, f64)> = last.iter().map(|&(k, t)| (k, t / one.max(1e-12))).collect();
    let n = ratios.len() as f64;
    let (mk, mr) = (
        ratios.iter().map(|p| p.0).sum::<f64>() / n,
        ratios.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let var: f64 = ratios.iter().map(|p| (p.0 - mk).powi(2)).sum();
    let c = if var > 0.0 {
        (ratios.iter().map(|p| (p.0 - mk) * (p.1 - mr)).sum::<f64>() / var).max(0.0)
    } else {
        0.0
    };
    let a = (mr - c * mk).max(0.0);
    if a + c <= 0.0 {
        return BatchCost::default();
    }
    BatchCost {
        fixed: Duration::ZERO,
        per_batch: a,
        per_request: c,
    }
}

struct Waiting {
    request: InferRequest,
    deadline: Duration,
    reply: Reply,
}

struct Running {
    batch: BatchId,
    variant: usize,
    size: usize,
    requests: Vec<(RequestId, Waiting)>,
    started: Instant,
}

/// A served model's loop.
pub(super) struct Server {
    job: BatchJob,
    kind: RequestSchedulerKind,
    scheduler: Box<dyn RequestScheduler>,
    default_slo: Option<Duration>,
    /// Milliseconds each (variant, batch size) took at `Serve`.
    calibration: HashMap<(usize, usize), f64>,
    stats: Arc<Mutex<ServingStats>>,
    start: Instant,
    last: Duration,
    next_request: u64,
    waiting: HashMap<RequestId, Waiting>,
    running: Option<Running>,
    actions: Vec<RequestAction>,
    /// The session is gone (closed, or salusd stops): serving ends.
    gone: bool,
}

impl Server {
    pub(super) fn new(
        job: BatchJob,
        spec: &ServeSpec,
        slo_hint: Option<Duration>,
        calibration: &[(usize, usize, Duration)],
        stats: Arc<Mutex<ServingStats>>,
    ) -> Result<Server, String> {
        let config = ServingConfig {
            batch_sizes: job.shapes.batch_sizes.clone(),
            cost: fit_cost(calibration, job.shapes.variants.len()),
            ..ServingConfig::default()
        };
        let scheduler = spec.scheduler.build(config).map_err(|e| e.to_string())?;
        Ok(Server {
            job,
            kind: spec.scheduler,
            scheduler,
            default_slo: spec.default_slo.or(slo_hint),
            calibration: calibration
                .iter()
                .map(|&(v, b, t)| ((v, b), t.as_secs_f64() * 1e3))
                .collect(),
            stats,
            start: Instant::now(),
            last: Duration::ZERO,
            next_request: 0,
            waiting: HashMap::new(),
            running: None,
            actions: Vec::new(),
            gone: false,
        })
    }

    /// Serves until the session stops being served (its sender is dropped), then answers
    /// what waits.
    pub(super) async fn run(
        mut self,
        mut arrivals: mpsc::UnboundedReceiver<(InferRequest, Reply)>,
    ) {
        let mut task: Option<JoinHandle<Outcome>> = None;
        let mut open = true;
        while open || task.is_some() {
            let wake = self.scheduler.poll_timeout().map(|t| self.start + t);
            tokio::select! {
                arrival = arrivals.recv(), if open => match arrival {
                    Some((request, reply)) => self.arrived(request, reply),
                    None => {
                        open = false;
                        self.close_waiting();
                    }
                },
                outcome = async { task.as_mut().expect("guarded").await }, if task.is_some() => {
                    task = None;
                    let outcome = outcome.unwrap_or_else(|e| {
                        let error = Arc::new(EngineError::Exec(salus_exec::ExecError::Device(
                            format!("the batch's task stopped (a bug): {e}"),
                        )));
                        let n = self.running.as_ref().map_or(0, |r| r.requests.len());
                        (0..n).map(|_| Err(error.clone())).collect()
                    });
                    self.finished(outcome);
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now).into()), if wake.is_some() && open => {
                    self.event(RequestEvent::Tick);
                }
            }
            if self.gone && open {
                open = false;
                self.close_waiting();
            }
            if open && task.is_none() {
                task = self.act();
            } else {
                self.drops();
            }
            self.stats.lock().expect("stats").pending = self.waiting.len() as u64;
        }
    }

    fn now(&mut self) -> Duration {
        self.last = self.last.max(self.start.elapsed());
        self.last
    }

    /// Tells the scheduler `event` and takes its decisions, timing both.
    fn event(&mut self, event: RequestEvent) {
        let now = self.now();
        let started = Instant::now();
        if let Err(error) = self.scheduler.handle(now, event) {
            tracing::error!(session = self.job.session, %error, "the request scheduler refused an event (a bug)");
        }
        self.actions.extend(self.scheduler.poll());
        let mut stats = self.stats.lock().expect("stats");
        stats.scheduling += started.elapsed();
    }

    fn arrived(&mut self, request: InferRequest, reply: Reply) {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let arrival = request.arrived.saturating_duration_since(self.start);
        let slo = request.slo.or(self.default_slo).unwrap_or(NO_DEADLINE);
        let deadline = arrival + slo;
        let app = AppId(request.app);
        self.stats.lock().expect("stats").requests += 1;
        self.waiting.insert(
            id,
            Waiting {
                request,
                deadline,
                reply,
            },
        );
        self.event(RequestEvent::Arrived(Request {
            id,
            app,
            arrival,
            deadline,
        }));
    }

    /// Carries out the decisions taken: drops, and the next batch (as a task).
    fn act(&mut self) -> Option<JoinHandle<Outcome>> {
        let mut started = None;
        for action in std::mem::take(&mut self.actions) {
            match action {
                RequestAction::Drop { request, reason } => self.drop_request(request, reason),
                RequestAction::RunBatch(batch) => {
                    debug_assert!(started.is_none() && self.running.is_none());
                    let mut requests: Vec<(RequestId, Waiting)> = batch
                        .requests
                        .iter()
                        .filter_map(|id| self.waiting.remove(id).map(|w| (*id, w)))
                        .collect();
                    let variant = requests
                        .iter()
                        .map(|r| r.1.request.variant)
                        .max()
                        .unwrap_or(0);
                    // The rows move to the batch; the answer needs only the rest.
                    let rows = requests
                        .iter_mut()
                        .map(|(_, w)| (w.request.variant, std::mem::take(&mut w.request.feeds)))
                        .collect();
                    let job = self.job.clone();
                    let size = batch.batch_size;
                    started = Some(tokio::spawn(job.execute(variant, size, rows)));
                    *self
                        .stats
                        .lock()
                        .expect("stats")
                        .batches
                        .entry(size)
                        .or_default() += 1;
                    self.running = Some(Running {
                        batch: batch.id,
                        variant,
                        size,
                        requests,
                        started: Instant::now(),
                    });
                }
            }
        }
        started
    }

    /// While a batch runs or the server closes: only the drops.
    fn drops(&mut self) {
        let actions = std::mem::take(&mut self.actions);
        for action in actions {
            match action {
                RequestAction::Drop { request, reason } => self.drop_request(request, reason),
                run @ RequestAction::RunBatch(_) => self.actions.push(run),
            }
        }
    }

    fn drop_request(&mut self, id: RequestId, reason: salus_core::serving::DropReason) {
        if let Some(waiting) = self.waiting.remove(&id) {
            self.stats.lock().expect("stats").dropped += 1;
            let _ = waiting.reply.send(Err(ServeError::Dropped {
                session: self.job.session,
                scheduler: self.kind,
                reason,
            }));
        }
    }

    fn finished(&mut self, outcome: Outcome) {
        let Some(running) = self.running.take() else {
            return;
        };
        let duration = running.started.elapsed();
        self.event(RequestEvent::BatchFinished {
            batch: running.batch,
            duration,
        });
        let batch_steps = outcome
            .iter()
            .filter_map(|r| r.as_ref().ok().map(|r| r.steps))
            .max()
            .unwrap_or(1)
            .max(1);
        let batch_ms = self.calibration[&(running.variant, running.size)];
        let count = running.requests.len();
        for ((_, waiting), result) in running.requests.into_iter().zip(outcome) {
            let variant = waiting.request.variant;
            let answered = self.now();
            let latency = waiting.request.arrived.elapsed();
            let queued = running
                .started
                .saturating_duration_since(waiting.request.arrived);
            match result {
                Ok(rows) => {
                    // Its solo time: its share of the batch's steps, at its variant's batch of one.
                    let solo = duration.as_secs_f64()
                        * (rows.steps as f64 / batch_steps as f64)
                        * (self.calibration[&(variant, self.job.shapes.batch_sizes[0])]
                            / batch_ms.max(1e-9));
                    self.event(RequestEvent::Profiled {
                        app: AppId(waiting.request.app),
                        execution: Duration::from_secs_f64(solo.max(0.0)),
                    });
                    let met_deadline = answered <= waiting.deadline;
                    {
                        let mut stats = self.stats.lock().expect("stats");
                        stats.finished += 1;
                        stats.met_deadline += met_deadline as u64;
                        stats.latency(latency);
                    }
                    let _ = waiting.reply.send(Ok(InferAnswer {
                        fetches: rows.fetches,
                        latency,
                        queued,
                        batch_size: running.size,
                        batch_requests: count,
                        batch_variant: running.variant,
                        steps: rows.steps,
                        done: rows.done,
                        met_deadline,
                    }));
                }
                Err(error) => {
                    self.gone |= matches!(
                        *error,
                        EngineError::UnknownSession(_)
                            | EngineError::Closing(_)
                            | EngineError::Closed(_)
                            | EngineError::ClosedBeforeStart { .. }
                            | EngineError::ShuttingDown
                            | EngineError::Denied(_)
                    );
                    self.stats.lock().expect("stats").failed += 1;
                    let _ = waiting.reply.send(Err(ServeError::Engine(error)));
                }
            }
        }
    }

    /// The session stopped being served: every waiting request is told so.
    fn close_waiting(&mut self) {
        let session = self.job.session;
        for (_, waiting) in self.waiting.drain() {
            let _ = waiting
                .reply
                .send(Err(EngineError::Closing(session).into()));
        }
        self.actions.clear();
    }
}
