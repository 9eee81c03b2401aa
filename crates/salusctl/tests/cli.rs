//! salusctl against a real daemon (in this process, on a temporary socket) in a known
//! state: one admitted session and one queued behind it under FIFO.

#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use salus_client::{Client, OpenOptions, v1 as pb};
use salusd::Config;

fn salusctl(socket: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_salusctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn options(name: &str) -> OpenOptions {
    // w: [256, 64] f32 = 64 KiB.
    let graph = salus_graph::samples::regression(32, 256, 64, 0.1);
    OpenOptions {
        graph: graph.to_proto(),
        kind: pb::SessionKind::Training,
        hints: pb::Hints {
            name: name.into(),
            total_iterations: 100,
            ..Default::default()
        },
        initial: vec![(0, vec![0u8; 256 * 64 * 4])],
    }
}

#[test]
fn status_sessions_policy_and_json_for_a_known_state() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let mut config = Config::new(socket.clone());
    config.memory = 64 << 20;
    // One session at a time, so the second waits with a reason to show.
    config.policy = "fifo".parse().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime
            .block_on(salusd::run(config, async {
                let _ = stopped.await;
            }))
            .unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    let address = socket.display().to_string();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (first, second) = runtime.block_on(async {
        let client = Client::connect_with_token(&address, None).await.unwrap();
        let mut first = client.open(options("resnet-ish")).await.unwrap();
        first.admitted().await.unwrap();
        let second = client.open(options("waiting-job")).await.unwrap();
        (first, second)
    });

    let (ok, text, err) = salusctl(&address, &["status"]);
    assert!(ok, "{err}");
    assert!(text.contains("on cpu: policy fifo, admitting"), "{text}");
    assert!(
        text.contains("memory 64.0 MiB (reserve 0 B): persistent 64.0 KiB"),
        "{text}"
    );
    let (a, b) = (first.id, second.id);
    assert!(
        text.contains(&format!("persistent  session {a} (resnet-ish)")),
        "{text}"
    );
    assert!(
        text.contains(&format!("lane 0      session {a} (resnet-ish)")),
        "{text}"
    );
    assert!(text.contains("free"), "{text}");
    assert!(
        text.contains(&format!(
            "session {b} (waiting-job): policy fifo runs one session at a time and session {a} holds the device"
        )),
        "{text}"
    );
    // What sessions off the device hold, against the limits.
    assert!(
        text.contains(
            "host memory 64.0 KiB of 64.0 MiB held by sessions off the device; opening 0 (0 B)"
        ),
        "{text}"
    );
    assert!(
        text.contains("per user: 64 sessions, 32.0 MiB host memory; open timeout 5m00s"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "uid {}: sessions 2 (not limited), host memory 64.0 KiB",
            salus_client::current_uid()
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "protection healthy: offline duty 0.50, offline share beside online work 0.000 \
             (fixed), offline sessions hold 0 B of 25.6 MiB, 0 evicted, 0 iterations abandoned"
        ),
        "{text}"
    );
    let bar = text.lines().nth(2).unwrap().trim();
    assert!(
        bar.starts_with("[P") && bar.ends_with("0]") && bar.len() == 66,
        "{bar}"
    );

    let (ok, json, err) = salusctl(&address, &["status", "--json"]);
    assert!(ok, "{err}");
    let status: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(status["policy"], "fifo");
    assert_eq!(status["memory"]["capacity"], 64 << 20);
    assert_eq!(status["memory"]["persistent_bytes"], 64 << 10);
    assert_eq!(status["queue"][0]["session"], b);
    assert_eq!(status["lanes"][0]["sessions"][0], a);
    assert_eq!(status["limits"]["max_sessions_per_user"], 64);
    assert_eq!(status["users"][0]["sessions"], 2);
    assert_eq!(status["host_bytes"], 64 << 10);
    assert_eq!(status["protection"]["health"], "healthy");
    assert_eq!(status["protection"]["offline_limit"], (64u64 << 20) * 2 / 5);
    let total: u64 = status["memory"]["regions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["size"].as_u64().unwrap())
        .sum();
    assert_eq!(total, 64 << 20, "the map covers the device");

    let (ok, text, err) = salusctl(&address, &["sessions"]);
    assert!(ok, "{err}");
    let id_width = a.to_string().len();
    assert!(
        text.starts_with(&format!("{:>id_width$}  NAME", "ID")),
        "{text}"
    );
    assert!(text.contains(&format!("{a}  resnet-ish")), "{text}");
    assert!(text.contains("resnet-ish"), "{text}");
    assert!(text.contains("admitted"), "{text}");
    assert!(text.contains("0/100"), "{text}");
    assert!(
        text.contains("waiting: policy fifo runs one session at a time"),
        "{text}"
    );
    let (ok, json, _) = salusctl(&address, &["sessions", "--json"]);
    assert!(ok);
    let sessions: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(sessions[1]["state"], "queued");
    assert_eq!(sessions[0]["persistent_bytes"], 64 << 10);
    assert_eq!(sessions[0]["class"], "online");

    assert_eq!(salusctl(&address, &["policy"]).1, "policy fifo\n");
    assert_eq!(salusctl(&address, &["policy", "pack"]).1, "policy pack\n");
    let (ok, _, err) = salusctl(&address, &["policy", "lottery"]);
    assert!(!ok && err.contains("unknown policy"), "{err}");
    let (_, json, _) = salusctl(&address, &["drain", "--json"]);
    assert_eq!(json.trim(), r#"{"draining":true}"#);
    assert_eq!(salusctl(&address, &["drain", "--resume"]).1, "admitting\n");

    drop((first, second));
    let _ = stop.send(());
    daemon.join().unwrap();
    assert!(!socket.exists());
}

#[test]
fn a_missing_daemon_is_explained() {
    let (ok, _, err) = salusctl("/nonexistent/salusd.sock", &["status"]);
    assert!(!ok);
    assert!(
        err.contains("cannot reach salusd at /nonexistent/salusd.sock"),
        "{err}"
    );
    assert!(err.contains("is salusd running?"), "{err}");
}

/// salusctl reaches a daemon over TLS: `--socket https://host:port`, the CA from
/// SALUS_TLS_CA and the token from SALUS_TOKEN_FILE.
#[test]
fn status_over_tls() {
    let tls = concat!(env!("CARGO_MANIFEST_DIR"), "/../salusd/tests/tls");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("salusd.sock");
    let token = dir.path().join("token");
    std::fs::write(&token, "a-token-of-twenty-bytes").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut config = Config::new(socket.clone());
    config.memory = 64 << 20;
    config.listen = Some(format!("127.0.0.1:{port}").parse().unwrap());
    config.token_file = Some(token.clone());
    config.tls_cert = Some(format!("{tls}/server.pem").into());
    config.tls_key = Some(format!("{tls}/server.key").into());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let daemon = std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime
            .block_on(salusd::run(config, async {
                let _ = stopped.await;
            }))
            .unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    let run = |ca: &str| {
        Command::new(env!("CARGO_BIN_EXE_salusctl"))
            .args(["--socket", &format!("https://localhost:{port}"), "policy"])
            .env("SALUS_TLS_CA", ca)
            .env("SALUS_TOKEN_FILE", &token)
            .output()
            .unwrap()
    };
    let mut out = run(&format!("{tls}/ca.pem"));
    while !out.status.success() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        out = run(&format!("{tls}/ca.pem"));
    }
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "policy share\n");
    let out = run("/nonexistent/ca.pem");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("reading the CA certificate /nonexistent/ca.pem"),
        "{err}"
    );
    let _ = stop.send(());
    daemon.join().unwrap();
}
