//! StaticFluid's and DynamicFluid's widths (Algorithms 3.1 and 3.2, Eq. B.1), as pure
//! functions of the trials' remaining runtimes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Identifies a trial. Chosen by the driver, unique for the life of one planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TrialId(pub u64);

impl fmt::Display for TrialId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "trial {}", self.0)
    }
}

/// The resources a trial is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Width {
    /// `1/c` of a device: packed with up to `c - 1` other trials.
    Share,
    /// This many whole devices, training across them.
    Devices(u32),
}

/// Eq. B.1 for one trial: `w* = h / sum(h) * n`; `floor(w*)` whole devices (at most `d`)
/// when `w* >= 1`, else a share of one device. Algorithm 3.2 uses the same formula with
/// `n` the group's total resources.
pub fn dynamic_target(h: f64, total_h: f64, resources: f64, d: usize) -> Width {
    if total_h <= 0.0 || !h.is_finite() {
        return Width::Share;
    }
    let w = h / total_h * resources;
    if w >= 1.0 {
        let whole = (w.floor() as u64).clamp(1, d.max(1) as u64);
        Width::Devices(whole as u32)
    } else {
        Width::Share
    }
}

/// Algorithm 3.1 (StaticFluid): the trials `(id, h)`, `h` the remaining runtime alone on
/// one device, sorted by `h` non-increasing (ties by id), each with its width on
/// `resources` idle devices (fractional: free shares count as `1/c` each).
pub fn static_widths(trials: &[(TrialId, f64)], resources: f64, d: usize) -> Vec<(TrialId, Width)> {
    let total: f64 = trials.iter().map(|(_, h)| h.max(0.0)).sum();
    let mut sorted: Vec<(TrialId, f64)> = trials.to_vec();
    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    sorted
        .into_iter()
        .map(|(id, h)| (id, dynamic_target(h.max(0.0), total, resources, d)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_toy_example_of_fig_3_5() {
        // 5 devices; trials of 4, 4, 12 and 30 s: the 30 s trial gets 3 devices, the 12 s
        // one a whole device, the short ones shares.
        let trials = [
            (TrialId(1), 4.0),
            (TrialId(2), 4.0),
            (TrialId(3), 12.0),
            (TrialId(4), 30.0),
        ];
        let widths = static_widths(&trials, 5.0, 8);
        assert_eq!(
            widths,
            vec![
                (TrialId(4), Width::Devices(3)),
                (TrialId(3), Width::Devices(1)),
                (TrialId(1), Width::Share),
                (TrialId(2), Width::Share),
            ]
        );
        // With d = 2 the long trial is capped.
        assert_eq!(static_widths(&trials, 5.0, 2)[0].1, Width::Devices(2));
    }

    #[test]
    fn more_trials_than_devices_all_share() {
        let trials: Vec<_> = (0..27).map(|i| (TrialId(i), 10.0 + i as f64)).collect();
        assert!(
            static_widths(&trials, 8.0, 4)
                .iter()
                .all(|(_, w)| *w == Width::Share)
        );
    }

    #[test]
    fn degenerate_inputs_share() {
        assert_eq!(dynamic_target(0.0, 0.0, 8.0, 4), Width::Share);
        assert_eq!(dynamic_target(f64::NAN, 1.0, 8.0, 4), Width::Share);
        assert_eq!(dynamic_target(5.0, 5.0, 8.0, 0), Width::Devices(1));
    }
}
