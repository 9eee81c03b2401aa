use super::*;

#[test]
fn profiling_finds_the_packing_degree_of_eq_3_1() {
    // A small trial (30% of the device) packs 3 to a device; a large one (60%) 2.
    let small = profile(&Config { size: 0.0, lr: 0.5 });
    assert_eq!(small.c, 3, "{small:?}");
    let large = profile(&Config { size: 1.0, lr: 0.5 });
    assert_eq!(large.c, 2, "{large:?}");
    assert_eq!(large.d, 4);
    assert!(large.cost_s < 60.0);
}

#[test]
fn one_trial_per_device_under_fifo_leaves_devices_idle_in_hyperband() {
    let (fifo, _) = run_system("hyperband", 1, "fifo").unwrap();
    assert!(fifo.utilization < 0.5, "{fifo:?}");
    let (fluid, profile) = run_system("hyperband", 1, "fluid").unwrap();
    assert!(profile.is_some());
    assert!(fluid.makespan_s < fifo.makespan_s);
    assert!(fluid.utilization > fifo.utilization);
    assert!(fluid.rescales > 0);
}

#[test]
fn static_fluid_alone_never_resizes() {
    let (run, _) = run_system("asha", 2, "static_fluid").unwrap();
    assert_eq!(run.rescales, 0);
}

#[test]
fn the_experiment_meets_its_targets() {
    let result = fluid(1).unwrap();
    assert_eq!(result.algorithms.len(), algorithms::ALGORITHMS.len());
    for r in result.algorithms.values() {
        for system in SYSTEMS {
            assert!(r.makespan_s[system] > 0.0);
            assert!((0.0..=1.0).contains(&r.utilization[system]));
        }
    }
    let missed: Vec<_> = fluid_targets(&result)
        .into_iter()
        .filter(|c| !c.met)
        .collect();
    assert!(missed.is_empty(), "{missed:#?}");
}
