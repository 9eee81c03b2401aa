//! Transposes folded into the products that read them: a `permute` that swaps the last two
//! dims (a linear layer's `weight.t()`, the transposed activations of a weight's gradient)
//! and is read only as a factor of `mm`, `addmm` or `bmm` on cuBLAS, or by such permutes in
//! turn (the backward's `weight.t().t()`), is not copied; each product reads the chain's
//! first source, with cuBLAS's transpose flag where the chain swaps an odd number of times
//! (PyTorch hands the strided view to cuBLAS the same way), and a chained permute that is
//! copied after all (something else reads it) copies from that source: a transpose of a
//! transpose becomes one straight copy.
//!
//! A `permute` whose input is a `view` of one output of a `split_with_sizes` (attention's
//! query, key and value cut from one projection, then put heads first), each read by
//! nothing else, copies straight from the split's source through the strided view that the
//! split and the view make of it; the split then does not write that output. This needs
//! the source's bytes unchanged from the split to the permute, checked as below.
//!
//! Its mirror in the backward: a `cat` input that is a `view` of a `permute`'s output
//! (each head's gradient put back as `[B, S, H, D]`, viewed as `[B, S, H*D]` and cat into
//! the projection's gradient), each read by nothing else: the permute is not run, and the
//! cat copies from the permute's source into its output, walking the permute's shape on
//! both sides. This needs the permute's source unchanged from the permute to the cat.
//!
//! A `full` or `full_like` read only by a scatter or `index_put` that starts from it (as
//! cross-entropy's backward starts from zeros) is not run: the scatter fills its output
//! with the value instead of copying the fill's output there.
//!
//! The split and cat folds are found from the graph alone ([`extra_reads`]), so the CUDA device's memory plan
//! keeps each source live until its folded reader (the planner would otherwise give its
//! bytes to a later tensor, often the cat's own output); whether they fold is decided on
//! the plan, as below.
//!
//! The permute's output keeps its planned bytes (the memory plan is the program's and
//! stays as it is); they are just never written or read. Folding needs the source's bytes
//! unchanged until the last product has read them: a persistent source always is (updates
//! are written after the last node), a lane source when no node from the permute to that
//! product writes over it (outputs or scratch; the product's own output included, since
//! the plan may give it the source's bytes once the permute has read them).

use salus_exec::{Location, Program};
use salus_graph::{DType, Graph, Op, OpParams};

use super::contiguous;

use super::epilogues::Epilogues;
use super::fusion::{
    lane_range, node_writes, overlaps, read_at_end, tensor_producers, tensor_readers,
};

/// The permutes not copied and the sources their outputs stand for.
#[derive(Debug, Clone, Default)]
pub(crate) struct Folds {
    /// Per node: a folded permute, lowered to nothing.
    skip: Vec<bool>,
    /// Per tensor: a folded permute's output reads as this source, transposed or not.
    source: Vec<Option<(usize, bool)>>,
    /// Per tensor: a split output's view that its permute reads from the split's source.
    view: Vec<Option<StridedSource>>,
    /// Per tensor: a split output that is not written (its permute reads the source).
    unwritten: Vec<bool>,
    /// Per tensor: a fill's output that is not written, its value (its one reader, a
    /// scatter or `index_put` that would copy it into its output first, fills it instead).
    constant: Vec<Option<f64>>,
}

/// Where a tensor's elements are in another's: `root`'s element `offset`, then `strides`
/// (in elements) along the dims of `shape`, which has the tensor's elements in row-major
/// order (the tensor's own shape, or one it is a view of).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StridedSource {
    pub(crate) root: usize,
    pub(crate) offset: u64,
    pub(crate) strides: Vec<i64>,
    pub(crate) shape: Vec<u64>,
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

    /// Where tensor `id` is read from when it is a split output's view that its permute
    /// reads from the split's source.
    pub(crate) fn strided_source(&self, id: usize) -> Option<&StridedSource> {
        self.view.get(id).and_then(Option::as_ref)
    }

    /// Whether split output `id` is left unwritten.
    pub(crate) fn unwritten(&self, id: usize) -> bool {
        self.unwritten.get(id).copied().unwrap_or(false)
    }

    /// The value of tensor `id` when it is a fill's output left unwritten.
    pub(crate) fn constant(&self, id: usize) -> Option<f64> {
        self.constant.get(id).copied().flatten()
    }
}

/// The strides that view the elements of a tensor of `shape`, laid out with `strides`, as
/// a tensor of shape `out`, where one strided view can (dims split or merged only within
/// runs of elements evenly spaced); `None` otherwise, as `Tensor.view` refuses.
pub(crate) fn view_strides(shape: &[u64], strides: &[i64], out: &[u64]) -> Option<Vec<i64>> {
    if shape.contains(&0) || out.contains(&0) || shape.is_empty() {
        return None;
    }
    let mut result = vec![0i64; out.len()];
    let mut next = out.len();
    let mut base = *strides.last()?;
    let (mut run, mut viewed) = (1u64, 1u64);
    for d in (0..shape.len()).rev() {
        run *= shape[d];
        // Dims d.. end a run of evenly spaced elements here.
        if d == 0 || (shape[d - 1] != 1 && strides[d - 1] != run as i64 * base) {
            while next > 0 && (viewed < run || out[next - 1] == 1) {
                next -= 1;
                result[next] = viewed as i64 * base;
                viewed *= out[next];
            }
            if viewed != run {
                return None;
            }
            if d > 0 {
                (base, run, viewed) = (strides[d - 1], 1, 1);
            }
        }
    }
    (next == 0).then_some(result)
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
        view: vec![None; graph.tensors.len()],
        unwritten: vec![false; graph.tensors.len()],
        constant: vec![None; graph.tensors.len()],
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
    let clean = |n: usize| layouts[n].error.is_none() && !layouts[n].skip;
    for c in candidates(graph, program.node_params()) {
        let root = c.source.root;
        let ok = layouts[c.view].skip
            && clean(c.from)
            && clean(c.reader)
            && c.skipped.is_none_or(|p| !folds.skip[p])
            && !folds.skip[c.reader]
            && folds.source(root).is_none()
            && folds.strided_source(root).is_none()
            && !folds.unwritten(root)
            && facts.intact(root, c.from, c.reader);
        if !ok {
            continue;
        }
        if let Some(p) = c.skipped {
            folds.skip[p] = true;
        }
        if let Some(u) = c.unwritten {
            folds.unwritten[u] = true;
        }
        folds.view[c.tensor] = Some(c.source);
    }
    let producers = tensor_producers(graph);
    for (n, node) in graph.nodes.iter().enumerate() {
        let starts_from_copy = matches!(
            node.op,
            Op::ScatterValue | Op::ScatterAdd | Op::ScatterSrc | Op::ScatterReduce | Op::IndexPut
        );
        let (Some(Some(a)), Some(Some(o))) = (node.inputs.first(), node.outputs.first()) else {
            continue;
        };
        let Some(f) = producers[*a].filter(|_| starts_from_copy && clean(n)) else {
            continue;
        };
        if let OpParams::Fill { value, .. } = program.params(f)
            && matches!(graph.nodes[f].op, Op::Full | Op::FullLike)
            && clean(f)
            && facts.readers[*a] == [n]
            && !read_at_end.contains(a)
            && graph.tensors[*a].ty == graph.tensors[*o].ty
        {
            folds.skip[f] = true;
            folds.constant[*a] = Some(value.as_f64());
        }
    }
    folds
}

/// A layout copy its reader can do instead, found from the graph alone: `reader` reads
/// `tensor` (made by `view`) from `source`, the copy that made it or its input (node
/// `from` on) no longer needed. The plan must keep `source`'s bytes intact from `from` to
/// `reader` ([`extra_reads`] asks the planner to).
#[derive(Debug)]
struct Candidate {
    reader: usize,
    tensor: usize,
    view: usize,
    from: usize,
    /// The permute not run (the reader copies from its source).
    skipped: Option<usize>,
    /// The split output not written (the reader copies from the split's source).
    unwritten: Option<usize>,
    source: StridedSource,
}

/// The copies the CUDA lowering may fold for `graph`, as the memory plan should see them:
/// each folded reader reads its source until it runs.
pub(crate) fn extra_reads(graph: &Graph, params: &[OpParams]) -> Vec<(usize, usize)> {
    candidates(graph, params)
        .into_iter()
        .map(|c| (c.reader, c.source.root))
        .collect()
}

/// In program order: per permute, a heads-first split ([`split_view`]); per cat input, a
/// permute's view ([`cat_view`]). A permute that is both is left to the cat.
fn candidates(graph: &Graph, params: &[OpParams]) -> Vec<Candidate> {
    let readers = tensor_readers(graph);
    let producers = tensor_producers(graph);
    let at_end = read_at_end(graph);
    let only = |id: usize, reader: usize| readers[id] == [reader] && !at_end.contains(&id);
    let mut found = Vec::new();
    for (c, node) in graph.nodes.iter().enumerate() {
        if node.op == Op::Cat {
            for &t in node.inputs.iter().flatten() {
                found.extend(cat_view(graph, params, &producers, &only, c, t));
            }
        }
    }
    let taken: Vec<usize> = found.iter().filter_map(|c| c.skipped).collect();
    for p in (0..graph.nodes.len()).filter(|p| !taken.contains(p)) {
        found.extend(split_view(graph, params, &producers, &only, p));
    }
    found
}

/// A permute `p` that reads a view `t` of split output `u`, each read by nothing else: `p`
/// copies `t` straight from the split's source, and the split does not write `u`.
fn split_view(
    graph: &Graph,
    params: &[OpParams],
    producers: &[Option<usize>],
    only: &dyn Fn(usize, usize) -> bool,
    p: usize,
) -> Option<Candidate> {
    let node = &graph.nodes[p];
    if node.op != Op::Permute {
        return None;
    }
    let t = node.inputs.first().copied().flatten()?;
    let v = producers[t]?;
    let view = &graph.nodes[v];
    let u = view.inputs.first().copied().flatten()?;
    let sp = producers[u]?;
    let split = &graph.nodes[sp];
    if view.op != Op::View || split.op != Op::SplitWithSizes {
        return None;
    }
    let s = split.inputs.first().copied().flatten()?;
    let dtype = graph.tensors[s].ty.dtype;
    let same = [t, u].iter().all(|&id| graph.tensors[id].ty.dtype == dtype);
    if !only(t, p) || !only(u, v) || !same {
        return None;
    }
    let OpParams::Split { dim, sizes } = params.get(sp)? else {
        return None;
    };
    let k = split.outputs.iter().position(|&o| o == Some(u))?;
    let st = contiguous(&graph.tensors[s].ty.shape);
    let offset = sizes.get(..k)?.iter().sum::<u64>() * *st.get(*dim)? as u64;
    let shape = graph.tensors[t].ty.shape.clone();
    let strides = view_strides(&graph.tensors[u].ty.shape, &st, &shape)?;
    Some(Candidate {
        reader: p,
        tensor: t,
        view: v,
        from: sp,
        skipped: None,
        unwritten: Some(u),
        source: StridedSource {
            root: s,
            offset,
            strides,
            shape,
        },
    })
}

/// An input `t` of cat `c` that is a view of the output of a permute `p`, each read by
/// nothing else: the cat copies `t` from the permute's source, and the permute is not
/// run. The view can merge dims the permute left apart (heads and their width, `[B, S,
/// H, D]` as `[B, S, H*D]`), so the copy walks the permute's shape on both sides: the
/// cat's output slot is viewed as that shape too ([`cat_slot`]).
fn cat_view(
    graph: &Graph,
    params: &[OpParams],
    producers: &[Option<usize>],
    only: &dyn Fn(usize, usize) -> bool,
    c: usize,
    t: usize,
) -> Option<Candidate> {
    let v = producers[t]?;
    let view = &graph.nodes[v];
    let o = view.inputs.first().copied().flatten()?;
    let p = producers[o]?;
    let permute = &graph.nodes[p];
    if view.op != Op::View || permute.op != Op::Permute {
        return None;
    }
    let g = permute.inputs.first().copied().flatten()?;
    let dtype = graph.tensors[g].ty.dtype;
    let same = [t, o].iter().all(|&id| graph.tensors[id].ty.dtype == dtype);
    if !only(t, c) || !only(o, v) || !same {
        return None;
    }
    let OpParams::Permute { dims } = params.get(p)? else {
        return None;
    };
    let shape = graph.tensors[o].ty.shape.clone();
    let out = &graph.tensors[graph.nodes[c].outputs.first().copied().flatten()?]
        .ty
        .shape;
    cat_slot(out, &graph.tensors[t].ty.shape, &shape)?;
    let st = contiguous(&graph.tensors[g].ty.shape);
    let strides = dims
        .iter()
        .map(|&d| st.get(d).copied())
        .collect::<Option<_>>()?;
    Some(Candidate {
        reader: c,
        tensor: t,
        view: v,
        from: p,
        skipped: Some(p),
        unwritten: None,
        source: StridedSource {
            root: g,
            offset: 0,
            strides,
            shape,
        },
    })
}

/// The strides of a cat's output slot for an input of shape `input` (the output of shape
/// `out`, row-major; the slot has the output's strides) viewed as `shape`, where one
/// strided view can.
pub(crate) fn cat_slot(out: &[u64], input: &[u64], shape: &[u64]) -> Option<Vec<i64>> {
    view_strides(input, &contiguous(out), shape)
}
