//! Online sessions protected from offline ones: the memory share, lanes by class, online
//! first, the controller's hold and the health state machine.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Driver, MB, admitted, spec, started, suspended};
use std::time::Duration;

use salus_core::protection::HealthState;
use salus_core::{
    Action, DeviceSample, Event, MemoryConfig, PolicyKind, ProtectionConfig, Scheduler,
    SessionClass, SessionId, SessionSpec, WaitReason,
};

fn offline(id: u64, p: u64, e: u64) -> SessionSpec {
    SessionSpec {
        class: SessionClass::Offline,
        ..spec(id, p, e)
    }
}

fn driver(policy: PolicyKind, config: ProtectionConfig) -> Driver {
    let mut d = Driver::new(1000 * MB, 0, policy);
    d.core = Scheduler::with_protection(MemoryConfig::new(1000 * MB, 0), policy, config).unwrap();
    d
}

fn queued(actions: &[Action], id: u64) -> Option<WaitReason> {
    actions.iter().rev().find_map(|a| match a {
        Action::Queue { session, reason } if session.0 == id => Some(reason.clone()),
        _ => None,
    })
}

/// Runs `id`'s iteration for `ms` and returns the actions.
fn run(d: &mut Driver, id: u64, ms: u64) -> Vec<Action> {
    d.finish(id, ms)
}

/// Runs online session `id` alone until protection has its clean reference (the
/// session's clean time and a percentile of clean ratios): `min_samples + 1` iterations
/// of `ms`.
fn warm_up(d: &mut Driver, id: u64, ms: u64, min_samples: usize) {
    for _ in 0..=min_samples {
        d.submit(id);
        run(d, id, ms);
    }
}

#[test]
fn offline_sessions_keep_to_their_share() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    // 40% of 1000 MB = 400 MB.
    let a = d.open(offline(1, 100 * MB, 200 * MB));
    assert_eq!(admitted(&a).len(), 1);
    // A lane of its own would take 150 MB past 300; joining session 1's lane, 150 MB.
    let a = d.open(offline(2, 150 * MB, 100 * MB));
    match queued(&a, 2) {
        Some(WaitReason::OfflineShare { held, limit, .. }) => {
            assert_eq!(held, 300 * MB);
            assert_eq!(limit, 400 * MB);
        }
        other => panic!("expected the offline share, got {other:?}"),
    }
    // An online session of the same size is admitted: the share binds offline ones only.
    let a = d.open(spec(3, 50 * MB, 100 * MB));
    assert_eq!(admitted(&a).len(), 1);
    // An offline session bigger than the share alone is rejected at once, saying so.
    let a = d.open(offline(4, 300 * MB, 200 * MB));
    let Some(Action::Reject { reason, .. }) = a.first() else {
        panic!("expected a rejection, got {a:?}");
    };
    assert_eq!(reason.offline_limit, Some(400 * MB));
    assert!(
        reason
            .to_string()
            .contains("offline sessions may hold at most")
    );
    // It fits beside session 1 once the lane is shared: joining costs no lane bytes.
    let a = d.open(offline(5, 50 * MB, 150 * MB));
    assert_eq!(admitted(&a).len(), 1);
    assert_eq!(d.core.protection_status().offline_bytes, 350 * MB);
}

#[test]
fn lanes_never_mix_classes() {
    let mut d = driver(PolicyKind::Fair, ProtectionConfig::default());
    let a = d.open(spec(1, 10 * MB, 100 * MB));
    let b = d.open(offline(2, 10 * MB, 100 * MB));
    let c = d.open(spec(3, 10 * MB, 50 * MB));
    // FAIR keeps one lane; under protection, one per class.
    let (la, lb, lc) = (admitted(&a)[0].1, admitted(&b)[0].1, admitted(&c)[0].1);
    assert_ne!(la, lb);
    assert_eq!(la, lc);
    // Without protection the offline session shares the lane.
    let mut d = driver(PolicyKind::Fair, ProtectionConfig::disabled());
    let a = d.open(spec(1, 10 * MB, 100 * MB));
    let b = d.open(offline(2, 10 * MB, 100 * MB));
    assert_eq!(admitted(&a)[0].1, admitted(&b)[0].1);
}

#[test]
fn an_online_session_takes_memory_offline_sessions_hold() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(offline(1, 150 * MB, 200 * MB)); // 350 MB
    d.open(spec(2, 200 * MB, 300 * MB)); // 500 MB; 850 in all
    d.submit(1);
    assert_eq!(started(&d.log), vec![1]);
    // Needs 100 MB and a lane of 400 (200 more by growing session 2's): only 150 are free.
    // Session 1 runs, so it is stopped at its boundary.
    let a = d.open(spec(3, 100 * MB, 400 * MB));
    assert!(
        matches!(queued(&a, 3), Some(WaitReason::Memory { .. })),
        "{a:?}"
    );
    d.submit(1);
    let a = run(&mut d, 1, 50);
    assert_eq!(suspended(&a), vec![1], "{a:?}");
    assert_eq!(admitted(&a), vec![(3, admitted(&a)[0].1)]);
    // Session 1 waits behind the online one... and comes back when there is room.
    let a = d.open(offline(4, 10 * MB, 10 * MB));
    assert!(admitted(&a).is_empty() || admitted(&a)[0].0 == 4);
    let a = d.close(3);
    let back = a.iter().find_map(|x| match x {
        Action::Admit {
            session, resumed, ..
        } if session.0 == 1 => Some(*resumed),
        _ => None,
    });
    assert_eq!(back, Some(true), "{a:?}");
    assert_eq!(d.core.protection_status().offline_evictions, 1);
}

#[test]
fn offline_sessions_wait_while_an_online_one_waits() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(spec(1, 300 * MB, 400 * MB));
    d.open(offline(2, 100 * MB, 100 * MB));
    d.submit(1);
    // The online session does not fit (needs 400, 100 free beside offline 200)...
    // ...offline 2 is idle, so it is suspended for it.
    let a = d.open(spec(3, 200 * MB, 200 * MB));
    assert_eq!(suspended(&a), vec![2]);
    assert_eq!(admitted(&a)[0].0, 3);
    // Now an online session that cannot fit at all for now, and an offline one that would.
    let a = d.open(spec(4, 200 * MB, 200 * MB));
    assert!(matches!(queued(&a, 4), Some(WaitReason::Memory { .. })));
    let a = d.open(offline(5, MB, MB));
    assert_eq!(
        queued(&a, 5),
        Some(WaitReason::OnlineFirst {
            first: SessionId(4)
        })
    );
}

#[test]
fn an_online_session_that_stops_waiting_no_longer_holds_offline_work() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(offline(1, 150 * MB, 200 * MB)); // 350 MB
    d.submit(1);
    assert_eq!(started(&d.log), vec![1]);
    // 900 MB do not fit beside the running offline session: it is to stop at its boundary.
    let a = d.open(spec(2, 500 * MB, 400 * MB));
    assert!(
        matches!(queued(&a, 2), Some(WaitReason::Memory { .. })),
        "{a:?}"
    );
    // The online session gives up before then: nothing waits for the offline memory, so
    // the offline session goes on rather than stopping at its boundary.
    d.close(2);
    d.submit(1);
    let a = run(&mut d, 1, 50);
    assert!(suspended(&a).is_empty(), "{a:?}");
    assert_eq!(started(&a), vec![1], "{a:?}");
}

#[test]
fn the_controller_holds_offline_iterations_while_online_ones_suffer() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(spec(1, 10 * MB, 10 * MB));
    d.open(offline(2, 10 * MB, 10 * MB));
    // A clean online iteration gives the reference: 10 ms.
    d.submit(1);
    run(&mut d, 1, 10);
    // Offline work beside it slows it 1.6x, again and again: the duty goes down.
    for _ in 0..6 {
        d.submit(2);
        d.submit(1);
        run(&mut d, 1, 16);
        if d.core
            .session(SessionId(2))
            .unwrap()
            .stats
            .pending_iterations
            == 0
        {
            run(&mut d, 2, 100);
        }
    }
    let status = d.core.protection_status();
    assert!(status.offline_duty < 0.5, "{status:?}");
    // An offline iteration just finished: the next waits (1 - duty) / duty of its length.
    d.log.clear();
    d.submit(2);
    if started(&d.log).contains(&2) {
        run(&mut d, 2, 100);
        d.submit(2);
    }
    let wake = d.core.next_wakeup().expect("offline work is held");
    assert!(wake > d.now);
    assert!(!started(&d.log).contains(&2));
    d.now = wake;
    let a = d.feed(Event::Tick);
    assert_eq!(started(&a), vec![2]);
}

#[test]
fn overlimit_evicts_offline_work_until_calm_and_backs_off() {
    // Every sample counts (by default a percentile needs 20).
    let config = ProtectionConfig {
        min_samples: 1,
        ..ProtectionConfig::default()
    };
    let mut d = driver(PolicyKind::Pack, config.clone());
    d.open(spec(1, 10 * MB, 10 * MB));
    d.open(offline(2, 10 * MB, 10 * MB));
    warm_up(&mut d, 1, 10, 1);
    assert_eq!(d.core.protection_status().health, HealthState::Healthy);
    // The online session's iteration takes 3x its clean time: overlimit.
    d.submit(2);
    d.submit(1);
    let a = run(&mut d, 1, 30);
    assert_eq!(d.core.protection_status().health, HealthState::Overlimit);
    assert!(suspended(&a).is_empty(), "session 2 still runs");
    let a = run(&mut d, 2, 50);
    assert_eq!(suspended(&a), vec![2], "evicted at its boundary");
    assert!(matches!(
        d.core.waiting()[0].1,
        Some(WaitReason::OfflineHealth {
            health: HealthState::Overlimit
        })
    ));
    // Once the slow sample has left the window and the hold has passed, it comes back.
    let mut back = false;
    for _ in 0..10 {
        let Some(wake) = d.core.next_wakeup() else {
            break;
        };
        d.now = wake;
        if !admitted(&d.feed(Event::Tick)).is_empty() {
            back = true;
            break;
        }
    }
    assert!(back, "{:?}", d.core.protection_status());
    assert_eq!(d.core.protection_status().health, HealthState::Healthy);
    assert_eq!(d.core.protection_status().overlimit_entries, 1);
}

#[test]
fn device_samples_and_the_operator_switch() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(offline(1, 10 * MB, 10 * MB));
    let slow_clock = DeviceSample {
        sm_activity: Some(0.5),
        sm_clock: Some((750.0, 1500.0)),
    };
    // With no online work, the device's load harms no one: offline work goes on.
    d.feed(Event::DeviceSampled(slow_clock));
    assert_eq!(d.core.protection_status().health, HealthState::Healthy);
    assert_eq!(d.core.protection_status().metrics.clock_factor, None);
    assert!(d.core.waiting().is_empty());
    // With an online session at work, a clock at half the highest: Equation 2 gives
    // 1 + 4 * (1350 - 750) / 1350 = 2.78.
    d.open(spec(2, 10 * MB, 10 * MB));
    d.submit(2);
    run(&mut d, 2, 5);
    d.feed(Event::DeviceSampled(slow_clock));
    let status = d.core.protection_status();
    assert_eq!(status.health, HealthState::Overlimit);
    let expected = 1.0 + 4.0 * (1350.0 - 750.0) / 1350.0;
    assert!((status.metrics.clock_factor.unwrap() - expected).abs() < 1e-12);
    assert_eq!(d.core.waiting().len(), 1, "evicted");
    // The operator disables offline work; enabling it again goes through unhealthy.
    let a = d.feed(Event::OfflineEnabled(false));
    assert!(admitted(&a).is_empty());
    assert_eq!(d.core.protection_status().health, HealthState::Disabled);
    d.feed(Event::DeviceSampled(DeviceSample::default()));
    assert_eq!(d.core.protection_status().health, HealthState::Disabled);
    let a = d.feed(Event::OfflineEnabled(true));
    assert_eq!(d.core.protection_status().health, HealthState::Healthy);
    assert_eq!(admitted(&a).len(), 1);
}

#[test]
fn once_offline_work_stops_online_iterations_are_clean_again() {
    let config = ProtectionConfig {
        min_samples: 1,
        ..ProtectionConfig::default()
    };
    let mut d = driver(PolicyKind::Share, config);
    d.open(spec(1, 10 * MB, 10 * MB));
    d.open(offline(2, 10 * MB, 10 * MB));
    warm_up(&mut d, 1, 10, 1);
    d.submit(2);
    d.submit(1);
    run(&mut d, 1, 30); // 3x beside offline work: overlimit
    run(&mut d, 2, 50); // evicted at its boundary
    assert_eq!(d.core.protection_status().health, HealthState::Overlimit);
    let before = d.core.protection_status().metrics.online_slowdown;
    for _ in 0..20 {
        d.submit(1);
        run(&mut d, 1, 25);
    }
    // No offline iteration ran beside these: no new slowdown samples, so the metric can
    // only fall (clean iterations now give the percentile it is divided by).
    let after = d.core.protection_status().metrics.online_slowdown;
    assert!(after.unwrap() <= before.unwrap(), "{after:?} {before:?}");
}

#[test]
fn one_slow_iteration_is_not_a_percentile() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(spec(1, 10 * MB, 10 * MB));
    d.open(offline(2, 10 * MB, 10 * MB));
    d.submit(1);
    run(&mut d, 1, 10);
    d.submit(2);
    d.submit(1);
    run(&mut d, 1, 40);
    let status = d.core.protection_status();
    assert_eq!(status.health, HealthState::Healthy, "{status:?}");
    assert_eq!(status.metrics.online_slowdown, None);
    assert!(status.offline_duty < 0.5, "the controller reacts at once");
}

fn start_share(a: &[Action]) -> Option<f64> {
    a.iter().find_map(|x| match x {
        Action::StartIteration { compute_share, .. } => Some(*compute_share),
        _ => None,
    })
}

fn set_shares(a: &[Action]) -> Vec<(u64, f64)> {
    a.iter()
        .filter_map(|x| match x {
            Action::SetComputeShare {
                session,
                compute_share,
            } => Some((session.0, *compute_share)),
            _ => None,
        })
        .collect()
}

/// Submits an iteration of `id`, waking the core when the controller holds it.
fn submit_through_hold(d: &mut Driver, id: u64) -> Vec<Action> {
    let a = d.submit(id);
    if start_share(&a).is_some() {
        return a;
    }
    d.now = d.core.next_wakeup().unwrap();
    d.feed(Event::Tick)
}

/// Protection with the offline compute share fixed at the default's start.
fn fixed_share() -> ProtectionConfig {
    ProtectionConfig {
        dynamic_compute_share: false,
        ..ProtectionConfig::default()
    }
}

#[test]
fn the_offline_compute_share_follows_online_iterations() {
    let mut d = driver(PolicyKind::Pack, fixed_share());
    d.open(offline(2, 10 * MB, 10 * MB));
    // Alone, it has the whole device.
    assert_eq!(start_share(&d.submit(2)), Some(1.0));
    run(&mut d, 2, 10);
    d.open(spec(1, 10 * MB, 10 * MB));
    warm_up(&mut d, 1, 10, ProtectionConfig::default().min_samples);
    // With an online session active but no online iteration running: the whole device.
    let a = submit_through_hold(&mut d, 2);
    assert_eq!(start_share(&a), Some(1.0), "{a:?}");
    // An online iteration starts beside it: it gets the rest of the offline share, and
    // the running offline iteration is told to shrink from its next kernel on.
    let a = d.submit(1);
    assert_eq!(start_share(&a), Some(0.7), "{a:?}");
    assert_eq!(set_shares(&a), vec![(2, 0.3)]);
    // The last online iteration ends: the whole device again.
    let a = run(&mut d, 1, 10);
    assert_eq!(set_shares(&a), vec![(2, 1.0)]);
    // Nothing to tell when online work starts with no offline iteration running.
    run(&mut d, 2, 10);
    let a = d.submit(1);
    assert_eq!((start_share(&a), set_shares(&a)), (Some(1.0), vec![]));
    // An offline iteration that starts while an online one runs gets the offline share.
    let a = submit_through_hold(&mut d, 2);
    assert_eq!(start_share(&a), Some(0.3), "{a:?}");
    let a = run(&mut d, 1, 10);
    assert_eq!(set_shares(&a), vec![(2, 1.0)]);
    // An online session closing mid-iteration ends its online work too.
    assert_eq!(set_shares(&d.submit(1)), vec![(2, 0.3)]);
    assert_eq!(set_shares(&d.close(1)), vec![(2, 1.0)]);
}

#[test]
fn an_offline_share_of_zero_holds_offline_work_while_online_work_runs() {
    let config = ProtectionConfig {
        offline_compute_share: 0.0,
        ..fixed_share()
    };
    config.validate().unwrap();
    let mut d = driver(PolicyKind::Pack, config);
    d.open(offline(2, 10 * MB, 10 * MB));
    d.open(spec(1, 10 * MB, 10 * MB));
    d.submit(1);
    run(&mut d, 1, 10);
    assert_eq!(start_share(&submit_through_hold(&mut d, 2)), Some(1.0));
    let a = d.submit(1);
    assert_eq!(start_share(&a), Some(1.0), "{a:?}");
    assert_eq!(set_shares(&a), vec![(2, 0.0)]);
    assert_eq!(set_shares(&run(&mut d, 1, 10)), vec![(2, 1.0)]);
    // Without protection nothing is throttled.
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::disabled());
    d.open(offline(2, 10 * MB, 10 * MB));
    d.open(spec(1, 10 * MB, 10 * MB));
    assert_eq!(start_share(&d.submit(2)), Some(1.0));
    let a = d.submit(1);
    assert_eq!((start_share(&a), set_shares(&a)), (Some(1.0), vec![]));
}

#[test]
fn the_offline_share_is_learned_from_online_iterations_beside_offline_ones() {
    // An online session that needs half the device: beside an offline share `s` it gets
    // `1 - s` and takes `max(1, 0.5 / (1 - s))` times its 100 ms, give or take 2 ms.
    let config = ProtectionConfig::default();
    assert!(config.dynamic_compute_share);
    let mut d = driver(PolicyKind::Pack, config.clone());
    d.open(offline(2, 10 * MB, 10 * MB));
    d.open(spec(1, 10 * MB, 10 * MB));
    warm_up(&mut d, 1, 100, config.min_samples);
    // One offline iteration runs beside all of them.
    assert!(start_share(&submit_through_hold(&mut d, 2)).is_some());
    let mut shares = Vec::new();
    for i in 0..3000u64 {
        let a = d.submit(1);
        let online = start_share(&a).unwrap();
        let offline = 1.0 - online;
        // The running offline iteration is told the share the online one leaves.
        assert_eq!(set_shares(&a), vec![(2, offline)]);
        shares.push(offline);
        let ms = 100.0 * (0.5 / online).max(1.0) + if i % 2 == 0 { 2.0 } else { -2.0 };
        run(&mut d, 1, ms.round() as u64);
    }
    // It climbs from 0.3125 to the half the online session leaves, and rarely past it.
    assert!((shares[0] - 0.3125).abs() < 1e-9, "{}", shares[0]);
    let late = &shares[1000..];
    let at_half = late.iter().filter(|&&s| (s - 0.5).abs() < 1e-9).count();
    let above = late.iter().filter(|&&s| s > 0.5 + 1e-9).count();
    assert!(
        at_half * 10 > late.len() * 9,
        "{at_half} of {} at 0.5",
        late.len()
    );
    assert!(
        above * 20 < late.len(),
        "{above} of {} above 0.5",
        late.len()
    );
    let status = d.core.protection_status();
    assert!(status.offline_compute_share_learned);
    assert!(status.offline_compute_share <= 0.5 + 1e-9);
}

/// Online session 1 with its clean reference (10 ms iterations), and offline session 2's
/// iteration running, under a fixed share.
fn offline_iteration_running() -> (Driver, ProtectionConfig) {
    let config = fixed_share();
    let mut d = driver(PolicyKind::Pack, config.clone());
    d.open(offline(2, 10 * MB, 10 * MB));
    d.open(spec(1, 10 * MB, 10 * MB));
    warm_up(&mut d, 1, 10, config.min_samples);
    assert_eq!(started(&submit_through_hold(&mut d, 2)), vec![2]);
    (d, config)
}

#[test]
fn a_hold_follows_the_duty_as_it_recovers() {
    let (mut d, config) = offline_iteration_running();
    // Online iterations beside it take 2.5 times as long (unhealthy, not overlimit): the
    // duty falls.
    for _ in 0..config.min_samples {
        d.submit(1);
        run(&mut d, 1, 25);
    }
    assert_eq!(d.core.health(), HealthState::Unhealthy);
    assert!(d.core.protection_status().offline_duty < 0.2);
    // A long offline iteration ends: at this duty the next waits for seconds.
    run(&mut d, 2, 1000);
    assert!(started(&d.submit(2)).is_empty());
    let first = d.core.protection_status().offline_held_until.unwrap();
    assert!(
        first > d.now + Duration::from_secs(2),
        "{first:?} {:?}",
        d.now
    );
    // Online iterations alone again: the duty recovers and the hold shrinks with it, so
    // the offline iteration starts long before the hold first set would have ended.
    let mut start = None;
    for _ in 0..400 {
        let mut a = d.submit(1);
        a.extend(run(&mut d, 1, 10));
        if started(&a).contains(&2) {
            start = Some(d.now);
            break;
        }
    }
    let start = start.expect("the held offline iteration started");
    assert!(
        start + Duration::from_secs(1) < first,
        "{start:?} against {first:?}"
    );
    assert!(d.core.protection_status().offline_duty > 0.5);
}

#[test]
fn a_hiccup_of_the_host_does_not_take_the_duty_to_its_floor() {
    // A 10 ms request beside offline work, as fast as alone, until one takes 100 ms (the
    // host paused it). One iteration says at most the unhealthy slowdown to the
    // controller: the duty dips and comes back, where 10x would have driven it to 0.02
    // through the integral of the load's moving average.
    let (mut d, _) = offline_iteration_running();
    for _ in 0..40 {
        d.submit(1);
        run(&mut d, 1, 10);
    }
    let before = d.core.protection_status().offline_duty;
    assert!(before > 0.9, "{before}");
    d.submit(1);
    run(&mut d, 1, 100);
    let mut lowest = f64::INFINITY;
    for _ in 0..10 {
        d.submit(1);
        run(&mut d, 1, 10);
        lowest = lowest.min(d.core.protection_status().offline_duty);
    }
    assert!(lowest > 0.6, "the duty fell to {lowest}");
    // Every iteration at twice the clean time is harm, not a hiccup: the duty falls.
    for _ in 0..20 {
        d.submit(1);
        run(&mut d, 1, 20);
    }
    assert!(d.core.protection_status().offline_duty < 0.2);
}

#[test]
fn a_learned_share_needs_a_share_to_start_from() {
    let config = ProtectionConfig {
        offline_compute_share: 0.0,
        ..ProtectionConfig::default()
    };
    let err = config.validate().unwrap_err();
    assert!(err.contains("dynamic_compute_share"), "{err}");
}

fn start_background(a: &[Action]) -> Option<bool> {
    a.iter().find_map(|x| match x {
        Action::StartIteration { background, .. } => Some(*background),
        _ => None,
    })
}

#[test]
fn offline_iterations_run_in_the_background_and_online_ones_keep_a_prioritizing_device() {
    let config = ProtectionConfig {
        background_priority: true,
        ..fixed_share()
    };
    let mut d = driver(PolicyKind::Pack, config);
    d.open(offline(2, 10 * MB, 10 * MB));
    d.open(spec(1, 10 * MB, 10 * MB));
    assert_eq!(start_background(&d.submit(1)), Some(false));
    run(&mut d, 1, 10);
    let a = submit_through_hold(&mut d, 2);
    assert_eq!(
        (start_share(&a), start_background(&a)),
        (Some(1.0), Some(true))
    );
    // An online iteration beside it keeps the whole device; the offline one still gets
    // the offline share while it runs.
    let a = d.submit(1);
    assert_eq!(
        (start_share(&a), start_background(&a)),
        (Some(1.0), Some(false))
    );
    assert_eq!(set_shares(&a), vec![(2, 0.3)]);
    // Without protection no iteration runs in the background.
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::disabled());
    d.open(offline(2, 10 * MB, 10 * MB));
    assert_eq!(start_background(&d.submit(2)), Some(false));
}

#[test]
fn an_offline_iteration_is_abandoned_for_an_online_session_past_the_deadline() {
    let mut d = driver(PolicyKind::Pack, ProtectionConfig::default());
    d.open(offline(1, 150 * MB, 200 * MB));
    d.open(spec(2, 200 * MB, 300 * MB));
    d.submit(1);
    assert_eq!(started(&d.log), vec![1]);
    // Session 1's iteration is long; the online session needs its memory now.
    let a = d.open(spec(3, 100 * MB, 400 * MB));
    assert!(matches!(queued(&a, 3), Some(WaitReason::Memory { .. })));
    let wake = d.core.next_wakeup().expect("the deadline");
    assert_eq!(wake, d.now + Duration::from_millis(200));
    d.now = wake;
    let a = d.feed(Event::Tick);
    assert_eq!(
        a,
        vec![Action::Abandon {
            session: SessionId(1)
        }]
    );
    // Asked once only.
    assert!(d.feed(Event::Tick).is_empty());
    let a = d.feed(Event::IterationAbandoned(SessionId(1)));
    assert_eq!(suspended(&a), vec![1]);
    assert_eq!(admitted(&a)[0].0, 3);
    let status = d.core.protection_status();
    assert_eq!(status.offline_abandoned, 1);
    let view = d.core.session(SessionId(1)).unwrap();
    assert_eq!(view.stats.pending_iterations, 1, "it runs again");
    assert_eq!(view.stats.completed_iterations, 0);
    let a = d.close(3);
    assert_eq!(admitted(&a)[0].0, 1);
    assert_eq!(started(&a), vec![1]);
}

#[test]
fn a_service_missing_its_slo_alone_does_not_hold_offline_work_out() {
    let config = ProtectionConfig {
        min_samples: 1,
        ..ProtectionConfig::default()
    };
    let mut d = driver(PolicyKind::Share, config);
    let mut online = spec(1, 10 * MB, 10 * MB);
    online.hints.slo = Some(Duration::from_millis(5));
    d.open(online);
    // Alone, every iteration takes twice its SLO (the service's own load).
    for _ in 0..5 {
        d.submit(1);
        run(&mut d, 1, 10);
    }
    let status = d.core.protection_status();
    assert_eq!(status.health, HealthState::Healthy, "{status:?}");
    assert_eq!(
        status.metrics.slo_use, None,
        "no iteration ran beside offline work"
    );
    // So an offline session is admitted, and runs.
    let a = d.open(offline(2, 10 * MB, 10 * MB));
    assert_eq!(admitted(&a).len(), 1);
    assert_eq!(started(&d.submit(2)), vec![2]);
    // Beside it, the same latency is evidence: past the overlimit threshold (1.5 x SLO).
    d.submit(1);
    run(&mut d, 1, 10);
    let status = d.core.protection_status();
    assert_eq!(status.metrics.slo_use, Some(2.0));
    assert_eq!(status.health, HealthState::Overlimit, "{status:?}");
}

#[test]
fn offline_work_waits_for_a_clean_reference_before_slowdown_is_judged() {
    let config = ProtectionConfig {
        min_samples: 3,
        ..ProtectionConfig::default()
    };
    let mut d = driver(PolicyKind::Pack, config);
    d.open(spec(1, 10 * MB, 10 * MB));
    d.open(offline(2, 10 * MB, 10 * MB));
    // While online iterations probe (no clean reference, then fewer than three clean
    // ratios), an offline iteration submitted meanwhile waits for them to end.
    for i in 0..=3 {
        d.submit(1);
        assert!(started(&d.submit(2)).is_empty(), "probing iteration {i}");
        let a = run(&mut d, 1, 10);
        assert_eq!(started(&a), vec![2], "after probing iteration {i}");
        run(&mut d, 2, 10);
        // Past the controller's hold, the next online iteration runs alone again.
        d.now += Duration::from_millis(100);
        d.feed(Event::Tick);
    }
    // Now the reference is there: online iterations no longer hold offline ones back.
    d.submit(1);
    assert_eq!(started(&d.submit(2)), vec![2]);
    // And a slowdown beside offline work is judged against the clean percentile.
    run(&mut d, 1, 40);
    let status = d.core.protection_status();
    assert_eq!(
        status.metrics.online_slowdown, None,
        "one sample is no percentile"
    );
    for _ in 0..2 {
        d.submit(1);
        run(&mut d, 1, 40);
    }
    let status = d.core.protection_status();
    assert_eq!(status.metrics.online_slowdown, Some(4.0));
    assert_eq!(status.health, HealthState::Overlimit);
}
