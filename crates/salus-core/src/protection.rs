//! Protection of online sessions from offline ones: MuxFlow's two levels inside the core.
//!
//! A session is [`SessionClass::Online`] (latency matters: serving, or any job that did not
//! say otherwise) or [`SessionClass::Offline`] (best effort, e.g. training that may use
//! what the online sessions leave). MuxFlow protects online work from outside the
//! framework, by intercepting CUDA calls; the core decides every admission and every
//! iteration start, so it protects exactly:
//!
//! - **Memory.** Offline sessions together hold at most a share of the device
//!   ([`ProtectionConfig::offline_memory_share`], 40% as in MuxFlow). They never share a
//!   lane with online sessions, so an online iteration never waits behind an offline one.
//!   An online session that needs memory offline sessions hold takes it: idle offline
//!   sessions are suspended to host memory, running ones at their iteration boundary
//!   (no offline iteration starts while an online session waits for memory).
//! - **Compute, workload level** ([`Controller`], MuxFlow's xCUDA, Eq. 1-2): a PID
//!   controller turns the online sessions' measured slowdown (times the SM clock factor
//!   of Eq. 2 where the device reports its clock) into the offline duty: the fraction of
//!   time offline iterations may run. After an offline iteration of length `d`, the next
//!   offline iteration waits `d * (1 - duty) / duty`.
//! - **Compute, device level** ([`Health`], MuxFlow's SysMonitor): five states driven by
//!   thresholds on the slowdown and SLO use of online iterations that ran beside offline
//!   ones (what offline work may have caused) and the device's SM activity and clock.
//!   Offline sessions are admitted only while `Healthy`, stopped and evicted while
//!   `Overlimit` (which lasts a period doubling with each entry in the last two hours) or
//!   `Disabled` (the operator's switch).
//!
//! Everything here is deterministic arithmetic on the times and durations the driver
//! reports; the scheduler glue is in `scheduler/protect.rs`.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::session::SessionClass;
pub use share::OfflineShare;

mod share;

/// How online sessions are protected from offline ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProtectionConfig {
    /// When false, classes change nothing: offline sessions are scheduled like online
    /// ones (the "without protection" baseline).
    pub enabled: bool,
    /// The most of `C - reserve` offline sessions may hold together (persistent bytes and
    /// their lanes), in (0, 1].
    pub offline_memory_share: f64,
    /// The controller's setpoint: the online load (slowdown x clock factor) it steers to.
    pub target_load: f64,
    /// The controller's gains.
    pub gains: PidGains,
    /// The offline duty the controller starts from and never goes below, in (0, 1].
    pub initial_duty: f64,
    /// The lowest offline duty while online sessions are active.
    pub min_duty: f64,
    /// The share of the device's compute an offline iteration may use while an online
    /// iteration runs, in [0, 1] (MuxFlow's SM percentage for offline work; a CPU device
    /// gives it that share of its cores, the others stay free for online work; 0 holds it
    /// between two kernels). While no online iteration runs it may use the whole device:
    /// the share follows the online work at kernel granularity
    /// ([`crate::Action::SetComputeShare`]).
    pub offline_compute_share: f64,
    /// The share is learned ([`OfflineShare`], MuxFlow's dynamic SM allocation), starting
    /// from `offline_compute_share`: the most offline work may use beside online
    /// iterations without slowing them. Off where the operator or the device fixes the
    /// share.
    #[serde(default = "learned_by_default")]
    pub dynamic_compute_share: bool,
    /// The device runs offline iterations at a priority below online ones, on the compute
    /// online work leaves (`Action::StartIteration`'s `background`; the cpu device runs
    /// them on threads the OS schedules only on otherwise idle cores). Online iterations
    /// then keep the whole device while offline ones run; without it they get the rest of
    /// `offline_compute_share`. Set from the device, not by the operator.
    #[serde(default)]
    pub background_priority: bool,
    /// Percentiles of online latency and slowdown are judged only over at least this
    /// many samples in the window, and online iterations wait for as many clean ones
    /// before offline work runs beside them: one slow iteration is not a 99th
    /// percentile. By nearest rank, the 99th percentile of fewer than 100 samples is
    /// their largest: one iteration the host paused would be the metric.
    pub min_samples: usize,
    /// How long an online session waits for memory offline sessions hold before their
    /// running iterations are abandoned (they run again later, from the same state).
    pub abandon_after: Duration,
    /// Health metrics are taken over this much recent time; an online session without an
    /// iteration for this long is dormant and does not hold offline work back.
    pub window: Duration,
    /// Thresholds of the health state machine.
    pub thresholds: HealthThresholds,
    /// The shortest time `Overlimit` lasts once every metric is below its threshold; it
    /// doubles with each entry into `Overlimit` within `overlimit_history`.
    pub overlimit_hold: Duration,
    /// How far back entries into `Overlimit` count (MuxFlow: two hours).
    pub overlimit_history: Duration,
    /// Equation 2: the SM clock below which the clock factor rises, as a fraction of the
    /// highest clock.
    pub clock_threshold: f64,
    /// Equation 2: `a_L`, the weight of a clock below the threshold.
    pub clock_low_weight: f64,
    /// Equation 2: `a_H`, the weight of a clock above the threshold.
    pub clock_high_weight: f64,
}

impl Default for ProtectionConfig {
    fn default() -> Self {
        ProtectionConfig {
            enabled: true,
            offline_memory_share: 0.4,
            target_load: 1.05,
            gains: PidGains {
                kp: 0.6,
                ki: 0.15,
                kd: 0.05,
            },
            initial_duty: 0.5,
            min_duty: 0.02,
            offline_compute_share: 0.3,
            dynamic_compute_share: true,
            background_priority: false,
            min_samples: 100,
            abandon_after: Duration::from_millis(200),
            window: Duration::from_secs(10),
            thresholds: HealthThresholds::default(),
            overlimit_hold: Duration::from_secs(5),
            overlimit_history: Duration::from_secs(2 * 3600),
            clock_threshold: 0.9,
            clock_low_weight: 4.0,
            clock_high_weight: 0.2,
        }
    }
}

fn learned_by_default() -> bool {
    true
}

impl ProtectionConfig {
    /// Classes change nothing: the baseline without protection.
    pub fn disabled() -> Self {
        ProtectionConfig {
            enabled: false,
            ..ProtectionConfig::default()
        }
    }

    /// Checks every value; the message names the first that is out of range.
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, v: f64| {
            if v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(format!("{name} must be in (0, 1], got {v}"))
            }
        };
        unit("offline_memory_share", self.offline_memory_share)?;
        unit("initial_duty", self.initial_duty)?;
        unit("min_duty", self.min_duty)?;
        if !(0.0..=1.0).contains(&self.offline_compute_share) {
            return Err(format!(
                "offline_compute_share must be in [0, 1], got {}",
                self.offline_compute_share
            ));
        }
        if self.dynamic_compute_share
            && !(self.offline_compute_share > 0.0 && self.offline_compute_share < 1.0)
        {
            return Err(format!(
                "dynamic_compute_share learns a share from offline_compute_share in (0, 1), \
                 got {}: set dynamic_compute_share to false to fix the share",
                self.offline_compute_share
            ));
        }
        unit("clock_threshold", self.clock_threshold)?;
        if self.min_duty > self.initial_duty {
            return Err(format!(
                "min_duty ({}) must not exceed initial_duty ({})",
                self.min_duty, self.initial_duty
            ));
        }
        if !(self.target_load >= 1.0 && self.target_load.is_finite()) {
            return Err(format!(
                "target_load must be at least 1, got {}",
                self.target_load
            ));
        }
        for (name, v) in [
            ("kp", self.gains.kp),
            ("ki", self.gains.ki),
            ("kd", self.gains.kd),
            ("clock_low_weight", self.clock_low_weight),
            ("clock_high_weight", self.clock_high_weight),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} must be finite and at least 0, got {v}"));
            }
        }
        if self.window.is_zero() {
            return Err("window must be longer than zero".into());
        }
        self.thresholds.validate()
    }

    /// The bytes offline sessions may hold together on a device with `usable` bytes.
    pub fn offline_limit(&self, usable: u64) -> u64 {
        if !self.enabled {
            return usable;
        }
        // Exact for every realistic size: f64 holds integers to 2^53.
        ((usable as f64) * self.offline_memory_share).floor() as u64
    }

    /// MuxFlow's Equation 2: the clock factor `a_C` for an SM clock of `clock` out of
    /// `highest`: above 1 when the clock is below the threshold (the device is loaded),
    /// below 1 when it is above.
    pub fn clock_factor(&self, clock: f64, highest: f64) -> f64 {
        if !(highest > 0.0 && clock >= 0.0) {
            return 1.0;
        }
        let threshold = self.clock_threshold * highest;
        if clock < threshold {
            1.0 + self.clock_low_weight * (threshold - clock) / threshold
        } else if highest > threshold {
            1.0 - self.clock_high_weight * (clock - threshold) / (highest - threshold)
        } else {
            1.0
        }
    }
}

/// The gains of the PID controller (velocity form, one step per online iteration).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PidGains {
    /// Proportional.
    pub kp: f64,
    /// Integral.
    pub ki: f64,
    /// Derivative.
    pub kd: f64,
}

/// One metric's thresholds: below `healthy` it is healthy, from `unhealthy` on it makes
/// the device unhealthy, from `overlimit` on overloaded. `healthy <= unhealthy <=
/// overlimit`; an infinite threshold is never reached.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Below this, healthy.
    pub healthy: f64,
    /// From this on, unhealthy.
    pub unhealthy: f64,
    /// From this on, overlimit.
    pub overlimit: f64,
}

impl Thresholds {
    fn validate(&self, name: &str) -> Result<(), String> {
        if self.healthy <= self.unhealthy && self.unhealthy <= self.overlimit && self.healthy > 0.0
        {
            Ok(())
        } else {
            Err(format!(
                "{name} thresholds must satisfy 0 < healthy <= unhealthy <= overlimit, got \
                 {} / {} / {}",
                self.healthy, self.unhealthy, self.overlimit
            ))
        }
    }
}

/// The health state machine's thresholds, per metric ([`HealthMetrics`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HealthThresholds {
    /// 99th percentile of the slowdown of online iterations that ran beside offline ones
    /// (duration against the same session's iterations with no offline iteration beside
    /// them), over the same percentile of the iterations with none beside them.
    pub online_slowdown: Thresholds,
    /// 99th percentile of online latency (submission to finish) over the session's SLO,
    /// of the iterations that ran beside offline ones.
    pub slo_use: Thresholds,
    /// SM activity reported by the device, 0 to 1.
    pub sm_activity: Thresholds,
    /// Equation 2's clock factor from the SM clock the device reports.
    pub clock_factor: Thresholds,
}

impl Default for HealthThresholds {
    fn default() -> Self {
        HealthThresholds {
            online_slowdown: Thresholds {
                healthy: 1.3,
                unhealthy: 1.6,
                overlimit: 3.0,
            },
            slo_use: Thresholds {
                healthy: 0.8,
                unhealthy: 1.0,
                overlimit: 1.5,
            },
            sm_activity: Thresholds {
                healthy: 0.9,
                unhealthy: 0.97,
                overlimit: f64::INFINITY,
            },
            clock_factor: Thresholds {
                healthy: 1.1,
                unhealthy: 1.3,
                overlimit: 2.0,
            },
        }
    }
}

impl HealthThresholds {
    fn validate(&self) -> Result<(), String> {
        self.online_slowdown.validate("online_slowdown")?;
        self.slo_use.validate("slo_use")?;
        self.sm_activity.validate("sm_activity")?;
        self.clock_factor.validate("clock_factor")
    }
}

/// What the device reports about itself (a GPU, through NVML); `None` where unknown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceSample {
    /// Fraction of time and SMs busy, 0 to 1.
    pub sm_activity: Option<f64>,
    /// The SM clock now and the highest it reaches, in MHz.
    pub sm_clock: Option<(f64, f64)>,
}

/// SysMonitor's five states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    /// Before the first event: nothing is decided yet.
    #[default]
    Init,
    /// Offline sessions are admitted and run.
    Healthy,
    /// Online work may be suffering: no offline session is admitted; admitted ones run
    /// under the controller.
    Unhealthy,
    /// The device is overloaded: offline iterations stop and offline sessions are evicted
    /// to host memory until the state has been below every overlimit threshold for its
    /// period.
    Overlimit,
    /// The operator disabled offline work: none runs and offline sessions are evicted.
    Disabled,
}

impl HealthState {
    /// Its name in status output.
    pub fn name(self) -> &'static str {
        match self {
            HealthState::Init => "init",
            HealthState::Healthy => "healthy",
            HealthState::Unhealthy => "unhealthy",
            HealthState::Overlimit => "overlimit",
            HealthState::Disabled => "disabled",
        }
    }

    /// True when offline sessions may be admitted.
    pub fn admits_offline(self) -> bool {
        matches!(self, HealthState::Healthy | HealthState::Init)
    }

    /// True when offline iterations may start.
    pub fn runs_offline(self) -> bool {
        !matches!(self, HealthState::Overlimit | HealthState::Disabled)
    }
}

impl fmt::Display for HealthState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The metrics the state machine reads, over the recent window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HealthMetrics {
    /// 99th percentile of online slowdown, when online iterations ran.
    pub online_slowdown: Option<f64>,
    /// 99th percentile of online latency over SLO, for sessions with an SLO, of the
    /// iterations that ran beside offline ones.
    pub slo_use: Option<f64>,
    /// The device's SM activity.
    pub sm_activity: Option<f64>,
    /// Equation 2's clock factor.
    pub clock_factor: Option<f64>,
}

/// How bad the worst metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Healthy,
    Between,
    Unhealthy,
    Overlimit,
}

impl HealthMetrics {
    fn level(&self, t: &HealthThresholds) -> Level {
        let of = |v: Option<f64>, t: Thresholds| match v {
            Some(v) if v >= t.overlimit => Level::Overlimit,
            Some(v) if v >= t.unhealthy => Level::Unhealthy,
            Some(v) if v >= t.healthy => Level::Between,
            _ => Level::Healthy,
        };
        [
            of(self.online_slowdown, t.online_slowdown),
            of(self.slo_use, t.slo_use),
            of(self.sm_activity, t.sm_activity),
            of(self.clock_factor, t.clock_factor),
        ]
        .into_iter()
        .max()
        .unwrap_or(Level::Healthy)
    }
}

/// SysMonitor: the five-state machine and its Overlimit back-off.
#[derive(Debug, Clone, Default)]
pub struct Health {
    state: HealthState,
    /// Times `Overlimit` was entered, oldest first, within the history.
    entries: VecDeque<Duration>,
    /// While `Overlimit`: since when every metric has been below the overlimit thresholds.
    calm_since: Option<Duration>,
    /// The state to return to when the operator enables offline work again.
    disabled: bool,
}

impl Health {
    /// The state now.
    pub fn state(&self) -> HealthState {
        self.state
    }

    /// Entries into `Overlimit` within the history.
    pub fn overlimit_entries(&self) -> usize {
        self.entries.len()
    }

    /// How long `Overlimit` lasts once calm: the hold doubled per earlier entry in the
    /// history (the exponential back-off of MuxFlow's SysMonitor).
    pub fn overlimit_period(&self, config: &ProtectionConfig) -> Duration {
        let doublings = u32::try_from(self.entries.len().saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(16);
        config.overlimit_hold.saturating_mul(1 << doublings)
    }

    /// When `Overlimit` ends if the metrics stay calm; `None` in other states or while a
    /// metric is over its overlimit threshold.
    pub fn leaves_overlimit_at(&self, config: &ProtectionConfig) -> Option<Duration> {
        (self.state == HealthState::Overlimit)
            .then_some(self.calm_since?)
            .map(|calm| calm.saturating_add(self.overlimit_period(config)))
    }

    /// The operator's switch: `false` disables offline work until it is enabled again.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.disabled = !enabled;
        if self.disabled {
            self.state = HealthState::Disabled;
        } else if self.state == HealthState::Disabled {
            self.state = HealthState::Unhealthy;
        }
    }

    /// Moves the machine for the metrics at `now`; returns the new state.
    pub fn update(
        &mut self,
        now: Duration,
        metrics: &HealthMetrics,
        config: &ProtectionConfig,
    ) -> HealthState {
        while self
            .entries
            .front()
            .is_some_and(|&t| now.saturating_sub(t) > config.overlimit_history)
        {
            self.entries.pop_front();
        }
        if self.disabled {
            self.state = HealthState::Disabled;
            return self.state;
        }
        let level = metrics.level(&config.thresholds);
        self.state = match (self.state, level) {
            (HealthState::Overlimit, Level::Overlimit) => {
                self.calm_since = None;
                HealthState::Overlimit
            }
            (HealthState::Overlimit, _) => {
                let calm = *self.calm_since.get_or_insert(now);
                if now.saturating_sub(calm) >= self.overlimit_period(config) {
                    self.calm_since = None;
                    HealthState::Unhealthy
                } else {
                    HealthState::Overlimit
                }
            }
            (_, Level::Overlimit) => {
                self.entries.push_back(now);
                self.calm_since = None;
                HealthState::Overlimit
            }
            (_, Level::Unhealthy) => HealthState::Unhealthy,
            (HealthState::Init | HealthState::Healthy, _) => HealthState::Healthy,
            (HealthState::Unhealthy, Level::Healthy) => HealthState::Healthy,
            (state, _) => state,
        };
        self.state
    }
}

/// MuxFlow's workload-level control (xCUDA, Eq. 1-2) at iteration granularity: a PID
/// controller from the online load to the offline duty.
#[derive(Debug, Clone, PartialEq)]
pub struct Controller {
    duty: f64,
    /// The duty averaged over recent steps (an exponential moving average), which the
    /// hold follows: the hold is convex in the duty, so following each noisy step would
    /// hold offline work longer on average than the average duty says.
    smoothed: f64,
    /// The load averaged over recent steps (an exponential moving average): the
    /// measurement the PID steers. One iteration's slowdown is mostly the size of its own
    /// request (a 20% spread against a setpoint 5% above 1), which the proportional and
    /// derivative terms would pass on to the duty, and the duty's clamp at 1 would turn
    /// into a lower average duty than the integral asks for.
    load: Option<f64>,
    /// The last two errors, newest first.
    errors: [f64; 2],
    steps: u64,
}

impl Controller {
    /// A controller at the configured initial duty.
    pub fn new(config: &ProtectionConfig) -> Self {
        Controller {
            duty: config.initial_duty,
            smoothed: config.initial_duty,
            load: None,
            errors: [0.0; 2],
            steps: 0,
        }
    }

    /// The fraction of time offline iterations may run while online sessions are active.
    pub fn duty(&self) -> f64 {
        self.duty
    }

    /// One step for an online iteration whose load (slowdown x clock factor, Eq. 1) was
    /// `load`: velocity-form PID on the load's moving average (about ten steps) towards
    /// the setpoint; returns the new duty.
    pub fn step(&mut self, load: f64, config: &ProtectionConfig) -> f64 {
        if !load.is_finite() {
            return self.duty;
        }
        let load = match self.load {
            Some(average) => average + 0.1 * (load - average),
            None => load,
        };
        self.load = Some(load);
        let error = config.target_load - load;
        let [e1, e2] = if self.steps == 0 {
            [error, error]
        } else {
            self.errors
        };
        let g = config.gains;
        let delta = g.kp * (error - e1) + g.ki * error + g.kd * (error - 2.0 * e1 + e2);
        if delta.is_finite() {
            self.duty = (self.duty + delta).clamp(config.min_duty, 1.0);
            self.smoothed += 0.1 * (self.duty - self.smoothed);
        }
        self.errors = [error, e1];
        self.steps += 1;
        self.duty
    }

    /// The duty averaged over the last steps (about ten), which the hold follows.
    pub fn smoothed_duty(&self) -> f64 {
        self.smoothed
    }

    /// How long the next offline iteration waits after one of `ran`: `ran * (1 - d) / d`
    /// for the smoothed duty `d`, so offline iterations take `d` of the time.
    pub fn hold_after(&self, ran: Duration) -> Duration {
        ran.mul_f64((1.0 - self.smoothed) / self.smoothed)
    }
}

/// Samples over a sliding window of time, for percentiles. Its memory is taken once: a
/// daemon's live bytes do not grow with the iterations it has run.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    samples: VecDeque<(Duration, f64)>,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            samples: VecDeque::with_capacity(Self::MAX),
        }
    }
}

impl Window {
    /// The most samples kept; older ones go first.
    const MAX: usize = 2048;

    pub(crate) fn push(&mut self, now: Duration, value: f64) {
        if self.samples.len() == Self::MAX {
            self.samples.pop_front();
        }
        self.samples.push_back((now, value));
    }

    pub(crate) fn expire(&mut self, now: Duration, window: Duration) {
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) > window)
        {
            self.samples.pop_front();
        }
    }

    /// When the oldest sample leaves the window.
    pub(crate) fn next_expiry(&self, window: Duration) -> Option<Duration> {
        self.samples
            .front()
            .map(|&(t, _)| t.saturating_add(window) + Duration::from_nanos(1))
    }

    /// Samples kept.
    pub(crate) fn len(&self) -> usize {
        self.samples.len()
    }

    /// The 99th percentile (nearest rank), if at least `min` samples are in the window.
    pub(crate) fn p99(&self, min: usize) -> Option<f64> {
        if self.samples.len() < min.max(1) {
            return None;
        }
        let mut values: Vec<f64> = self.samples.iter().map(|&(_, v)| v).collect();
        let rank = (values.len() * 99).div_ceil(100).max(1) - 1;
        let (_, v, _) = values.select_nth_unstable_by(rank, f64::total_cmp);
        Some(*v)
    }
}

/// What `salusctl status` and the metrics show of the protection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProtectionStatus {
    /// Whether classes change anything.
    pub enabled: bool,
    /// SysMonitor's state.
    pub health: HealthState,
    /// The metrics the state was decided on.
    pub metrics: HealthMetrics,
    /// The controller's offline duty, 0 to 1.
    pub offline_duty: f64,
    /// The share of the device an offline iteration may use while an online one runs.
    pub offline_compute_share: f64,
    /// Whether that share is learned ([`OfflineShare`]) or fixed.
    pub offline_compute_share_learned: bool,
    /// Offline iterations wait until then (core time), if they are held.
    pub offline_held_until: Option<Duration>,
    /// Bytes offline sessions hold (persistent and their lanes).
    pub offline_bytes: u64,
    /// The most they may hold.
    pub offline_limit: u64,
    /// Offline sessions evicted to host memory by protection since start.
    pub offline_evictions: u64,
    /// Offline iterations abandoned for an online session that waited past the deadline.
    pub offline_abandoned: u64,
    /// Entries into `Overlimit` in the history window.
    pub overlimit_entries: usize,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn defaults_are_valid_and_bad_values_are_named() {
        ProtectionConfig::default().validate().unwrap();
        let bad = ProtectionConfig {
            offline_memory_share: 1.5,
            ..ProtectionConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("offline_memory_share"));
        let mut bad = ProtectionConfig::default();
        bad.thresholds.slo_use.healthy = 2.0;
        assert!(bad.validate().unwrap_err().contains("slo_use"));
    }

    #[test]
    fn clock_factor_follows_equation_2() {
        let c = ProtectionConfig::default();
        // At the threshold: 1. Below: 1 + a_L (T - C) / T. Above: 1 - a_H (C - T) / (C_H - T).
        assert_eq!(c.clock_factor(900.0, 1000.0), 1.0);
        assert!((c.clock_factor(450.0, 1000.0) - 3.0).abs() < 1e-12);
        assert!((c.clock_factor(1000.0, 1000.0) - 0.8).abs() < 1e-12);
        assert!((c.clock_factor(950.0, 1000.0) - 0.9).abs() < 1e-12);
        assert_eq!(c.clock_factor(500.0, 0.0), 1.0);
    }

    #[test]
    fn the_duty_does_not_follow_the_spread_of_single_iterations() {
        // Requests of other sizes: slowdown samples spread 20% around a mean below the
        // setpoint. The duty stays at the top instead of swinging with each sample.
        let c = ProtectionConfig::default();
        let mut pid = Controller::new(&c);
        let mut sum = 0.0;
        for i in 0..400 {
            let duty = pid.step(if i % 2 == 0 { 0.8 } else { 1.2 }, &c);
            if i >= 200 {
                sum += duty;
            }
        }
        assert!(sum / 200.0 > 0.99, "{}", sum / 200.0);
    }

    #[test]
    fn the_controller_backs_off_under_load_and_recovers() {
        let c = ProtectionConfig::default();
        let mut pid = Controller::new(&c);
        assert_eq!(pid.duty(), 0.5);
        for _ in 0..20 {
            pid.step(1.5, &c);
        }
        assert_eq!(
            pid.duty(),
            c.min_duty,
            "a persistent 1.5x slowdown drives it down"
        );
        for _ in 0..400 {
            pid.step(1.0, &c);
        }
        assert_eq!(pid.duty(), 1.0, "clean online iterations let it back up");
        assert!(pid.hold_after(s(1.0)) < Duration::from_micros(1));
        for _ in 0..3 {
            pid.step(2.0, &c);
        }
        assert!(pid.duty() < 1.0);
        let d = pid.duty();
        // The hold follows the duty's moving average, which lags the duty.
        let m = pid.smoothed_duty();
        assert!(m > d, "{m} {d}");
        let hold = pid.hold_after(s(0.1)).as_secs_f64();
        assert!((hold - 0.1 * (1.0 - m) / m).abs() < 1e-9);
        // Not a number changes nothing.
        pid.step(f64::NAN, &c);
        assert_eq!(pid.duty(), d);
        assert_eq!(pid.smoothed_duty(), m);
    }

    fn metrics(slowdown: f64) -> HealthMetrics {
        HealthMetrics {
            online_slowdown: Some(slowdown),
            ..HealthMetrics::default()
        }
    }

    #[test]
    fn health_walks_muxflows_states() {
        let mut c = ProtectionConfig::default();
        c.thresholds.online_slowdown = Thresholds {
            healthy: 1.15,
            unhealthy: 1.3,
            overlimit: 2.0,
        };
        let mut h = Health::default();
        assert_eq!(h.state(), HealthState::Init);
        assert_eq!(h.update(s(0.0), &metrics(1.0), &c), HealthState::Healthy);
        // Between healthy and unhealthy: stays healthy.
        assert_eq!(h.update(s(1.0), &metrics(1.2), &c), HealthState::Healthy);
        assert_eq!(h.update(s(2.0), &metrics(1.4), &c), HealthState::Unhealthy);
        // Between: stays unhealthy (hysteresis).
        assert_eq!(h.update(s(3.0), &metrics(1.2), &c), HealthState::Unhealthy);
        assert_eq!(h.update(s(4.0), &metrics(1.1), &c), HealthState::Healthy);
        // Straight to overlimit.
        assert_eq!(h.update(s(5.0), &metrics(2.5), &c), HealthState::Overlimit);
        assert_eq!(h.overlimit_entries(), 1);
        // Calm from 6 s; the first period is the hold, 5 s.
        assert_eq!(h.update(s(6.0), &metrics(1.0), &c), HealthState::Overlimit);
        assert_eq!(h.leaves_overlimit_at(&c), Some(s(11.0)));
        assert_eq!(h.update(s(10.9), &metrics(1.0), &c), HealthState::Overlimit);
        assert_eq!(h.update(s(11.0), &metrics(1.0), &c), HealthState::Unhealthy);
        assert_eq!(h.update(s(12.0), &metrics(1.0), &c), HealthState::Healthy);
        // A second entry within two hours doubles the period; a relapse restarts calm.
        assert_eq!(h.update(s(20.0), &metrics(3.0), &c), HealthState::Overlimit);
        assert_eq!(h.overlimit_period(&c), s(10.0));
        h.update(s(21.0), &metrics(1.0), &c);
        h.update(s(25.0), &metrics(2.1), &c);
        assert_eq!(h.leaves_overlimit_at(&c), None);
        h.update(s(26.0), &metrics(1.0), &c);
        assert_eq!(h.update(s(35.9), &metrics(1.0), &c), HealthState::Overlimit);
        assert_eq!(h.update(s(36.0), &metrics(1.0), &c), HealthState::Unhealthy);
        // Entries older than two hours no longer count.
        assert_eq!(h.update(s(7300.0), &metrics(1.0), &c), HealthState::Healthy);
        assert_eq!(h.overlimit_entries(), 0);
        // The operator's switch.
        h.set_enabled(false);
        assert_eq!(
            h.update(s(7301.0), &metrics(1.0), &c),
            HealthState::Disabled
        );
        h.set_enabled(true);
        assert_eq!(h.state(), HealthState::Unhealthy);
        assert_eq!(h.update(s(7302.0), &metrics(1.0), &c), HealthState::Healthy);
    }

    #[test]
    fn window_percentile_and_expiry() {
        let mut w = Window::default();
        assert_eq!(w.p99(1), None);
        for i in 0..100 {
            w.push(s(f64::from(i) * 0.1), f64::from(i));
        }
        assert_eq!(w.p99(1), Some(98.0));
        assert_eq!(w.p99(101), None);
        w.expire(s(9.9), s(1.0));
        assert_eq!(w.samples.len(), 11);
        assert_eq!(
            w.next_expiry(s(1.0)),
            Some(s(9.9) + Duration::from_nanos(1))
        );
    }
}
