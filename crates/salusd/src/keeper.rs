//! Keeping sessions across restarts (`--state-dir`): restoring the snapshots found at
//! start as sessions that wait for their clients to reattach, taking snapshots while the
//! daemon runs, and forgetting those of sessions that close.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::auth::Principal;
use crate::engine::{Command, Engine, EventKind, HostImage, Kept, NewSession, Restored};
use crate::state::{self, Snapshot};

/// Brings back every session snapshotted in `dir`; a session nobody reattaches to within
/// `reattach_timeout` is closed. A snapshot that cannot come back is set aside. Returns
/// how many came back.
pub async fn restore(engine: &Engine, dir: &Path, reattach_timeout: Duration) -> usize {
    let found = {
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || state::read_all(&dir))
            .await
            .unwrap_or_default()
    };
    let (restored, refused) = restore_snapshots(engine, found, reattach_timeout);
    for (id, why) in &refused {
        tracing::error!(session = id, %why, "session snapshot not restored");
        state::set_aside(dir, *id);
    }
    if restored > 0 {
        tracing::info!(
            restored,
            ?reattach_timeout,
            "sessions restored; waiting for their clients"
        );
    }
    restored
}

/// Brings back `snapshots` as sessions waiting for their clients (each closed if nobody
/// reattaches within `reattach_timeout`); returns how many came back, and those that
/// cannot, with why (the rest, if the engine stopped, are left as they were). Runs on the
/// engine's runtime.
pub fn restore_snapshots(
    engine: &Engine,
    snapshots: Vec<Snapshot>,
    reattach_timeout: Duration,
) -> (usize, Vec<(u64, String)>) {
    let (mut restored, mut refused) = (0, Vec::new());
    for snapshot in snapshots {
        let id = snapshot.id;
        match bring_back(engine, snapshot) {
            Ok(session) => {
                if engine.send(Command::Open(Box::new(session))).is_err() {
                    break;
                }
                restored += 1;
                let engine = engine.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(reattach_timeout).await;
                    let _ = engine.send(Command::ExpireOrphan(id));
                });
            }
            Err(why) => refused.push((id, why)),
        }
    }
    (restored, refused)
}

/// A snapshot as a session for the engine: its programs planned again for this device,
/// its block held in host memory until it is admitted.
fn bring_back(engine: &Engine, snapshot: Snapshot) -> Result<NewSession, String> {
    let owner = Principal {
        uid: snapshot.owner,
    };
    let mut programs = snapshot
        .programs
        .into_iter()
        .map(|graph| {
            engine
                .plan(graph)
                .map_err(|e| format!("planning a program: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if programs.is_empty() {
        return Err("it holds no program".into());
    }
    let first = programs.remove(0);
    let p = first.plan().persistent_bytes;
    if snapshot.block.len() as u64 != p {
        return Err(format!(
            "its block has {} bytes; its program plans {p} on this device",
            snapshot.block.len()
        ));
    }
    let mut slot = engine
        .quotas()
        .open_session(owner)
        .map_err(|e| e.to_string())?;
    slot.committed();
    let held = engine
        .quotas()
        .reserve(owner, p)
        .map_err(|e| e.to_string())?;
    Ok(NewSession {
        id: snapshot.id,
        owner,
        program: first.with_expected_iteration(snapshot.hints.expected_iteration),
        image: HostImage {
            bytes: snapshot.block,
            held,
        },
        slot,
        kind: snapshot.kind,
        class: snapshot.class,
        hints: snapshot.hints,
        // Nobody listens until its client reattaches.
        updates: Box::new(|_| {}),
        token: snapshot.token,
        restored: Some(Restored {
            iterations: snapshot.iterations,
            programs,
        }),
    })
}

/// Keeps `dir` up to date while the daemon runs: a snapshot of every session each
/// `every` (never, if zero), and a closed session's snapshot removed at once.
pub async fn keep(engine: Engine, dir: PathBuf, every: Duration) {
    let mut events = engine.subscribe();
    let mut ticks = (!every.is_zero()).then(|| {
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval
    });
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Ok(event) if event.kind == EventKind::Closed => {
                    if let Some(session) = event.session {
                        state::remove(&dir, session.0);
                    }
                }
                Ok(_) => {}
                // Closed events may be among those missed: forget every snapshot of a
                // session that is gone, or the next start would bring it back.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "the state keeper fell behind the events; pruning");
                    if let Ok(sessions) = engine.ask(Command::Sessions).await {
                        let open: Vec<u64> = sessions.iter().map(|s| s.id.0).collect();
                        prune(&dir, &open).await;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
            _ = async { ticks.as_mut().expect("only polled when set").tick().await },
                if ticks.is_some() => snapshot_all(&engine, &dir).await,
        }
    }
}

/// Snapshots every session now (each between two of its iterations).
pub async fn snapshot_all(engine: &Engine, dir: &Path) {
    let Ok(sessions) = engine.ask(Command::Sessions).await else {
        return;
    };
    for report in sessions {
        let session = report.id.0;
        let Ok(snapshot) = engine
            .ask(|reply| Command::Snapshot { session, reply })
            .await
        else {
            continue;
        };
        write(dir, vec![snapshot]).await;
    }
}

/// Removes from `dir` the snapshot of every session not in `open`, off the async workers.
pub async fn prune(dir: &Path, open: &[u64]) {
    let dir = dir.to_path_buf();
    let open = open.to_vec();
    let _ = tokio::task::spawn_blocking(move || {
        for id in state::ids(&dir) {
            if !open.contains(&id) {
                state::remove(&dir, id);
            }
        }
    })
    .await;
}

/// At shutdown: writes what was kept and forgets every other session's snapshot, so that
/// `dir` holds only sessions open when salusd stopped (one closed since an earlier
/// snapshot while nothing watched, or whose Closed event the keeper missed, must not come
/// back at the next start). A session open without a new snapshot (its device failed)
/// keeps its last one.
pub async fn keep_only(dir: &Path, kept: Kept) {
    write(dir, kept.snapshots).await;
    prune(dir, &kept.open).await;
}

/// Writes snapshots into `dir`, off the async workers.
pub async fn write(dir: &Path, snapshots: Vec<Snapshot>) {
    let dir = dir.to_path_buf();
    let _ = tokio::task::spawn_blocking(move || {
        for snapshot in snapshots {
            if let Err(error) = state::write(&dir, &snapshot) {
                tracing::error!(session = snapshot.id, %error, "writing a session snapshot");
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn snapshot(id: u64) -> Snapshot {
        Snapshot {
            id,
            owner: 1000,
            kind: salus_core::SessionKind::Training,
            class: salus_core::SessionClass::Offline,
            hints: salus_core::Hints::default(),
            token: [1; 16],
            iterations: 3,
            programs: vec![salus_graph::samples::regression(2, 2, 1, 0.1)],
            block: vec![0; 16],
        }
    }

    /// A snapshot of a session closed while nothing watched (the keeper stopped for the
    /// shutdown, or behind the events) was left in the directory, and the next start
    /// brought the closed session back (found by the soak benchmark). At shutdown the
    /// directory keeps only the sessions then open; one open without a new snapshot (on a
    /// failed device) keeps its last.
    #[tokio::test]
    async fn at_shutdown_only_the_open_sessions_stay_in_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        for id in [1, 2, 3] {
            state::write(dir.path(), &snapshot(id)).unwrap();
        }
        let mut newer = snapshot(2);
        newer.iterations = 9;
        keep_only(
            dir.path(),
            Kept {
                snapshots: vec![newer],
                open: vec![2, 3],
            },
        )
        .await;
        let mut ids = state::ids(dir.path());
        ids.sort_unstable();
        assert_eq!(ids, vec![2, 3]);
        let back = state::read_all(dir.path());
        assert_eq!(
            back.iter().map(|s| s.iterations).collect::<Vec<_>>(),
            [9, 3]
        );
    }
}
