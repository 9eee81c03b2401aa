//! Request serving: which inference requests run together in the next batch, at which
//! batch size, and which are dropped because they can no longer meet their deadlines.
//!
//! This is separate from session admission (the [`crate::Scheduler`]): a served model is
//! one session on the device, and each of its iterations is a batch of requests. A
//! [`RequestScheduler`] decides what goes into each batch. It is sans-IO like the rest of
//! the core: the driver (the daemon, the simulator, a test) tells it what happened with
//! [`RequestScheduler::handle`] and the current time, takes its decisions from
//! [`RequestScheduler::poll`], and calls it again at [`RequestScheduler::poll_timeout`]
//! (with [`RequestEvent::Tick`]) even if nothing happened. It reads no clock, so a
//! recorded event stream replays to the same decisions.
//!
//! One scheduler serves one model on one worker (a GPU): it starts a batch only while no
//! other batch of it runs. Several workers are several schedulers.
//!
//! Six schedulers implement the trait ([`RequestSchedulerKind`]): FIFO and EDF (batch the
//! oldest or most urgent requests, as many as fit), Clipper-like (adaptive batch size,
//! additive increase and multiplicative decrease), Nexus-like (batch size and duty cycle
//! planned from the mean execution time), Clockwork-like (batches planned ahead from a
//! fixed latency estimate per batch size, each with a window to start in), and ORLOJ
//! (dissertation ch. 4: priorities from the whole empirical distribution of execution
//! times, per application, with a dynamic convex hull per batch size). `docs/serving.md`
//! describes each.
//!
//! ```
//! use std::time::Duration;
//! use salus_core::serving::{AppId, Request, RequestAction, RequestEvent, RequestId,
//!                           RequestSchedulerKind, ServingConfig};
//!
//! let mut orloj = RequestSchedulerKind::Orloj.build(ServingConfig::default()).unwrap();
//! let ms = Duration::from_millis;
//! // What the profiler measured of application 7's requests, run alone.
//! for t in [9, 10, 11, 30] {
//!     orloj.handle(ms(0), RequestEvent::Profiled { app: AppId(7), execution: ms(t) }).unwrap();
//! }
//! let request = Request { id: RequestId(1), app: AppId(7), arrival: ms(0), deadline: ms(100) };
//! orloj.handle(ms(0), RequestEvent::Arrived(request)).unwrap();
//! let actions = orloj.poll();
//! let RequestAction::RunBatch(batch) = &actions[0] else { panic!("{actions:?}") };
//! assert_eq!((batch.batch_size, &batch.requests[..]), (1, &[RequestId(1)][..]));
//! orloj.handle(ms(12), RequestEvent::BatchFinished { batch: batch.id, duration: ms(12) }).unwrap();
//! ```

mod baselines;
mod clockwork;
pub mod hull;
mod orloj;
pub mod profile;
mod server;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use hull::{HullPoint, HullQueue};
pub use profile::{BatchCost, BatchLatency, LatencyBin, Profile, Profiler};

/// Identifies a request. Chosen by the driver, unique for the life of one scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// The application a request comes from. Requests of one application tend to take alike
/// times (§4.3.2); ORLOJ keeps a distribution per application.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AppId(pub u32);

/// Identifies a batch, numbered by the scheduler from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BatchId(pub u64);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch {}", self.0)
    }
}

/// An inference request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The driver's id.
    pub id: RequestId,
    /// Where it comes from.
    pub app: AppId,
    /// When it arrived (its release time).
    pub arrival: Duration,
    /// When its answer is due: arrival plus its SLO.
    pub deadline: Duration,
}

impl Request {
    /// Deadline less arrival.
    pub fn slo(&self) -> Duration {
        self.deadline.saturating_sub(self.arrival)
    }
}

/// Something that happened, told to a [`RequestScheduler`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RequestEvent {
    /// A request arrived.
    Arrived(Request),
    /// The running batch finished; `duration` is how long the worker took.
    BatchFinished {
        /// Which batch.
        batch: BatchId,
        /// Measured execution time.
        duration: Duration,
    },
    /// The profiler measured one request of `app` executed alone (finished requests are
    /// sampled and re-run off the critical path, §4.3.2).
    Profiled {
        /// Whose request.
        app: AppId,
        /// Its solo execution time.
        execution: Duration,
    },
    /// Nothing but the passing of time.
    Tick,
}

/// Why a request was dropped without running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// Its deadline passed before it could start.
    Expired,
    /// By the scheduler's estimate it can no longer finish by its deadline at any batch
    /// size.
    Hopeless,
    /// It was in a batch planned ahead that could not start within its window because
    /// the batch before ran late (Clockwork-like).
    MissedStartWindow,
}

/// A batch to run now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Its id, for [`RequestEvent::BatchFinished`].
    pub id: BatchId,
    /// The batch size to run at: one of the model's sizes, at least `requests.len()`
    /// (the rest is padding).
    pub batch_size: usize,
    /// Its requests.
    pub requests: Vec<RequestId>,
}

/// A decision of a [`RequestScheduler`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum RequestAction {
    /// Run this batch on the worker now; answer with [`RequestEvent::BatchFinished`].
    RunBatch(Batch),
    /// Answer this request with an error: it will not run.
    Drop {
        /// Which request.
        request: RequestId,
        /// Why.
        reason: DropReason,
    },
}

/// An event a scheduler cannot accept. Its state is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServingError {
    /// A pending request already has this id.
    #[error("{0} is already pending")]
    DuplicateRequest(RequestId),
    /// `BatchFinished` for a batch that is not running.
    #[error("{0} is not running")]
    UnknownBatch(BatchId),
    /// An event earlier than one already handled.
    #[error("time went backwards: {now:?} after {last:?}")]
    TimeWentBackwards {
        /// The event's time.
        now: Duration,
        /// The latest time handled.
        last: Duration,
    },
    /// The configuration cannot work.
    #[error("invalid serving configuration: {0}")]
    InvalidConfig(String),
}

/// A request scheduler: events in, batches and drops out. See the module docs.
pub trait RequestScheduler: Send {
    /// Which scheduler this is.
    fn kind(&self) -> RequestSchedulerKind;

    /// Handles one event that happened at `now` (never earlier than the last event's
    /// time) and decides what follows from it.
    fn handle(&mut self, now: Duration, event: RequestEvent) -> Result<(), ServingError>;

    /// Decisions made since the last call, in order.
    fn poll(&mut self) -> Vec<RequestAction>;

    /// When the scheduler wants [`RequestEvent::Tick`] if nothing else happens before.
    fn poll_timeout(&self) -> Option<Duration>;

    /// Requests neither started nor dropped.
    fn pending(&self) -> usize;

    /// The profiler's current snapshot.
    fn profile(&self) -> &Profile;
}

/// The request schedulers salus ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestSchedulerKind {
    /// Distribution-aware batching (dissertation ch. 4).
    Orloj,
    /// Batches planned ahead with a fixed latency estimate per batch size.
    Clockwork,
    /// Batch size and duty cycle planned from the mean execution time.
    Nexus,
    /// Adaptive batch size (AIMD), arrival order.
    Clipper,
    /// Earliest deadline first, largest batch.
    Edf,
    /// Arrival order, largest batch.
    Fifo,
}

impl RequestSchedulerKind {
    /// Every scheduler, in the order tables list them.
    pub const ALL: [RequestSchedulerKind; 6] = [
        RequestSchedulerKind::Orloj,
        RequestSchedulerKind::Clockwork,
        RequestSchedulerKind::Nexus,
        RequestSchedulerKind::Clipper,
        RequestSchedulerKind::Edf,
        RequestSchedulerKind::Fifo,
    ];

    /// The lower-case name used on command lines and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            RequestSchedulerKind::Orloj => "orloj",
            RequestSchedulerKind::Clockwork => "clockwork",
            RequestSchedulerKind::Nexus => "nexus",
            RequestSchedulerKind::Clipper => "clipper",
            RequestSchedulerKind::Edf => "edf",
            RequestSchedulerKind::Fifo => "fifo",
        }
    }

    /// A scheduler of this kind.
    pub fn build(self, config: ServingConfig) -> Result<Box<dyn RequestScheduler>, ServingError> {
        config.validate()?;
        Ok(match self {
            RequestSchedulerKind::Orloj => server::boxed(config, orloj::Orloj::new),
            RequestSchedulerKind::Clockwork => server::boxed(config, clockwork::Clockwork::new),
            RequestSchedulerKind::Nexus => server::boxed(config, baselines::Nexus::new),
            RequestSchedulerKind::Clipper => server::boxed(config, baselines::Clipper::new),
            RequestSchedulerKind::Edf => server::boxed(config, baselines::Greedy::edf),
            RequestSchedulerKind::Fifo => server::boxed(config, baselines::Greedy::fifo),
        })
    }
}

impl fmt::Display for RequestSchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RequestSchedulerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RequestSchedulerKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!(
                    "unknown request scheduler {s:?}; expected one of orloj, clockwork, nexus, clipper, edf, fifo"
                )
            })
    }
}

/// What a request scheduler knows of its model and how it is tuned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServingConfig {
    /// Batch sizes the model runs at, ascending (default 1, 2, 4, 8, 16).
    pub batch_sizes: Vec<usize>,
    /// How batch size and the slowest request make a batch's time.
    pub cost: BatchCost,
    /// Solo execution times the profiler keeps per application, and arrivals it keeps
    /// for the mix of applications.
    pub profile_window: usize,
    /// The profiler's snapshot is rebuilt after this many new samples and arrivals.
    pub profile_refresh: usize,
    /// ORLOJ's parameters.
    pub orloj: OrlojParams,
    /// The Clockwork-like scheduler's parameters.
    pub clockwork: ClockworkParams,
    /// The Clipper-like scheduler's parameters.
    pub clipper: ClipperParams,
    /// The Nexus-like scheduler's parameters.
    pub nexus: NexusParams,
}

impl Default for ServingConfig {
    fn default() -> Self {
        ServingConfig {
            batch_sizes: vec![1, 2, 4, 8, 16],
            cost: BatchCost::default(),
            profile_window: 1000,
            profile_refresh: 200,
            orloj: OrlojParams::default(),
            clockwork: ClockworkParams::default(),
            clipper: ClipperParams::default(),
            nexus: NexusParams::default(),
        }
    }
}

impl ServingConfig {
    /// Checks that the batch sizes are ascending and positive and the parameters usable.
    pub fn validate(&self) -> Result<(), ServingError> {
        let bad = |m: String| Err(ServingError::InvalidConfig(m));
        if self.batch_sizes.is_empty() || self.batch_sizes[0] == 0 {
            return bad(format!(
                "batch sizes must be positive, got {:?}",
                self.batch_sizes
            ));
        }
        if self.batch_sizes.windows(2).any(|w| w[0] >= w[1]) || self.batch_sizes.len() > 32 {
            return bad(format!(
                "batch sizes must be strictly ascending, at most 32 of them, got {:?}",
                self.batch_sizes
            ));
        }
        if !(self.cost.per_batch >= 0.0 && self.cost.per_request >= 0.0)
            || self.cost.factor(1) <= 0.0
        {
            return bad(format!(
                "batch cost factors must be non-negative with a positive total, got {:?}",
                self.cost
            ));
        }
        if !(self.orloj.b > 0.0 && self.orloj.b.is_finite()) || self.orloj.bins == 0 {
            return bad(format!(
                "ORLOJ needs b > 0 and at least one bin, got b = {} and {} bins",
                self.orloj.b, self.orloj.bins
            ));
        }
        if !(0.0..=1.0).contains(&self.orloj.feasibility_quantile) {
            return bad(format!(
                "ORLOJ's feasibility quantile must lie in [0, 1], got {}",
                self.orloj.feasibility_quantile
            ));
        }
        Ok(())
    }

    /// The largest batch size.
    pub fn max_batch(&self) -> usize {
        self.batch_sizes.last().copied().unwrap_or(1)
    }

    /// The smallest batch size that holds `n` requests (the largest when none does).
    pub fn batch_size_for(&self, n: usize) -> usize {
        self.batch_sizes
            .iter()
            .copied()
            .find(|&s| s >= n)
            .unwrap_or(self.max_batch())
    }
}

/// ORLOJ's parameters (dissertation §4.4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrlojParams {
    /// `b`, the rate of the exponentially distributed anticipated delay, per millisecond
    /// (§4.4.1; 1e-4 as in §4.4.4, which §4.5.6 shows the finish rate is insensitive to).
    pub b: f64,
    /// Bins of each batch latency histogram.
    pub bins: usize,
    /// `EstimateBatchLatency` of Algorithm 4.1 (which the dissertation leaves open): this
    /// quantile of the batch latency distribution of the request's application at that
    /// batch size. A request stays in the queue of a batch size while it would meet its
    /// deadline with this probability if run now at that size.
    pub feasibility_quantile: f64,
    /// Relative timestamps are rebased after this long (§4.4.4: with `b = 1e-4`/ms,
    /// 1,000 s keeps `e^(b·t)` far from overflow).
    pub rebase_after: Duration,
}

impl Default for OrlojParams {
    fn default() -> Self {
        OrlojParams {
            b: 1e-4,
            bins: 32,
            feasibility_quantile: 0.5,
            rebase_after: Duration::from_secs(1000),
        }
    }
}

/// The Clockwork-like scheduler's parameters: Clockwork's own defaults (its `infer5`
/// scheduler).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClockworkParams {
    /// Measured batch times kept per batch size.
    pub estimate_window: usize,
    /// The estimate is this percentile of the window (0.99 of 10: effectively the max).
    pub estimate_percentile: f64,
    /// The next batch is planned this long before the worker is expected to be free.
    pub schedule_ahead: Duration,
    /// A planned batch may start this long after its planned start, and no later.
    pub latest_delta: Duration,
}

impl Default for ClockworkParams {
    fn default() -> Self {
        ClockworkParams {
            estimate_window: 10,
            estimate_percentile: 0.99,
            schedule_ahead: Duration::from_millis(10),
            latest_delta: Duration::from_millis(10),
        }
    }
}

/// The Clipper-like scheduler's parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClipperParams {
    /// Requests added to the batch limit after a batch that met the SLO.
    pub increase: usize,
    /// Fraction the limit shrinks by after a batch that took longer than the SLO.
    pub decrease: f64,
}

impl Default for ClipperParams {
    fn default() -> Self {
        ClipperParams {
            increase: 1,
            decrease: 0.1,
        }
    }
}

/// The Nexus-like scheduler's parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NexusParams {
    /// Arrivals over this window give the request rate the plan is made for.
    pub rate_window: Duration,
}

impl Default for NexusParams {
    fn default() -> Self {
        NexusParams {
            rate_window: Duration::from_secs(1),
        }
    }
}
