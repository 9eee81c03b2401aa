//! `salusctl`: see and steer a running salusd.
//!
//! `status` (device, memory map, lanes, queue, protection of online sessions),
//! `sessions`, `policy [NAME]`, `drain`, `offline [on|off]`, `watch`; `--json` on each for machines. The daemon is found from `--socket`, else
//! `SALUS_ADDRESS`, else the default socket path.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use salus_client::Client;
use salus_client::v1 as pb;
use serde_json::{Value, json};
use tokio_stream::StreamExt;

/// Show and steer salusd.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The daemon: a Unix socket path, host:port, or https://host:port (TLS, trusting the
    /// CA certificate $SALUS_TLS_CA names) [default: $SALUS_ADDRESS, else the default
    /// socket path]. Over TCP the token comes from the file $SALUS_TOKEN_FILE names.
    #[arg(long, global = true)]
    socket: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The device, its memory map, lanes and the queue.
    Status,
    /// Every open session with its statistics.
    Sessions,
    /// Show the policy, or change it (share, pack, srtf, fair, fifo).
    Policy {
        /// The new policy.
        name: Option<String>,
    },
    /// Stop admitting new sessions (running ones go on); --resume to admit again.
    Drain {
        /// Admit again.
        #[arg(long)]
        resume: bool,
    },
    /// Show whether offline sessions may run, or enable (on) or disable (off) them;
    /// disabled, they are suspended to host memory.
    Offline {
        /// on or off.
        #[arg(value_parser = ["on", "off"])]
        switch: Option<String>,
    },
    /// Print events as they happen, until interrupted.
    Watch,
}

/// Bytes for people: 1.50 GiB, 12.0 MiB, 256 B.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else if value >= 100.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else if value >= 10.0 {
        format!("{value:.1} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

fn duration_ms(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s / 60) % 60),
    }
}

fn region_kind(kind: i32) -> &'static str {
    match pb::RegionKind::try_from(kind) {
        Ok(pb::RegionKind::Persistent) => "persistent",
        Ok(pb::RegionKind::Hole) => "hole",
        Ok(pb::RegionKind::Free) => "free",
        Ok(pb::RegionKind::Lane) => "lane",
        _ => "unknown",
    }
}

fn state_name(state: i32) -> &'static str {
    match pb::SessionState::try_from(state) {
        Ok(pb::SessionState::Queued) => "queued",
        Ok(pb::SessionState::Admitted) => "admitted",
        Ok(pb::SessionState::Suspended) => "suspended",
        Ok(pb::SessionState::Closing) => "closing",
        _ => "unknown",
    }
}

fn class_name(class: i32) -> &'static str {
    match pb::SessionClass::try_from(class) {
        Ok(pb::SessionClass::Offline) => "offline",
        _ => "online",
    }
}

fn kind_name(kind: i32) -> &'static str {
    match pb::SessionKind::try_from(kind) {
        Ok(pb::SessionKind::Inference) => "inference",
        _ => "training",
    }
}

fn event_name(kind: i32) -> String {
    pb::EventKind::try_from(kind).map_or_else(
        |_| "unknown".into(),
        |k| {
            k.as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_ascii_lowercase()
        },
    )
}

/// The status as JSON.
fn status_json(s: &pb::StatusResponse) -> Value {
    let device = s.device.clone().unwrap_or_default();
    let memory = s.memory.clone().unwrap_or_default();
    json!({
        "version": s.version,
        "uptime_ms": s.uptime_ms,
        "device": {"name": device.name, "capacity": device.capacity, "reserve": device.reserve},
        "policy": s.policy,
        "draining": s.draining,
        "memory": {
            "capacity": memory.capacity,
            "reserve": memory.reserve,
            "persistent_bytes": memory.persistent_bytes,
            "lane_bytes": memory.lane_bytes,
            "available_bytes": memory.available_bytes,
            "regions": memory.regions.iter().map(|r| {
                let mut v = json!({"offset": r.offset, "size": r.size, "kind": region_kind(r.kind)});
                match pb::RegionKind::try_from(r.kind) {
                    Ok(pb::RegionKind::Persistent) => v["session"] = json!(r.session),
                    Ok(pb::RegionKind::Lane) => {
                        v["lane"] = json!(r.lane);
                        v["sessions"] = json!(r.sessions);
                    }
                    _ => {}
                }
                v
            }).collect::<Vec<_>>(),
        },
        "lanes": s.lanes.iter().map(|l| json!({
            "id": l.id, "size": l.size, "offset": l.offset, "placed": l.placed,
            "sessions": l.sessions, "running": l.running,
        })).collect::<Vec<_>>(),
        "queue": s.queue.iter().map(|q| json!({
            "session": q.session, "name": q.name, "reason": q.reason,
        })).collect::<Vec<_>>(),
        "limits": s.limits.map(|l| json!({
            "host_memory": l.host_memory, "user_host_memory": l.user_host_memory,
            "max_sessions_per_user": l.max_sessions_per_user,
            "open_timeout_ms": l.open_timeout_ms,
        })),
        "host_bytes": s.host_bytes,
        "opening_sessions": s.opening_sessions,
        "opening_bytes": s.opening_bytes,
        "users": s.users.iter().map(|u| json!({
            "uid": u.uid, "sessions": u.sessions, "opening": u.opening,
            "opening_bytes": u.opening_bytes, "host_bytes": u.host_bytes, "limited": u.limited,
        })).collect::<Vec<_>>(),
        "protection": s.protection.as_ref().map(|p| json!({
            "enabled": p.enabled, "health": p.health, "offline_duty": p.offline_duty,
            "offline_compute_share": p.offline_compute_share,
            "offline_compute_share_learned": p.offline_compute_share_learned,
            "offline_bytes": p.offline_bytes, "offline_limit": p.offline_limit,
            "offline_evictions": p.offline_evictions, "overlimit_entries": p.overlimit_entries,
            "offline_abandoned": p.offline_abandoned,
            "online_slowdown_p99": p.online_slowdown_p99, "slo_use_p99": p.slo_use_p99,
            "offline_held_ms": p.offline_held_ms,
            "sm_activity": p.sm_activity, "clock_factor": p.clock_factor,
        })),
    })
}

/// The protection of online sessions, in a line or two.
fn protection_text(s: &pb::StatusResponse) -> String {
    let Some(p) = &s.protection else {
        return String::new();
    };
    if !p.enabled {
        return "protection off: offline sessions are scheduled like online ones\n".into();
    }
    let mut out = format!(
        "protection {}: offline duty {:.2}, offline share beside online work {:.3} ({}), \
         offline sessions hold {} of {}, {} evicted, {} iterations abandoned",
        p.health,
        p.offline_duty,
        p.offline_compute_share,
        if p.offline_compute_share_learned {
            "learned"
        } else {
            "fixed"
        },
        bytes(p.offline_bytes),
        bytes(p.offline_limit),
        p.offline_evictions,
        p.offline_abandoned
    );
    if p.online_slowdown_p99 > 0.0 {
        out += &format!("; online slowdown p99 {:.2}", p.online_slowdown_p99);
    }
    if p.slo_use_p99 > 0.0 {
        out += &format!(", SLO use p99 {:.2}", p.slo_use_p99);
    }
    if p.sm_activity > 0.0 {
        out += &format!("; SM activity {:.2}", p.sm_activity);
    }
    if p.clock_factor > 0.0 {
        out += &format!(", clock factor {:.2}", p.clock_factor);
    }
    if p.offline_held_ms > 0.0 {
        out += &format!("; offline held {:.1} ms", p.offline_held_ms);
    }
    out + "\n"
}

/// Host memory, opening sessions and each user's share against the limits.
fn limits_text(s: &pb::StatusResponse) -> String {
    let limits = s.limits.unwrap_or_default();
    let mut out = format!(
        "host memory {} of {} held by sessions off the device; opening {} ({})\n",
        bytes(s.host_bytes),
        bytes(limits.host_memory),
        s.opening_sessions,
        bytes(s.opening_bytes),
    );
    out += &format!(
        "per user: {} sessions, {} host memory; open timeout {}\n",
        limits.max_sessions_per_user,
        bytes(limits.user_host_memory),
        duration_ms(limits.open_timeout_ms)
    );
    for u in &s.users {
        let (sessions, host) = if u.limited {
            (
                format!("{}/{}", u.sessions, limits.max_sessions_per_user),
                format!("{}/{}", bytes(u.host_bytes), bytes(limits.user_host_memory)),
            )
        } else {
            (format!("{} (not limited)", u.sessions), bytes(u.host_bytes))
        };
        out += &format!("  uid {}: sessions {sessions}, host memory {host}", u.uid);
        if u.opening > 0 {
            out += &format!(", opening {} ({})", u.opening, bytes(u.opening_bytes));
        }
        out += "\n";
    }
    out
}

/// One character per 1/width of memory: P persistent, the lane's digit, . free, _ hole.
fn memory_bar(memory: &pb::MemoryMap, width: u64) -> String {
    if memory.capacity == 0 {
        return String::new();
    }
    (0..width)
        .map(|i| {
            let start = memory.capacity * i / width;
            let end = (memory.capacity * (i + 1) / width).max(start + 1);
            // What covers most of this cell; anything in use beats free space.
            let mut best = ('.', 0u64);
            for r in &memory.regions {
                let overlap = r
                    .offset
                    .saturating_add(r.size)
                    .min(end)
                    .saturating_sub(r.offset.max(start));
                if overlap == 0 {
                    continue;
                }
                let c = match pb::RegionKind::try_from(r.kind) {
                    Ok(pb::RegionKind::Persistent) => 'P',
                    Ok(pb::RegionKind::Lane) => {
                        char::from_digit((r.lane % 10) as u32, 10).unwrap_or('L')
                    }
                    Ok(pb::RegionKind::Hole) => '_',
                    _ => '.',
                };
                let weight = if c == '.' {
                    overlap
                } else {
                    overlap.saturating_mul(1 << 20)
                };
                if weight > best.1 {
                    best = (c, weight);
                }
            }
            best.0
        })
        .collect()
}

fn status_text(s: &pb::StatusResponse, sessions: &[pb::SessionInfo]) -> String {
    let device = s.device.clone().unwrap_or_default();
    let memory = s.memory.clone().unwrap_or_default();
    let name = |id: u64| {
        sessions
            .iter()
            .find(|i| i.id == id)
            .map(|i| {
                if i.name.is_empty() {
                    format!("session {id}")
                } else {
                    format!("session {id} ({})", i.name)
                }
            })
            .unwrap_or_else(|| format!("session {id}"))
    };
    let mut out = format!(
        "salusd {} on {}: policy {}, {}, up {}\n",
        s.version,
        device.name,
        s.policy,
        if s.draining { "draining" } else { "admitting" },
        duration_ms(s.uptime_ms)
    );
    out += &format!(
        "memory {} (reserve {}): persistent {}, lanes {}, available {}\n",
        bytes(memory.capacity),
        bytes(memory.reserve),
        bytes(memory.persistent_bytes),
        bytes(memory.lane_bytes),
        bytes(memory.available_bytes)
    );
    out += &format!("  [{}]\n", memory_bar(&memory, 64));
    out += &format!("  {:>12}  {:>12}  what\n", "offset", "size");
    for r in &memory.regions {
        let what = match pb::RegionKind::try_from(r.kind) {
            Ok(pb::RegionKind::Persistent) => format!("persistent  {}", name(r.session)),
            Ok(pb::RegionKind::Lane) => {
                let lane = s.lanes.iter().find(|l| l.id == r.lane);
                let members: Vec<String> = r
                    .sessions
                    .iter()
                    .map(|&id| {
                        let running = lane.and_then(|l| l.running) == Some(id);
                        format!("{}{}", name(id), if running { " [running]" } else { "" })
                    })
                    .collect();
                format!("lane {}      {}", r.lane, members.join(", "))
            }
            Ok(pb::RegionKind::Hole) => "hole".into(),
            _ => "free".into(),
        };
        out += &format!("  {:>12}  {:>12}  {what}\n", bytes(r.offset), bytes(r.size));
    }
    out += &protection_text(s);
    out += &limits_text(s);
    if s.queue.is_empty() {
        out += "queue: empty\n";
    } else {
        out += "queue:\n";
        for q in &s.queue {
            out += &format!("  {}: {}\n", name(q.session), q.reason);
        }
    }
    out
}

fn sessions_json(sessions: &[pb::SessionInfo]) -> Value {
    Value::Array(
        sessions
            .iter()
            .map(|i| {
                json!({
                    "id": i.id, "name": i.name, "owner_uid": i.owner_uid,
                    "kind": kind_name(i.kind), "state": state_name(i.state), "reason": i.reason,
                    "lane": i.lane, "persistent_bytes": i.persistent_bytes,
                    "ephemeral_bytes": i.ephemeral_bytes, "priority": i.priority,
                    "total_iterations": i.total_iterations, "iterations": i.iterations,
                    "pending": i.pending, "mean_iteration_ms": i.mean_iteration_ms,
                    "p99_iteration_ms": i.p99_iteration_ms, "queue_wait_ms": i.queue_wait_ms,
                    "attained_service_ms": i.attained_service_ms, "preemptions": i.preemptions,
                    "suspensions": i.suspensions, "age_ms": i.age_ms,
                    "class": class_name(i.class), "slo_ms": i.slo_ms,
                    "serving": i.serving.as_ref().map(serving_json),
                })
            })
            .collect(),
    )
}

fn sessions_text(sessions: &[pb::SessionInfo]) -> String {
    if sessions.is_empty() {
        return "no sessions\n".into();
    }
    // Ids are large (random per daemon start): the column fits the longest.
    let width = sessions
        .iter()
        .map(|i| i.id.to_string().len())
        .max()
        .unwrap_or(0)
        .max(4);
    let mut out = format!(
        "{:>width$}  {:<16} {:>6}  {:<9} {:>4}  {:>10} {:>10}  {:>7} {:>8} {:>8} {:>8} {:>9}\n",
        "ID",
        "NAME",
        "UID",
        "STATE",
        "LANE",
        "P",
        "E",
        "ITERS",
        "MEAN ms",
        "P99 ms",
        "WAIT s",
        "SERVICE s"
    );
    for i in sessions {
        let iters = if i.total_iterations > 0 {
            format!("{}/{}", i.iterations, i.total_iterations)
        } else {
            i.iterations.to_string()
        };
        out += &format!(
            "{:>width$}  {:<16} {:>6}  {:<9} {:>4}  {:>10} {:>10}  {:>7} {:>8.2} {:>8.2} {:>8.2} {:>9.2}\n",
            i.id,
            i.name.chars().take(16).collect::<String>(),
            i.owner_uid,
            state_name(i.state),
            i.lane.map_or_else(|| "-".into(), |l| l.to_string()),
            bytes(i.persistent_bytes),
            bytes(i.ephemeral_bytes),
            iters,
            i.mean_iteration_ms,
            i.p99_iteration_ms,
            i.queue_wait_ms / 1e3,
            i.attained_service_ms / 1e3
        );
        if !i.reason.is_empty() {
            out += &format!("      waiting: {}\n", i.reason);
        }
        if let Some(s) = &i.serving {
            out += &format!("      {}\n", serving_text(s));
        }
    }
    out
}

fn serving_json(s: &pb::ServingInfo) -> Value {
    json!({
        "scheduler": s.scheduler, "pending": s.pending, "finished": s.finished,
        "met_deadline": s.met_deadline, "dropped": s.dropped, "failed": s.failed,
        "batches": s.batches.iter().map(|(b, n)| (b.to_string(), json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "p50_latency_ms": s.p50_latency_ms, "p99_latency_ms": s.p99_latency_ms,
        "scheduling_us_per_request": s.scheduling_us_per_request,
    })
}

/// One line for a served model: its scheduler, requests, batch sizes used, latency.
fn serving_text(s: &pb::ServingInfo) -> String {
    let answered = s.finished + s.dropped + s.failed;
    let rate = if answered == 0 {
        "-".to_string()
    } else {
        format!("{:.1}%", 100.0 * s.met_deadline as f64 / answered as f64)
    };
    let mut sizes: Vec<_> = s.batches.iter().collect();
    sizes.sort();
    let sizes = sizes
        .iter()
        .map(|(b, n)| format!("{b}x{n}"))
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "serving ({}): {} pending, {} finished, {} dropped, {} failed, {rate} on time; \
         batches {}; latency p50 {:.2} ms p99 {:.2} ms; scheduling {:.1} us/request",
        s.scheduler,
        s.pending,
        s.finished,
        s.dropped,
        s.failed,
        if sizes.is_empty() { "-".into() } else { sizes },
        s.p50_latency_ms,
        s.p99_latency_ms,
        s.scheduling_us_per_request
    )
}

fn event_json(e: &pb::Event) -> Value {
    json!({
        "time_us": e.time_us, "kind": event_name(e.kind), "session": e.session,
        "lane": e.lane, "detail": e.detail, "duration_us": e.duration_us,
    })
}

fn event_text(e: &pb::Event) -> String {
    let mut out = format!(
        "{:>12.6}s  {:<19}",
        e.time_us as f64 / 1e6,
        event_name(e.kind)
    );
    if let Some(s) = e.session {
        out += &format!(" session {s}");
    }
    if let Some(l) = e.lane {
        out += &format!(" lane {l}");
    }
    if e.duration_us > 0 {
        out += &format!(" {:.3} ms", e.duration_us as f64 / 1e3);
    }
    if !e.detail.is_empty() {
        out += &format!(" {}", e.detail);
    }
    out
}

async fn run(args: Args) -> Result<(), salus_client::Error> {
    let address = args.socket.unwrap_or_else(salus_client::address_from_env);
    let client = Client::connect(&address).await?;
    match args.command {
        Command::Status => {
            let status = client.status().await?;
            if args.json {
                println!("{}", status_json(&status));
            } else {
                let sessions = client.list_sessions().await?;
                print!("{}", status_text(&status, &sessions));
            }
        }
        Command::Sessions => {
            let sessions = client.list_sessions().await?;
            if args.json {
                println!("{}", sessions_json(&sessions));
            } else {
                print!("{}", sessions_text(&sessions));
            }
        }
        Command::Policy { name } => {
            let policy = client.policy(name.as_deref()).await?;
            if args.json {
                println!("{}", json!({"policy": policy}));
            } else {
                println!("policy {policy}");
            }
        }
        Command::Drain { resume } => {
            let draining = client.drain(!resume).await?;
            if args.json {
                println!("{}", json!({"draining": draining}));
            } else if draining {
                println!("draining: running sessions go on, new sessions wait");
            } else {
                println!("admitting");
            }
        }
        Command::Offline { switch } => {
            // clap accepts only on and off.
            let enable = switch.as_deref().map(|s| s == "on");
            let health = client.offline(enable).await?;
            if args.json {
                println!("{}", json!({"health": health}));
            } else if health == "disabled" {
                println!("offline sessions disabled: they wait in host memory");
            } else {
                println!("offline sessions enabled; protection {health}");
            }
        }
        Command::Watch => {
            let mut events = client.watch().await?;
            while let Some(event) = events.next().await {
                let event = event?;
                if args.json {
                    println!("{}", event_json(&event));
                } else {
                    println!("{}", event_text(&event));
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("salusctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("salusctl: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_served_model_reads_on_one_line() {
        let s = pb::ServingInfo {
            scheduler: "orloj".into(),
            pending: 2,
            finished: 9,
            met_deadline: 8,
            dropped: 1,
            batches: [(1, 3), (4, 2)].into_iter().collect(),
            p50_latency_ms: 1.5,
            p99_latency_ms: 4.25,
            scheduling_us_per_request: 2.0,
            ..Default::default()
        };
        assert_eq!(
            serving_text(&s),
            "serving (orloj): 2 pending, 9 finished, 1 dropped, 0 failed, 80.0% on time; \
             batches 1x3 4x2; latency p50 1.50 ms p99 4.25 ms; scheduling 2.0 us/request"
        );
    }

    #[test]
    fn protection_reads_on_one_line_with_the_device_load_when_measured() {
        let mut s = pb::StatusResponse {
            protection: Some(pb::Protection {
                enabled: true,
                health: "unhealthy".into(),
                offline_duty: 0.5,
                offline_compute_share: 0.4375,
                offline_compute_share_learned: true,
                offline_bytes: 1 << 20,
                offline_limit: 4 << 20,
                online_slowdown_p99: 1.25,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            protection_text(&s),
            "protection unhealthy: offline duty 0.50, offline share beside online work 0.438 \
             (learned), offline sessions hold 1.00 MiB of 4.00 MiB, 0 evicted, 0 iterations \
             abandoned; online slowdown p99 1.25\n"
        );
        if let Some(p) = s.protection.as_mut() {
            p.sm_activity = 0.93;
            p.clock_factor = 1.2;
        }
        assert!(
            protection_text(&s).ends_with("; SM activity 0.93, clock factor 1.20\n"),
            "{}",
            protection_text(&s)
        );
    }

    #[test]
    fn sizes_read_at_a_glance() {
        assert_eq!(bytes(256), "256 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(4 << 30), "4.00 GiB");
        assert_eq!(bytes(300 << 20), "300 MiB");
    }

    #[test]
    fn the_bar_shows_persistent_free_and_lanes() {
        let memory = pb::MemoryMap {
            capacity: 1000,
            regions: vec![
                pb::Region {
                    offset: 0,
                    size: 250,
                    kind: pb::RegionKind::Persistent as i32,
                    session: 1,
                    ..Default::default()
                },
                pb::Region {
                    offset: 250,
                    size: 500,
                    kind: pb::RegionKind::Free as i32,
                    ..Default::default()
                },
                pb::Region {
                    offset: 750,
                    size: 250,
                    kind: pb::RegionKind::Lane as i32,
                    lane: 3,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(memory_bar(&memory, 8), "PP....33");
    }
}
