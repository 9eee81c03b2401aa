//! Read-only views of the core for drivers and reports: sessions, lanes, the waiting
//! queue and the physical memory map.

use serde::{Deserialize, Serialize};

use super::{Scheduler, Session, State};
use crate::memory::{Extent, LaneId, MemoryMap, Region, RegionKind, WaitReason};
use crate::session::{SessionId, SessionView};

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

impl Scheduler {
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
}
