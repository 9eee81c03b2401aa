//! Online sessions protected from offline ones, end to end: real daemons, real gRPC, real
//! training steps on the cpu device.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Daemon, Job, eventually};
use salus_client::v1 as pb;
use salus_client::{Client, OpenOptions};
use tokio_stream::StreamExt;

fn class(info: &pb::SessionInfo) -> pb::SessionClass {
    pb::SessionClass::try_from(info.class).unwrap()
}

fn state(info: &pb::SessionInfo) -> pb::SessionState {
    pb::SessionState::try_from(info.state).unwrap()
}

fn offline(job: &Job) -> OpenOptions {
    let mut options = job.options();
    options.hints.class = pb::SessionClass::Offline as i32;
    options
}

fn online(job: &Job, slo_ms: f64) -> OpenOptions {
    let mut options = job.options();
    options.hints.slo_ms = slo_ms;
    options
}

/// `--memory` that holds one of these jobs but not two, rounded to 256 bytes.
fn room_for_one(job: &Job) -> String {
    let program = salus_exec::Program::new(job.graph(), &salus_graph::Limits::default()).unwrap();
    let plan = program.plan();
    let one =
        plan.persistent_bytes.next_multiple_of(256) + plan.ephemeral_bytes.next_multiple_of(256);
    format!("{}", (one * 3 / 2).next_multiple_of(256))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_online_session_takes_the_memory_of_an_offline_one_and_both_stay_exact() {
    let training = Job::new("training", 4, 256, 64, 1);
    let serving = Job::new("serving", 4, 256, 64, 2);
    let memory = room_for_one(&training);
    let daemon = Daemon::start(&[
        "--policy",
        "pack",
        "--memory",
        &memory,
        "--offline-share",
        "0.9",
    ]);
    let client = daemon.client().await;
    let mut background = client.open(offline(&training)).await.unwrap();
    background.admitted().await.unwrap();
    let mut losses = training.on(&background, 3).await.0;

    let mut foreground = client.open(online(&serving, 10_000.0)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), foreground.admitted())
        .await
        .expect("the online session is admitted at once")
        .unwrap();
    let infos = client.list_sessions().await.unwrap();
    let info = infos.iter().find(|i| i.id == background.id).unwrap();
    assert_eq!(class(info), pb::SessionClass::Offline);
    assert_eq!(state(info), pb::SessionState::Suspended, "{info:?}");
    let fg = infos.iter().find(|i| i.id == foreground.id).unwrap();
    assert_eq!(class(fg), pb::SessionClass::Online);
    assert_eq!(fg.slo_ms, 10_000.0);

    // The offline session's next iteration waits in host memory meanwhile.
    let feeds = training.feeds(3);
    let background = std::sync::Arc::new(background);
    let pending = {
        let background = background.clone();
        tokio::spawn(async move { background.run(feeds).await })
    };
    assert_eq!(serving.on(&foreground, 5).await, serving.alone(5));
    let status = client.status().await.unwrap();
    let protection = status.protection.unwrap();
    assert!(protection.enabled);
    assert_eq!(protection.offline_evictions, 1);
    assert!(
        !pending.is_finished(),
        "offline work ran while it had no memory"
    );
    foreground.close().await.unwrap();

    let out = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .expect("the offline session resumes once the online one has gone")
        .unwrap()
        .unwrap();
    losses.push(common::floats(&out.fetches[0])[0]);
    for i in 4..8 {
        let out = background.run(training.feeds(i)).await.unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    let w = background.read(&[0]).await.unwrap().remove(0).1;
    assert_eq!((losses, w), training.alone(8), "resumed exactly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_failures_and_vanishing_offline_clients_leave_online_results_unchanged() {
    let daemon = Daemon::start(&["--policy", "share", "--memory", "64MiB"]);
    let client = daemon.client().await;
    let serving = Job::new("serving", 16, 8, 2, 3);
    let mut foreground = client.open(online(&serving, 5_000.0)).await.unwrap();
    foreground.admitted().await.unwrap();
    let address = daemon.address();
    // Offline clients on their own threads and connections: one sends iterations that
    // fail, one goes away in the middle of an iteration, as a killed process does.
    let troublemakers = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let client = Client::connect_with_token(&address, None).await.unwrap();
            let job = Job::new("failing", 64, 32, 4, 4);
            let mut failing = client.open(offline(&job)).await.unwrap();
            failing.admitted().await.unwrap();
            let mut refused = 0;
            for i in 0..20 {
                let mut feeds = job.feeds(i);
                feeds[0].truncate(7);
                if failing.run(feeds).await.is_err() {
                    refused += 1;
                }
                let _ = failing.run(job.feeds(i)).await.unwrap();
            }
            let job = Job::new("vanishing", 64, 32, 4, 5);
            let mut options = offline(&job);
            options.hints.expected_iteration_ms = 100.0;
            let mut vanishing = client.open(options).await.unwrap();
            vanishing.admitted().await.unwrap();
            let run = vanishing.run(job.feeds(0));
            let _ = tokio::time::timeout(Duration::from_millis(1), run).await;
            std::mem::forget(vanishing);
            refused
        })
    });
    let results = serving.on(&foreground, 40).await;
    let refused = troublemakers.join().unwrap();
    assert_eq!(
        refused, 20,
        "each bad feed is refused, naming what was wrong"
    );
    assert_eq!(results, serving.alone(40), "bit for bit as alone");
    eventually(&client, "the vanished offline session to close", |s| {
        s.iter()
            .all(|i| i.name != "vanishing" && (i.name != "failing" || i.iterations == 20))
    })
    .await;
    foreground.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_disables_and_enables_offline_work() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    let job = Job::new("background", 16, 8, 2, 6);
    let mut session = client.open(offline(&job)).await.unwrap();
    session.admitted().await.unwrap();
    let mut losses = job.on(&session, 2).await.0;
    assert_eq!(client.offline(None).await.unwrap(), "healthy");
    assert_eq!(client.offline(Some(false)).await.unwrap(), "disabled");
    let infos = eventually(&client, "the offline session to be suspended", |s| {
        s.iter().all(|i| state(i) == pb::SessionState::Suspended)
    })
    .await;
    assert!(
        infos[0].reason.contains("disabled"),
        "{:?}",
        infos[0].reason
    );
    let status = client.status().await.unwrap();
    assert_eq!(status.protection.unwrap().health, "disabled");
    assert_eq!(client.offline(Some(true)).await.unwrap(), "healthy");
    for i in 2..4 {
        let out = session.run(job.feeds(i)).await.unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    let w = session.read(&[0]).await.unwrap().remove(0).1;
    assert_eq!((losses, w), job.alone(4));
    let metrics = daemon.log();
    assert!(metrics.contains("offline sessions disabled"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_classes_and_targets_are_refused_by_name() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    let job = Job::new("bad", 16, 8, 2, 7);
    let mut options = job.options();
    options.hints.class = 7;
    let error = client.open(options).await.err().unwrap().to_string();
    assert!(error.contains("hints.class 7"), "{error}");
    let mut options = offline(&job);
    options.hints.slo_ms = 10.0;
    let error = client.open(options).await.err().unwrap().to_string();
    assert!(
        error.contains("hints.slo_ms is for online sessions"),
        "{error}"
    );
    let mut options = job.options();
    options.hints.slo_ms = -1.0;
    let error = client.open(options).await.err().unwrap().to_string();
    assert!(error.contains("hints.slo_ms"), "{error}");
    // An offline session bigger than the offline share is refused at once.
    let daemon = Daemon::start(&["--memory", "64KiB", "--offline-share", "0.1"]);
    let client = daemon.client().await;
    let big = Job::new("big", 4, 64, 32, 8);
    let error = client.open(offline(&big)).await.err().unwrap().to_string();
    assert!(
        error.contains("offline sessions may hold at most"),
        "{error}"
    );
    let (code, log) = common::refused_start(&["--offline-share", "1.5"]);
    assert_ne!(code, Some(0));
    assert!(log.contains("offline_memory_share"), "{log}");
    let (code, log) = common::refused_start(&["--offline-compute-share", "1.5"]);
    assert_ne!(code, Some(0));
    assert!(log.contains("offline_compute_share"), "{log}");
    // A share the operator gives is fixed: the whole device is one.
    drop(Daemon::start(&["--offline-compute-share", "1"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_iteration_is_abandoned_for_an_online_session_and_runs_again_exactly() {
    // Iterations long enough to be abandoned in the middle: about a GFLOP each, tens of
    // ms on two cores. The serving job is as large, so that it fits only in the memory
    // the training job holds.
    let training = Job::new("training", 1024, 1024, 256, 11).without_signal();
    let serving = Job::new("serving", 1024, 1024, 256, 12).without_signal();
    let memory = room_for_one(&training);
    let daemon = Daemon::start(&[
        "--policy",
        "pack",
        "--memory",
        &memory,
        "--offline-share",
        "0.9",
        "--offline-abandon-after",
        "1ms",
    ]);
    let client = daemon.client().await;
    let mut background = client.open(offline(&training)).await.unwrap();
    background.admitted().await.unwrap();
    // Every iteration submitted at once (pipelined): the offline session is never idle
    // between them, so the online one can only get its memory by abandoning one.
    let iterations = 24;
    let feeds = (0..iterations).map(|i| training.feeds(i)).collect();
    let mut stream = background.run_stream(feeds).await.unwrap();
    let mut losses = Vec::new();
    for _ in 0..3 {
        let out = stream.next().await.unwrap().unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    // An online session that arrives less than 1 ms before the running iteration ends
    // takes the memory at that boundary instead (an eviction): up to five arrivals, until
    // one has abandoned an iteration.
    let served = serving.alone(2);
    for _ in 0..5 {
        let mut foreground = client.open(online(&serving, 10_000.0)).await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), foreground.admitted())
            .await
            .expect("the online session is admitted")
            .unwrap();
        assert_eq!(serving.on(&foreground, 2).await, served);
        foreground.close().await.unwrap();
        if client
            .status()
            .await
            .unwrap()
            .protection
            .unwrap()
            .offline_abandoned
            >= 1
        {
            break;
        }
    }
    let protection = client.status().await.unwrap().protection.unwrap();
    assert!(protection.offline_abandoned >= 1, "{protection:?}");
    while let Some(out) = stream.next().await {
        losses.push(common::floats(&out.unwrap().fetches[0])[0]);
    }
    let w = background.read(&[0]).await.unwrap().remove(0).1;
    assert_eq!(
        (losses, w),
        training.alone(iterations),
        "the abandoned iteration ran again, exactly"
    );
}

/// A change of health is an event that names the metrics behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_health_is_an_event_naming_its_metrics() {
    let daemon = Daemon::start(&[]);
    let client = daemon.client().await;
    let mut events = client.watch().await.unwrap();
    assert_eq!(client.offline(Some(false)).await.unwrap(), "disabled");
    let detail = loop {
        let event = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        // The switch itself is an event too ("offline sessions disabled").
        if event.kind == pb::EventKind::Protection as i32 && event.detail.starts_with("health") {
            break event.detail;
        }
    };
    assert_eq!(detail, "health healthy -> disabled (no metric yet)");
}

#[test]
fn the_device_sets_the_offline_compute_share_unless_the_operator_does() {
    let mut config = salusd::config::Config::new("unused.sock".into());
    config.memory = 1 << 20;
    let cpu = salusd::open_device(&config).unwrap();
    // The cpu device: offline work waits between two nodes while online work runs.
    assert_eq!(cpu.offline_compute_share(), Some(0.0));
    let protection = salusd::protection_for(&config, &*cpu);
    assert_eq!(protection.offline_compute_share, 0.0);
    assert!(
        !protection.dynamic_compute_share,
        "the device's share is fixed"
    );
    assert_eq!(
        protection.background_priority,
        cpu.has_background_priority()
    );
    config.protection.offline_compute_share = 0.3;
    config.offline_compute_share_given = true;
    let given = salusd::protection_for(&config, &*cpu);
    assert_eq!(given.offline_compute_share, 0.3);
    assert!(
        !given.dynamic_compute_share,
        "the operator's share is fixed"
    );
    // A device without its own share learns it from protection's default.
    let mut config = salusd::config::Config::new("unused.sock".into());
    config.device = salusd::config::DeviceChoice::Sim;
    let sim = salusd::open_device(&config).unwrap();
    let learned = salusd::protection_for(&config, &*sim);
    assert_eq!(
        learned.offline_compute_share,
        salus_core::ProtectionConfig::default().offline_compute_share
    );
    assert!(learned.dynamic_compute_share);
    config.offline_compute_share_given = true;
    assert!(!salusd::protection_for(&config, &*sim).dynamic_compute_share);
}
