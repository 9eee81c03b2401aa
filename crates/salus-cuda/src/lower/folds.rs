//! Transposes folded into the products that read them: a `permute` that swaps the last two
//! dims (a linear layer's `weight.t()`, the transposed activations of a weight's gradient)
//! and is read only as a factor of `mm`, `addmm` or `bmm` on cuBLAS, or by such permutes in
//! turn (the backward's `weight.t().t()`), is not copied; each product reads the chain's
//! first source, with cuBLAS's transpose flag where the chain swaps an odd number of times
//! (PyTorch hands the strided view to cuBLAS the same way), and a chained permute that is
//! copied after all (something else reads it) copies from that source: a transpose of a
//! transpose becomes one straight copy.
//!
//! The permute's output keeps its planned bytes (the memory plan is the program's and
//! stays as it is); they are just never written or read. Folding needs the source's bytes
//! unchanged until the last product has read them: a persistent source always is (updates
//! are written after the last node), a lane source when no node from the permute to that
//! product writes over it (outputs or scratch; the product's own output included, since
//! the plan may give it the source's bytes once the permute has read them).

use salus_exec::{Location, Program};
use salus_graph::{DType, Op, OpParams};

use super::epilogues::Epilogues;
use super::fusion::{lane_range, node_writes, overlaps, read_at_end, tensor_readers};

/// The permutes not copied and the sources their outputs stand for.
#[derive(Debug, Clone, Default)]
pub(crate) struct Folds {
    /// Per node: a folded permute, lowered to nothing.
    skip: Vec<bool>,
    /// Per tensor: a folded permute's output reads as this source, transposed or not.
    source: Vec<Option<(usize, bool)>>,
}

impl Folds {
    /// Nothing folded.
    #[cfg(test)]
    pub(crate) fn none() -> Folds {
        Folds::default()
    }

    /// Whether node `index` is a folded permute.
    pub(crate) fn skips(&self, index: usize) -> bool {
        self.skip.get(index).copied().unwrap_or(false)
    }

    /// What tensor `id` reads as when it is a folded permute's output: a source, and
    /// whether its last two dims are swapped.
    pub(crate) fn source(&self, id: usize) -> Option<(usize, bool)> {
        self.source.get(id).copied().flatten()
    }
}

/// Whether `dims` keeps the leading dims and swaps the last two.
fn swaps_last_two(dims: &[usize]) -> bool {
    let r = dims.len();
    r >= 2 && dims[r - 2] == r - 1 && dims[r - 1] == r - 2 && (0..r - 2).all(|d| dims[d] == d)
}

/// What the planner knows about one program.
struct Facts<'p> {
    program: &'p Program,
    readers: Vec<Vec<usize>>,
    writes: Vec<Vec<std::ops::Range<u64>>>,
    /// Per tensor: the permute swapping the last two dims that makes it, when it may fold
    /// (not a view already, not fetched or written back, read by something).
    transpose_of: Vec<Option<usize>>,
    /// Per permute node: folds (memo).
    decided: Vec<Option<bool>>,
}

impl Facts<'_> {
    fn input(&self, node: usize) -> usize {
        self.program.graph().nodes[node].inputs[0].unwrap_or(usize::MAX)
    }

    fn output(&self, node: usize) -> usize {
        self.program.graph().nodes[node].outputs[0].unwrap_or(usize::MAX)
    }

    /// The chain of foldable transposes ending at permute `p`: its first source, whether
    /// `p`'s output is that source transposed, and the first permute's index.
    fn root(&self, p: usize) -> (usize, bool, usize) {
        let s = self.input(p);
        match self.transpose_of[s] {
            Some(q) => {
                let (root, transposed, first) = self.root(q);
                (root, !transposed, first)
            }
            None => (s, true, p),
        }
    }

    /// Whether `root`'s bytes stay as they are from node `first` to node `last`.
    fn intact(&self, root: usize, first: usize, last: usize) -> bool {
        match self.program.location(root) {
            Some(Location::Persistent(_)) => true,
            Some(Location::Lane(off)) => {
                let bytes = off..off + self.program.bytes(root);
                (first + 1..=last).all(|m| self.writes[m].iter().all(|w| !overlaps(w, &bytes)))
            }
            None => false,
        }
    }

    /// Whether node `c` can read tensor `o` (`rank` dims) as a factor of a product cuBLAS
    /// runs, and nothing else of it.
    fn factor_of(&self, c: usize, o: usize, rank: usize) -> bool {
        let graph = self.program.graph();
        let layout = &self.program.layouts()[c];
        let consumer = &graph.nodes[c];
        let (factors, factor_rank) = match consumer.op {
            Op::Mm => (0..2, 2),
            Op::Addmm => (1..3, 2),
            Op::Bmm => (0..2, 3),
            _ => return false,
        };
        let dtype = graph.tensors[o].ty.dtype;
        let operands = consumer.inputs.iter().chain(&consumer.outputs).flatten();
        let on_cublas = matches!(dtype, DType::F32 | DType::F16 | DType::Bf16)
            && operands
                .clone()
                .all(|&t| graph.tensors[t].ty.dtype == dtype)
            && operands
                .clone()
                .all(|&t| !graph.tensors[t].ty.shape.contains(&0));
        let as_factor_only = consumer
            .inputs
            .iter()
            .enumerate()
            .all(|(slot, t)| *t != Some(o) || factors.contains(&slot));
        rank == factor_rank && on_cublas && as_factor_only && !layout.skip && layout.error.is_none()
    }

    /// Whether permute `p` folds: each reader of its output is a product that can take it
    /// as a factor, or a permute that folds, with the chain's source intact until then.
    fn folds(&mut self, p: usize) -> bool {
        if let Some(d) = self.decided[p] {
            return d;
        }
        let o = self.output(p);
        let rank = self.program.graph().tensors[o].ty.shape.len();
        let (root, _, first) = self.root(p);
        let readers = self.readers[o].clone();
        // A chained permute reads the chain's source whether it folds or is copied.
        let ok = readers.iter().all(|&c| {
            let chained = self.transpose_of[self.output(c)].is_some() && self.input(c) == o;
            (chained || self.factor_of(c, o, rank)) && self.intact(root, first, c)
        });
        self.decided[p] = Some(ok);
        ok
    }
}

/// The transposes of `program` to fold (see the module doc). A producer with an epilogue
/// writes its add's output when it runs (`epilogues`), so that is among its writes.
pub(crate) fn plan(program: &Program, epilogues: &Epilogues) -> Folds {
    let graph = program.graph();
    let layouts = program.layouts();
    let readers = tensor_readers(graph);
    let read_at_end = read_at_end(graph);
    let mut transpose_of = vec![None; graph.tensors.len()];
    for (p, node) in graph.nodes.iter().enumerate() {
        let layout = &layouts[p];
        let OpParams::Permute { dims } = program.params(p) else {
            continue;
        };
        let (Some(Some(s)), Some(Some(o))) = (node.inputs.first(), node.outputs.first()) else {
            continue;
        };
        if node.op == Op::Permute
            && !layout.skip
            && layout.error.is_none()
            && swaps_last_two(dims)
            && !read_at_end.contains(o)
            && !readers[*o].is_empty()
            && !graph.tensors[*s].ty.shape.contains(&0)
        {
            transpose_of[*o] = Some(p);
        }
    }
    let mut writes = node_writes(program);
    for (p, w) in writes.iter_mut().enumerate() {
        if let Some(bytes) = epilogues.of(p).and_then(|e| lane_range(program, e.out)) {
            w.push(bytes);
        }
    }
    let mut facts = Facts {
        program,
        readers,
        writes,
        transpose_of,
        decided: vec![None; graph.nodes.len()],
    };
    let mut folds = Folds {
        skip: vec![false; graph.nodes.len()],
        source: vec![None; graph.tensors.len()],
    };
    for o in 0..graph.tensors.len() {
        let Some(p) = facts.transpose_of[o] else {
            continue;
        };
        if facts.folds(p) {
            let (root, transposed, _) = facts.root(p);
            folds.skip[p] = true;
            folds.source[o] = Some((root, transposed));
        }
    }
    folds
}
