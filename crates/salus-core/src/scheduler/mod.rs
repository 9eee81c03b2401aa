//! The scheduler: a deterministic state machine from events to actions.
//!
//! The driver (daemon, simulator, test) calls [`Scheduler::handle`] for each event with the
//! current time, then [`Scheduler::poll`] to get what to do. Nothing here reads a clock,
//! spawns a thread or touches a device. Every change of state, the operator's policy and
//! drain switches included, arrives as a timed [`Event`], so an event stream replays
//! exactly.
//!
//! This module holds the state and the handling of each event; the rest is split by
//! concern:
//! - `admission`: the waiting queue, Salus Algorithm 2.1 (lane finding), suspension;
//! - `dispatch`: lane placement and moves, run queues, starting iterations;
//! - `views`: read-only views and the memory map;
//! - `protect`: online sessions protected from offline ones (`crate::protection`);
//! - `invariants`: the checks tests run after every event.

mod admission;
mod dispatch;
mod invariants;
mod protect;
mod views;

use std::collections::{BTreeMap, BTreeSet};
use std::mem;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::heap::{Block, PersistentHeap};
use crate::memory::{Extent, LaneId, MemoryConfig, RejectReason, WaitReason};
use crate::policy::{PolicyKind, RunKey};
use crate::protection::{DeviceSample, ProtectionConfig};
use crate::session::{SessionClass, SessionId, SessionSpec, SessionStats, SessionView};

pub use admission::LaneChoice;
pub use views::LaneInfo;

/// Something that happened, told to the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A client opened a session. Answered by `Admit`, `Queue` or `Reject`.
    SessionOpened(SessionSpec),
    /// A client submitted one iteration of a session (waiting or admitted).
    IterationSubmitted(SessionId),
    /// The running iteration of this session was abandoned (after `Abandon`): it kept
    /// nothing and is to run again; its lane is free.
    IterationAbandoned(SessionId),
    /// The iteration started by the last `StartIteration` of this session finished.
    IterationFinished {
        /// Whose iteration.
        session: SessionId,
        /// How long it ran, as measured by the device.
        duration: Duration,
    },
    /// The client closed the session or went away. Its memory is released once no
    /// iteration of it is running (answered by `Closed`).
    SessionClosed(SessionId),
    /// The operator switched policy. Sessions already admitted keep their lanes; from
    /// this time on, admission and iteration order follow the new policy.
    PolicyChanged(PolicyKind),
    /// The operator started (`true`) or ended draining. While draining, running sessions
    /// go on but nothing new is admitted: waiting sessions are queued as `Draining`.
    DrainingChanged(bool),
    /// What the device reports about itself (a GPU's SM activity and clock), for the
    /// protection of online sessions.
    DeviceSampled(DeviceSample),
    /// The operator enabled (`true`) or disabled offline work: while disabled, offline
    /// sessions are evicted to host memory and none runs.
    OfflineEnabled(bool),
    /// Nothing but the passing of time (send one at [`Scheduler::next_wakeup`]).
    Tick,
}

/// Something the driver must do, or be told, decided by the core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// The session is admitted: its persistent tensors go at `persistent`, its iterations
    /// run in `lane`.
    Admit {
        /// Who.
        session: SessionId,
        /// Its lane.
        lane: LaneId,
        /// Where its persistent tensors live.
        persistent: Extent,
        /// The lane's size after admission.
        lane_size: u64,
        /// True when the session was suspended: restore its persistent tensors from host
        /// memory to `persistent` instead of expecting an upload.
        resumed: bool,
    },
    /// Copy the session's persistent tensors to host memory: their device memory is free
    /// from now on. The session waits in the queue and comes back with `Admit { resumed }`.
    /// Only policies that preempt memory (SRTF) suspend, and only idle sessions.
    Suspend {
        /// Who.
        session: SessionId,
        /// Where its persistent tensors were.
        persistent: Extent,
    },
    /// The session waits for admission, for this reason. Repeated when the reason changes.
    Queue {
        /// Who.
        session: SessionId,
        /// Why.
        reason: WaitReason,
    },
    /// The session can never run on this device; it is forgotten.
    Reject {
        /// Who.
        session: SessionId,
        /// Why.
        reason: RejectReason,
    },
    /// A lane takes a new place: its first placement, a move up after a lane above it was
    /// removed or shrank, or a resize. Happens only while no iteration runs in it.
    MoveLane {
        /// Which lane.
        lane: LaneId,
        /// Where it was, if it was placed.
        from: Option<Extent>,
        /// Where it is now.
        to: Extent,
    },
    /// Run one iteration of `session` with its ephemeral memory at `lane_offset`.
    StartIteration {
        /// Whose iteration.
        session: SessionId,
        /// On which lane.
        lane: LaneId,
        /// First byte of the lane: the base of the iteration's memory plan.
        lane_offset: u64,
        /// The session that ran last on this lane, when it was another one.
        switched_from: Option<SessionId>,
        /// The share of the device's compute the iteration may use, in [0, 1]: below 1
        /// for an offline iteration while an online one runs (protection's compute share;
        /// a CPU device runs it on that share of its cores, 0 holds it before its first
        /// kernel) and for an online iteration beside offline ones (unless the device
        /// has a background priority).
        compute_share: f64,
        /// Run it in the background, on the compute other iterations leave, where the
        /// device can (an offline iteration under protection).
        background: bool,
    },
    /// The running iteration of this (offline) session may now use `compute_share` of
    /// the device, from its next kernel on: online work started or ended (protection's
    /// kernel-level throttling). 0 holds it between two kernels until a later share.
    SetComputeShare {
        /// Whose iteration.
        session: SessionId,
        /// The share of the device's compute, in [0, 1].
        compute_share: f64,
    },
    /// Stop the running iteration of this offline session before its end, keeping
    /// nothing (an online session has waited past the deadline for the memory it holds);
    /// answer with `Event::IterationAbandoned`, or `IterationFinished` if it ended first.
    Abandon {
        /// Whose iteration.
        session: SessionId,
    },
    /// The session is gone and its memory is free.
    Closed {
        /// Who.
        session: SessionId,
    },
}

/// An event the core cannot accept. The state is unchanged when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// No open session has this id.
    #[error("{0} does not exist")]
    UnknownSession(SessionId),
    /// A session with this id is already open.
    #[error("{0} is already open")]
    DuplicateSession(SessionId),
    /// A session asked for something impossible.
    #[error("{session}: {message}")]
    InvalidSession {
        /// Who.
        session: SessionId,
        /// What was wrong.
        message: String,
    },
    /// `IterationFinished` for a session with no running iteration.
    #[error("{0} has no running iteration")]
    NotRunning(SessionId),
    /// An iteration was submitted to a session that is closing.
    #[error("{0} is closing")]
    Closing(SessionId),
    /// Time given to the core went backwards.
    #[error("time went backwards: {now:?} after {last:?}")]
    TimeWentBackwards {
        /// The time given.
        now: Duration,
        /// The latest time seen before.
        last: Duration,
    },
    /// The memory configuration is impossible.
    #[error("invalid memory configuration: {0}")]
    InvalidConfig(String),
}

#[derive(Debug, Clone)]
enum State {
    Waiting(Option<WaitReason>),
    Admitted {
        lane: LaneId,
        block: Block,
        running: bool,
        closing: bool,
    },
}

#[derive(Debug, Clone)]
struct Session {
    spec: SessionSpec,
    stats: SessionStats,
    virtual_service: Duration,
    state: State,
    /// Its persistent tensors wait in host memory to be restored at re-admission.
    suspended: bool,
    /// Where it sits in its lane's run queue, while it is ready.
    queued: Option<(LaneId, RunKey)>,
    /// What protection follows of its iterations.
    track: protect::Track,
}

impl Session {
    fn view(&self) -> SessionView<'_> {
        SessionView {
            spec: &self.spec,
            stats: &self.stats,
            virtual_service: self.virtual_service,
        }
    }

    fn ready(&self) -> bool {
        self.stats.pending_iterations > 0
            && matches!(
                self.state,
                State::Admitted {
                    running: false,
                    closing: false,
                    ..
                }
            )
    }

    fn active(&self) -> bool {
        self.stats.pending_iterations > 0
            || matches!(self.state, State::Admitted { running: true, .. })
    }
}

/// A lane: a contiguous stretch of ephemeral memory, time-shared by its sessions.
#[derive(Debug, Clone)]
struct Lane {
    /// The class of its sessions: under protection a lane never mixes classes.
    class: SessionClass,
    /// L: the largest E among its sessions.
    size: u64,
    /// Where the lane belongs when the stack is compact.
    target: u64,
    /// Where it physically is now; `None` until first placed, and while idle between
    /// leaving an old place and taking its target.
    placed: Option<Extent>,
    /// The place it last left, reported when it takes its target.
    vacated: Option<Extent>,
    sessions: Vec<SessionId>,
    /// Run queue: its ready sessions in the policy's order.
    ready: BTreeSet<(RunKey, SessionId)>,
    running: Option<SessionId>,
    last_session: Option<SessionId>,
    /// FAIR's clock: the service of the session that started last. Newcomers start here.
    fair_clock: Duration,
}

impl Lane {
    fn target_extent(&self) -> Extent {
        Extent {
            offset: self.target,
            size: self.size,
        }
    }

    fn in_place(&self) -> bool {
        self.placed == Some(self.target_extent())
    }
}

/// The sans-IO memory manager and iteration scheduler of one device.
#[derive(Debug, Clone)]
pub struct Scheduler {
    memory: MemoryConfig,
    policy: PolicyKind,
    now: Duration,
    draining: bool,
    heap: PersistentHeap,
    sessions: BTreeMap<SessionId, Session>,
    /// Waiting sessions in arrival order.
    queue: Vec<SessionId>,
    lanes: BTreeMap<LaneId, Lane>,
    /// Where lanes are placed: offset -> (end, lane). Placed ranges never overlap.
    placed: BTreeMap<u64, (u64, LaneId)>,
    /// Lanes by (size, id), for Algorithm 2.1's best fit and smallest growth.
    lanes_by_size: BTreeSet<(u64, LaneId)>,
    /// Lanes top (highest offset) first.
    stack: Vec<LaneId>,
    next_lane: u64,
    persistent_total: u64,
    lane_total: u64,
    admission_due: bool,
    /// Lanes to try moving to their targets at the next poll.
    move_candidates: BTreeSet<LaneId>,
    /// Idle lanes that gave up their old place and wait for their target to be free, by
    /// target offset. Rebuilt whenever targets change.
    unplaced: BTreeMap<u64, LaneId>,
    lanes_due: BTreeSet<LaneId>,
    /// Lanes of offline sessions (each class has the policy's lane limit).
    offline_lanes: usize,
    protect: protect::Protect,
    actions: Vec<Action>,
}

impl Scheduler {
    /// A scheduler for a device with `memory`, starting under `policy`, protecting online
    /// sessions with the default [`ProtectionConfig`].
    pub fn new(memory: MemoryConfig, policy: PolicyKind) -> Result<Self, CoreError> {
        Self::with_protection(memory, policy, ProtectionConfig::default())
    }

    /// A scheduler that protects online sessions from offline ones as `protection` says.
    pub fn with_protection(
        memory: MemoryConfig,
        policy: PolicyKind,
        protection: ProtectionConfig,
    ) -> Result<Self, CoreError> {
        memory.validate().map_err(CoreError::InvalidConfig)?;
        protection.validate().map_err(CoreError::InvalidConfig)?;
        Ok(Scheduler {
            memory,
            policy,
            now: Duration::ZERO,
            draining: false,
            heap: PersistentHeap::default(),
            sessions: BTreeMap::new(),
            queue: Vec::new(),
            lanes: BTreeMap::new(),
            placed: BTreeMap::new(),
            lanes_by_size: BTreeSet::new(),
            stack: Vec::new(),
            next_lane: 0,
            persistent_total: 0,
            lane_total: 0,
            admission_due: false,
            move_candidates: BTreeSet::new(),
            unplaced: BTreeMap::new(),
            lanes_due: BTreeSet::new(),
            offline_lanes: 0,
            protect: protect::Protect::new(protection),
            actions: Vec::new(),
        })
    }

    /// The memory configuration.
    pub fn memory_config(&self) -> MemoryConfig {
        self.memory
    }

    /// The policy in force (see [`Event::PolicyChanged`]).
    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// True while draining (see [`Event::DrainingChanged`]).
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// The latest time the core has been given.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Feeds one event. On error nothing changes.
    pub fn handle(&mut self, now: Duration, event: Event) -> Result<(), CoreError> {
        if now < self.now {
            return Err(CoreError::TimeWentBackwards {
                now,
                last: self.now,
            });
        }
        self.now = now;
        self.start_protection();
        match event {
            Event::SessionOpened(spec) => self.open(spec),
            Event::IterationSubmitted(id) => self.submit(id),
            Event::IterationFinished { session, duration } => {
                self.end_iteration(session, Some(duration))
            }
            Event::IterationAbandoned(session) => self.end_iteration(session, None),
            Event::SessionClosed(id) => self.close(id),
            Event::PolicyChanged(policy) => {
                self.change_policy(policy);
                Ok(())
            }
            Event::DrainingChanged(draining) => {
                self.draining = draining;
                self.admission_due = true;
                Ok(())
            }
            Event::DeviceSampled(sample) => {
                self.on_device_sample(sample);
                Ok(())
            }
            Event::OfflineEnabled(enabled) => {
                self.set_offline_enabled(enabled);
                Ok(())
            }
            Event::Tick => {
                self.evaluate_health();
                Ok(())
            }
        }
    }

    /// Makes every decision the events so far allow and returns the actions, in order.
    pub fn poll(&mut self) -> Vec<Action> {
        self.move_lanes();
        if self.admission_due {
            self.admission_due = false;
            self.evict_offline();
            self.admit_waiting();
            self.move_lanes();
        }
        self.abandon_if_overdue();
        self.release_held();
        self.start_iterations();
        mem::take(&mut self.actions)
    }

    fn open(&mut self, spec: SessionSpec) -> Result<(), CoreError> {
        let id = spec.id;
        if self.sessions.contains_key(&id) {
            return Err(CoreError::DuplicateSession(id));
        }
        if spec.ephemeral_bytes == 0 {
            return Err(CoreError::InvalidSession {
                session: id,
                message: "ephemeral_bytes must be at least 1: every iteration needs lane memory"
                    .into(),
            });
        }
        let persistent = self.memory.align_up(spec.persistent_bytes);
        let ephemeral = self.memory.align_up(spec.ephemeral_bytes);
        let offline_limit = (self.protecting() && spec.class == SessionClass::Offline)
            .then(|| self.offline_limit());
        let over_share = offline_limit.is_some_and(|limit| {
            persistent
                .zip(ephemeral)
                .is_none_or(|(p, e)| p.saturating_add(e) > limit)
        });
        if over_share
            || !self
                .memory
                .fits_empty(spec.persistent_bytes, spec.ephemeral_bytes)
        {
            self.actions.push(Action::Reject {
                session: id,
                reason: RejectReason {
                    persistent_bytes: persistent.unwrap_or(u64::MAX),
                    ephemeral_bytes: ephemeral.unwrap_or(u64::MAX),
                    capacity: self.memory.capacity,
                    reserve: self.memory.reserve,
                    offline_limit: offline_limit.filter(|_| over_share),
                },
            });
            return Ok(());
        }
        let spec = SessionSpec {
            persistent_bytes: persistent.unwrap_or_default(),
            ephemeral_bytes: ephemeral.unwrap_or_default(),
            ..spec
        };
        self.sessions.insert(
            id,
            Session {
                spec,
                stats: SessionStats::new(self.now),
                virtual_service: Duration::ZERO,
                state: State::Waiting(None),
                suspended: false,
                queued: None,
                track: protect::Track::default(),
            },
        );
        self.queue.push(id);
        self.admission_due = true;
        Ok(())
    }

    fn submit(&mut self, id: SessionId) -> Result<(), CoreError> {
        let session = self
            .sessions
            .get(&id)
            .ok_or(CoreError::UnknownSession(id))?;
        let lane = match session.state {
            State::Admitted { closing: true, .. } => return Err(CoreError::Closing(id)),
            State::Admitted { lane, .. } => Some(lane),
            State::Waiting(_) => None,
        };
        if let (Some(lane), false) = (lane, session.active()) {
            // A session coming back from idle joins the lane's fair-share clock where the
            // others are, so time spent idle is not banked as credit.
            let clock = self
                .lanes
                .get(&lane)
                .map_or(Duration::ZERO, |l| l.fair_clock);
            let session = self
                .sessions
                .get_mut(&id)
                .ok_or(CoreError::UnknownSession(id))?;
            session.virtual_service = session.virtual_service.max(clock);
        }
        let session = self
            .sessions
            .get_mut(&id)
            .ok_or(CoreError::UnknownSession(id))?;
        session.stats.pending_iterations += 1;
        self.protect.submitted(session, self.now);
        self.sync_run_queue(id);
        Ok(())
    }

    /// Ends the running iteration of `id`: `Some(duration)` when it finished (it counts as
    /// service), `None` when it was abandoned (it is pending again). Its lane is free.
    fn end_iteration(
        &mut self,
        id: SessionId,
        finished: Option<Duration>,
    ) -> Result<(), CoreError> {
        let session = self
            .sessions
            .get_mut(&id)
            .ok_or(CoreError::UnknownSession(id))?;
        let State::Admitted {
            lane,
            running: running @ true,
            closing,
            ..
        } = &mut session.state
        else {
            return Err(CoreError::NotRunning(id));
        };
        *running = false;
        let (lane_id, closing) = (*lane, *closing);
        let ended = match finished {
            Some(duration) => {
                session.stats.completed_iterations += 1;
                session.stats.attained_service += duration;
                session.virtual_service += duration;
                Some(self.protect.finished(session, id, duration, self.now))
            }
            None if !closing => {
                session.stats.pending_iterations += 1;
                None
            }
            None => None,
        };
        if let Some(lane) = self.lanes.get_mut(&lane_id) {
            lane.running = None;
            if !lane.in_place() {
                self.move_candidates.insert(lane_id);
            }
        }
        self.lanes_due.insert(lane_id);
        if self.policy.policy().suspends() && !self.queue.is_empty() {
            // An iteration boundary makes this session suspendable for a waiting one.
            self.admission_due = true;
        }
        match ended {
            Some(ended) => {
                self.admission_due |= ended.admission_due;
                if ended.evaluate_health {
                    self.evaluate_health();
                }
            }
            None => self.on_abandoned(id),
        }
        self.sync_offline_share();
        if closing {
            self.release(id);
        } else {
            self.sync_run_queue(id);
        }
        Ok(())
    }

    fn close(&mut self, id: SessionId) -> Result<(), CoreError> {
        let session = self
            .sessions
            .get_mut(&id)
            .ok_or(CoreError::UnknownSession(id))?;
        session.stats.pending_iterations = 0;
        self.forget_track(id);
        self.sync_offline_share();
        let session = self
            .sessions
            .get_mut(&id)
            .ok_or(CoreError::UnknownSession(id))?;
        match &mut session.state {
            State::Waiting(_) => {
                self.sessions.remove(&id);
                self.queue.retain(|&q| q != id);
                self.admission_due = true;
                self.actions.push(Action::Closed { session: id });
            }
            State::Admitted {
                running: true,
                closing,
                ..
            } => {
                *closing = true;
                self.sync_run_queue(id);
            }
            State::Admitted { .. } => self.release(id),
        }
        Ok(())
    }

    /// Sessions already admitted keep their lanes; every run queue is re-keyed under the
    /// new policy and the waiting queue is looked at again.
    fn change_policy(&mut self, policy: PolicyKind) {
        self.policy = policy;
        self.admission_due = true;
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        for id in ids {
            self.sync_run_queue(id);
        }
    }

    /// Closes an admitted session: frees its memory and forgets it.
    fn release(&mut self, id: SessionId) {
        if self.free_memory(id).is_some() {
            self.sessions.remove(&id);
            self.actions.push(Action::Closed { session: id });
        }
    }
}
