//! The `salus-sim` binary end to end: commands, JSON shapes, trace errors.

use std::process::Command;

fn sim(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_salus-sim"))
        .args(args)
        .output()
        .expect("salus-sim runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn training_json_has_the_documented_shape() {
    let (ok, out, err) = sim(&["experiment", "training", "--seed", "2", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for policy in ["fifo", "srtf", "pack", "fair"] {
        for field in ["makespan_s", "avg_queue_s", "avg_jct_s", "p95_jct_s"] {
            assert!(
                v["policies"][policy][field].as_f64().unwrap() > 0.0,
                "{policy}.{field}"
            );
        }
    }
}

#[test]
fn tuning_and_fair_share_json() {
    let (ok, out, err) = sim(&["experiment", "tuning", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for set in ["superres_128", "resnet50_50"] {
        assert!(v["sets"][set]["fifo_makespan_s"].as_f64().unwrap() > 0.0);
        assert!(v["sets"][set]["pack_makespan_s"].as_f64().unwrap() > 0.0);
    }
    let (ok, out, err) = sim(&["experiment", "fair-share", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["max_share_deviation"].as_f64().unwrap() <= 0.05);
}

#[test]
fn replay_of_the_generated_trace_matches_the_experiment() {
    let dir = std::env::temp_dir().join(format!("salus-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace.jsonl");
    let (ok, trace, err) = sim(&["trace", "--seed", "3"]);
    assert!(ok, "{err}");
    std::fs::write(&path, trace).unwrap();
    let (ok, out, err) = sim(&[
        "replay",
        path.to_str().unwrap(),
        "--policy",
        "srtf",
        "--json",
    ]);
    assert!(ok, "{err}");
    let replay: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (_, out, _) = sim(&["experiment", "training", "--seed", "3", "--json"]);
    let experiment: serde_json::Value = serde_json::from_str(&out).unwrap();
    let a = replay["summary"]["avg_jct_s"].as_f64().unwrap();
    let b = experiment["policies"]["srtf"]["avg_jct_s"]
        .as_f64()
        .unwrap();
    assert!((a - b).abs() < 1e-6 * b, "replay {a} vs experiment {b}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bad_trace_names_the_line_and_field() {
    let dir = std::env::temp_dir().join(format!("salus-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"id\":\"a\",\"arrival_s\":0,\"model\":\"googlenet\",\"batch_size\":25,\"iterations\":10}\n\
         {\"id\":\"b\",\"arrival_s\":-1,\"model\":\"googlenet\",\"batch_size\":25,\"iterations\":10}\n",
    )
    .unwrap();
    let (ok, _, err) = sim(&["replay", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("line 2") && err.contains("arrival_s"), "{err}");
    let (ok, _, err) = sim(&["replay", "/nonexistent/trace.jsonl"]);
    assert!(!ok);
    assert!(err.contains("/nonexistent/trace.jsonl"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn orloj_json_has_the_documented_shape() {
    let (ok, out, err) = sim(&[
        "experiment",
        "orloj",
        "--seeds",
        "1",
        "--case",
        "std-1",
        "--case",
        "resnet-imagenet",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for case in ["std-1", "resnet-imagenet"] {
        let c = &v["cases"][case];
        let slo: Vec<f64> = c["slo"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(slo, [1.5, 2.0, 3.0, 4.0, 5.0]);
        for scheduler in ["orloj", "clockwork", "nexus", "clipper", "edf", "fifo"] {
            let rates = c["finish_rate"][scheduler].as_array().unwrap();
            assert_eq!(rates.len(), 5, "{case} {scheduler}");
            assert!(
                rates
                    .iter()
                    .all(|r| (0.0..=1.0).contains(&r.as_f64().unwrap()))
            );
        }
    }
    let (ok, _, err) = sim(&["experiment", "orloj", "--case", "nine-modal"]);
    assert!(!ok);
    assert!(
        err.contains("nine-modal") && err.contains("eight-modal"),
        "{err}"
    );
}

#[test]
fn orloj_queue_json_has_a_row_per_size() {
    let (ok, out, err) = sim(&["experiment", "orloj-queue", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v.as_array().unwrap();
    let sizes: Vec<u64> = rows
        .iter()
        .map(|r| r["pending"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [10, 100, 1_000, 10_000]);
    for row in rows {
        for field in ["insert_us", "replace_us", "query_us"] {
            assert!(row[field].as_f64().unwrap() > 0.0, "{field}");
        }
    }
}

#[test]
fn fluid_json_has_the_documented_shape() {
    let (ok, out, err) = sim(&["experiment", "fluid", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for algorithm in ["grid", "hyperband", "sync_bohb", "asha", "bohb", "pbt"] {
        for system in ["fifo", "pack", "static_fluid", "fluid"] {
            let a = &v["algorithms"][algorithm];
            assert!(
                a["makespan_s"][system].as_f64().unwrap() > 0.0,
                "{algorithm} {system}"
            );
            let u = a["utilization"][system].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&u), "{algorithm} {system}: {u}");
        }
    }
}
