//! What every request scheduler shares: checking events, the pending requests, the
//! worker, the profiler, turning decisions into actions. A [`Policy`] only decides which
//! requests form the next batch and which to drop; it cannot start a batch while another
//! runs, run a request twice or drop one that is not pending. Whatever the policy, a
//! request still pending past its deadline is dropped ([`DropReason::Expired`]), and the
//! scheduler asks to be woken just after the earliest pending deadline: no request waits
//! for an event that may never come.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use super::{
    Batch, BatchId, DropReason, Profile, Profiler, Request, RequestAction, RequestEvent, RequestId,
    RequestScheduler, RequestSchedulerKind, ServingConfig, ServingError,
};

/// What a policy may read beside its own state.
pub(crate) struct View<'a> {
    pub config: &'a ServingConfig,
    pub profile: &'a Profile,
}

/// The worker as a policy sees it when deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Worker {
    /// No batch runs: a batch decided now starts now.
    Idle,
    /// A batch of `batch_size` runs since `started`.
    Busy {
        started: Duration,
        batch_size: usize,
    },
}

/// What a policy decided.
#[derive(Debug, Default)]
pub(crate) struct Decision {
    /// The next batch, honoured only while the worker is idle: its size and requests.
    pub batch: Option<(usize, Vec<RequestId>)>,
    /// Requests to drop.
    pub drops: Vec<(RequestId, DropReason)>,
}

/// A scheduling policy: the part that differs between request schedulers.
pub(crate) trait Policy: Send {
    /// Which scheduler this is.
    fn kind(&self) -> RequestSchedulerKind;

    /// A request arrived (it is pending from now on).
    fn arrived(&mut self, now: Duration, request: &Request, view: &View<'_>);

    /// The running batch finished after `duration`.
    fn finished(&mut self, _now: Duration, _batch: &Batch, _duration: Duration, _view: &View<'_>) {}

    /// Decides after every event. Requests it returns in a batch or drops must be ones it
    /// was told arrived and has not returned since.
    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision);

    /// When it wants to decide again if nothing happens.
    fn wake_at(&self) -> Option<Duration> {
        None
    }
}

struct Server<P> {
    config: ServingConfig,
    policy: P,
    profiler: Profiler,
    pending: HashMap<RequestId, Request>,
    /// The pending requests by deadline: a tick follows the earliest, so that no request
    /// waits past its deadline for an event that may never come.
    deadlines: BTreeSet<(Duration, RequestId)>,
    running: Option<(Batch, Duration)>,
    next_batch: u64,
    actions: Vec<RequestAction>,
    last: Duration,
}

/// A request scheduler running `make`'s policy.
pub(crate) fn boxed<P: Policy + 'static>(
    config: ServingConfig,
    make: fn(&ServingConfig) -> P,
) -> Box<dyn RequestScheduler> {
    let policy = make(&config);
    Box::new(Server {
        profiler: Profiler::new(config.profile_window, config.profile_refresh),
        config,
        policy,
        pending: HashMap::new(),
        deadlines: BTreeSet::new(),
        running: None,
        next_batch: 0,
        actions: Vec::new(),
        last: Duration::ZERO,
    })
}

/// How long after a pending request's deadline the scheduler is woken to drop it, if its
/// policy has not decided on it by then.
const PAST_DEADLINE: Duration = Duration::from_micros(1);

impl<P: Policy> Server<P> {
    /// Removes a pending request; false when it was not pending.
    fn take(&mut self, id: RequestId) -> bool {
        match self.pending.remove(&id) {
            Some(request) => {
                self.deadlines.remove(&(request.deadline, id));
                true
            }
            None => false,
        }
    }

    fn decide(&mut self, now: Duration) {
        self.decide_policy(now);
        // A request past its deadline can no longer finish on time: dropped here whatever
        // the policy's queues make of it (a policy that looks only at their fronts could
        // otherwise hold it, and the tick after its deadline would be the last event).
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline >= now {
                break;
            }
            self.take(id);
            self.actions.push(RequestAction::Drop {
                request: id,
                reason: DropReason::Expired,
            });
        }
    }

    fn decide_policy(&mut self, now: Duration) {
        let worker = match &self.running {
            None => Worker::Idle,
            Some((batch, started)) => Worker::Busy {
                started: *started,
                batch_size: batch.batch_size,
            },
        };
        let view = View {
            config: &self.config,
            profile: self.profiler.profile(),
        };
        let mut decision = Decision::default();
        self.policy.decide(now, worker, &view, &mut decision);
        for (request, reason) in decision.drops {
            // Not pending: this server dropped it past its deadline already.
            if self.take(request) {
                self.actions.push(RequestAction::Drop { request, reason });
            }
        }
        let Some((batch_size, mut requests)) = decision.batch else {
            return;
        };
        debug_assert!(worker == Worker::Idle, "a batch decided while one runs");
        debug_assert!(
            !requests.is_empty()
                && requests.len() <= batch_size
                && self.config.batch_sizes.contains(&batch_size),
            "batch of {} at size {batch_size}",
            requests.len()
        );
        if self.running.is_some() {
            return;
        }
        requests.retain(|&request| self.take(request));
        if requests.is_empty() {
            return;
        }
        let batch = Batch {
            id: BatchId(self.next_batch),
            batch_size,
            requests,
        };
        self.next_batch += 1;
        self.actions.push(RequestAction::RunBatch(batch.clone()));
        self.running = Some((batch, now));
    }
}

impl<P: Policy> RequestScheduler for Server<P> {
    fn kind(&self) -> RequestSchedulerKind {
        self.policy.kind()
    }

    fn handle(&mut self, now: Duration, event: RequestEvent) -> Result<(), ServingError> {
        if now < self.last {
            return Err(ServingError::TimeWentBackwards {
                now,
                last: self.last,
            });
        }
        match event {
            RequestEvent::Arrived(request) => {
                let running = self
                    .running
                    .as_ref()
                    .is_some_and(|(b, _)| b.requests.contains(&request.id));
                if running || self.pending.contains_key(&request.id) {
                    return Err(ServingError::DuplicateRequest(request.id));
                }
                self.pending.insert(request.id, request);
                self.deadlines.insert((request.deadline, request.id));
                self.profiler.arrival(request.app);
                let view = View {
                    config: &self.config,
                    profile: self.profiler.profile(),
                };
                self.policy.arrived(now, &request, &view);
            }
            RequestEvent::BatchFinished { batch, duration } => {
                let Some((running, _)) = self.running.take_if(|(b, _)| b.id == batch) else {
                    return Err(ServingError::UnknownBatch(batch));
                };
                let view = View {
                    config: &self.config,
                    profile: self.profiler.profile(),
                };
                self.policy.finished(now, &running, duration, &view);
            }
            RequestEvent::Profiled { app, execution } => self.profiler.record(app, execution),
            RequestEvent::Tick => {}
        }
        self.last = now;
        self.decide(now);
        Ok(())
    }

    fn poll(&mut self) -> Vec<RequestAction> {
        std::mem::take(&mut self.actions)
    }

    fn poll_timeout(&self) -> Option<Duration> {
        // Only the future: a driver that ticks at a time already handled would loop.
        let deadline = self
            .deadlines
            .first()
            .map(|&(d, _)| d + PAST_DEADLINE)
            .filter(|&t| t > self.last);
        let wake = self.policy.wake_at().filter(|&t| t > self.last);
        wake.into_iter().chain(deadline).min()
    }

    fn pending(&self) -> usize {
        self.pending.len()
    }

    fn profile(&self) -> &Profile {
        self.profiler.profile()
    }
}
