//! Protection of online sessions in the scheduler (see [`crate::protection`]): the offline
//! memory share, lanes that never mix classes, online sessions first in admission and
//! taking offline memory, the controller's hold on offline iterations, and the health
//! state machine's admission and eviction of offline sessions.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use super::{Scheduler, Session, State};
use crate::memory::LaneId;
use crate::protection::{
    Controller, DeviceSample, Health, HealthMetrics, HealthState, OfflineShare, ProtectionConfig,
    ProtectionStatus, Window,
};
use crate::session::{SessionClass, SessionId};

/// The scheduler's protection state.
#[derive(Debug, Clone)]
pub(super) struct Protect {
    pub(super) config: ProtectionConfig,
    pub(super) health: Health,
    controller: Controller,
    /// The offline compute share beside online iterations, fixed or learned.
    share: OfflineShare,
    slowdowns: Window,
    /// The same ratio for online iterations with no offline one beside them: how much
    /// online iterations vary by themselves (requests of other sizes, a busy host). A
    /// property of the service and the host, not of the recent window: kept over the
    /// last samples, however old, so that a stretch with offline work beside every
    /// online iteration keeps its reference.
    clean_ratios: Window,
    slo_use: Window,
    device: Option<DeviceSample>,
    /// The offline iteration the hold counts from (when it ended, how long it ran): the
    /// next one waits `ran * (1 - d) / d` for the controller's duty `d` now, so a duty that
    /// recovers shortens a hold already under way.
    held_after: Option<(Duration, Duration)>,
    /// Offline lanes with a ready session that the gate held back.
    pub(super) held: BTreeSet<LaneId>,
    offline_running: usize,
    /// Offline iterations started so far: an online iteration that sees this move while it
    /// runs had an offline one beside it.
    offline_starts: u64,
    /// Online iterations running now, and those of them that run before there is a
    /// clean reference (probing: no offline iteration starts meanwhile).
    online_running: usize,
    probing_running: usize,
    /// An online session waits for memory offline sessions hold: no offline iteration
    /// starts, so that they reach their boundaries and can be suspended.
    pub(super) online_starved: bool,
    evictions: u64,
    /// Since when an online session has waited for memory offline sessions hold.
    starved_since: Option<Duration>,
    /// Offline sessions asked to abandon their running iteration.
    abandoning: BTreeSet<SessionId>,
    abandoned: u64,
    last_online: Option<Duration>,
    started: bool,
    /// The share of the device the running offline iterations were last given (they
    /// all have the same).
    offline_share: f64,
}

impl Protect {
    pub(super) fn new(config: ProtectionConfig) -> Self {
        Protect {
            controller: Controller::new(&config),
            share: OfflineShare::new(&config),
            config,
            health: Health::default(),
            slowdowns: Window::default(),
            clean_ratios: Window::default(),
            slo_use: Window::default(),
            device: None,
            held_after: None,
            held: BTreeSet::new(),
            offline_running: 0,
            offline_starts: 0,
            online_running: 0,
            probing_running: 0,
            online_starved: false,
            evictions: 0,
            starved_since: None,
            abandoning: BTreeSet::new(),
            abandoned: 0,
            last_online: None,
            started: false,
            offline_share: 1.0,
        }
    }
}

/// What the core follows of one online session's iterations.
#[derive(Debug, Clone, Default)]
pub(super) struct Track {
    /// Submission times of its iterations not yet started.
    submitted: VecDeque<Duration>,
    /// Submission time of the iteration running now.
    running_submitted: Option<Duration>,
    /// An offline iteration was running when the iteration running now started.
    overlapped: bool,
    /// The iteration running now is counted among the online iterations running (and
    /// among the probing ones), and `Protect::offline_starts` when it started.
    running: bool,
    probing: bool,
    starts_seen: u64,
    /// The offline share's epoch and `Protect::offline_ends()` when the iteration running
    /// now started beside offline work, `None` when it started alone: it ran at that share
    /// all along if neither moved.
    share_epoch: Option<(u64, u64)>,
    /// Its iterations' duration with no offline iteration beside them (moving average), in
    /// seconds: the reference its slowdown is measured against.
    clean: Option<f64>,
    /// The mean log of those durations over the last [`LOG_MEAN_SAMPLES`] or so, and how
    /// many it weighs: the steadier reference the offline share learns against (the
    /// moving average above follows the last few iterations, and stays where they left it
    /// while every iteration has offline work beside it).
    clean_log: (f64, f64),
}

/// How many clean durations an online session's log mean weighs at most.
const LOG_MEAN_SAMPLES: f64 = 1024.0;

impl Track {
    /// This duration over the session's steady clean reference, once there is one.
    fn over_clean_log(&self, secs: f64) -> Option<f64> {
        let (mean, n) = self.clean_log;
        (n > 0.0 && secs > 0.0).then(|| (secs.ln() - mean).exp())
    }
}

impl Scheduler {
    /// True when classes change scheduling.
    pub(super) fn protecting(&self) -> bool {
        self.protect.config.enabled
    }

    pub(super) fn class_of(&self, id: SessionId) -> SessionClass {
        self.sessions
            .get(&id)
            .map_or(SessionClass::Online, |s| s.spec.class)
    }

    /// Bytes offline sessions hold: their persistent blocks and their lanes.
    pub(super) fn offline_bytes(&self) -> u64 {
        let persistent: u64 = self
            .sessions
            .values()
            .filter(|s| s.spec.class == SessionClass::Offline)
            .filter_map(|s| match s.state {
                State::Admitted { block, .. } => Some(block.size),
                State::Waiting(_) => None,
            })
            .sum();
        let lanes: u64 = self
            .lanes
            .values()
            .filter(|l| l.class == SessionClass::Offline)
            .map(|l| l.size)
            .sum();
        persistent + lanes
    }

    /// The most offline sessions may hold.
    pub(super) fn offline_limit(&self) -> u64 {
        self.protect.config.offline_limit(self.memory.usable())
    }

    /// An iteration was abandoned: it ran for nothing.
    pub(super) fn on_abandoned(&mut self, id: SessionId) {
        if self.protect.abandoning.remove(&id) {
            self.protect.abandoned += 1;
        }
        if self.class_of(id) == SessionClass::Offline {
            self.protect.offline_running = self.protect.offline_running.saturating_sub(1);
        } else if let Some(session) = self.sessions.get_mut(&id) {
            // An online iteration abandoned runs again: it waits at the head of its queue
            // with its submission time, and no longer counts as running.
            let track = &mut session.track;
            if let Some(submitted) = track.running_submitted.take() {
                track.submitted.push_front(submitted);
            }
            if std::mem::take(&mut track.running) {
                self.protect.online_running -= 1;
                self.protect.probing_running -= usize::from(track.probing);
            }
        }
        self.admission_due = true;
    }

    /// Keeps the time since which an online session has waited for offline memory, and
    /// past `abandon_after` asks running offline iterations to stop.
    pub(super) fn abandon_if_overdue(&mut self) {
        if !self.protecting() || !self.protect.online_starved {
            self.protect.starved_since = None;
            return;
        }
        let since = *self.protect.starved_since.get_or_insert(self.now);
        if self.now.saturating_sub(since) < self.protect.config.abandon_after {
            return;
        }
        let running: Vec<SessionId> = self
            .sessions
            .values()
            .filter(|s| s.spec.class == SessionClass::Offline)
            .filter(|s| matches!(s.state, State::Admitted { running: true, .. }))
            .map(|s| s.spec.id)
            .filter(|id| !self.protect.abandoning.contains(id))
            .collect();
        for session in running {
            self.protect.abandoning.insert(session);
            self.actions.push(super::Action::Abandon { session });
        }
    }

    /// A new device sample.
    pub(super) fn on_device_sample(&mut self, sample: DeviceSample) {
        self.protect.device = Some(sample);
        self.evaluate_health();
    }

    /// The operator's switch for offline work.
    pub(super) fn set_offline_enabled(&mut self, enabled: bool) {
        self.protect.health.set_enabled(enabled);
        self.admission_due = true;
        self.evaluate_health();
    }

    /// Moves the health state machine for the metrics now; a change makes admission look
    /// again (to admit or to evict offline sessions).
    pub(super) fn evaluate_health(&mut self) {
        if !self.protecting() {
            return;
        }
        self.protect.started = true;
        let window = self.protect.config.window;
        self.protect.slowdowns.expire(self.now, window);
        self.protect.slo_use.expire(self.now, window);
        let metrics = self.health_metrics();
        let before = self.protect.health.state();
        // Each state's exits are looked at once; a state left now may be left again at
        // once (Overlimit, calm for its period, to Unhealthy, to Healthy).
        let mut state = before;
        for _ in 0..4 {
            let next = self
                .protect
                .health
                .update(self.now, &metrics, &self.protect.config);
            if next == state {
                break;
            }
            state = next;
        }
        if before != state {
            self.admission_due = true;
        }
    }

    fn health_metrics(&self) -> HealthMetrics {
        let min = self.protect.config.min_samples;
        // The device's own load speaks of online work only while there is some: a device
        // busy (or its clock held back by power) with offline work alone harms no one.
        let online = self.protect.online_active(self.now);
        HealthMetrics {
            // Beside offline work against alone, percentile against percentile: online
            // iterations that vary by themselves (requests of other sizes, a noisy host)
            // are no slowdown. Without a percentile of clean iterations there is no
            // slowdown to judge: the raw ratio would read the host's noise as harm.
            online_slowdown: self
                .protect
                .slowdowns
                .p99(min)
                .zip(
                    self.protect
                        .clean_ratios
                        .p99(min)
                        .filter(|&alone| alone > 0.0),
                )
                .map(|(beside, alone)| beside / alone),
            slo_use: self.protect.slo_use.p99(min),
            sm_activity: self
                .protect
                .device
                .and_then(|d| d.sm_activity)
                .filter(|_| online),
            clock_factor: self.protect.clock_factor().filter(|_| online),
        }
    }

    /// True when an offline iteration may start now.
    pub(super) fn offline_gate_open(&self) -> bool {
        if !self.protecting() {
            return true;
        }
        self.protect.health.state().runs_offline()
            && !self.protect.online_starved
            && self.now >= self.protect.hold_until()
            && self.protect.probing_running == 0
    }

    /// Gives held offline lanes back to dispatch once the gate is open.
    pub(super) fn release_held(&mut self) {
        if !self.protect.held.is_empty() && self.offline_gate_open() {
            let held = std::mem::take(&mut self.protect.held);
            self.lanes_due.extend(held);
        }
    }

    /// Under `Overlimit` or `Disabled`: suspends every idle offline session (running ones
    /// follow at their boundary).
    pub(super) fn evict_offline(&mut self) {
        if !self.protecting() || self.protect.health.state().runs_offline() {
            return;
        }
        let idle: Vec<SessionId> = self
            .sessions
            .values()
            .filter(|s| s.spec.class == SessionClass::Offline)
            .filter(|s| {
                matches!(
                    s.state,
                    State::Admitted {
                        running: false,
                        closing: false,
                        ..
                    }
                )
            })
            .map(|s| s.spec.id)
            .collect();
        for id in idle {
            self.suspend(id);
            self.protect.evictions += 1;
        }
    }

    /// For an online session that does not fit: suspends idle offline sessions, those
    /// holding most first, if that makes it fit. True when it was admitted.
    pub(super) fn admit_by_evicting_offline(&mut self, head: SessionId, max_lanes: usize) -> bool {
        let mut victims: Vec<(u64, SessionId)> = self
            .sessions
            .values()
            .filter(|s| s.spec.class == SessionClass::Offline)
            .filter_map(|s| match s.state {
                State::Admitted {
                    running: false,
                    closing: false,
                    block,
                    ..
                } => Some((block.size + s.spec.ephemeral_bytes, s.spec.id)),
                State::Admitted { .. } | State::Waiting(_) => None,
            })
            .collect();
        victims.sort_by_key(|&(bytes, id)| (std::cmp::Reverse(bytes), id));
        let victims: Vec<SessionId> = victims.into_iter().map(|(_, id)| id).collect();
        match self.admit_suspending(head, &victims, max_lanes) {
            Some(evicted) => {
                self.protect.evictions += evicted as u64;
                true
            }
            None => false,
        }
    }

    /// True when an admitted offline session holds memory (and could give it up).
    pub(super) fn offline_holds_memory(&self) -> bool {
        self.sessions.values().any(|s| {
            s.spec.class == SessionClass::Offline && matches!(s.state, State::Admitted { .. })
        })
    }

    /// When the driver must send `Event::Tick` for a decision that depends on time alone:
    /// held offline iterations may start, `Overlimit` may end, or old metrics leave the
    /// window. `None` when nothing waits on time.
    pub fn next_wakeup(&self) -> Option<Duration> {
        if !self.protecting() {
            return None;
        }
        let p = &self.protect;
        let unhealthy = !matches!(p.health.state(), HealthState::Healthy | HealthState::Init);
        let expiries = unhealthy.then(|| {
            let window = p.config.window;
            [
                p.slowdowns.next_expiry(window),
                p.slo_use.next_expiry(window),
            ]
        });
        // Online work falling quiet ends what the device's load says.
        let quiet = p
            .device
            .and(p.last_online)
            .map(|last| last.saturating_add(p.config.window));
        [
            (!p.held.is_empty()).then_some(p.hold_until()),
            quiet,
            p.starved_since
                .map(|since| since.saturating_add(p.config.abandon_after)),
            p.health.leaves_overlimit_at(&p.config),
        ]
        .into_iter()
        .chain(expiries.into_iter().flatten())
        .flatten()
        .filter(|&t| t > self.now)
        .min()
    }

    /// The health state machine's state now (cheap, unlike [`Self::protection_status`]).
    pub fn health(&self) -> HealthState {
        self.protect.health.state()
    }

    /// The protection as status output shows it.
    pub fn protection_status(&self) -> ProtectionStatus {
        let p = &self.protect;
        ProtectionStatus {
            enabled: p.config.enabled,
            health: p.health.state(),
            metrics: self.health_metrics(),
            offline_duty: p.controller.duty(),
            offline_compute_share: p.share.share(),
            offline_compute_share_learned: p.share.learned(),
            offline_held_until: (!p.held.is_empty() && p.hold_until() > self.now)
                .then_some(p.hold_until()),
            offline_bytes: self.offline_bytes(),
            offline_limit: self.offline_limit(),
            offline_evictions: p.evictions,
            offline_abandoned: p.abandoned,
            overlimit_entries: p.health.overlimit_entries(),
        }
    }

    /// The protection's configuration.
    pub fn protection_config(&self) -> &ProtectionConfig {
        &self.protect.config
    }

    /// Starts the state machine at the first event (MuxFlow's Init ends once the device is
    /// up; the core's device is up once it is told anything).
    pub(super) fn start_protection(&mut self) {
        if !self.protect.started {
            self.evaluate_health();
        }
    }
}

impl Scheduler {
    /// Gives the running offline iterations the share of the device they may use now,
    /// when it changed: an online iteration started or the last one ended
    /// (`Action::SetComputeShare`, applied by the device at its next kernel).
    pub(super) fn sync_offline_share(&mut self) {
        if self.protect.offline_running == 0 {
            // Nothing to tell: an offline iteration that starts later gets its share then.
            return;
        }
        let share = self.protect.offline_share_now();
        if share == self.protect.offline_share {
            return;
        }
        self.protect.offline_share = share;
        let running = self
            .lanes
            .values()
            .filter(|lane| lane.class == SessionClass::Offline)
            .filter_map(|lane| lane.running);
        for session in running {
            self.actions.push(super::Action::SetComputeShare {
                session,
                compute_share: share,
            });
        }
    }

    /// Forgets what protection follows of a closing session's iterations.
    pub(super) fn forget_track(&mut self, id: SessionId) {
        let Some(session) = self.sessions.get_mut(&id) else {
            return;
        };
        let track = std::mem::take(&mut session.track);
        if track.running {
            self.protect.online_running -= 1;
            self.protect.probing_running -= usize::from(track.probing);
        }
    }
}

/// What an iteration's end asks of the scheduler besides the protection's own state.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ended {
    /// Admission should look again (an offline session at its boundary can be suspended).
    pub admission_due: bool,
    /// A new slowdown or SLO sample: the health state may move.
    pub evaluate_health: bool,
}

impl Protect {
    /// Offline iterations ended (or abandoned) so far: an online iteration that sees this
    /// move while it runs did not have offline work beside it all along.
    fn offline_ends(&self) -> u64 {
        self.offline_starts
            .saturating_sub(u64::try_from(self.offline_running).unwrap_or(u64::MAX))
    }

    /// Offline iterations do not start before this time.
    fn hold_until(&self) -> Duration {
        self.held_after.map_or(Duration::ZERO, |(end, ran)| {
            end.saturating_add(self.controller.hold_after(ran))
        })
    }

    /// True while an online session has had iterations within the window: offline work
    /// is then held to the controller's duty.
    fn online_active(&self, now: Duration) -> bool {
        self.online_running > 0
            || self
                .last_online
                .is_some_and(|t| now.saturating_sub(t) <= self.config.window)
    }

    fn clock_factor(&self) -> Option<f64> {
        let (clock, highest) = self.device?.sm_clock?;
        Some(self.config.clock_factor(clock, highest))
    }

    /// An iteration of `session` was submitted at `now`.
    pub(super) fn submitted(&mut self, session: &mut Session, now: Duration) {
        if session.spec.class == SessionClass::Online {
            session.track.submitted.push_back(now);
            self.last_online = Some(now);
        }
    }

    /// The share of the device an offline iteration may use now: the offline compute
    /// share while an online iteration runs, else the whole device.
    fn offline_share_now(&self) -> f64 {
        if self.config.enabled && self.online_running > 0 {
            self.share.share()
        } else {
            1.0
        }
    }

    /// Whether an iteration of `session` runs in the background: offline, under
    /// protection.
    pub(super) fn in_background(&self, session: &Session) -> bool {
        self.config.enabled && session.spec.class == SessionClass::Offline
    }

    /// An iteration of `session` starts: the share of the device's compute it may use.
    /// An offline iteration gets the offline share while an online iteration runs (and
    /// the whole device otherwise: [`Scheduler::sync_offline_share`] follows the online
    /// work as it starts and ends), and an online iteration that starts while offline
    /// ones run gets the rest, so that the two never ask for more than the device (on
    /// the cpu device, more threads than cores); on a device with a background priority
    /// it keeps the whole device, the offline iterations yielding to it.
    pub(super) fn started(&mut self, session: &mut Session) -> f64 {
        match session.spec.class {
            SessionClass::Offline => {
                self.offline_running += 1;
                self.offline_starts += 1;
                self.offline_share = self.offline_share_now();
                self.offline_share
            }
            SessionClass::Online => {
                let track = &mut session.track;
                track.running_submitted = track.submitted.pop_front();
                track.overlapped = self.offline_running > 0;
                track.starts_seen = self.offline_starts;
                track.share_epoch = track
                    .overlapped
                    .then_some((self.share.epoch(), self.offline_ends()));
                track.running = true;
                // Until the session has a clean reference and the clean ratios a
                // percentile, online iterations run without new offline ones beside them.
                track.probing = track.clean.is_none()
                    || self.clean_ratios.len() < self.config.min_samples.max(1);
                self.online_running += 1;
                self.probing_running += usize::from(track.probing);
                let offline = self.share.share();
                if self.config.enabled
                    && !self.config.background_priority
                    && self.offline_running > 0
                    && offline < 1.0
                {
                    1.0 - offline
                } else {
                    1.0
                }
            }
        }
    }

    /// An iteration of `session` (`id`) finished at `now` after `duration`.
    pub(super) fn finished(
        &mut self,
        session: &mut Session,
        id: SessionId,
        duration: Duration,
        now: Duration,
    ) -> Ended {
        let mut ended = Ended::default();
        match session.spec.class {
            SessionClass::Offline => {
                self.abandoning.remove(&id);
                self.offline_running = self.offline_running.saturating_sub(1);
                if self.online_active(now) {
                    let this = (now, duration);
                    let later =
                        |(end, ran): (Duration, Duration)| end + self.controller.hold_after(ran);
                    if self
                        .held_after
                        .is_none_or(|last| later(this) >= later(last))
                    {
                        self.held_after = Some(this);
                    }
                }
                // At its boundary it can be suspended for the online session.
                ended.admission_due = self.online_starved || !self.health.state().runs_offline();
            }
            SessionClass::Online => {
                self.last_online = Some(now);
                let track = &mut session.track;
                if track.running {
                    self.online_running -= 1;
                    self.probing_running -= usize::from(track.probing);
                }
                track.running = false;
                // An offline iteration beside it at its start, or one started meanwhile.
                track.overlapped |= track.starts_seen != self.offline_starts;
                let secs = duration.as_secs_f64();
                // An iteration with no offline iteration beside it measures no
                // interference: it updates the reference and tells the controller all is
                // well; only one beside offline work is a slowdown sample (so that noise
                // of a busy host alone never evicts offline work).
                let ratio = track.clean.filter(|&c| c > 0.0).map(|c| secs / c);
                let slowdown = if track.overlapped {
                    // Only an iteration that ran beside offline work at the share now, all
                    // along, teaches the share.
                    let all_along = Some((self.share.epoch(), self.offline_ends()));
                    if track.share_epoch == all_along
                        && let Some(steady) = track.over_clean_log(secs)
                    {
                        self.share.beside(steady);
                    }
                    ratio
                } else {
                    if let Some(ratio) = ratio {
                        self.clean_ratios.push(now, ratio);
                    }
                    if let Some(steady) = track.over_clean_log(secs) {
                        self.share.clean(steady);
                    }
                    if secs > 0.0 {
                        let (mean, n) = &mut track.clean_log;
                        *n = (*n + 1.0).min(LOG_MEAN_SAMPLES);
                        *mean += (secs.ln() - *mean) / *n;
                    }
                    track.clean = Some(match track.clean {
                        Some(c) => 0.8 * c + 0.2 * secs,
                        None => secs,
                    });
                    None
                };
                let clean = !track.overlapped;
                let submitted = track.running_submitted.take();
                // SLO use, like the slowdown, is evidence against offline work only
                // where offline work ran beside the iteration: a service that misses its
                // SLO alone (its own peak load) is not hurt by offline work, and holding
                // offline sessions out then only loses their work.
                let slo = session.spec.hints.slo.filter(|s| !s.is_zero());
                let slo_sample = submitted
                    .zip(slo)
                    .filter(|_| !clean)
                    .map(|(submitted, slo)| {
                        now.saturating_sub(submitted).as_secs_f64() / slo.as_secs_f64()
                    });
                if let Some(used) = slo_sample {
                    self.slo_use.push(now, used);
                }
                if let Some(slowdown) = slowdown {
                    self.slowdowns.push(now, slowdown);
                }
                if let Some(slowdown) = slowdown.or(clean.then_some(1.0)) {
                    // Equation 1 with the online slowdown in place of SM activity: the
                    // load the controller steers. One iteration says at most the unhealthy
                    // slowdown: past it is the tail, which the health machine judges
                    // against the clean iterations' own tail. A host's hiccup (a 1 ms
                    // request taking 5 ms, with offline work beside it or not) would
                    // otherwise drive the duty to its floor, and it took a second to
                    // recover from each (the CPU device on a shared two-core host sat
                    // below half its duty a quarter of the time with no mean slowdown).
                    let slowdown = slowdown.min(self.config.thresholds.online_slowdown.unhealthy);
                    let load = slowdown * self.clock_factor().unwrap_or(1.0);
                    self.controller.step(load, &self.config);
                }
                // Only a new slowdown or SLO sample can move the health state here; the
                // windows' expiry is looked at when the core wakes (`next_wakeup`).
                ended.evaluate_health = slowdown.is_some() || slo_sample.is_some();
            }
        }
        ended
    }
}
