//! Prometheus metrics over HTTP: `GET /metrics` in the text exposition format.
//!
//! A minimal HTTP/1.1 responder on its own listener; each scrape asks the engine for its
//! numbers (one command, microseconds).

use std::fmt::Write as _;

use salus_core::HealthState;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::engine::{Command, Engine, HISTOGRAM_BOUNDS, Metrics, SessionMetrics, UserUsage};
use crate::serving::{Servers, ServingStats};

/// A per-session family: name, type, help, and the sample's value.
type SessionFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&SessionMetrics) -> String,
);

/// A per-user family: name, help, and the sample's value.
type UserFamily = (&'static str, &'static str, fn(&UserUsage) -> u64);

/// One sample of a family without labels: `name value`.
fn gauge(name: &'static str, value: impl std::fmt::Display) -> impl FnMut(&mut String) {
    move |out: &mut String| {
        let _ = writeln!(out, "{name} {value}");
    }
}

/// The exposition text for the engine's current numbers: each family's HELP and TYPE,
/// then all its samples.
pub fn render(engine: &Engine, metrics: Metrics, serving: &Servers) -> String {
    let Metrics {
        sessions,
        lane_bytes,
        persistent_bytes,
        quotas,
        protection,
    } = metrics;
    let memory = engine.memory();
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: &mut dyn FnMut(&mut String)| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        samples(&mut out);
    };
    let labels = |s: &SessionMetrics| format!("session=\"{}\",name=\"{}\"", s.id, escape(&s.name));
    family(
        "salus_memory_capacity_bytes",
        "gauge",
        "Bytes of the device arena.",
        &mut gauge("salus_memory_capacity_bytes", memory.capacity),
    );
    family(
        "salus_memory_reserve_bytes",
        "gauge",
        "Bytes kept free.",
        &mut gauge("salus_memory_reserve_bytes", memory.reserve),
    );
    family(
        "salus_memory_persistent_bytes",
        "gauge",
        "Bytes of persistent tensors of admitted sessions.",
        &mut gauge("salus_memory_persistent_bytes", persistent_bytes),
    );
    family(
        "salus_memory_lane_bytes",
        "gauge",
        "Bytes of lanes.",
        &mut gauge("salus_memory_lane_bytes", lane_bytes),
    );
    family(
        "salus_memory_in_use_bytes",
        "gauge",
        "Persistent plus lane bytes.",
        &mut gauge("salus_memory_in_use_bytes", persistent_bytes + lane_bytes),
    );
    family(
        "salus_offline_bytes",
        "gauge",
        "Bytes offline sessions hold (persistent and their lanes).",
        &mut gauge("salus_offline_bytes", protection.offline_bytes),
    );
    family(
        "salus_offline_limit_bytes",
        "gauge",
        "The most offline sessions may hold together (--offline-share).",
        &mut gauge("salus_offline_limit_bytes", protection.offline_limit),
    );
    family(
        "salus_offline_evictions_total",
        "counter",
        "Offline sessions suspended to host memory to protect online ones.",
        &mut gauge(
            "salus_offline_evictions_total",
            protection.offline_evictions,
        ),
    );
    family(
        "salus_offline_duty",
        "gauge",
        "The fraction of time offline iterations may run while online sessions are active.",
        &mut gauge("salus_offline_duty", protection.offline_duty),
    );
    family(
        "salus_offline_compute_share",
        "gauge",
        "The share of the device an offline iteration may use while an online one runs.",
        &mut gauge(
            "salus_offline_compute_share",
            protection.offline_compute_share,
        ),
    );
    let health = protection.health;
    family(
        "salus_protection_health",
        "gauge",
        "1 for the protection's health state now (init, healthy, unhealthy, overlimit, disabled).",
        &mut |out: &mut String| {
            for state in [
                HealthState::Init,
                HealthState::Healthy,
                HealthState::Unhealthy,
                HealthState::Overlimit,
                HealthState::Disabled,
            ] {
                let on = u8::from(state == health);
                let _ = writeln!(out, "salus_protection_health{{state=\"{state}\"}} {on}");
            }
        },
    );
    family(
        "salus_host_image_bytes",
        "gauge",
        "Host memory held by opening, waiting and suspended sessions.",
        &mut gauge("salus_host_image_bytes", quotas.host_bytes),
    );
    family(
        "salus_opening_sessions",
        "gauge",
        "Sessions whose Open stream has not committed yet.",
        &mut gauge("salus_opening_sessions", quotas.opening),
    );
    family(
        "salus_opening_bytes",
        "gauge",
        "Host memory reserved for opening sessions.",
        &mut gauge("salus_opening_bytes", quotas.opening_bytes),
    );
    let config = quotas.config;
    family(
        "salus_limit_host_memory_bytes",
        "gauge",
        "--host-memory: host memory sessions off the device may hold in all.",
        &mut gauge("salus_limit_host_memory_bytes", config.host_memory),
    );
    family(
        "salus_limit_user_host_memory_bytes",
        "gauge",
        "--user-host-memory: host memory one user's sessions off the device may hold.",
        &mut gauge(
            "salus_limit_user_host_memory_bytes",
            config.user_host_memory,
        ),
    );
    family(
        "salus_limit_sessions_per_user",
        "gauge",
        "--max-sessions-per-user: sessions one user may have open or opening.",
        &mut gauge(
            "salus_limit_sessions_per_user",
            config.max_sessions_per_user,
        ),
    );
    let per_user: [UserFamily; 3] = [
        (
            "salus_user_sessions",
            "Sessions open or opening, per user.",
            |u| u.sessions,
        ),
        (
            "salus_user_opening_sessions",
            "Sessions opening, per user.",
            |u| u.opening,
        ),
        (
            "salus_user_host_bytes",
            "Host memory held by a user's sessions off the device.",
            |u| u.host_bytes,
        ),
    ];
    for (name, help, value) in per_user {
        family(name, "gauge", help, &mut |out: &mut String| {
            for (uid, usage) in &quotas.users {
                let _ = writeln!(out, "{name}{{uid=\"{uid}\"}} {}", value(usage));
            }
        });
    }
    family(
        "salus_sessions",
        "gauge",
        "Open sessions.",
        &mut gauge("salus_sessions", sessions.len() as u64),
    );
    let per_session: [SessionFamily; 4] = [
        (
            "salus_session_iterations_total",
            "counter",
            "Iterations finished, per session.",
            |s| s.iterations.to_string(),
        ),
        (
            "salus_session_queue_wait_seconds",
            "gauge",
            "Time waited for admission, per session.",
            |s| s.queue_wait_seconds.to_string(),
        ),
        (
            "salus_session_persistent_bytes",
            "gauge",
            "P, per session.",
            |s| s.persistent_bytes.to_string(),
        ),
        (
            "salus_session_ephemeral_bytes",
            "gauge",
            "E, per session.",
            |s| s.ephemeral_bytes.to_string(),
        ),
    ];
    for (name, kind, help, value) in per_session {
        family(name, kind, help, &mut |out: &mut String| {
            for s in &sessions {
                let _ = writeln!(out, "{name}{{{}}} {}", labels(s), value(s));
            }
        });
    }
    family(
        "salus_iteration_seconds",
        "histogram",
        "Device time of iterations, per session.",
        &mut |out: &mut String| {
            for s in &sessions {
                let labels = labels(s);
                let mut cumulative = 0;
                for (i, count) in s.histogram.iter().enumerate() {
                    cumulative += count;
                    let le = HISTOGRAM_BOUNDS
                        .get(i)
                        .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
                    let _ = writeln!(
                        out,
                        "salus_iteration_seconds_bucket{{{labels},le=\"{le}\"}} {cumulative}"
                    );
                }
                let _ = writeln!(
                    out,
                    "salus_iteration_seconds_sum{{{labels}}} {}",
                    s.iteration_seconds
                );
                let _ = writeln!(
                    out,
                    "salus_iteration_seconds_count{{{labels}}} {cumulative}"
                );
            }
        },
    );
    let mut served: Vec<(u64, ServingStats)> = serving.stats().into_iter().collect();
    served.sort_by_key(|s| s.0);
    family(
        "salus_serving_requests_total",
        "counter",
        "Requests of a served model by outcome: finished (met_deadline of them on time), \
         dropped by its scheduler, failed.",
        &mut |out: &mut String| {
            for (id, s) in &served {
                for (outcome, n) in [
                    ("finished", s.finished),
                    ("met_deadline", s.met_deadline),
                    ("dropped", s.dropped),
                    ("failed", s.failed),
                ] {
                    let _ = writeln!(
                        out,
                        "salus_serving_requests_total{{session=\"{id}\",outcome=\"{outcome}\"}} {n}"
                    );
                }
            }
        },
    );
    family(
        "salus_serving_pending_requests",
        "gauge",
        "Requests of a served model waiting for a batch.",
        &mut |out: &mut String| {
            for (id, s) in &served {
                let _ = writeln!(
                    out,
                    "salus_serving_pending_requests{{session=\"{id}\"}} {}",
                    s.pending
                );
            }
        },
    );
    family(
        "salus_serving_latency_seconds",
        "summary",
        "Latency (arrival to answer) of a served model's recent finished requests.",
        &mut |out: &mut String| {
            for (id, s) in &served {
                for q in [0.5, 0.99] {
                    if let Some(l) = s.latency_quantile(q) {
                        let _ = writeln!(
                            out,
                            "salus_serving_latency_seconds{{session=\"{id}\",quantile=\"{q}\"}} {}",
                            l.as_secs_f64()
                        );
                    }
                }
            }
        },
    );
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Serves `GET /metrics` (and `/`) on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, engine: Engine, serving: Servers) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            continue;
        };
        let (engine, serving) = (engine.clone(), serving.clone());
        tokio::spawn(async move {
            let mut request = vec![0u8; 4096];
            let n = match socket.read(&mut request).await {
                Ok(n) => n,
                Err(_) => return,
            };
            let head = String::from_utf8_lossy(&request[..n]);
            let path = head.split_whitespace().nth(1).unwrap_or("/");
            let (status, body) = if path == "/metrics" || path == "/" {
                match engine.ask(Command::Metrics).await {
                    Ok(metrics) => ("200 OK", render(&engine, metrics, &serving)),
                    Err(error) => ("503 Service Unavailable", format!("{error}\n")),
                }
            } else {
                (
                    "404 Not Found",
                    "not found; metrics are at /metrics\n".to_string(),
                )
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(response.as_bytes()).await;
        });
    }
}
