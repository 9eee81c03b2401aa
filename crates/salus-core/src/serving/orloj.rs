//! ORLOJ (dissertation ch. 4): batch-aware, distribution-based request scheduling.
//!
//! - Each request's execution time is a random variable: its application's empirical
//!   distribution, from the online profiler (§4.3.2).
//! - For each application and batch size, the distribution of the whole batch's time
//!   `L_B` (§4.4.2, Eqs. 4.5-4.9): the slowest of one request of the application and
//!   `k - 1` from the model's mix of applications (§4.4.3), through the cost model.
//!   These tables are rebuilt only when the profile changes.
//! - A request's priority in the queue of batch size `k` is Eq. 4.2 summed over the bins
//!   of its `L_B` histogram, with cost `c = 1` for a missed deadline and the
//!   exponentially distributed anticipated delay of rate `b`. Between milestones (the
//!   times `D - l` at bin edges `l`, where a bin changes case) the score is
//!   `A·e^(b·t) + B`, so each queue is a [`HullQueue`] of points `(A, B)` and the best
//!   request at `t` is the hull's extreme point in direction `(e^(b·t), 1)` (§4.4.4).
//!   Times are relative to a base that moves every `rebase_after` to keep `e^(b·t)` far
//!   from overflow (§4.4.4, "Overflow Handling").
//! - Algorithm 4.1 runs whenever the worker can take a batch: rebase if due, update the
//!   requests whose milestone passed, drop from each batch size's queue the requests
//!   that would miss their deadline at that size (`t + EstimateBatchLatency(r, bs) > D_r`,
//!   earliest deadline first; dropped outright when no size is left), pick the batch size
//!   (sizes ordered by the earliest deadline in their queue, then size, both descending:
//!   the first whose queue holds at least a batch), and pop that many requests by score.
//!
//! Where the dissertation is silent: `EstimateBatchLatency(r, bs)` is a quantile of the
//! request's `L_B` (`OrlojParams::feasibility_quantile`); a request that fits no batch
//! size on arrival is dropped at once rather than at the next scheduling round; queues
//! keep their earliest deadline in ordered sets (per application, since the estimate
//! depends on it) where the dissertation uses a Fibonacci heap.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use super::hull::{HullPoint, HullQueue};
use super::profile::{BatchLatency, duration, ms};
use super::server::{Decision, Policy, View, Worker};
use super::{AppId, DropReason, OrlojParams, Request, RequestId, RequestSchedulerKind};
use super::{BatchCost, Profile, ServingConfig};

/// `E[L_B]` below this (an empty profile and no fixed cost) is taken as this, in ms.
const MIN_MEAN_MS: f64 = 1e-6;

/// One histogram bin's part of Eq. 4.2, `e^(-b·D)` factored out.
#[derive(Debug, Clone)]
struct BinTerm {
    lo: Duration,
    hi: Duration,
    /// Coefficient of `e^(b·(t - D))` while `t < D - hi`:
    /// `(h·c / (E·b))·(e^(b·hi) - e^(b·lo))` with `h` the bin's density.
    early: f64,
    /// Constant part while `D - hi <= t < D - lo`: `h·c / (E·b)`.
    late: f64,
    /// Its coefficient of `e^(b·(t - D))`, subtracted: `h·c / (E·b)·e^(b·lo)`.
    late_decay: f64,
}

/// The score of a request of one application at one batch size.
#[derive(Debug, Clone)]
struct ScoreTable {
    terms: Vec<BinTerm>,
    /// Every bin edge, ascending: the slacks at which the score changes case.
    edges: Vec<Duration>,
    /// `EstimateBatchLatency`.
    estimate: Duration,
}

impl ScoreTable {
    fn new(latency: &BatchLatency, b: f64) -> Self {
        let mean = latency.mean_ms.max(MIN_MEAN_MS);
        let terms: Vec<BinTerm> = latency
            .bins
            .iter()
            .map(|bin| {
                let width = bin.hi_ms - bin.lo_ms;
                let grows = (b * bin.lo_ms).exp();
                // c = 1: every missed deadline costs the same.
                let mass = bin.mass / mean;
                if width > 0.0 {
                    let late = mass / (b * width);
                    BinTerm {
                        lo: duration(bin.lo_ms),
                        hi: duration(bin.hi_ms),
                        early: late * grows * (b * width).exp_m1(),
                        late,
                        late_decay: late * grows,
                    }
                } else {
                    // A point mass: the limit of a vanishing bin, whose late case is
                    // empty.
                    BinTerm {
                        lo: duration(bin.lo_ms),
                        hi: duration(bin.hi_ms),
                        early: mass * grows,
                        late: 0.0,
                        late_decay: 0.0,
                    }
                }
            })
            .collect();
        let mut edges: Vec<Duration> = terms.iter().flat_map(|t| [t.lo, t.hi]).collect();
        edges.sort();
        edges.dedup();
        ScoreTable {
            terms,
            edges,
            estimate: duration(latency.quantile_ms),
        }
    }

    /// The score's `(A, B)` for a deadline `rel_deadline_ms` after the base and `slack`
    /// left before it, and the slack at which it next changes (`None`: it stays zero).
    fn point(
        &self,
        slack: Duration,
        rel_deadline_ms: f64,
        b: f64,
    ) -> (HullPoint, Option<Duration>) {
        let decay = (-b * rel_deadline_ms).exp();
        let (mut a, mut c) = (0.0, 0.0);
        for term in &self.terms {
            if slack > term.hi {
                a += term.early * decay;
            } else if slack > term.lo {
                c += term.late;
                a -= term.late_decay * decay;
            }
        }
        let next = self.edges.partition_point(|&e| e < slack);
        let next = next.checked_sub(1).map(|i| self.edges[i]);
        (HullPoint::new(a, c), next)
    }
}

/// The score tables, per application (and for applications without samples, the mix),
/// per batch size.
#[derive(Debug, Clone, Default)]
struct Tables {
    version: Option<u64>,
    by_app: HashMap<AppId, Vec<ScoreTable>>,
    mix: Vec<ScoreTable>,
}

impl Tables {
    fn build(profile: &Profile, sizes: &[usize], cost: &BatchCost, params: &OrlojParams) -> Self {
        let make = |app: Option<AppId>| {
            profile
                .batch_latency(app, sizes, cost, params.bins, params.feasibility_quantile)
                .iter()
                .map(|l| ScoreTable::new(l, params.b))
                .collect::<Vec<_>>()
        };
        Tables {
            version: Some(profile.version()),
            by_app: profile.apps().map(|a| (a, make(Some(a)))).collect(),
            mix: make(None),
        }
    }

    fn get(&self, app: AppId, size: usize) -> &ScoreTable {
        self.by_app.get(&app).map_or(&self.mix[size], |t| &t[size])
    }
}

/// The queue `Q_bs` of one batch size.
#[derive(Debug, Default)]
struct SizeQueue {
    hull: HullQueue<RequestId>,
    /// Per application, by deadline: the requests to check for feasibility first.
    deadlines: BTreeMap<AppId, BTreeSet<(Duration, RequestId)>>,
}

impl SizeQueue {
    fn earliest(&self) -> Option<Duration> {
        self.deadlines
            .values()
            .filter_map(|s| s.first().map(|&(d, _)| d))
            .min()
    }
}

/// A pending request.
#[derive(Debug, Clone)]
struct Entry {
    app: AppId,
    deadline: Duration,
    /// Bit `i`: the request is in the queue of the `i`-th batch size.
    queues: u32,
    /// Per batch size, when its score there next changes.
    milestones: Vec<Option<Duration>>,
}

pub(crate) struct Orloj {
    params: OrlojParams,
    sizes: Vec<usize>,
    cost: BatchCost,
    tables: Tables,
    queues: Vec<SizeQueue>,
    /// Ordered, so that rebuilding and rebasing visit requests in one order.
    pending: BTreeMap<RequestId, Entry>,
    milestones: BTreeSet<(Duration, RequestId, usize)>,
    base: Duration,
    /// Requests found hopeless outside a scheduling round, dropped at the next decision.
    hopeless: Vec<RequestId>,
}

impl Orloj {
    pub fn new(config: &ServingConfig) -> Self {
        Orloj {
            params: config.orloj.clone(),
            sizes: config.batch_sizes.clone(),
            cost: config.cost,
            tables: Tables::default(),
            queues: config
                .batch_sizes
                .iter()
                .map(|_| SizeQueue::default())
                .collect(),
            pending: BTreeMap::new(),
            milestones: BTreeSet::new(),
            base: Duration::ZERO,
            hopeless: Vec::new(),
        }
    }

    fn rel_ms(&self, t: Duration) -> f64 {
        ms(t) - ms(self.base)
    }

    /// Rebuilds the tables when the profile changed; every pending request is placed
    /// again with them.
    fn refresh(&mut self, now: Duration, profile: &Profile) {
        if self.tables.version == Some(profile.version()) {
            return;
        }
        self.tables = Tables::build(profile, &self.sizes, &self.cost, &self.params);
        let ids: Vec<RequestId> = self.pending.keys().copied().collect();
        for id in ids {
            for i in 0..self.sizes.len() {
                self.leave(id, i);
            }
            self.place(now, id);
        }
    }

    /// Puts a request into the queue of every batch size it can still meet its deadline
    /// at; hopeless when there is none.
    fn place(&mut self, now: Duration, id: RequestId) {
        let Some(entry) = self.pending.get(&id) else {
            return;
        };
        let (app, deadline) = (entry.app, entry.deadline);
        for i in 0..self.sizes.len() {
            if now + self.tables.get(app, i).estimate <= deadline {
                self.queues[i]
                    .deadlines
                    .entry(app)
                    .or_default()
                    .insert((deadline, id));
                if let Some(e) = self.pending.get_mut(&id) {
                    e.queues |= 1 << i;
                }
                self.rescore(now, id, i);
            }
        }
        if self.pending.get(&id).is_some_and(|e| e.queues == 0) {
            self.pending.remove(&id);
            self.hopeless.push(id);
        }
    }

    /// Computes a request's score point in one queue at `now` and its next milestone.
    fn rescore(&mut self, now: Duration, id: RequestId, i: usize) {
        let Some(entry) = self.pending.get(&id) else {
            return;
        };
        let (app, deadline, old) = (entry.app, entry.deadline, entry.milestones[i]);
        let slack = deadline.saturating_sub(now);
        let table = self.tables.get(app, i);
        let (point, next) = table.point(slack, self.rel_ms(deadline), self.params.b);
        let milestone = next.map(|edge| deadline - edge);
        if let Some(old) = old {
            self.milestones.remove(&(old, id, i));
        }
        if let Some(at) = milestone {
            self.milestones.insert((at, id, i));
        }
        if let Some(e) = self.pending.get_mut(&id) {
            e.milestones[i] = milestone;
        }
        self.queues[i].hull.insert(id, point);
    }

    /// Takes a request out of one queue.
    fn leave(&mut self, id: RequestId, i: usize) {
        let Some(entry) = self.pending.get_mut(&id) else {
            return;
        };
        if entry.queues & (1 << i) == 0 {
            return;
        }
        entry.queues &= !(1 << i);
        if let Some(at) = entry.milestones[i].take() {
            self.milestones.remove(&(at, id, i));
        }
        let (app, deadline) = (entry.app, entry.deadline);
        self.queues[i].hull.remove(&id);
        if let Some(set) = self.queues[i].deadlines.get_mut(&app) {
            set.remove(&(deadline, id));
            if set.is_empty() {
                self.queues[i].deadlines.remove(&app);
            }
        }
    }

    /// Algorithm 4.1, lines 1-9: rebase when due, then rescore the requests whose
    /// milestone has passed.
    fn update_scores(&mut self, now: Duration) {
        if now.saturating_sub(self.base) > self.params.rebase_after {
            self.base = now;
            let placed: Vec<(RequestId, u32)> =
                self.pending.iter().map(|(&id, e)| (id, e.queues)).collect();
            for (id, queues) in placed {
                for i in 0..self.sizes.len() {
                    if queues & (1 << i) != 0 {
                        self.rescore(now, id, i);
                    }
                }
            }
        }
        while let Some(&(at, id, i)) = self.milestones.first() {
            if at > now {
                break;
            }
            self.milestones.pop_first();
            if let Some(e) = self.pending.get_mut(&id) {
                e.milestones[i] = None;
            }
            self.rescore(now, id, i);
        }
    }

    /// Algorithm 4.1, lines 10-14: drop from each queue the requests that would miss
    /// their deadline at its batch size; a request no queue holds is hopeless.
    fn drop_late(&mut self, now: Duration, out: &mut Decision) {
        for i in 0..self.sizes.len() {
            let apps: Vec<AppId> = self.queues[i].deadlines.keys().copied().collect();
            for app in apps {
                let estimate = self.tables.get(app, i).estimate;
                while let Some(&(deadline, id)) =
                    self.queues[i].deadlines.get(&app).and_then(|s| s.first())
                {
                    if now + estimate <= deadline {
                        break;
                    }
                    self.leave(id, i);
                    if self.pending.get(&id).is_some_and(|e| e.queues == 0) {
                        self.pending.remove(&id);
                        out.drops.push((id, DropReason::Hopeless));
                    }
                }
            }
        }
    }

    /// Algorithm 4.1, lines 15-21: the batch size to form.
    fn candidate(&self) -> Option<usize> {
        let mut order: Vec<(Duration, usize, usize)> = (0..self.sizes.len())
            .filter_map(|i| self.queues[i].earliest().map(|d| (d, self.sizes[i], i)))
            .collect();
        order.sort_by(|a, b| b.cmp(a));
        order
            .into_iter()
            .find(|&(_, size, i)| self.queues[i].hull.len() >= size)
            .map(|(_, _, i)| i)
    }

    /// Algorithm 4.1, line 22: the candidate queue's best requests by score.
    fn pop_batch(&mut self, now: Duration, i: usize) -> Vec<RequestId> {
        let x = (self.params.b * self.rel_ms(now)).exp();
        let mut batch = Vec::with_capacity(self.sizes[i]);
        while batch.len() < self.sizes[i] {
            let Some(id) = self.queues[i].hull.best(x) else {
                break;
            };
            for j in 0..self.sizes.len() {
                self.leave(id, j);
            }
            // Already out of the queue; this only guards against looping forever should
            // the hull ever hold a request that is not pending.
            self.queues[i].hull.remove(&id);
            self.pending.remove(&id);
            batch.push(id);
        }
        batch
    }
}

impl Policy for Orloj {
    fn kind(&self) -> RequestSchedulerKind {
        RequestSchedulerKind::Orloj
    }

    fn arrived(&mut self, now: Duration, request: &Request, view: &View<'_>) {
        self.refresh(now, view.profile);
        self.pending.insert(
            request.id,
            Entry {
                app: request.app,
                deadline: request.deadline,
                queues: 0,
                milestones: vec![None; self.sizes.len()],
            },
        );
        self.place(now, request.id);
    }

    fn decide(&mut self, now: Duration, worker: Worker, view: &View<'_>, out: &mut Decision) {
        self.refresh(now, view.profile);
        out.drops
            .extend(self.hopeless.drain(..).map(|id| (id, DropReason::Hopeless)));
        if worker != Worker::Idle {
            return;
        }
        self.update_scores(now);
        self.drop_late(now, out);
        if let Some(i) = self.candidate() {
            let batch = self.pop_batch(now, i);
            if !batch.is_empty() {
                out.batch = Some((self.sizes[i], batch));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serving::profile::LatencyBin;

    fn latency(bins: &[(f64, f64, f64)]) -> BatchLatency {
        let bins: Vec<LatencyBin> = bins
            .iter()
            .map(|&(lo_ms, hi_ms, mass)| LatencyBin { lo_ms, hi_ms, mass })
            .collect();
        let mean_ms = bins
            .iter()
            .map(|b| b.mass * (b.lo_ms + b.hi_ms) / 2.0)
            .sum();
        BatchLatency {
            min_ms: bins[0].lo_ms,
            quantile_ms: mean_ms,
            bins,
            mean_ms,
        }
    }

    /// Eq. 4.2 written out directly, with the anticipated delay integrated numerically:
    /// the reference the closed form must agree with.
    fn score_by_integration(l: &BatchLatency, slack_ms: f64, b: f64) -> f64 {
        // E[C_delay] - E[C_now] = P(L <= s < L + tau), tau ~ Exp(b), over E[L].
        let mut p = 0.0;
        for bin in &l.bins {
            let steps = 20_000;
            let w = bin.hi_ms - bin.lo_ms;
            for k in 0..steps {
                let x = bin.lo_ms + w * (k as f64 + 0.5) / steps as f64;
                if x <= slack_ms {
                    p += bin.mass / steps as f64 * (-b * (slack_ms - x)).exp();
                }
            }
        }
        p / l.mean_ms
    }

    #[test]
    fn closed_form_score_matches_eq_4_2_by_integration() {
        let b = 1e-2; // large, so the exponential matters
        let l = latency(&[(10.0, 20.0, 0.25), (40.0, 60.0, 0.75)]);
        let table = ScoreTable::new(&l, b);
        let deadline_rel = 500.0;
        for slack in [5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 100.0, 400.0] {
            let t_rel = deadline_rel - slack;
            let (p, _) = table.point(duration(slack), deadline_rel, b);
            let score = p.a * (b * t_rel).exp() + p.b;
            let want = score_by_integration(&l, slack, b);
            assert!(
                (score - want).abs() < 1e-4 * want.max(1e-3),
                "slack {slack}: closed form {score}, integral {want}"
            );
        }
    }

    #[test]
    fn milestones_are_the_bin_edges_below_the_slack() {
        let l = latency(&[(10.0, 20.0, 0.5), (40.0, 60.0, 0.5)]);
        let table = ScoreTable::new(&l, 1e-4);
        let next = |slack| table.point(duration(slack), 100.0, 1e-4).1;
        assert_eq!(next(100.0), Some(duration(60.0)));
        assert_eq!(next(50.0), Some(duration(40.0)));
        assert_eq!(next(40.0), Some(duration(20.0)));
        assert_eq!(next(10.0), None);
        let (p, _) = table.point(duration(5.0), 100.0, 1e-4);
        assert_eq!((p.a, p.b), (0.0, 0.0), "no chance left, no score");
    }

    #[test]
    fn a_point_mass_scores_like_a_vanishing_bin() {
        let b = 1e-3;
        let point = ScoreTable::new(&latency(&[(30.0, 30.0, 1.0)]), b);
        let thin = ScoreTable::new(&latency(&[(30.0, 30.0 + 1e-6, 1.0)]), b);
        let (p, _) = point.point(duration(80.0), 200.0, b);
        let (q, _) = thin.point(duration(80.0), 200.0, b);
        assert!((p.a - q.a).abs() < 1e-6 * p.a.abs(), "{p:?} vs {q:?}");
    }
}
