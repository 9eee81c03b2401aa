//! The scheduling core of salus: memory lanes, admission, iteration scheduling, policies.
//!
//! Owns every decision about device memory and about whose iteration runs next: the
//! persistent region (best-fit, coalescing), the lanes stacked down from the top of memory
//! (Salus Algorithm 2.1, reference counting, auto-defragmentation), the admission queue
//! with a reason for every wait, per-lane run queues, and the FIFO, PACK, SRTF and FAIR
//! policies, and SHARE (PACK's lanes with SRTF's order and a bounded wait; the daemon's
//! default). Its [`protection`] module keeps offline (best-effort) sessions from hurting
//! online ones, as MuxFlow does: a memory share, a PID controller and a health state
//! machine. Its [`serving`] module decides, for a served model, which inference requests
//! form each batch (ORLOJ and the schedulers it is compared with).
//!
//! It is sans-IO, like `quinn-proto`: no threads, sockets, clocks or sleeping. Time comes
//! in as an argument; decisions come out as [`Action`] values. The daemon, the simulator
//! and the tests drive this same code, so the same inputs always give the same outputs.
//! It does not execute anything and knows nothing of graphs or devices: those belong to
//! `salus-graph` and `salus-exec`.
//!
//! ```
//! use std::time::Duration;
//! use salus_core::{Action, Event, Hints, MemoryConfig, PolicyKind, Scheduler, SessionClass,
//!                  SessionId, SessionKind, SessionSpec};
//!
//! let mut core = Scheduler::new(MemoryConfig::new(1 << 30, 0), PolicyKind::Pack).unwrap();
//! let spec = SessionSpec {
//!     id: SessionId(1),
//!     kind: SessionKind::Training,
//!     class: SessionClass::Online,
//!     persistent_bytes: 100 << 20,
//!     ephemeral_bytes: 300 << 20,
//!     hints: Hints::default(),
//! };
//! core.handle(Duration::ZERO, Event::SessionOpened(spec)).unwrap();
//! core.handle(Duration::ZERO, Event::IterationSubmitted(SessionId(1))).unwrap();
//! let actions = core.poll();
//! assert!(matches!(actions[0], Action::Admit { session: SessionId(1), .. }));
//! assert!(matches!(actions.last(), Some(Action::StartIteration { session: SessionId(1), .. })));
//! ```

mod heap;
pub mod memory;
pub mod policy;
pub mod protection;
mod scheduler;
pub mod serving;
pub mod session;

pub use memory::{
    Extent, LaneId, MemoryConfig, MemoryMap, Region, RegionKind, RejectReason, WaitReason,
};
pub use policy::{Policy, PolicyKind, RunKey};
pub use protection::{DeviceSample, HealthState, ProtectionConfig, ProtectionStatus};
pub use scheduler::{Action, CoreError, Event, LaneChoice, LaneInfo, Scheduler};
pub use session::{
    Hints, SessionClass, SessionId, SessionKind, SessionSpec, SessionStats, SessionView,
};
