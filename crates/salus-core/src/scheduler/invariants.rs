//! The invariants the core promises, checked on demand (tests call this after every event).

use std::collections::BTreeSet;

use super::{Scheduler, State};
use crate::memory::LaneId;
use crate::session::SessionClass;

impl Scheduler {
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
        if self.protecting() {
            for (id, lane) in &self.lanes {
                if let Some(other) = lane.sessions.iter().find(|s| {
                    self.sessions
                        .get(s)
                        .is_some_and(|s| s.spec.class != lane.class)
                }) {
                    return Err(format!(
                        "{id} is a {} lane but holds {other}, of the other class",
                        lane.class
                    ));
                }
            }
            let offline_lanes = self
                .lanes
                .values()
                .filter(|l| l.class == SessionClass::Offline)
                .count();
            if offline_lanes != self.offline_lanes {
                return Err(format!(
                    "{offline_lanes} offline lanes but {} counted",
                    self.offline_lanes
                ));
            }
            let (held, limit) = (self.offline_bytes(), self.offline_limit());
            if held > limit {
                return Err(format!(
                    "offline sessions hold {held} bytes, past their share of {limit}"
                ));
            }
        }
        Ok(())
    }
}
