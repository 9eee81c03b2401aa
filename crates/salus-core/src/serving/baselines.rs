//! The simple request schedulers: FIFO and EDF (largest batch, arrival or deadline order),
//! Clipper-like (adaptive batch size) and Nexus-like (batch size and duty cycle planned
//! from the mean execution time). None of them looks at the spread of execution times,
//! which is ORLOJ's point; they are what it is measured against.
//!
//! Every one of them drops a request whose deadline has passed before it could start
//! ([`DropReason::Expired`]): running it cannot help anyone.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::profile::{duration, ms};
use super::server::{Decision, Policy, View, Worker};
use super::{
    Batch, ClipperParams, DropReason, NexusParams, Request, RequestId, RequestSchedulerKind,
    ServingConfig,
};

/// FIFO and EDF: whenever the worker is free, the first requests in arrival (FIFO) or
/// deadline (EDF) order, as many as the largest batch size holds, at the smallest batch
/// size that holds them.
pub(crate) struct Greedy {
    kind: RequestSchedulerKind,
    /// Ordered by (deadline for EDF, zero for FIFO; then arrival sequence).
    queue: BTreeMap<(Duration, u64), Request>,
    seq: u64,
}

impl Greedy {
    pub fn fifo(_config: &ServingConfig) -> Self {
        Greedy {
            kind: RequestSchedulerKind::Fifo,
            queue: BTreeMap::new(),
            seq: 0,
        }
    }

    pub fn edf(_config: &ServingConfig) -> Self {
        Greedy {
            kind: RequestSchedulerKind::Edf,
            ..Greedy::fifo(_config)
        }
    }
}

impl Policy for Greedy {
    fn kind(&self) -> RequestSchedulerKind {
        self.kind
    }

    fn arrived(&mut self, _now: Duration, request: &Request, _view: &View<'_>) {
        let order = match self.kind {
            RequestSchedulerKind::Edf => request.deadline,
            _ => Duration::ZERO,
        };
        self.queue.insert((order, self.seq), *request);
        self.seq += 1;
    }

    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision) {
        if worker != Worker::Idle {
            return;
        }
        let mut batch = Vec::new();
        while batch.len() < view.config.max_batch() {
            let Some((_, request)) = self.queue.pop_first() else {
                break;
            };
            if request.deadline <= now {
                out.drops.push((request.id, DropReason::Expired));
            } else {
                batch.push(request.id);
            }
        }
        if !batch.is_empty() {
            out.batch = Some((view.config.batch_size_for(batch.len()), batch));
        }
    }
}

/// Clipper-like: arrival order; the number of requests per batch adapts by additive
/// increase and multiplicative decrease (Clipper's adaptive batching): one more after a
/// batch that took no longer than its requests' SLO, 10% fewer after one that took
/// longer. It plans nothing ahead and drops only requests already past their deadline.
pub(crate) struct Clipper {
    params: ClipperParams,
    queue: VecDeque<Request>,
    /// Requests per batch at most.
    limit: usize,
    /// The smallest SLO in the running batch.
    running_slo: Option<Duration>,
}

impl Clipper {
    pub fn new(config: &ServingConfig) -> Self {
        Clipper {
            params: config.clipper.clone(),
            queue: VecDeque::new(),
            limit: 1,
            running_slo: None,
        }
    }
}

impl Policy for Clipper {
    fn kind(&self) -> RequestSchedulerKind {
        RequestSchedulerKind::Clipper
    }

    fn arrived(&mut self, _now: Duration, request: &Request, _view: &View<'_>) {
        self.queue.push_back(*request);
    }

    fn finished(&mut self, _now: Duration, _batch: &Batch, took: Duration, view: &View<'_>) {
        let Some(slo) = self.running_slo.take() else {
            return;
        };
        self.limit = if took > slo {
            ((self.limit as f64 * (1.0 - self.params.decrease)).floor() as usize).max(1)
        } else {
            (self.limit + self.params.increase).min(view.config.max_batch())
        };
    }

    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision) {
        if worker != Worker::Idle {
            return;
        }
        let mut batch = Vec::new();
        let mut slo: Option<Duration> = None;
        while batch.len() < self.limit {
            let Some(request) = self.queue.pop_front() else {
                break;
            };
            if request.deadline <= now {
                out.drops.push((request.id, DropReason::Expired));
            } else {
                slo = Some(slo.map_or(request.slo(), |s| s.min(request.slo())));
                batch.push(request.id);
            }
        }
        if !batch.is_empty() {
            self.running_slo = slo;
            out.batch = Some((view.config.batch_size_for(batch.len()), batch));
        }
    }
}

/// Nexus-like: a plan from the profile's *mean* solo time `m`, taking `ℓ(b)` =
/// the cost model at `m` as the latency of a batch of `b`. With the recent request rate
/// `λ` and SLO, the batch size is the largest `b` whose batch fits twice in the SLO
/// counting the time to gather it, `ℓ(b) + max(ℓ(b), b/λ) <= SLO` (Nexus's squishy bin
/// packing for one model on one GPU: a request may wait a whole duty cycle and then run
/// a whole batch), and batches start every duty cycle `max(ℓ(b), b/λ)`, or earlier once
/// `b` requests wait. Requests go in deadline order; at dispatch those that would miss
/// their deadline by `ℓ(b)` are dropped (Nexus's early drop). The mean says nothing of
/// the slowest request in a batch, which sets the batch's real time.
pub(crate) struct Nexus {
    params: NexusParams,
    queue: BTreeSet<(Duration, RequestId)>,
    /// Recent arrivals and their SLOs.
    arrivals: VecDeque<(Duration, Duration)>,
    next_cycle: Duration,
    /// Set while requests wait for the next duty cycle.
    wake: Option<Duration>,
}

impl Nexus {
    pub fn new(config: &ServingConfig) -> Self {
        Nexus {
            params: config.nexus.clone(),
            queue: BTreeSet::new(),
            arrivals: VecDeque::new(),
            next_cycle: Duration::ZERO,
            wake: None,
        }
    }

    /// Keeps the arrivals of the last `rate_window` only.
    fn forget_arrivals_before(&mut self, now: Duration) {
        while let Some(&(at, _)) = self.arrivals.front() {
            if at + self.params.rate_window >= now {
                break;
            }
            self.arrivals.pop_front();
        }
    }

    /// The batch size, the duty cycle and the batch latency it plans with.
    fn plan(&self, view: &View<'_>) -> (usize, Duration, Duration) {
        let mean = view.profile.mean_ms();
        let latency = |b: usize| view.config.cost.batch_ms(b, mean);
        let window = ms(self.params.rate_window).max(1e-9);
        let per_ms = self.arrivals.len() as f64 / window;
        let gather = |b: usize| {
            if per_ms > 0.0 { b as f64 / per_ms } else { 0.0 }
        };
        let slo = self
            .arrivals
            .iter()
            .map(|&(_, slo)| ms(slo))
            .fold(f64::INFINITY, f64::min);
        let sizes = &view.config.batch_sizes;
        let b = sizes
            .iter()
            .rev()
            .copied()
            .find(|&b| latency(b) + latency(b).max(gather(b)) <= slo)
            .unwrap_or(sizes[0]);
        (b, duration(latency(b).max(gather(b))), duration(latency(b)))
    }
}

impl Policy for Nexus {
    fn kind(&self) -> RequestSchedulerKind {
        RequestSchedulerKind::Nexus
    }

    fn arrived(&mut self, now: Duration, request: &Request, _view: &View<'_>) {
        self.queue.insert((request.deadline, request.id));
        self.arrivals.push_back((now, request.slo()));
        self.forget_arrivals_before(now);
    }

    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision) {
        self.wake = None;
        if worker != Worker::Idle || self.queue.is_empty() {
            return;
        }
        self.forget_arrivals_before(now);
        let (size, cycle, latency) = self.plan(view);
        if self.queue.len() < size && now < self.next_cycle {
            self.wake = Some(self.next_cycle);
            return;
        }
        let mut batch = Vec::new();
        while batch.len() < size {
            let Some((deadline, id)) = self.queue.pop_first() else {
                break;
            };
            if deadline <= now {
                out.drops.push((id, DropReason::Expired));
            } else if now + latency > deadline {
                out.drops.push((id, DropReason::Hopeless));
            } else {
                batch.push(id);
            }
        }
        if !batch.is_empty() {
            self.next_cycle = now + cycle;
            out.batch = Some((view.config.batch_size_for(batch.len()), batch));
        }
    }

    fn wake_at(&self) -> Option<Duration> {
        self.wake
    }
}
