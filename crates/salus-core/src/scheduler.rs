//! The scheduler: a deterministic state machine from events to actions.
//!
//! The driver (daemon, simulator, test) calls [`Scheduler::handle`] for each event with the
//! current time, then [`Scheduler::poll`] to get what to do. Nothing here reads a clock,
//! spawns a thread or touches a device.

use std::collections::{BTreeMap, BTreeSet};
use std::mem;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::heap::{Block, PersistentHeap, Placement};
use crate::memory::{
    Extent, LaneId, MemoryConfig, MemoryMap, Region, RegionKind, RejectReason, WaitReason,
};
use crate::policy::{PolicyKind, RunKey};
use crate::session::{SessionId, SessionSpec, SessionStats, SessionView};

/// Something that happened, told to the core.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A client opened a session. Answered by `Admit`, `Queue` or `Reject`.
    SessionOpened(SessionSpec),
    /// A client submitted one iteration of a session (waiting or admitted).
    IterationSubmitted(SessionId),
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
    /// Nothing but the passing of time.
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

/// Read-only summary of one lane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneInfo {
    /// Which lane.
    pub id: LaneId,
    /// L, in bytes.
    pub size: u64,
    /// Where it is now, if placed.
    pub placed: Option<Extent>,
    /// Where it will be once it has moved (equals `placed` when in place).
    pub target: Extent,
    /// Sessions assigned to it.
    pub sessions: Vec<SessionId>,
    /// The session whose iteration runs in it now.
    pub running: Option<SessionId>,
}

/// Where a session would go, per Salus Algorithm 2.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "plan", content = "lane", rename_all = "snake_case")]
pub enum LaneChoice {
    /// A new lane of size E at the bottom of the lane stack.
    Open,
    /// An existing lane with L >= E (the best fit).
    Join(LaneId),
    /// An existing lane, grown to E.
    Grow(LaneId),
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
    actions: Vec<Action>,
}

impl Scheduler {
    /// A scheduler for a device with `memory`, starting under `policy`.
    pub fn new(memory: MemoryConfig, policy: PolicyKind) -> Result<Self, CoreError> {
        memory.validate().map_err(CoreError::InvalidConfig)?;
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
            actions: Vec::new(),
        })
    }

    /// The memory configuration.
    pub fn memory_config(&self) -> MemoryConfig {
        self.memory
    }

    /// The policy in force.
    pub fn policy(&self) -> PolicyKind {
        self.policy
    }

    /// Switches policy. Sessions already admitted keep their lanes; from the next decision
    /// on, admission and iteration order follow the new policy.
    pub fn set_policy(&mut self, policy: PolicyKind) {
        self.policy = policy;
        self.admission_due = true;
        let ids: Vec<SessionId> = self.sessions.keys().copied().collect();
        for id in ids {
            self.sync_run_queue(id);
        }
    }

    /// While draining, running sessions go on but nothing new is admitted.
    pub fn set_draining(&mut self, draining: bool) {
        self.draining = draining;
        self.admission_due = true;
    }

    /// True while draining.
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
        match event {
            Event::SessionOpened(spec) => self.open(spec),
            Event::IterationSubmitted(id) => self.submit(id),
            Event::IterationFinished { session, duration } => self.finish(session, duration),
            Event::SessionClosed(id) => self.close(id),
            Event::Tick => Ok(()),
        }
    }

    /// Makes every decision the events so far allow and returns the actions, in order.
    pub fn poll(&mut self) -> Vec<Action> {
        self.move_lanes();
        if self.admission_due {
            self.admission_due = false;
            self.admit_waiting();
            self.move_lanes();
        }
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
        if !self
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
        self.sync_run_queue(id);
        Ok(())
    }

    fn finish(&mut self, id: SessionId, duration: Duration) -> Result<(), CoreError> {
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
        session.stats.completed_iterations += 1;
        session.stats.attained_service += duration;
        session.virtual_service += duration;
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

    /// Closes an admitted session: frees its memory and forgets it.
    fn release(&mut self, id: SessionId) {
        if self.free_memory(id).is_some() {
            self.sessions.remove(&id);
            self.actions.push(Action::Closed { session: id });
        }
    }

    /// Moves an idle admitted session out of device memory and back to the queue, where
    /// it waits for re-admission like any other session.
    fn suspend(&mut self, id: SessionId) {
        let Some(block) = self.free_memory(id) else {
            return;
        };
        if let Some(session) = self.sessions.get_mut(&id) {
            session.state = State::Waiting(None);
            session.suspended = true;
            session.stats.suspensions += 1;
        }
        self.queue.push(id);
        self.actions.push(Action::Suspend {
            session: id,
            persistent: Extent {
                offset: block.offset,
                size: block.size,
            },
        });
    }

    /// Frees an admitted session's persistent block and its share of its lane; the lane
    /// shrinks to its remaining sessions' largest E, or goes when it has none. Returns the
    /// freed block, or `None` when the session is not admitted.
    fn free_memory(&mut self, id: SessionId) -> Option<Block> {
        let State::Admitted {
            lane: lane_id,
            block,
            ..
        } = self.sessions.get(&id)?.state
        else {
            return None;
        };
        self.unqueue(id);
        self.heap.free(block);
        self.persistent_total -= block.size;
        if let Some(lane) = self.lanes.get_mut(&lane_id) {
            lane.sessions.retain(|&s| s != id);
            let size = lane
                .sessions
                .iter()
                .filter_map(|s| self.sessions.get(s))
                .map(|s| s.spec.ephemeral_bytes)
                .max()
                .unwrap_or(0);
            self.lanes_by_size.remove(&(lane.size, lane_id));
            if size < lane.size {
                self.lane_total -= lane.size - size;
                lane.size = size;
            }
            if lane.sessions.is_empty() {
                if let Some(placed) = lane.placed {
                    self.placed.remove(&placed.offset);
                }
                self.lanes.remove(&lane_id);
                self.stack.retain(|&l| l != lane_id);
            } else {
                self.lanes_by_size.insert((lane.size, lane_id));
            }
            self.restack();
        }
        self.admission_due = true;
        Some(block)
    }

    /// For a policy that suspends: makes room for `head` by suspending idle admitted
    /// sessions that come after it in the policy's run order, latest first, and only if
    /// that makes `head` fit. True when `head` was admitted.
    fn admit_by_suspending(&mut self, head: SessionId, max_lanes: usize) -> bool {
        let policy = self.policy.policy();
        let Some(head_session) = self.sessions.get(&head) else {
            return false;
        };
        let head_key = (policy.run_key(&head_session.view()), head);
        let mut behind: Vec<((RunKey, SessionId), SessionId)> = self
            .sessions
            .values()
            .filter(|s| {
                matches!(
                    s.state,
                    State::Admitted {
                        running: false,
                        closing: false,
                        ..
                    }
                )
            })
            .map(|s| ((policy.run_key(&s.view()), s.spec.id), s.spec.id))
            .filter(|(key, _)| *key > head_key)
            .collect();
        if behind.is_empty() {
            return false;
        }
        behind.sort_by_key(|&(key, _)| std::cmp::Reverse(key));
        let victims: Vec<SessionId> = behind.into_iter().map(|(_, id)| id).collect();
        if !self.fits_without(head, &victims) {
            return false;
        }
        // Suspend one at a time on a copy, so nothing changes unless the head gets in.
        let mut trial = self.clone();
        for victim in victims {
            trial.suspend(victim);
            if trial.try_admit(head, max_lanes) {
                *self = trial;
                return true;
            }
        }
        false
    }

    /// Whether `head` could keep the safety condition if every one of `victims` left:
    /// a cheap bound that spares copying the scheduler when even that would not do.
    fn fits_without(&self, head: SessionId, victims: &[SessionId]) -> bool {
        let Some(head) = self.sessions.get(&head) else {
            return false;
        };
        let (p, e) = (head.spec.persistent_bytes, head.spec.ephemeral_bytes);
        let leaving: BTreeSet<SessionId> = victims.iter().copied().collect();
        let mut persistent = self.persistent_total;
        let mut lane_total = 0;
        let mut largest = 0;
        for lane in self.lanes.values() {
            let size = lane
                .sessions
                .iter()
                .filter(|s| !leaving.contains(s))
                .filter_map(|s| self.sessions.get(s))
                .map(|s| s.spec.ephemeral_bytes)
                .max()
                .unwrap_or(0);
            lane_total += size;
            largest = largest.max(size);
        }
        for victim in victims {
            if let Some(State::Admitted { block, .. }) = self.sessions.get(victim).map(|s| &s.state)
            {
                persistent -= block.size;
            }
        }
        // The cheapest lane for the head: join one that is large enough, or grow the
        // largest (a new lane never costs less).
        persistent + p + lane_total + e.saturating_sub(largest) <= self.memory.usable()
    }

    /// Recomputes every lane's target: stacked down from C in stack order.
    fn restack(&mut self) {
        self.unplaced.clear();
        let mut offset = self.memory.capacity;
        for id in &self.stack {
            if let Some(lane) = self.lanes.get_mut(id) {
                offset -= lane.size;
                lane.target = offset;
                if !lane.in_place() && lane.running.is_none() {
                    self.move_candidates.insert(*id);
                }
            }
        }
    }

    /// Puts a session in its lane's run queue, under its current key, exactly when it is
    /// ready; takes it out otherwise. Call after anything that changes readiness or key.
    fn sync_run_queue(&mut self, id: SessionId) {
        self.unqueue(id);
        let policy = self.policy.policy();
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let State::Admitted { lane, .. } = session.state else {
            return;
        };
        if !session.ready() {
            return;
        }
        let key = policy.run_key(&session.view());
        session.queued = Some((lane, key));
        if let Some(lane) = self.lanes.get_mut(&lane) {
            lane.ready.insert((key, id));
        }
        self.lanes_due.insert(lane);
    }

    fn unqueue(&mut self, id: SessionId) {
        if let Some((lane, key)) = self.sessions.get_mut(&id).and_then(|s| s.queued.take())
            && let Some(lane) = self.lanes.get_mut(&lane)
        {
            lane.ready.remove(&(key, id));
        }
    }

    /// Lowest offset any lane occupies now or is headed to: the persistent heap must stay
    /// below it.
    fn lanes_floor(&self, lane_total: u64) -> u64 {
        let lowest_placed = self.placed.keys().next().copied();
        let lowest_target = self.memory.capacity - lane_total;
        lowest_placed.map_or(lowest_target, |p| p.min(lowest_target))
    }

    /// True when a placed lane shares a byte with `extent`.
    fn placed_overlaps(&self, extent: Extent) -> bool {
        // Placed ranges are disjoint, so the one starting last before `extent` ends is the
        // only candidate.
        self.placed
            .range(..extent.end())
            .next_back()
            .is_some_and(|(_, &(end, _))| end > extent.offset)
    }

    /// Offers memory to waiting sessions in the policy's order.
    fn admit_waiting(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        let policy = self.policy.policy();
        let mut order = self.queue.clone();
        order.sort_by(|a, b| match (self.sessions.get(a), self.sessions.get(b)) {
            (Some(a), Some(b)) => policy.admission_order(&a.view(), &b.view()),
            _ => a.cmp(b),
        });
        if self.draining {
            for id in order {
                self.set_wait_reason(id, WaitReason::Draining);
            }
            return;
        }
        if policy.exclusive() {
            let holder = self
                .sessions
                .iter()
                .find(|(_, s)| matches!(s.state, State::Admitted { .. }))
                .map(|(&id, _)| id);
            let first = order[0];
            for &id in &order[1..] {
                self.set_wait_reason(
                    id,
                    WaitReason::BehindEarlier {
                        first,
                        policy: policy.kind(),
                    },
                );
            }
            match holder {
                Some(running) => self.set_wait_reason(first, WaitReason::DeviceBusy { running }),
                None => {
                    self.try_admit(first, policy.max_lanes());
                }
            }
            return;
        }
        let mut first_waiting = None;
        for id in order {
            match first_waiting {
                Some(first) if !policy.backfill() => self.set_wait_reason(
                    id,
                    WaitReason::BehindEarlier {
                        first,
                        policy: policy.kind(),
                    },
                ),
                _ => {
                    let admitted = self.try_admit(id, policy.max_lanes())
                        || (first_waiting.is_none()
                            && policy.suspends()
                            && self.admit_by_suspending(id, policy.max_lanes()));
                    if !admitted {
                        first_waiting = Some(id);
                    }
                }
            }
        }
    }

    fn set_wait_reason(&mut self, id: SessionId, reason: WaitReason) {
        if let Some(session) = self.sessions.get_mut(&id)
            && let State::Waiting(current) = &mut session.state
            && current.as_ref() != Some(&reason)
        {
            *current = Some(reason.clone());
            self.actions.push(Action::Queue {
                session: id,
                reason,
            });
        }
    }

    /// Admits the session if Algorithm 2.1 finds it a lane; true when admitted.
    fn try_admit(&mut self, id: SessionId, max_lanes: usize) -> bool {
        let Some(session) = self.sessions.get(&id) else {
            return false;
        };
        let (p, e) = (session.spec.persistent_bytes, session.spec.ephemeral_bytes);
        match self.find_lane(p, e, max_lanes) {
            Ok((choice, placement)) => {
                self.admit(id, choice, placement);
                true
            }
            Err(reason) => {
                self.set_wait_reason(id, reason);
                false
            }
        }
    }

    /// Salus Algorithm 2.1: open a new lane if it fits; else the best-fitting existing lane
    /// with L >= E; else grow the smallest lane whose growth keeps the safety condition.
    /// Each choice must also be placeable: the persistent block must fit below the lanes.
    fn find_lane(
        &self,
        p: u64,
        e: u64,
        max_lanes: usize,
    ) -> Result<(LaneChoice, Placement), WaitReason> {
        let usable = self.memory.usable();
        let used = self.persistent_total + self.lane_total;
        let placement = self.heap.place(p);
        let heap_top = self.heap.top_after(placement, p);
        // Every choice must also be placeable: the persistent block below every lane, now
        // and once the stack is compact with `lane_total` bytes of lanes.
        let placeable = |lane_total: u64| heap_top <= self.lanes_floor(lane_total);
        let mut safe_somewhere = false;

        // 1. A new lane.
        if self.stack.len() < max_lanes && used.saturating_add(p).saturating_add(e) <= usable {
            safe_somewhere = true;
            if placeable(self.lane_total + e) {
                return Ok((LaneChoice::Open, placement));
            }
        }
        // 2. The best-fitting lane with L >= E.
        if used.saturating_add(p) <= usable
            && let Some(&(_, id)) = self.lanes_by_size.range((e, LaneId(0))..).next()
        {
            safe_somewhere = true;
            if placeable(self.lane_total) {
                return Ok((LaneChoice::Join(id), placement));
            }
        }
        // 3. Grow the smallest lane that keeps safety. Growing lane r from L_r to E keeps
        // it when sum P + P + sum L - L_r + E <= usable, i.e. L_r >= safe_min; it is
        // placeable when the lowest target stays above the heap, i.e. L_r >= place_min.
        // Both bounds only rise with L_r, so the smallest lane above both is the answer.
        let safe_min = (self.persistent_total + p + self.lane_total + e).saturating_sub(usable);
        let smallest_from = |min: u64| {
            (min < e)
                .then(|| {
                    self.lanes_by_size
                        .range((min, LaneId(0))..(e, LaneId(0)))
                        .next()
                })
                .flatten()
                .copied()
        };
        if smallest_from(safe_min).is_some() {
            safe_somewhere = true;
            let place_min = (heap_top + self.lane_total + e).saturating_sub(self.memory.capacity);
            if let Some((size, id)) = smallest_from(safe_min.max(place_min))
                && placeable(self.lane_total - size + e)
            {
                return Ok((LaneChoice::Grow(id), placement));
            }
        }
        let needed = p + e;
        let available = usable - used;
        Err(if safe_somewhere {
            WaitReason::Fragmented { needed, available }
        } else {
            WaitReason::Memory {
                needed,
                available,
                usable,
            }
        })
    }

    fn admit(&mut self, id: SessionId, choice: LaneChoice, placement: Placement) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let (p, e) = (session.spec.persistent_bytes, session.spec.ephemeral_bytes);
        let lane_id = match choice {
            LaneChoice::Open => {
                let lane_id = LaneId(self.next_lane);
                self.next_lane += 1;
                self.lanes.insert(
                    lane_id,
                    Lane {
                        size: e,
                        target: 0,
                        placed: None,
                        vacated: None,
                        sessions: Vec::new(),
                        ready: BTreeSet::new(),
                        running: None,
                        last_session: None,
                        fair_clock: Duration::ZERO,
                    },
                );
                self.stack.push(lane_id);
                self.lanes_by_size.insert((e, lane_id));
                self.lane_total += e;
                lane_id
            }
            LaneChoice::Join(lane_id) => lane_id,
            LaneChoice::Grow(lane_id) => {
                if let Some(lane) = self.lanes.get_mut(&lane_id) {
                    self.lanes_by_size.remove(&(lane.size, lane_id));
                    self.lanes_by_size.insert((e, lane_id));
                    self.lane_total += e - lane.size;
                    lane.size = e;
                }
                lane_id
            }
        };
        let clock = self
            .lanes
            .get(&lane_id)
            .map_or(Duration::ZERO, |l| l.fair_clock);
        let block = self.heap.allocate(placement, p);
        self.persistent_total += p;
        let Some(lane) = self.lanes.get_mut(&lane_id) else {
            return;
        };
        lane.sessions.push(id);
        let lane_size = lane.size;
        self.restack();
        self.queue.retain(|&q| q != id);
        if let Some(session) = self.sessions.get_mut(&id) {
            session.state = State::Admitted {
                lane: lane_id,
                block,
                running: false,
                closing: false,
            };
            session.stats.admitted_at.get_or_insert(self.now);
            session.virtual_service = clock;
        }
        let resumed = self
            .sessions
            .get_mut(&id)
            .is_some_and(|s| mem::take(&mut s.suspended));
        self.sync_run_queue(id);
        self.lanes_due.insert(lane_id);
        self.actions.push(Action::Admit {
            session: id,
            lane: lane_id,
            persistent: Extent {
                offset: block.offset,
                size: block.size,
            },
            lane_size,
            resumed,
        });
    }

    /// Moves idle lanes that are out of place to their targets. Nothing is copied:
    /// between iterations a lane holds no data, so an idle lane out of place first gives up
    /// its old range, then takes its target as soon as no placed lane and no persistent
    /// block is there. Targets never overlap each other, so once the running iterations end
    /// every lane is in place: moves cannot deadlock. Only lanes that may have become
    /// movable are looked at, so a poll costs nothing when no lane moves.
    fn move_lanes(&mut self) {
        while let Some(id) = self.move_candidates.pop_first() {
            let Some(lane) = self.lanes.get_mut(&id) else {
                continue;
            };
            if lane.running.is_some() || lane.in_place() {
                continue;
            }
            if let Some(old) = lane.placed.take() {
                lane.vacated = Some(old);
                self.placed.remove(&old.offset);
                // Lanes waiting for a target inside the freed range may fit now. Targets
                // are disjoint, so they are the ones starting before its end, back to the
                // first that ends before its start.
                let freed: Vec<(u64, LaneId)> = self
                    .unplaced
                    .range(..old.end())
                    .rev()
                    .map(|(&offset, &lane)| (offset, lane))
                    .take_while(|&(_, lane)| {
                        self.lanes
                            .get(&lane)
                            .is_some_and(|l| l.target_extent().end() > old.offset)
                    })
                    .collect();
                for (offset, lane) in freed {
                    self.unplaced.remove(&offset);
                    self.move_candidates.insert(lane);
                }
            }
            let Some(lane) = self.lanes.get(&id) else {
                continue;
            };
            let target = lane.target_extent();
            if target.offset < self.heap.top() || self.placed_overlaps(target) {
                self.unplaced.insert(target.offset, id);
                continue;
            }
            let Some(lane) = self.lanes.get_mut(&id) else {
                continue;
            };
            lane.placed = Some(target);
            let from = lane.vacated.take();
            self.placed.insert(target.offset, (target.end(), id));
            self.actions.push(Action::MoveLane {
                lane: id,
                from,
                to: target,
            });
            self.lanes_due.insert(id);
            self.admission_due = true;
        }
    }

    fn start_iterations(&mut self) {
        for lane_id in mem::take(&mut self.lanes_due) {
            let Some(lane) = self.lanes.get(&lane_id) else {
                continue;
            };
            if lane.running.is_some() || !lane.in_place() {
                continue;
            }
            let Some(&(_, id)) = lane.ready.first() else {
                continue;
            };
            let lane_offset = lane.target;
            let switched_from = lane.last_session.filter(|&last| last != id);
            if let Some(last) = switched_from
                && let Some(previous) = self.sessions.get_mut(&last)
                && previous.stats.pending_iterations > 0
            {
                previous.stats.preemptions += 1;
            }
            let Some(session) = self.sessions.get_mut(&id) else {
                continue;
            };
            session.stats.pending_iterations -= 1;
            session.stats.last_started_at = Some(self.now);
            if let State::Admitted { running, .. } = &mut session.state {
                *running = true;
            }
            let service = session.virtual_service;
            if let Some(lane) = self.lanes.get_mut(&lane_id) {
                lane.running = Some(id);
                lane.last_session = Some(id);
                lane.fair_clock = lane.fair_clock.max(service);
            }
            self.unqueue(id);
            self.actions.push(Action::StartIteration {
                session: id,
                lane: lane_id,
                lane_offset,
                switched_from,
            });
        }
    }

    /// Where a session of `persistent` + `ephemeral` bytes would be admitted now under the
    /// current policy's lane limit (Salus Algorithm 2.1), without admitting it; or why it
    /// would wait. Ignores the policy's admission order and the queue.
    pub fn plan_admission(
        &self,
        persistent: u64,
        ephemeral: u64,
    ) -> Result<LaneChoice, WaitReason> {
        let (Some(p), Some(e)) = (
            self.memory.align_up(persistent),
            self.memory.align_up(ephemeral),
        ) else {
            return Err(WaitReason::Memory {
                needed: u64::MAX,
                available: self.memory.usable() - self.persistent_total - self.lane_total,
                usable: self.memory.usable(),
            });
        };
        let usable = self.memory.usable();
        if p.saturating_add(e) > usable {
            return Err(WaitReason::Memory {
                needed: p.saturating_add(e),
                available: usable - self.persistent_total - self.lane_total,
                usable,
            });
        }
        self.find_lane(p, e, self.policy.policy().max_lanes())
            .map(|(choice, _)| choice)
    }

    /// A session as policies see it.
    pub fn session(&self, id: SessionId) -> Option<SessionView<'_>> {
        self.sessions.get(&id).map(Session::view)
    }

    /// Every open session (waiting or admitted), by id.
    pub fn sessions(&self) -> impl Iterator<Item = SessionView<'_>> {
        self.sessions.values().map(Session::view)
    }

    /// The lane a session is admitted to, if any.
    pub fn lane_of(&self, id: SessionId) -> Option<LaneId> {
        match self.sessions.get(&id)?.state {
            State::Admitted { lane, .. } => Some(lane),
            State::Waiting(_) => None,
        }
    }

    /// Waiting sessions in arrival order, with the reason each waits (`None` before the
    /// first decision about it).
    pub fn waiting(&self) -> Vec<(SessionId, Option<WaitReason>)> {
        self.queue
            .iter()
            .filter_map(|id| match &self.sessions.get(id)?.state {
                State::Waiting(reason) => Some((*id, reason.clone())),
                State::Admitted { .. } => None,
            })
            .collect()
    }

    /// Lanes, top of memory first.
    pub fn lanes(&self) -> Vec<LaneInfo> {
        self.stack
            .iter()
            .filter_map(|id| {
                let lane = self.lanes.get(id)?;
                Some(LaneInfo {
                    id: *id,
                    size: lane.size,
                    placed: lane.placed,
                    target: lane.target_extent(),
                    sessions: lane.sessions.clone(),
                    running: lane.running,
                })
            })
            .collect()
    }

    /// The physical memory map now.
    pub fn memory_map(&self) -> MemoryMap {
        let mut regions: Vec<Region> = self
            .sessions
            .values()
            .filter_map(|s| match s.state {
                State::Admitted { block, .. } if block.size > 0 => Some(Region {
                    extent: Extent {
                        offset: block.offset,
                        size: block.size,
                    },
                    kind: RegionKind::Persistent { session: s.spec.id },
                }),
                _ => None,
            })
            .collect();
        regions.extend(self.heap.holes().map(|h| Region {
            extent: Extent {
                offset: h.offset,
                size: h.size,
            },
            kind: RegionKind::Hole,
        }));
        regions.extend(self.lanes.iter().filter_map(|(&lane, l)| {
            Some(Region {
                extent: l.placed?,
                kind: RegionKind::Lane {
                    lane,
                    sessions: l.sessions.clone(),
                },
            })
        }));
        regions.sort_by_key(|r| r.extent.offset);
        let mut map = Vec::with_capacity(regions.len() * 2 + 1);
        let mut cursor = 0;
        for region in regions {
            if region.extent.offset > cursor {
                map.push(Region {
                    extent: Extent {
                        offset: cursor,
                        size: region.extent.offset - cursor,
                    },
                    kind: RegionKind::Free,
                });
            }
            cursor = region.extent.end();
            map.push(region);
        }
        if cursor < self.memory.capacity {
            map.push(Region {
                extent: Extent {
                    offset: cursor,
                    size: self.memory.capacity - cursor,
                },
                kind: RegionKind::Free,
            });
        }
        MemoryMap {
            capacity: self.memory.capacity,
            reserve: self.memory.reserve,
            persistent_bytes: self.persistent_total,
            lane_bytes: self.lane_total,
            available_bytes: self.memory.usable() - self.persistent_total - self.lane_total,
            regions: map,
        }
    }

    /// Checks every invariant the core promises; `Err` names the first one broken. Cheap
    /// enough for tests to call after every event.
    pub fn check_invariants(&self) -> Result<(), String> {
        let sum_p: u64 = self
            .sessions
            .values()
            .filter_map(|s| match s.state {
                State::Admitted { block, .. } => Some(block.size),
                State::Waiting(_) => None,
            })
            .sum();
        let sum_l: u64 = self.lanes.values().map(|l| l.size).sum();
        if sum_p != self.persistent_total || sum_l != self.lane_total {
            return Err(format!(
                "accounting drifted: P {sum_p} vs {}, L {sum_l} vs {}",
                self.persistent_total, self.lane_total
            ));
        }
        if sum_p + sum_l > self.memory.usable() {
            return Err(format!(
                "safety violated: sum P {sum_p} + sum L {sum_l} > C - reserve {}",
                self.memory.usable()
            ));
        }
        let map = self.memory_map();
        if map.total() != self.memory.capacity {
            return Err(format!(
                "memory map sums to {} not {}",
                map.total(),
                self.memory.capacity
            ));
        }
        let mut cursor = 0;
        for region in &map.regions {
            if region.extent.offset != cursor {
                return Err(format!(
                    "memory map overlaps or skips at {cursor}: {region:?}"
                ));
            }
            cursor = region.extent.end();
        }
        for (id, lane) in &self.lanes {
            let expected = lane
                .sessions
                .iter()
                .filter_map(|s| self.sessions.get(s))
                .map(|s| s.spec.ephemeral_bytes)
                .max()
                .unwrap_or(0);
            if lane.sessions.is_empty() || expected != lane.size {
                return Err(format!(
                    "{id} has size {} but its sessions need {expected}",
                    lane.size
                ));
            }
            if let Some(running) = lane.running {
                if lane.placed.is_none() {
                    return Err(format!("{id} runs {running} but was never placed"));
                }
                let ok = self.sessions.get(&running).is_some_and(|s| {
                    matches!(s.state, State::Admitted { lane: l, running: true, .. } if l == *id)
                });
                if !ok {
                    return Err(format!(
                        "{id} claims to run {running}, which is not running there"
                    ));
                }
            }
            if lane.running.is_none()
                && !lane.in_place()
                && !self.unplaced.values().any(|l| l == id)
                && !self.move_candidates.contains(id)
            {
                return Err(format!(
                    "{id} is idle and out of place but nothing will move it"
                ));
            }
            if let Some(placed) = lane.placed
                && placed.offset < self.heap.top()
            {
                return Err(format!("{id} at {placed:?} overlaps the persistent region"));
            }
        }
        for (id, session) in &self.sessions {
            let in_queue = self
                .lanes
                .values()
                .filter(|l| l.ready.iter().any(|&(_, s)| s == *id))
                .count();
            if session.ready() != (in_queue == 1) || session.queued.is_some() != (in_queue == 1) {
                return Err(format!(
                    "{id} is {}ready but sits in {in_queue} run queues",
                    if session.ready() { "" } else { "not " }
                ));
            }
        }
        let placed: Vec<(u64, u64, LaneId)> = self
            .lanes
            .iter()
            .filter_map(|(&id, l)| l.placed.map(|e| (e.offset, e.end(), id)))
            .collect();
        let mut indexed: Vec<(u64, u64, LaneId)> = self
            .placed
            .iter()
            .map(|(&o, &(e, id))| (o, e, id))
            .collect();
        indexed.sort();
        let mut placed_sorted = placed;
        placed_sorted.sort();
        if indexed != placed_sorted {
            return Err(format!(
                "placement index {indexed:?} != lanes {placed_sorted:?}"
            ));
        }
        let by_size: BTreeSet<(u64, LaneId)> =
            self.lanes.iter().map(|(&id, l)| (l.size, id)).collect();
        if by_size != self.lanes_by_size {
            return Err("lane size index out of date".into());
        }
        let running: usize = self
            .sessions
            .values()
            .filter(|s| matches!(s.state, State::Admitted { running: true, .. }))
            .count();
        let lanes_running = self.lanes.values().filter(|l| l.running.is_some()).count();
        if running != lanes_running {
            return Err(format!(
                "{running} sessions running but {lanes_running} lanes busy: two iterations on one lane"
            ));
        }
        Ok(())
    }
}
