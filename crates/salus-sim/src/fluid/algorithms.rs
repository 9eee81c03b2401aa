//! The tuning algorithms of the chapter's evaluation, as schedules of trial budgets: which
//! trials run how many more epochs, and what happens when they get there.
//!
//! Each algorithm hands out work as TrialGroups ([`Algorithm::next`]): a grid is one
//! group, each rung of a synchronous Hyperband bracket is one, and an asynchronous
//! algorithm's new trials form a group each time it is asked. When a trial has run its
//! epochs the algorithm decides ([`Algorithm::reached`]): run on without pausing (ASHA and
//! PBT between milestones), or give its resources back (done, stopped, or paused until
//! its rung is complete). Accuracy is modelled ([`Config::quality`] plus deterministic
//! noise), so promotions depend on which trials finish first, as in Ray Tune.

use crate::rng::Rng;

use super::workload::{Config, noise};

/// More epochs of one trial (a new trial, or a paused one resumed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Run {
    /// The trial.
    pub trial: u64,
    /// Epochs to run from where it is.
    pub epochs: u32,
}

/// What a trial does once it has run the epochs it was given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Go on for this many more epochs where it is.
    Continue(u32),
    /// Give its resources back (finished, stopped, or paused until its rung completes).
    Release,
}

/// A tuning algorithm as the simulator drives it.
pub trait Algorithm {
    /// The configuration of a trial it handed out.
    fn config(&self, trial: u64) -> Config;
    /// New work, given room for `room` more concurrent trials (asynchronous algorithms
    /// fill it; synchronous ones hand out whole rungs whatever the room).
    fn next(&mut self, room: usize) -> Vec<Run>;
    /// `trial` has now run `epoch` epochs in all.
    fn reached(&mut self, trial: u64, epoch: u32) -> Verdict;
    /// No more work will come and none is out.
    fn finished(&self) -> bool;
    /// The best accuracy a trial reported at the full budget, if one got there.
    fn best(&self) -> Option<f64>;
}

/// The algorithms of Fig. 3.7, by their names in the experiment's output.
pub const ALGORITHMS: [&str; 6] = ["grid", "hyperband", "sync_bohb", "asha", "bohb", "pbt"];

/// The algorithm `name` for `seed`.
pub fn algorithm(name: &str, seed: u64) -> Option<Box<dyn Algorithm>> {
    Some(match name {
        "grid" => Box::new(Grid::new(seed)),
        "hyperband" => Box::new(Hyperband::new(seed, Sampler::random())),
        "sync_bohb" => Box::new(Hyperband::new(seed, Sampler::bohb())),
        "asha" => Box::new(Asha::new(seed, Sampler::random(), ASHA_SAMPLES)),
        "bohb" => Box::new(Asha::new(seed, Sampler::bohb(), BOHB_SAMPLES)),
        "pbt" => Box::new(Pbt::new(seed)),
        _ => return None,
    })
}

/// Trials sampled by ASHA.
pub const ASHA_SAMPLES: usize = 64;
/// Trials sampled by (asynchronous) BOHB.
pub const BOHB_SAMPLES: usize = 48;
/// Largest budget of a trial, epochs (Hyperband's R, ASHA's max_t).
pub const MAX_EPOCHS: u32 = 27;
/// Reduction factor of the successive-halving algorithms.
pub const ETA: u32 = 3;

/// The trials an algorithm has created, and the accuracy each reports.
#[derive(Debug, Clone)]
struct Trials {
    seed: u64,
    configs: Vec<Config>,
    best: Option<f64>,
}

impl Trials {
    fn new(seed: u64) -> Self {
        Trials {
            seed,
            configs: Vec::new(),
            best: None,
        }
    }

    /// The accuracy `trial` reports after `epoch` epochs, remembered as the best when it
    /// is the full budget `full`.
    fn report(&mut self, trial: u64, epoch: u32, full: u32) -> f64 {
        let metric = self.metric(trial, epoch);
        if epoch >= full {
            self.best = Some(self.best.map_or(metric, |b| b.max(metric)));
        }
        metric
    }

    fn add(&mut self, config: Config) -> u64 {
        self.configs.push(config);
        (self.configs.len() - 1) as u64
    }

    fn config(&self, trial: u64) -> Config {
        self.configs[trial as usize]
    }

    /// Validation accuracy of `trial` after `epoch` epochs: the configuration's quality,
    /// less what training longer would still add, plus noise shrinking with the budget.
    fn metric(&self, trial: u64, epoch: u32) -> f64 {
        let e = f64::from(epoch.max(1));
        self.config(trial).quality() + 0.02 * noise(self.seed, trial, 0) - 0.25 / e.sqrt()
            + 0.01 * noise(self.seed, trial, u64::from(epoch)) / e.sqrt()
    }
}

/// How new configurations are chosen: at random, or BOHB's model-based way.
#[derive(Debug, Clone)]
pub struct Sampler {
    model_based: bool,
    /// (configuration, budget, accuracy) observed so far.
    observed: Vec<(Config, u32, f64)>,
}

impl Sampler {
    fn random() -> Self {
        Sampler {
            model_based: false,
            observed: Vec::new(),
        }
    }

    fn bohb() -> Self {
        Sampler {
            model_based: true,
            observed: Vec::new(),
        }
    }

    fn observe(&mut self, config: Config, budget: u32, metric: f64) {
        if self.model_based {
            self.observed.push((config, budget, metric));
        }
    }

    /// BOHB: a third of the time at random; otherwise near one of the best 15% of the
    /// configurations of the largest budget with at least 6 observations.
    fn sample(&self, rng: &mut Rng) -> Config {
        let random = Config {
            size: rng.unit(),
            lr: rng.unit(),
        };
        if !self.model_based || rng.unit() < 1.0 / 3.0 {
            return random;
        }
        let budget = self
            .observed
            .iter()
            .map(|o| o.1)
            .filter(|b| self.observed.iter().filter(|o| o.1 == *b).count() >= 6)
            .max();
        let Some(budget) = budget else {
            return random;
        };
        let mut best: Vec<&(Config, u32, f64)> =
            self.observed.iter().filter(|o| o.1 == budget).collect();
        best.sort_by(|a, b| b.2.total_cmp(&a.2));
        let top = ((best.len() as f64 * 0.15).ceil() as usize).max(1);
        let base = best[rng.index(top)].0;
        Config {
            size: (base.size + rng.uniform(-0.15, 0.15)).clamp(0.0, 1.0),
            lr: (base.lr + rng.uniform(-0.15, 0.15)).clamp(0.0, 1.0),
        }
    }
}

/// Epochs of each grid-search trial.
pub const GRID_EPOCHS: u32 = 9;

/// Grid search: 3 architecture sizes x 9 learning rates, 9 epochs each, one TrialGroup.
#[derive(Debug, Clone)]
pub struct Grid {
    trials: Trials,
    handed_out: bool,
    out: usize,
}

impl Grid {
    fn new(seed: u64) -> Self {
        Grid {
            trials: Trials::new(seed),
            handed_out: false,
            out: 0,
        }
    }
}

impl Algorithm for Grid {
    fn config(&self, trial: u64) -> Config {
        self.trials.config(trial)
    }

    fn next(&mut self, _room: usize) -> Vec<Run> {
        if self.handed_out {
            return Vec::new();
        }
        self.handed_out = true;
        let mut runs = Vec::new();
        for size in [0.0, 0.5, 1.0] {
            for i in 1..=9 {
                let trial = self.trials.add(Config {
                    size,
                    lr: f64::from(i) / 10.0,
                });
                runs.push(Run {
                    trial,
                    epochs: GRID_EPOCHS,
                });
            }
        }
        self.out = runs.len();
        runs
    }

    fn reached(&mut self, trial: u64, epoch: u32) -> Verdict {
        self.trials.report(trial, epoch, GRID_EPOCHS);
        self.out -= 1;
        Verdict::Release
    }

    fn best(&self) -> Option<f64> {
        self.trials.best
    }

    fn finished(&self) -> bool {
        self.handed_out && self.out == 0
    }
}

/// Synchronous Hyperband (Li et al.), brackets one after another, each rung a
/// TrialGroup; with BOHB's sampler it is synchronous BOHB.
#[derive(Debug, Clone)]
pub struct Hyperband {
    trials: Trials,
    sampler: Sampler,
    rng: Rng,
    /// Halvings of the first (most aggressive) bracket.
    s_max: u32,
    /// Brackets still to run, as `s` (the number of halvings).
    brackets: Vec<u32>,
    /// The running bracket: its `s`, its rung, the rung's trials.
    current: Option<(u32, u32, Vec<u64>)>,
    out: usize,
}

impl Hyperband {
    fn new(seed: u64, sampler: Sampler) -> Self {
        let s_max = (f64::from(MAX_EPOCHS).ln() / f64::from(ETA).ln()).round() as u32;
        Hyperband {
            trials: Trials::new(seed),
            sampler,
            rng: Rng::new(seed ^ 0x4879_7065),
            s_max,
            brackets: (0..=s_max).collect(),
            current: None,
            out: 0,
        }
    }

    fn budget(s: u32, rung: u32) -> u32 {
        MAX_EPOCHS / ETA.pow(s) * ETA.pow(rung)
    }
}

impl Algorithm for Hyperband {
    fn config(&self, trial: u64) -> Config {
        self.trials.config(trial)
    }

    fn next(&mut self, _room: usize) -> Vec<Run> {
        if self.out > 0 {
            return Vec::new();
        }
        let (s, rung, members) = match self.current.take() {
            Some((s, rung, members)) if rung < s => {
                // Promote the best 1/eta at this rung's budget.
                let budget = Self::budget(s, rung);
                let mut ranked = members;
                ranked.sort_by(|a, b| {
                    self.trials
                        .metric(*b, budget)
                        .total_cmp(&self.trials.metric(*a, budget))
                });
                ranked.truncate((ranked.len() / ETA as usize).max(1));
                (s, rung + 1, ranked)
            }
            _ => {
                let Some(s) = self.brackets.pop() else {
                    return Vec::new();
                };
                let n =
                    (f64::from(self.s_max + 1) / f64::from(s + 1) * f64::from(ETA.pow(s))).ceil();
                let members = (0..n as usize)
                    .map(|_| {
                        let config = self.sampler.sample(&mut self.rng);
                        self.trials.add(config)
                    })
                    .collect();
                (s, 0, members)
            }
        };
        let epochs = Self::budget(s, rung)
            - if rung == 0 {
                0
            } else {
                Self::budget(s, rung - 1)
            };
        let runs: Vec<Run> = members.iter().map(|&trial| Run { trial, epochs }).collect();
        self.out = runs.len();
        self.current = Some((s, rung, members));
        runs
    }

    fn reached(&mut self, trial: u64, epoch: u32) -> Verdict {
        let metric = self.trials.report(trial, epoch, MAX_EPOCHS);
        self.sampler
            .observe(self.trials.config(trial), epoch, metric);
        self.out -= 1;
        Verdict::Release
    }

    fn best(&self) -> Option<f64> {
        self.trials.best
    }

    fn finished(&self) -> bool {
        self.out == 0
            && self.brackets.is_empty()
            && self.current.as_ref().is_none_or(|(s, rung, _)| rung >= s)
    }
}

/// Asynchronous successive halving as Ray Tune's ASHA runs it: each trial trains without
/// pausing and is stopped at a milestone (1, 3, 9 epochs) when its accuracy is below the
/// top `1/eta` of those recorded there so far. With BOHB's sampler it is asynchronous
/// BOHB.
#[derive(Debug, Clone)]
pub struct Asha {
    trials: Trials,
    sampler: Sampler,
    rng: Rng,
    samples: usize,
    /// Accuracies recorded at each milestone.
    recorded: Vec<(u32, Vec<f64>)>,
    live: usize,
}

impl Asha {
    fn new(seed: u64, sampler: Sampler, samples: usize) -> Self {
        Asha {
            trials: Trials::new(seed),
            sampler,
            rng: Rng::new(seed ^ 0x4153_4841),
            samples,
            recorded: Vec::new(),
            live: 0,
        }
    }
}

impl Algorithm for Asha {
    fn config(&self, trial: u64) -> Config {
        self.trials.config(trial)
    }

    fn next(&mut self, room: usize) -> Vec<Run> {
        let n = room.min(self.samples - self.trials.configs.len());
        self.live += n;
        (0..n)
            .map(|_| {
                let config = self.sampler.sample(&mut self.rng);
                Run {
                    trial: self.trials.add(config),
                    epochs: 1,
                }
            })
            .collect()
    }

    fn reached(&mut self, trial: u64, epoch: u32) -> Verdict {
        let metric = self.trials.report(trial, epoch, MAX_EPOCHS);
        self.sampler
            .observe(self.trials.config(trial), epoch, metric);
        let at = match self.recorded.iter().position(|(m, _)| *m == epoch) {
            Some(i) => i,
            None => {
                self.recorded.push((epoch, Vec::new()));
                self.recorded.len() - 1
            }
        };
        let recorded = &mut self.recorded[at].1;
        let below_cutoff =
            !recorded.is_empty() && metric < percentile(recorded, 1.0 - 1.0 / f64::from(ETA));
        recorded.push(metric);
        if epoch >= MAX_EPOCHS || below_cutoff {
            self.live -= 1;
            Verdict::Release
        } else {
            Verdict::Continue(epoch * ETA - epoch)
        }
    }

    fn best(&self) -> Option<f64> {
        self.trials.best
    }

    fn finished(&self) -> bool {
        self.live == 0 && self.trials.configs.len() >= self.samples
    }
}

/// Linear-interpolation percentile (numpy's default), `q` in `[0, 1]`.
fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// Population-based training: 8 trials of one architecture for 27 epochs; every 3 epochs
/// the bottom quarter copies the learning rate of one of the top quarter and perturbs it.
#[derive(Debug, Clone)]
pub struct Pbt {
    trials: Trials,
    rng: Rng,
    started: bool,
    latest: Vec<Option<f64>>,
    live: usize,
}

/// PBT's population.
pub const PBT_POPULATION: usize = 8;
/// Epochs between PBT's exploit/explore steps.
pub const PBT_INTERVAL: u32 = 3;

impl Pbt {
    fn new(seed: u64) -> Self {
        Pbt {
            trials: Trials::new(seed),
            rng: Rng::new(seed ^ 0x5042_5400),
            started: false,
            latest: Vec::new(),
            live: 0,
        }
    }
}

impl Algorithm for Pbt {
    fn config(&self, trial: u64) -> Config {
        self.trials.config(trial)
    }

    fn next(&mut self, _room: usize) -> Vec<Run> {
        if self.started {
            return Vec::new();
        }
        self.started = true;
        self.live = PBT_POPULATION;
        self.latest = vec![None; PBT_POPULATION];
        (0..PBT_POPULATION)
            .map(|_| {
                let lr = self.rng.unit();
                Run {
                    trial: self.trials.add(Config { size: 0.5, lr }),
                    epochs: PBT_INTERVAL,
                }
            })
            .collect()
    }

    fn reached(&mut self, trial: u64, epoch: u32) -> Verdict {
        let metric = self.trials.report(trial, epoch, MAX_EPOCHS);
        self.latest[trial as usize] = Some(metric);
        if epoch >= MAX_EPOCHS {
            self.live -= 1;
            return Verdict::Release;
        }
        let mut scores: Vec<(f64, usize)> = self
            .latest
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some(((*s)?, i)))
            .collect();
        scores.sort_by(|a, b| a.0.total_cmp(&b.0));
        let quarter = (scores.len() / 4).max(1);
        if scores.len() >= 4 && scores[..quarter].iter().any(|s| s.1 == trial as usize) {
            let donor = scores[scores.len() - 1 - self.rng.index(quarter)].1;
            let lr = self.trials.configs[donor].lr * if self.rng.unit() < 0.5 { 0.8 } else { 1.2 };
            self.trials.configs[trial as usize].lr = lr.clamp(0.0, 1.0);
        }
        Verdict::Continue(PBT_INTERVAL)
    }

    fn best(&self) -> Option<f64> {
        self.trials.best
    }

    fn finished(&self) -> bool {
        self.started && self.live == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs an algorithm with unlimited room, finishing trials in hand-out order.
    fn drain(mut algo: Box<dyn Algorithm>) -> (usize, u64) {
        let mut epochs = 0u64;
        let mut groups = 0;
        let mut done: Vec<u32> = Vec::new();
        while !algo.finished() {
            let runs = algo.next(usize::MAX / 2);
            assert!(!runs.is_empty(), "stalled");
            groups += 1;
            let mut queue: std::collections::VecDeque<Run> = runs.into();
            while let Some(run) = queue.pop_front() {
                let t = run.trial as usize;
                if done.len() <= t {
                    done.resize(t + 1, 0);
                }
                done[t] += run.epochs;
                epochs += u64::from(run.epochs);
                if let Verdict::Continue(more) = algo.reached(run.trial, done[t]) {
                    queue.push_back(Run {
                        trial: run.trial,
                        epochs: more,
                    });
                }
            }
        }
        (groups, epochs)
    }

    #[test]
    fn hyperband_runs_four_brackets_of_rungs() {
        let (groups, epochs) = drain(algorithm("hyperband", 1).unwrap());
        // Brackets s = 3, 2, 1, 0 have 4, 3, 2 and 1 rungs.
        assert_eq!(groups, 10);
        // 27x1 + 9x2 + 3x6 + 1x18, 12x3 + 4x6 + 1x18, 6x9 + 2x18, 4x27.
        assert_eq!(epochs, 81 + 78 + 90 + 108);
    }

    #[test]
    fn grid_is_one_group_and_asha_stops_most_trials_early() {
        assert_eq!(drain(algorithm("grid", 1).unwrap()), (1, 27 * 9));
        let (_, epochs) = drain(algorithm("asha", 1).unwrap());
        assert!(epochs < (ASHA_SAMPLES as u64) * 5, "{epochs}");
        assert!(epochs > ASHA_SAMPLES as u64, "{epochs}");
        let (_, pbt) = drain(algorithm("pbt", 1).unwrap());
        assert_eq!(pbt, PBT_POPULATION as u64 * u64::from(MAX_EPOCHS));
    }

    #[test]
    fn bohb_samples_near_the_best_configurations() {
        let mut sampler = Sampler::bohb();
        for i in 0..20 {
            let size = f64::from(i) / 20.0;
            sampler.observe(Config { size, lr: 0.6 }, 3, size);
        }
        let mut rng = Rng::new(1);
        let big = (0..300)
            .filter(|_| sampler.sample(&mut rng).size > 0.7)
            .count();
        // Random alone would give about 30%; the model concentrates on large sizes.
        assert!(big > 150, "{big}");
    }
}
