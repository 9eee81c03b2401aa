//! How far to share: the packing degree `c` (trials per device, Eq. 3.1), the scaling
//! degree `d` (devices per trial), and a trial's runtime at a width (Eq. 3.2).
//!
//! Both degrees come from measurements, as in the chapter: Fluid runs a few iterations of
//! a trial of the group alone and packed with 2, 3, ... copies of itself, and (where it can
//! train across devices) on 1, 2, ... devices, and stops sharing where one more trial or
//! device stops paying off. The same measurements give the runtime model that DynamicFluid
//! compares widths with, so Eq. 3.2's overhead factors `alpha` and `beta` are read off the
//! measured curve instead of fitted.

use serde::{Deserialize, Serialize};

use crate::plan::Width;

/// Eq. 3.1, the marginal benefit of packing the `p`-th trial on a device:
/// `O^p = 1 - (p - 1) / p * avg(T^p) / avg(T^(p-1))`, for `p = 2..=times.len()`.
///
/// `times[p - 1]` is the mean time of one iteration of a trial while `p` trials share the
/// device. The result's first element is `O^2`. A device that was idle most of the time
/// (iterations no slower when packed) gives `1 / p`; a saturated one (iterations `p / (p -
/// 1)` times slower) gives 0; interference beyond saturation gives less.
pub fn packing_marginal_benefit(times: &[f64]) -> Vec<f64> {
    times
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let p = (i + 2) as f64;
            1.0 - (p - 1.0) / p * w[1] / w[0]
        })
        .collect()
}

/// The packing degree `c = argmax_p O^p > O_th`: the largest `p` such that packing each of
/// the 2nd..`p`-th trial still had a marginal benefit above `threshold`. At least 1.
pub fn packing_degree(times: &[f64], threshold: f64) -> usize {
    1 + packing_marginal_benefit(times)
        .iter()
        .take_while(|&&o| o > threshold)
        .count()
}

/// The marginal benefit of training on a `w`-th device: the time it saves as a fraction of
/// what a perfectly scaling device would save, `w * (1 - T_w / T_(w-1))` for `w =
/// 2..=times.len()` (1 = linear scaling, 0 = no gain). `times[w - 1]` is the time of one
/// iteration (of the whole batch) on `w` devices.
pub fn scaling_marginal_benefit(times: &[f64]) -> Vec<f64> {
    times
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let n = (i + 2) as f64;
            n * (1.0 - w[1] / w[0])
        })
        .collect()
}

/// The scaling degree `d`: the largest `w` such that every device up to the `w`-th saved
/// more than `threshold` of a device's worth. At least 1. The chapter estimates it with
/// Paleo; here it comes from measured (or modelled) iteration times.
pub fn scaling_degree(times: &[f64], threshold: f64) -> usize {
    1 + scaling_marginal_benefit(times)
        .iter()
        .take_while(|&&o| o > threshold)
        .count()
}

/// A trial's runtime at each width, relative to its runtime alone on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RuntimeModel {
    /// `packing[p - 1] = T^p / T^1`, for `p = 1..=c`: how much longer an iteration takes
    /// with `p` trials on the device. Its length is the packing degree `c`.
    pub packing: Vec<f64>,
    /// `scaling[w - 1] = T_w / T_1`, for `w = 1..=d`: the time of an iteration on `w`
    /// devices. Its length is the scaling degree `d`.
    pub scaling: Vec<f64>,
}

impl RuntimeModel {
    /// Eq. 3.2 with constant overheads: `h(1/p) = h(1) * alpha^(p - 1)` packed `p` to a
    /// device (Eq. 3.2's `alpha^(1/w - 1)`), `h(w) = h(1) / w * beta^(w - 1)` on `w`
    /// devices.
    pub fn from_overheads(c: usize, d: usize, alpha: f64, beta: f64) -> Self {
        RuntimeModel {
            packing: (0..c.max(1)).map(|p| alpha.powi(p as i32)).collect(),
            scaling: (1..=d.max(1))
                .map(|w| beta.powi(w as i32 - 1) / w as f64)
                .collect(),
        }
    }

    /// From measured iteration times (`packing_times[p - 1]` with `p` trials on a device,
    /// `scaling_times[w - 1]` on `w` devices), cut at the degrees the thresholds give.
    pub fn from_measurements(
        packing_times: &[f64],
        packing_threshold: f64,
        scaling_times: &[f64],
        scaling_threshold: f64,
    ) -> Self {
        let relative = |times: &[f64], n: usize| -> Vec<f64> {
            match times.first() {
                Some(&t1) if t1 > 0.0 => times.iter().take(n).map(|t| t / t1).collect(),
                _ => vec![1.0],
            }
        };
        RuntimeModel {
            packing: relative(
                packing_times,
                packing_degree(packing_times, packing_threshold),
            ),
            scaling: relative(
                scaling_times,
                scaling_degree(scaling_times, scaling_threshold),
            ),
        }
    }

    /// The packing degree `c`.
    pub fn c(&self) -> usize {
        self.packing.len().max(1)
    }

    /// The scaling degree `d`.
    pub fn d(&self) -> usize {
        self.scaling.len().max(1)
    }

    /// Runtime of a trial that takes `h1` seconds alone on one device, when it shares a
    /// device with `sharing - 1` others (`Width::Share`) or trains on `k` devices
    /// (`Width::Devices(k)`). Beyond the measured degrees the last factor holds.
    pub fn runtime(&self, h1: f64, width: Width, sharing: usize) -> f64 {
        let factor = |table: &[f64], n: usize| {
            table
                .get(n.max(1) - 1)
                .or(table.last())
                .copied()
                .unwrap_or(1.0)
        };
        match width {
            Width::Share => h1 * factor(&self.packing, sharing),
            Width::Devices(k) => h1 * factor(&self.scaling, k as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_device_packs_until_it_saturates() {
        // A trial keeping 40% of the device busy: 2 fit side by side (no slowdown), the
        // 3rd saturates it (1.2x), the 4th only slows everyone down.
        let times = [1.0, 1.0, 1.2, 1.6];
        let o = packing_marginal_benefit(&times);
        assert!((o[0] - 0.5).abs() < 1e-12);
        assert!((o[1] - 0.2).abs() < 1e-12);
        assert!((o[2] - 0.0).abs() < 1e-12);
        assert_eq!(packing_degree(&times, 0.1), 3);
        assert_eq!(packing_degree(&times, 0.3), 2);
        assert_eq!(packing_degree(&[1.0], 0.1), 1);
        assert_eq!(packing_degree(&[], 0.1), 1);
    }

    #[test]
    fn a_saturating_trial_is_not_packed() {
        // Twice as slow with two: no benefit.
        assert_eq!(packing_degree(&[1.0, 2.0, 3.0], 0.05), 1);
    }

    #[test]
    fn scaling_stops_where_a_device_saves_too_little() {
        let model = RuntimeModel::from_overheads(1, 8, 1.0, 1.15);
        let o = scaling_marginal_benefit(&model.scaling);
        assert!(o.windows(2).all(|w| w[1] < w[0]), "{o:?}");
        assert_eq!(scaling_degree(&model.scaling, 0.5), 4);
        // Linear scaling never stops.
        let linear: Vec<f64> = (1..=6).map(|w| 1.0 / w as f64).collect();
        assert_eq!(scaling_degree(&linear, 0.99), 6);
    }

    #[test]
    fn runtime_follows_eq_3_2() {
        let model = RuntimeModel::from_overheads(3, 4, 1.1, 1.2);
        assert_eq!(model.c(), 3);
        assert_eq!(model.d(), 4);
        assert!((model.runtime(10.0, Width::Share, 1) - 10.0).abs() < 1e-12);
        assert!((model.runtime(10.0, Width::Share, 3) - 12.1).abs() < 1e-9);
        assert!((model.runtime(10.0, Width::Devices(2), 1) - 6.0).abs() < 1e-9);
        // Past the degree, the last measured factor.
        assert!((model.runtime(10.0, Width::Share, 5) - 12.1).abs() < 1e-9);
    }

    #[test]
    fn measurements_are_cut_at_the_degrees() {
        let model =
            RuntimeModel::from_measurements(&[2.0, 2.0, 2.4, 3.2], 0.1, &[4.0, 2.4, 2.0], 0.5);
        assert_eq!(model.packing, vec![1.0, 1.0, 1.2]);
        assert_eq!(model.scaling, vec![1.0, 0.6]);
    }
}
