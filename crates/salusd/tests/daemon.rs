//! salusd end to end: real daemons on temporary sockets, real gRPC, real training steps.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Daemon, Job, eventually, floats, free_address};
use salus_client::v1 as pb;
use salus_client::{Client, OpenOptions};
use tokio_stream::StreamExt;

fn state(info: &pb::SessionInfo) -> pb::SessionState {
    pb::SessionState::try_from(info.state).unwrap()
}

/// Three jobs of different sizes at once give, bit for bit, what each gives alone.
async fn concurrent_jobs_match_alone(policy: &str) {
    let daemon = Daemon::start(&["--policy", policy, "--memory", "64MiB"]);
    let jobs = [
        Job::new("small", 16, 8, 2, 1),
        Job::new("medium", 64, 32, 4, 2),
        Job::new("large", 128, 64, 8, 3),
    ];
    let iterations = 6;
    let mut tasks = Vec::new();
    for job in jobs.clone() {
        let client = daemon.client().await;
        tasks.push(tokio::spawn(async move {
            let mut session = client.open(job.options()).await.unwrap();
            session.admitted().await.unwrap();
            let result = job.on(&session, iterations).await;
            session.close().await.unwrap();
            result
        }));
    }
    for (job, task) in jobs.iter().zip(tasks) {
        let (losses, w) = task.await.unwrap();
        let (alone_losses, alone_w) = job.alone(iterations);
        assert_eq!(losses, alone_losses, "{policy}: {} losses", job.name);
        assert_eq!(w, alone_w, "{policy}: {} weights", job.name);
        assert!(
            losses[iterations as usize - 1] < losses[0],
            "{}: training must reduce the loss: {losses:?}",
            job.name
        );
    }
    let status = daemon.client().await.status().await.unwrap();
    let memory = status.memory.unwrap();
    assert_eq!(
        memory.persistent_bytes + memory.lane_bytes,
        0,
        "all memory back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_results_match_alone() {
    concurrent_jobs_match_alone("fifo").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pack_results_match_alone() {
    concurrent_jobs_match_alone("pack").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srtf_results_match_alone() {
    concurrent_jobs_match_alone("srtf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_results_match_alone() {
    concurrent_jobs_match_alone("fair").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_results_match_alone() {
    concurrent_jobs_match_alone("share").await;
}

/// Without `--policy`, salusd shares the device: two sessions are admitted side by side,
/// each in a lane of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_policy_shares_the_device() {
    let daemon = Daemon::start(&["--memory", "64MiB"]);
    let client = daemon.client().await;
    assert_eq!(client.policy(None).await.unwrap(), "share");
    let mut first = client
        .open(Job::new("a", 16, 8, 2, 1).options())
        .await
        .unwrap();
    let mut second = client
        .open(Job::new("b", 16, 8, 2, 2).options())
        .await
        .unwrap();
    first.admitted().await.unwrap();
    second.admitted().await.unwrap();
    let status = client.status().await.unwrap();
    assert_eq!(status.lanes.len(), 2, "a lane each: {:?}", status.lanes);
    first.close().await.unwrap();
    second.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_runs_one_session_at_a_time_and_the_next_is_admitted_on_close() {
    let daemon = Daemon::start(&["--policy", "fifo"]);
    let client = daemon.client().await;
    let a = Job::new("a", 8, 4, 1, 1);
    let b = Job::new("b", 8, 4, 1, 2);
    let mut first = client.open(a.options()).await.unwrap();
    first.admitted().await.unwrap();
    let mut second = client.open(b.options()).await.unwrap();
    let sessions = eventually(&client, "b queued behind a", |s| {
        s.iter().any(|i| {
            i.id == second.id
                && state(i) == pb::SessionState::Queued
                && i.reason.contains(&format!("session {}", first.id))
        })
    })
    .await;
    assert_eq!(sessions.len(), 2);
    first.run(a.feeds(0)).await.unwrap();
    first.close().await.unwrap();
    let admitted = tokio::time::timeout(Duration::from_secs(5), second.admitted()).await;
    assert!(admitted.unwrap().is_ok());
    let out = second.run(b.feeds(0)).await.unwrap();
    assert_eq!(common::floats(&out.fetches[0]), vec![b.alone(1).0[0]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_waits_for_memory_and_is_admitted_when_it_frees() {
    // Each job needs P = 512 KiB and a lane of about as much; the lane could be shared,
    // but 1.5 MiB of device has no room for a second P.
    let daemon = Daemon::start(&["--policy", "pack", "--memory", "1536KiB"]);
    let client = daemon.client().await;
    let big = Job::new("big", 4, 512, 256, 1); // w: 512 KiB
    let other = Job::new("other", 4, 512, 256, 2);
    let mut first = client.open(big.options()).await.unwrap();
    first.admitted().await.unwrap();
    let mut second = client.open(other.options()).await.unwrap();
    let sessions = eventually(&client, "a memory wait", |s| {
        s.iter().any(|i| {
            i.id == second.id && state(i) == pb::SessionState::Queued && i.reason.contains("needs")
        })
    })
    .await;
    let reason = &sessions.iter().find(|i| i.id == second.id).unwrap().reason;
    assert!(reason.contains("usable bytes are free"), "{reason}");
    let status = client.status().await.unwrap();
    assert_eq!(status.queue.len(), 1);
    first.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), second.admitted())
        .await
        .unwrap()
        .unwrap();
    let (losses, w) = other.on(&second, 2).await;
    assert_eq!((losses, w), other.alone(2));
}

/// Sessions under FAIR that always have work get equal device time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_gives_equal_service() {
    let daemon = Daemon::start(&["--policy", "fair", "--device", "sim", "--memory", "1GiB"]);
    let client = daemon.client().await;
    let mut streams = Vec::new();
    let mut sessions = Vec::new();
    for (i, ms) in [2.0, 4.0, 8.0].into_iter().enumerate() {
        let job = Job::new(&format!("job{i}"), 8, 4, 1, i as u64);
        let mut options = job.options();
        options.hints.expected_iteration_ms = ms;
        let mut session = client.open(options).await.unwrap();
        session.admitted().await.unwrap();
        let requests = (0..2000).map(|k| job.feeds(k % 4)).collect();
        streams.push(session.run_stream(requests).await.unwrap());
        sessions.push(session);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let infos = client.list_sessions().await.unwrap();
    let service: Vec<f64> = infos.iter().map(|i| i.attained_service_ms).collect();
    let mean = service.iter().sum::<f64>() / service.len() as f64;
    for s in &service {
        assert!(
            (s - mean).abs() <= 0.10 * mean,
            "unequal service under FAIR: {service:?} ms"
        );
    }
    // Different iteration times, equal service: the iteration counts differ accordingly.
    let iterations: Vec<u64> = infos.iter().map(|i| i.iterations).collect();
    assert!(iterations[0] > iterations[2], "{iterations:?}");
    drop(streams);
    for s in sessions {
        s.close().await.unwrap();
    }
}

/// SRTF runs a short job that arrives late before a long one, then resumes the long one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srtf_runs_the_shortest_job_first_and_resumes_the_others() {
    let daemon = Daemon::start(&["--policy", "srtf", "--device", "sim", "--memory", "1GiB"]);
    let client = daemon.client().await;
    let open = |name: &str, total: u64, seed: u64| {
        let job = Job::new(name, 8, 4, 1, seed);
        let mut options = job.options();
        options.hints.expected_iteration_ms = 5.0;
        options.hints.total_iterations = total;
        (job, options)
    };
    let (long_job, long_options) = open("long", 120, 1);
    let mut long = client.open(long_options).await.unwrap();
    long.admitted().await.unwrap();
    let long_feeds: Vec<_> = (0..120).map(|k| long_job.feeds(k % 4)).collect();
    let mut long_stream = long.run_stream(long_feeds).await.unwrap();
    for _ in 0..5 {
        long_stream.next().await.unwrap().unwrap();
    }
    let (short_job, short_options) = open("short", 10, 2);
    let short = client.open(short_options).await.unwrap();
    let started = Instant::now();
    let short_feeds: Vec<_> = (0..10).map(|k| short_job.feeds(k % 4)).collect();
    let mut short_stream = short.run_stream(short_feeds).await.unwrap();
    let mut short_done = 0;
    while let Some(r) = short_stream.next().await {
        assert!(r.unwrap().failure.is_none());
        short_done += 1;
    }
    assert_eq!(short_done, 10);
    let short_time = started.elapsed();
    let infos = client.list_sessions().await.unwrap();
    let long_info = infos.iter().find(|i| i.id == long.id).unwrap();
    assert!(
        long_info.iterations < 120,
        "the long job finished first: {long_info:?}"
    );
    // 10 iterations of 5 ms each: the short job did not wait for the long one's 115.
    assert!(
        short_time < Duration::from_millis(400),
        "short job took {short_time:?}"
    );
    let mut long_done = 5;
    while let Some(r) = long_stream.next().await {
        assert!(r.unwrap().failure.is_none());
        long_done += 1;
    }
    assert_eq!(long_done, 120, "the long job resumed and finished");
    let infos = client.list_sessions().await.unwrap();
    let long_info = infos.iter().find(|i| i.id == long.id).unwrap();
    assert!(
        long_info.preemptions + long_info.suspensions >= 1,
        "{long_info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_changes_while_jobs_run() {
    let daemon = Daemon::start(&["--policy", "fifo"]);
    let client = daemon.client().await;
    let a = Job::new("a", 32, 16, 2, 1);
    let b = Job::new("b", 32, 16, 2, 2);
    let mut first = client.open(a.options()).await.unwrap();
    first.admitted().await.unwrap();
    let mut second = client.open(b.options()).await.unwrap();
    let a_half = a.on(&first, 3).await;
    eventually(&client, "b queued", |s| {
        s.iter()
            .any(|i| i.id == second.id && state(i) == pb::SessionState::Queued)
    })
    .await;
    assert_eq!(client.policy(Some("pack")).await.unwrap(), "pack");
    assert_eq!(client.policy(None).await.unwrap(), "pack");
    tokio::time::timeout(Duration::from_secs(5), second.admitted())
        .await
        .unwrap()
        .unwrap();
    let (b_losses, b_w) = b.on(&second, 4).await;
    assert_eq!((b_losses, b_w), b.alone(4));
    // a goes on where it was: its first 3 iterations and then 3 more equal 6 alone.
    let mut losses = a_half.0;
    for i in 3..6 {
        let out = first.run(a.feeds(i)).await.unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    assert_eq!(losses, a.alone(6).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_and_restore_through_tensor_reads_and_writes() {
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let job = Job::new("ckpt", 64, 32, 4, 5);
    let mut session = client.open(job.options()).await.unwrap();
    session.admitted().await.unwrap();
    job.on(&session, 3).await;
    let checkpoint = session.read(&[]).await.unwrap();
    assert_eq!(checkpoint.len(), 1, "one parameter");
    session.close().await.unwrap();
    // A fresh session from the initial values, restored, continues as if never stopped.
    let mut restored = client.open(job.options()).await.unwrap();
    restored.admitted().await.unwrap();
    assert_eq!(restored.write(&checkpoint).await.unwrap(), 1);
    let mut losses = Vec::new();
    for i in 3..6 {
        let out = restored.run(job.feeds(i)).await.unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    assert_eq!(losses, job.alone(6).0[3..].to_vec());
    let w = restored.read(&[0]).await.unwrap().remove(0).1;
    assert_eq!(w, job.alone(6).1);
}

/// A client that vanishes mid-iteration: its memory comes back, the queue moves on, and
/// other sessions go on unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_vanishes_mid_iteration_loses_its_session_and_nothing_else() {
    let daemon = Daemon::start(&["--policy", "pack", "--device", "sim", "--memory", "1GiB"]);
    let client = daemon.client().await;
    let survivor_job = Job::new("survivor", 8, 4, 1, 1);
    let mut survivor = client.open(survivor_job.options()).await.unwrap();
    survivor.admitted().await.unwrap();
    // The doomed client: its own runtime and connection, dropped mid-iteration, as the
    // kernel drops a killed process's sockets.
    let address = daemon.address();
    let doomed_id = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let id = runtime.block_on(async {
            let client = Client::connect_with_token(&address, None).await.unwrap();
            let job = Job::new("doomed", 8, 4, 1, 2);
            let mut options: OpenOptions = job.options();
            options.hints.expected_iteration_ms = 300.0;
            let mut session = client.open(options).await.unwrap();
            session.admitted().await.unwrap();
            let id = session.id;
            let run = session.run(job.feeds(0));
            // Leave while the iteration runs.
            let _ = tokio::time::timeout(Duration::from_millis(100), run).await;
            std::mem::forget(session);
            id
        });
        drop(runtime);
        id
    })
    .join()
    .unwrap();
    let gone_by = Instant::now();
    eventually(&client, "the doomed session to be closed", |s| {
        s.iter().all(|i| i.id != doomed_id)
    })
    .await;
    // Within a second of its iteration's end (300 ms after it started).
    assert!(
        gone_by.elapsed() < Duration::from_secs(1),
        "{:?}",
        gone_by.elapsed()
    );
    let status = client.status().await.unwrap();
    let memory = status.memory.unwrap();
    assert_eq!(
        memory.persistent_bytes,
        survivor.persistent_bytes.next_multiple_of(256)
    );
    let out = survivor.run(survivor_job.feeds(0)).await.unwrap();
    assert!(out.failure.is_none());
    survivor.close().await.unwrap();
    assert!(
        daemon.log().contains("the client went away"),
        "{}",
        daemon.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_running_iteration_closes_sessions_and_removes_the_socket() {
    let mut daemon = Daemon::start(&["--device", "sim"]);
    let client = daemon.client().await;
    let job = Job::new("late", 8, 4, 1, 1);
    let mut options = job.options();
    options.hints.expected_iteration_ms = 300.0;
    let mut session = client.open(options).await.unwrap();
    session.admitted().await.unwrap();
    let run = tokio::spawn({
        let feeds = job.feeds(0);
        async move { session.run(feeds).await.map(|r| r.fetches.len()) }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    daemon.signal("TERM");
    assert_eq!(
        run.await.unwrap().unwrap(),
        1,
        "the running iteration finished"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = daemon.child.wait().unwrap();
        (status, daemon)
    })
    .await
    .unwrap();
    assert!(status.0.success(), "{}", status.1.log());
    assert!(!status.1.socket.exists(), "socket removed");
    assert!(status.1.log().contains("salusd stopped"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_events_describe_what_happened() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let metrics = format!("127.0.0.1:{port}");
    let daemon = Daemon::start(&["--policy", "pack", "--metrics", &metrics]);
    let client = daemon.client().await;
    let mut events = client.watch().await.unwrap();
    let job = Job::new("watched", 8, 4, 1, 1);
    let mut session = client.open(job.options()).await.unwrap();
    session.admitted().await.unwrap();
    job.on(&session, 2).await;
    let id = session.id;
    session.close().await.unwrap();
    let mut kinds = Vec::new();
    while kinds.last() != Some(&pb::EventKind::Closed) {
        let event = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if event.session == Some(id) {
            kinds.push(pb::EventKind::try_from(event.kind).unwrap());
        }
    }
    use pb::EventKind::*;
    assert_eq!(
        kinds,
        [
            Opened,
            Admitted,
            IterationStarted,
            IterationFinished,
            IterationStarted,
            IterationFinished,
            Closed
        ]
    );
    let body = common::scrape(metrics).await;
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(
        body.contains("salus_memory_capacity_bytes 4294967296"),
        "{body}"
    );
    assert!(
        body.contains("# TYPE salus_iteration_seconds histogram"),
        "{body}"
    );
    for line in [
        "salus_protection_health{state=\"healthy\"} 1",
        "salus_protection_health{state=\"overlimit\"} 0",
        "salus_offline_duty 0.5",
        "salus_offline_bytes 0",
        "salus_offline_limit_bytes 1717986918",
        "salus_offline_evictions_total 0",
    ] {
        assert!(body.contains(line), "{line}: {body}");
    }
}

/// SRTF with room for one job: the long job's tensors go to host memory while the short
/// one runs, and come back bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn srtf_suspends_to_host_memory_and_resumes_exactly() {
    let daemon = Daemon::start(&["--policy", "srtf", "--memory", "192KiB"]);
    let client = daemon.client().await;
    let long = Job::new("long", 4, 256, 64, 1); // P = 64 KiB
    let short = Job::new("short", 4, 256, 64, 2);
    let hinted = |job: &Job, total: u64| {
        let mut options = job.options();
        options.hints.total_iterations = total;
        options.hints.expected_iteration_ms = 1.0;
        options
    };
    let mut first = client.open(hinted(&long, 100)).await.unwrap();
    first.admitted().await.unwrap();
    let mut losses = long.on(&first, 3).await.0;
    let mut second = client.open(hinted(&short, 5)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), second.admitted())
        .await
        .unwrap()
        .unwrap();
    let infos = client.list_sessions().await.unwrap();
    let long_info = infos.iter().find(|i| i.id == first.id).unwrap();
    assert_eq!(
        state(long_info),
        pb::SessionState::Suspended,
        "{long_info:?}"
    );
    assert_eq!(long_info.suspensions, 1);
    // Its tensors read from the host copy while suspended.
    assert_eq!(first.read(&[0]).await.unwrap()[0].1, long.alone(3).1);
    assert_eq!(short.on(&second, 5).await, short.alone(5));
    second.close().await.unwrap();
    for i in 3..10 {
        let out = first.run(long.feeds(i)).await.unwrap();
        losses.push(common::floats(&out.fetches[0])[0]);
    }
    let w = first.read(&[0]).await.unwrap().remove(0).1;
    assert_eq!((losses, w), long.alone(10));
}

/// Session ids restarted at 1 with the daemon, so a client holding an id from before a
/// restart drove someone's new session. A restarted daemon hands out other ids, and the
/// old one is unknown to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_do_not_repeat_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let job = Job::new("ids", 8, 4, 1, 1);
    let old = {
        let daemon = Daemon::start_at(&socket, &["--device", "cpu"]);
        let client = daemon.client().await;
        let first = client.open(job.options()).await.unwrap();
        let second = client.open(job.options()).await.unwrap();
        assert_eq!(second.id, first.id + 1);
        first.id
        // The daemon is killed here, as a crash would; its socket stays behind.
    };
    let daemon = Daemon::start_at(&socket, &["--device", "cpu"]);
    let client = daemon.client().await;
    let mut fresh = client.open(job.options()).await.unwrap();
    fresh.admitted().await.unwrap();
    assert!(
        fresh.id != old && fresh.id != old + 1,
        "{} was handed out before the restart",
        fresh.id
    );
    let mut sessions = pb::sessions_client::SessionsClient::new(client.channel());
    let stale = sessions
        .run(pb::RunRequest {
            session: old,
            feeds: job.feeds(0),
            tag: 0,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), tonic::Code::NotFound, "{}", stale.message());
    assert_eq!(job.on(&fresh, 1).await, job.alone(1), "untouched");
}

fn status_code(
    result: Result<salus_client::Session, salus_client::Error>,
) -> (tonic::Code, String) {
    match result {
        Err(salus_client::Error::Status(status)) => (status.code(), status.message().to_string()),
        Err(other) => panic!("{other}"),
        Ok(session) => panic!("session {} opened", session.id),
    }
}

/// One uid held 31 sessions until the host memory was full, and then root could not open
/// even a small session. Each user now has a number of sessions and a share of the host
/// memory (root and the daemon's user are not held to them), and status and metrics show
/// what each user holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_user_cannot_hold_every_session_or_the_host_memory() {
    let listen = free_address();
    let metrics = free_address();
    let daemon = Daemon::start(&[
        "--policy",
        "fifo",
        "--memory",
        "16MiB",
        "--host-memory",
        "4MiB",
        "--user-host-memory",
        "768KiB",
        "--max-sessions-per-user",
        "2",
        "--listen",
        &listen,
        "--insecure-tcp",
        "--metrics",
        &metrics,
    ]);
    let owner = daemon.client().await;
    // TCP clients of an insecure daemon are the unprivileged user nobody (65534).
    let nobody = daemon.tcp_client(&listen, None).await;
    let big = |seed| Job::new("big", 4, 512, 256, seed); // P = 512 KiB
    let small = |seed| Job::new("small", 8, 4, 4, seed);
    let mut running = owner.open(small(1).options()).await.unwrap();
    running.admitted().await.unwrap();
    // Under FIFO the others wait, holding their tensors in host memory.
    let waiting = nobody.open(big(2).options()).await.unwrap();
    let (code, message) = status_code(nobody.open(big(3).options()).await);
    assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
    assert!(
        message.contains("uid 65534's sessions off the device")
            && message.contains("524288 more would pass the per-user limit of 786432")
            && message.contains("--user-host-memory"),
        "{message}"
    );
    let _second = nobody.open(small(4).options()).await.unwrap();
    let (code, message) = status_code(nobody.open(small(5).options()).await);
    assert_eq!(code, tonic::Code::ResourceExhausted, "{message}");
    assert!(
        message.contains("uid 65534 has 2 sessions open or opening, the per-user limit of 2")
            && message.contains("--max-sessions-per-user"),
        "{message}"
    );
    // Others still open sessions, and the daemon's user is not held to the per-user limits.
    let mut own = Vec::new();
    for seed in 6..9 {
        own.push(owner.open(big(seed).options()).await.unwrap());
    }

    let status = owner.status().await.unwrap();
    let limits = status.limits.unwrap();
    assert_eq!(
        (
            limits.host_memory,
            limits.user_host_memory,
            limits.max_sessions_per_user
        ),
        (4 << 20, 768 << 10, 2)
    );
    assert_eq!(limits.open_timeout_ms, 300_000, "the default");
    let user = |uid: u32| status.users.iter().find(|u| u.uid == uid).cloned().unwrap();
    let limited = user(65534);
    assert_eq!(
        (limited.sessions, limited.opening, limited.limited),
        (2, 0, true)
    );
    assert!(limited.host_bytes >= 512 << 10, "{limited:?}");
    let me = user(salus_client::current_uid());
    assert_eq!((me.sessions, me.limited), (4, false));
    assert_eq!(status.host_bytes, limited.host_bytes + me.host_bytes);

    let body = common::scrape(metrics).await;
    for line in [
        "salus_user_sessions{uid=\"65534\"} 2",
        "salus_limit_sessions_per_user 2",
        "salus_limit_user_host_memory_bytes 786432",
        "salus_opening_sessions 0",
    ] {
        assert!(body.contains(line), "{line}: {body}");
    }

    // A session closed gives its place and its share back.
    waiting.close().await.unwrap();
    nobody.open(small(10).options()).await.unwrap();
    assert_eq!(small(1).on(&running, 2).await, small(1).alone(2));
}

/// Streams that sent only `open` held their host memory with no end, and nothing showed
/// them. Opening sessions are in the status now, and an open that does not commit within
/// --open-timeout is dropped and its memory released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_that_never_commits_is_dropped_and_shows_in_status() {
    // Long enough for a loaded machine to see the open before it times out.
    let daemon = Daemon::start(&["--open-timeout", "3s"]);
    let client = daemon.client().await;
    let job = Job::new("slow", 4, 512, 256, 1); // P = 512 KiB
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::OpenRequest {
        item: Some(pb::open_request::Item::Open(pb::OpenSession {
            graph: Some(job.graph().to_proto()),
            kind: pb::SessionKind::Training as i32,
            hints: None,
        })),
    })
    .await
    .unwrap();
    let mut sessions = pb::sessions_client::SessionsClient::new(client.channel());
    let started = Instant::now();
    let mut updates = sessions
        .open(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // The open is counted as it arrives and its upload's bytes a moment later, once
    // the graph is read: wait for both.
    let opening = loop {
        let status = client.status().await.unwrap();
        if status.opening_sessions == 1 && status.opening_bytes > 0 {
            break status;
        }
        assert!(started.elapsed() < Duration::from_secs(3), "{status:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(opening.opening_bytes, 512 << 10);
    assert_eq!(opening.host_bytes, 512 << 10);
    assert_eq!(opening.users.len(), 1);
    assert_eq!(
        (opening.users[0].opening, opening.users[0].opening_bytes),
        (1, 512 << 10)
    );
    assert!(
        client.list_sessions().await.unwrap().is_empty(),
        "not a session yet"
    );
    // The client keeps its side open and never commits.
    let end = tokio::time::timeout(Duration::from_secs(10), updates.message())
        .await
        .expect("the open was not dropped")
        .unwrap_err();
    assert_eq!(
        end.code(),
        tonic::Code::DeadlineExceeded,
        "{}",
        end.message()
    );
    assert!(
        end.message().contains("--open-timeout"),
        "{}",
        end.message()
    );
    assert!(started.elapsed() >= Duration::from_millis(2900));
    let status = client.status().await.unwrap();
    assert_eq!(
        (
            status.opening_sessions,
            status.opening_bytes,
            status.host_bytes
        ),
        (0, 0, 0),
        "released"
    );
    assert!(status.users.is_empty(), "{:?}", status.users);
    drop(tx);
}

/// WriteTensors to a session that does not exist, or is someone else's, kept every chunk
/// before checking. The session and the caller's right to it are checked on the first
/// message now, before any bytes are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_refused_before_its_chunks_when_the_session_is_not_the_callers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listen = free_address();
    let daemon = Daemon::start(&["--listen", &listen, "--insecure-tcp"]);
    let owner = daemon.client().await;
    let nobody = daemon.tcp_client(&listen, None).await;
    let job = Job::new("w", 8, 4, 1, 1);
    let session = owner.open(job.options()).await.unwrap();
    for (client, id, code) in [
        (&owner, session.id + 1000, tonic::Code::NotFound),
        (&nobody, session.id, tonic::Code::PermissionDenied),
    ] {
        // 64 chunks of 4 MiB, made only as the client's transport takes them.
        let pulled = Arc::new(AtomicUsize::new(0));
        let counter = pulled.clone();
        let chunks = (0..64u64).map(move |i| {
            counter.fetch_add(1, Ordering::Relaxed);
            pb::WriteTensorsRequest {
                item: Some(pb::write_tensors_request::Item::Chunk(pb::TensorChunk {
                    tensor: 0,
                    offset: i * (4 << 20),
                    data: vec![0; 4 << 20],
                })),
            }
        });
        let first = pb::WriteTensorsRequest {
            item: Some(pb::write_tensors_request::Item::Session(id)),
        };
        let messages = tokio_stream::iter(std::iter::once(first).chain(chunks));
        let mut sessions = pb::sessions_client::SessionsClient::new(client.channel())
            .max_encoding_message_size(1 << 30);
        let refused = sessions
            .write_tensors(client.request(messages))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), code, "{}", refused.message());
        let pulled = pulled.load(Ordering::Relaxed);
        assert!(
            pulled < 16,
            "{pulled} of 64 chunks were sent before the answer"
        );
    }
    assert_eq!(job.on(&session, 1).await, job.alone(1));
}

/// A one-node graph: `y = ones * x` with `ones: f32[n]` constant and `x: f32[fed]` fed
/// (1, or n), so a request of `fed` floats fetches n floats.
fn broadcast_graph(n: u64, fed: u64) -> salus_graph::Graph {
    use salus_graph::{DType, Op, Role, Tensor, TensorType};
    let tensor = |name: &str, shape: Vec<u64>, role, data| Tensor {
        name: name.into(),
        ty: TensorType::new(DType::F32, shape),
        role,
        data,
    };
    common::one_node_graph(
        vec![
            tensor(
                "ones",
                vec![n],
                Role::Constant,
                common::bytes(&vec![1.0; n as usize]),
            ),
            tensor("x", vec![fed], Role::Feed, vec![]),
            tensor("y", vec![n], Role::Intermediate, vec![]),
        ],
        "scale",
        Op::MulTensor,
    )
}

/// A RunStream whose answers were never read had them all kept (1,000 requests fetching
/// 4 MiB each: 2.5 GB). The daemon stops taking a stream's requests while its answers are
/// unread now, and goes on once they are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_stream_stops_taking_requests_while_answers_are_unread() {
    let daemon = Daemon::start(&["--policy", "pack", "--memory", "64MiB"]);
    let client = daemon.client().await;
    let n = 256 << 10; // 1 MiB of fetch per request
    let mut session = client
        .open(OpenOptions::training(broadcast_graph(n, 1).to_proto()))
        .await
        .unwrap();
    session.admitted().await.unwrap();
    let requests = 300u64;
    let feeds: Vec<Vec<Vec<u8>>> = (0..requests)
        .map(|i| vec![common::bytes(&[i as f32])])
        .collect();
    let mut responses = session.run_stream(feeds).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let done = |infos: &[pb::SessionInfo]| infos[0].iterations + infos[0].pending;
    let taken = done(&client.list_sessions().await.unwrap());
    let bound = 3 * salusd::service::PIPELINE as u64 + 8;
    assert!(
        (1..=bound).contains(&taken),
        "{taken} of {requests} requests taken while no answer was read (bound {bound})"
    );
    for i in 0..requests {
        let response = responses.next().await.unwrap().unwrap();
        assert_eq!(response.tag, i);
        assert!(response.failure.is_none(), "{:?}", response.failure);
        let y = common::floats(&response.fetches[0]);
        assert_eq!(
            (y.len(), y[0], y[n as usize - 1]),
            (n as usize, i as f32, i as f32)
        );
    }
    assert!(
        responses.next().await.is_none(),
        "every request answered, then OK"
    );
}

/// A stream whose requests the daemon stops reading (its answers unread) keeps its own
/// unread requests, and only those: it held HTTP/2's window for the whole connection
/// (1 MiB, as one stream's), so every other session of the same client stalled with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_daemon_stops_reading_holds_up_no_other_session_of_its_client() {
    let daemon = Daemon::start(&["--policy", "pack", "--memory", "256MiB"]);
    let client = daemon.client().await;
    let n = 256 << 10; // 1 MiB of feed and of fetch per request
    let mut piped = client
        .open(OpenOptions::training(broadcast_graph(n, n).to_proto()))
        .await
        .unwrap();
    piped.admitted().await.unwrap();
    let requests = 3 * salusd::service::PIPELINE as u64 + 8;
    let feeds: Vec<Vec<Vec<u8>>> = (0..requests)
        .map(|i| vec![common::bytes(&vec![i as f32; n as usize])])
        .collect();
    let mut responses = piped.run_stream(feeds).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Another session on the same connection, while that stream waits: it opens, runs
    // (a MiB of feed each time), reads and closes.
    let other = async {
        let job = Job::new("other", 256, 1024, 2, 3);
        let mut session = client.open(job.options()).await.unwrap();
        session.admitted().await.unwrap();
        let result = job.on(&session, 2).await;
        session.close().await.unwrap();
        (result, job.alone(2))
    };
    let (on, alone) = tokio::time::timeout(Duration::from_secs(30), other)
        .await
        .expect("the other session is not held up by the waiting stream");
    assert_eq!(on, alone);
    for i in 0..requests {
        let response = responses.next().await.unwrap().unwrap();
        assert_eq!(response.tag, i);
        let y = common::floats(&response.fetches[0]);
        assert_eq!((y.len(), y[n as usize - 1]), (n as usize, i as f32));
    }
    assert!(responses.next().await.is_none());
}

/// With --state-dir, a SIGTERM keeps every session: the restarted daemon brings them
/// back, the client reattaches with its token and goes on bit for bit; a wrong token, a
/// stranger's reattach and a damaged snapshot are refused without harm to the rest.
#[tokio::test]
async fn sessions_survive_a_restart_and_their_clients_reattach() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let args = ["--device", "cpu", "--state-dir", state_arg.as_str()];
    let job = Job::new("restart", 8, 4, 1, 3);
    let (id, token, before) = {
        let daemon = Daemon::start_at(&socket, &args);
        let client = daemon.client().await;
        let mut session = client.open(job.options()).await.unwrap();
        assert_eq!(session.token.len(), 16);
        assert_eq!(session.iterations, 0);
        session.admitted().await.unwrap();
        for i in 0..3 {
            session.run(job.feeds(i)).await.unwrap();
        }
        let before = session.read(&[0]).await.unwrap().remove(0).1;
        // A second session, closed by its client: nothing of it is kept.
        let closed = client.open(job.options()).await.unwrap();
        let closed_id = closed.id;
        closed.close().await.unwrap();
        daemon.signal("TERM");
        let mut daemon = daemon;
        assert!(daemon.child.wait().unwrap().success(), "{}", daemon.log());
        let kept: Vec<_> = std::fs::read_dir(&state).unwrap().flatten().collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert!(!state.join(format!("session-{closed_id}.snap")).exists());
        (session.id, session.token.clone(), before)
    };
    // Damage a copy of the snapshot under another name: it is set aside, not restored.
    let bad = state.join("session-1.snap");
    let mut bytes = std::fs::read(state.join(format!("session-{id}.snap"))).unwrap();
    let last = bytes.len() - 20;
    bytes[last] ^= 0xff;
    std::fs::write(&bad, bytes).unwrap();

    let daemon = Daemon::start_at(&socket, &args);
    let client = daemon.client().await;
    assert!(
        state.join("session-1.rejected").exists(),
        "{}",
        daemon.log()
    );
    let wrong = client.reattach(id, vec![0; 16]).await;
    assert!(
        matches!(&wrong, Err(salus_client::Error::Status(s)) if s.code() == tonic::Code::PermissionDenied),
        "{:?}",
        wrong.map(|s| s.id)
    );
    let mut session = client.reattach(id, token.clone()).await.unwrap();
    assert_eq!((session.id, session.iterations), (id, 3));
    session.admitted().await.unwrap();
    assert_eq!(session.read(&[0]).await.unwrap().remove(0).1, before);
    // A second reattach while the first holds the lease is refused.
    let twice = client.reattach(id, token).await;
    assert!(
        matches!(&twice, Err(salus_client::Error::Status(s)) if s.code() == tonic::Code::FailedPrecondition),
        "{:?}",
        twice.map(|s| s.id)
    );
    // It goes on exactly as a session that never stopped.
    let mut losses = Vec::new();
    for i in 3..5 {
        let out = session.run(job.feeds(i)).await.unwrap();
        losses.push(floats(&out.fetches[0])[0]);
    }
    let w = session.read(&[0]).await.unwrap().remove(0).1;
    let (alone_losses, alone_w) = job.alone(5);
    assert_eq!(losses, alone_losses[3..].to_vec());
    assert_eq!(w, alone_w);
}

/// A restored session works only for the client that took it back: a client whose
/// connection came back by itself after the restart (tonic's and grpcio's channels
/// reconnect) is told to reattach (UNAVAILABLE) rather than run on a session with no lease,
/// which --reattach-timeout would close under it (found by the soak benchmark).
#[tokio::test]
async fn a_restored_session_works_only_once_its_client_reattaches() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let args = ["--device", "cpu", "--state-dir", state_arg.as_str()];
    let job = Job::new("lease", 8, 4, 1, 8);
    let mut daemon = Daemon::start_at(&socket, &args);
    let client = daemon.client().await;
    let mut session = client.open(job.options()).await.unwrap();
    session.admitted().await.unwrap();
    session.run(job.feeds(0)).await.unwrap();
    daemon.signal("TERM");
    assert!(daemon.child.wait().unwrap().success(), "{}", daemon.log());
    let _daemon = Daemon::start_at(&socket, &args);
    // The old handles, on a channel that reconnects to the new daemon by itself (its
    // first call may see the old connection broken).
    let first = session.run(job.feeds(1)).await;
    assert!(first.is_err(), "ran on a session with no lease");
    for attempt in [
        session.run(job.feeds(1)).await.map(|_| ()),
        session.read(&[0]).await.map(|_| ()),
        session.write(&[(0, job.initial())]).await.map(|_| ()),
    ] {
        let Err(salus_client::Error::Status(status)) = attempt else {
            panic!("{attempt:?}");
        };
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("reattach"), "{status:?}");
    }
    let back = client
        .reattach(session.id, session.token.clone())
        .await
        .unwrap();
    assert_eq!(back.iterations, 1);
    let out = back.run(job.feeds(1)).await.unwrap();
    let (alone, _) = job.alone(2);
    assert_eq!(floats(&out.fetches[0])[0], alone[1]);
}

/// `--snapshot-every 0` snapshots only at shutdown, as documented (salusd refused to start
/// with it: "out of range"; found by the soak benchmark).
#[tokio::test]
async fn snapshot_every_zero_snapshots_only_at_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let args = [
        "--device",
        "cpu",
        "--state-dir",
        &state_arg,
        "--snapshot-every",
        "0",
    ];
    let mut daemon = Daemon::start_at(&socket, &args);
    let client = daemon.client().await;
    let job = Job::new("only-at-shutdown", 8, 4, 1, 7);
    let mut session = client.open(job.options()).await.unwrap();
    session.admitted().await.unwrap();
    session.run(job.feeds(0)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0);
    daemon.signal("TERM");
    assert!(daemon.child.wait().unwrap().success(), "{}", daemon.log());
    assert_eq!(std::fs::read_dir(&state).unwrap().count(), 1);
    drop(session);
}

/// A restored session whose client never comes back is closed after --reattach-timeout.
#[tokio::test]
async fn a_restored_session_nobody_reattaches_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let job = Job::new("orphan", 8, 4, 1, 4);
    {
        let daemon = Daemon::start_at(&socket, &["--device", "cpu", "--state-dir", &state_arg]);
        let client = daemon.client().await;
        let session = client.open(job.options()).await.unwrap();
        daemon.signal("TERM");
        let mut daemon = daemon;
        assert!(daemon.child.wait().unwrap().success());
        drop(session);
    }
    let daemon = Daemon::start_at(
        &socket,
        &[
            "--device",
            "cpu",
            "--state-dir",
            &state_arg,
            "--reattach-timeout",
            "300ms",
        ],
    );
    let client = daemon.client().await;
    assert_eq!(client.list_sessions().await.unwrap().len(), 1);
    eventually(&client, "the orphan closed", |sessions| sessions.is_empty()).await;
    assert_eq!(
        std::fs::read_dir(&state).unwrap().count(),
        0,
        "{}",
        daemon.log()
    );
}

/// With --snapshot-every, a SIGKILL loses at most the work since the last snapshot, and
/// the reattached client learns exactly which iteration its session resumes from.
#[tokio::test]
async fn after_a_kill_a_session_resumes_from_its_last_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let args = [
        "--device",
        "cpu",
        "--state-dir",
        state_arg.as_str(),
        "--snapshot-every",
        "100ms",
    ];
    let job = Job::new("killed", 8, 4, 1, 5);
    let (id, token) = {
        let daemon = Daemon::start_at(&socket, &args);
        let client = daemon.client().await;
        let mut session = client.open(job.options()).await.unwrap();
        session.admitted().await.unwrap();
        for i in 0..3 {
            session.run(job.feeds(i)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(400)).await; // a snapshot or more
        session.run(job.feeds(3)).await.unwrap();
        (session.id, session.token.clone())
        // The daemon is killed here (SIGKILL), with no chance to snapshot again.
    };
    let daemon = Daemon::start_at(&socket, &args);
    let client = daemon.client().await;
    let session = client.reattach(id, token).await.unwrap();
    let resumed = session.iterations;
    assert!((3..=4).contains(&resumed), "resumed from {resumed}");
    let w = session.read(&[0]).await.unwrap().remove(0).1;
    let (_, alone_w) = job.alone(resumed);
    assert_eq!(w, alone_w, "the state after exactly {resumed} iterations");
}

/// A device fault (a poisoned context; injected on the sim device) fails the iteration in
/// flight and stops salusd with a failure, keeping the last snapshots: restarted (as its
/// supervisor does), salusd brings the sessions back and their clients go on from the
/// iteration they are told.
#[tokio::test]
async fn after_a_device_fault_sessions_come_back_from_their_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let state = dir.path().join("state");
    let state_arg = state.display().to_string();
    let args = [
        "--device",
        "sim",
        "--state-dir",
        state_arg.as_str(),
        "--snapshot-every",
        "100ms",
    ];
    let job = Job::new("fault", 8, 4, 1, 6);
    let (id, token) = {
        let mut daemon = Daemon::start_with_env(&socket, &args, &[("SALUS_SIM_FAULT_AFTER", "3")]);
        let client = daemon.client().await;
        let mut session = client.open(job.options()).await.unwrap();
        session.admitted().await.unwrap();
        for i in 0..3 {
            session.run(job.feeds(i)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(400)).await; // a snapshot after three
        let fault = session.run(job.feeds(3)).await;
        assert!(fault.is_err(), "the iteration in flight fails");
        let status = tokio::task::spawn_blocking(move || {
            let status = daemon.child.wait().unwrap();
            (status, daemon)
        })
        .await
        .unwrap();
        assert_eq!(status.0.code(), Some(1), "{}", status.1.log());
        assert!(status.1.log().contains("poisoned"), "{}", status.1.log());
        (session.id, session.token.clone())
    };
    let daemon = Daemon::start_at(&socket, &args);
    let client = daemon.client().await;
    let mut session = client.reattach(id, token).await.unwrap();
    assert_eq!(session.iterations, 3, "{}", daemon.log());
    session.admitted().await.unwrap();
    session.run(job.feeds(3)).await.unwrap();
}
