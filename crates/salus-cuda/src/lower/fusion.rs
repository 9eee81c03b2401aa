//! Fused pointwise regions: nodes of elementwise ops (unary, binary, with a scalar, where,
//! casts) over one output shape, whose inputs broadcast to it, become one generated kernel
//! that keeps the region's intermediates in registers and writes only the outputs something
//! else needs (a node outside the region, a fetch, an update).
//!
//! A region runs where its last node is. Its nodes need not be adjacent in the program;
//! what [`plan`] checks keeps that equal to running them one by one under the program's
//! static memory plan (which fusion leaves as it is: dropped intermediates keep their bytes,
//! untouched):
//!
//! 1. every reader of a region output outside the region comes after the region's last
//!    node (it must find the value written);
//! 2. no node outside the region that runs between a region input's first reader in the
//!    region and the last node writes (outputs or scratch) over that input's bytes;
//! 3. an output the region writes does not overlap an input it reads, unless it is that
//!    input's own bytes, same dtype and every element (in place: each thread reads its
//!    element before writing it).
//!
//! The generated source names ops, dtypes and the loads and stores by the `abi` codes;
//! `apply` (elementwise.cu) computes every op as the `ew` kernel does, in double, and each
//! intermediate is rounded to its dtype as storing and reloading it would.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::Arc;

use salus_exec::{Location, Program};
use salus_graph::{DType, GeluApproximate, Graph, Op, OpParams};

use super::elementwise::{StridedView, coalesce, index_mode};
use super::{Command, Lowered, Lowering, broadcast, contiguous, grid_for, numel, padded, signed};
use crate::abi::{
    BLOCK, DeviceDType, ElementwiseOp, FusedArgs, MAX_FUSED_NODES, MAX_FUSED_OPERANDS, MAX_RANK,
    StridedTensor,
};
use crate::driver::Raw;

/// A fused kernel's launch: its generated kernel (by name; the function handle is filled in
/// once the kernel is compiled and loaded), grid and arguments.
#[derive(Debug, Clone)]
pub(crate) struct FusedLaunch {
    pub name: String,
    pub grid: u32,
    pub block: u32,
    pub args: Arc<FusedArgs>,
    pub function: Option<Raw<cudarc::driver::sys::CUfunction>>,
    /// Operands `args.ops[..inputs]` are read, the rest written.
    pub inputs: usize,
    /// The kernel, for its batched form (`batch`).
    pub spec: Arc<KernelSpec>,
}

/// What one node of a region computes: `apply(op, in[0], in[1], in[2], s[0], s[1])`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Pointwise {
    pub op: ElementwiseOp,
    pub inputs: usize,
    pub s: [f64; 2],
}

/// The elementwise op a node is, as the unfused lowering runs it; `None` for every other
/// node (and for same-dtype i64 copies, which `ew` copies bit for bit and a region could
/// not through double).
pub(crate) fn pointwise(op: Op, params: &OpParams, from: DType, to: DType) -> Option<Pointwise> {
    use ElementwiseOp as E;
    use Op::*;
    let p = |op, inputs, s| Some(Pointwise { op, inputs, s });
    match (op, params) {
        (AddTensor | SubTensor, &OpParams::Binary { alpha }) => {
            let sign = if op == SubTensor { -1.0 } else { 1.0 };
            p(E::Add, 2, [sign * alpha, 0.0])
        }
        (MulTensor, _) => p(E::Mul, 2, [0.0; 2]),
        (DivTensor, _) => p(E::Div, 2, [0.0; 2]),
        (LogicalAnd, _) => p(E::LogicalAnd, 2, [0.0; 2]),
        (Maximum, _) => p(E::Maximum, 2, [0.0; 2]),
        (Minimum, _) => p(E::Minimum, 2, [0.0; 2]),
        (EqTensor, _) => p(E::EqTensor, 2, [0.0; 2]),
        (LtTensor, _) => p(E::LtTensor, 2, [0.0; 2]),
        (GtTensor, _) => p(E::GtTensor, 2, [0.0; 2]),
        (BitwiseAndTensor, _) => p(E::BitwiseAnd, 2, [0.0; 2]),
        (
            AddScalar | MulScalar | DivScalar | PowTensorScalar | PowScalar | EqScalar | NeScalar
            | LtScalar | LeScalar | GtScalar | GeScalar,
            &OpParams::WithScalar { scalar, alpha },
        ) => {
            let e = match op {
                AddScalar => E::AddScalar,
                MulScalar => E::MulScalar,
                DivScalar => E::DivScalar,
                PowTensorScalar => E::PowTensorScalar,
                PowScalar => E::PowScalar,
                EqScalar => E::Eq,
                NeScalar => E::Ne,
                LtScalar => E::Lt,
                LeScalar => E::Le,
                GtScalar => E::Gt,
                _ => E::Ge,
            };
            p(e, 1, [alpha * scalar.as_f64(), 0.0])
        }
        (Neg, _) => p(E::Neg, 1, [0.0; 2]),
        (Abs, _) => p(E::Abs, 1, [0.0; 2]),
        (Sign, _) => p(E::Sign, 1, [0.0; 2]),
        (Exp, _) => p(E::Exp, 1, [0.0; 2]),
        (Log, _) => p(E::Log, 1, [0.0; 2]),
        (Sqrt, _) => p(E::Sqrt, 1, [0.0; 2]),
        (Rsqrt, _) => p(E::Rsqrt, 1, [0.0; 2]),
        (Reciprocal, _) => p(E::Reciprocal, 1, [0.0; 2]),
        (Sigmoid, _) => p(E::Sigmoid, 1, [0.0; 2]),
        (Tanh, _) => p(E::Tanh, 1, [0.0; 2]),
        (Relu, _) => p(E::Relu, 1, [0.0; 2]),
        (Erf, _) => p(E::Erf, 1, [0.0; 2]),
        (Erfc, _) => p(E::Erfc, 1, [0.0; 2]),
        (Erfinv, _) => p(E::Erfinv, 1, [0.0; 2]),
        (Lgamma, _) => p(E::Lgamma, 1, [0.0; 2]),
        (Digamma, _) => p(E::Digamma, 1, [0.0; 2]),
        (Polygamma, &OpParams::Polygamma { n }) => p(E::Polygamma, 1, [n as f64, 0.0]),
        (Log1p, _) => p(E::Log1p, 1, [0.0; 2]),
        (Expm1, _) => p(E::Expm1, 1, [0.0; 2]),
        (Sin, _) => p(E::Sin, 1, [0.0; 2]),
        (Cos, _) => p(E::Cos, 1, [0.0; 2]),
        (Floor, _) => p(E::Floor, 1, [0.0; 2]),
        (Ceil, _) => p(E::Ceil, 1, [0.0; 2]),
        (Round, _) => p(E::Round, 1, [0.0; 2]),
        (Trunc, _) => p(E::Trunc, 1, [0.0; 2]),
        (Atan, _) => p(E::Atan, 1, [0.0; 2]),
        (Atan2, _) => p(E::Atan2, 2, [0.0; 2]),
        (RemainderTensor, _) => p(E::Remainder, 2, [0.0; 2]),
        (FmodTensor, _) => p(E::Fmod, 2, [0.0; 2]),
        (PowTensorTensor, _) => p(E::PowTensorTensor, 2, [0.0; 2]),
        (LeakyRelu, &OpParams::LeakyRelu { negative_slope }) => {
            p(E::LeakyRelu, 1, [negative_slope, 0.0])
        }
        (Gelu, &OpParams::Gelu { approximate }) => match approximate {
            GeluApproximate::Tanh => p(E::GeluTanh, 1, [0.0; 2]),
            GeluApproximate::None => p(E::Gelu, 1, [0.0; 2]),
        },
        (Clamp, &OpParams::Clamp { min, max }) => {
            let lo = min.map_or(f64::NEG_INFINITY, |v| v.as_f64());
            let hi = max.map_or(f64::INFINITY, |v| v.as_f64());
            p(E::Clamp, 1, [lo, hi])
        }
        (LogicalNot, _) => p(E::LogicalNot, 1, [0.0; 2]),
        (BitwiseNot, _) if to == DType::Bool => p(E::LogicalNot, 1, [0.0; 2]),
        (BitwiseNot, _) => p(E::BitwiseNot, 1, [0.0; 2]),
        (WhereSelf, _) => p(E::Where, 3, [0.0; 2]),
        (ToCopy | Clone, _) if from == to && to == DType::I64 => None,
        (ToCopy | Clone, _) => p(E::Copy, 1, [0.0; 2]),
        _ => None,
    }
}

/// One fused region: its nodes in program order (it runs at the last), their output shape,
/// and the tensors it reads from memory and writes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Region {
    pub nodes: Vec<usize>,
    pub shape: Vec<u64>,
    /// Tensors produced outside the region that its nodes read, in first-use order.
    pub inputs: Vec<usize>,
    /// Outputs of its nodes that something outside the region needs, in node order.
    pub outputs: Vec<usize>,
}

/// The fused regions of a program.
#[derive(Debug, Clone, Default)]
pub(crate) struct FusionPlan {
    pub regions: Vec<Region>,
    /// Per node, the region it belongs to.
    pub region_of: Vec<Option<usize>>,
}

impl FusionPlan {
    /// No fusion: every node on its own.
    pub(crate) fn none() -> FusionPlan {
        FusionPlan::default()
    }

    /// The region of node `index`, if it is fused.
    pub(crate) fn region(&self, index: usize) -> Option<&Region> {
        let r = self.region_of.get(index).copied().flatten()?;
        self.regions.get(r)
    }
}

pub(crate) fn overlaps(a: &Range<u64>, b: &Range<u64>) -> bool {
    a.start < b.end && b.start < a.end
}

/// The lane bytes of tensor `id`, if it lives in the lane.
pub(crate) fn lane_range(program: &Program, id: usize) -> Option<Range<u64>> {
    match program.location(id) {
        Some(Location::Lane(off)) => Some(off..off + program.bytes(id)),
        _ => None,
    }
}

/// What the region finder knows about a program.
struct Facts<'p> {
    program: &'p Program,
    ops: Vec<Option<Pointwise>>,
    /// Per tensor, the nodes that read it (ascending, once each).
    readers: Vec<Vec<usize>>,
    /// Per tensor, its producer.
    producer: Vec<Option<usize>>,
    /// Tensors read after the last node (fetches, update values).
    at_end: BTreeSet<usize>,
    /// Per node, the lane bytes it writes (outputs and scratch).
    writes: Vec<Vec<Range<u64>>>,
}

impl Facts<'_> {
    fn lane_range(&self, id: usize) -> Option<Range<u64>> {
        lane_range(self.program, id)
    }

    fn inputs(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        self.program.graph().nodes[node]
            .inputs
            .iter()
            .flatten()
            .copied()
    }

    fn output(&self, node: usize) -> usize {
        self.program.graph().nodes[node].outputs[0].unwrap_or(usize::MAX)
    }

    fn shape(&self, id: usize) -> &[u64] {
        &self.program.graph().tensors[id].ty.shape
    }

    /// The region's external inputs (first-use order) if `nodes` ran as one.
    fn external(&self, nodes: &[usize]) -> Vec<usize> {
        let produced: BTreeSet<usize> = nodes.iter().map(|&n| self.output(n)).collect();
        let mut out = Vec::new();
        for &n in nodes {
            for t in self.inputs(n) {
                if !produced.contains(&t) && !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        out
    }

    /// Outputs of `nodes` that something outside them needs.
    fn needed(&self, nodes: &[usize]) -> Vec<usize> {
        nodes
            .iter()
            .map(|&n| self.output(n))
            .filter(|&t| {
                self.at_end.contains(&t) || self.readers[t].iter().any(|r| !nodes.contains(r))
            })
            .collect()
    }

    /// Rules 1 and 2 and the size limits for `nodes` (ascending) as one region.
    fn may_run_together(&self, nodes: &[usize]) -> bool {
        let last = *nodes.last().unwrap_or(&0);
        if nodes.len() > MAX_FUSED_NODES {
            return false;
        }
        let external = self.external(nodes);
        let needed = self.needed(nodes);
        if external.len() + needed.len() > MAX_FUSED_OPERANDS {
            return false;
        }
        // 1: outside readers of region outputs come after the last node.
        for &n in nodes {
            let t = self.output(n);
            if self.readers[t]
                .iter()
                .any(|r| !nodes.contains(r) && *r < last)
            {
                return false;
            }
        }
        // 2: nothing outside overwrites an input between its first read and the last node.
        for &x in &external {
            let Some(bytes) = self.lane_range(x) else {
                continue;
            };
            let first = nodes
                .iter()
                .copied()
                .find(|&n| self.inputs(n).any(|t| t == x))
                .unwrap_or(last);
            for m in first + 1..last {
                if !nodes.contains(&m) && self.writes[m].iter().any(|w| overlaps(w, &bytes)) {
                    return false;
                }
            }
        }
        true
    }

    /// `nodes` (ascending) as one region.
    fn region(&self, nodes: &[usize]) -> Region {
        Region {
            shape: self.shape(self.output(nodes[0])).to_vec(),
            inputs: self.external(nodes),
            outputs: self.needed(nodes),
            nodes: nodes.to_vec(),
        }
    }

    /// Rule 3 for a finished region.
    fn writes_are_safe(&self, region: &Region) -> bool {
        let count = numel(&region.shape);
        for &o in &region.outputs {
            let Some(ob) = self.lane_range(o) else {
                return false;
            };
            for &x in &region.inputs {
                let Some(xb) = self.lane_range(x) else {
                    continue;
                };
                if !overlaps(&ob, &xb) {
                    continue;
                }
                let tensors = &self.program.graph().tensors;
                let same = ob == xb
                    && tensors[o].ty.dtype == tensors[x].ty.dtype
                    && numel(self.shape(x)) == count;
                if !same {
                    return false;
                }
            }
        }
        true
    }
}

/// Per tensor, the nodes that read it (ascending, once each).
pub(crate) fn tensor_readers(graph: &Graph) -> Vec<Vec<usize>> {
    let mut readers = vec![Vec::new(); graph.tensors.len()];
    for (n, node) in graph.nodes.iter().enumerate() {
        for &t in node.inputs.iter().flatten() {
            if readers[t].last() != Some(&n) {
                readers[t].push(n);
            }
        }
    }
    readers
}

/// Per tensor, the node that makes it (`None` for feeds, parameters and constants).
pub(crate) fn tensor_producers(graph: &Graph) -> Vec<Option<usize>> {
    let mut producer = vec![None; graph.tensors.len()];
    for (n, node) in graph.nodes.iter().enumerate() {
        for &t in node.outputs.iter().flatten() {
            producer[t] = Some(n);
        }
    }
    producer
}

/// The tensors read after the last node: fetches and update values.
pub(crate) fn read_at_end(graph: &Graph) -> BTreeSet<usize> {
    graph
        .fetches
        .iter()
        .copied()
        .chain(graph.updates.iter().map(|u| u.value))
        .collect()
}

/// Per node, the lane bytes it writes (its outputs and its scratch); nothing for a view.
pub(crate) fn node_writes(program: &Program) -> Vec<Vec<Range<u64>>> {
    let graph = program.graph();
    let layouts = program.layouts();
    let plan = program.plan();
    graph
        .nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            if layouts[n].skip {
                return Vec::new();
            }
            let mut w: Vec<Range<u64>> = node
                .outputs
                .iter()
                .flatten()
                .filter_map(|&t| lane_range(program, t))
                .collect();
            if let Some((off, len)) = plan.scratch(n) {
                w.push(off..off + len);
            }
            w
        })
        .collect()
}

/// The fused regions of `program`: greedily, in program order, each fusible node joins the
/// regions that produced its inputs, merging them into one when it reads from several and
/// the merged region may run as one, else the first that may take it, or starts one;
/// regions of one node, and regions whose writes would overlap their reads, are dropped.
pub(crate) fn plan(program: &Program) -> FusionPlan {
    let graph = program.graph();
    let layouts = program.layouts();
    let count = graph.nodes.len();
    let readers = tensor_readers(graph);
    let producer = tensor_producers(graph);
    let at_end = read_at_end(graph);
    let writes = node_writes(program);
    let ops: Vec<Option<Pointwise>> = (0..count)
        .map(|n| {
            let node = &graph.nodes[n];
            let layout = &layouts[n];
            if layout.skip || layout.error.is_some() || node.outputs.len() != 1 {
                return None;
            }
            let out = node.outputs[0]?;
            if node.inputs.iter().any(Option::is_none) {
                return None;
            }
            let ty = &graph.tensors[out].ty;
            let n_out = numel(&ty.shape);
            if n_out == 0 || ty.shape.len() > MAX_RANK {
                return None;
            }
            if !matches!(program.location(out), Some(Location::Lane(_))) {
                return None;
            }
            let from = node
                .inputs
                .first()
                .copied()
                .flatten()
                .map_or(ty.dtype, |t| graph.tensors[t].ty.dtype);
            let p = pointwise(node.op, program.params(n), from, ty.dtype)?;
            // Every input broadcasts to the output's shape (no more dims than it).
            let fits = node.inputs.iter().flatten().all(|&t| {
                let s = &graph.tensors[t].ty.shape;
                s.len() <= ty.shape.len()
                    && s.iter()
                        .rev()
                        .zip(ty.shape.iter().rev())
                        .all(|(&a, &b)| a == b || a == 1)
            });
            (fits && node.inputs.len() == p.inputs).then_some(p)
        })
        .collect();
    let facts = Facts {
        program,
        ops,
        readers,
        producer,
        at_end,
        writes,
    };
    let mut building: Vec<Vec<usize>> = Vec::new();
    let mut region_of: Vec<Option<usize>> = vec![None; count];
    for n in 0..count {
        if facts.ops[n].is_none() {
            continue;
        }
        let shape = facts.shape(facts.output(n)).to_vec();
        // The regions of n's shape that produced its inputs, in input order.
        let mut producers: Vec<usize> = Vec::new();
        for t in facts.inputs(n) {
            if let Some(r) = facts.producer[t].and_then(|p| region_of[p])
                && !producers.contains(&r)
                && facts.shape(facts.output(building[r][0])) == shape.as_slice()
            {
                producers.push(r);
            }
        }
        // A node that joins two or more regions merges them all when it can (the update
        // of a traced optimizer joins its moments' chains: one region, one pass).
        if producers.len() > 1 {
            let mut nodes: Vec<usize> = producers
                .iter()
                .flat_map(|&r| building[r].iter().copied())
                .chain([n])
                .collect();
            nodes.sort_unstable();
            if facts.may_run_together(&nodes) && facts.writes_are_safe(&facts.region(&nodes)) {
                let keep = producers[0];
                for &r in &producers[1..] {
                    for m in std::mem::take(&mut building[r]) {
                        region_of[m] = Some(keep);
                    }
                }
                building[keep] = nodes;
                region_of[n] = Some(keep);
                continue;
            }
        }
        let mut placed = None;
        for &r in &producers {
            let mut nodes = building[r].clone();
            nodes.push(n);
            if facts.may_run_together(&nodes) {
                placed = Some(r);
                break;
            }
        }
        match placed {
            Some(r) => building[r].push(n),
            None => {
                building.push(vec![n]);
                placed = Some(building.len() - 1);
            }
        }
        region_of[n] = placed;
    }
    let mut out = FusionPlan {
        regions: Vec::new(),
        region_of: vec![None; count],
    };
    for nodes in building {
        if nodes.len() < 2 {
            continue;
        }
        let region = facts.region(&nodes);
        if region.outputs.is_empty() || !facts.writes_are_safe(&region) {
            continue;
        }
        for &n in &region.nodes {
            out.region_of[n] = Some(out.regions.len());
        }
        out.regions.push(region);
    }
    out
}

/// The C expression of `v` (a double) rounded to `dt` and widened back, as storing it and
/// loading it again would give.
fn rounded(dt: DeviceDType, v: &str) -> String {
    match dt {
        DeviceDType::F32 => format!("(double)(float)({v})"),
        DeviceDType::F16 => format!("(double)h2f(f2h((float)({v})))"),
        DeviceDType::Bf16 => format!("(double)bf2f(f2bf((float)({v})))"),
        DeviceDType::I64 => format!("(double)(i64)({v})"),
        DeviceDType::I32 => format!("(double)(int)({v})"),
        DeviceDType::Bool => format!("(({v}) != 0.0 ? 1.0 : 0.0)"),
    }
}

/// An operand of a region's node: `Ok(input slot)` (loaded) or `Err(node position)` (an
/// earlier node's value).
pub(crate) type Source = Result<usize, usize>;

/// One node of a generated kernel: what it computes, its output dtype, its operands.
pub(crate) type SpecNode = (Pointwise, DeviceDType, Vec<Source>);

/// The generated kernel of a region: inputs `ins` (dtype of each external input), the
/// nodes, `outs` (node position and dtype of each written output).
#[derive(Debug)]
pub(crate) struct KernelSpec {
    pub ins: Vec<DeviceDType>,
    pub nodes: Vec<SpecNode>,
    pub outs: Vec<(usize, DeviceDType)>,
}

impl KernelSpec {
    /// The kernel's source, its name `fused_<hash of the body>`.
    pub(crate) fn source(&self) -> (String, String) {
        let body = self.body();
        let name = format!("fused_{:016x}", crate::image::fnv1a(&[body.as_bytes()]));
        let text = format!("\nextern \"C\" __global__ void {name}(const FusedArgs a) {body}");
        (name, text)
    }

    /// The source of the batched form (`FusedBatchArgs`), its name the kernel's with
    /// `_batch`: each block finds its launch (segment) and walks that launch's elements,
    /// flat, computing as the kernel does.
    pub(crate) fn batch_source(&self) -> (String, String) {
        let (name, _) = self.source();
        let name = format!("{name}_batch");
        let nops = self.ins.len() + self.outs.len();
        let mut b = String::from("{\n    int g = 0;\n");
        b.push_str(
            "    while (g + 1 < (int)a.count && (i64)blockIdx.x >= a.seg[g + 1].first) ++g;\n",
        );
        b.push_str("    const i64 first = a.seg[g].first;\n");
        b.push_str("    const i64 end = g + 1 < (int)a.count ? a.seg[g + 1].first : a.blocks;\n");
        b.push_str("    const i64 n = a.seg[g].n, full = a.seg[g].full;\n");
        b.push_str("    const i64 step = (end - first) * (i64)blockDim.x;\n");
        b.push_str(
            "    for (i64 i = ((i64)blockIdx.x - first) * blockDim.x + threadIdx.x; i < n; i += step) {\n",
        );
        for k in 0..nops {
            let _ = writeln!(b, "        i64 p{k} = ((full >> {k}) & 1) ? i : 0;");
        }
        self.compute(&mut b, |k| format!("a.seg[g].ptr[{k}]"));
        b.push_str("    }\n}\n");
        let text = format!("\nextern \"C\" __global__ void {name}(const FusedBatchArgs a) {b}");
        (name, text)
    }

    fn body(&self) -> String {
        let nops = self.ins.len() + self.outs.len();
        let mut b = String::from("{\n    GRID_LOOP(i, a.n) {\n");
        // One offset per operand, each its own variable (no run-time indexed array).
        for k in 0..nops {
            let _ = writeln!(b, "        i64 p{k} = i;");
        }
        b.push_str("        if (a.mode == IDX_FLAT) {\n");
        for k in 0..nops {
            let _ = writeln!(b, "            p{k} = a.ops[{k}].q != 0 ? i : 0;");
        }
        b.push_str("        } else if (a.mode == IDX_BROADCAST) {\n");
        b.push_str("            const bool narrow = a.n <= 0xffffffffLL;\n");
        for k in 0..nops {
            let _ = writeln!(
                b,
                "            p{k} = fast_index(i, a.ops[{k}].q, a.ops[{k}].m, narrow);"
            );
        }
        b.push_str("        } else {\n");
        for k in 0..nops {
            let _ = writeln!(b, "            p{k} = 0;");
        }
        b.push_str("            i64 r = i;\n");
        b.push_str("            for (int d = (int)a.rank - 1; d >= 0; --d) {\n");
        b.push_str("                i64 c = r % a.shape[d];\n");
        b.push_str("                r /= a.shape[d];\n");
        for k in 0..nops {
            let _ = writeln!(b, "                p{k} += c * a.ops[{k}].st[d];");
        }
        b.push_str("            }\n        }\n");
        self.compute(&mut b, |k| format!("a.ops[{k}].ptr"));
        b.push_str("    }\n}\n");
        b
    }

    /// The loads (operand `k` at `ptr(k)`, element `p{k}`), the nodes and the stores, for
    /// element `i`.
    fn compute(&self, b: &mut String, ptr: impl Fn(usize) -> String) {
        for (k, dt) in self.ins.iter().enumerate() {
            let _ = writeln!(
                b,
                "        double x{k} = ld({}, {}, p{k});",
                ptr(k),
                dt.c_name()
            );
        }
        for (j, (p, dt, operands)) in self.nodes.iter().enumerate() {
            let arg = |k: usize| match operands.get(k) {
                Some(Ok(slot)) => format!("x{slot}"),
                Some(Err(node)) => format!("v{node}"),
                None => "0.0".to_string(),
            };
            let call = format!(
                "apply({}, {}, {}, {}, a.s[{}], a.s[{}], i)",
                p.op.c_name(),
                arg(0),
                arg(1),
                arg(2),
                2 * j,
                2 * j + 1
            );
            let _ = writeln!(b, "        double v{j} = {};", rounded(*dt, &call));
        }
        for (k, (node, dt)) in self.outs.iter().enumerate() {
            let slot = self.ins.len() + k;
            let _ = writeln!(
                b,
                "        st({}, {}, p{slot}, v{node});",
                ptr(slot),
                dt.c_name()
            );
        }
    }
}

/// The kernel spec of a region of `program`, and its nodes' scalars.
pub(crate) fn spec(program: &Program, region: &Region) -> (KernelSpec, Vec<f64>) {
    let graph = program.graph();
    let dt = |t: usize| DeviceDType::of(graph.tensors[t].ty.dtype);
    let ins: Vec<DeviceDType> = region.inputs.iter().map(|&t| dt(t)).collect();
    let mut position: BTreeMap<usize, usize> = BTreeMap::new();
    let mut nodes = Vec::new();
    let mut scalars = Vec::new();
    for (j, &n) in region.nodes.iter().enumerate() {
        let node = &graph.nodes[n];
        let out = node.outputs[0].unwrap_or(usize::MAX);
        let from = node
            .inputs
            .first()
            .copied()
            .flatten()
            .map_or(graph.tensors[out].ty.dtype, |t| graph.tensors[t].ty.dtype);
        let p = pointwise(
            node.op,
            program.params(n),
            from,
            graph.tensors[out].ty.dtype,
        )
        .unwrap_or(Pointwise {
            op: ElementwiseOp::Copy,
            inputs: 1,
            s: [0.0; 2],
        });
        let operands = node
            .inputs
            .iter()
            .flatten()
            .map(|t| match position.get(t) {
                Some(&k) => Err(k),
                None => Ok(region.inputs.iter().position(|x| x == t).unwrap_or(0)),
            })
            .collect();
        nodes.push((p, dt(out), operands));
        scalars.extend(p.s);
        position.insert(out, j);
    }
    let outs = region
        .outputs
        .iter()
        .map(|t| (position.get(t).copied().unwrap_or(0), dt(*t)))
        .collect();
    (KernelSpec { ins, nodes, outs }, scalars)
}

impl Lowering<'_> {
    /// Node `self.index` of a fused region: nothing, or at the region's last node its
    /// kernel.
    pub(super) fn fused(&mut self, region: &Region) -> Lowered {
        if region.nodes.last() != Some(&self.index) {
            return Ok(());
        }
        let (spec, scalars) = spec(self.program, region);
        let (name, text) = spec.source();
        if !self.kernels.iter().any(|(n, _)| *n == name) {
            self.kernels.push((name.clone(), text));
        }
        let shape = region.shape.clone();
        let mut views: Vec<StridedView> = region
            .inputs
            .iter()
            .map(|&t| {
                let o = self.operand(t);
                StridedView {
                    ptr: o.ptr,
                    dt: o.dt(),
                    st: broadcast(o.shape(), &shape),
                }
            })
            .collect();
        for &t in &region.outputs {
            let o = self.operand(t);
            views.push(StridedView {
                ptr: o.ptr,
                dt: o.dt(),
                st: contiguous(&shape),
            });
        }
        let n = numel(&shape);
        let coalesced = coalesce(&shape, &mut views);
        if coalesced.len() > MAX_RANK {
            return Err(format!(
                "the CUDA device runs fused regions of at most {MAX_RANK} dims"
            ));
        }
        let outputs = region.inputs.len()..views.len();
        let (mode, fast) = index_mode(&coalesced, &views, outputs);
        let mut ops = [StridedTensor::default(); MAX_FUSED_OPERANDS];
        for ((slot, v), &f) in ops.iter_mut().zip(&views).zip(&fast) {
            *slot = v.kernel_operand(f);
        }
        let mut s = [0.0; 2 * MAX_FUSED_NODES];
        for (slot, v) in s.iter_mut().zip(&scalars) {
            *slot = *v;
        }
        let args = FusedArgs {
            n: n as i64,
            rank: coalesced.len() as i64,
            mode: mode.code(),
            nops: views.len() as i64,
            shape: padded(&signed(&coalesced)),
            s,
            ops,
        };
        self.commands.push(Command::Fused(FusedLaunch {
            name,
            grid: grid_for(n),
            block: BLOCK,
            args: Arc::new(args),
            function: None,
            inputs: region.inputs.len(),
            spec: Arc::new(spec),
        }));
        Ok(())
    }
}
