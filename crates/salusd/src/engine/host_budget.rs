//! Host memory held by sessions that are not on the device (their initial values before
//! admission, their tensors while suspended), counted against `--host-memory` so that
//! waiting sessions cannot exhaust the host.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::EngineError;

/// The budget: shared by the service (which reserves a session's initial image before
/// reading it) and the engine (which forces room for suspensions).
#[derive(Debug, Clone)]
pub struct HostBudget {
    used: Arc<AtomicU64>,
    limit: u64,
}

/// Bytes counted against a [`HostBudget`] until dropped.
#[derive(Debug)]
pub struct HostBytes {
    used: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Relaxed);
    }
}

impl HostBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> HostBudget {
        HostBudget {
            used: Arc::new(AtomicU64::new(0)),
            limit,
        }
    }

    /// Counts `bytes` if they fit, else says how much is held and allowed.
    pub fn reserve(&self, bytes: u64) -> Result<HostBytes, EngineError> {
        self.used
            .fetch_update(Relaxed, Relaxed, |used| {
                used.checked_add(bytes).filter(|&total| total <= self.limit)
            })
            .map_err(|used| EngineError::HostMemory {
                used,
                bytes,
                limit: self.limit,
            })?;
        Ok(HostBytes {
            used: self.used.clone(),
            bytes,
        })
    }

    /// Counts `bytes` whatever the limit (a suspension the policy decided).
    pub fn force(&self, bytes: u64) -> HostBytes {
        self.used.fetch_add(bytes, Relaxed);
        HostBytes {
            used: self.used.clone(),
            bytes,
        }
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }
}

/// A session's persistent block on the host, counted against the host budget.
#[derive(Debug)]
pub struct HostImage {
    /// The P bytes.
    pub bytes: Vec<u8>,
    /// Its share of the budget.
    pub held: HostBytes,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_past_the_limit_are_refused_and_drops_give_back() {
        let budget = HostBudget::new(100);
        let a = budget.reserve(60).expect("fits");
        assert!(matches!(
            budget.reserve(50),
            Err(EngineError::HostMemory {
                used: 60,
                bytes: 50,
                limit: 100
            })
        ));
        let forced = budget.force(50);
        assert_eq!(budget.used(), 110);
        drop((a, forced));
        assert_eq!(budget.used(), 0);
    }
}
