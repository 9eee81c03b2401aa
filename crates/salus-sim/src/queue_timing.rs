//! ORLOJ's priority queue, timed (dissertation §4.5.5, Fig. 4.12): how long inserting a
//! request and finding the highest-priority one take with `n` requests pending.
//!
//! The one experiment measured in wall-clock time rather than simulated: it times
//! `salus-core`'s [`HullQueue`] on this machine. As in the dissertation, insertion is the
//! average over filling an empty queue to `n`; a query asks for the extreme point against
//! a line of random slope. Two more figures: replacing a point at `n` (a request's score
//! moves to its next case, or one leaves and another arrives: a removal and an
//! insertion), and the same with every point on the hull (points on a parabola), the
//! worst case for the hull's size.

use std::hint::black_box;
use std::time::Instant;

use salus_core::serving::{HullPoint, HullQueue};
use serde::Serialize;

use crate::experiments::TargetCheck;
use crate::rng::Rng;

/// Queue sizes timed.
pub const SIZES: [usize; 4] = [10, 100, 1_000, 10_000];

/// Timings at one queue size, in microseconds per operation.
#[derive(Debug, Clone, Serialize)]
pub struct QueueTiming {
    /// Requests in the queue.
    pub pending: usize,
    /// Filling an empty queue to `pending`, per insertion.
    pub insert_us: f64,
    /// Removing one point and inserting another at `pending`.
    pub replace_us: f64,
    /// The highest-priority point against a random slope.
    pub query_us: f64,
    /// Replacement with every point on the hull.
    pub replace_all_on_hull_us: f64,
    /// Query with every point on the hull.
    pub query_all_on_hull_us: f64,
}

fn score_like(rng: &mut Rng) -> HullPoint {
    // Coefficients like ORLOJ's: a time-varying part of either sign and a constant part.
    HullPoint::new(rng.uniform(-1.0, 1.0), rng.uniform(0.0, 1.0))
}

fn on_parabola(rng: &mut Rng) -> HullPoint {
    let a = rng.uniform(-1.0, 1.0);
    HullPoint::new(a, -a * a)
}

fn time_one(n: usize, rng: &mut Rng, point: fn(&mut Rng) -> HullPoint) -> (f64, f64, f64) {
    let mut queue = HullQueue::new();
    let points: Vec<HullPoint> = (0..n).map(|_| point(rng)).collect();
    let start = Instant::now();
    for (i, &p) in points.iter().enumerate() {
        queue.insert(i as u64, p);
    }
    let insert = start.elapsed().as_secs_f64() / n as f64;
    let rounds = 20_000;
    let fresh: Vec<HullPoint> = (0..rounds).map(|_| point(rng)).collect();
    let start = Instant::now();
    for (r, &p) in fresh.iter().enumerate() {
        let key = (r % n) as u64;
        queue.remove(&key);
        queue.insert(key, p);
    }
    let replace = start.elapsed().as_secs_f64() / rounds as f64;
    let slopes: Vec<f64> = (0..rounds).map(|_| rng.uniform(-3.0, 3.0)).collect();
    let start = Instant::now();
    for &x in &slopes {
        black_box(queue.best(x));
    }
    let query = start.elapsed().as_secs_f64() / rounds as f64;
    (insert * 1e6, replace * 1e6, query * 1e6)
}

/// Times the queue at every size of [`SIZES`].
pub fn queue_timing(seed: u64) -> Vec<QueueTiming> {
    let mut rng = Rng::new(seed);
    SIZES
        .iter()
        .map(|&n| {
            let (insert_us, replace_us, query_us) = time_one(n, &mut rng, score_like);
            let (_, replace_all, query_all) = time_one(n, &mut rng, on_parabola);
            QueueTiming {
                pending: n,
                insert_us,
                replace_us,
                query_us,
                replace_all_on_hull_us: replace_all,
                query_all_on_hull_us: query_all,
            }
        })
        .collect()
}

/// The target: insertion and query under 10 µs with 10,000 requests pending.
pub fn queue_targets(timings: &[QueueTiming]) -> Vec<TargetCheck> {
    let Some(at) = timings.iter().find(|t| t.pending == 10_000) else {
        return Vec::new();
    };
    let insert = at
        .insert_us
        .max(at.replace_us)
        .max(at.replace_all_on_hull_us);
    let query = at.query_us.max(at.query_all_on_hull_us);
    vec![
        TargetCheck::new(
            "insertion at 10,000 pending, slowest measure (us)",
            insert,
            "< 10",
            insert < 10.0,
        ),
        TargetCheck::new(
            "query at 10,000 pending, slowest measure (us)",
            query,
            "< 10",
            query < 10.0,
        ),
    ]
}
