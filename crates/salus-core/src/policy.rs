//! Scheduling policies: which waiting session is offered memory first, how many lanes the
//! lane finder may open, and which session of a lane runs its next iteration.
//!
//! A policy only orders and picks; the [`crate::Scheduler`] enforces memory safety and
//! iteration boundaries whatever the policy says, so a policy cannot break either.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::session::SessionView;

/// The policies salus ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// One session on the device at a time, in arrival order: the no-sharing baseline.
    Fifo,
    /// Admit every session the safety condition allows, a lane each where possible.
    Pack,
    /// Shortest remaining time first, preempting at iteration boundaries.
    Srtf,
    /// Time-share each lane so its sessions receive equal service.
    Fair,
    /// Pack every session memory allows into lanes (as PACK); memory and each lane go to
    /// the shortest remaining work first (as SRTF), and no ready session waits much longer
    /// than [`Share::MAX_WAIT`] for its next iteration. The daemon's default.
    Share,
}

impl PolicyKind {
    /// Every policy, in the order status output lists them.
    pub const ALL: [PolicyKind; 5] = [
        PolicyKind::Fifo,
        PolicyKind::Srtf,
        PolicyKind::Pack,
        PolicyKind::Fair,
        PolicyKind::Share,
    ];

    /// The policy a daemon starts with unless told otherwise: one that shares the device.
    pub const DEFAULT: PolicyKind = PolicyKind::Share;

    /// The lower-case name used on command lines and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Fifo => "fifo",
            PolicyKind::Pack => "pack",
            PolicyKind::Srtf => "srtf",
            PolicyKind::Fair => "fair",
            PolicyKind::Share => "share",
        }
    }

    /// The policy itself.
    pub fn policy(self) -> &'static dyn Policy {
        match self {
            PolicyKind::Fifo => &Fifo,
            PolicyKind::Pack => &Pack,
            PolicyKind::Srtf => &Srtf,
            PolicyKind::Fair => &Fair,
            PolicyKind::Share => &Share,
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("unknown policy {s:?}; expected one of fifo, pack, srtf, fair, share")
            })
    }
}

/// A scheduling policy.
pub trait Policy: Sync {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// How many lanes the lane finder (Salus Algorithm 2.1) may have open at once. With one
    /// lane, every admitted session time-shares it.
    fn max_lanes(&self) -> usize;

    /// True when only one session may be admitted at a time, strictly in arrival order.
    fn exclusive(&self) -> bool {
        false
    }

    /// True when a session may be admitted ahead of an earlier one (in admission order)
    /// that has to wait. Policies that run one iteration at a time gain nothing from
    /// backfilling and lose by it: a later session's persistent memory would delay the
    /// earlier one further.
    fn backfill(&self) -> bool {
        true
    }

    /// True when the first waiting session may take memory from idle admitted sessions
    /// that come after it in run order, by suspending them (their persistent tensors move
    /// to host memory until they are re-admitted).
    fn suspends(&self) -> bool {
        false
    }

    /// Order in which waiting sessions are offered memory (`Less` first).
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering;

    /// Where a ready session stands in its lane's run queue: the smallest key runs next,
    /// ties go to the smaller session id. The key depends only on the session's own
    /// accounting, so run queues stay ordered sets and picking the next iteration is
    /// logarithmic in the number of sessions.
    fn run_key(&self, session: &SessionView<'_>) -> RunKey;

    /// For a policy that [suspends](Policy::suspends): the order that decides which idle
    /// sessions come after a waiting one and may give it their memory (smallest first, the
    /// largest suspended first). The run order unless the policy says otherwise.
    fn suspension_key(&self, session: &SessionView<'_>) -> RunKey {
        self.run_key(session)
    }
}

/// Position in a lane's run queue; compared lexicographically, smallest first.
pub type RunKey = [u64; 3];

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Never-started sorts first, then the longest ago.
fn last_started(s: &SessionView<'_>) -> u64 {
    s.stats
        .last_started_at
        .map_or(0, |t| nanos(t).saturating_add(1))
}

fn arrival(a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
    a.stats
        .opened_at
        .cmp(&b.stats.opened_at)
        .then(a.id().cmp(&b.id()))
}

fn priority_then_arrival(a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
    b.spec
        .hints
        .priority
        .cmp(&a.spec.hints.priority)
        .then_with(|| arrival(a, b))
}

fn priority_then_shortest_remaining(a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
    b.spec
        .hints
        .priority
        .cmp(&a.spec.hints.priority)
        .then_with(|| shortest_remaining(a, b))
}

/// Shortest remaining time first; sessions of unknown length after every known one.
fn shortest_remaining(a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
    match (a.remaining_time(), b.remaining_time()) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
    .then_with(|| arrival(a, b))
}

/// First in, first out: the baseline without sharing.
#[derive(Debug, Clone, Copy)]
pub struct Fifo;

impl Policy for Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fifo
    }
    fn max_lanes(&self) -> usize {
        1
    }
    fn exclusive(&self) -> bool {
        true
    }
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
        arrival(a, b)
    }
    fn run_key(&self, s: &SessionView<'_>) -> RunKey {
        [nanos(s.stats.opened_at), 0, 0]
    }
}

/// Packs as many sessions as memory safety allows, each in its own lane where possible;
/// sessions that share a lane take turns, one iteration each.
#[derive(Debug, Clone, Copy)]
pub struct Pack;

impl Policy for Pack {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Pack
    }
    fn max_lanes(&self) -> usize {
        usize::MAX
    }
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
        priority_then_arrival(a, b)
    }
    fn run_key(&self, s: &SessionView<'_>) -> RunKey {
        // Round robin: the session that started longest ago (or never) goes next.
        [last_started(s), nanos(s.stats.opened_at), 0]
    }
}

/// Shortest remaining time first. All sessions share one lane, so the shortest job runs
/// alone at full speed and a longer one is preempted at its next iteration boundary. A
/// session is admitted whenever it alone fits: idle longer sessions are suspended to make
/// room. Admission goes shortest first without backfilling, so a longer job never takes
/// memory a shorter waiting one needs.
#[derive(Debug, Clone, Copy)]
pub struct Srtf;

impl Policy for Srtf {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Srtf
    }
    fn max_lanes(&self) -> usize {
        1
    }
    fn backfill(&self) -> bool {
        false
    }
    fn suspends(&self) -> bool {
        true
    }
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
        priority_then_shortest_remaining(a, b)
    }
    fn run_key(&self, s: &SessionView<'_>) -> RunKey {
        let remaining = s.remaining_time().map_or(u64::MAX, nanos);
        [remaining, nanos(s.stats.opened_at), 0]
    }
}

/// Equal service: all sessions time-share one lane and the one with the least service on
/// the lane's fair-share clock runs next. A session joining a lane, or coming back after
/// idling, starts at the lane's clock (the service of the session that started last), not
/// at what it had: it gets an equal share at once instead of monopolising the lane to make
/// up for time it was not there.
#[derive(Debug, Clone, Copy)]
pub struct Fair;

impl Policy for Fair {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fair
    }
    fn max_lanes(&self) -> usize {
        1
    }
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
        priority_then_arrival(a, b)
    }
    fn run_key(&self, s: &SessionView<'_>) -> RunKey {
        [
            nanos(s.virtual_service),
            last_started(s),
            nanos(s.stats.opened_at),
        ]
    }
}

/// Sharing by default: PACK's lanes with SRTF's order and a bound on waiting.
///
/// - **Lanes**: as many as memory allows (Salus Algorithm 2.1, a new lane first), so
///   sessions that leave the device's compute idle run side by side.
/// - **Admission**: priority, then shortest remaining time (sessions without hints after
///   every one with them, in arrival order); later sessions backfill the memory an earlier
///   one cannot use. When the first waiting session does not fit, idle admitted sessions
///   with more remaining work are suspended to host memory to make room (as SRTF).
/// - **Within a lane**: the ready session with the earliest *deadline* runs next, where a
///   session's deadline is its last start (its arrival, before the first) plus its
///   remaining time capped at [`Share::MAX_WAIT`]. A short job runs ahead of long ones, but
///   once a session has waited `MAX_WAIT` past its last start it goes before every session
///   that started after that, so no ready session starves. Sessions of unknown or long
///   remaining time take turns (round robin).
#[derive(Debug, Clone, Copy)]
pub struct Share;

impl Share {
    /// The longest a ready session's deadline lies after its last start: the bound on how
    /// long shorter sessions may keep it waiting in a shared lane.
    pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
}

impl Policy for Share {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Share
    }
    fn max_lanes(&self) -> usize {
        usize::MAX
    }
    fn suspends(&self) -> bool {
        true
    }
    fn admission_order(&self, a: &SessionView<'_>, b: &SessionView<'_>) -> Ordering {
        priority_then_shortest_remaining(a, b)
    }
    fn run_key(&self, s: &SessionView<'_>) -> RunKey {
        let slack = s
            .remaining_time()
            .map_or(Share::MAX_WAIT, |r| r.min(Share::MAX_WAIT));
        let since = s.stats.last_started_at.unwrap_or(s.stats.opened_at);
        [
            nanos(since).saturating_add(nanos(slack)),
            nanos(s.stats.opened_at),
            0,
        ]
    }
    fn suspension_key(&self, s: &SessionView<'_>) -> RunKey {
        // Higher priority first.
        let priority =
            u64::try_from(i64::from(i32::MAX) - i64::from(s.spec.hints.priority)).unwrap_or(0);
        let remaining = s.remaining_time().map_or(u64::MAX, nanos);
        [priority, remaining, nanos(s.stats.opened_at)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.name().parse::<PolicyKind>(), Ok(kind));
            assert_eq!(kind.policy().kind(), kind);
        }
        assert_eq!("FAIR".parse::<PolicyKind>(), Ok(PolicyKind::Fair));
        let err = "lifo".parse::<PolicyKind>().unwrap_err();
        assert!(
            err.contains("lifo") && err.contains("fifo, pack, srtf, fair, share"),
            "{err}"
        );
    }
}
