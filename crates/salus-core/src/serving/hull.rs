//! The dynamic convex hull behind ORLOJ's priority queues (dissertation §4.4.4).
//!
//! Between two of its milestones a pending request's score is `A·x + B` with `x = e^(b·t)`
//! (Eq. 4.2 summed over the histogram bins), so the request with the highest score at
//! time `t` is the point `(A, B)` that is extreme in direction `(x, 1)`: a vertex of the
//! *upper* convex hull of all pending requests' points. [`HullQueue`] keeps that hull as
//! requests come and go and answers "which point is extreme in this direction" in
//! `O(log n)`.
//!
//! The structure is Overmars and van Leeuwen's, in the form that stores only bridges: a
//! leaf-oriented AVL tree over the distinct points in `(A, B)` order, where every internal
//! node keeps the *bridge* of its subtree's upper hull, the edge that joins the part of
//! the left child's hull that survives to the part of the right child's hull that
//! survives. A subtree's hull is therefore never stored: it is the left child's hull up
//! to the bridge, then the right child's hull from the bridge, recursively, and it is
//! walked by descending the tree. A query descends once from the root (`O(log n)`); an
//! update rebuilds the bridges of the `O(log n)` ancestors of the changed leaf, each found
//! by a simultaneous descent of both children (`O(log n)`), so `O(log² n)` in all. The
//! dissertation's implementation keeps concatenable queues of hull vertices to the same
//! bounds; bridges alone need no second tree.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

#[cfg(test)]
mod tests;

const NIL: u32 = u32::MAX;

/// A point of the plane: a request's score is `a·x + b` at `x = e^(b·t)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HullPoint {
    /// Coefficient of the time-varying part.
    pub a: f64,
    /// The constant part.
    pub b: f64,
}

impl HullPoint {
    /// A point.
    pub fn new(a: f64, b: f64) -> Self {
        HullPoint { a, b }
    }

    /// The point's value in direction `(dx, dy)`.
    pub fn dot(self, dx: f64, dy: f64) -> f64 {
        dx * self.a + dy * self.b
    }
}

#[derive(Debug, Clone)]
struct Node {
    /// Children; `NIL` for a leaf.
    left: u32,
    right: u32,
    /// 1 for a leaf.
    height: u32,
    /// A leaf's point; an internal node's largest point in tree order (what routing
    /// compares against).
    point: HullPoint,
    /// An internal node's bridge: a leaf of the left subtree and a leaf of the right
    /// subtree, adjacent on this subtree's upper hull.
    bridge: (u32, u32),
}

/// Where a descent stands in the hull of a subtree: the hull vertices of `node`'s
/// subtree with keys between `lo` and `hi` (leaves; `NIL` for unbounded) are the
/// candidates left.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    node: u32,
    lo: u32,
    hi: u32,
}

/// What a cursor shows once it has descended to where its candidates split.
#[derive(Debug, Clone, Copy)]
enum Candidates {
    /// One vertex is left.
    Vertex(u32),
    /// An edge of the hull between two leaves: the candidates are this edge's left end
    /// and what lies left of it, or its right end and what lies right of it.
    Edge(u32, u32),
}

/// A set of keyed points that answers "which point maximizes `x·a + b`" in `O(log n)`,
/// with insertion and removal in `O(log² n)`: ORLOJ's priority queue.
///
/// Keys with the same point share one leaf, so the tree holds distinct points and its
/// answers depend only on the set of points, never on the order they came in: among
/// points of equal value the one with the smaller `a` wins, and among keys of one point
/// the smallest key.
#[derive(Debug, Clone)]
pub struct HullQueue<K> {
    nodes: Vec<Node>,
    free: Vec<u32>,
    root: u32,
    points: HashMap<K, HullPoint>,
    /// The keys of each distinct point, by the point's bits.
    keys: HashMap<(u64, u64), BTreeSet<K>>,
}

fn bits(p: HullPoint) -> (u64, u64) {
    (p.a.to_bits(), p.b.to_bits())
}

impl<K: Copy + Ord + Hash> Default for HullQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Ord + Hash> HullQueue<K> {
    /// An empty queue.
    pub fn new() -> Self {
        HullQueue {
            nodes: Vec::new(),
            free: Vec::new(),
            root: NIL,
            points: HashMap::new(),
            keys: HashMap::new(),
        }
    }

    /// How many points the queue holds.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// True when the queue holds no point.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// The point stored under `key`.
    pub fn get(&self, key: &K) -> Option<HullPoint> {
        self.points.get(key).copied()
    }

    /// Puts `point` under `key`, replacing the key's previous point.
    pub fn insert(&mut self, key: K, point: HullPoint) {
        // One zero: -0.0 and 0.0 are the same point.
        let point = HullPoint::new(point.a + 0.0, point.b + 0.0);
        if let Some(old) = self.points.insert(key, point) {
            self.forget(key, old);
        }
        let keys = self.keys.entry(bits(point)).or_default();
        keys.insert(key);
        if keys.len() > 1 {
            return;
        }
        let leaf = self.alloc(Node {
            left: NIL,
            right: NIL,
            height: 1,
            point,
            bridge: (NIL, NIL),
        });
        self.root = if self.root == NIL {
            leaf
        } else {
            self.insert_at(self.root, leaf)
        };
    }

    /// Removes `key`'s point; false when there was none.
    pub fn remove(&mut self, key: &K) -> bool {
        let Some(point) = self.points.remove(key) else {
            return false;
        };
        self.forget(*key, point);
        true
    }

    /// Takes `key` off `point`'s keys, and the point out of the tree when it was the last.
    fn forget(&mut self, key: K, point: HullPoint) {
        let Some(keys) = self.keys.get_mut(&bits(point)) else {
            return;
        };
        keys.remove(&key);
        if keys.is_empty() {
            self.keys.remove(&bits(point));
            self.root = self.remove_at(self.root, point);
        }
    }

    /// Removes every point.
    pub fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.points.clear();
        self.keys.clear();
        self.root = NIL;
    }

    /// The key whose point maximizes `x·a + b`; `None` when empty.
    pub fn best(&self, x: f64) -> Option<K> {
        self.extreme(x, 1.0)
    }

    /// The key whose point maximizes `dx·a + dy·b`, for any direction with `dy > 0` (the
    /// directions the upper hull answers).
    pub fn extreme(&self, dx: f64, dy: f64) -> Option<K> {
        if self.root == NIL {
            return None;
        }
        let mut cursor = self.cursor(self.root);
        loop {
            match self.settle(&mut cursor) {
                Candidates::Vertex(v) => return self.key_of(v),
                Candidates::Edge(p, q) => {
                    if self.at(q).dot(dx, dy) > self.at(p).dot(dx, dy) {
                        self.go_right(&mut cursor, q);
                    } else {
                        self.go_left(&mut cursor, p);
                    }
                }
            }
        }
    }

    /// The vertices of the upper hull, left to right: for tests and diagnostics (it walks
    /// the whole hull, `O(h log n)`).
    pub fn hull(&self) -> Vec<(K, HullPoint)> {
        let mut out = Vec::new();
        if self.root != NIL {
            self.walk(self.cursor(self.root), &mut out);
        }
        out
    }

    /// The smallest key of a leaf's point.
    fn key_of(&self, leaf: u32) -> Option<K> {
        let keys = self.keys.get(&bits(self.at(leaf)))?;
        keys.first().copied()
    }

    fn walk(&self, cursor: Cursor, out: &mut Vec<(K, HullPoint)>) {
        let mut c = cursor;
        match self.settle(&mut c) {
            Candidates::Vertex(v) => {
                if let Some(key) = self.key_of(v) {
                    out.push((key, self.at(v)));
                }
            }
            Candidates::Edge(p, q) => {
                let (mut left, mut right) = (c, c);
                self.go_left(&mut left, p);
                self.go_right(&mut right, q);
                self.walk(left, out);
                self.walk(right, out);
            }
        }
    }

    fn alloc(&mut self, node: Node) -> u32 {
        if let Some(i) = self.free.pop() {
            self.nodes[i as usize] = node;
            i
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        }
    }

    fn release(&mut self, i: u32) {
        self.free.push(i);
    }

    fn at(&self, i: u32) -> HullPoint {
        self.nodes[i as usize].point
    }

    fn is_leaf(&self, i: u32) -> bool {
        self.nodes[i as usize].left == NIL
    }

    fn height(&self, i: u32) -> u32 {
        self.nodes[i as usize].height
    }

    /// Tree order of a point against node `j`'s (a leaf's own, an internal node's
    /// largest).
    fn order_of(&self, point: HullPoint, j: u32) -> Ordering {
        let other = self.at(j);
        point
            .a
            .total_cmp(&other.a)
            .then(point.b.total_cmp(&other.b))
    }

    fn order(&self, i: u32, j: u32) -> Ordering {
        self.order_of(self.at(i), j)
    }

    fn insert_at(&mut self, node: u32, leaf: u32) -> u32 {
        if self.is_leaf(node) {
            let (left, right) = if self.order(leaf, node) == Ordering::Less {
                (leaf, node)
            } else {
                (node, leaf)
            };
            let parent = self.alloc(Node {
                left,
                right,
                height: 2,
                point: self.at(right),
                bridge: (NIL, NIL),
            });
            self.update(parent);
            return parent;
        }
        let left = self.nodes[node as usize].left;
        if self.order(leaf, left) != Ordering::Greater {
            let child = self.insert_at(left, leaf);
            self.nodes[node as usize].left = child;
        } else {
            let right = self.nodes[node as usize].right;
            let child = self.insert_at(right, leaf);
            self.nodes[node as usize].right = child;
        }
        self.rebalance(node)
    }

    fn remove_at(&mut self, node: u32, point: HullPoint) -> u32 {
        if self.is_leaf(node) {
            debug_assert!(
                bits(self.at(node)) == bits(point),
                "routed to the wrong leaf"
            );
            self.release(node);
            return NIL;
        }
        let Node { left, right, .. } = self.nodes[node as usize];
        let go_left = self.order_of(point, left) != Ordering::Greater;
        let (child, sibling) = if go_left {
            (left, right)
        } else {
            (right, left)
        };
        let rest = self.remove_at(child, point);
        if rest == NIL {
            self.release(node);
            return sibling;
        }
        if go_left {
            self.nodes[node as usize].left = rest;
        } else {
            self.nodes[node as usize].right = rest;
        }
        self.rebalance(node)
    }

    fn rebalance(&mut self, node: u32) -> u32 {
        let Node { left, right, .. } = self.nodes[node as usize];
        let (hl, hr) = (self.height(left), self.height(right));
        if hl > hr + 1 {
            let Node {
                left: ll,
                right: lr,
                ..
            } = self.nodes[left as usize];
            if self.height(ll) < self.height(lr) {
                let rotated = self.rotate_left(left);
                self.nodes[node as usize].left = rotated;
            }
            return self.rotate_right(node);
        }
        if hr > hl + 1 {
            let Node {
                left: rl,
                right: rr,
                ..
            } = self.nodes[right as usize];
            if self.height(rr) < self.height(rl) {
                let rotated = self.rotate_right(right);
                self.nodes[node as usize].right = rotated;
            }
            return self.rotate_left(node);
        }
        self.update(node);
        node
    }

    fn rotate_right(&mut self, node: u32) -> u32 {
        let pivot = self.nodes[node as usize].left;
        self.nodes[node as usize].left = self.nodes[pivot as usize].right;
        self.update(node);
        self.nodes[pivot as usize].right = node;
        self.update(pivot);
        pivot
    }

    fn rotate_left(&mut self, node: u32) -> u32 {
        let pivot = self.nodes[node as usize].right;
        self.nodes[node as usize].right = self.nodes[pivot as usize].left;
        self.update(node);
        self.nodes[pivot as usize].left = node;
        self.update(pivot);
        pivot
    }

    /// Recomputes an internal node from its children: height, largest key, bridge.
    fn update(&mut self, node: u32) {
        let Node { left, right, .. } = self.nodes[node as usize];
        let height = 1 + self.height(left).max(self.height(right));
        let point = self.at(right);
        let bridge = self.find_bridge(left, right);
        let n = &mut self.nodes[node as usize];
        n.height = height;
        n.point = point;
        n.bridge = bridge;
    }

    fn cursor(&self, node: u32) -> Cursor {
        Cursor {
            node,
            lo: NIL,
            hi: NIL,
        }
    }

    /// Descends past nodes whose bridge lies outside the cursor's bounds, to the vertex or
    /// the edge where its candidates split.
    fn settle(&self, c: &mut Cursor) -> Candidates {
        loop {
            let node = &self.nodes[c.node as usize];
            if node.left == NIL {
                return Candidates::Vertex(c.node);
            }
            let (p, q) = node.bridge;
            if c.hi != NIL && self.order(c.hi, p) != Ordering::Greater {
                c.node = node.left;
            } else if c.lo != NIL && self.order(c.lo, q) != Ordering::Less {
                c.node = node.right;
            } else {
                return Candidates::Edge(p, q);
            }
        }
    }

    /// Keeps the candidates at or left of `p`, the left end of the cursor's edge.
    fn go_left(&self, c: &mut Cursor, p: u32) {
        c.node = self.nodes[c.node as usize].left;
        c.hi = p;
    }

    /// Keeps the candidates at or right of `q`, the right end of the cursor's edge.
    fn go_right(&self, c: &mut Cursor, q: u32) {
        c.node = self.nodes[c.node as usize].right;
        c.lo = q;
    }

    /// The bridge of the upper hulls of two subtrees, every point of `left` before every
    /// point of `right`: a simultaneous descent of both hulls that discards, at each step,
    /// part of one hull or of both (Overmars and van Leeuwen's case analysis).
    fn find_bridge(&self, left: u32, right: u32) -> (u32, u32) {
        // Every point of the left hull lies at or left of this abscissa.
        let split = self.at(left).a;
        let mut l = self.cursor(left);
        let mut r = self.cursor(right);
        loop {
            match (self.settle(&mut l), self.settle(&mut r)) {
                (Candidates::Vertex(a), Candidates::Vertex(c)) => return (a, c),
                (Candidates::Vertex(a), Candidates::Edge(c, d)) => {
                    // The bridge's right end is the tangent point from `a`; when `a`, `c`
                    // and `d` are collinear, `c` lies between and is no vertex.
                    if below(self.at(a), self.at(c), self.at(d)) {
                        self.go_left(&mut r, c);
                    } else {
                        self.go_right(&mut r, d);
                    }
                }
                (Candidates::Edge(a, b), Candidates::Vertex(c)) => {
                    // The bridge's left end is the tangent point from `c`.
                    if below(self.at(c), self.at(a), self.at(b)) {
                        self.go_right(&mut l, b);
                    } else {
                        self.go_left(&mut l, a);
                    }
                }
                (Candidates::Edge(a, b), Candidates::Edge(c, d)) => {
                    let (pa, pb, pc, pd) = (self.at(a), self.at(b), self.at(c), self.at(d));
                    // A point of the right hull on or above the line of edge ab: b is no
                    // vertex of the merged hull, so the bridge leaves the left hull at or
                    // before a.
                    let left_before = !below(pc, pa, pb) || !below(pd, pa, pb);
                    // A point of the left hull on or above the line of cd: the bridge
                    // reaches the right hull at or after d.
                    let right_after = !below(pa, pc, pd) || !below(pb, pc, pd);
                    // Both may hold; only one is applied, because when b and c are the
                    // same point each rule drops a different copy of it.
                    if left_before {
                        self.go_left(&mut l, a);
                    } else if right_after {
                        self.go_right(&mut r, d);
                    } else if meet_left_of(pa, pb, pc, pd, split) {
                        // Each line passes above the other edge: ab is steeper than cd.
                        // Where the two lines meet tells which side one of the bridge's
                        // ends certainly lies on.
                        self.go_right(&mut l, b);
                    } else {
                        self.go_left(&mut r, c);
                    }
                }
            }
        }
    }
}

/// True when `p` lies strictly below the line through `a` and `b` (`a` before `b`); for
/// an upward vertical `a → b`, strictly right of it. Hulls are kept strict (no vertex on
/// the segment between its neighbours, no duplicate vertex), so that along a hull the
/// value in any direction rises, peaks once and falls.
fn below(p: HullPoint, a: HullPoint, b: HullPoint) -> bool {
    (b.a - a.a) * (p.b - a.b) - (b.b - a.b) * (p.a - a.a) < 0.0
}

/// Whether the lines through `a, b` and through `c, d` meet at or left of `split` (taken
/// as true for parallel lines, which the callers' case rules out).
fn meet_left_of(a: HullPoint, b: HullPoint, c: HullPoint, d: HullPoint, split: f64) -> bool {
    let (d1a, d1b) = (b.a - a.a, b.b - a.b);
    let (d2a, d2b) = (d.a - c.a, d.b - c.b);
    let den = d1a * d2b - d1b * d2a;
    if den == 0.0 {
        return true;
    }
    let t = ((c.a - a.a) * d2b - (c.b - a.b) * d2a) / den;
    a.a + t * d1a <= split
}
