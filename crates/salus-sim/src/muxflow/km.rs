//! The Kuhn-Munkres (Hungarian) algorithm for maximum weight bipartite matching, as
//! MuxFlow's scheduler uses it (§5, Algorithm 1 line 10): rows are online workloads
//! (GPUs), columns offline workloads, a weight the predicted normalized throughput of the
//! offline workload beside the online one.
//!
//! The matrix may be rectangular (`n` rows, `m` columns). A pair whose weight is not
//! positive (or not finite) is never matched: leaving a GPU without an offline workload,
//! or an offline workload pending, is always allowed. That is the maximum weight
//! matching of the graph whose edges are the positive weights, found as the maximum
//! weight *perfect* matching of the matrix with those weights set to 0 (a zero edge in
//! the perfect matching is dropped from the answer). `O(k² · K)` time with
//! `k = min(n, m)`, `K = max(n, m)`: the shortest augmenting path form with potentials
//! (Jonker-Volgenant style) of the `O(|V|³)` algorithm the paper cites.

/// A maximum weight matching of `weights` (`weights[i][j]`: row `i` with column `j`;
/// every row the same length). Returns, per row, the column matched to it, if any. Only
/// pairs with a positive finite weight are matched.
pub fn max_weight_matching(weights: &[Vec<f64>]) -> Vec<Option<usize>> {
    let n = weights.len();
    let m = weights.first().map_or(0, Vec::len);
    if n == 0 || m == 0 {
        return vec![None; n];
    }
    let w = |i: usize, j: usize| {
        let x = weights[i].get(j).copied().unwrap_or(0.0);
        if x.is_finite() && x > 0.0 { x } else { 0.0 }
    };
    // Solve with the smaller side as rows: minimise the cost -w.
    let transpose = n > m;
    let (rows, cols) = if transpose { (m, n) } else { (n, m) };
    let cost = |r: usize, c: usize| if transpose { -w(c, r) } else { -w(r, c) };
    let assigned = hungarian_min(rows, cols, cost);
    let mut out = vec![None; n];
    for (r, c) in assigned.into_iter().enumerate() {
        let (i, j) = if transpose { (c, r) } else { (r, c) };
        if w(i, j) > 0.0 {
            out[i] = Some(j);
        }
    }
    out
}

/// The total weight of `matching` under `weights`.
pub fn matching_weight(weights: &[Vec<f64>], matching: &[Option<usize>]) -> f64 {
    matching
        .iter()
        .enumerate()
        .filter_map(|(i, j)| j.map(|j| weights[i][j]))
        .sum()
}

/// Minimum cost assignment of every one of `rows` rows to a distinct column of `cols`
/// (`rows <= cols`): the column of each row. Shortest augmenting paths with row and
/// column potentials; one row is added per phase, `O(rows² · cols)`.
fn hungarian_min(rows: usize, cols: usize, cost: impl Fn(usize, usize) -> f64) -> Vec<usize> {
    debug_assert!(rows <= cols);
    // 1-based with column 0 as the virtual start, as in the classic formulation.
    let mut u = vec![0.0f64; rows + 1];
    let mut v = vec![0.0f64; cols + 1];
    // p[j]: the row holding column j (0 = none); way[j]: previous column on the path.
    let mut p = vec![0usize; cols + 1];
    let mut way = vec![0usize; cols + 1];
    for i in 1..=rows {
        p[0] = i;
        let mut j0 = 0usize;
        let mut minv = vec![f64::INFINITY; cols + 1];
        let mut used = vec![false; cols + 1];
        loop {
            used[j0] = true;
            let i0 = p[j0];
            let mut delta = f64::INFINITY;
            let mut j1 = 0usize;
            for j in 1..=cols {
                if used[j] {
                    continue;
                }
                let reduced = cost(i0 - 1, j - 1) - u[i0] - v[j];
                if reduced < minv[j] {
                    minv[j] = reduced;
                    way[j] = j0;
                }
                if minv[j] < delta {
                    delta = minv[j];
                    j1 = j;
                }
            }
            for j in 0..=cols {
                if used[j] {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        // Flip the augmenting path.
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut row_to_col = vec![0usize; rows];
    for j in 1..=cols {
        if p[j] != 0 {
            row_to_col[p[j] - 1] = j - 1;
        }
    }
    row_to_col
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The best total over every matching (each row to a distinct column or to none).
    fn brute_force(weights: &[Vec<f64>]) -> f64 {
        fn go(weights: &[Vec<f64>], row: usize, used: &mut Vec<bool>) -> f64 {
            if row == weights.len() {
                return 0.0;
            }
            let mut best = go(weights, row + 1, used);
            for j in 0..used.len() {
                if !used[j] && weights[row][j] > 0.0 {
                    used[j] = true;
                    best = best.max(weights[row][j] + go(weights, row + 1, used));
                    used[j] = false;
                }
            }
            best
        }
        let m = weights.first().map_or(0, Vec::len);
        go(weights, 0, &mut vec![false; m])
    }

    fn valid(weights: &[Vec<f64>], matching: &[Option<usize>]) {
        assert_eq!(matching.len(), weights.len());
        let mut seen = std::collections::BTreeSet::new();
        for (i, j) in matching.iter().enumerate() {
            if let Some(j) = *j {
                assert!(seen.insert(j), "column {j} matched twice");
                assert!(weights[i][j] > 0.0, "non-positive pair ({i}, {j}) matched");
            }
        }
    }

    #[test]
    fn the_papers_example() {
        // Fig. 9: online A, B; offline C, D, E. Plan 1 (A-D, B-C) gives 1.6.
        let weights = vec![vec![0.3, 0.8, 0.5], vec![0.8, 0.6, 0.4]];
        let m = max_weight_matching(&weights);
        assert_eq!(m, vec![Some(1), Some(0)]);
        assert!((matching_weight(&weights, &m) - 1.6).abs() < 1e-12);
    }

    #[test]
    fn empty_and_non_positive() {
        assert_eq!(max_weight_matching(&[]), Vec::<Option<usize>>::new());
        assert_eq!(max_weight_matching(&[vec![], vec![]]), vec![None, None]);
        let weights = vec![vec![-1.0, 0.0], vec![f64::NAN, 2.0]];
        assert_eq!(max_weight_matching(&weights), vec![None, Some(1)]);
    }

    #[test]
    fn a_hundred_by_three_hundred_is_quick_and_valid() {
        let mut rng = crate::rng::Rng::new(3);
        let weights: Vec<Vec<f64>> = (0..100)
            .map(|_| (0..300).map(|_| rng.unit()).collect())
            .collect();
        let m = max_weight_matching(&weights);
        valid(&weights, &m);
        assert_eq!(m.iter().flatten().count(), 100);
        // No better than the per-row maxima, and at least the greedy matching.
        let upper: f64 = weights
            .iter()
            .map(|r| r.iter().copied().fold(0.0, f64::max))
            .sum();
        let mut taken = vec![false; 300];
        let mut greedy = 0.0;
        for row in &weights {
            let best = (0..300)
                .filter(|&j| !taken[j])
                .max_by(|&a, &b| row[a].total_cmp(&row[b]));
            if let Some(j) = best {
                taken[j] = true;
                greedy += row[j];
            }
        }
        let got = matching_weight(&weights, &m);
        assert!(
            got <= upper + 1e-9 && got >= greedy - 1e-9,
            "{greedy} {got} {upper}"
        );
    }

    fn matrix() -> impl Strategy<Value = Vec<Vec<f64>>> {
        (1usize..=6, 1usize..=6).prop_flat_map(|(n, m)| {
            // Integer weights (many ties) and some non-positive ones.
            proptest::collection::vec(
                proptest::collection::vec((-3i32..10).prop_map(f64::from), m),
                n,
            )
        })
    }

    fn real_matrix() -> impl Strategy<Value = Vec<Vec<f64>>> {
        (1usize..=7, 1usize..=7).prop_flat_map(|(n, m)| {
            proptest::collection::vec(proptest::collection::vec(0.0f64..1.0, m), n)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn matches_brute_force_on_integer_weights(weights in matrix()) {
            let m = max_weight_matching(&weights);
            valid(&weights, &m);
            let got = matching_weight(&weights, &m);
            prop_assert!((got - brute_force(&weights)).abs() < 1e-9);
        }

        #[test]
        fn matches_brute_force_on_real_weights(weights in real_matrix()) {
            let m = max_weight_matching(&weights);
            valid(&weights, &m);
            let got = matching_weight(&weights, &m);
            prop_assert!((got - brute_force(&weights)).abs() < 1e-9);
        }
    }
}
