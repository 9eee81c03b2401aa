//! Property tests over random event sequences: the core's promises hold whatever clients do.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{MB, timed};
use proptest::prelude::*;
use salus_core::{
    Action, DeviceSample, Event, LaneId, MemoryConfig, PolicyKind, Scheduler, SessionClass,
    SessionId,
};

#[derive(Debug, Clone)]
enum Op {
    Open {
        p: u64,
        e: u64,
        iterations: u64,
        ms: u64,
        offline: bool,
    },
    Submit(usize),
    Finish(usize, u64),
    Close(usize),
    Tick(u64),
    Policy(PolicyKind),
    Drain(bool),
    Offline(bool),
    Sample(u8, u16),
}

fn policy() -> impl Strategy<Value = PolicyKind> {
    prop_oneof![
        Just(PolicyKind::Fifo),
        Just(PolicyKind::Pack),
        Just(PolicyKind::Srtf),
        Just(PolicyKind::Fair),
        Just(PolicyKind::Share)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..400, 1u64..600, 1u64..50, 1u64..200, any::<bool>())
            .prop_map(|(p, e, iterations, ms, offline)| {
                Op::Open { p: p * MB, e: e * MB, iterations, ms, offline }
            }),
        6 => any::<usize>().prop_map(Op::Submit),
        6 => (any::<usize>(), 1u64..300).prop_map(|(i, ms)| Op::Finish(i, ms)),
        2 => any::<usize>().prop_map(Op::Close),
        1 => (0u64..100).prop_map(Op::Tick),
        1 => policy().prop_map(Op::Policy),
        1 => any::<bool>().prop_map(Op::Drain),
        1 => any::<bool>().prop_map(Op::Offline),
        1 => (0u8..=100, 0u16..=1500).prop_map(|(a, c)| Op::Sample(a, c)),
    ]
}

/// Drives a scheduler and checks, action by action, what the core promises the device.
struct Checked {
    core: Scheduler,
    now: Duration,
    next_id: u64,
    /// Lane -> session whose iteration runs there, as the actions said.
    running: BTreeMap<LaneId, SessionId>,
    /// Lane -> where the actions last placed it.
    placed: BTreeMap<LaneId, u64>,
    open: BTreeSet<SessionId>,
    admitted: BTreeSet<SessionId>,
}

impl Checked {
    fn new(policy: PolicyKind, capacity: u64, reserve: u64) -> Self {
        Checked {
            core: Scheduler::new(MemoryConfig::new(capacity, reserve), policy).unwrap(),
            now: Duration::ZERO,
            next_id: 0,
            running: BTreeMap::new(),
            placed: BTreeMap::new(),
            open: BTreeSet::new(),
            admitted: BTreeSet::new(),
        }
    }

    fn pick(set: &BTreeSet<SessionId>, i: usize) -> Option<SessionId> {
        (!set.is_empty()).then(|| *set.iter().nth(i % set.len()).unwrap())
    }

    fn running_sessions(&self) -> Vec<SessionId> {
        self.running.values().copied().collect()
    }

    fn feed(&mut self, event: Event) {
        if let Event::IterationFinished { session, .. } = &event {
            self.running.retain(|_, s| s != session);
        }
        self.core.handle(self.now, event).unwrap();
        let mut abandon = Vec::new();
        for action in self.core.poll() {
            match action {
                Action::Abandon { session } => {
                    let lane = self.running.iter().find(|(_, s)| **s == session);
                    assert!(lane.is_some(), "abandon of {session}, which does not run");
                    abandon.push(session);
                }
                Action::SetComputeShare {
                    session,
                    compute_share,
                } => {
                    let lane = self.running.iter().find(|(_, s)| **s == session);
                    assert!(lane.is_some(), "a share for {session}, which does not run");
                    assert!((0.0..=1.0).contains(&compute_share));
                }
                Action::Admit { session, .. } => {
                    assert!(self.admitted.insert(session));
                }
                Action::Reject { session, .. } => {
                    assert!(self.open.remove(&session));
                }
                Action::Closed { session } => {
                    assert!(self.open.remove(&session), "closed twice: {session}");
                    self.admitted.remove(&session);
                    assert!(
                        !self.running_sessions().contains(&session),
                        "freed while running"
                    );
                }
                Action::MoveLane { lane, from, to } => {
                    assert!(
                        !self.running.contains_key(&lane),
                        "{lane} moved while running"
                    );
                    assert_eq!(from.map(|e| e.offset), self.placed.get(&lane).copied());
                    self.placed.insert(lane, to.offset);
                }
                Action::StartIteration {
                    session,
                    lane,
                    lane_offset,
                    ..
                } => {
                    assert!(self.admitted.contains(&session));
                    assert_eq!(
                        self.placed.get(&lane),
                        Some(&lane_offset),
                        "started out of place"
                    );
                    let previous = self.running.insert(lane, session);
                    assert!(previous.is_none(), "two iterations on {lane}");
                    assert!(
                        self.running.values().filter(|&&s| s == session).count() == 1,
                        "{session} runs twice"
                    );
                }
                Action::Queue { session, .. } => assert!(!self.admitted.contains(&session)),
                Action::Suspend { session, .. } => {
                    assert!(
                        self.admitted.remove(&session),
                        "suspended while not admitted"
                    );
                    assert!(
                        !self.running_sessions().contains(&session),
                        "suspended while running"
                    );
                }
            }
        }
        if let Err(broken) = self.core.check_invariants() {
            panic!("{broken}");
        }
        let map = self.core.memory_map();
        assert_eq!(map.total(), map.capacity);
        let usable = map.capacity - map.reserve;
        assert!(map.persistent_bytes + map.lane_bytes <= usable, "safety");
        // The device stops abandoned iterations at once.
        for session in abandon {
            self.running.retain(|_, s| *s != session);
            self.feed(Event::IterationAbandoned(session));
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Open {
                p,
                e,
                iterations,
                ms,
                offline,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                self.open.insert(SessionId(id));
                let mut spec = timed(id, p, e, iterations, ms);
                if offline {
                    spec.class = SessionClass::Offline;
                } else {
                    spec.hints.slo = Some(Duration::from_millis(ms * 3));
                }
                self.feed(Event::SessionOpened(spec));
            }
            Op::Submit(i) => {
                if let Some(id) = Self::pick(&self.open, i) {
                    // Submitting to a closing session is an error by design; skip those.
                    let event = Event::IterationSubmitted(id);
                    if self.core.clone().handle(self.now, event.clone()).is_ok() {
                        self.feed(event);
                    }
                }
            }
            Op::Finish(i, ms) => {
                let running = self.running_sessions();
                if !running.is_empty() {
                    let id = running[i % running.len()];
                    self.now += Duration::from_millis(ms);
                    self.feed(Event::IterationFinished {
                        session: id,
                        duration: Duration::from_millis(ms),
                    });
                }
            }
            Op::Close(i) => {
                let live: BTreeSet<SessionId> = self
                    .open
                    .iter()
                    .copied()
                    .filter(|id| self.core.session(*id).is_some())
                    .collect();
                if let Some(id) = Self::pick(&live, i) {
                    let event = Event::SessionClosed(id);
                    if self.core.clone().handle(self.now, event.clone()).is_ok() {
                        self.feed(event);
                    }
                }
            }
            Op::Tick(ms) => {
                self.now += Duration::from_millis(ms);
                self.feed(Event::Tick);
            }
            Op::Policy(p) => {
                self.feed(Event::PolicyChanged(p));
            }
            Op::Drain(d) => {
                self.feed(Event::DrainingChanged(d));
            }
            Op::Offline(on) => {
                self.feed(Event::OfflineEnabled(on));
            }
            Op::Sample(activity, clock) => {
                self.feed(Event::DeviceSampled(DeviceSample {
                    sm_activity: Some(f64::from(activity) / 100.0),
                    sm_clock: Some((f64::from(clock), 1500.0)),
                }));
            }
        }
    }

    /// Every open session submits `quota` iterations and closes after its last one; the
    /// device runs whatever it is told. Returns once every session has closed, or panics if
    /// the core stops making progress.
    fn run_to_completion(&mut self, quota: u64) {
        self.feed(Event::DrainingChanged(false));
        self.feed(Event::OfflineEnabled(true));
        self.feed(Event::DeviceSampled(DeviceSample::default()));
        let mut left: BTreeMap<SessionId, u64> = BTreeMap::new();
        for id in self.open.clone() {
            if self.core.session(id).is_none() {
                continue;
            }
            left.insert(id, quota);
            for _ in 0..quota {
                let event = Event::IterationSubmitted(id);
                if self.core.clone().handle(self.now, event.clone()).is_ok() {
                    self.feed(event);
                }
            }
        }
        self.feed(Event::Tick);
        let mut steps = 0;
        while !self.open.is_empty() {
            steps += 1;
            assert!(steps < 100_000, "no progress");
            let running = self.running_sessions();
            if running.is_empty()
                && let Some(wakeup) = self.core.next_wakeup()
            {
                // Offline work held back by protection goes on at the time it says.
                assert!(wakeup > self.now);
                self.now = wakeup;
                self.feed(Event::Tick);
                continue;
            }
            assert!(
                !running.is_empty(),
                "stuck: open {:?}, waiting {:?}, lanes {:?}",
                self.open,
                self.core.waiting(),
                self.core.lanes()
            );
            for id in running {
                self.now += Duration::from_millis(7);
                self.feed(Event::IterationFinished {
                    session: id,
                    duration: Duration::from_millis(7),
                });
                let remaining = left.entry(id).or_insert(1);
                *remaining = remaining.saturating_sub(1);
                if *remaining == 0 && self.core.session(id).is_some() {
                    let event = Event::SessionClosed(id);
                    if self.core.clone().handle(self.now, event.clone()).is_ok() {
                        self.feed(event);
                    }
                } else if self.core.session(id).is_some()
                    && self.core.session(id).unwrap().stats.pending_iterations == 0
                {
                    // A session that lost submissions to an earlier close-in-progress
                    // keeps being fed so it can reach its quota.
                    self.feed(Event::IterationSubmitted(id));
                }
            }
        }
        assert!(self.core.lanes().is_empty());
        assert_eq!(self.core.memory_map().persistent_bytes, 0);
    }
}

proptest! {
    #[test]
    fn invariants_hold_and_every_session_finishes(
        start in policy(),
        finish_under in prop_oneof![Just(PolicyKind::Fifo), Just(PolicyKind::Pack),
                                    Just(PolicyKind::Fair), Just(PolicyKind::Srtf),
                                    Just(PolicyKind::Share)],
        reserve in 0u64..200,
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let mut run = Checked::new(start, 1024 * MB, reserve * MB);
        for op in ops {
            run.apply(op);
        }
        run.feed(Event::PolicyChanged(finish_under));
        run.run_to_completion(3);
    }

    #[test]
    fn same_events_give_same_actions(ops in prop::collection::vec(op(), 1..80), p in policy()) {
        let mut a = Checked::new(p, 1024 * MB, 0);
        let mut b = Checked::new(p, 1024 * MB, 0);
        for op in ops {
            a.apply(op.clone());
            b.apply(op);
            prop_assert_eq!(format!("{:?}", a.core.memory_map()), format!("{:?}", b.core.memory_map()));
        }
    }
}
