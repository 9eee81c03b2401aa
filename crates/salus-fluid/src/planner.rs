//! The planner: StaticFluid and DynamicFluid over a set of devices, as a state machine.
//!
//! Events in: a TrialGroup submitted, a trial's remaining runtime updated, a trial
//! finished (or stopped by its algorithm). Actions out: place a trial (a share of one
//! device, or whole devices) and resize a running one. A resize takes effect at the
//! trial's next iteration boundary and costs the driver the rescale time `epsilon`;
//! the planner counts the new devices as the trial's from the moment it decides.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::degree::RuntimeModel;
use crate::plan::{TrialId, Width, dynamic_target, static_widths};

/// How the planner decides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Devices of the tuning job.
    pub devices: usize,
    /// Runtime at each width; its lengths are the packing degree `c` and scaling degree `d`.
    pub model: RuntimeModel,
    /// `epsilon` of Algorithm 3.2: seconds a trial loses when its width changes
    /// (checkpoint, restart on the new devices).
    pub rescale_cost_s: f64,
    /// Run DynamicFluid when resources free up; `false` is StaticFluid alone.
    pub dynamic: bool,
}

impl PlannerConfig {
    /// No sharing overheads (Eq. 3.2 with `alpha = beta = 1`), no rescale cost, DynamicFluid
    /// on: the setting of Theorem 1.
    pub fn ideal(devices: usize, c: usize, d: usize) -> Self {
        PlannerConfig {
            devices,
            model: RuntimeModel::from_overheads(c, d, 1.0, 1.0),
            rescale_cost_s: 0.0,
            dynamic: true,
        }
    }
}

/// Where a trial runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// On this device, beside up to `c - 1` other shared trials.
    Shared(usize),
    /// Alone on each of these devices, training across them.
    Exclusive(Vec<usize>),
}

impl Placement {
    /// The devices it touches.
    pub fn devices(&self) -> &[usize] {
        match self {
            Placement::Shared(d) => std::slice::from_ref(d),
            Placement::Exclusive(ds) => ds,
        }
    }
}

/// Something that happened, told to the planner.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A TrialGroup: each trial with its remaining runtime alone on one device, seconds.
    GroupSubmitted(Vec<(TrialId, f64)>),
    /// A trial's remaining runtime alone on one device is now this (it progressed, or
    /// its algorithm extended its budget).
    Progress {
        /// Which trial.
        trial: TrialId,
        /// Seconds left alone on one device.
        remaining_s: f64,
    },
    /// A trial finished or its algorithm stopped it: its resources are free.
    TrialFinished(TrialId),
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Start a waiting trial there.
    Place {
        /// Which trial.
        trial: TrialId,
        /// Where.
        placement: Placement,
    },
    /// Move a running trial there at its next iteration boundary (DynamicFluid).
    Resize {
        /// Which trial.
        trial: TrialId,
        /// Where it runs from then on.
        placement: Placement,
    },
}

#[derive(Debug, Clone)]
struct TrialState {
    remaining_s: f64,
    placement: Option<Placement>,
}

/// Fluid's planner over `config.devices` devices.
#[derive(Debug, Clone)]
pub struct Planner {
    config: PlannerConfig,
    trials: BTreeMap<TrialId, TrialState>,
    /// Waiting trials, in submission order.
    queue: Vec<TrialId>,
    /// Per device: its shared trials.
    sharers: Vec<Vec<TrialId>>,
    /// Per device: the trial that has it to itself.
    owner: Vec<Option<TrialId>>,
    actions: Vec<Action>,
}

impl Planner {
    /// A planner with every device idle.
    pub fn new(config: PlannerConfig) -> Self {
        let n = config.devices;
        Planner {
            config,
            trials: BTreeMap::new(),
            queue: Vec::new(),
            sharers: vec![Vec::new(); n],
            owner: vec![None; n],
            actions: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// The packing degree `c`.
    pub fn c(&self) -> usize {
        self.config.model.c()
    }

    /// The scaling degree `d`.
    pub fn d(&self) -> usize {
        self.config.model.d().min(self.config.devices.max(1))
    }

    /// Where a trial runs, if it has been placed.
    pub fn placement(&self, trial: TrialId) -> Option<&Placement> {
        self.trials.get(&trial)?.placement.as_ref()
    }

    /// Trials waiting for resources, in order.
    pub fn queued(&self) -> &[TrialId] {
        &self.queue
    }

    /// Handles one event; the decisions wait in [`Planner::poll`].
    pub fn handle(&mut self, event: Event) {
        match event {
            Event::GroupSubmitted(group) => {
                for (id, h) in group {
                    if let Some(t) = self.trials.get_mut(&id) {
                        t.remaining_s = h;
                        continue;
                    }
                    self.trials.insert(
                        id,
                        TrialState {
                            remaining_s: h,
                            placement: None,
                        },
                    );
                    self.queue.push(id);
                }
                self.schedule();
            }
            Event::Progress { trial, remaining_s } => {
                if let Some(t) = self.trials.get_mut(&trial) {
                    t.remaining_s = remaining_s;
                }
            }
            Event::TrialFinished(id) => {
                if let Some(t) = self.trials.remove(&id) {
                    self.queue.retain(|q| *q != id);
                    if let Some(p) = t.placement {
                        self.release(id, &p);
                    }
                    self.schedule();
                }
            }
        }
    }

    /// The decisions since the last poll, in order.
    pub fn poll(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// StaticFluid for the waiting trials, then DynamicFluid.
    fn schedule(&mut self) {
        self.place_queued();
        if !self.config.dynamic {
            return;
        }
        if self.queue.is_empty() {
            self.scale_up();
        } else if self.scale_down() {
            self.place_queued();
        }
    }

    fn is_idle(&self, device: usize) -> bool {
        self.owner[device].is_none() && self.sharers[device].is_empty()
    }

    fn idle_devices(&self) -> Vec<usize> {
        (0..self.config.devices)
            .filter(|&d| self.is_idle(d))
            .collect()
    }

    /// Idle resources `M'`: idle devices count 1, free shares of shared devices `1/c` each.
    fn idle_resources(&self) -> f64 {
        let c = self.c();
        (0..self.config.devices)
            .filter(|&d| self.owner[d].is_none())
            .map(|d| c.saturating_sub(self.sharers[d].len()) as f64 / c as f64)
            .sum()
    }

    /// The device with a free share and the fewest trials (idle devices first).
    fn free_share(&self) -> Option<usize> {
        let c = self.c();
        (0..self.config.devices)
            .filter(|&d| self.owner[d].is_none() && self.sharers[d].len() < c)
            .min_by_key(|&d| (self.sharers[d].len(), d))
    }

    /// Algorithm 3.1 on the waiting trials and the idle resources.
    fn place_queued(&mut self) {
        if self.queue.is_empty() {
            return;
        }
        let resources = self.idle_resources();
        if resources <= 0.0 {
            return;
        }
        let waiting: Vec<(TrialId, f64)> = self
            .queue
            .iter()
            .map(|id| (*id, self.trials.get(id).map_or(0.0, |t| t.remaining_s)))
            .collect();
        for (id, width) in static_widths(&waiting, resources, self.d()) {
            let placement = match width {
                Width::Devices(k) => {
                    let idle = self.idle_devices();
                    if idle.is_empty() {
                        self.free_share().map(Placement::Shared)
                    } else {
                        Some(Placement::Exclusive(
                            idle.into_iter().take(k as usize).collect(),
                        ))
                    }
                }
                Width::Share => self.free_share().map(Placement::Shared),
            };
            let Some(placement) = placement else {
                continue;
            };
            self.occupy(id, &placement);
            self.queue.retain(|q| *q != id);
            self.actions.push(Action::Place {
                trial: id,
                placement,
            });
        }
    }

    fn occupy(&mut self, id: TrialId, placement: &Placement) {
        match placement {
            Placement::Shared(d) => self.sharers[*d].push(id),
            Placement::Exclusive(ds) => {
                for &d in ds {
                    self.owner[d] = Some(id);
                }
            }
        }
        if let Some(t) = self.trials.get_mut(&id) {
            t.placement = Some(placement.clone());
        }
    }

    fn release(&mut self, id: TrialId, placement: &Placement) {
        match placement {
            Placement::Shared(d) => self.sharers[*d].retain(|t| *t != id),
            Placement::Exclusive(ds) => {
                for &d in ds {
                    if self.owner[d] == Some(id) {
                        self.owner[d] = None;
                    }
                }
            }
        }
    }

    fn resize(&mut self, id: TrialId, from: &Placement, to: Placement) {
        self.release(id, from);
        self.occupy(id, &to);
        self.actions.push(Action::Resize {
            trial: id,
            placement: to,
        });
    }

    /// Running trials by remaining runtime, longest first (Algorithm 3.2, line 1).
    fn running_by_length(&self) -> Vec<(TrialId, f64, Placement)> {
        let mut running: Vec<(TrialId, f64, Placement)> = self
            .trials
            .iter()
            .filter_map(|(id, t)| Some((*id, t.remaining_s, t.placement.clone()?)))
            .collect();
        running.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        running
    }

    /// Algorithm 3.2's scale-down branch: a trial on several devices gives some back when
    /// its target width is smaller and `w' (h(w') + eps) < w h(w)`. Returns whether any did.
    fn scale_down(&mut self) -> bool {
        let total: f64 = self.trials.values().map(|t| t.remaining_s.max(0.0)).sum();
        let n = self.config.devices as f64;
        let eps = self.config.rescale_cost_s;
        let mut any = false;
        for (id, h, placement) in self.running_by_length() {
            let Placement::Exclusive(devices) = &placement else {
                continue;
            };
            let k = devices.len();
            let target = match dynamic_target(h, total, n, self.d()) {
                Width::Share => 1,
                Width::Devices(j) => j as usize,
            };
            if target >= k {
                continue;
            }
            let model = &self.config.model;
            let now = k as f64 * model.runtime(h, Width::Devices(k as u32), 1);
            let then = target as f64 * (model.runtime(h, Width::Devices(target as u32), 1) + eps);
            if then < now {
                let kept = Placement::Exclusive(devices[..target].to_vec());
                self.resize(id, &placement, kept);
                any = true;
            }
        }
        any
    }

    /// Algorithm 3.2's scale-up branch, with the group's total resources: a trial whose
    /// target is more whole devices than it has takes idle ones when `h(w') + eps < h(w)`.
    /// A shared trial moving alone onto an idle device is the same rule with `w' = 1`.
    fn scale_up(&mut self) {
        let total: f64 = self.trials.values().map(|t| t.remaining_s.max(0.0)).sum();
        let n = self.config.devices as f64;
        let eps = self.config.rescale_cost_s;
        for (id, h, placement) in self.running_by_length() {
            let Width::Devices(target) = dynamic_target(h, total, n, self.d()) else {
                continue;
            };
            let target = target as usize;
            let model = &self.config.model;
            let (own, width_now, h_now) = match &placement {
                Placement::Exclusive(ds) => (
                    ds.clone(),
                    ds.len() as f64,
                    model.runtime(h, Width::Devices(ds.len() as u32), 1),
                ),
                Placement::Shared(d) => {
                    let p = self.sharers[*d].len();
                    let own = if p == 1 { vec![*d] } else { Vec::new() };
                    (own, 1.0 / p as f64, model.runtime(h, Width::Share, p))
                }
            };
            if target as f64 <= width_now {
                continue;
            }
            let idle = self.idle_devices();
            let reachable = target.min(own.len() + idle.len());
            if reachable == 0 || reachable as f64 <= width_now {
                continue;
            }
            let h_then = model.runtime(h, Width::Devices(reachable as u32), 1);
            if h_then + eps >= h_now {
                continue;
            }
            let mut devices = own;
            devices.extend(idle.into_iter().take(reachable - devices.len()));
            devices.sort_unstable();
            self.resize(id, &placement, Placement::Exclusive(devices));
        }
    }
}

#[cfg(test)]
mod tests;
