//! Surviving a restart: a session's snapshot (what the state directory keeps of it),
//! sessions restored from snapshots as orphans, and a client reattaching to one with its
//! token.

use salus_core::SessionId;

use super::reports::SessionUpdate;
use super::{EngineError, Place, State, UpdateSink};
use crate::auth::Principal;
use crate::state::Snapshot;

impl State {
    /// Everything a snapshot keeps of a session that is not running now: its programs,
    /// its persistent block (from the device or the host), and the iterations it has done.
    pub(super) fn snapshot(&self, id: SessionId) -> Result<Snapshot, EngineError> {
        let entry = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let p = entry.program().plan().persistent_bytes;
        let block = match (&entry.image, entry.place) {
            (Some(image), _) => image.bytes.clone(),
            (None, Place::Admitted { persistent }) => {
                self.device.read(persistent, p).map_err(EngineError::Exec)?
            }
            (None, _) => return Err(EngineError::NoTensorCopy(id.0)),
        };
        let done = self
            .core
            .session(id)
            .map_or(0, |view| view.stats.completed_iterations);
        Ok(Snapshot {
            id: id.0,
            owner: entry.owner.uid,
            kind: self
                .core
                .session(id)
                .map_or(salus_core::SessionKind::Training, |view| view.spec.kind),
            class: self
                .core
                .session(id)
                .map_or(salus_core::SessionClass::Online, |view| view.spec.class),
            hints: entry.hints.clone(),
            token: entry.token,
            iterations: entry.iterations_before + done,
            programs: entry.programs.iter().map(|p| p.graph().clone()).collect(),
            block,
        })
    }

    /// Snapshots of every session (none may be running).
    pub(super) fn snapshot_all(&self) -> Vec<Snapshot> {
        let mut states = Vec::new();
        for &id in self.sessions.keys() {
            match self.snapshot(id) {
                Ok(state) => states.push(state),
                Err(error) => tracing::error!(session = id.0, %error, "no snapshot"),
            }
        }
        states
    }

    /// A client takes back a session restored from a snapshot: its updates go to
    /// `updates` from now on, starting with `opened` (its token and the iterations the
    /// snapshot holds) and where it stands.
    pub(super) fn reattach(
        &mut self,
        principal: Principal,
        session: u64,
        token: &[u8],
        updates: UpdateSink,
    ) -> Result<(), EngineError> {
        let id = SessionId(session);
        let stopping = self.stopping;
        let entry = self.sessions.get_mut(&id).ok_or(if stopping {
            EngineError::ShuttingDown
        } else {
            EngineError::UnknownSession(session)
        })?;
        principal.check_session(session, entry.owner)?;
        if !same_secret(&entry.token, token) {
            return Err(EngineError::WrongToken(session));
        }
        if !entry.orphan {
            return Err(EngineError::Attached(session));
        }
        entry.orphan = false;
        entry.updates = updates;
        let plan = entry.program().plan();
        let done = self
            .core
            .session(id)
            .map_or(0, |view| view.stats.completed_iterations);
        entry.send(SessionUpdate::Opened {
            session: id,
            persistent_bytes: plan.persistent_bytes,
            ephemeral_bytes: plan.ephemeral_bytes,
            token: entry.token,
            iterations: entry.iterations_before + done,
        });
        match (entry.place, self.core.lane_of(id)) {
            (Place::Admitted { .. }, Some(lane)) => {
                let lane_bytes = self
                    .core
                    .lanes()
                    .into_iter()
                    .find(|l| l.id == lane)
                    .map_or(0, |l| l.size);
                entry.send(SessionUpdate::Admitted {
                    lane,
                    lane_bytes,
                    resumed: false,
                });
            }
            (Place::Suspended, _) => entry.send(SessionUpdate::Suspended),
            _ => entry.send(SessionUpdate::Queued {
                reason: entry.reason.clone(),
            }),
        }
        tracing::info!(session, owner = principal.uid, "reattached");
        Ok(())
    }

    /// Closes a restored session nobody reattached to in time.
    pub(super) fn expire_orphan(&mut self, session: u64) {
        if self
            .sessions
            .get(&SessionId(session))
            .is_some_and(|entry| entry.orphan)
        {
            self.close(SessionId(session), "no client reattached after the restart");
        }
    }
}

/// Compares secrets in time that depends only on their lengths.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
