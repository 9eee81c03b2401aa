//! The engine driven directly, without gRPC or sockets: commands in, domain answers out.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use salus_core::{Hints, LaneId, MemoryConfig, PolicyKind, SessionId, SessionKind};
use salus_exec::Program;
use salus_graph::samples;
use salusd::auth::Principal;
use salusd::engine::{
    Command, Engine, EngineConfig, EngineError, NewSession, SessionState, SessionUpdate,
};
use tokio::sync::mpsc;

const DAEMON: Principal = Principal { uid: 1000 };
const STRANGER: Principal = Principal { uid: 1001 };

fn f32s(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn start() -> Engine {
    let mut config = salusd::Config::new("unused.sock".into());
    config.memory = 64 << 20;
    let device = salusd::open_device(&config).unwrap();
    Engine::start(EngineConfig {
        memory: MemoryConfig::new(device.capacity(), 0),
        device: Arc::clone(&device),
        policy: PolicyKind::Pack,
        limits: salus_graph::Limits::default(),
        daemon_uid: DAEMON.uid,
        host_memory: 1 << 30,
        user_host_memory: 1 << 29,
        max_sessions_per_user: 4,
        open_timeout: std::time::Duration::from_secs(60),
    })
    .unwrap()
}

#[tokio::test]
async fn a_session_opens_is_admitted_runs_and_closes_without_grpc() {
    let engine = start();
    // One SGD step of y ~ x w with w = 0: loss = mean(y^2), and w moves by 0.1 * x^T y.
    let program = Program::new(samples::regression(2, 2, 1, 0.1), engine.limits()).unwrap();
    let p = program.plan().persistent_bytes;
    let (tx, mut updates) = mpsc::unbounded_channel();
    let id = engine.new_session_id();
    engine
        .send(Command::Open(Box::new(NewSession {
            id,
            owner: DAEMON,
            image: salusd::engine::HostImage {
                bytes: vec![0; p as usize],
                held: engine.quotas().reserve(DAEMON, p).unwrap(),
            },
            slot: engine.quotas().open_session(DAEMON).unwrap(),
            program,
            kind: SessionKind::Training,
            hints: Hints {
                name: "regression".into(),
                ..Hints::default()
            },
            updates: Box::new(move |update| drop(tx.send(update))),
        })))
        .unwrap();

    // open -> admit
    assert!(matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Opened { session, persistent_bytes, .. }
            if session == SessionId(id) && persistent_bytes == p
    ));
    assert!(matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Admitted {
            lane: LaneId(0),
            resumed: false,
            ..
        }
    ));

    // run: only the owner (or root) may; the answer is the fetched loss.
    let feeds = || vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])];
    let refused = engine
        .ask(|reply| Command::Run {
            principal: STRANGER,
            session: id,
            feeds: feeds(),
            reply,
        })
        .await;
    assert!(
        matches!(refused, Err(EngineError::Denied(_))),
        "{refused:?}"
    );
    let result = engine
        .ask(|reply| Command::Run {
            principal: DAEMON,
            session: id,
            feeds: feeds(),
            reply,
        })
        .await
        .unwrap();
    assert_eq!(floats(&result.fetches[0]), vec![2.5]);
    let w = engine
        .ask(|reply| Command::Read {
            principal: DAEMON,
            session: id,
            tensors: vec![0],
            reply,
        })
        .await
        .unwrap();
    let w = floats(&w[0].1);
    // A read names each tensor once: it is at most the session's P bytes.
    let repeated = engine
        .ask(|reply| Command::Read {
            principal: DAEMON,
            session: id,
            tensors: vec![0; 1024],
            reply,
        })
        .await;
    assert!(
        matches!(
            repeated,
            Err(EngineError::DuplicateTensor {
                request: "ReadTensors",
                tensor: 0
            })
        ),
        "{repeated:?}"
    );
    assert!(
        (w[0] - 0.1).abs() < 1e-6 && (w[1] - 0.2).abs() < 1e-6,
        "{w:?}"
    );
    let reports = engine.ask(Command::Sessions).await.unwrap();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].state, SessionState::Admitted);
    assert_eq!(reports[0].iterations, 1);

    // Steering is for root and the daemon's user: the status shows the change.
    let refused = engine
        .ask(|reply| Command::Policy {
            principal: STRANGER,
            policy: Some(PolicyKind::Fair),
            reply,
        })
        .await;
    assert!(
        matches!(refused, Err(EngineError::Denied(_))),
        "{refused:?}"
    );
    let policy = engine
        .ask(|reply| Command::Policy {
            principal: DAEMON,
            policy: Some(PolicyKind::Fair),
            reply,
        })
        .await
        .unwrap();
    assert_eq!(policy, PolicyKind::Fair);
    assert_eq!(
        engine.ask(Command::Status).await.unwrap().policy,
        PolicyKind::Fair
    );

    // close: the update stream ends and the memory is free.
    engine
        .ask(|reply| Command::Close {
            principal: DAEMON,
            session: id,
            reply: Some(reply),
        })
        .await
        .unwrap();
    assert!(
        updates.recv().await.is_none(),
        "the engine let go of the sink"
    );
    assert!(engine.ask(Command::Sessions).await.unwrap().is_empty());
    let status = engine.ask(Command::Status).await.unwrap();
    assert_eq!(status.map.persistent_bytes + status.map.lane_bytes, 0);
    assert!(
        status.quotas.users.is_empty() && status.quotas.host_bytes == 0,
        "the session's place and host memory are given back: {:?}",
        status.quotas
    );
    let gone = engine
        .ask(|reply| Command::Run {
            principal: DAEMON,
            session: id,
            feeds: feeds(),
            reply,
        })
        .await;
    assert!(
        matches!(gone, Err(EngineError::UnknownSession(s)) if s == id),
        "{gone:?}"
    );
    engine.shutdown().await;
}

/// Session ids are never the small counter they were: each engine starts at a random
/// point, so a daemon restarted does not hand an old client's id to someone else's
/// session.
#[tokio::test]
async fn session_ids_start_anew_at_random_and_stay_json_safe() {
    let (first, second) = (start(), start());
    let (a, b) = (first.new_session_id(), second.new_session_id());
    assert_ne!(a, b, "two engines, two series of ids");
    assert_eq!(first.new_session_id(), a + 1, "unique within an engine");
    for id in [a, b] {
        assert!(id > 1 << 20, "{id}: not a small counter");
        assert!(id < 1 << 53, "{id}: past what JSON doubles hold exactly");
    }
}
