//! Served models: requests with deadlines, batched by salusd.
//!
//! `Serve` turns an open inference session into a served model: a task of its own (the
//! [`server`](self) loop) takes each request `Infer` brings, tells the session's request
//! scheduler (`salus_core::serving`: ORLOJ or a baseline) that it arrived, and carries out
//! what the scheduler decides: a batch becomes one iteration of the session's program for
//! that batch size (or, decoding, that program repeated until every request in it is
//! done), run through the engine like any client's; each request is answered with its own
//! rows, or dropped with the scheduler's reason. The engine still decides when the
//! session's iterations run beside other sessions; the request scheduler decides only
//! what each iteration holds.
//!
//! Execution times come from the batches themselves: each batch's measured time is the
//! scheduler's `BatchFinished`, and each request's solo time, estimated from its batch's
//! time and what `Serve` measured of every program, is its `Profiled` sample.

mod server;
pub mod shapes;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use salus_core::serving::{DropReason, RequestSchedulerKind};
use tokio::sync::{mpsc, oneshot};

use crate::auth::Principal;
use crate::engine::{Engine, EngineError};
pub use shapes::Shapes;

/// A served model as `Serve` asks for it.
#[derive(Debug, Clone)]
pub struct ServeSpec {
    /// The request scheduler.
    pub scheduler: RequestSchedulerKind,
    /// What a request may ask for, cheapest first.
    pub variants: Vec<VariantSpec>,
    /// Decoding: the program repeats until each request is done.
    pub decode: Option<DecodeSpec>,
    /// A request's SLO when it gives none; `None`: no deadline.
    pub default_slo: Option<Duration>,
    /// The feed salusd fills with each request's variant index (requests omit it).
    pub variant_feed: Option<usize>,
}

/// One variant: the program for each batch size.
#[derive(Debug, Clone)]
pub struct VariantSpec {
    /// A name people recognise.
    pub name: String,
    /// (batch size, program number).
    pub programs: Vec<(usize, u32)>,
}

/// A program repeated until a value it computes says stop.
#[derive(Debug, Clone)]
pub struct DecodeSpec {
    /// (fetch, feed): each step's fetch is the next step's feed.
    pub carry: Vec<(usize, usize)>,
    /// The fetch holding each request's done flag.
    pub done: usize,
    /// Steps at most.
    pub max_steps: u32,
}

/// One request as `Infer` brings it.
#[derive(Debug)]
pub struct InferRequest {
    /// Its rows, one per feed, in its variant's shapes.
    pub feeds: Vec<Vec<u8>>,
    /// Its variant's index.
    pub variant: usize,
    /// Its SLO; `None`: the served model's default.
    pub slo: Option<Duration>,
    /// Its application.
    pub app: u32,
    /// When it reached salusd.
    pub arrived: Instant,
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct InferAnswer {
    /// Its rows of each fetch, in its variant's shapes.
    pub fetches: Vec<Vec<u8>>,
    /// Arrival to answer.
    pub latency: Duration,
    /// Arrival to its batch's start.
    pub queued: Duration,
    /// Its batch's size.
    pub batch_size: usize,
    /// Requests its batch held.
    pub batch_requests: usize,
    /// The variant its batch ran.
    pub batch_variant: usize,
    /// Decode steps it took (1 without decoding).
    pub steps: u32,
    /// Whether it was done within the step bound (true without decoding).
    pub done: bool,
    /// Whether it was answered by its deadline.
    pub met_deadline: bool,
}

/// Why serving or a request failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ServeError {
    /// The served model cannot be built as asked: the message names what.
    #[error("session {session}: cannot serve: {why}")]
    Spec {
        /// Which session.
        session: u64,
        /// What is wrong.
        why: String,
    },
    /// A request that does not fit the served model.
    #[error("session {session}: request refused: {why}")]
    Request {
        /// Which session.
        session: u64,
        /// What is wrong.
        why: String,
    },
    /// `Infer` to a session that is not served.
    #[error("session {0} is not served: call Serve first")]
    NotServed(u64),
    /// `Serve` twice.
    #[error("session {0} is served already")]
    AlreadyServed(u64),
    /// The scheduler dropped the request unrun.
    #[error("session {session}: {scheduler} dropped the request: {}", reason_text(*.reason))]
    Dropped {
        /// Which session.
        session: u64,
        /// Which scheduler.
        scheduler: RequestSchedulerKind,
        /// Why.
        reason: DropReason,
    },
    /// The engine refused or failed the batch (the session closed, the device failed, the
    /// request's values made the program fail).
    #[error(transparent)]
    Engine(Arc<EngineError>),
}

impl From<EngineError> for ServeError {
    fn from(error: EngineError) -> Self {
        ServeError::Engine(Arc::new(error))
    }
}

fn reason_text(reason: DropReason) -> &'static str {
    match reason {
        DropReason::Expired => "its deadline passed before it could start",
        DropReason::Hopeless => "by its estimate it could no longer finish by its deadline",
        DropReason::MissedStartWindow => {
            "its planned batch could not start in time after the batch before ran late"
        }
    }
}

/// How many recent latencies percentiles are computed over.
const RECENT: usize = 4096;

/// What a served model has done, for `salusctl` and the metrics endpoint.
#[derive(Debug, Clone, Default)]
pub struct ServingStats {
    /// The scheduler's name.
    pub scheduler: String,
    /// Requests waiting for a batch.
    pub pending: u64,
    /// Requests answered with their rows.
    pub finished: u64,
    /// Of those, answered by their deadline.
    pub met_deadline: u64,
    /// Requests the scheduler dropped.
    pub dropped: u64,
    /// Requests whose batch failed.
    pub failed: u64,
    /// Batches run, by batch size.
    pub batches: BTreeMap<usize, u64>,
    /// Recent latencies (arrival to answer) of finished requests.
    pub recent: VecDeque<Duration>,
    /// Requests that arrived.
    pub requests: u64,
    /// Time spent in the scheduler's decisions, over every event.
    pub scheduling: Duration,
}

impl ServingStats {
    fn latency(&mut self, latency: Duration) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(latency);
    }

    /// The `q` quantile (0..=1) of recent latencies.
    pub fn latency_quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted: Vec<Duration> = self.recent.iter().copied().collect();
        sorted.sort_unstable();
        let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
        sorted.get(i).copied()
    }
}

struct Handle {
    owner: Principal,
    shapes: Arc<Shapes>,
    arrivals: mpsc::UnboundedSender<(
        InferRequest,
        oneshot::Sender<Result<InferAnswer, ServeError>>,
    )>,
    stats: Arc<Mutex<ServingStats>>,
}

/// The served models of a daemon, by session.
#[derive(Clone, Default)]
pub struct Servers {
    inner: Arc<Mutex<HashMap<u64, Handle>>>,
}

impl Servers {
    /// Starts serving `session` as `spec` says: checks the spec against the session's
    /// programs, times each program on zeros (waiting for the session's admission), and
    /// starts the server. Returns what it measured: (variant, batch size, time).
    pub async fn serve(
        &self,
        engine: &Engine,
        principal: Principal,
        session: u64,
        spec: ServeSpec,
        slo_hint: Option<Duration>,
    ) -> Result<Vec<(usize, usize, Duration)>, ServeError> {
        if self.inner.lock().expect("servers").contains_key(&session) {
            return Err(ServeError::AlreadyServed(session));
        }
        let programs = engine
            .ask(|reply| crate::engine::Command::Programs {
                principal,
                session,
                reply,
            })
            .await?;
        let shapes = Arc::new(
            Shapes::check(&spec, &programs).map_err(|why| ServeError::Spec { session, why })?,
        );
        let job = server::BatchJob {
            engine: engine.clone(),
            principal,
            session,
            shapes: shapes.clone(),
            decode: spec.decode.clone(),
        };
        let calibration = job.calibrate().await?;
        let stats = Arc::new(Mutex::new(ServingStats {
            scheduler: spec.scheduler.name().to_string(),
            ..ServingStats::default()
        }));
        let server = server::Server::new(job, &spec, slo_hint, &calibration, stats.clone())
            .map_err(|why| ServeError::Spec { session, why })?;
        let (arrivals, rx) = mpsc::unbounded_channel();
        {
            let mut servers = self.inner.lock().expect("servers");
            if servers.contains_key(&session) {
                return Err(ServeError::AlreadyServed(session));
            }
            servers.insert(
                session,
                Handle {
                    owner: principal,
                    shapes,
                    arrivals,
                    stats,
                },
            );
        }
        let servers = self.clone();
        tokio::spawn(async move {
            server.run(rx).await;
            servers.stop(session);
        });
        Ok(calibration)
    }

    /// Hands a request to `session`'s server after checking it; resolves with its answer.
    pub async fn infer(
        &self,
        principal: Principal,
        session: u64,
        request: InferRequest,
    ) -> Result<InferAnswer, ServeError> {
        let (reply, answer) = oneshot::channel();
        {
            let servers = self.inner.lock().expect("servers");
            let handle = servers
                .get(&session)
                .ok_or(ServeError::NotServed(session))?;
            principal
                .check_session(session, handle.owner)
                .map_err(EngineError::from)?;
            check_request(&handle.shapes, &request)
                .map_err(|why| ServeError::Request { session, why })?;
            handle
                .arrivals
                .send((request, reply))
                .map_err(|_| ServeError::from(EngineError::Closing(session)))?;
        }
        answer
            .await
            .unwrap_or_else(|_| Err(EngineError::Closing(session).into()))
    }

    /// Stops serving `session` (it closed): requests waiting are answered that it closed.
    pub fn stop(&self, session: u64) {
        self.inner.lock().expect("servers").remove(&session);
    }

    /// Each served session's numbers.
    pub fn stats(&self) -> HashMap<u64, ServingStats> {
        self.inner
            .lock()
            .expect("servers")
            .iter()
            .map(|(&s, h)| (s, h.stats.lock().expect("stats").clone()))
            .collect()
    }
}

fn check_request(shapes: &Shapes, request: &InferRequest) -> Result<(), String> {
    let variant = shapes.variants.get(request.variant).ok_or_else(|| {
        format!(
            "variant {} does not exist (the model has {})",
            request.variant,
            shapes.variants.len()
        )
    })?;
    let given: Vec<(usize, &salus_graph::TensorType)> =
        shapes.request_feeds(request.variant).collect();
    if request.feeds.len() != given.len() {
        return Err(format!(
            "it gives {} feeds; variant '{}' takes {}{}",
            request.feeds.len(),
            variant.name,
            given.len(),
            if shapes.variant_feed.is_some() {
                " (salusd fills the variant feed)"
            } else {
                ""
            }
        ));
    }
    for (bytes, (i, ty)) in request.feeds.iter().zip(given) {
        let want = shapes::row_bytes(ty);
        if bytes.len() != want {
            return Err(format!(
                "feed {i} has {} bytes; a request's row of it is {ty} in variant '{}', {want} \
                 bytes",
                bytes.len(),
                variant.name
            ));
        }
    }
    Ok(())
}
