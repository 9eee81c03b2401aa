//! Admission: the queue of waiting sessions, Salus Algorithm 2.1 (lane finding), and
//! making room by suspending idle sessions for policies that preempt memory.

use std::collections::BTreeSet;
use std::mem;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Action, Lane, Scheduler, State};
use crate::heap::{Block, Placement};
use crate::memory::{Extent, LaneId, WaitReason};
use crate::policy::RunKey;
use crate::session::{SessionClass, SessionId};

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

impl Scheduler {
    /// Where a session of `persistent` + `ephemeral` bytes would be admitted now under the
    /// current policy's lane limit (Salus Algorithm 2.1), as an online session, without
    /// admitting it; or why it would wait. Ignores the policy's admission order and the
    /// queue.
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
        self.find_lane(p, e, self.policy.policy().max_lanes(), SessionClass::Online)
            .map(|(choice, _)| choice)
    }

    /// Offers memory to waiting sessions in the policy's order.
    pub(super) fn admit_waiting(&mut self) {
        // Set again below while an online session still waits for offline memory; one that
        // closed while waiting leaves nothing to starve.
        self.protect.online_starved = false;
        if self.queue.is_empty() {
            return;
        }
        let policy = self.policy.policy();
        let mut order = self.queue.clone();
        let protecting = self.protecting();
        order.sort_by(|a, b| match (self.sessions.get(a), self.sessions.get(b)) {
            (Some(a), Some(b)) if protecting => a
                .spec
                .class
                .cmp(&b.spec.class)
                .then_with(|| policy.admission_order(&a.view(), &b.view())),
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
        let mut online_waiting = None;
        let health = self.protect.health.state();
        for id in order {
            let offline = protecting && self.class_of(id) == SessionClass::Offline;
            if offline && let Some(first) = online_waiting {
                self.set_wait_reason(id, WaitReason::OnlineFirst { first });
                continue;
            }
            if offline && !health.admits_offline() {
                self.set_wait_reason(id, WaitReason::OfflineHealth { health });
                continue;
            }
            match first_waiting {
                Some(first) if !policy.backfill() => self.set_wait_reason(
                    id,
                    WaitReason::BehindEarlier {
                        first,
                        policy: policy.kind(),
                    },
                ),
                _ => {
                    let online = protecting && !offline;
                    let admitted = self.try_admit(id, policy.max_lanes())
                        || (online && self.admit_by_evicting_offline(id, policy.max_lanes()))
                        || (first_waiting.is_none()
                            && policy.suspends()
                            && self.admit_by_suspending(id, policy.max_lanes()));
                    if !admitted {
                        first_waiting = Some(id);
                        if online {
                            online_waiting = Some(id);
                            // Offline sessions that hold memory stop at their boundaries
                            // so that they can give it up.
                            self.protect.online_starved |= self.offline_holds_memory();
                        }
                    }
                }
            }
        }
    }

    pub(super) fn set_wait_reason(&mut self, id: SessionId, reason: WaitReason) {
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
    pub(super) fn try_admit(&mut self, id: SessionId, max_lanes: usize) -> bool {
        let Some(session) = self.sessions.get(&id) else {
            return false;
        };
        let (p, e) = (session.spec.persistent_bytes, session.spec.ephemeral_bytes);
        match self.find_lane(p, e, max_lanes, session.spec.class) {
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
    /// Under protection a session only joins or grows lanes of its class, and an offline
    /// session only takes what keeps the offline sessions within their share.
    pub(super) fn find_lane(
        &self,
        p: u64,
        e: u64,
        max_lanes: usize,
        class: SessionClass,
    ) -> Result<(LaneChoice, Placement), WaitReason> {
        let protecting = self.protecting();
        // Every lane is online while no offline lane exists: no lookup then.
        let any_lane = !protecting || (class == SessionClass::Online && self.offline_lanes == 0);
        let same_class =
            |id: &LaneId| any_lane || self.lanes.get(id).is_some_and(|l| l.class == class);
        // What an offline admission may add to the offline sessions' bytes.
        let (offline_held, offline_room) = if protecting && class == SessionClass::Offline {
            let held = self.offline_bytes();
            (held, self.offline_limit().saturating_sub(held))
        } else {
            (0, u64::MAX)
        };
        let within_share = |lane_growth: u64| p.saturating_add(lane_growth) <= offline_room;
        let mut over_share = false;
        let usable = self.memory.usable();
        let used = self.persistent_total + self.lane_total;
        let placement = self.heap.place(p);
        let heap_top = self.heap.top_after(placement, p);
        // Every choice must also be placeable: the persistent block below every lane, now
        // and once the stack is compact with `lane_total` bytes of lanes.
        let placeable = |lane_total: u64| heap_top <= self.lanes_floor(lane_total);
        let mut safe_somewhere = false;

        // 1. A new lane.
        // Under protection each class has the policy's lane limit.
        let lanes = match (protecting, class) {
            (false, _) => self.stack.len(),
            (true, SessionClass::Offline) => self.offline_lanes,
            (true, SessionClass::Online) => self.stack.len() - self.offline_lanes,
        };
        if lanes < max_lanes && used.saturating_add(p).saturating_add(e) <= usable {
            if !within_share(e) {
                over_share = true;
            } else {
                safe_somewhere = true;
                if placeable(self.lane_total + e) {
                    return Ok((LaneChoice::Open, placement));
                }
            }
        }
        // 2. The best-fitting lane with L >= E.
        if used.saturating_add(p) <= usable
            && let Some(&(_, id)) = self
                .lanes_by_size
                .range((e, LaneId(0))..)
                .find(|(_, id)| same_class(id))
        {
            if !within_share(0) {
                over_share = true;
            } else {
                safe_somewhere = true;
                if placeable(self.lane_total) {
                    return Ok((LaneChoice::Join(id), placement));
                }
            }
        }
        // 3. Grow the smallest lane that keeps safety. Growing lane r from L_r to E keeps
        // it when sum P + P + sum L - L_r + E <= usable, i.e. L_r >= safe_min; it is
        // placeable when the lowest target stays above the heap, i.e. L_r >= place_min.
        // Both bounds only rise with L_r, so the smallest lane above both is the answer.
        let safe_min = (self.persistent_total + p + self.lane_total + e).saturating_sub(usable);
        // Under the offline share, a lane of size L grows by E - L: it must be at least
        // share_min.
        let share_min = if offline_room == u64::MAX {
            0
        } else {
            (p + e).saturating_sub(offline_room)
        };
        let smallest_from = |min: u64| {
            (min < e)
                .then(|| {
                    self.lanes_by_size
                        .range((min, LaneId(0))..(e, LaneId(0)))
                        .find(|(_, id)| same_class(id))
                })
                .flatten()
                .copied()
        };
        if smallest_from(safe_min).is_some() {
            // (The same search again only when the share raises the bound.)
            if share_min > safe_min && smallest_from(share_min).is_none() {
                over_share = true;
            } else {
                safe_somewhere = true;
                let place_min =
                    (heap_top + self.lane_total + e).saturating_sub(self.memory.capacity);
                if let Some((size, id)) = smallest_from(safe_min.max(place_min).max(share_min))
                    && placeable(self.lane_total - size + e)
                {
                    return Ok((LaneChoice::Grow(id), placement));
                }
            }
        }
        let needed = p + e;
        let available = usable - used;
        if over_share && !safe_somewhere {
            return Err(WaitReason::OfflineShare {
                needed,
                held: offline_held,
                limit: self.offline_limit(),
            });
        }
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

    pub(super) fn admit(&mut self, id: SessionId, choice: LaneChoice, placement: Placement) {
        let Some(session) = self.sessions.get(&id) else {
            return;
        };
        let (p, e) = (session.spec.persistent_bytes, session.spec.ephemeral_bytes);
        let class = session.spec.class;
        let lane_id = match choice {
            LaneChoice::Open => {
                let lane_id = LaneId(self.next_lane);
                self.next_lane += 1;
                self.lanes.insert(
                    lane_id,
                    Lane {
                        class,
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
                self.offline_lanes += usize::from(class == SessionClass::Offline);
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

    /// For a policy that suspends: makes room for `head` by suspending idle admitted
    /// sessions that come after it in the policy's run order, latest first, and only if
    /// that makes `head` fit. True when `head` was admitted.
    pub(super) fn admit_by_suspending(&mut self, head: SessionId, max_lanes: usize) -> bool {
        let policy = self.policy.policy();
        let Some(head_session) = self.sessions.get(&head) else {
            return false;
        };
        let head_key = (policy.suspension_key(&head_session.view()), head);
        // Under protection an offline session never takes an online one's memory.
        let head_class = head_session.spec.class;
        let protecting = self.protecting();
        let mut behind: Vec<((RunKey, SessionId), SessionId)> = self
            .sessions
            .values()
            .filter(|s| !protecting || s.spec.class >= head_class)
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
            .map(|s| ((policy.suspension_key(&s.view()), s.spec.id), s.spec.id))
            .filter(|(key, _)| *key > head_key)
            .collect();
        if behind.is_empty() {
            return false;
        }
        behind.sort_by_key(|&(key, _)| std::cmp::Reverse(key));
        let victims: Vec<SessionId> = behind.into_iter().map(|(_, id)| id).collect();
        self.admit_suspending(head, &victims, max_lanes).is_some()
    }

    /// Admits `head` by suspending idle `victims` in their order, as few as it takes, if
    /// that makes it fit; returns how many were suspended. Nothing changes otherwise.
    pub(super) fn admit_suspending(
        &mut self,
        head: SessionId,
        victims: &[SessionId],
        max_lanes: usize,
    ) -> Option<usize> {
        if victims.is_empty() || !self.fits_without(head, victims) {
            return None;
        }
        // Suspend one at a time on a copy, so nothing changes unless the head gets in.
        let mut trial = self.clone();
        for (n, &victim) in victims.iter().enumerate() {
            trial.suspend(victim);
            if trial.try_admit(head, max_lanes) {
                *self = trial;
                return Some(n + 1);
            }
        }
        None
    }

    /// Whether `head` could keep the safety condition if every one of `victims` left:
    /// a cheap bound that spares copying the scheduler when even that would not do.
    pub(super) fn fits_without(&self, head: SessionId, victims: &[SessionId]) -> bool {
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

    /// Moves an idle admitted session out of device memory and back to the queue, where
    /// it waits for re-admission like any other session.
    pub(super) fn suspend(&mut self, id: SessionId) {
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
    pub(super) fn free_memory(&mut self, id: SessionId) -> Option<Block> {
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
                let offline = lane.class == SessionClass::Offline;
                self.lanes.remove(&lane_id);
                self.stack.retain(|&l| l != lane_id);
                self.offline_lanes -= usize::from(offline);
            } else {
                self.lanes_by_size.insert((lane.size, lane_id));
            }
            self.restack();
        }
        self.admission_due = true;
        Some(block)
    }
}
