//! How each compared system puts trials on devices: one trial per device (FIFO, Ray
//! Tune's default), as many as memory allows (plain PACK), or as Fluid plans
//! (`salus-fluid`'s planner, StaticFluid alone or with DynamicFluid).

use std::collections::{BTreeMap, VecDeque};

use salus_fluid::{Action, Event, Placement, Planner, PlannerConfig, TrialId};

/// A trial handed to a system: its id, seconds left alone on one device, and its bytes on
/// a device (P + E).
#[derive(Debug, Clone, Copy)]
pub struct Submitted {
    /// The trial.
    pub trial: u64,
    /// Remaining runtime alone on one device, seconds.
    pub remaining_s: f64,
    /// P + E.
    pub bytes: u64,
}

/// The cluster-level placement of one compared system.
#[derive(Debug)]
pub enum Dispatcher {
    /// One trial per device, in submission order.
    Fifo {
        /// Waiting trials.
        queue: VecDeque<u64>,
        /// Per device, its trial.
        owner: Vec<Option<u64>>,
        /// Decisions not yet polled.
        actions: Vec<Action>,
    },
    /// Every trial goes at once to the device with the fewest trials where its memory
    /// fits (each salusd packs it under PACK); a trial that fits nowhere waits, and later
    /// ones that fit go ahead of it.
    Pack {
        /// Waiting trials with their bytes.
        queue: Vec<(u64, u64)>,
        /// Per device, bytes of its trials.
        used: Vec<u64>,
        /// Per device, its trials.
        count: Vec<usize>,
        /// Device and bytes of each placed trial.
        placed: BTreeMap<u64, (usize, u64)>,
        /// Device memory.
        capacity: u64,
        /// Decisions not yet polled.
        actions: Vec<Action>,
    },
    /// Fluid's planner.
    Fluid(Box<Planner>),
}

impl Dispatcher {
    /// FIFO over `devices`.
    pub fn fifo(devices: usize) -> Self {
        Dispatcher::Fifo {
            queue: VecDeque::new(),
            owner: vec![None; devices],
            actions: Vec::new(),
        }
    }

    /// Plain PACK over `devices` of `capacity` bytes.
    pub fn pack(devices: usize, capacity: u64) -> Self {
        Dispatcher::Pack {
            queue: Vec::new(),
            used: vec![0; devices],
            count: vec![0; devices],
            placed: BTreeMap::new(),
            capacity,
            actions: Vec::new(),
        }
    }

    /// Fluid with `config`.
    pub fn fluid(config: PlannerConfig) -> Self {
        Dispatcher::Fluid(Box::new(Planner::new(config)))
    }

    /// A TrialGroup arrives.
    pub fn submit(&mut self, group: &[Submitted]) {
        match self {
            Dispatcher::Fifo { queue, .. } => queue.extend(group.iter().map(|s| s.trial)),
            Dispatcher::Pack { queue, .. } => {
                queue.extend(group.iter().map(|s| (s.trial, s.bytes)))
            }
            Dispatcher::Fluid(planner) => planner.handle(Event::GroupSubmitted(
                group
                    .iter()
                    .map(|s| (TrialId(s.trial), s.remaining_s))
                    .collect(),
            )),
        }
        self.place();
    }

    /// A running trial's remaining runtime (Fluid reads it; the others do not plan).
    pub fn progress(&mut self, trial: u64, remaining_s: f64) {
        if let Dispatcher::Fluid(planner) = self {
            planner.handle(Event::Progress {
                trial: TrialId(trial),
                remaining_s,
            });
        }
    }

    /// A trial gave its resources back.
    pub fn finished(&mut self, trial: u64) {
        match self {
            Dispatcher::Fifo { owner, .. } => {
                for o in owner.iter_mut().filter(|o| **o == Some(trial)) {
                    *o = None;
                }
            }
            Dispatcher::Pack {
                used,
                count,
                placed,
                ..
            } => {
                if let Some((d, bytes)) = placed.remove(&trial) {
                    used[d] -= bytes;
                    count[d] -= 1;
                }
            }
            Dispatcher::Fluid(planner) => planner.handle(Event::TrialFinished(TrialId(trial))),
        }
        self.place();
    }

    /// The decisions since the last poll.
    pub fn poll(&mut self) -> Vec<Action> {
        match self {
            Dispatcher::Fifo { actions, .. } | Dispatcher::Pack { actions, .. } => {
                std::mem::take(actions)
            }
            Dispatcher::Fluid(planner) => planner.poll(),
        }
    }

    fn place(&mut self) {
        match self {
            Dispatcher::Fifo {
                queue,
                owner,
                actions,
            } => {
                for (d, o) in owner.iter_mut().enumerate() {
                    if o.is_none()
                        && let Some(trial) = queue.pop_front()
                    {
                        *o = Some(trial);
                        actions.push(Action::Place {
                            trial: TrialId(trial),
                            placement: Placement::Exclusive(vec![d]),
                        });
                    }
                }
            }
            Dispatcher::Pack {
                queue,
                used,
                count,
                placed,
                capacity,
                actions,
            } => {
                queue.retain(|&(trial, bytes)| {
                    let best = (0..used.len())
                        .filter(|&d| used[d] + bytes <= *capacity)
                        .min_by_key(|&d| (count[d], d));
                    let Some(d) = best else {
                        return true;
                    };
                    used[d] += bytes;
                    count[d] += 1;
                    placed.insert(trial, (d, bytes));
                    actions.push(Action::Place {
                        trial: TrialId(trial),
                        placement: Placement::Shared(d),
                    });
                    false
                });
            }
            Dispatcher::Fluid(_) => {}
        }
    }
}
