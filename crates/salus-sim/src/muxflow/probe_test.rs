#[test]
fn probe() {
    for seed in [1u64, 2] {
        let r = super::cluster::cluster(seed);
        println!(
            "seed {seed} load {:.3} jobs {} solo {:.0} h",
            r.online_load, r.offline_jobs, r.offline_solo_h
        );
        for (n, s) in &r.systems {
            println!(
                "{n:<18} mean {:.2}ms({:.3}) p99 {:.2}ms({:.3}) frac {:.3} idlefrac {:.3} dayh {:.0} fin {} jct {:.2}h mk {:.1}h util {:.3}({:.2}x) sm {:.3} mig {} ev {}",
                s.online_mean_ms,
                s.online_mean_slowdown,
                s.online_p99_ms,
                s.online_p99_slowdown,
                s.offline_throughput_fraction,
                s.offline_idle_capacity_fraction,
                s.offline_work_day_h,
                s.offline_finished,
                s.offline_avg_jct_h,
                s.offline_makespan_h,
                s.utilization,
                s.utilization_gain,
                s.sm_activity,
                s.migrations,
                s.evictions
            );
        }
    }
}
