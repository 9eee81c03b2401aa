//! Unit tests of the scheduler's rules, one behaviour each, through the public API.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use salus_core::{
    Action, CoreError, Event, Extent, LaneId, MemoryConfig, PolicyKind, RegionKind, Scheduler,
    SessionId, WaitReason,
};

#[test]
fn pack_opens_a_lane_per_session_stacked_down_from_the_top() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    let a = d.open(spec(1, 100 * MB, 200 * MB));
    let b = d.open(spec(2, 50 * MB, 300 * MB));
    assert_eq!(
        a[0],
        Action::Admit {
            session: SessionId(1),
            lane: LaneId(0),
            persistent: Extent {
                offset: 0,
                size: 100 * MB
            },
            lane_size: 200 * MB,
            resumed: false,
        }
    );
    assert_eq!(
        a[1],
        Action::MoveLane {
            lane: LaneId(0),
            from: None,
            to: Extent {
                offset: 800 * MB,
                size: 200 * MB
            },
        }
    );
    assert_eq!(admitted(&b), vec![(2, LaneId(1))]);
    let lanes = d.core.lanes();
    assert_eq!(
        lanes[1].placed,
        Some(Extent {
            offset: 500 * MB,
            size: 300 * MB
        })
    );
    let map = d.core.memory_map();
    assert_eq!(map.persistent_bytes, 150 * MB);
    assert_eq!(map.lane_bytes, 500 * MB);
    assert_eq!(map.available_bytes, 350 * MB);
    assert_eq!(map.total(), 1000 * MB);
    assert!(matches!(
        map.regions[1].kind,
        RegionKind::Persistent {
            session: SessionId(2)
        }
    ));
    assert_eq!(map.regions[2].kind, RegionKind::Free);
}

#[test]
fn algorithm_2_1_joins_best_fitting_lane_when_no_new_lane_fits() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 10 * MB, 300 * MB));
    d.open(spec(2, 10 * MB, 200 * MB));
    d.open(spec(3, 10 * MB, 400 * MB));
    // 30 + 900 used: a new lane of 60 no longer fits; lanes of 300 and 400 hold 250, best
    // fit is the 300 one.
    let a = d.open(spec(4, 10 * MB, 250 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(0))]);
    assert_eq!(d.core.lanes()[0].sessions, vec![SessionId(1), SessionId(4)]);
    assert_eq!(d.core.memory_map().lane_bytes, 900 * MB);
}

#[test]
fn algorithm_2_1_grows_the_smallest_lane_that_keeps_safety() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 300 * MB));
    d.open(spec(2, 0, 200 * MB));
    d.open(spec(3, 0, 400 * MB));
    // No new lane (needs 450 more), no lane >= 450; growing the 200 lane to 450 needs
    // 900 - 200 + 450 = 1150: too much; growing the 300 lane: 1050, too much; the 400 lane:
    // 950 + 50 persistent = 1000, fits.
    let a = d.open(spec(4, 50 * MB, 450 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(2))]);
    let lanes = d.core.lanes();
    assert_eq!(lanes[2].size, 450 * MB);
    assert_eq!(d.core.memory_map().lane_bytes, 950 * MB);
    // Growing picks the smallest lane first when several would do.
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 300 * MB));
    d.open(spec(2, 0, 200 * MB));
    d.open(spec(3, 0, 400 * MB));
    let a = d.open(spec(4, 0, 250 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(0))], "best fit, not growth");
    let a = d.open(spec(5, 0, 350 * MB));
    assert_eq!(
        admitted(&a),
        vec![(5, LaneId(2))],
        "existing 400 lane fits 350"
    );
}

#[test]
fn growth_takes_smallest_candidate() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 100 * MB));
    d.open(spec(2, 0, 200 * MB));
    d.open(spec(3, 0, 600 * MB));
    // free 100; E = 650: grow 100-lane -> +550 no; 200-lane -> +450 no; 600 -> +50 yes.
    let a = d.open(spec(4, 0, 650 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(2))]);
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 400 * MB));
    d.open(spec(2, 0, 300 * MB));
    d.open(spec(3, 0, 250 * MB));
    // free 50; E = 420: grow 250 -> +170 no, 300 -> +120 no, 400 -> 400 >= 420? no, +20 yes.
    let a = d.open(spec(4, 0, 420 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(0))]);
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 200 * MB));
    d.open(spec(2, 0, 100 * MB));
    d.open(spec(3, 0, 300 * MB));
    // free 400; E = 450: no new lane, no lane >= 450; growing 100 (+350) or 200 (+250)
    // would both fit: the smallest lane grows.
    let a = d.open(spec(4, 0, 450 * MB));
    assert_eq!(admitted(&a), vec![(4, LaneId(1))]);
}

#[test]
fn a_session_that_can_never_fit_is_rejected_with_sizes() {
    let mut d = Driver::new(1000 * MB, 100 * MB, PolicyKind::Pack);
    let a = d.open(spec(1, 500 * MB, 500 * MB));
    let Action::Reject { session, reason } = &a[0] else {
        panic!("expected reject, got {a:?}");
    };
    assert_eq!(*session, SessionId(1));
    let text = reason.to_string();
    for needle in [
        "524288000 persistent",
        "524288000 ephemeral",
        "1048576000 bytes",
        "943718400",
    ] {
        assert!(text.contains(needle), "{text:?} lacks {needle}");
    }
    assert!(d.core.session(SessionId(1)).is_none());
    // Absurd sizes do not overflow.
    let a = d.open(spec(2, u64::MAX, u64::MAX));
    assert!(matches!(a[0], Action::Reject { .. }));
}

#[test]
fn a_session_waits_for_memory_with_the_reason_and_is_admitted_when_it_frees() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 300 * MB, 500 * MB));
    let a = d.open(spec(2, 300 * MB, 400 * MB));
    assert_eq!(
        a,
        vec![Action::Queue {
            session: SessionId(2),
            reason: WaitReason::Memory {
                needed: 700 * MB,
                available: 200 * MB,
                usable: 1000 * MB
            }
        }]
    );
    assert!(
        a[0].clone()
            != Action::Closed {
                session: SessionId(2)
            }
    );
    let text = match &a[0] {
        Action::Queue { reason, .. } => reason.to_string(),
        _ => unreachable!(),
    };
    assert!(
        text.contains("734003200 bytes") && text.contains("209715200 of 1048576000"),
        "{text}"
    );
    let a = d.close(1);
    assert_eq!(
        a[0],
        Action::Closed {
            session: SessionId(1)
        }
    );
    assert_eq!(admitted(&a), vec![(2, LaneId(1))]);
    // The persistent region reuses offset 0.
    assert!(a.contains(&Action::Admit {
        session: SessionId(2),
        lane: LaneId(1),
        persistent: Extent {
            offset: 0,
            size: 300 * MB
        },
        lane_size: 400 * MB,
        resumed: false,
    }));
}

#[test]
fn reserve_is_never_handed_out() {
    let mut d = Driver::new(1000 * MB, 200 * MB, PolicyKind::Pack);
    d.open(spec(1, 100 * MB, 600 * MB));
    let a = d.open(spec(2, 150 * MB, 60 * MB));
    assert!(
        matches!(
            a[0],
            Action::Queue {
                reason: WaitReason::Memory { .. },
                ..
            }
        ),
        "{a:?}"
    );
    let a = d.open(spec(3, 40 * MB, 70 * MB));
    assert_eq!(
        admitted(&a),
        vec![(3, LaneId(0))],
        "a new lane needs 810 > 800; joining the 600 lane needs 740"
    );
}

#[test]
fn fifo_runs_one_session_at_a_time_in_arrival_order() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Fifo);
    d.open(spec(1, 10 * MB, 10 * MB));
    let a = d.open(spec(2, 10 * MB, 10 * MB));
    assert_eq!(
        a,
        vec![Action::Queue {
            session: SessionId(2),
            reason: WaitReason::DeviceBusy {
                running: SessionId(1)
            }
        }]
    );
    let a = d.open(spec(3, 10 * MB, 10 * MB));
    assert_eq!(
        a,
        vec![Action::Queue {
            session: SessionId(3),
            reason: WaitReason::BehindEarlier {
                first: SessionId(2),
                policy: PolicyKind::Fifo
            }
        }]
    );
    let a = d.close(1);
    assert_eq!(admitted(&a), vec![(2, LaneId(1))]);
    let a = d.close(2);
    assert_eq!(admitted(&a), vec![(3, LaneId(2))]);
}

#[test]
fn iterations_start_only_at_boundaries_and_one_per_lane() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Fair);
    d.open(spec(1, 10 * MB, 100 * MB));
    d.open(spec(2, 10 * MB, 100 * MB));
    assert_eq!(d.core.lanes().len(), 1, "FAIR time-shares one lane");
    assert_eq!(started(&d.submit(1)), vec![1]);
    assert_eq!(
        started(&d.submit(2)),
        Vec::<u64>::new(),
        "lane busy until the boundary"
    );
    assert_eq!(started(&d.submit(1)), Vec::<u64>::new());
    assert_eq!(started(&d.finish(1, 10)), vec![2]);
    assert_eq!(started(&d.finish(2, 10)), vec![1]);
    assert_eq!(started(&d.finish(1, 10)), Vec::<u64>::new());
}

#[test]
fn fair_gives_equal_service_and_newcomers_start_level() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Fair);
    d.open(spec(1, 0, 100 * MB));
    d.submit(1);
    // Session 1 runs alone for 10 iterations of 30 ms.
    for _ in 0..10 {
        d.submit(1);
        d.finish(1, 30);
    }
    d.open(spec(2, 0, 100 * MB));
    d.submit(2);
    let mut runs = vec![0u32; 3];
    let mut current = 1;
    for _ in 0..40 {
        d.submit(current);
        let next = started(&d.finish(current, if current == 1 { 30 } else { 10 }));
        current = next[0];
        runs[current as usize] += 1;
    }
    // Equal service: session 2's iterations are a third as long, so it runs three times as
    // often; and it did not monopolise the lane to make up for the 300 ms before it came.
    assert_eq!(runs[2], 3 * runs[1], "{runs:?}");
    let s1 = d.core.session(SessionId(1)).unwrap().stats.attained_service;
    let s2 = d.core.session(SessionId(2)).unwrap().stats.attained_service;
    assert!(s1 > s2 + Duration::from_millis(250), "{s1:?} {s2:?}");
}

#[test]
fn srtf_preempts_the_longer_job_at_the_next_boundary() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Srtf);
    d.open(timed(1, 100 * MB, 300 * MB, 1000, 100));
    d.submit(1);
    d.submit(1);
    d.finish(1, 100);
    d.submit(1);
    // A short job arrives; it fits alone beside job 1's persistent memory.
    let a = d.open(timed(2, 100 * MB, 500 * MB, 3, 50));
    assert_eq!(
        admitted(&a),
        vec![(2, LaneId(0))],
        "shares the one lane, grown to 500"
    );
    d.submit(2);
    let a = d.finish(1, 100);
    assert_eq!(
        a.last(),
        Some(&Action::StartIteration {
            session: SessionId(2),
            lane: LaneId(0),
            lane_offset: 500 * MB,
            switched_from: Some(SessionId(1)),
            compute_share: 1.0,
            background: false,
        })
    );
    assert_eq!(d.core.session(SessionId(1)).unwrap().stats.preemptions, 1);
    d.submit(2);
    assert_eq!(started(&d.finish(2, 50)), vec![2]);
    d.submit(2);
    assert_eq!(started(&d.finish(2, 50)), vec![2]);
    assert_eq!(
        started(&d.finish(2, 50)),
        vec![1],
        "long job resumes when short one is done"
    );
    d.close(2);
}

#[test]
fn srtf_uses_measured_time_over_the_hint() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Srtf);
    // Job 1 claims 1 ms iterations but really takes 100 ms; job 2 is honest at 20 ms.
    d.open(timed(1, 0, 10 * MB, 10, 1));
    d.open(timed(2, 0, 10 * MB, 10, 20));
    d.submit(1);
    d.submit(2);
    assert_eq!(started(&d.log), vec![1], "by hints job 1 is shorter");
    d.submit(1);
    assert_eq!(
        started(&d.finish(1, 100)),
        vec![2],
        "9 x 100 ms > 10 x 20 ms"
    );
}

#[test]
fn close_during_an_iteration_frees_memory_after_it_finishes() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 300 * MB, 600 * MB));
    d.submit(1);
    d.submit(1);
    let waiting = d.open(spec(2, 300 * MB, 300 * MB));
    assert!(matches!(waiting[0], Action::Queue { .. }));
    assert_eq!(
        d.close(1),
        vec![],
        "memory stays in use while the iteration runs"
    );
    assert_eq!(d.core.memory_map().persistent_bytes, 300 * MB);
    assert_eq!(
        d.core
            .handle(d.now, Event::IterationSubmitted(SessionId(1))),
        Err(CoreError::Closing(SessionId(1)))
    );
    let a = d.finish(1, 5);
    assert_eq!(
        a[0],
        Action::Closed {
            session: SessionId(1)
        }
    );
    assert_eq!(admitted(&a), vec![(2, LaneId(1))]);
    assert!(
        started(&a).is_empty(),
        "the pending iteration of a closed session is dropped"
    );
}

#[test]
fn lanes_below_an_emptied_lane_move_up_at_their_next_boundary() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 200 * MB));
    d.open(spec(2, 0, 300 * MB));
    d.submit(2);
    assert_eq!(
        d.core.lanes()[1].placed,
        Some(Extent {
            offset: 500 * MB,
            size: 300 * MB
        })
    );
    let a = d.close(1);
    assert!(
        !a.iter().any(|x| matches!(x, Action::MoveLane { .. })),
        "lane 1 is running: it must not move"
    );
    let lane = &d.core.lanes()[0];
    assert_eq!(
        lane.target,
        Extent {
            offset: 700 * MB,
            size: 300 * MB
        }
    );
    assert_eq!(
        lane.placed,
        Some(Extent {
            offset: 500 * MB,
            size: 300 * MB
        })
    );
    d.submit(2);
    let a = d.finish(2, 10);
    assert_eq!(
        a,
        vec![
            Action::MoveLane {
                lane: LaneId(1),
                from: Some(Extent {
                    offset: 500 * MB,
                    size: 300 * MB
                }),
                to: Extent {
                    offset: 700 * MB,
                    size: 300 * MB
                },
            },
            Action::StartIteration {
                session: SessionId(2),
                lane: LaneId(1),
                lane_offset: 700 * MB,
                switched_from: None,
                compute_share: 1.0,
                background: false,
            }
        ]
    );
}

#[test]
fn a_new_lane_waits_for_the_lane_it_overlaps_to_move() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 200 * MB));
    d.open(spec(2, 0, 300 * MB));
    d.submit(2);
    d.close(1);
    // Lane 1 (300) still sits at 500..800 though its target is 700..1000. A new session
    // with a lane of 400 gets target 300..700, which overlaps lane 1's current place.
    let a = d.open(spec(3, 0, 400 * MB));
    assert_eq!(admitted(&a), vec![(3, LaneId(2))]);
    d.submit(3);
    assert!(started(&d.log).iter().all(|&s| s != 3));
    let a = d.finish(2, 10);
    assert_eq!(
        a.iter()
            .filter(|x| matches!(x, Action::MoveLane { .. }))
            .count(),
        2,
        "lane 1 moves up, then lane 2 is placed: {a:?}"
    );
    assert_eq!(started(&a), vec![3]);
}

#[test]
fn a_lane_shrinks_when_its_largest_session_leaves() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Fair);
    d.open(spec(1, 0, 100 * MB));
    d.open(spec(2, 0, 400 * MB));
    assert_eq!(d.core.lanes()[0].size, 400 * MB);
    let a = d.close(2);
    assert!(a.contains(&Action::MoveLane {
        lane: LaneId(0),
        from: Some(Extent {
            offset: 600 * MB,
            size: 400 * MB
        }),
        to: Extent {
            offset: 900 * MB,
            size: 100 * MB
        },
    }));
    assert_eq!(d.core.memory_map().lane_bytes, 100 * MB);
}

#[test]
fn persistent_holes_are_reused_best_fit() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 100 * MB, 10 * MB));
    d.open(spec(2, 50 * MB, 10 * MB));
    d.open(spec(3, 30 * MB, 10 * MB));
    d.open(spec(4, 10 * MB, 10 * MB));
    d.close(1);
    d.close(3);
    let a = d.open(spec(5, 25 * MB, 10 * MB));
    let Action::Admit { persistent, .. } = &a[0] else {
        panic!("{a:?}")
    };
    assert_eq!(
        persistent.offset,
        150 * MB,
        "the 30 MB hole fits 25 MB best"
    );
}

#[test]
fn draining_stops_admission_but_not_running_sessions() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 100 * MB));
    d.feed(Event::DrainingChanged(true));
    let a = d.open(spec(2, 0, 100 * MB));
    assert_eq!(
        a,
        vec![Action::Queue {
            session: SessionId(2),
            reason: WaitReason::Draining
        }]
    );
    assert_eq!(started(&d.submit(1)), vec![1]);
    let a = d.feed(Event::DrainingChanged(false));
    assert_eq!(admitted(&a), vec![(2, LaneId(1))]);
}

#[test]
fn policy_and_drain_changes_replay_from_the_event_stream() {
    let ms = Duration::from_millis;
    let stream = vec![
        (ms(0), Event::SessionOpened(spec(1, 0, 100 * MB))),
        (ms(1), Event::SessionOpened(spec(2, 0, 100 * MB))),
        (ms(2), Event::IterationSubmitted(SessionId(1))),
        (ms(3), Event::PolicyChanged(PolicyKind::Pack)),
        (ms(4), Event::DrainingChanged(true)),
        (ms(5), Event::SessionOpened(spec(3, 0, 50 * MB))),
        (ms(6), Event::DrainingChanged(false)),
        (ms(7), Event::PolicyChanged(PolicyKind::Fair)),
        (ms(8), Event::IterationSubmitted(SessionId(3))),
    ];
    let replay = || {
        let mut core = Scheduler::new(MemoryConfig::new(1000 * MB, 0), PolicyKind::Fifo).unwrap();
        let mut actions = Vec::new();
        for (at, event) in stream.clone() {
            core.handle(at, event).unwrap();
            actions.extend(core.poll());
            core.check_invariants().unwrap();
        }
        (actions, core.policy(), core.draining())
    };
    let (first, policy, draining) = replay();
    assert_eq!((policy, draining), (PolicyKind::Fair, false));
    assert!(first.contains(&Action::Queue {
        session: SessionId(3),
        reason: WaitReason::Draining
    }));
    assert_eq!(
        first,
        replay().0,
        "the same timed events give the same actions"
    );
}

#[test]
fn a_policy_change_is_a_timed_event() {
    let mut core = Scheduler::new(MemoryConfig::new(1000 * MB, 0), PolicyKind::Fifo).unwrap();
    core.handle(Duration::from_secs(2), Event::Tick).unwrap();
    assert_eq!(
        core.handle(
            Duration::from_secs(1),
            Event::PolicyChanged(PolicyKind::Pack)
        ),
        Err(CoreError::TimeWentBackwards {
            now: Duration::from_secs(1),
            last: Duration::from_secs(2)
        })
    );
    assert_eq!(
        core.policy(),
        PolicyKind::Fifo,
        "a refused event changes nothing"
    );
}

#[test]
fn the_policy_can_change_while_sessions_run() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Fifo);
    d.open(spec(1, 0, 100 * MB));
    d.open(spec(2, 0, 100 * MB));
    assert_eq!(d.core.waiting().len(), 1);
    let a = d.feed(Event::PolicyChanged(PolicyKind::Pack));
    assert_eq!(admitted(&a), vec![(2, LaneId(1))]);
    d.feed(Event::PolicyChanged(PolicyKind::Fair));
    let a = d.open(spec(3, 0, 50 * MB));
    assert_eq!(
        admitted(&a),
        vec![(3, LaneId(0))],
        "FAIR adds no lane; joins best fit"
    );
}

#[test]
fn bad_events_are_errors_that_change_nothing() {
    let mut core = Scheduler::new(MemoryConfig::new(1000 * MB, 0), PolicyKind::Pack).unwrap();
    let t = Duration::from_secs(1);
    assert_eq!(
        core.handle(t, Event::IterationSubmitted(SessionId(9))),
        Err(CoreError::UnknownSession(SessionId(9)))
    );
    core.handle(t, Event::SessionOpened(spec(1, 0, MB)))
        .unwrap();
    assert_eq!(
        core.handle(t, Event::SessionOpened(spec(1, 0, MB))),
        Err(CoreError::DuplicateSession(SessionId(1)))
    );
    assert_eq!(
        core.handle(
            t,
            Event::IterationFinished {
                session: SessionId(1),
                duration: t
            }
        ),
        Err(CoreError::NotRunning(SessionId(1)))
    );
    assert!(matches!(
        core.handle(Duration::ZERO, Event::Tick),
        Err(CoreError::TimeWentBackwards { .. })
    ));
    let err = core
        .handle(t, Event::SessionOpened(spec(2, 0, 0)))
        .unwrap_err();
    assert!(
        err.to_string().contains("session 2: ephemeral_bytes"),
        "{err}"
    );
    assert_eq!(core.sessions().count(), 1);
    core.check_invariants().unwrap();
    let err = Scheduler::new(MemoryConfig::new(1000, 1000), PolicyKind::Pack).unwrap_err();
    assert!(
        err.to_string()
            .contains("reserve (1000 bytes) must be smaller"),
        "{err}"
    );
}

#[test]
fn sizes_are_rounded_up_to_the_alignment() {
    let mut d = Driver::new(1 << 20, 0, PolicyKind::Pack);
    let a = d.open(spec(1, 1, 300));
    assert_eq!(
        a[0],
        Action::Admit {
            session: SessionId(1),
            lane: LaneId(0),
            persistent: Extent {
                offset: 0,
                size: 256
            },
            lane_size: 512,
            resumed: false,
        }
    );
}

#[test]
fn memory_map_serializes_for_status_output() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 100 * MB, 200 * MB));
    let json = serde_json::to_value(d.core.memory_map()).unwrap();
    assert_eq!(json["capacity"], 1000 * MB);
    assert_eq!(json["regions"][0]["kind"], "persistent");
    assert_eq!(json["regions"][0]["session"], 1);
    assert_eq!(json["regions"][1]["kind"], "free");
    assert_eq!(json["regions"][2]["kind"], "lane");
    assert_eq!(json["regions"][2]["offset"], 800 * MB);
}

#[test]
fn srtf_suspends_idle_longer_sessions_to_admit_a_shorter_one() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Srtf);
    d.open(timed(1, 300 * MB, 400 * MB, 1000, 100));
    d.open(timed(2, 200 * MB, 100 * MB, 500, 100));
    d.submit(1);
    d.submit(2);
    // Job 3 is the shortest; it needs 250 + 600 (lane grows to 600): only room once both
    // longer jobs are out. Job 1 is running, so it must wait for its boundary.
    let a = d.open(timed(3, 250 * MB, 600 * MB, 5, 100));
    assert_eq!(
        suspended(&a),
        Vec::<u64>::new(),
        "job 2 alone frees too little: {a:?}"
    );
    assert!(matches!(a.last(), Some(Action::Queue { .. })));
    d.submit(1);
    let a = d.finish(1, 100);
    assert_eq!(
        suspended(&a),
        vec![1, 2],
        "longest first, only as many as needed: {a:?}"
    );
    assert_eq!(admitted(&a), vec![(3, LaneId(1))]);
    d.submit(3);
    // Job 3 runs alone; the others come back in shortest-first order when it is done.
    for _ in 0..4 {
        d.submit(3);
        d.finish(3, 100);
    }
    let a = d.finish(3, 100);
    assert!(started(&a).is_empty());
    let a = d.close(3);
    assert!(
        a.contains(&Action::Admit {
            session: SessionId(2),
            lane: LaneId(2),
            persistent: Extent {
                offset: 0,
                size: 200 * MB
            },
            lane_size: 100 * MB,
            resumed: true,
        }),
        "{a:?}"
    );
    assert_eq!(d.core.session(SessionId(1)).unwrap().stats.suspensions, 1);
}

#[test]
fn safe_but_unplaceable_waits_as_fragmented_until_the_heap_compacts() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 400 * MB, 10 * MB));
    d.open(spec(2, 400 * MB, 10 * MB));
    d.close(1);
    // 410 MB used, so 450 + 100 keeps safety, but the only hole (at 0) holds 400 MB and
    // the heap top is at 800 MB: nowhere to put 450 MB in one piece.
    assert_eq!(
        d.core.plan_admission(450 * MB, 100 * MB),
        Err(WaitReason::Fragmented {
            needed: 550 * MB,
            available: 590 * MB
        })
    );
    let a = d.open(spec(3, 450 * MB, 100 * MB));
    assert_eq!(
        a,
        vec![Action::Queue {
            session: SessionId(3),
            reason: WaitReason::Fragmented {
                needed: 550 * MB,
                available: 590 * MB
            },
        }]
    );
    let text = WaitReason::Fragmented {
        needed: 1,
        available: 2,
    }
    .to_string();
    assert!(text.contains("not yet in one piece"), "{text}");
    let a = d.close(2);
    assert_eq!(admitted(&a), vec![(3, LaneId(2))]);
}

#[test]
fn plan_admission_predicts_algorithm_2_1_without_changing_anything() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Pack);
    d.open(spec(1, 0, 300 * MB));
    d.open(spec(2, 0, 200 * MB));
    assert_eq!(
        d.core.plan_admission(0, 100 * MB),
        Ok(salus_core::LaneChoice::Open)
    );
    d.open(spec(3, 0, 400 * MB));
    assert_eq!(
        d.core.plan_admission(0, 250 * MB),
        Ok(salus_core::LaneChoice::Join(LaneId(0)))
    );
    assert_eq!(
        d.core.plan_admission(0, 350 * MB),
        Ok(salus_core::LaneChoice::Join(LaneId(2)))
    );
    assert_eq!(
        d.core.plan_admission(0, 450 * MB),
        Ok(salus_core::LaneChoice::Grow(LaneId(2)))
    );
    assert!(matches!(
        d.core.plan_admission(0, 2000 * MB),
        Err(WaitReason::Memory { .. })
    ));
    assert!(matches!(
        d.core.plan_admission(u64::MAX, u64::MAX),
        Err(WaitReason::Memory { .. })
    ));
    assert_eq!(d.core.lanes().len(), 3);
}

#[test]
fn share_packs_sessions_into_lanes_side_by_side() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Share);
    d.open(spec(1, 100 * MB, 300 * MB));
    d.open(spec(2, 100 * MB, 300 * MB));
    assert_eq!(
        admitted(&d.log),
        vec![(1, LaneId(0)), (2, LaneId(1))],
        "a lane each while memory allows"
    );
    d.submit(1);
    d.submit(2);
    assert_eq!(started(&d.log), vec![1, 2], "both lanes run at once");
}

#[test]
fn share_runs_the_shortest_first_in_a_shared_lane() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Share);
    d.open(timed(1, 100 * MB, 500 * MB, 1000, 100));
    d.submit(1);
    d.submit(1);
    // No room for a second lane (100 + 500 + 100 + 400 > 1000): job 2 joins lane 0.
    let a = d.open(timed(2, 100 * MB, 400 * MB, 3, 50));
    assert_eq!(admitted(&a), vec![(2, LaneId(0))]);
    d.submit(2);
    let a = d.finish(1, 100);
    assert_eq!(
        a.last(),
        Some(&Action::StartIteration {
            session: SessionId(2),
            lane: LaneId(0),
            lane_offset: 500 * MB,
            switched_from: Some(SessionId(1)),
            compute_share: 1.0,
            background: false,
        }),
        "the shorter job goes first at the boundary"
    );
    d.submit(2);
    assert_eq!(started(&d.finish(2, 50)), vec![2]);
    d.submit(2);
    assert_eq!(started(&d.finish(2, 50)), vec![2]);
    assert_eq!(
        started(&d.finish(2, 50)),
        vec![1],
        "the long job resumes when the short one is done"
    );
}

#[test]
fn share_bounds_how_long_a_ready_session_waits_behind_shorter_ones() {
    // Job 1 has no hints (unknown length); a stream of one-iteration jobs, each shorter,
    // keeps arriving in its lane. SRTF would never run job 1 again; share runs it once it
    // has waited `Share::MAX_WAIT` since its last start.
    let bound = salus_core::policy::Share::MAX_WAIT;
    for policy in [PolicyKind::Share, PolicyKind::Srtf] {
        let mut d = Driver::new(1000 * MB, 0, policy);
        d.open(spec(1, 100 * MB, 500 * MB));
        d.submit(1);
        d.submit(1);
        let mut running = 1;
        let mut last_start_of_1 = Duration::ZERO;
        let mut longest_wait = Duration::ZERO;
        for k in 2..200 {
            // 100 + 500 + 10 + 400 > 1000: every short job shares lane 0.
            d.open(timed(k, 10 * MB, 400 * MB, 1, 100));
            d.submit(k);
            let a = d.finish(running, 100);
            if running != 1 {
                d.close(running);
            } else {
                d.submit(1);
            }
            if let Some(&next) = started(&a).last() {
                running = next;
            }
            if running == 1 {
                longest_wait = longest_wait.max(d.now - last_start_of_1);
                last_start_of_1 = d.now;
            }
        }
        let waited_last = d.now - last_start_of_1;
        match policy {
            PolicyKind::Share => assert!(
                longest_wait <= bound + Duration::from_millis(200) && waited_last <= bound,
                "job 1 waited {longest_wait:?} (bound {bound:?})"
            ),
            _ => assert_eq!(last_start_of_1, Duration::ZERO, "SRTF starves job 1"),
        }
    }
}

#[test]
fn share_suspends_an_idle_longer_session_for_a_shorter_one() {
    let mut d = Driver::new(1000 * MB, 0, PolicyKind::Share);
    d.open(timed(1, 400 * MB, 400 * MB, 1000, 100));
    d.submit(1);
    // Job 2 is shorter but does not fit beside job 1 (400 + 400 + 400 > 1000).
    let a = d.open(timed(2, 400 * MB, 400 * MB, 5, 100));
    assert!(matches!(a.last(), Some(Action::Queue { .. })), "{a:?}");
    // At job 1's boundary it is idle: it goes to host memory and job 2 comes in.
    let a = d.finish(1, 100);
    assert_eq!(suspended(&a), vec![1], "{a:?}");
    assert_eq!(admitted(&a).len(), 1);
    assert_eq!(admitted(&a)[0].0, 2);
    d.submit(1);
    d.submit(2);
    for _ in 0..4 {
        d.finish(2, 100);
        d.submit(2);
    }
    d.finish(2, 100);
    let a = d.close(2);
    assert!(
        a.iter().any(|x| matches!(
            x,
            Action::Admit {
                session: SessionId(1),
                resumed: true,
                ..
            }
        )),
        "job 1 comes back once job 2 is done: {a:?}"
    );
    assert!(started(&a).contains(&1), "{a:?}");
}
