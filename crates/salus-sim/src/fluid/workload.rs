//! The tuning task of the Fluid chapter's testbed, as the simulator models it: a CIFAR-10
//! network whose hyperparameters change both its cost and its accuracy, on 8 devices of
//! 24 GB (Quadro RTX 6000) where one trial keeps a device 30-60% busy.

use serde::Serialize;

/// Devices of the cluster (the chapter's 8 workers).
pub const DEVICES: usize = 8;
/// Memory of one device: a Quadro RTX 6000's 24 GB.
pub const DEVICE_BYTES: u64 = 24_000_000_000;
/// Simulated iterations per epoch (each a block of training steps: the scheduler sees the
/// same lanes and contention at this granularity, in far fewer events).
pub const ITERATIONS_PER_EPOCH: u64 = 10;
/// Slowdown each additional co-running iteration adds on a device, beyond compute
/// contention (caches, memory bandwidth): `p` iterations together run at `1 / (1 +
/// INTERFERENCE * (p - 1))` of the speed processor sharing alone would give.
pub const INTERFERENCE: f64 = 0.05;
/// `beta` of Eq. 3.2: one iteration on `w` devices takes `beta^(w - 1) / w` of its time on
/// one (data-parallel training over 10 Gb/s Ethernet).
pub const SCALING_OVERHEAD: f64 = 1.15;
/// `epsilon` of Algorithm 3.2: seconds a trial loses when its devices change
/// (checkpoint, start on the new devices, restore).
pub const RESCALE_COST_S: f64 = 10.0;

/// One hyperparameter configuration: `size` (architecture: layers and widths) and `lr`
/// (training), both in `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Config {
    /// Architecture size: bigger trains slower, uses more of the device and more memory,
    /// and reaches a higher accuracy.
    pub size: f64,
    /// Learning rate, normalised: best near 0.6.
    pub lr: f64,
}

impl Config {
    /// Seconds of one epoch alone on a device: 15 s to 45 s.
    pub fn epoch_s(&self) -> f64 {
        15.0 * 3f64.powf(self.size)
    }

    /// Seconds of one simulated iteration alone on a device.
    pub fn iteration_s(&self) -> f64 {
        self.epoch_s() / ITERATIONS_PER_EPOCH as f64
    }

    /// Fraction of a device one trial keeps busy alone: 30% to 60% (the chapter measures
    /// at most 60%).
    pub fn compute_share(&self) -> f64 {
        0.3 + 0.3 * self.size
    }

    /// Persistent bytes (parameters, optimizer state).
    pub fn persistent_bytes(&self) -> u64 {
        ((50.0 + 250.0 * self.size) * 1e6) as u64
    }

    /// Peak ephemeral bytes of an iteration.
    pub fn ephemeral_bytes(&self) -> u64 {
        ((0.8 + 2.2 * self.size) * 1e9) as u64
    }

    /// Final accuracy the configuration reaches (before noise).
    pub fn quality(&self) -> f64 {
        0.70 + 0.15 * self.size - 0.4 * (self.lr - 0.6).powi(2)
    }
}

/// The device model's speed for `running` iterations whose compute shares sum to
/// `demand`: each progresses at this fraction of its speed alone.
pub fn rate(running: usize, demand: f64) -> f64 {
    let interference = 1.0 + INTERFERENCE * running.saturating_sub(1) as f64;
    1.0 / (demand.max(1.0) * interference)
}

/// Time of one iteration of `config` with `p` copies of it running on one device: what
/// Fluid's profiling run measures.
pub fn packed_iteration_s(config: &Config, p: usize) -> f64 {
    config.iteration_s() / rate(p, p as f64 * config.compute_share())
}

/// Time of one iteration of a trial on `w` devices, relative to one.
pub fn scaling_factor(w: usize) -> f64 {
    SCALING_OVERHEAD.powi(w.max(1) as i32 - 1) / w.max(1) as f64
}

/// A deterministic noise in `[-1, 1]` for a key (the same trial and epoch always see
/// the same noise, whichever system runs them).
pub fn noise(seed: u64, a: u64, b: u64) -> f64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(a.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(b.wrapping_mul(0x94D0_49BB_1331_11EB));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_trial_leaves_the_device_underused() {
        for size in [0.0, 0.5, 1.0] {
            let c = Config { size, lr: 0.5 };
            assert!((0.3..=0.6).contains(&c.compute_share()));
            assert!(c.persistent_bytes() + c.ephemeral_bytes() < DEVICE_BYTES / 6);
        }
        // Two small trials side by side run at nearly full speed; four are slowed.
        let small = Config { size: 0.0, lr: 0.5 };
        assert!(packed_iteration_s(&small, 2) < 1.1 * small.iteration_s());
        assert!(packed_iteration_s(&small, 4) > 1.3 * small.iteration_s());
    }

    #[test]
    fn noise_is_bounded_and_deterministic() {
        for i in 0..1000 {
            let n = noise(1, i, 3);
            assert!((-1.0..=1.0).contains(&n));
            assert_eq!(n, noise(1, i, 3));
        }
        assert_ne!(noise(1, 2, 3), noise(2, 2, 3));
    }
}
