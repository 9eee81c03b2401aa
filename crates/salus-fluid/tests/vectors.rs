//! The shared test vectors (`vectors.json`): the same decisions the Python mirror
//! (`salus.fluid`) is checked against.

use salus_fluid::degree::scaling_marginal_benefit;
use salus_fluid::{
    TrialId, Width, packing_degree, packing_marginal_benefit, scaling_degree, static_widths,
};
use serde_json::Value;

fn vectors() -> Value {
    serde_json::from_str(include_str!("vectors.json")).expect("vectors.json parses")
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
}

#[test]
fn packing_and_scaling_degrees() {
    let v = vectors();
    for case in v["packing"].as_array().expect("packing cases") {
        let times = floats(&case["times"]);
        let threshold = case["threshold"].as_f64().expect("threshold");
        let benefit = packing_marginal_benefit(&times);
        assert!(
            close(&benefit, &floats(&case["benefit"])),
            "{case}: {benefit:?}"
        );
        assert_eq!(
            packing_degree(&times, threshold) as u64,
            case["degree"].as_u64().expect("degree"),
            "{case}"
        );
    }
    for case in v["scaling"].as_array().expect("scaling cases") {
        let times = floats(&case["times"]);
        let threshold = case["threshold"].as_f64().expect("threshold");
        let benefit = scaling_marginal_benefit(&times);
        assert!(
            close(&benefit, &floats(&case["benefit"])),
            "{case}: {benefit:?}"
        );
        assert_eq!(
            scaling_degree(&times, threshold) as u64,
            case["degree"].as_u64().expect("degree"),
            "{case}"
        );
    }
}

#[test]
fn static_fluid_widths() {
    let v = vectors();
    for case in v["static"].as_array().expect("static cases") {
        let trials: Vec<(TrialId, f64)> = case["trials"]
            .as_array()
            .expect("trials")
            .iter()
            .map(|t| {
                (
                    TrialId(t[0].as_u64().expect("id")),
                    t[1].as_f64().expect("h"),
                )
            })
            .collect();
        let widths = static_widths(
            &trials,
            case["resources"].as_f64().expect("resources"),
            case["d"].as_u64().expect("d") as usize,
        );
        let expected: Vec<(TrialId, Width)> = case["widths"]
            .as_array()
            .expect("widths")
            .iter()
            .map(|w| {
                let width = match w[1].as_u64() {
                    Some(k) => Width::Devices(k as u32),
                    None => Width::Share,
                };
                (TrialId(w[0].as_u64().expect("id")), width)
            })
            .collect();
        assert_eq!(widths, expected, "{case}");
    }
}
