use super::*;

fn ids(actions: &[Action]) -> Vec<(u64, Placement)> {
    actions
        .iter()
        .map(|a| match a {
            Action::Place { trial, placement } | Action::Resize { trial, placement } => {
                (trial.0, placement.clone())
            }
        })
        .collect()
}

fn group(trials: &[(u64, f64)]) -> Event {
    Event::GroupSubmitted(trials.iter().map(|&(i, h)| (TrialId(i), h)).collect())
}

/// Every device is either owned by one trial or shared by at most `c`, and the planner's
/// bookkeeping agrees with the trials' placements.
fn check(fluid: &Planner) {
    for d in 0..fluid.config.devices {
        assert!(
            fluid.sharers[d].len() <= fluid.c(),
            "device {d} over-packed"
        );
        assert!(
            fluid.owner[d].is_none() || fluid.sharers[d].is_empty(),
            "device {d} owned and shared"
        );
    }
    for (id, t) in &fluid.trials {
        match &t.placement {
            Some(Placement::Shared(d)) => assert!(fluid.sharers[*d].contains(id)),
            Some(Placement::Exclusive(ds)) => {
                assert!(ds.len() <= fluid.d());
                assert!(ds.iter().all(|d| fluid.owner[*d] == Some(*id)));
            }
            None => assert!(fluid.queue.contains(id)),
        }
    }
}

#[test]
fn static_fluid_places_the_toy_example_like_fig_3_5c() {
    let mut fluid = Planner::new(PlannerConfig::ideal(5, 2, 3));
    fluid.handle(group(&[(1, 4.0), (2, 4.0), (3, 12.0), (4, 30.0)]));
    assert_eq!(
        ids(&fluid.poll()),
        vec![
            (4, Placement::Exclusive(vec![0, 1, 2])),
            (3, Placement::Exclusive(vec![3])),
            (1, Placement::Shared(4)),
            (2, Placement::Shared(4)),
        ]
    );
    check(&fluid);
}

#[test]
fn waiting_trials_take_shares_as_they_free_up() {
    let mut fluid = Planner::new(PlannerConfig {
        dynamic: false,
        ..PlannerConfig::ideal(2, 2, 4)
    });
    fluid.handle(group(&[
        (1, 10.0),
        (2, 10.0),
        (3, 10.0),
        (4, 10.0),
        (5, 10.0),
    ]));
    let placed = ids(&fluid.poll());
    // Spread over both devices first, two to a device.
    assert_eq!(
        placed,
        vec![
            (1, Placement::Shared(0)),
            (2, Placement::Shared(1)),
            (3, Placement::Shared(0)),
            (4, Placement::Shared(1)),
        ]
    );
    assert_eq!(fluid.queued(), &[TrialId(5)]);
    fluid.handle(Event::TrialFinished(TrialId(2)));
    assert_eq!(ids(&fluid.poll()), vec![(5, Placement::Shared(1))]);
    check(&fluid);
}

#[test]
fn dynamic_fluid_spreads_the_last_trial_over_freed_devices() {
    let config = PlannerConfig {
        model: RuntimeModel::from_overheads(2, 4, 1.0, 1.1),
        rescale_cost_s: 5.0,
        ..PlannerConfig::ideal(4, 2, 4)
    };
    for dynamic in [false, true] {
        let mut fluid = Planner::new(PlannerConfig {
            dynamic,
            ..config.clone()
        });
        fluid.handle(group(&[(1, 100.0), (2, 100.0), (3, 100.0), (4, 100.0)]));
        assert_eq!(fluid.poll().len(), 4);
        for t in [2, 3, 4] {
            fluid.handle(Event::Progress {
                trial: TrialId(1),
                remaining_s: 300.0,
            });
            fluid.handle(Event::TrialFinished(TrialId(t)));
        }
        let actions = ids(&fluid.poll());
        if dynamic {
            // Alone now: scaled to all four devices (h(4) = 300 * 1.1^3 / 4 = 100 s).
            assert_eq!(
                actions.last(),
                Some(&(1, Placement::Exclusive(vec![0, 1, 2, 3])))
            );
        } else {
            assert!(actions.is_empty());
        }
        check(&fluid);
    }
}

#[test]
fn the_rescale_cost_keeps_short_trials_where_they_are() {
    let mut fluid = Planner::new(PlannerConfig {
        rescale_cost_s: 50.0,
        ..PlannerConfig::ideal(2, 2, 2)
    });
    fluid.handle(group(&[(1, 60.0), (2, 10.0)]));
    fluid.poll();
    fluid.handle(Event::Progress {
        trial: TrialId(1),
        remaining_s: 60.0,
    });
    fluid.handle(Event::TrialFinished(TrialId(2)));
    // h(2) = 30 s, + 50 s of rescaling is worse than 60 s on one device.
    assert!(fluid.poll().is_empty());
}

#[test]
fn a_packed_trial_moves_onto_an_idle_device() {
    let mut fluid = Planner::new(PlannerConfig {
        model: RuntimeModel::from_overheads(2, 1, 1.5, 1.0),
        rescale_cost_s: 1.0,
        ..PlannerConfig::ideal(2, 2, 1)
    });
    // Four trials on two devices, two each.
    fluid.handle(group(&[(1, 50.0), (2, 50.0), (3, 50.0), (4, 50.0)]));
    fluid.poll();
    fluid.handle(Event::TrialFinished(TrialId(2)));
    fluid.handle(Event::TrialFinished(TrialId(4)));
    // Device 1 is idle, device 0 still has trials 1 and 3 (each 1.5x slower packed).
    let actions = ids(&fluid.poll());
    assert_eq!(actions, vec![(1, Placement::Exclusive(vec![1]))]);
    check(&fluid);
}

#[test]
fn wide_trials_give_devices_back_to_a_new_group() {
    let mut fluid = Planner::new(PlannerConfig {
        model: RuntimeModel::from_overheads(2, 4, 1.0, 1.2),
        ..PlannerConfig::ideal(4, 2, 4)
    });
    fluid.handle(group(&[(1, 400.0)]));
    assert_eq!(
        ids(&fluid.poll()),
        vec![(1, Placement::Exclusive(vec![0, 1, 2, 3]))]
    );
    // A new group of equal trials arrives: trial 1 is now a fifth of the work.
    fluid.handle(group(&[(2, 400.0), (3, 400.0), (4, 400.0), (5, 400.0)]));
    let actions = ids(&fluid.poll());
    assert_eq!(actions[0], (1, Placement::Exclusive(vec![0])));
    assert_eq!(actions.len(), 5, "{actions:?}");
    assert!(fluid.queued().is_empty());
    check(&fluid);
}

#[test]
fn random_event_streams_keep_the_devices_consistent() {
    let mut state = 7u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    for dynamic in [false, true] {
        let mut fluid = Planner::new(PlannerConfig {
            dynamic,
            rescale_cost_s: 2.0,
            model: RuntimeModel::from_overheads(3, 4, 1.05, 1.1),
            devices: 6,
        });
        let mut live: Vec<u64> = Vec::new();
        let mut id = 0;
        for _ in 0..2000 {
            match next(3) {
                0 => {
                    let trials: Vec<(u64, f64)> = (0..next(6))
                        .map(|_| {
                            id += 1;
                            live.push(id);
                            (id, 1.0 + next(500) as f64)
                        })
                        .collect();
                    fluid.handle(group(&trials));
                }
                1 if !live.is_empty() => {
                    let t = live.swap_remove(next(live.len() as u64) as usize);
                    fluid.handle(Event::TrialFinished(TrialId(t)));
                }
                _ if !live.is_empty() => {
                    let t = live[next(live.len() as u64) as usize];
                    fluid.handle(Event::Progress {
                        trial: TrialId(t),
                        remaining_s: next(500) as f64,
                    });
                }
                _ => {}
            }
            fluid.poll();
            check(&fluid);
            // Work-conserving: nothing waits while a share is free.
            if !fluid.queued().is_empty() {
                assert!(fluid.free_share().is_none());
            }
        }
    }
}
