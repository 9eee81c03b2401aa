//! The Clockwork-like request scheduler: batches planned ahead with a fixed latency
//! estimate per batch size, as Clockwork's `infer5` scheduler does.
//!
//! - **Estimate**: per batch size, the 99th percentile of the last 10 measured batch
//!   times (effectively their maximum); before any measurement, the cost model at the
//!   profile's 99th percentile solo time (Clockwork's offline profile).
//! - **Queues**: every request enters a queue per batch size. Before a batch is formed for
//!   a worker free at `free_at`, each queue sheds, oldest first, the requests that would
//!   miss their deadline if a batch of its size started at `free_at`. The batch size is
//!   the largest one whose queue (and every smaller one's) holds enough requests; the
//!   batch is that queue's oldest requests, and every queue then drops the requests
//!   that arrived no later than the last of them. A request no queue holds any more is
//!   dropped ([`DropReason::Hopeless`]).
//! - **Plan ahead**: while a batch runs, the next one is planned `schedule_ahead` before
//!   the running one is expected to end (by the estimate), for a start at that expected
//!   end, with a window: it may start up to `latest_delta` after it. If the running batch
//!   ends later than that, the planned batch fails and its requests are dropped
//!   ([`DropReason::MissedStartWindow`]): Clockwork's worker rejects actions it cannot
//!   start in their window. With execution times that vary, the estimate is often wrong
//!   and batches fail (the dissertation's §4.2.3 "fail-every-other-batch pattern").

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::profile::duration;
use super::server::{Decision, Policy, View, Worker};
use super::{
    Batch, ClockworkParams, DropReason, Request, RequestId, RequestSchedulerKind, ServingConfig,
};

/// Clockwork's expected lag between the controller and the worker.
const FUTURE: Duration = Duration::from_millis(1);

/// A request in a batch-size queue.
#[derive(Debug, Clone, Copy)]
struct Queued {
    seq: u64,
    id: RequestId,
    deadline: Duration,
}

/// A batch planned while another runs.
#[derive(Debug, Clone)]
struct Planned {
    batch_size: usize,
    requests: Vec<RequestId>,
    /// It must start by then.
    latest: Duration,
}

pub(crate) struct Clockwork {
    params: ClockworkParams,
    sizes: Vec<usize>,
    queues: Vec<VecDeque<Queued>>,
    /// How many queues hold each request.
    held: HashMap<RequestId, usize>,
    seq: u64,
    /// Recent measured batch times, per batch size.
    measured: Vec<VecDeque<Duration>>,
    plan: Option<Planned>,
    wake: Option<Duration>,
}

impl Clockwork {
    pub fn new(config: &ServingConfig) -> Self {
        let n = config.batch_sizes.len();
        Clockwork {
            params: config.clockwork.clone(),
            sizes: config.batch_sizes.clone(),
            queues: vec![VecDeque::new(); n],
            held: HashMap::new(),
            seq: 0,
            measured: vec![VecDeque::new(); n],
            plan: None,
            wake: None,
        }
    }

    fn index(&self, batch_size: usize) -> usize {
        self.sizes
            .iter()
            .position(|&s| s == batch_size)
            .unwrap_or(self.sizes.len() - 1)
    }

    /// The fixed latency estimate of a batch size.
    fn estimate(&self, i: usize, view: &View<'_>) -> Duration {
        let window = &self.measured[i];
        if window.is_empty() {
            let solo = view.profile.quantile_ms(self.params.estimate_percentile);
            return duration(view.config.cost.batch_ms(self.sizes[i], solo));
        }
        let mut sorted: Vec<Duration> = window.iter().copied().collect();
        sorted.sort();
        let rank = (self.params.estimate_percentile * sorted.len() as f64).ceil() as usize;
        sorted[rank.clamp(1, sorted.len()) - 1]
    }

    /// A request leaves one queue; dropped when it was the last that held it.
    fn leave(&mut self, id: RequestId, drops: &mut Vec<(RequestId, DropReason)>) {
        if let Some(n) = self.held.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&id);
                drops.push((id, DropReason::Hopeless));
            }
        }
    }

    /// Clockwork's `try_dequeue` for a worker free at `free_at`.
    fn form_batch(
        &mut self,
        free_at: Duration,
        view: &View<'_>,
        drops: &mut Vec<(RequestId, DropReason)>,
    ) -> Option<(usize, Vec<RequestId>)> {
        for i in 0..self.sizes.len() {
            let completes = free_at + self.estimate(i, view);
            while let Some(front) = self.queues[i].front().copied() {
                if front.deadline >= completes {
                    break;
                }
                self.queues[i].pop_front();
                self.leave(front.id, drops);
            }
        }
        let mut i = 0;
        while i + 1 < self.sizes.len() && self.queues[i + 1].len() >= self.sizes[i + 1] {
            i += 1;
        }
        let size = self.sizes[i];
        if self.queues[i].len() < size {
            return None;
        }
        let taken: Vec<Queued> = self.queues[i].drain(..size).collect();
        let last = taken.last().map_or(0, |q| q.seq);
        for q in &taken {
            self.held.remove(&q.id);
        }
        for j in 0..self.queues.len() {
            while let Some(front) = self.queues[j].front().copied() {
                if front.seq > last {
                    break;
                }
                self.queues[j].pop_front();
                self.leave(front.id, drops);
            }
        }
        Some((size, taken.into_iter().map(|q| q.id).collect()))
    }
}

impl Clockwork {
    /// Plans the batch to follow one of `batch_size` started at `started`, once it is
    /// expected to end within `schedule_ahead`.
    fn plan_ahead(
        &mut self,
        now: Duration,
        started: Duration,
        batch_size: usize,
        view: &View<'_>,
        drops: &mut Vec<(RequestId, DropReason)>,
    ) {
        if self.plan.is_some() || self.held.is_empty() {
            return;
        }
        let expected_end = started + self.estimate(self.index(batch_size), view);
        if now + self.params.schedule_ahead < expected_end {
            self.wake = Some(expected_end - self.params.schedule_ahead);
            return;
        }
        let free_at = expected_end.max(now);
        if let Some((batch_size, requests)) = self.form_batch(free_at, view, drops) {
            let latest =
                (now + FUTURE + self.params.latest_delta).max(free_at + self.params.latest_delta);
            self.plan = Some(Planned {
                batch_size,
                requests,
                latest,
            });
        }
    }
}

impl Policy for Clockwork {
    fn kind(&self) -> RequestSchedulerKind {
        RequestSchedulerKind::Clockwork
    }

    fn arrived(&mut self, _now: Duration, request: &Request, _view: &View<'_>) {
        let queued = Queued {
            seq: self.seq,
            id: request.id,
            deadline: request.deadline,
        };
        self.seq += 1;
        for queue in &mut self.queues {
            queue.push_back(queued);
        }
        self.held.insert(request.id, self.queues.len());
    }

    fn finished(&mut self, _now: Duration, batch: &Batch, took: Duration, _view: &View<'_>) {
        let i = self.index(batch.batch_size);
        let window = &mut self.measured[i];
        window.push_back(took);
        if window.len() > self.params.estimate_window.max(1) {
            window.pop_front();
        }
    }

    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision) {
        self.wake = None;
        match worker {
            Worker::Idle => {
                let planned = match self.plan.take() {
                    Some(plan) if now <= plan.latest => Some((plan.batch_size, plan.requests)),
                    Some(plan) => {
                        for id in plan.requests {
                            out.drops.push((id, DropReason::MissedStartWindow));
                        }
                        None
                    }
                    None => None,
                };
                out.batch = planned.or_else(|| self.form_batch(now, view, &mut out.drops));
                if let Some((batch_size, _)) = &out.batch {
                    self.plan_ahead(now, now, *batch_size, view, &mut out.drops);
                }
            }
            Worker::Busy {
                started,
                batch_size,
            } => self.plan_ahead(now, started, batch_size, view, &mut out.drops),
        }
    }

    fn wake_at(&self) -> Option<Duration> {
        self.wake
    }
}
