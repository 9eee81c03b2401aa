//! A small driver for tests: feeds events, keeps every action, checks invariants each step.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use salus_core::{
    Action, Event, Hints, LaneId, MemoryConfig, PolicyKind, Scheduler, SessionId, SessionKind,
    SessionSpec,
};

pub const MB: u64 = 1 << 20;

pub fn spec(id: u64, p: u64, e: u64) -> SessionSpec {
    SessionSpec {
        id: SessionId(id),
        kind: SessionKind::Training,
        class: salus_core::SessionClass::Online,
        persistent_bytes: p,
        ephemeral_bytes: e,
        hints: Hints::default(),
    }
}

pub fn timed(id: u64, p: u64, e: u64, iterations: u64, iteration_ms: u64) -> SessionSpec {
    SessionSpec {
        hints: Hints {
            total_iterations: Some(iterations),
            expected_iteration: Some(Duration::from_millis(iteration_ms)),
            ..Hints::default()
        },
        ..spec(id, p, e)
    }
}

pub struct Driver {
    pub core: Scheduler,
    pub now: Duration,
    pub log: Vec<Action>,
}

impl Driver {
    pub fn new(capacity: u64, reserve: u64, policy: PolicyKind) -> Self {
        Driver {
            core: Scheduler::new(MemoryConfig::new(capacity, reserve), policy).unwrap(),
            now: Duration::ZERO,
            log: Vec::new(),
        }
    }

    /// Feeds an event at the current time and returns the actions it caused.
    pub fn feed(&mut self, event: Event) -> Vec<Action> {
        self.core.handle(self.now, event).unwrap();
        let actions = self.core.poll();
        self.core.check_invariants().unwrap();
        self.log.extend(actions.iter().cloned());
        actions
    }

    pub fn open(&mut self, spec: SessionSpec) -> Vec<Action> {
        self.feed(Event::SessionOpened(spec))
    }

    pub fn submit(&mut self, id: u64) -> Vec<Action> {
        self.feed(Event::IterationSubmitted(SessionId(id)))
    }

    pub fn finish(&mut self, id: u64, ms: u64) -> Vec<Action> {
        self.now += Duration::from_millis(ms);
        self.feed(Event::IterationFinished {
            session: SessionId(id),
            duration: Duration::from_millis(ms),
        })
    }

    pub fn close(&mut self, id: u64) -> Vec<Action> {
        self.feed(Event::SessionClosed(SessionId(id)))
    }
}

pub fn started(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::StartIteration { session, .. } => Some(session.0),
            _ => None,
        })
        .collect()
}

pub fn admitted(actions: &[Action]) -> Vec<(u64, LaneId)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Admit { session, lane, .. } => Some((session.0, *lane)),
            _ => None,
        })
        .collect()
}

pub fn suspended(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Suspend { session, .. } => Some(session.0),
            _ => None,
        })
        .collect()
}
