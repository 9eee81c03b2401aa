//! The `core` suite: how many events per second `salus-core` decides with many open
//! sessions, and how long one lane-finding call takes.
//!
//! The workload is a steady state like a busy daemon's: every session is a training loop
//! that submits its next iteration when the last one finishes; one iteration in a hundred
//! is followed by a session closing and a new one opening, so admission, lane removal and
//! auto-defragmentation are part of the mix. Every `handle` call counts as one event; the
//! time includes the `poll` that turns events into actions.

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use salus_core::{
    Action, Event, Hints, MemoryConfig, PolicyKind, Scheduler, SessionId, SessionKind, SessionSpec,
};
use serde::Serialize;

const MIB: u64 = 1 << 20;

#[derive(Debug, Serialize)]
struct PolicyResult {
    events: u64,
    sessions_replaced: u64,
    seconds: f64,
    events_per_s: f64,
    lanes: usize,
}

#[derive(Debug, Serialize)]
struct CoreResult {
    sessions: u64,
    /// The slowest policy's rate: what the core sustains whatever the policy.
    events_per_s: f64,
    find_lane_ns: f64,
    by_policy: std::collections::BTreeMap<String, PolicyResult>,
}

fn spec(id: u64, seed: u64) -> SessionSpec {
    // Sizes vary so lanes differ and Algorithm 2.1 has real choices to make.
    let e = (64 + (seed * 37) % 448) * MIB;
    SessionSpec {
        id: SessionId(id),
        kind: SessionKind::Training,
        class: salus_core::SessionClass::Online,
        persistent_bytes: (16 + (seed * 13) % 240) * MIB,
        ephemeral_bytes: e,
        hints: Hints {
            name: String::new(),
            priority: 0,
            total_iterations: Some(1_000 + seed % 5_000),
            expected_iteration: Some(Duration::from_millis(5 + seed % 200)),
            slo: None,
        },
    }
}

/// A device big enough that every session of the steady state fits (PACK opens a lane
/// each), so the measurement is of decisions, not of waiting.
fn device(sessions: u64) -> MemoryConfig {
    MemoryConfig::new(sessions * 1024 * MIB, 0)
}

fn steady_state(policy: PolicyKind, sessions: u64, events: u64) -> Result<PolicyResult, String> {
    let err = |e: salus_core::CoreError| e.to_string();
    let mut core = Scheduler::new(device(sessions), policy).map_err(err)?;
    let mut now = Duration::ZERO;
    let mut running: VecDeque<SessionId> = VecDeque::new();
    let mut next_id = 0;
    let collect = |actions: Vec<Action>, running: &mut VecDeque<SessionId>| {
        for action in actions {
            if let Action::StartIteration { session, .. } = action {
                running.push_back(session);
            }
        }
    };
    for _ in 0..sessions {
        core.handle(now, Event::SessionOpened(spec(next_id, next_id)))
            .map_err(err)?;
        core.handle(now, Event::IterationSubmitted(SessionId(next_id)))
            .map_err(err)?;
        next_id += 1;
    }
    collect(core.poll(), &mut running);
    let lanes = core.lanes().len();

    let start = Instant::now();
    let mut fed = 0u64;
    let mut iterations = 0u64;
    let mut churned = 0u64;
    while fed < events {
        let Some(id) = running.pop_front() else {
            return Err(format!("{policy}: nothing running after {fed} events"));
        };
        let duration = Duration::from_micros(1_000 + fed % 7_919);
        now += duration / 8;
        core.handle(
            now,
            Event::IterationFinished {
                session: id,
                duration,
            },
        )
        .map_err(err)?;
        fed += 1;
        iterations += 1;
        if iterations.is_multiple_of(100) {
            core.handle(now, Event::SessionClosed(id)).map_err(err)?;
            core.handle(now, Event::SessionOpened(spec(next_id, fed)))
                .map_err(err)?;
            core.handle(now, Event::IterationSubmitted(SessionId(next_id)))
                .map_err(err)?;
            next_id += 1;
            fed += 3;
            churned += 1;
        } else {
            core.handle(now, Event::IterationSubmitted(id))
                .map_err(err)?;
            fed += 1;
        }
        collect(black_box(core.poll()), &mut running);
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(PolicyResult {
        events: fed,
        sessions_replaced: churned,
        seconds,
        events_per_s: fed as f64 / seconds,
        lanes,
    })
}

/// Mean time of one `plan_admission` (Algorithm 2.1 over every lane) on a device holding
/// `sessions` sessions in as many lanes, with little room left, so all three steps run.
fn find_lane_ns(sessions: u64) -> Result<f64, String> {
    let err = |e: salus_core::CoreError| e.to_string();
    let total: u64 = (0..sessions)
        .map(|i| {
            let s = spec(i, i);
            s.persistent_bytes + s.ephemeral_bytes
        })
        .sum();
    let memory = MemoryConfig::new(total + 64 * MIB, 0);
    let mut core = Scheduler::new(memory, PolicyKind::Pack).map_err(err)?;
    for i in 0..sessions {
        core.handle(Duration::ZERO, Event::SessionOpened(spec(i, i)))
            .map_err(err)?;
    }
    core.poll();
    let rounds = 2_000u64;
    let start = Instant::now();
    let mut found = 0usize;
    for i in 0..rounds {
        // Needs growth of some lane: E above every lane, P small.
        let e = (512 + i % 64) * MIB;
        found += usize::from(black_box(core.plan_admission(MIB, black_box(e))).is_ok());
    }
    let ns = start.elapsed().as_nanos() as f64 / rounds as f64;
    black_box(found);
    Ok(ns)
}

pub fn run(sessions: u64, events: u64, json: bool) -> Result<(), String> {
    let mut by_policy = std::collections::BTreeMap::new();
    for policy in PolicyKind::ALL {
        by_policy.insert(
            policy.name().to_string(),
            steady_state(policy, sessions, events)?,
        );
    }
    let slowest = by_policy
        .values()
        .map(|r| r.events_per_s)
        .fold(f64::INFINITY, f64::min);
    let result = CoreResult {
        sessions,
        events_per_s: slowest,
        find_lane_ns: find_lane_ns(sessions)?,
        by_policy,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&result).map_err(|e| e.to_string())?
        );
    } else {
        println!("salus-core with {sessions} open sessions");
        println!(
            "{:<8} {:>12} {:>10} {:>14} {:>7}",
            "policy", "events", "seconds", "events/s", "lanes"
        );
        for (name, r) in &result.by_policy {
            println!(
                "{:<8} {:>12} {:>10.3} {:>14.0} {:>7}",
                name, r.events, r.seconds, r.events_per_s, r.lanes
            );
        }
        println!(
            "slowest policy: {:.0} events/s (target >= 1,000,000)",
            result.events_per_s
        );
        println!(
            "one lane-finding call over {sessions} lanes: {:.0} ns",
            result.find_lane_ns
        );
    }
    Ok(())
}
