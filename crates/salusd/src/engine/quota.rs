//! What sessions may hold on the host, in all and per user.
//!
//! A session that is not on the device keeps its persistent block in host memory: while
//! its client uploads it (opening), while it waits for admission, and while the policy has
//! suspended it. All of that counts against `--host-memory`, and each user's share against
//! `--user-host-memory`; each user may also have at most `--max-sessions-per-user` sessions
//! open or opening. So one user cannot fill the host, or the queue, for everyone else.
//!
//! Root and the daemon's own user (and TCP clients with the token, who act as it) are
//! counted but not limited per user: they run the daemon and may steer it.
//!
//! The service reserves a session's place and bytes as its `Open` stream arrives, before
//! it keeps any tensor bytes; the engine forces room for the suspensions the policy
//! decides. Each reservation is a value that gives its share back when dropped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::EngineError;
use crate::auth::Principal;

/// The limits, as salusd was started with them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaConfig {
    /// Host bytes all sessions off the device may hold (`--host-memory`).
    pub host_memory: u64,
    /// Host bytes one user's sessions off the device may hold (`--user-host-memory`).
    pub user_host_memory: u64,
    /// Sessions one user may have open or opening (`--max-sessions-per-user`).
    pub max_sessions_per_user: u64,
    /// The daemon's own uid: it and root are not limited per user.
    pub daemon_uid: u32,
}

impl QuotaConfig {
    /// Whether the per-user limits apply to `user`.
    pub fn limits(&self, user: Principal) -> bool {
        !user.may_steer(self.daemon_uid)
    }
}

/// What one user holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UserUsage {
    /// Sessions open or opening.
    pub sessions: u64,
    /// Of those, sessions whose `Open` stream has not committed yet.
    pub opening: u64,
    /// Host bytes reserved for the opening ones.
    pub opening_bytes: u64,
    /// Host bytes held by its opening, waiting and suspended sessions.
    pub host_bytes: u64,
}

impl UserUsage {
    fn is_empty(&self) -> bool {
        *self == UserUsage::default()
    }
}

/// The numbers status and metrics show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaReport {
    /// The limits.
    pub config: QuotaConfig,
    /// Host bytes held in all.
    pub host_bytes: u64,
    /// Sessions opening in all.
    pub opening: u64,
    /// Host bytes reserved for opening sessions in all.
    pub opening_bytes: u64,
    /// Per user (uid, usage), by uid; users holding nothing are left out.
    pub users: Vec<(u32, UserUsage)>,
}

#[derive(Debug, Default)]
struct Ledger {
    host_bytes: u64,
    users: BTreeMap<u32, UserUsage>,
}

impl Ledger {
    fn user(&mut self, uid: u32) -> &mut UserUsage {
        self.users.entry(uid).or_default()
    }

    /// Applies `change` to `uid`'s usage, forgetting users who hold nothing.
    fn change(&mut self, uid: u32, change: impl FnOnce(&mut UserUsage)) {
        let usage = self.user(uid);
        change(usage);
        if usage.is_empty() {
            self.users.remove(&uid);
        }
    }
}

type Shared = Arc<Mutex<Ledger>>;

fn lock(ledger: &Shared) -> MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The ledger: shared by the service (which reserves as `Open` streams arrive) and the
/// engine (which forces room for suspensions).
#[derive(Debug, Clone)]
pub struct Quotas {
    ledger: Shared,
    config: QuotaConfig,
}

/// Host bytes counted against the limits until dropped.
#[derive(Debug)]
pub struct HostBytes {
    ledger: Shared,
    uid: u32,
    bytes: u64,
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        let mut ledger = lock(&self.ledger);
        ledger.host_bytes = ledger.host_bytes.saturating_sub(self.bytes);
        let bytes = self.bytes;
        ledger.change(self.uid, |u| {
            u.host_bytes = u.host_bytes.saturating_sub(bytes)
        });
    }
}

/// One of a user's sessions, counted from its `open` until it is gone; while opening,
/// also the bytes reserved for its upload.
#[derive(Debug)]
pub struct SessionSlot {
    ledger: Shared,
    uid: u32,
    /// `Some(bytes reserved)` until the `Open` stream commits.
    opening: Option<u64>,
}

impl SessionSlot {
    /// Records the bytes reserved for the upload (shown as opening bytes).
    pub fn uploading(&mut self, bytes: u64) {
        if let Some(held) = self.opening.as_mut() {
            let before = std::mem::replace(held, bytes);
            let mut ledger = lock(&self.ledger);
            ledger.change(self.uid, |u| {
                u.opening_bytes = u.opening_bytes.saturating_sub(before) + bytes;
            });
        }
    }

    /// The `Open` stream committed: the session is open, no longer opening.
    pub fn committed(&mut self) {
        if let Some(bytes) = self.opening.take() {
            lock(&self.ledger).change(self.uid, |u| {
                u.opening = u.opening.saturating_sub(1);
                u.opening_bytes = u.opening_bytes.saturating_sub(bytes);
            });
        }
    }
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.committed();
        lock(&self.ledger).change(self.uid, |u| u.sessions = u.sessions.saturating_sub(1));
    }
}

impl Quotas {
    /// A ledger with these limits, holding nothing.
    pub fn new(config: QuotaConfig) -> Quotas {
        Quotas {
            ledger: Arc::default(),
            config,
        }
    }

    /// The limits.
    pub fn config(&self) -> &QuotaConfig {
        &self.config
    }

    /// Counts a new session of `owner`, opening, if the user may have one more.
    pub fn open_session(&self, owner: Principal) -> Result<SessionSlot, EngineError> {
        let mut ledger = lock(&self.ledger);
        let usage = ledger.user(owner.uid);
        let limit = self.config.max_sessions_per_user;
        if self.config.limits(owner) && usage.sessions >= limit {
            let sessions = usage.sessions;
            return Err(EngineError::UserSessions {
                uid: owner.uid,
                sessions,
                limit,
            });
        }
        usage.sessions += 1;
        usage.opening += 1;
        Ok(SessionSlot {
            ledger: self.ledger.clone(),
            uid: owner.uid,
            opening: Some(0),
        })
    }

    /// Counts `bytes` of `owner`'s if they fit both in all and in the user's share.
    pub fn reserve(&self, owner: Principal, bytes: u64) -> Result<HostBytes, EngineError> {
        let mut ledger = lock(&self.ledger);
        let limit = self.config.host_memory;
        if ledger
            .host_bytes
            .checked_add(bytes)
            .is_none_or(|t| t > limit)
        {
            return Err(EngineError::HostMemory {
                used: ledger.host_bytes,
                bytes,
                limit,
            });
        }
        let limit = self.config.user_host_memory;
        let used = ledger.users.get(&owner.uid).map_or(0, |u| u.host_bytes);
        if self.config.limits(owner) && used.checked_add(bytes).is_none_or(|t| t > limit) {
            return Err(EngineError::UserHostMemory {
                uid: owner.uid,
                used,
                bytes,
                limit,
            });
        }
        Ok(self.count(&mut ledger, owner, bytes))
    }

    /// Counts `bytes` of `owner`'s whatever the limits (a suspension the policy decided).
    pub fn force(&self, owner: Principal, bytes: u64) -> HostBytes {
        let mut ledger = lock(&self.ledger);
        self.count(&mut ledger, owner, bytes)
    }

    fn count(&self, ledger: &mut Ledger, owner: Principal, bytes: u64) -> HostBytes {
        ledger.host_bytes = ledger.host_bytes.saturating_add(bytes);
        let usage = ledger.user(owner.uid);
        usage.host_bytes = usage.host_bytes.saturating_add(bytes);
        HostBytes {
            ledger: self.ledger.clone(),
            uid: owner.uid,
            bytes,
        }
    }

    /// Host bytes held now, in all.
    pub fn used(&self) -> u64 {
        lock(&self.ledger).host_bytes
    }

    /// The limits and what each user holds now.
    pub fn report(&self) -> QuotaReport {
        let ledger = lock(&self.ledger);
        let users: Vec<(u32, UserUsage)> = ledger.users.iter().map(|(&u, &s)| (u, s)).collect();
        QuotaReport {
            config: self.config,
            host_bytes: ledger.host_bytes,
            opening: users.iter().map(|(_, u)| u.opening).sum(),
            opening_bytes: users.iter().map(|(_, u)| u.opening_bytes).sum(),
            users,
        }
    }
}

/// A session's persistent block on the host, counted against the limits.
#[derive(Debug)]
pub struct HostImage {
    /// The P bytes.
    pub bytes: Vec<u8>,
    /// Its share of the host memory.
    pub held: HostBytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAEMON: Principal = Principal { uid: 1000 };
    const ALICE: Principal = Principal { uid: 1001 };
    const BOB: Principal = Principal { uid: 1002 };

    fn quotas() -> Quotas {
        Quotas::new(QuotaConfig {
            host_memory: 100,
            user_host_memory: 60,
            max_sessions_per_user: 2,
            daemon_uid: DAEMON.uid,
        })
    }

    #[test]
    fn reservations_past_the_limits_are_refused_and_drops_give_back() {
        let q = quotas();
        let a = q.reserve(ALICE, 60).expect("fits");
        assert!(matches!(
            q.reserve(ALICE, 1),
            Err(EngineError::UserHostMemory {
                uid: 1001,
                used: 60,
                bytes: 1,
                limit: 60
            })
        ));
        let b = q.reserve(BOB, 40).expect("bob has his own share");
        assert!(matches!(
            q.reserve(DAEMON, 1),
            Err(EngineError::HostMemory {
                used: 100,
                bytes: 1,
                limit: 100
            })
        ));
        let forced = q.force(ALICE, 50);
        assert_eq!(q.used(), 150);
        assert_eq!(
            q.report().users[0],
            (
                1001,
                UserUsage {
                    host_bytes: 110,
                    ..UserUsage::default()
                }
            )
        );
        drop((a, b, forced));
        assert_eq!(q.used(), 0);
        assert!(q.report().users.is_empty());
    }

    #[test]
    fn sessions_per_user_are_limited_but_not_for_the_daemons_user_or_root() {
        let q = quotas();
        let mut first = q.open_session(ALICE).expect("first");
        first.uploading(30);
        let _second = q.open_session(ALICE).expect("second");
        assert!(matches!(
            q.open_session(ALICE),
            Err(EngineError::UserSessions {
                uid: 1001,
                sessions: 2,
                limit: 2
            })
        ));
        let report = q.report();
        assert_eq!((report.opening, report.opening_bytes), (2, 30));
        first.committed();
        assert_eq!(q.report().opening, 1);
        let privileged: Vec<SessionSlot> = (0..5)
            .flat_map(|_| [q.open_session(DAEMON), q.open_session(Principal { uid: 0 })])
            .collect::<Result<_, _>>()
            .expect("not limited");
        assert!(
            q.reserve(DAEMON, 100).is_ok(),
            "nor held to the per-user share"
        );
        drop(first);
        assert!(
            q.open_session(ALICE).is_ok(),
            "a closed session gives its place back"
        );
        drop(privileged);
    }
}
