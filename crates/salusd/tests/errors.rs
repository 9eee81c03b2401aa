//! Bad requests get a gRPC status that says what was wrong, and change nothing else;
//! sessions belong to their users; TCP needs the token.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Daemon, Job, bytes, floats};
use salus_client::v1 as pb;
use salus_client::{Client, Error, OpenOptions};
use tonic::Code;

fn expect(result: Result<impl std::fmt::Debug, Error>, code: Code, needles: &[&str], case: &str) {
    match result {
        Err(Error::Status(status)) => {
            assert_eq!(status.code(), code, "{case}: {}", status.message());
            for needle in needles {
                assert!(
                    status.message().contains(needle),
                    "{case}: {:?} lacks {needle:?}",
                    status.message()
                );
            }
        }
        other => panic!("{case}: expected {code:?}, got {other:?}"),
    }
}

fn job() -> Job {
    Job::new("j", 8, 4, 4, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_clear_statuses() {
    let daemon = Daemon::start(&["--policy", "pack", "--memory", "16MiB"]);
    let client = daemon.client().await;
    let j = job();

    let mut unknown_op = j.graph().to_proto();
    unknown_op.nodes[2].op = "frobnicate".into();
    let mut bad_shape = j.graph().to_proto();
    bad_shape.tensors[1].shape = vec![8, 5];
    let mut huge = j.graph().to_proto();
    huge.tensors[0].shape = vec![1 << 40, 1 << 40];
    let mut bad_fetch = j.graph().to_proto();
    bad_fetch.fetches = vec![42];
    let open = |graph: pb::Graph, initial: Vec<(u32, Vec<u8>)>| OpenOptions {
        graph,
        kind: pb::SessionKind::Training,
        hints: pb::Hints::default(),
        initial,
    };
    let w = j.initial();
    let cases: Vec<(&str, OpenOptions, Code, Vec<&str>)> = vec![
        (
            "unknown op",
            open(unknown_op, vec![(0, w.clone())]),
            Code::InvalidArgument,
            vec!["frobnicate"],
        ),
        (
            "wrong shapes",
            open(bad_shape, vec![(0, w.clone())]),
            Code::InvalidArgument,
            vec!["mm", "node 0"],
        ),
        (
            "huge tensor",
            open(huge, vec![]),
            Code::InvalidArgument,
            vec!["tensor 0 'w'"],
        ),
        (
            "fetch out of range",
            open(bad_fetch, vec![(0, w.clone())]),
            Code::InvalidArgument,
            vec!["42"],
        ),
        (
            "missing initial value",
            open(j.graph().to_proto(), vec![]),
            Code::InvalidArgument,
            vec!["tensor 0 'w'", "needs 64 bytes of initial value, got 0"],
        ),
        (
            "initial value too long",
            open(j.graph().to_proto(), vec![(0, vec![0; 80])]),
            Code::InvalidArgument,
            vec!["has 64 bytes; chunks give 80"],
        ),
        (
            "value for a feed",
            open(j.graph().to_proto(), vec![(0, w.clone()), (1, vec![0; 4])]),
            Code::InvalidArgument,
            vec!["tensor 1 'x'", "only PARAMETER and STATE"],
        ),
        (
            "value for no tensor",
            open(j.graph().to_proto(), vec![(99, vec![0; 4])]),
            Code::InvalidArgument,
            vec!["tensor 99", "11 tensors"],
        ),
        (
            "can never fit",
            Job::new("big", 8, 2048, 1024, 1).options(),
            Code::ResourceExhausted,
            vec!["can never run here", "16777216 usable"],
        ),
    ];
    for (case, options, code, needles) in cases {
        expect(
            client.open(options).await.map(|s| s.id),
            code,
            &needles,
            case,
        );
    }

    // A good session, to aim bad calls at.
    let mut session = client.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    let feeds = j.feeds(0);
    expect(
        session.run(vec![feeds[0].clone()]).await,
        Code::InvalidArgument,
        &["takes 2 feeds, 1 given"],
        "feed count",
    );
    expect(
        session
            .run(vec![feeds[0][..8].to_vec(), feeds[1].clone()])
            .await,
        Code::InvalidArgument,
        &["feed 0 'x'", "needs 128 bytes, got 8"],
        "feed size",
    );
    expect(
        session.read(&[3]).await,
        Code::InvalidArgument,
        &["tensor 3 'pred' is not persistent"],
        "read an intermediate",
    );
    expect(
        session.read(&[77]).await,
        Code::InvalidArgument,
        &["tensor 77 does not exist"],
        "read no tensor",
    );
    expect(
        session.write(&[(0, vec![0; 12])]).await,
        Code::InvalidArgument,
        &["tensor 0 'w'", "needs 64 bytes, got 12"],
        "write a wrong size",
    );
    expect(
        client.policy(Some("lottery")).await,
        Code::InvalidArgument,
        &["unknown policy \"lottery\""],
        "policy",
    );

    // Raw protocol mistakes, through the generated stubs.
    let mut sessions = pb::sessions_client::SessionsClient::new(client.channel());
    let run = sessions
        .run(pb::RunRequest {
            session: 999,
            feeds: vec![],
            tag: 0,
            ..Default::default()
        })
        .await;
    expect(
        run.map_err(Error::Status),
        Code::NotFound,
        &["session 999 does not exist"],
        "unknown session",
    );
    let close = sessions.close(pb::CloseRequest { session: 999 }).await;
    expect(
        close.map_err(Error::Status),
        Code::NotFound,
        &["session 999"],
        "close unknown",
    );
    let chunk_first = tokio_stream::iter(vec![pb::OpenRequest {
        item: Some(pb::open_request::Item::Commit(pb::Commit {})),
    }]);
    let mut stream = sessions.open(chunk_first).await.unwrap().into_inner();
    let first = stream.message().await;
    expect(
        first.map_err(Error::Status),
        Code::InvalidArgument,
        &["first Open message must be `open`"],
        "commit first",
    );

    // None of it touched the good session: it trains exactly as alone.
    let (losses, w) = j.on(&session, 3).await;
    assert_eq!((losses, w), j.alone(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_out_of_range_fails_the_iteration_and_changes_nothing() {
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let table: Vec<f32> = (1..=8).map(|v| v as f32).collect();
    let mut session = client
        .open(OpenOptions {
            graph: salus_graph::samples::embedding_sum().to_proto(),
            kind: pb::SessionKind::Training,
            hints: pb::Hints::default(),
            initial: vec![(0, bytes(&table))],
        })
        .await
        .unwrap();
    session.admitted().await.unwrap();
    let neighbour = job();
    let mut other = client.open(neighbour.options()).await.unwrap();
    other.admitted().await.unwrap();
    let ids = |v: [i64; 3]| vec![v.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()];
    expect(
        session.run(ids([0, 7, 1])).await,
        Code::FailedPrecondition,
        &["node 0", "embedding", "7", "4"],
        "index",
    );
    assert_eq!(
        session.read(&[0]).await.unwrap()[0].1,
        bytes(&table),
        "state unchanged"
    );
    let out = session.run(ids([0, 3, 1])).await.unwrap();
    // Rows 0, 3, 1: (1+2) + (7+8) + (3+4) = 25.
    assert_eq!(floats(&out.fetches[0]), vec![25.0]);
    assert_eq!(neighbour.on(&other, 2).await, neighbour.alone(2));
}

/// Run by `another_user_cannot_touch_a_session` as uid 65534 (nobody), group 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: runs as another user, started by another_user_cannot_touch_a_session"]
async fn as_another_user() {
    let address = std::env::var("SALUS_TEST_ADDRESS").unwrap();
    let id: u64 = std::env::var("SALUS_TEST_SESSION")
        .unwrap()
        .parse()
        .unwrap();
    let client = Client::connect_with_token(&address, None).await.unwrap();
    let mut sessions = pb::sessions_client::SessionsClient::new(client.channel());
    let denied = |r: Result<tonic::Response<_>, tonic::Status>, what: &str| {
        let status = r.map(|_: tonic::Response<()>| ()).unwrap_err();
        assert_eq!(
            status.code(),
            Code::PermissionDenied,
            "{what}: {}",
            status.message()
        );
        assert!(
            status.message().contains("uid 65534 may not use it"),
            "{}",
            status.message()
        );
    };
    denied(
        sessions
            .run(pb::RunRequest {
                session: id,
                feeds: vec![],
                tag: 0,
                ..Default::default()
            })
            .await
            .map(|r| r.map(|_| ())),
        "run",
    );
    denied(
        sessions
            .close(pb::CloseRequest { session: id })
            .await
            .map(|r| r.map(|_| ())),
        "close",
    );
    let read = sessions
        .read_tensors(pb::ReadTensorsRequest {
            session: id,
            tensors: vec![],
        })
        .await;
    denied(read.map(|r| r.map(|_| ())), "read");
    let write = sessions
        .write_tensors(tokio_stream::iter(vec![pb::WriteTensorsRequest {
            item: Some(pb::write_tensors_request::Item::Session(id)),
        }]))
        .await;
    denied(write.map(|r| r.map(|_| ())), "write");
    // Status shows the session, without its tensors.
    let listed = client.list_sessions().await.unwrap();
    assert!(listed.iter().any(|s| s.id == id && s.owner_uid == 0));
    let policy = client.policy(Some("fair")).await.unwrap_err();
    assert!(policy.to_string().contains("PermissionDenied"), "{policy}");
    let drain = client.drain(true).await.unwrap_err();
    assert!(
        drain
            .to_string()
            .contains("needs root or the daemon's user"),
        "{drain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_cannot_touch_a_session() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if salus_client::current_uid() != 0 {
        eprintln!(
            "skipped: acting as another user needs root (the rules are unit-tested in auth.rs)"
        );
        return;
    }
    let daemon = Daemon::start(&["--policy", "pack"]);
    // Group members reach the socket (0660); let them through the test's directory too.
    std::fs::set_permissions(daemon.dir.path(), std::fs::Permissions::from_mode(0o750)).unwrap();
    let client = daemon.client().await;
    let j = job();
    let mut session = client.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    let exe = std::env::current_exe().unwrap();
    let address = daemon.address();
    let id = session.id.to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args(["--ignored", "--exact", "as_another_user", "--nocapture"])
            .env("SALUS_TEST_ADDRESS", address)
            .env("SALUS_TEST_SESSION", id)
            .uid(65534)
            .gid(0)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    // The owner's session is intact.
    assert_eq!(j.on(&session, 2).await, j.alone(2));
    assert_eq!(client.policy(None).await.unwrap(), "pack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_needs_the_token() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let listen = format!("127.0.0.1:{port}");
    let daemon = Daemon::start(&[
        "--listen",
        &listen,
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    let wait = std::time::Instant::now();
    let anonymous = loop {
        match Client::connect_with_token(&listen, None).await {
            Ok(c) => break c,
            Err(_) if wait.elapsed().as_secs() < 10 => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            Err(e) => panic!("{e}: {}", daemon.log()),
        }
    };
    expect(
        anonymous.status().await,
        Code::Unauthenticated,
        &["Bearer"],
        "no token",
    );
    let wrong = Client::connect_with_token(&listen, Some("guess".into()))
        .await
        .unwrap();
    expect(
        wrong.status().await,
        Code::Unauthenticated,
        &["wrong bearer token"],
        "wrong token",
    );
    let right = Client::connect_with_token(&listen, Some("s3cret".into()))
        .await
        .unwrap();
    assert_eq!(right.policy(Some("srtf")).await.unwrap(), "srtf");
    let j = job();
    let mut session = right.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    assert_eq!(j.on(&session, 2).await, j.alone(2));
}

#[test]
fn tcp_without_a_token_is_refused_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_salusd"))
        .args(["--socket", "/nonexistent/s.sock", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--listen needs --token-file"), "{err}");
}

#[test]
fn bad_settings_are_named() {
    for (args, needle) in [
        (&["--policy", "lottery"][..], "unknown policy"),
        (&["--memory", "lots"][..], "--memory"),
        (&["--device", "tpu"][..], "unknown device"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_salusd"))
            .args(["--socket", "/tmp/salus-test-never.sock"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Sessions waiting for admission hold their tensors in host memory, within a limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_sessions_cannot_exhaust_host_memory() {
    let daemon = Daemon::start(&[
        "--policy",
        "fifo",
        "--memory",
        "16MiB",
        "--host-memory",
        "1MiB",
    ]);
    let client = daemon.client().await;
    let job = |seed| Job::new("half-mib", 4, 512, 256, seed); // P = 512 KiB
    let mut running = client.open(job(1).options()).await.unwrap();
    running.admitted().await.unwrap();
    // Two waiting sessions fill the 1 MiB; a third is refused, saying why.
    let first_waiting = client.open(job(2).options()).await.unwrap();
    let _second_waiting = client.open(job(3).options()).await.unwrap();
    expect(
        client.open(job(4).options()).await.map(|s| s.id),
        Code::ResourceExhausted,
        &[
            "waiting sessions hold 1048576 bytes of host memory",
            "--host-memory",
        ],
        "host memory",
    );
    // A waiting session that leaves gives its share back.
    first_waiting.close().await.unwrap();
    let again = client.open(job(4).options()).await.unwrap();
    assert!(again.id > 0);
    assert_eq!(job(1).on(&running, 2).await, job(1).alone(2));
}

#[test]
fn cuda_without_a_usable_gpu_exits_with_the_reason_and_no_panic() {
    let Err(reason) = salus_cuda::CudaDevice::probe() else {
        eprintln!("skipped: this host has a usable GPU");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_salusd"))
        .args([
            "--socket",
            "/tmp/salus-test-never.sock",
            "--device",
            "cuda:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device cuda:0") && err.contains(&reason),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
