//! The engine keeps nothing of a session once it is closed: a counting global allocator
//! (live bytes), and thousands of sessions opened, run and closed one after another. What
//! the engine holds after the last one is what it held after the first hundred, within a
//! few bytes per session. Its own test binary, so no other test's allocations are counted.

#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

use salus_core::{Hints, MemoryConfig, PolicyKind, SessionKind};
use salus_exec::Program;
use salusd::auth::Principal;
use salusd::engine::{Command, Engine, EngineConfig, NewSession, SessionUpdate};
use tokio::sync::mpsc;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no
// effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: as for `alloc`; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const OWNER: Principal = Principal { uid: 1000 };

/// Opens a regression session, waits for its admission, runs one iteration, closes it.
async fn one_session(engine: &Engine) {
    let program = Program::new(
        salus_graph::samples::regression(2, 2, 1, 0.1),
        engine.limits(),
    )
    .unwrap();
    let p = program.plan().persistent_bytes;
    let (tx, mut updates) = mpsc::unbounded_channel();
    let id = engine.new_session_id();
    engine
        .send(Command::Open(Box::new(NewSession {
            id,
            owner: OWNER,
            image: salusd::engine::HostImage {
                bytes: vec![0; p as usize],
                held: engine.quotas().reserve(OWNER, p).unwrap(),
            },
            slot: engine.quotas().open_session(OWNER).unwrap(),
            program,
            kind: SessionKind::Training,
            class: salus_core::SessionClass::Online,
            hints: Hints {
                name: format!("churn-{id}"),
                ..Hints::default()
            },
            updates: Box::new(move |update| drop(tx.send(update))),
            token: [7; 16],
            restored: None,
        })))
        .unwrap();
    while !matches!(
        updates.recv().await.unwrap().unwrap(),
        SessionUpdate::Admitted { .. }
    ) {}
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    engine
        .ask(|reply| Command::Run {
            principal: OWNER,
            session: id,
            program: 0,
            feeds: vec![f32s(&[1.0, 0.0, 0.0, 1.0]), f32s(&[1.0, 2.0])],
            writes: vec![],
            fetch_lengths: vec![],
            reply,
        })
        .await
        .unwrap();
    engine
        .ask(|reply| Command::Close {
            principal: OWNER,
            session: id,
            reply: Some(reply),
        })
        .await
        .unwrap();
    assert!(updates.recv().await.is_none());
}

/// Sessions that come and go leave nothing behind in the engine: no per-session or
/// per-lane record outlives them (each session had a lane of its own under SHARE, and the
/// engine kept the end time of every lane it had ever run: about 60 bytes per session for
/// the daemon's life, found by the soak benchmark's slowly growing resident memory).
#[tokio::test(flavor = "current_thread")]
async fn thousands_of_sessions_leave_nothing_behind() {
    let mut config = salusd::Config::new("unused.sock".into());
    config.memory = 64 << 20;
    let device = salusd::open_device(&config).unwrap();
    let engine = Engine::start(EngineConfig {
        memory: MemoryConfig::new(device.capacity(), 0),
        device: Arc::clone(&device),
        policy: PolicyKind::Share,
        protection: salus_core::ProtectionConfig::default(),
        limits: salus_graph::Limits::default(),
        daemon_uid: OWNER.uid,
        host_memory: 1 << 30,
        user_host_memory: 1 << 29,
        max_sessions_per_user: 4,
        open_timeout: std::time::Duration::from_secs(60),
    })
    .unwrap();
    // Warm up: buffers and maps reach their working size.
    for _ in 0..200 {
        one_session(&engine).await;
    }
    let before = LIVE.load(Ordering::Relaxed);
    let sessions = 3000;
    for _ in 0..sessions {
        one_session(&engine).await;
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    assert!(
        grown < 8 * sessions,
        "{grown} bytes more live after {sessions} sessions came and went ({} per session)",
        grown / sessions
    );
}
