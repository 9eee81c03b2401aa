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

/// The cpu device of a 64 MiB arena.
fn cpu() -> Arc<dyn salus_exec::Device> {
    let mut config = salusd::Config::new("unused.sock".into());
    config.memory = 64 << 20;
    salusd::open_device(&config).unwrap()
}

fn start() -> Engine {
    start_on(cpu())
}

fn start_on(device: Arc<dyn salus_exec::Device>) -> Engine {
    Engine::start(EngineConfig {
        memory: MemoryConfig::new(device.capacity(), 0),
        device: Arc::clone(&device),
        policy: PolicyKind::Pack,
        protection: salus_core::ProtectionConfig::default(),
        limits: salus_graph::Limits::default(),
        daemon_uid: DAEMON.uid,
        host_memory: 1 << 30,
        user_host_memory: 1 << 29,
        max_sessions_per_user: 4,
        open_timeout: std::time::Duration::from_secs(60),
    })
    .unwrap()
}

/// Opens an online training session of the regression sample (`rows` x 2 inputs, one
/// SGD step): its id, its updates and its persistent bytes.
fn open_regression(
    engine: &Engine,
    rows: u64,
) -> (
    u64,
    mpsc::UnboundedReceiver<Result<SessionUpdate, EngineError>>,
    u64,
) {
    let program = Program::new(samples::regression(rows, 2, 1, 0.1), engine.limits()).unwrap();
    let p = program.plan().persistent_bytes;
    let (tx, updates) = mpsc::unbounded_channel();
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
            class: salus_core::SessionClass::Online,
            hints: Hints::default(),
            updates: Box::new(move |update| drop(tx.send(update))),
            token: [7; 16],
            restored: None,
        })))
        .unwrap();
    (id, updates, p)
}

#[tokio::test]
async fn a_session_opens_is_admitted_runs_and_closes_without_grpc() {
    let engine = start();
    // One SGD step of y ~ x w with w = 0: loss = mean(y^2), and w moves by 0.1 * x^T y.
    let (id, mut updates, p) = open_regression(&engine, 2);

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
            program: 0,
            feeds: feeds(),
            writes: vec![],
            fetch_lengths: vec![],
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
            program: 0,
            feeds: feeds(),
            writes: vec![],
            fetch_lengths: vec![],
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
            program: 0,
            feeds: feeds(),
            writes: vec![],
            fetch_lengths: vec![],
            reply,
        })
        .await;
    assert!(
        matches!(gone, Err(EngineError::UnknownSession(s)) if s == id),
        "{gone:?}"
    );
    engine.shutdown(false).await;
}

#[tokio::test]
async fn writes_carried_by_an_iteration_apply_just_before_it_in_order() {
    let engine = start();
    let (id, mut updates, _) = open_regression(&engine, 2);
    assert!(matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Opened { .. }
    ));
    let feeds = || vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])];
    let run = |writes: Vec<(u32, Vec<u8>)>| {
        let (reply, answer) = tokio::sync::oneshot::channel();
        engine
            .send(Command::Run {
                principal: DAEMON,
                session: id,
                program: 0,
                feeds: feeds(),
                writes,
                fetch_lengths: vec![],
                reply,
            })
            .unwrap();
        answer
    };
    // Both submitted before either runs: the write waits for the first iteration, then
    // sets w = (1, 2), which fits y exactly: the second loss is 0.
    let first = run(vec![]);
    let second = run(vec![(0, f32s(&[1.0, 2.0]))]);
    assert_eq!(floats(&first.await.unwrap().unwrap().fetches[0]), vec![2.5]);
    assert_eq!(
        floats(&second.await.unwrap().unwrap().fetches[0]),
        vec![0.0]
    );

    // A bad write fails its iteration at once and changes nothing.
    let read_w = || async {
        let w = engine
            .ask(|reply| Command::Read {
                principal: DAEMON,
                session: id,
                tensors: vec![0],
                reply,
            })
            .await
            .unwrap();
        floats(&w[0].1)
    };
    let before = read_w().await;
    let short = run(vec![(0, f32s(&[5.0, 5.0])), (0, f32s(&[1.0]))])
        .await
        .unwrap();
    assert!(
        matches!(short, Err(EngineError::TensorSize { tensor: 0, .. })),
        "{short:?}"
    );
    let twice = run(vec![(0, f32s(&[5.0, 5.0])), (0, f32s(&[6.0, 6.0]))])
        .await
        .unwrap();
    assert!(
        matches!(twice, Err(EngineError::DuplicateTensor { tensor: 0, .. })),
        "{twice:?}"
    );
    let fetches = run(vec![(1 << 20, vec![])]).await.unwrap();
    assert!(
        matches!(fetches, Err(EngineError::UnknownTensor { .. })),
        "{fetches:?}"
    );
    assert_eq!(read_w().await, before);
}

#[tokio::test]
async fn a_session_runs_further_programs_on_its_own_persistent_tensors() {
    let engine = start();
    let (id, mut updates, _) = open_regression(&engine, 4);
    assert!(matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Opened { .. }
    ));
    let add = |graph| {
        let program = Box::new(Program::new(graph, engine.limits()).unwrap());
        engine.ask(move |reply| Command::AddProgram {
            principal: DAEMON,
            session: id,
            program,
            reply,
        })
    };
    // The same step for a batch of 2 rows instead of 4.
    assert_eq!(add(samples::regression(2, 2, 1, 0.1)).await.unwrap(), 1);
    let run = |program: u32, feeds: Vec<Vec<u8>>| {
        engine.ask(move |reply| Command::Run {
            principal: DAEMON,
            session: id,
            program,
            feeds,
            writes: vec![],
            fetch_lengths: vec![],
            reply,
        })
    };
    let small = run(1, vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])]).await;
    assert_eq!(floats(&small.unwrap().fetches[0]), vec![2.5]);
    // Program 0 sees the weights program 1 trained: w = (0.1, 0.2) after one step.
    let x = f32s(&[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    let big = run(0, vec![x, f32s(&[0.0; 4])]).await.unwrap();
    let w2 = 0.1f32 * 0.1 + 0.2 * 0.2;
    assert!((floats(&big.fetches[0])[0] - w2 / 4.0).abs() < 1e-7);

    // Refused: other persistent tensors, more scratch, a program that does not exist.
    let other = add(samples::regression(2, 3, 1, 0.1)).await;
    assert!(
        matches!(&other, Err(EngineError::ProgramMismatch { why, .. }) if why.contains("'w'")),
        "{other:?}"
    );
    let larger = add(samples::regression(64, 2, 1, 0.1)).await;
    assert!(
        matches!(larger, Err(EngineError::ProgramTooLarge { .. })),
        "{larger:?}"
    );
    let missing = run(7, vec![]).await;
    assert!(
        matches!(missing, Err(EngineError::UnknownProgram { count: 2, .. })),
        "{missing:?}"
    );
    // A stranger may not add programs to someone's session.
    let program =
        Box::new(Program::new(samples::regression(2, 2, 1, 0.1), engine.limits()).unwrap());
    let denied = engine
        .ask(move |reply| Command::AddProgram {
            principal: STRANGER,
            session: id,
            program,
            reply,
        })
        .await;
    assert!(matches!(denied, Err(EngineError::Denied(_))), "{denied:?}");
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

/// Once salusd shuts down, a request naming a session the shutdown closed is told salusd
/// is shutting down (UNAVAILABLE: come back after the restart), not that the session does
/// not exist (NOT_FOUND, which it said; found by the soak benchmark: a client whose
/// iteration arrived in that moment gave its session up).
#[tokio::test]
async fn sessions_closed_by_the_shutdown_answer_shutting_down() {
    let engine = start();
    let (id, mut updates, _) = open_regression(&engine, 2);
    assert!(matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Opened { .. }
    ));
    let unknown = id + 1000;
    engine.shutdown(false).await;
    for session in [id, unknown] {
        let run = engine
            .ask(|reply| Command::Run {
                principal: DAEMON,
                session,
                program: 0,
                feeds: vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])],
                writes: vec![],
                fetch_lengths: vec![],
                reply,
            })
            .await;
        assert!(
            matches!(run, Err(EngineError::ShuttingDown)),
            "{session}: {run:?}"
        );
    }
}

/// The cpu device with a load sensor that reads an SM clock at half its highest: what a
/// GPU held back by power reports through NVML.
struct HalfClock(Arc<dyn salus_exec::Device>);

struct HalfClockMonitor;

impl salus_exec::LoadMonitor for HalfClockMonitor {
    fn read(&mut self) -> Result<salus_exec::Load, String> {
        Ok(salus_exec::Load {
            sm_activity: Some(0.5),
            sm_clock: Some((750.0, 1500.0)),
        })
    }
}

impl salus_exec::Device for HalfClock {
    fn name(&self) -> String {
        self.0.name()
    }
    fn capacity(&self) -> u64 {
        self.0.capacity()
    }
    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), salus_exec::ExecError> {
        self.0.write(offset, bytes)
    }
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, salus_exec::ExecError> {
        self.0.read(offset, len)
    }
    fn run(
        &self,
        program: &Program,
        at: salus_exec::Placement,
        feeds: &[&[u8]],
    ) -> Result<salus_exec::Outcome, salus_exec::ExecError> {
        self.0.run(program, at, feeds)
    }
    fn load_monitor(&self) -> Result<Box<dyn salus_exec::LoadMonitor>, String> {
        Ok(Box::new(HalfClockMonitor))
    }
}

#[tokio::test]
async fn the_device_load_reaches_protection_while_online_work_runs() {
    let device: Arc<dyn salus_exec::Device> = Arc::new(HalfClock(cpu()));
    let engine = start_on(Arc::clone(&device));
    engine.watch_load(&*device, std::time::Duration::from_millis(5));
    let status = || engine.ask(Command::Status);
    // Read, but no online work yet: the device's load harms no one.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let report = status().await.unwrap();
    assert_eq!(report.protection.metrics.clock_factor, None);
    assert_eq!(report.protection.health, salus_core::HealthState::Healthy);

    let (id, mut updates, _) = open_regression(&engine, 2);
    while !matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Admitted { .. }
    ) {}
    engine
        .ask(|reply| Command::Run {
            principal: DAEMON,
            session: id,
            program: 0,
            feeds: vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])],
            writes: vec![],
            fetch_lengths: vec![],
            reply,
        })
        .await
        .unwrap();
    // Equation 2 for a clock at half the highest: 1 + 4 * (1350 - 750) / 1350.
    let expected = 1.0 + 4.0 * (1350.0 - 750.0) / 1350.0;
    let mut report = status().await.unwrap();
    for _ in 0..2000 {
        // The next reading after the online iteration moves the health state.
        if report.protection.health != salus_core::HealthState::Healthy {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        report = status().await.unwrap();
    }
    let factor = report.protection.metrics.clock_factor.unwrap();
    assert!((factor - expected).abs() < 1e-12, "{factor}");
    assert_eq!(report.protection.metrics.sm_activity, Some(0.5));
    assert_eq!(report.protection.health, salus_core::HealthState::Overlimit);
}
