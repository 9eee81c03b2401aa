//! The op tests' harness: one-node graphs run on a fresh [`CpuDevice`], values in and out
//! as `f64` (rounded to each tensor's dtype on the way in), index helpers for the naive
//! reference implementations, central finite differences, and a record of the ops run.
//!
//! `SALUS_TEST_DEVICE=cuda` runs every case on GPU 0 instead (one device shared by all
//! cases, one case at a time): `SALUS_TEST_DEVICE=cuda cargo test -p salus-testkit --test ops`
//! checks the CUDA kernels against the same naive references; `SALUS_TEST_DEVICE=cuda-emulated`
//! runs the same kernels and command lists on the host (`salus_cuda::Emulator`), where
//! there is no GPU.

#![allow(dead_code)]

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use std::sync::{Arc, Mutex, OnceLock};

use salus_cpu::CpuDevice;
use salus_cuda::{CudaDevice, CudaOptions, Emulator};
use salus_exec::{Device, Placement, Program};
use salus_graph::{Attr, DType, Graph, Limits, Node, Op, Role, ScratchSizer, Tensor, TensorType};

thread_local! {
    static RECORD: RefCell<Option<BTreeSet<Op>>> = const { RefCell::new(None) };
}

/// Runs `f` and returns every op the harness ran on this thread meanwhile.
pub fn record_ops(f: impl FnOnce()) -> BTreeSet<Op> {
    RECORD.with(|r| *r.borrow_mut() = Some(BTreeSet::new()));
    f();
    RECORD.with(|r| r.borrow_mut().take().unwrap_or_default())
}

fn note(op: Op) {
    RECORD.with(|r| {
        if let Some(set) = r.borrow_mut().as_mut() {
            set.insert(op);
        }
    });
}

/// `v` as the nearest value of `dtype` (integers truncate toward zero, bools are != 0).
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => f64::from(v as f32),
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::Bf16 => half::bf16::from_f64(v).to_f64(),
        DType::I64 => v as i64 as f64,
        DType::I32 => f64::from(v as i32),
        DType::Bool => f64::from(u8::from(v != 0.0)),
    }
}

/// Little-endian bytes of `data` as `dtype`.
pub fn encode(dtype: DType, data: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() * dtype.size() as usize);
    for &v in data {
        match dtype {
            DType::F32 => out.extend((v as f32).to_le_bytes()),
            DType::F16 => out.extend(half::f16::from_f64(v).to_le_bytes()),
            DType::Bf16 => out.extend(half::bf16::from_f64(v).to_le_bytes()),
            DType::I64 => out.extend((v as i64).to_le_bytes()),
            DType::I32 => out.extend((v as i32).to_le_bytes()),
            DType::Bool => out.push(u8::from(v != 0.0)),
        }
    }
    out
}

/// Values of little-endian `bytes` of `dtype`.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    let size = dtype.size() as usize;
    bytes
        .chunks_exact(size)
        .map(|c| match dtype {
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            DType::F16 => half::f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::Bf16 => half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I32 => f64::from(i32::from_le_bytes(c.try_into().unwrap())),
            DType::Bool => f64::from(c[0]),
        })
        .collect()
}

/// A tensor value: its type and its elements (row-major), already rounded to its dtype.
#[derive(Debug, Clone)]
pub struct Value {
    pub ty: TensorType,
    pub data: Vec<f64>,
}

/// A value of `dtype` and `shape` holding `data` rounded to the dtype.
pub fn val(dtype: DType, shape: &[u64], data: Vec<f64>) -> Value {
    assert_eq!(
        data.len() as u64,
        shape.iter().product::<u64>(),
        "{} values for shape {shape:?}",
        data.len()
    );
    Value {
        ty: TensorType::new(dtype, shape.to_vec()),
        data: data.into_iter().map(|v| round_to(dtype, v)).collect(),
    }
}

/// An f32 value.
pub fn f32v(shape: &[u64], data: Vec<f64>) -> Value {
    val(DType::F32, shape, data)
}

/// An i64 value.
pub fn i64v(shape: &[u64], data: &[i64]) -> Value {
    val(DType::I64, shape, data.iter().map(|&v| v as f64).collect())
}

/// One node over fed inputs, every used output fetched.
#[derive(Debug, Clone)]
pub struct Case {
    op: Op,
    inputs: Vec<Option<Value>>,
    attrs: BTreeMap<String, Attr>,
    outputs: Vec<Option<TensorType>>,
}

impl Case {
    pub fn new(op: Op) -> Case {
        Case {
            op,
            inputs: vec![],
            attrs: BTreeMap::new(),
            outputs: vec![],
        }
    }

    pub fn input(mut self, v: Value) -> Case {
        self.inputs.push(Some(v));
        self
    }

    /// An absent optional input.
    pub fn absent(mut self) -> Case {
        self.inputs.push(None);
        self
    }

    pub fn attr(mut self, name: &str, a: Attr) -> Case {
        self.attrs.insert(name.into(), a);
        self
    }

    pub fn int(self, name: &str, v: i64) -> Case {
        self.attr(name, Attr::Int(v))
    }

    pub fn float(self, name: &str, v: f64) -> Case {
        self.attr(name, Attr::Float(v))
    }

    pub fn flag(self, name: &str, v: bool) -> Case {
        self.attr(name, Attr::Bool(v))
    }

    pub fn ints(self, name: &str, v: &[i64]) -> Case {
        self.attr(name, Attr::Ints(v.to_vec()))
    }

    pub fn dtype(self, name: &str, d: DType) -> Case {
        self.attr(name, Attr::DType(d))
    }

    /// The next output, of this type (checked against the graph's shape inference).
    pub fn output(mut self, dtype: DType, shape: &[u64]) -> Case {
        self.outputs
            .push(Some(TensorType::new(dtype, shape.to_vec())));
        self
    }

    /// The next output is unused.
    pub fn unused(mut self) -> Case {
        self.outputs.push(None);
        self
    }

    /// The values of the inputs, present ones only.
    pub fn input_values(&self) -> Vec<&Value> {
        self.inputs.iter().flatten().collect()
    }

    pub fn graph(&self) -> Graph {
        let mut tensors = vec![];
        let mut inputs = vec![];
        for (k, v) in self.inputs.iter().enumerate() {
            inputs.push(v.as_ref().map(|v| {
                tensors.push(Tensor {
                    name: format!("in{k}"),
                    ty: v.ty.clone(),
                    role: Role::Feed,
                    data: vec![],
                });
                tensors.len() - 1
            }));
        }
        let mut outputs = vec![];
        for (k, ty) in self.outputs.iter().enumerate() {
            outputs.push(ty.as_ref().map(|ty| {
                tensors.push(Tensor {
                    name: format!("out{k}"),
                    ty: ty.clone(),
                    role: Role::Intermediate,
                    data: vec![],
                });
                tensors.len() - 1
            }));
        }
        Graph {
            tensors,
            nodes: vec![Node {
                name: format!("{}", self.op),
                op: self.op,
                inputs,
                outputs: outputs.clone(),
                attrs: self.attrs.clone(),
                source: String::new(),
            }],
            fetches: outputs.into_iter().flatten().collect(),
            updates: vec![],
            // Full f32, so the GPU's results compare as tightly as the CPU's.
            precision: salus_graph::Precision::IEEE,
        }
    }

    /// The case's graph, validated and planned, on a device of its own (or on the shared
    /// GPU under `SALUS_TEST_DEVICE=cuda`).
    pub fn try_session(&self) -> Result<Session, String> {
        let Some(gpu) = shared_gpu() else {
            return self.try_session_cpu();
        };
        // Planned for the GPU: E includes the workspace of its cuDNN calls.
        let program = Program::for_device(self.graph(), &Limits::default(), &*gpu)
            .map_err(|e| format!("{}: invalid graph: {e}", self.op))?;
        let lane = 256;
        let device = gpu;
        Ok(Session {
            op: self.op,
            program,
            device,
            at: Placement {
                persistent: 0,
                lane,
            },
            feed_dtypes: self.input_values().iter().map(|v| v.ty.dtype).collect(),
            outputs: self
                .outputs
                .iter()
                .map(|o| o.as_ref().map(|t| t.dtype))
                .collect(),
        })
    }

    /// Runs on `device` (one shared by all cases, lane 256), or on a CPU device of its own
    /// when `None`.
    pub fn try_run_on(&self, device: Option<Arc<dyn Device>>) -> Result<Vec<Vec<f64>>, String> {
        let mut session = self.try_session_cpu()?;
        if let Some(d) = device {
            session.program = Program::for_device(self.graph(), &Limits::default(), &*d)
                .map_err(|e| format!("{}: invalid graph: {e}", self.op))?;
            session.device = d;
        }
        let feeds: Vec<&[f64]> = self.input_values().iter().map(|v| &v.data[..]).collect();
        session.run(&feeds)
    }

    /// Runs on a CPU device of its own, planned with each node's scratch as `sizer` gives
    /// it (another device's planning: a kernel must cope with less scratch than its own).
    pub fn run_planned_with(&self, sizer: &dyn ScratchSizer) -> Vec<Vec<f64>> {
        let mut session = self.try_session_cpu().unwrap_or_else(|e| panic!("{e}"));
        session.program = Program::with_scratch(self.graph(), &Limits::default(), sizer)
            .unwrap_or_else(|e| panic!("{}: invalid graph: {e}", self.op));
        let feeds: Vec<&[f64]> = self.input_values().iter().map(|v| &v.data[..]).collect();
        session.run(&feeds).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The op.
    pub fn op(&self) -> Op {
        self.op
    }

    fn try_session_cpu(&self) -> Result<Session, String> {
        let program = Program::new(self.graph(), &Limits::default())
            .map_err(|e| format!("{}: invalid graph: {e}", self.op))?;
        let capacity = 256 + program.plan().ephemeral_bytes.max(1) + 256;
        Ok(Session {
            op: self.op,
            device: Arc::new(CpuDevice::new(capacity).map_err(|e| e.to_string())?),
            program,
            at: Placement {
                persistent: 0,
                lane: 256,
            },
            feed_dtypes: self.input_values().iter().map(|v| v.ty.dtype).collect(),
            outputs: self
                .outputs
                .iter()
                .map(|o| o.as_ref().map(|t| t.dtype))
                .collect(),
        })
    }

    pub fn session(&self) -> Session {
        self.try_session().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every output's values (empty for unused ones), or the device's error.
    pub fn try_run(&self) -> Result<Vec<Vec<f64>>, String> {
        let session = self.try_session()?;
        let feeds: Vec<&[f64]> = self.input_values().iter().map(|v| &v.data[..]).collect();
        session.run(&feeds)
    }

    pub fn run(&self) -> Vec<Vec<f64>> {
        self.try_run().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Output 0's values.
    pub fn run1(&self) -> Vec<f64> {
        self.run().swap_remove(0)
    }

    /// The error the device gives; panics when the node runs.
    pub fn fails(&self) -> String {
        match self.try_run() {
            Ok(_) => panic!("{} ran, but should have failed", self.op),
            Err(e) => e,
        }
    }
}

/// Serialises the cases' runs on the shared GPU (they all use lane 256).
static GPU_TURN: Mutex<()> = Mutex::new(());

/// The GPU every case shares under `SALUS_TEST_DEVICE=cuda` (1 GiB arena), or the CUDA
/// device's kernels on the host under `SALUS_TEST_DEVICE=cuda-emulated` (`salus_cuda::Emulator`,
/// 256 MiB); `None` runs each case on a CPU device of its own. Panics when the device asked
/// for is unusable.
pub fn shared_gpu() -> Option<Arc<dyn Device>> {
    static GPU: OnceLock<Option<Arc<dyn Device>>> = OnceLock::new();
    GPU.get_or_init(|| {
        let wanted = std::env::var("SALUS_TEST_DEVICE").ok()?;
        let device: Arc<dyn Device> = match wanted.as_str() {
            "cuda" => {
                let mut options = CudaOptions::new(0);
                options.cap = Some(1 << 30);
                Arc::new(CudaDevice::new(&options).unwrap_or_else(|e| {
                    panic!("SALUS_TEST_DEVICE=cuda but the GPU is unusable: {e}")
                }))
            }
            "cuda-emulated" => Arc::new(Emulator::new(256 << 20).unwrap_or_else(|e| {
                panic!("SALUS_TEST_DEVICE=cuda-emulated but the emulator is unusable: {e}")
            })),
            other => {
                panic!("SALUS_TEST_DEVICE must be cuda or cuda-emulated (or unset), not {other:?}")
            }
        };
        Some(device)
    })
    .clone()
}

/// A planned one-node graph on its own device, to run with several feeds.
pub struct Session {
    op: Op,
    program: Program,
    device: Arc<dyn Device>,
    at: Placement,
    feed_dtypes: Vec<DType>,
    outputs: Vec<Option<DType>>,
}

impl Session {
    /// Runs the node on `feeds` (one per present input, in order).
    pub fn run(&self, feeds: &[&[f64]]) -> Result<Vec<Vec<f64>>, String> {
        note(self.op);
        let bytes: Vec<Vec<u8>> = feeds
            .iter()
            .zip(&self.feed_dtypes)
            .map(|(f, &d)| encode(d, f))
            .collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let _one_at_a_time = GPU_TURN.lock().unwrap_or_else(|p| p.into_inner());
        let outcome = self
            .device
            .run(&self.program, self.at, &refs)
            .map_err(|e| e.to_string())?;
        let mut fetched = outcome.fetches.into_iter();
        Ok(self
            .outputs
            .iter()
            .map(|o| match o {
                Some(d) => decode(*d, &fetched.next().unwrap_or_default()),
                None => vec![],
            })
            .collect())
    }
}

/// Tolerances: `|got - want| <= atol + rtol * |want|` elementwise.
#[derive(Debug, Clone, Copy)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

/// For results computed in f64 and rounded once to f32.
pub const F32: Tol = Tol {
    rtol: 1e-6,
    atol: 1e-7,
};
/// For sums of many f32 terms.
pub const SUM32: Tol = Tol {
    rtol: 1e-5,
    atol: 1e-5,
};
/// Exact results (integers, bools, copies).
pub const EXACT: Tol = Tol {
    rtol: 0.0,
    atol: 0.0,
};

pub fn tol(rtol: f64, atol: f64) -> Tol {
    Tol { rtol, atol }
}

/// Asserts `got` matches `want` elementwise (NaN matches NaN, infinities match exactly).
#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], tol: Tol, what: &str) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: {} values, expected {}",
        got.len(),
        want.len()
    );
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol.atol + tol.rtol * w.abs()
        };
        assert!(
            ok,
            "{what}: element {i} is {g}, expected {w} (tolerance {tol:?})\n got: {got:?}\nwant: {want:?}"
        );
    }
}

/// Asserts `message` contains every one of `parts`.
#[track_caller]
pub fn assert_mentions(message: &str, parts: &[&str]) {
    for p in parts {
        assert!(message.contains(p), "{message:?} should mention {p:?}");
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[u64]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1] as usize;
    }
    s
}

pub fn numel(shape: &[u64]) -> usize {
    shape.iter().product::<u64>() as usize
}

/// The multi-index of linear position `i` in `shape`.
pub fn unravel(mut i: usize, shape: &[u64]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        let n = shape[d] as usize;
        idx[d] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// The linear position of multi-index `idx` in `shape`.
pub fn ravel(idx: &[usize], shape: &[u64]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

/// The linear position in a tensor of `shape` that broadcasting reads for output
/// multi-index `out` (trailing dimensions aligned, size-1 dimensions repeated).
pub fn broadcast_at(out: &[usize], shape: &[u64]) -> usize {
    let lead = out.len() - shape.len();
    let idx: Vec<usize> = (0..shape.len())
        .map(|d| if shape[d] == 1 { 0 } else { out[lead + d] })
        .collect();
    ravel(&idx, shape)
}

/// SplitMix64's finalizer, the mix of the session's random streams (`docs/ops.md`),
/// written out here apart from the devices' kernels.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The keep-flags' seed of a one-node efficient attention case under generator `state`:
/// the node's stream (its name is the op's).
pub fn attention_seed(state: i64) -> u64 {
    mix64(state as u64 ^ salus_exec::random::name_key(Op::EfficientAttention.name()))
}

/// The first generator state from `from` on whose [`attention_seed`] an f64 holds exactly:
/// the harness carries values as f64, and a backward must read back its forward's seed
/// to the bit.
pub fn exact_seed_state(from: i64) -> i64 {
    (from..)
        .find(|&state| {
            let seed = attention_seed(state) as i64;
            seed as f64 as i64 == seed
        })
        .expect("a state")
}

/// Attention dropout's factor of the probability at flat index `at` under `seed`: kept
/// (`1 / (1 - p)`) when the 24-bit draw of the seed's stream is below `1 - p`, else 0.
pub fn dropout_factor(seed: u64, p: f64, at: usize) -> f64 {
    let bits = mix64(seed.wrapping_add((at as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    let u = (bits >> 40) as f64 / (1u64 << 24) as f64;
    if u < 1.0 - p { 1.0 / (1.0 - p) } else { 0.0 }
}

/// A small deterministic generator (splitmix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    /// Integers in `[lo, hi)`.
    pub fn ints(&mut self, n: usize, lo: i64, hi: i64) -> Vec<i64> {
        (0..n)
            .map(|_| lo + (self.next_u64() % (hi - lo) as u64) as i64)
            .collect()
    }

    /// `n` values at least `gap` apart, in random order: inputs whose max or sort order
    /// does not change under perturbations smaller than `gap / 2`.
    pub fn distinct(&mut self, n: usize, gap: f64) -> Vec<f64> {
        let mut v: Vec<f64> = (0..n).map(|i| (i as f64 - n as f64 / 2.0) * gap).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }

    pub fn f32s(&mut self, shape: &[u64], lo: f64, hi: f64) -> Value {
        f32v(shape, self.vec(numel(shape), lo, hi))
    }
}

/// Central differences of `sum(upstream * output[out])` with respect to every element of
/// present input `wrt`, through the device's own forward op. The step is `eps`, as the
/// input's dtype rounds it.
pub fn numeric_grad(case: &Case, wrt: usize, out: usize, upstream: &[f64], eps: f64) -> Vec<f64> {
    let session = case.session();
    let mut feeds: Vec<Vec<f64>> = case.input_values().iter().map(|v| v.data.clone()).collect();
    let dtype = case.input_values()[wrt].ty.dtype;
    let loss = |feeds: &[Vec<f64>]| -> f64 {
        let refs: Vec<&[f64]> = feeds.iter().map(Vec::as_slice).collect();
        let outs = session.run(&refs).unwrap_or_else(|e| panic!("{e}"));
        outs[out].iter().zip(upstream).map(|(y, g)| y * g).sum()
    };
    (0..feeds[wrt].len())
        .map(|j| {
            let x = feeds[wrt][j];
            let (hi, lo) = (round_to(dtype, x + eps), round_to(dtype, x - eps));
            feeds[wrt][j] = hi;
            let up = loss(&feeds);
            feeds[wrt][j] = lo;
            let down = loss(&feeds);
            feeds[wrt][j] = x;
            (up - down) / (hi - lo)
        })
        .collect()
}

/// Asserts an analytic gradient matches central differences, within `rtol` of the
/// gradient's largest magnitude (plus a small absolute slack).
#[track_caller]
pub fn assert_grad(analytic: &[f64], numeric: &[f64], rtol: f64, what: &str) {
    let scale = numeric.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-3);
    assert_close(analytic, numeric, tol(0.0, rtol * scale), what);
}
