//! Steady-state iterations allocate nothing but their fetches: a counting global allocator
//! around the system one, and MLP and CNN training steps of two sizes each run for a few
//! iterations. After the first iteration, an iteration allocates only its fetches' vectors,
//! whatever the graph's size, including when kernels split work across the thread pool.
//! (Matrix products above `kernels::fast::matmul`'s small-product threshold go through the
//! `gemm` crate, which allocates its packing buffers on each call; these graphs stay below
//! it.) Its own test binary, so no other test's allocations are counted.

#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use salus_cpu::CpuDevice;
use salus_exec::{Device, Placement, Program};
use salus_graph::{Attr, DType, Graph, Limits, Node, Op, Role, Tensor, TensorType, Update};

/// The system allocator, counting allocations.
struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; counting has no
// effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as for `alloc`; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Builds a graph tensor by tensor and node by node.
#[derive(Default)]
struct Builder {
    graph: Graph,
}

impl Builder {
    fn tensor(&mut self, role: Role, dtype: DType, shape: &[u64]) -> usize {
        let id = self.graph.tensors.len();
        self.graph.tensors.push(Tensor {
            name: format!("t{id}"),
            ty: TensorType::new(dtype, shape.to_vec()),
            role,
            data: vec![],
        });
        id
    }

    fn input(&mut self, role: Role, shape: &[u64]) -> usize {
        self.tensor(role, DType::F32, shape)
    }

    /// A node with outputs of the given types (`None`: an unused output).
    fn node_with(
        &mut self,
        op: Op,
        inputs: &[Option<usize>],
        outputs: &[Option<(DType, &[u64])>],
        attrs: &[(&str, Attr)],
    ) -> Vec<Option<usize>> {
        let outs: Vec<Option<usize>> = outputs
            .iter()
            .map(|o| o.map(|(dtype, shape)| self.tensor(Role::Intermediate, dtype, shape)))
            .collect();
        self.graph.nodes.push(Node {
            name: format!("n{}", self.graph.nodes.len()),
            op,
            inputs: inputs.to_vec(),
            outputs: outs.clone(),
            attrs: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
            source: String::new(),
        });
        outs
    }

    fn node(&mut self, op: Op, inputs: &[usize], shape: &[u64], attrs: &[(&str, Attr)]) -> usize {
        self.typed_node(op, inputs, DType::F32, shape, attrs)
    }

    fn typed_node(
        &mut self,
        op: Op,
        inputs: &[usize],
        dtype: DType,
        shape: &[u64],
        attrs: &[(&str, Attr)],
    ) -> usize {
        let inputs: Vec<Option<usize>> = inputs.iter().map(|&i| Some(i)).collect();
        self.node_with(op, &inputs, &[Some((dtype, shape))], attrs)[0].unwrap()
    }

    fn transpose(&mut self, t: usize) -> usize {
        let shape = self.graph.tensors[t].ty.shape.clone();
        self.node(
            Op::Permute,
            &[t],
            &[shape[1], shape[0]],
            &[("dims", Attr::Ints(vec![1, 0]))],
        )
    }

    /// `param - lr * grad`, written back into `param` at the end of the iteration.
    fn sgd(&mut self, param: usize, grad: usize) {
        let shape = self.graph.tensors[param].ty.shape.clone();
        let value = self.node(
            Op::SubTensor,
            &[param, grad],
            &shape,
            &[("alpha", Attr::Float(0.02))],
        );
        self.graph.updates.push(Update {
            target: param,
            value,
        });
    }

    /// `relu(pre)`'s gradient: `grad` where `pre > 0`, else 0.
    fn relu_grad(&mut self, pre: usize, grad: usize) -> usize {
        let shape = self.graph.tensors[pre].ty.shape.clone();
        let off = self.typed_node(
            Op::LeScalar,
            &[pre],
            DType::Bool,
            &shape,
            &[("other", Attr::Float(0.0))],
        );
        let zero = self.node(Op::ScalarTensor, &[], &[], &[("s", Attr::Float(0.0))]);
        self.node(Op::WhereSelf, &[off, zero, grad], &shape, &[])
    }

    /// Mean squared error of `out` against the feed `target`; the loss is fetched.
    /// Returns the loss's gradient with respect to `out`.
    fn mse(&mut self, out: usize, target: usize) -> usize {
        let shape = self.graph.tensors[out].ty.shape.clone();
        let n: u64 = shape.iter().product();
        let diff = self.node(Op::SubTensor, &[out, target], &shape, &[]);
        let sq = self.node(Op::MulTensor, &[diff, diff], &shape, &[]);
        let loss = self.node(Op::Mean, &[sq], &[], &[]);
        self.graph.fetches.push(loss);
        self.node(
            Op::MulScalar,
            &[diff],
            &shape,
            &[("other", Attr::Float(2.0 / n as f64))],
        )
    }

    /// A linear layer's backward: updates `w` and `b`, returns the input's gradient.
    fn linear_backward(&mut self, x: usize, w: usize, b: usize, grad: usize) -> usize {
        let (xs, ws) = (
            self.graph.tensors[x].ty.shape.clone(),
            self.graph.tensors[w].ty.shape.clone(),
        );
        let xt = self.transpose(x);
        let gw = self.node(Op::Mm, &[xt, grad], &ws, &[]);
        let gb = self.node(
            Op::SumDimIntList,
            &[grad],
            &[ws[1]],
            &[("dim", Attr::Ints(vec![0])), ("keepdim", Attr::Bool(false))],
        );
        let wt = self.transpose(w);
        let gx = self.node(Op::Mm, &[grad, wt], &xs, &[]);
        self.sgd(w, gw);
        self.sgd(b, gb);
        gx
    }
}

/// An MLP of `layers` hidden layers of `width`, batch 8: a training step.
fn mlp(layers: usize, width: u64) -> Graph {
    let mut g = Builder::default();
    let batch = 8;
    let x = g.input(Role::Feed, &[batch, 16]);
    let target = g.input(Role::Feed, &[batch, 4]);
    let mut h = x;
    let mut saved = Vec::new();
    for i in 0..=layers {
        let (fan_in, fan_out) = (
            if i == 0 { 16 } else { width },
            if i == layers { 4 } else { width },
        );
        let w = g.input(Role::Parameter, &[fan_in, fan_out]);
        let b = g.input(Role::Parameter, &[fan_out]);
        let pre = g.node(Op::Addmm, &[b, h, w], &[batch, fan_out], &[]);
        let out = if i == layers {
            pre
        } else {
            g.node(Op::Relu, &[pre], &[batch, fan_out], &[])
        };
        saved.push((h, w, b, pre));
        h = out;
    }
    let mut grad = g.mse(h, target);
    for (i, &(x, w, b, pre)) in saved.iter().enumerate().rev() {
        if i != layers {
            grad = g.relu_grad(pre, grad);
        }
        grad = g.linear_backward(x, w, b, grad);
    }
    g.graph
}

/// A CNN of `blocks` 3x3 convolutions (4 channels, the first from 3) with relu, a 2x2 max
/// pool and a linear head, at `hw` x `hw`: a training step.
fn cnn(blocks: usize, batch: u64, hw: u64) -> Graph {
    let mut g = Builder::default();
    let c = 4u64;
    let x = g.input(Role::Feed, &[batch, 3, hw, hw]);
    let target = g.input(Role::Feed, &[batch, 3]);
    let conv_attrs = |with_mask: bool| {
        let mut a = vec![
            ("stride", Attr::Ints(vec![1, 1])),
            ("padding", Attr::Ints(vec![1, 1])),
            ("dilation", Attr::Ints(vec![1, 1])),
            ("transposed", Attr::Bool(false)),
            ("output_padding", Attr::Ints(vec![0, 0])),
            ("groups", Attr::Int(1)),
        ];
        if with_mask {
            a.push(("output_mask", Attr::Bools(vec![true, true, true])));
            a.push(("bias_sizes", Attr::Ints(vec![c as i64])));
        }
        a
    };
    let act = [batch, c, hw, hw];
    let mut h = x;
    let mut saved = Vec::new();
    for i in 0..blocks {
        let c_in = if i == 0 { 3 } else { c };
        let w = g.input(Role::Parameter, &[c, c_in, 3, 3]);
        let b = g.input(Role::Parameter, &[c]);
        let pre = g.node_with(
            Op::Convolution,
            &[Some(h), Some(w), Some(b)],
            &[Some((DType::F32, &act))],
            &conv_attrs(false),
        )[0]
        .unwrap();
        let out = g.node(Op::Relu, &[pre], &act, &[]);
        saved.push((h, w, b, pre));
        h = out;
    }
    let pooled = [batch, c, hw / 2, hw / 2];
    let pool_attrs = [
        ("kernel_size", Attr::Ints(vec![2, 2])),
        ("stride", Attr::Ints(vec![2, 2])),
        ("padding", Attr::Ints(vec![0, 0])),
        ("dilation", Attr::Ints(vec![1, 1])),
        ("ceil_mode", Attr::Bool(false)),
    ];
    let pool = g.node_with(
        Op::MaxPool2dWithIndices,
        &[Some(h)],
        &[Some((DType::F32, &pooled)), Some((DType::I64, &pooled))],
        &pool_attrs,
    );
    let (p, indices) = (pool[0].unwrap(), pool[1].unwrap());
    let features = c * (hw / 2) * (hw / 2);
    let flat = g.node(
        Op::View,
        &[p],
        &[batch, features],
        &[("size", Attr::Ints(vec![batch as i64, features as i64]))],
    );
    let w = g.input(Role::Parameter, &[features, 3]);
    let b = g.input(Role::Parameter, &[3]);
    let out = g.node(Op::Addmm, &[b, flat, w], &[batch, 3], &[]);
    let grad = g.mse(out, target);
    let gflat = g.linear_backward(flat, w, b, grad);
    let gp = g.node(
        Op::View,
        &[gflat],
        &pooled,
        &[(
            "size",
            Attr::Ints(pooled.iter().map(|&d| d as i64).collect()),
        )],
    );
    let mut grad = g.node(
        Op::MaxPool2dWithIndicesBackward,
        &[gp, h, indices],
        &act,
        &pool_attrs,
    );
    for (i, &(x, w, b, pre)) in saved.iter().enumerate().rev() {
        grad = g.relu_grad(pre, grad);
        let ws = g.graph.tensors[w].ty.shape.clone();
        let xs = g.graph.tensors[x].ty.shape.clone();
        let grads = g.node_with(
            Op::ConvolutionBackward,
            &[Some(grad), Some(x), Some(w)],
            &[
                (i > 0).then_some((DType::F32, xs.as_slice())),
                Some((DType::F32, &ws)),
                Some((DType::F32, &[c])),
            ],
            &conv_attrs(true),
        );
        g.sgd(w, grads[1].unwrap());
        g.sgd(b, grads[2].unwrap());
        if let Some(gx) = grads[0] {
            grad = gx;
        }
    }
    g.graph
}

/// Allocations of each of `iterations` iterations of `graph` on a CPU device, and the
/// fetched loss of each.
fn allocations_per_iteration(graph: Graph, iterations: usize) -> (Vec<usize>, Vec<f32>) {
    let program = Program::new(graph, &Limits::default()).unwrap();
    let plan = program.plan();
    let device = CpuDevice::new(plan.persistent_bytes + plan.ephemeral_bytes).unwrap();
    let at = Placement {
        persistent: 0,
        lane: plan.persistent_bytes,
    };
    // Small deterministic parameters and feeds.
    let fill = |bytes: u64, seed: usize, scale: f32| -> Vec<u8> {
        (0..bytes as usize / 4)
            .flat_map(|i| ((((i * 7 + seed * 3) % 17) as f32 - 8.0) * scale).to_le_bytes())
            .collect()
    };
    for (id, t) in program.graph().tensors.iter().enumerate() {
        if t.role == Role::Parameter
            && let Some(salus_exec::Location::Persistent(off)) = program.location(id)
        {
            device
                .write(off, &fill(program.bytes(id), id, 0.01))
                .unwrap();
        }
    }
    let feeds: Vec<Vec<u8>> = program
        .feeds()
        .iter()
        .map(|&id| fill(program.bytes(id), id, 0.1))
        .collect();
    let refs: Vec<&[u8]> = feeds.iter().map(Vec::as_slice).collect();
    let mut counts = Vec::new();
    let mut losses = Vec::new();
    for k in 0..iterations {
        if k == 1 {
            // The first iteration starts the kernels' thread pool; let its threads finish
            // starting (which allocates, once) before counting.
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        let outcome = device.run(&program, at, &refs).unwrap();
        counts.push(ALLOCATIONS.load(Ordering::SeqCst) - before);
        let b = &outcome.fetches[0];
        losses.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    }
    (counts, losses)
}

/// Tests of this binary run one at a time: each counts only its own allocations.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn check_steady_state(name: &str, small: Graph, large: Graph) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for graph in [small, large] {
        let nodes = graph.nodes.len();
        let fetches = graph.fetches.len();
        let (counts, losses) = allocations_per_iteration(graph, 4);
        println!("{name} ({nodes} nodes): allocations per iteration {counts:?}, losses {losses:?}");
        assert!(
            losses.iter().all(|l| l.is_finite()) && losses[3] < losses[0],
            "{name}: training does not train: {losses:?}"
        );
        // The fetches' vectors (one per fetch and the list) and nothing else, but for one
        // allocation in all: an iteration hands one job to rayon's pool from outside it,
        // and rayon's queue for such jobs takes a new block of slots every 63 jobs, which
        // may fall in any iteration.
        let steady = counts[1..].len() * (fetches + 1);
        assert!(
            counts[1..].iter().sum::<usize>() <= steady + 1,
            "{name} ({nodes} nodes): iterations allocate {counts:?}, expected at most {} \
             after the first (and one more in all)",
            fetches + 1
        );
    }
}

#[test]
fn mlp_iterations_allocate_only_their_fetches() {
    check_steady_state("mlp", mlp(1, 32), mlp(6, 64));
}

#[test]
fn cnn_iterations_allocate_only_their_fetches() {
    // The larger one splits its convolutions and elementwise ops across the thread pool.
    check_steady_state("cnn", cnn(1, 4, 8), cnn(4, 8, 32));
}
