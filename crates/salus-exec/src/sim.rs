//! The sim device: iterations take modeled time and memory is only accounted.
//!
//! For experiments at paper scale on machines without the GPU they model: a session of
//! 10 GB "runs" here without 10 GB of anything. The arena is a capacity and a registry of
//! borrowed ranges (the same exclusivity checks as the real devices); no bytes are kept, so
//! reads return zeros and fetches are zero-filled tensors of the right size. An iteration
//! sleeps for the session's expected iteration time when its client gave one
//! ([`Program::with_expected_iteration`]), otherwise for the [`CostModel`]'s estimate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use salus_graph::{ConvParams, Node, Op, OpParams};

use crate::arena::Claims;
use crate::{Device, ExecError, Outcome, Placement, Program};

/// How long a graph takes on the modeled device: a roofline of arithmetic and memory
/// traffic, summed over nodes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Sustained floating-point operations per second.
    pub flops_per_s: f64,
    /// Sustained memory bandwidth, bytes per second.
    pub bytes_per_s: f64,
    /// Fixed cost of launching one node.
    pub per_node: Duration,
}

impl Default for CostModel {
    /// Roughly a V100, the GPU of the Salus paper's experiments: 15 TFLOP/s f32 peak at
    /// about 60% sustained, 900 GB/s at about 70%, 5 us per kernel launch.
    fn default() -> Self {
        CostModel {
            flops_per_s: 9e12,
            bytes_per_s: 630e9,
            per_node: Duration::from_micros(5),
        }
    }
}

impl CostModel {
    /// Modeled time of one iteration of `program`.
    pub fn iteration(&self, program: &Program) -> Duration {
        let graph = program.graph();
        let bytes_of = |id: Option<usize>| id.map_or(0, |id| program.bytes(id));
        let numel_of = |id: Option<usize>| {
            id.and_then(|id| graph.tensors.get(id))
                .and_then(|t| t.ty.numel())
                .unwrap_or(0)
        };
        let mut seconds = 0.0;
        for (index, node) in graph.nodes.iter().enumerate() {
            let traffic: u64 = node
                .inputs
                .iter()
                .chain(&node.outputs)
                .map(|&t| bytes_of(t))
                .sum();
            let flops = flops(node, program.params(index), &numel_of, |i| {
                node.inputs
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|id| graph.tensors.get(id))
                    .map(|t| t.ty.shape.clone())
                    .unwrap_or_default()
            });
            seconds += (flops / self.flops_per_s).max(traffic as f64 / self.bytes_per_s);
        }
        Duration::from_secs_f64(seconds) + self.per_node * graph.nodes.len() as u32
    }
}

/// Floating-point operations of one node: 2 per multiply-add for products and
/// convolutions, one per output element otherwise.
fn flops(
    node: &Node,
    params: &OpParams,
    numel: &dyn Fn(Option<usize>) -> u64,
    shape: impl Fn(usize) -> Vec<u64>,
) -> f64 {
    let out = numel(node.outputs.first().copied().flatten()) as f64;
    match (node.op, params) {
        // [m, k] x [k, n] (addmm: bias first) and [b, m, k] x [b, k, n]: k = inner size.
        (Op::Mm | Op::Bmm, _) => 2.0 * out * shape(0).last().copied().unwrap_or(1) as f64,
        (Op::Addmm, _) => 2.0 * out * shape(1).last().copied().unwrap_or(1) as f64,
        // The backward computes one such product for each of the input and weight
        // gradients it is asked for (`output_mask`); the bias gradient is a sum.
        (Op::Convolution, OpParams::Conv(conv)) => 2.0 * conv_products(conv),
        (Op::ConvolutionBackward, OpParams::Conv(conv)) => {
            let passes = conv.output_mask[..2].iter().filter(|&&m| m).count();
            passes as f64 * 2.0 * conv_products(conv)
        }
        _ => out,
    }
}

/// Multiply-adds of one convolution: every weight element meets every position of the
/// smaller spatial side (the output, or the input when transposed) of every image.
fn conv_products(conv: &ConvParams) -> f64 {
    let small = if conv.transposed {
        &conv.input
    } else {
        &conv.output
    };
    let weight = conv.in_channels * conv.out_per_group() * conv.kernel.iter().product::<u64>();
    (conv.batch * weight * small.iter().product::<u64>()) as f64
}

/// The sim device.
pub struct SimDevice {
    model: CostModel,
    claims: Claims,
    /// Iterations that succeed before an injected fault poisons the device (tests of
    /// recovery from a device fault); `None`: never.
    fault_after: Option<u64>,
    runs: AtomicU64,
    poisoned: AtomicBool,
}

impl SimDevice {
    /// A sim device of `capacity` bytes timing iterations with `model`.
    pub fn new(capacity: u64, model: CostModel) -> SimDevice {
        SimDevice {
            model,
            claims: Claims::new(usize::try_from(capacity).unwrap_or(usize::MAX)),
            fault_after: None,
            runs: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
        }
    }

    /// The same device, poisoned by an injected fault in the iteration after the first
    /// `runs` (as a GPU context is by a faulting kernel): that iteration and every later
    /// call fail, and [`Device::health`] reports it.
    pub fn with_fault_after(mut self, runs: u64) -> SimDevice {
        self.fault_after = Some(runs);
        self
    }

    fn check_healthy(&self) -> Result<(), ExecError> {
        match self.poisoned.load(Ordering::SeqCst) {
            true => Err(ExecError::Device(POISONED.into())),
            false => Ok(()),
        }
    }
}

const POISONED: &str = "the sim device is poisoned by an injected fault";

impl Device for SimDevice {
    fn name(&self) -> String {
        "sim".into()
    }

    fn capacity(&self) -> u64 {
        self.claims.len() as u64
    }

    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        self.check_healthy()?;
        self.claims.claim(offset, bytes.len() as u64).map(drop)
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        self.check_healthy()?;
        let _region = self.claims.claim(offset, len)?;
        Ok(vec![0; len as usize])
    }

    fn health(&self) -> Result<(), String> {
        self.check_healthy().map_err(|e| e.to_string())
    }

    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError> {
        let start = Instant::now();
        self.check_healthy()?;
        let run = self.runs.fetch_add(1, Ordering::SeqCst);
        if self.fault_after.is_some_and(|after| run >= after) {
            self.poisoned.store(true, Ordering::SeqCst);
            return Err(ExecError::Device(POISONED.into()));
        }
        program.check_feeds(feeds)?;
        let plan = program.plan();
        let _persistent = self.claims.claim(at.persistent, plan.persistent_bytes)?;
        let _lane = self.claims.claim(at.lane, plan.ephemeral_bytes)?;
        let modeled = program
            .expected_iteration()
            .unwrap_or_else(|| self.model.iteration(program));
        let fetches = program
            .graph()
            .fetches
            .iter()
            .map(|&id| vec![0; program.bytes(id) as usize])
            .collect();
        std::thread::sleep(modeled.saturating_sub(start.elapsed()));
        Ok(Outcome {
            fetches,
            duration: modeled,
        })
    }
}
