//! MuxFlow's dynamic SM allocation (§4.3), learned from what the core measures.
//!
//! MuxFlow gives an offline job the SM percentage its online neighbour leaves (the
//! complement of the service's SM activity, profiled). The core cannot see SMs, but it
//! sees what matters: how much longer online iterations take beside offline ones at each
//! share. [`OfflineShare`] climbs the share an offline iteration gets while an online
//! one runs, in sixteenths of the device, as long as the online iterations do not get
//! slower than at the share below, and steps back where they do:
//!
//! - **Probe.** At a settled level `k`, the share moves to `k + 1` and the slowdown of
//!   online iterations beside offline ones there is compared with that at `k`. Within the
//!   tolerance (`ln(target_load)` on the log scale, the controller's own setpoint) it is
//!   kept and the next level probed; beyond it the share returns to `k`. A comparison of
//!   two levels cancels what every share costs alike (an offline kernel that runs on for
//!   a moment after the share drops), so only the share's own effect decides.
//! - **Back-off.** A refused level is probed again after a wait that doubles with each
//!   refusal in a row (up to 64 times the samples a level needs), so a service near its
//!   limit is slowed by a probe rarely, and one whose requests get lighter is given more.
//! - **Down.** Settled at a level where online iterations beside offline ones are slower
//!   than those alone by more than the tolerance (a heavier online session came, or the
//!   start was too high), the level below is tried the same way: if it is faster by more
//!   than the tolerance the share stays there; if not, the slowdown is not the share's
//!   and the share goes back up (with its own back-off before looking again).
//! - **Samples.** Each is the log of an online iteration's duration over its session's
//!   steady clean reference (the mean log of its recent clean durations). A level is
//!   settled once the mean's standard error is below a quarter of the tolerance (at least
//!   [`LEVEL_MIN_SAMPLES`], at most [`MOST_SAMPLES`]): few iterations for a fixed-shape graph on
//!   a GPU (percent-level noise), hundreds for requests of varying size.

use super::ProtectionConfig;

/// The share moves in steps of `1 / LEVELS` of the device.
pub const LEVELS: u32 = 16;
/// The fewest samples a level waits for before it is compared (a mean, not a tail: a
/// fixed-shape graph on a GPU varies by percents).
pub const LEVEL_MIN_SAMPLES: f64 = 20.0;
/// The most samples a level waits for before it is compared, and the most its running
/// statistics weigh (older samples count less beyond it).
pub const MOST_SAMPLES: f64 = 4096.0;
/// The longest back-off, in multiples of the samples a level needs.
const MOST_BACKOFF: u32 = 64;

/// Mean and variance of samples (Welford), forgetting beyond [`MOST_SAMPLES`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Stats {
    n: f64,
    mean: f64,
    m2: f64,
}

impl Stats {
    fn add(&mut self, x: f64) {
        if self.n >= MOST_SAMPLES {
            self.m2 *= (MOST_SAMPLES - 1.0) / self.n;
            self.n = MOST_SAMPLES - 1.0;
        }
        self.n += 1.0;
        let d = x - self.mean;
        self.mean += d / self.n;
        self.m2 += d * (x - self.mean);
    }

    fn variance(&self) -> f64 {
        if self.n > 1.0 {
            self.m2 / (self.n - 1.0)
        } else {
            0.0
        }
    }

    /// The samples that put the mean's standard error below `tolerance / 4` (so two
    /// levels' difference has a standard error below half the tolerance), at least `min`
    /// and at most [`MOST_SAMPLES`].
    fn needed(&self, tolerance: f64, min: f64) -> f64 {
        (16.0 * self.variance() / (tolerance * tolerance)).clamp(min, MOST_SAMPLES)
    }

    fn settled(&self, tolerance: f64, min: f64) -> bool {
        self.n >= self.needed(tolerance, min)
    }
}

/// A wait that doubles with each refusal in a row.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Backoff {
    /// Refusals in a row.
    times: u32,
    /// Samples still to wait.
    wait: f64,
}

impl Backoff {
    fn refused(&mut self, need: f64) {
        self.times = (self.times * 2).clamp(1, MOST_BACKOFF);
        self.wait = f64::from(self.times) * need;
    }

    fn cleared(&mut self) {
        *self = Backoff::default();
    }

    /// One sample waited; true when the wait is over.
    fn tick(&mut self) -> bool {
        self.wait -= 1.0;
        self.wait <= 0.0
    }
}

/// A level tried next to a settled one.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Probe {
    /// The settled level's samples, and whether the probe is above it.
    from: Stats,
    up: bool,
}

/// The offline compute share beside online work, fixed or learned (see the module).
#[derive(Debug, Clone, PartialEq)]
pub struct OfflineShare {
    /// A fixed share (the operator's or the device's): never learned.
    fixed: Option<f64>,
    level: u32,
    /// Changes with every new share: samples of iterations started at another share are
    /// not counted.
    epoch: u64,
    tolerance: f64,
    min_samples: f64,
    /// Online iterations beside offline ones at this level.
    here: Stats,
    probe: Option<Probe>,
    /// Online iterations with no offline iteration beside them.
    clean: Stats,
    /// The level above was refused (`up_level`) and is probed again after this.
    up: Backoff,
    up_level: u32,
    /// A level below gained nothing and is probed again after this.
    down: Backoff,
    probes: u64,
    refusals: u64,
}

impl OfflineShare {
    /// The share `config` asks for: learned from its `offline_compute_share` (the nearest
    /// sixteenth, at least one) where `dynamic_compute_share` is set, that share otherwise.
    pub fn new(config: &ProtectionConfig) -> Self {
        let share = config.offline_compute_share;
        let level = (share * f64::from(LEVELS))
            .round()
            .clamp(1.0, f64::from(LEVELS - 1));
        OfflineShare {
            fixed: (!config.dynamic_compute_share).then_some(share),
            level: level as u32,
            epoch: 0,
            tolerance: config.target_load.ln().max(1e-3),
            min_samples: LEVEL_MIN_SAMPLES,
            here: Stats::default(),
            probe: None,
            clean: Stats::default(),
            up: Backoff::default(),
            up_level: 0,
            down: Backoff::default(),
            probes: 0,
            refusals: 0,
        }
    }

    /// The share of the device an offline iteration may use while an online one runs.
    pub fn share(&self) -> f64 {
        self.fixed
            .unwrap_or(f64::from(self.level) / f64::from(LEVELS))
    }

    /// True when the share is learned.
    pub fn learned(&self) -> bool {
        self.fixed.is_none()
    }

    /// Changes with every new share.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Levels probed and refused so far.
    pub fn probes(&self) -> (u64, u64) {
        (self.probes, self.refusals)
    }

    /// An online iteration with no offline one beside it took `ratio` times its session's
    /// reference.
    pub fn clean(&mut self, ratio: f64) {
        if self.learned() && ratio > 0.0 && ratio.is_finite() {
            self.clean.add(ratio.ln());
        }
    }

    /// An online iteration that started beside offline work at this share (this
    /// [`Self::epoch`]) took `ratio` times its session's reference. True when the share
    /// changed.
    pub fn beside(&mut self, ratio: f64) -> bool {
        if !(self.learned() && ratio > 0.0 && ratio.is_finite()) {
            return false;
        }
        self.here.add(ratio.ln());
        let (tol, min) = (self.tolerance, self.min_samples);
        if !self.here.settled(tol, min) {
            return false;
        }
        // Samples a level needs at the spread seen here: the back-off's unit.
        let need = self.here.needed(tol, min);
        if let Some(probe) = self.probe.take() {
            // Online iterations at the higher of the two levels, against the lower.
            let (high, low) = if probe.up {
                (self.here, probe.from)
            } else {
                (probe.from, self.here)
            };
            let harms = high.mean - low.mean > tol;
            self.refusals += u64::from(harms);
            match (probe.up, harms) {
                // The level above slows online work: back, and wait longer each time.
                (true, true) => {
                    self.up_level = self.level;
                    self.up.refused(need);
                    self.here = probe.from;
                    self.move_to(self.level - 1);
                }
                // It does not: keep it.
                (true, false) => {
                    if self.up_level <= self.level {
                        self.up.cleared();
                    }
                }
                // The settled level was the harm (a heavier online session): stay below.
                (false, true) => {
                    self.up_level = self.level + 1;
                    self.up.refused(need);
                    self.down.cleared();
                }
                // Going down gained nothing: back, and wait longer before looking again.
                (false, false) => {
                    self.down.refused(need);
                    self.here = probe.from;
                    self.move_to(self.level + 1);
                }
            }
            return true;
        }
        let slower = self.clean.n >= min && self.here.mean - self.clean.mean > tol;
        if slower && self.level > 1 && self.down.tick() {
            return self.start_probe(false);
        }
        let may_rise = self.up_level != self.level + 1 || self.up.tick();
        if may_rise && self.level + 1 < LEVELS {
            return self.start_probe(true);
        }
        false
    }

    fn start_probe(&mut self, up: bool) -> bool {
        self.probes += 1;
        self.probe = Some(Probe {
            from: std::mem::take(&mut self.here),
            up,
        });
        self.move_to(if up { self.level + 1 } else { self.level - 1 });
        true
    }

    fn move_to(&mut self, level: u32) {
        self.level = level.clamp(1, LEVELS - 1);
        self.epoch += 1;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A device where online iterations need `need` of it: beside an offline share `s`
    /// they take `max(1, need / (1 - s))` times as long, times `noise`.
    fn stretch(need: f64, s: f64) -> f64 {
        (need / (1.0 - s)).max(1.0)
    }

    fn learner() -> OfflineShare {
        OfflineShare::new(&ProtectionConfig::default())
    }

    /// Runs `n` online iterations beside offline work (and as many alone), with
    /// log-normal noise of spread `sigma` from a fixed sequence; returns the shares seen.
    fn run(
        share: &mut OfflineShare,
        need: impl Fn(usize) -> f64,
        n: usize,
        sigma: f64,
    ) -> Vec<f64> {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut normal = || {
            // Sum of 12 uniforms less 6: mean 0, variance 1.
            let mut sum = 0.0;
            for _ in 0..12 {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                sum += (state >> 11) as f64 / (1u64 << 53) as f64;
            }
            sum - 6.0
        };
        let mut seen = Vec::with_capacity(n);
        for i in 0..n {
            share.clean((sigma * normal()).exp());
            let s = share.share();
            share.beside(stretch(need(i), s) * (sigma * normal()).exp());
            seen.push(s);
        }
        seen
    }

    #[test]
    fn a_fixed_share_never_moves() {
        let config = ProtectionConfig {
            dynamic_compute_share: false,
            offline_compute_share: 0.0,
            ..ProtectionConfig::default()
        };
        let mut share = OfflineShare::new(&config);
        let seen = run(&mut share, |_| 0.2, 2000, 0.02);
        assert!(seen.iter().all(|&s| s == 0.0));
        assert_eq!(share.probes(), (0, 0));
    }

    #[test]
    fn it_climbs_to_what_the_online_work_leaves_and_stays_below_it() {
        for (need, sigma) in [(0.35, 0.02), (0.55, 0.2), (0.75, 0.02), (0.2, 0.3)] {
            let mut share = learner();
            let seen = run(&mut share, |_| need, 60_000, sigma);
            // The best level: the largest sixteenth that slows nothing.
            let best = ((1.0 - need) * 16.0).floor() / 16.0;
            let late = &seen[30_000..];
            let at_best = late.iter().filter(|&&s| (s - best).abs() < 1e-9).count();
            let above = late.iter().filter(|&&s| s > best + 1e-9).count();
            let cases = format!("need {need}, sigma {sigma}: {at_best} at {best}, {above} above");
            assert!(at_best as f64 > 0.9 * late.len() as f64, "{cases}");
            assert!((above as f64) < 0.05 * late.len() as f64, "{cases}");
        }
    }

    #[test]
    fn a_heavier_online_session_takes_the_share_back() {
        let mut share = learner();
        // Light for a while, then an online session that needs 0.8 of the device.
        let seen = run(
            &mut share,
            |i| if i < 20_000 { 0.3 } else { 0.8 },
            60_000,
            0.05,
        );
        assert!(seen[19_999] >= 0.6, "{}", seen[19_999]);
        let late = &seen[50_000..];
        assert!(late.iter().filter(|&&s| s <= 0.2 + 1e-9).count() as f64 > 0.9 * late.len() as f64);
    }

    #[test]
    fn bad_samples_change_nothing() {
        let mut share = learner();
        let before = share.clone();
        share.beside(f64::NAN);
        share.beside(-1.0);
        share.clean(0.0);
        assert_eq!(share, before);
    }
}
