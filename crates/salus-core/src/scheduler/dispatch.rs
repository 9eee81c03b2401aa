//! Lane placement and iteration dispatch: moving idle lanes to their targets (nothing is
//! copied between iterations), per-lane run queues in the policy's order, and starting the
//! next iteration on every free lane.

use std::mem;

use super::{Action, Scheduler, State};
use crate::memory::{Extent, LaneId};
use crate::session::{SessionClass, SessionId};

impl Scheduler {
    /// Moves idle lanes that are out of place to their targets. Nothing is copied:
    /// between iterations a lane holds no data, so an idle lane out of place first gives up
    /// its old range, then takes its target as soon as no placed lane and no persistent
    /// block is there. Targets never overlap each other, so once the running iterations end
    /// every lane is in place: moves cannot deadlock. Only lanes that may have become
    /// movable are looked at, so a poll costs nothing when no lane moves.
    pub(super) fn move_lanes(&mut self) {
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

    pub(super) fn start_iterations(&mut self) {
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
            if lane.class == SessionClass::Offline && self.protecting() && !self.offline_gate_open()
            {
                self.protect.held.insert(lane_id);
                continue;
            }
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
            let compute_share = self.protect.started(session);
            let background = self.protect.in_background(session);
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
                compute_share,
                background,
            });
            self.sync_offline_share();
        }
    }

    /// Recomputes every lane's target: stacked down from C in stack order.
    pub(super) fn restack(&mut self) {
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
    pub(super) fn sync_run_queue(&mut self, id: SessionId) {
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

    pub(super) fn unqueue(&mut self, id: SessionId) {
        if let Some((lane, key)) = self.sessions.get_mut(&id).and_then(|s| s.queued.take())
            && let Some(lane) = self.lanes.get_mut(&lane)
        {
            lane.ready.remove(&(key, id));
        }
    }

    /// Lowest offset any lane occupies now or is headed to: the persistent heap must stay
    /// below it.
    pub(super) fn lanes_floor(&self, lane_total: u64) -> u64 {
        let lowest_placed = self.placed.keys().next().copied();
        let lowest_target = self.memory.capacity - lane_total;
        lowest_placed.map_or(lowest_target, |p| p.min(lowest_target))
    }

    /// True when a placed lane shares a byte with `extent`.
    pub(super) fn placed_overlaps(&self, extent: Extent) -> bool {
        // Placed ranges are disjoint, so the one starting last before `extent` ends is the
        // only candidate.
        self.placed
            .range(..extent.end())
            .next_back()
            .is_some_and(|(_, &(end, _))| end > extent.offset)
    }
}
