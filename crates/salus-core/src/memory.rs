//! Device memory as the core lays it out: the configuration, lanes, regions and the map.
//!
//! ```text
//! 0                                                                          C
//! | persistent region (heap, grows up) |     free     | lanes (stack, grows down) |
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::policy::PolicyKind;
use crate::protection::HealthState;
use crate::session::SessionId;

/// Memory of one device as the core manages it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryConfig {
    /// C: bytes of device memory salus manages.
    pub capacity: u64,
    /// Bytes kept free at all times (runtime workspaces, fragmentation headroom).
    pub reserve: u64,
    /// Every offset and size is a multiple of this power of two.
    pub alignment: u64,
}

impl MemoryConfig {
    /// Default alignment: 256 bytes, what CUDA allocations guarantee.
    pub const DEFAULT_ALIGNMENT: u64 = 256;

    /// A configuration with the default alignment.
    pub fn new(capacity: u64, reserve: u64) -> Self {
        MemoryConfig {
            capacity,
            reserve,
            alignment: Self::DEFAULT_ALIGNMENT,
        }
    }

    /// Bytes sessions may use: `C - reserve`.
    pub fn usable(&self) -> u64 {
        self.capacity - self.reserve
    }

    /// True when a session of `persistent` and `ephemeral` bytes (each aligned up) fits an
    /// empty device. A session that does not can never be admitted.
    pub fn fits_empty(&self, persistent: u64, ephemeral: u64) -> bool {
        match (self.align_up(persistent), self.align_up(ephemeral)) {
            (Some(p), Some(e)) => p.checked_add(e).is_some_and(|t| t <= self.usable()),
            _ => false,
        }
    }

    /// Rounds `bytes` up to the alignment; `None` on overflow.
    pub fn align_up(&self, bytes: u64) -> Option<u64> {
        Some(bytes.checked_add(self.alignment - 1)? & !(self.alignment - 1))
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if !self.alignment.is_power_of_two() {
            return Err(format!(
                "alignment must be a power of two, got {}",
                self.alignment
            ));
        }
        if self.reserve >= self.capacity {
            return Err(format!(
                "reserve ({} bytes) must be smaller than capacity ({} bytes)",
                self.reserve, self.capacity
            ));
        }
        if !self.capacity.is_multiple_of(self.alignment)
            || !self.reserve.is_multiple_of(self.alignment)
        {
            return Err(format!(
                "capacity ({}) and reserve ({}) must be multiples of the alignment ({})",
                self.capacity, self.reserve, self.alignment
            ));
        }
        Ok(())
    }
}

/// Identifies a lane for its whole life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LaneId(pub u64);

impl fmt::Display for LaneId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lane {}", self.0)
    }
}

/// A contiguous byte range of device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub size: u64,
}

impl Extent {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }

    /// True when the two ranges share at least one byte.
    pub fn overlaps(&self, other: &Extent) -> bool {
        self.offset < other.end() && other.offset < self.end()
    }
}

/// What occupies one region of the memory map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RegionKind {
    /// A session's persistent tensors.
    Persistent {
        /// Owner.
        session: SessionId,
    },
    /// A free hole inside the persistent region.
    Hole,
    /// Free memory between the persistent region and the lanes, or between lanes that
    /// have not yet moved up.
    Free,
    /// A lane: ephemeral memory of the sessions assigned to it.
    Lane {
        /// Which lane.
        lane: LaneId,
        /// Sessions assigned to it.
        sessions: Vec<SessionId>,
    },
}

/// One region of the memory map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Where it is.
    #[serde(flatten)]
    pub extent: Extent,
    /// What is there.
    #[serde(flatten)]
    pub kind: RegionKind,
}

/// The physical layout of device memory at one moment: regions in offset order, covering
/// `[0, capacity)` exactly, plus the accounting the safety condition uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryMap {
    /// C.
    pub capacity: u64,
    /// Bytes kept free.
    pub reserve: u64,
    /// Sum of P over admitted sessions.
    pub persistent_bytes: u64,
    /// Sum of L over lanes (their sizes, placed or about to be).
    pub lane_bytes: u64,
    /// `capacity - reserve - persistent_bytes - lane_bytes`: what admission can still use.
    pub available_bytes: u64,
    /// Regions in offset order.
    pub regions: Vec<Region>,
}

impl MemoryMap {
    /// Sum of all region sizes; equals `capacity` by construction.
    pub fn total(&self) -> u64 {
        self.regions.iter().map(|r| r.extent.size).sum()
    }
}

/// Why a session waits for admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WaitReason {
    /// The daemon is draining: nothing new is admitted.
    Draining,
    /// FIFO runs one session at a time and another holds the device.
    DeviceBusy {
        /// The session on the device.
        running: SessionId,
    },
    /// The policy admits strictly in its order (FIFO: arrival; SRTF: shortest first) and
    /// a session ahead of this one waits.
    BehindEarlier {
        /// The first waiting session in the policy's order.
        first: SessionId,
        /// The policy whose order it is.
        policy: PolicyKind,
    },
    /// Admitting the session would break the safety condition.
    Memory {
        /// P + E, aligned.
        needed: u64,
        /// Bytes admission can still use.
        available: u64,
        /// `capacity - reserve`.
        usable: u64,
    },
    /// The bytes are there, but not in one piece yet: a hole in the persistent region is
    /// too small or lanes have still to move up.
    Fragmented {
        /// P + E, aligned.
        needed: u64,
        /// Bytes admission can still use.
        available: u64,
    },
    /// An offline session waits while an online session waits for admission.
    OnlineFirst {
        /// The first waiting online session.
        first: SessionId,
    },
    /// An offline session waits until the device is healthy again.
    OfflineHealth {
        /// The health state that keeps offline sessions out.
        health: HealthState,
    },
    /// Admitting the offline session would take offline sessions past their share.
    OfflineShare {
        /// Bytes its admission would add to the offline sessions' total.
        needed: u64,
        /// Bytes offline sessions hold now.
        held: u64,
        /// The most offline sessions may hold together.
        limit: u64,
    },
}

impl fmt::Display for WaitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitReason::Draining => {
                f.write_str("the daemon is draining and admits no new sessions")
            }
            WaitReason::DeviceBusy { running } => write!(
                f,
                "policy fifo runs one session at a time and {running} holds the device"
            ),
            WaitReason::BehindEarlier { first, policy } => write!(
                f,
                "policy {policy} admits strictly in its order and {first} is waiting ahead"
            ),
            WaitReason::Memory {
                needed,
                available,
                usable,
            } => write!(
                f,
                "waiting for memory: needs {needed} bytes (persistent + ephemeral), \
                 {available} of {usable} usable bytes are free"
            ),
            WaitReason::OnlineFirst { first } => write!(
                f,
                "offline sessions wait while online {first} waits for admission"
            ),
            WaitReason::OfflineHealth { health } => write!(
                f,
                "offline sessions are not admitted while the device is {health} (protection of \
                 online sessions)"
            ),
            WaitReason::OfflineShare {
                needed,
                held,
                limit,
            } => write!(
                f,
                "waiting for the offline share: needs {needed} more bytes, offline sessions \
                 hold {held} of the {limit} they may hold together"
            ),
            WaitReason::Fragmented { needed, available } => write!(
                f,
                "waiting for memory to defragment: needs {needed} bytes and {available} are \
                 free, but not yet in one piece"
            ),
        }
    }
}

/// Why a session was rejected outright.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectReason {
    /// P, aligned (saturating at `u64::MAX`).
    pub persistent_bytes: u64,
    /// E, aligned (saturating at `u64::MAX`).
    pub ephemeral_bytes: u64,
    /// C.
    pub capacity: u64,
    /// The reserve.
    pub reserve: u64,
    /// For an offline session: the most offline sessions may hold together, which it
    /// exceeds alone.
    #[serde(default)]
    pub offline_limit: Option<u64>,
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(limit) = self.offline_limit {
            return write!(
                f,
                "offline session can never fit: it needs {} persistent + {} ephemeral = {} \
                 bytes, but offline sessions may hold at most {limit} bytes together (their \
                 share of the device)",
                self.persistent_bytes,
                self.ephemeral_bytes,
                self.persistent_bytes.saturating_add(self.ephemeral_bytes),
            );
        }
        write!(
            f,
            "session can never fit: it needs {} persistent + {} ephemeral = {} bytes, but the \
             device has {} bytes with {} reserved, so at most {} bytes are usable",
            self.persistent_bytes,
            self.ephemeral_bytes,
            self.persistent_bytes.saturating_add(self.ephemeral_bytes),
            self.capacity,
            self.reserve,
            self.capacity - self.reserve
        )
    }
}
