#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

/// The brute-force reference: every point, looked at every time.
fn brute_max(points: &BTreeMap<u32, HullPoint>, dx: f64, dy: f64) -> Option<f64> {
    points
        .values()
        .map(|p| p.dot(dx, dy))
        .max_by(|a, b| a.total_cmp(b))
}

/// Checks the answers and the hull against the reference for a spread of directions.
fn check(queue: &HullQueue<u32>, points: &BTreeMap<u32, HullPoint>) {
    assert_eq!(queue.len(), points.len());
    let directions = [
        (0.0, 1.0),
        (1.0, 1.0),
        (-1.0, 1.0),
        (3.0, 1.0),
        (-3.0, 1.0),
        (0.25, 1.0),
        (-0.25, 1.0),
        (100.0, 1.0),
        (-100.0, 1.0),
        (1.0, 0.001),
        (-1.0, 0.001),
        (0.7, 1.3),
    ];
    for (dx, dy) in directions {
        let best = queue.extreme(dx, dy);
        match brute_max(points, dx, dy) {
            None => assert!(best.is_none()),
            Some(max) => {
                let key = best.unwrap();
                assert_eq!(
                    points[&key].dot(dx, dy),
                    max,
                    "direction ({dx}, {dy}): {key} is not extreme among {points:?}"
                );
            }
        }
    }
    // The walked hull is a concave chain of stored points with every point on or below
    // it.
    let hull = queue.hull();
    for (key, p) in &hull {
        assert_eq!(points.get(key), Some(p));
    }
    for w in hull.windows(2) {
        assert!(w[0].1.a <= w[1].1.a, "hull out of order: {hull:?}");
    }
    for w in hull.windows(3) {
        let (a, b, c) = (w[0].1, w[1].1, w[2].1);
        assert!(
            below(c, a, b) || a.a == b.a,
            "not strictly concave at {b:?}: {hull:?}"
        );
    }
    for p in points.values() {
        for w in hull.windows(2) {
            let (a, b) = (w[0].1, w[1].1);
            if a.a < b.a && a.a <= p.a && p.a <= b.a {
                assert!(!below(*p, b, a), "{p:?} above hull edge {a:?}-{b:?}");
            }
        }
    }
}

#[test]
fn empty_queue_has_no_best() {
    let q: HullQueue<u32> = HullQueue::new();
    assert!(q.best(1.0).is_none());
    assert!(q.is_empty());
    assert!(q.hull().is_empty());
}

#[test]
fn best_follows_the_direction() {
    let mut q = HullQueue::new();
    // Scores: 0·x + 10 (constant), 5·x + 0 (grows), 2·x + 6 (between).
    q.insert(1u32, HullPoint::new(0.0, 10.0));
    q.insert(2, HullPoint::new(5.0, 0.0));
    q.insert(3, HullPoint::new(2.0, 8.0));
    assert_eq!(q.best(0.5), Some(1));
    assert_eq!(q.best(1.5), Some(3));
    assert_eq!(q.best(3.0), Some(2));
    assert_eq!(q.hull().len(), 3);
    assert!(q.remove(&3));
    assert_eq!(q.best(1.5), Some(1));
    assert!(!q.remove(&3));
}

#[test]
fn insert_replaces_a_keys_point() {
    let mut q = HullQueue::new();
    q.insert(1u32, HullPoint::new(0.0, 1.0));
    q.insert(2, HullPoint::new(0.0, 2.0));
    assert_eq!(q.best(1.0), Some(2));
    q.insert(1, HullPoint::new(0.0, 3.0));
    assert_eq!(q.len(), 2);
    assert_eq!(q.best(1.0), Some(1));
    assert_eq!(q.get(&1), Some(HullPoint::new(0.0, 3.0)));
}

#[test]
fn duplicates_and_vertical_ties() {
    let mut q = HullQueue::new();
    let mut points = BTreeMap::new();
    for (k, (a, b)) in [
        (0.0, 0.0),
        (0.0, 0.0),
        (0.0, 3.0),
        (1.0, 1.0),
        (1.0, 1.0),
        (1.0, 4.0),
    ]
    .into_iter()
    .enumerate()
    {
        q.insert(k as u32, HullPoint::new(a, b));
        points.insert(k as u32, HullPoint::new(a, b));
        check(&q, &points);
    }
    for k in [5u32, 2, 0] {
        q.remove(&k);
        points.remove(&k);
        check(&q, &points);
    }
}

#[test]
fn sorted_insertions_stay_balanced() {
    let mut q = HullQueue::new();
    for i in 0..4096u32 {
        // Deadlines arrive in order, so points arrive sorted: the tree must rebalance.
        q.insert(i, HullPoint::new(-(i as f64), (i as f64).sqrt()));
    }
    assert!(q.height(q.root) <= 18, "height {}", q.height(q.root));
    for i in (0..4096u32).step_by(2) {
        q.remove(&i);
    }
    assert!(q.height(q.root) <= 17, "height {}", q.height(q.root));
}

#[test]
fn points_on_a_parabola_are_all_on_the_hull() {
    let mut q = HullQueue::new();
    for i in 0..200u32 {
        let a = i as f64;
        q.insert(i, HullPoint::new(a, -a * a));
    }
    assert_eq!(q.hull().len(), 200);
    // The extreme point in direction (x, 1) of b = -a² is a = x / 2.
    assert_eq!(q.best(60.0), Some(30));
}

#[test]
fn answers_depend_on_the_points_not_the_order_they_came_in() {
    // Many keys share points, and some values tie: any order of insertions and removals
    // that leaves the same set answers the same.
    let points: Vec<(u32, HullPoint)> = (0..300u32)
        .map(|k| (k, HullPoint::new((k % 7) as f64 - 3.0, (k % 5) as f64)))
        .collect();
    let mut forward = HullQueue::new();
    for &(k, p) in &points {
        forward.insert(k, p);
    }
    let mut backward = HullQueue::new();
    for &(k, p) in points.iter().rev() {
        backward.insert(k, HullPoint::new(9.0, 9.0));
        backward.insert(k, p);
    }
    for extra in 300..340u32 {
        backward.insert(extra, HullPoint::new(1.0, 1.0));
    }
    for extra in 300..340u32 {
        backward.remove(&extra);
    }
    for x in [-5.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 5.0] {
        assert_eq!(forward.best(x), backward.best(x), "x = {x}");
    }
    assert_eq!(forward.hull(), backward.hull());
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u32, i8, i8),
    Remove(u32),
}

fn ops(coords: i8) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => (0u32..64, -coords..=coords, -coords..=coords)
                .prop_map(|(k, a, b)| Op::Insert(k, a, b)),
            1 => (0u32..64).prop_map(Op::Remove),
        ],
        1..160,
    )
}

fn run(ops: Vec<Op>) {
    let mut q = HullQueue::new();
    let mut points = BTreeMap::new();
    for op in ops {
        match op {
            Op::Insert(k, a, b) => {
                let p = HullPoint::new(a as f64, b as f64);
                q.insert(k, p);
                points.insert(k, p);
            }
            Op::Remove(k) => {
                assert_eq!(q.remove(&k), points.remove(&k).is_some());
            }
        }
        check(&q, &points);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Small integer coordinates: many duplicates, shared abscissas and collinear points,
    /// every degenerate case of the bridge search. Exact in floating point.
    #[test]
    fn matches_brute_force_on_a_small_grid(ops in ops(3)) {
        run(ops);
    }

    #[test]
    fn matches_brute_force_on_a_tiny_grid(ops in ops(1)) {
        run(ops);
    }

    #[test]
    fn matches_brute_force_on_a_wide_grid(ops in ops(100)) {
        run(ops);
    }

    /// Points shaped like ORLOJ's: A tiny and of either sign, B of ordinary size.
    #[test]
    fn matches_brute_force_on_score_like_points(
        raw in prop::collection::vec((0u32..48, -1.0e3f64..1.0e3, 0.0f64..50.0), 1..120),
        x in 1.0f64..1.0e30,
    ) {
        let mut q = HullQueue::new();
        let mut points = BTreeMap::new();
        for (k, a, b) in raw {
            let p = HullPoint::new(a * 1e-30, b);
            q.insert(k, p);
            points.insert(k, p);
        }
        let key = q.best(x).unwrap();
        let max = brute_max(&points, x, 1.0).unwrap();
        let got = points[&key].dot(x, 1.0);
        prop_assert!((got - max).abs() <= 1e-9 * max.abs().max(1.0), "{} vs {}", got, max);
    }
}
