//! Bad requests get a gRPC status that says what was wrong, and change nothing else;
//! sessions belong to their users; TCP needs the token.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Daemon, Job, bytes, floats, free_address, refused_start};
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
        &["run request: the graph takes 2 feeds, 1 given"],
        "feed count",
    );
    // A client's mistake, not a device fault.
    let count = session.run(vec![]).await.unwrap_err().to_string();
    assert!(!count.contains("device"), "{count}");
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

/// The token of the TCP tests: 16 bytes or more, as salusd requires.
const TOKEN: &str = "s3cret-s3cret-s3cret";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_needs_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let listen = free_address();
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
    // Wrong, empty (`authorization: Bearer `), a prefix, and the token twice.
    for guess in ["guess", "", &TOKEN[..6], &TOKEN.repeat(2)] {
        let wrong = Client::connect_with_token(&listen, Some(guess.into()))
            .await
            .unwrap();
        expect(
            wrong.status().await,
            Code::Unauthenticated,
            &["wrong bearer token"],
            &format!("token {guess:?}"),
        );
    }
    let right = Client::connect_with_token(&listen, Some(TOKEN.into()))
        .await
        .unwrap();
    assert_eq!(right.policy(Some("srtf")).await.unwrap(), "srtf");
    let j = job();
    let mut session = right.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    assert_eq!(j.on(&session, 2).await, j.alone(2));
}

/// A certificate and key for `localhost` and 127.0.0.1, and the CA that signed them
/// (`tests/tls/`, made with openssl, valid until 2126).
fn tls_file(name: &str) -> String {
    format!("{}/tests/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `--tls-cert`/`--tls-key` serve TCP clients over TLS: a client that trusts the CA gets
/// through with the token, one without the token is refused, and one speaking plain
/// text does not get through at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_over_tls_needs_the_ca_and_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let listen = free_address();
    let (cert, key, ca) = (
        tls_file("server.pem"),
        tls_file("server.key"),
        tls_file("ca.pem"),
    );
    let daemon = Daemon::start(&[
        "--listen",
        &listen,
        "--token-file",
        token_file.to_str().unwrap(),
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ]);
    let port = listen.rsplit(':').next().unwrap();
    let ca = std::path::Path::new(&ca);
    let connect = |address: String, token: Option<&str>| {
        let token = token.map(str::to_string);
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                match Client::connect_with(&address, token.clone(), Some(ca)).await {
                    Ok(client) => return client,
                    Err(e) if std::time::Instant::now() > deadline => panic!("{e}"),
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
                }
            }
        }
    };
    let trusted = connect(format!("https://localhost:{port}"), Some(TOKEN)).await;
    let j = job();
    let mut session = trusted.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    assert_eq!(j.on(&session, 2).await, j.alone(2));
    let by_address = connect(format!("https://127.0.0.1:{port}"), Some(TOKEN)).await;
    assert!(by_address.status().await.is_ok());
    let anonymous = connect(format!("https://localhost:{port}"), None).await;
    expect(
        anonymous.status().await,
        Code::Unauthenticated,
        &["Bearer"],
        "TLS without the token",
    );
    let plain = Client::connect_with_token(&listen, Some(TOKEN.into())).await;
    // Refused when connecting or at the first call.
    if let Ok(client) = plain {
        assert!(client.status().await.is_err(), "plain text got through");
    }
    let untrusted = Client::connect_with(
        &format!("https://localhost:{port}"),
        Some(TOKEN.into()),
        Some(std::path::Path::new(&cert)),
    )
    .await;
    if let Ok(client) = untrusted {
        assert!(client.status().await.is_err(), "an unknown CA was trusted");
    }
    // The Unix socket stays plain.
    assert!(daemon.client().await.status().await.is_ok());
}

/// A TLS setting that cannot be used stops salusd at start (exit 2).
#[test]
fn unusable_tls_settings_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let listen = free_address();
    let socket = dir.path().join("s.sock");
    let (cert, key) = (tls_file("server.pem"), tls_file("server.key"));
    let base = [
        "--socket",
        socket.to_str().unwrap(),
        "--token-file",
        token_file.to_str().unwrap(),
    ];
    for (args, needle) in [
        (
            vec!["--listen", &listen, "--tls-cert", &cert],
            "go together",
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &key],
            "needs --listen",
        ),
        (
            vec![
                "--listen",
                &listen,
                "--tls-cert",
                garbage.to_str().unwrap(),
                "--tls-key",
                &key,
            ],
            "--tls-cert",
        ),
        (
            vec!["--listen", &listen, "--tls-cert", &cert, "--tls-key", &cert],
            "--tls-key",
        ),
        (
            vec![
                "--listen",
                &listen,
                "--tls-cert",
                &cert,
                "--tls-key",
                "/nonexistent.key",
            ],
            "--tls-key: reading /nonexistent.key",
        ),
    ] {
        let (code, err) = refused_start(&[&base[..], &args].concat());
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!socket.exists(), "{args:?}: nothing listens");
    }
}

/// A bad setting exits with code 2, as docs/operations.md says (`--listen` without a token
/// exited with 1).
#[test]
fn tcp_without_a_token_is_refused_at_start() {
    let (code, err) =
        refused_start(&["--socket", "/nonexistent/s.sock", "--listen", "127.0.0.1:0"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--listen needs --token-file"), "{err}");
}

#[test]
fn bad_settings_are_named() {
    for (args, needle) in [
        (&["--policy", "lottery"][..], "unknown policy"),
        (&["--memory", "lots"][..], "--memory"),
        (&["--device", "tpu"][..], "unknown device"),
        (&["--open-timeout", "soon"][..], "--open-timeout"),
        (
            &["--max-sessions-per-user", "0"][..],
            "--max-sessions-per-user",
        ),
        (&["--user-host-memory", "lots"][..], "--user-host-memory"),
    ] {
        let (code, err) =
            refused_start(&[&["--socket", "/tmp/salus-test-never.sock"], args].concat());
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// A token file with only whitespace was accepted, and a TCP client sending
/// `authorization: Bearer ` then acted as the daemon's user. Empty and short tokens stop
/// salusd at start now.
#[test]
fn weak_tokens_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let listen = free_address();
    for (text, needle) in [
        ("", "holds no token"),
        ("  \n\t \n", "holds no token"),
        ("s3cret\n", "is 6 bytes; it must be at least 16"),
        ("fifteen-bytes!!", "is 15 bytes; it must be at least 16"),
    ] {
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, text).unwrap();
        let socket = dir.path().join("s.sock");
        let (code, err) = refused_start(&[
            "--socket",
            socket.to_str().unwrap(),
            "--listen",
            &listen,
            "--token-file",
            token_file.to_str().unwrap(),
        ]);
        assert_eq!(code, Some(2), "{text:?}: {err}");
        assert!(
            err.contains("--token-file") && err.contains(needle),
            "{text:?}: {err}"
        );
        assert!(!socket.exists(), "nothing listens");
    }
}

/// `--socket` naming a regular file deleted the file and put the socket there; now salusd
/// refuses (exit 2) and leaves the file as it was. A stale socket is still replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_path_that_is_not_a_socket_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("precious.txt");
    std::fs::write(&file, "do not delete").unwrap();
    let (code, err) = refused_start(&["--socket", file.to_str().unwrap(), "--device", "cpu"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("exists and is a regular file"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "do not delete");
    let (code, err) = refused_start(&["--socket", dir.path().to_str().unwrap()]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is a directory"), "{err}");

    // A socket nobody answers on (a daemon that was killed) is replaced.
    let daemon = Daemon::start(&[]);
    let socket = daemon.socket.clone();
    let stale = dir.path().join("stale.sock");
    std::fs::rename(&socket, &stale).unwrap();
    drop(daemon);
    let again = Daemon::start_at(&stale, &[]);
    assert!(again.client().await.status().await.is_ok());
}

/// `hints.expected_iteration_ms = 1e23` panicked in the service and the Open stream ended
/// with OK and no `opened`. Hints are checked now, and are INVALID_ARGUMENT naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_hints_are_refused_by_name() {
    let daemon = Daemon::start(&["--device", "sim"]);
    let client = daemon.client().await;
    for ms in [1e23, f64::INFINITY, f64::NAN, -1.0, 86_400_001.0] {
        let mut options = job().options();
        options.hints.expected_iteration_ms = ms;
        expect(
            client.open(options).await.map(|s| s.id),
            Code::InvalidArgument,
            &[
                "hints.expected_iteration_ms",
                "from 0 (unknown) to 86400000",
            ],
            &format!("{ms} ms"),
        );
    }
    let mut options = job().options();
    options.hints.expected_iteration_ms = 86_400_000.0;
    let session = client.open(options).await.unwrap();
    session.close().await.unwrap();
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
}

/// Raw request bytes: for requests no client would send.
mod raw {
    use salus_client::v1 as pb;
    use salus_proto::codec::SalusDecoder;
    use tonic::Status;
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    /// Sends each `Vec<u8>` as one message, as is; decodes `RunResponse`s.
    #[derive(Clone, Default)]
    pub struct RunCodec;

    pub struct Raw;

    impl Encoder for Raw {
        type Item = Vec<u8>;
        type Error = Status;

        fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
            bytes::BufMut::put_slice(buf, &item);
            Ok(())
        }
    }

    pub struct Responses(SalusDecoder<pb::RunResponse>);

    impl Decoder for Responses {
        type Item = pb::RunResponse;
        type Error = Status;

        fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Status> {
            self.0.decode(buf)
        }
    }

    impl Codec for RunCodec {
        type Encode = Vec<u8>;
        type Decode = pb::RunResponse;
        type Encoder = Raw;
        type Decoder = Responses;

        fn encoder(&mut self) -> Raw {
            Raw
        }

        fn decoder(&mut self) -> Responses {
            Responses(SalusDecoder::default())
        }
    }

    pub fn grpc(
        channel: tonic::transport::Channel,
    ) -> tonic::client::Grpc<tonic::transport::Channel> {
        tonic::client::Grpc::new(channel)
    }

    pub fn path(method: &str) -> tonic::codegen::http::uri::PathAndQuery {
        tonic::codegen::http::uri::PathAndQuery::from_maybe_shared(format!(
            "/salus.v1.Sessions/{method}"
        ))
        .unwrap()
    }
}

/// A request that cannot be decoded is INVALID_ARGUMENT (it was INTERNAL), and a RunStream
/// of [valid, truncated, valid] answers the first and then ends with INVALID_ARGUMENT naming
/// the second (it ended with OK, the third lost without a word).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_requests_are_invalid_argument_and_end_a_run_stream() {
    use prost::Message;
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let j = job();
    let mut session = client.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    let request = |tag| pb::RunRequest {
        session: session.id,
        feeds: j.feeds(0),
        tag,
        ..Default::default()
    };
    let valid = request(7).encode_to_vec();
    let truncated = valid[..valid.len() - 10].to_vec();

    let mut grpc = raw::grpc(client.channel());
    grpc.ready().await.unwrap();
    let unary = grpc
        .unary(
            tonic::Request::new(truncated.clone()),
            raw::path("Run"),
            raw::RunCodec,
        )
        .await;
    let status = unary.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{}", status.message());
    assert!(
        status
            .message()
            .contains("RunRequest message could not be decoded"),
        "{}",
        status.message()
    );

    grpc.ready().await.unwrap();
    let messages = vec![valid.clone(), truncated, request(9).encode_to_vec()];
    let mut responses = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter(messages)),
            raw::path("RunStream"),
            raw::RunCodec,
        )
        .await
        .unwrap()
        .into_inner();
    let first = responses.message().await.unwrap().unwrap();
    assert_eq!(first.tag, 7);
    assert!(first.failure.is_none(), "{:?}", first.failure);
    let end = responses.message().await.unwrap_err();
    assert_eq!(end.code(), Code::InvalidArgument, "{}", end.message());
    assert!(
        end.message()
            .contains("RunStream request 2 (after the request tagged 7)"),
        "{}",
        end.message()
    );
    // The session is as it was after one iteration.
    assert_eq!(j.on(&session, 0).await.1, j.alone(1).1);
}

/// Errors echoed unbounded input (a 10,000-character op name, 100,000 permute dims: a
/// 649 KB message) and clients got the transport's RESOURCE_EXHAUSTED. Messages are cut
/// to 1 KiB now and the status is the one the error deserves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_about_huge_input_are_short_and_keep_their_status() {
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let j = job();
    let open = |graph: pb::Graph, initial: Vec<(u32, Vec<u8>)>| OpenOptions {
        graph,
        kind: pb::SessionKind::Training,
        hints: pb::Hints::default(),
        initial,
    };
    let mut long_op = j.graph().to_proto();
    long_op.nodes[2].op = "x".repeat(10_000);
    let mut long_dims = j.graph().to_proto();
    long_dims.nodes[4].attributes.insert(
        "dims".into(),
        pb::Attribute {
            value: Some(pb::attribute::Value::Ints(pb::IntList {
                values: (0..100_000).map(|d| d % 2).collect(),
            })),
        },
    );
    let mut long_names = j.graph().to_proto();
    for tensor in &mut long_names.tensors {
        tensor.name = "n".repeat(100_000) + &tensor.id.to_string();
    }
    let cases = [
        (
            "op name",
            open(long_op, vec![(0, j.initial())]),
            "unknown op",
        ),
        (
            "permute dims",
            open(long_dims, vec![(0, j.initial())]),
            "node 4",
        ),
        (
            "tensor names",
            open(long_names, vec![(0, vec![0; 8])]),
            "tensor 0",
        ),
    ];
    for (case, options, needle) in cases {
        match client.open(options).await.map(|s| s.id) {
            Err(Error::Status(status)) => {
                assert_eq!(
                    status.code(),
                    Code::InvalidArgument,
                    "{case}: {}",
                    status.message()
                );
                assert!(
                    status.message().contains(needle),
                    "{case}: {}",
                    status.message()
                );
                assert!(
                    status.message().len() <= 1024,
                    "{case}: {}",
                    status.message().len()
                );
            }
            other => panic!("{case}: {other:?}"),
        }
    }
}

/// A node whose op's only result is -1 (unused) passed the open and then failed every
/// iteration; duplicate node names passed too. Both are refused at open now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graphs_that_could_never_run_are_refused_at_open() {
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let j = job();
    let mut unused = j.graph().to_proto();
    unused.nodes[1].outputs[0] = -1;
    let mut twins = j.graph().to_proto();
    twins.nodes[3].name = twins.nodes[1].name.clone();
    let mut bad_permute = j.graph().to_proto();
    bad_permute.nodes[4].attributes.insert(
        "dims".into(),
        pb::Attribute {
            value: Some(pb::attribute::Value::Ints(pb::IntList {
                values: vec![-3, 0],
            })),
        },
    );
    for (case, graph, needles) in [
        (
            "unused only result",
            unused,
            &["node 1", "output 0 is -1 (unused)"][..],
        ),
        (
            "duplicate names",
            twins,
            &["node 3", "node 1 has the same name"][..],
        ),
        (
            "permute",
            bad_permute,
            &["node 4", "dimension -3 out of range"][..],
        ),
    ] {
        let options = OpenOptions {
            graph,
            kind: pb::SessionKind::Training,
            hints: pb::Hints::default(),
            initial: vec![(0, j.initial())],
        };
        expect(
            client.open(options).await.map(|s| s.id),
            Code::InvalidArgument,
            needles,
            case,
        );
    }
}

/// ReadTensors with one 4 MiB tensor listed 1,024 times copied it each time before
/// streaming. A read names each tensor once now, so it is at most the session's P bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_names_each_tensor_once() {
    let daemon = Daemon::start(&["--policy", "pack"]);
    let client = daemon.client().await;
    let j = job();
    let mut session = client.open(j.options()).await.unwrap();
    session.admitted().await.unwrap();
    expect(
        session.read(&[0; 1024]).await,
        Code::InvalidArgument,
        &["ReadTensors names tensor 0 twice"],
        "repeated read",
    );
    expect(
        session.write(&[(0, j.initial()), (0, j.initial())]).await,
        Code::InvalidArgument,
        &["WriteTensors names tensor 0 twice"],
        "repeated write",
    );
    assert_eq!(session.read(&[0]).await.unwrap(), vec![(0, j.initial())]);
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
            "hold 1048576 bytes of host memory",
            "(salusd --host-memory)",
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
