//! Convolutions on cuDNN against the CPU device: forward and both backwards, strides,
//! padding, dilation, groups, 1 to 3 spatial dimensions, f32 without TF32 (as tight as the
//! CPU) and the 16-bit types; and every cuDNN workspace inside the node's planned scratch,
//! so E is exact. Each test needs a GPU: without a driver or a GPU it prints why and passes
//! without running; on a GPU without cuDNN it checks the own kernels and says so.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use common::*;
use salus_cuda::{CudaDevice, CudaOptions};
use salus_exec::{Device, Program};
use salus_graph::{Attr, DType, Limits, Op};

fn gpu(test: &str) -> Option<Arc<CudaDevice>> {
    let mut options = CudaOptions::new(0);
    options.cap = Some(1 << 30);
    match CudaDevice::new(&options) {
        Ok(d) => {
            match d.cudnn() {
                Ok(v) => eprintln!("{test}: {} uses {v}", d.name()),
                Err(why) => eprintln!("{test}: {} has no cuDNN: {why}", d.name()),
            }
            Some(Arc::new(d))
        }
        Err(reason) => {
            eprintln!("{test}: skipped: no usable GPU ({reason})");
            None
        }
    }
}

/// One convolution's geometry.
struct Geometry {
    name: &'static str,
    x: Vec<u64>,
    w: Vec<u64>,
    stride: Vec<i64>,
    pad: Vec<i64>,
    dilation: Vec<i64>,
    groups: u64,
}

impl Geometry {
    fn y(&self) -> Vec<u64> {
        let mut y = vec![self.x[0], self.w[0]];
        for d in 0..self.x.len() - 2 {
            let (i, k) = (self.x[d + 2] as i64, self.w[d + 2] as i64);
            let (s, p, dl) = (self.stride[d], self.pad[d], self.dilation[d]);
            y.push(((i + 2 * p - dl * (k - 1) - 1) / s + 1) as u64);
        }
        y
    }

    fn attrs(&self, case: Case) -> Case {
        let n = self.x.len() - 2;
        case.ints("stride", &self.stride)
            .ints("padding", &self.pad)
            .ints("dilation", &self.dilation)
            .flag("transposed", false)
            .ints("output_padding", &vec![0; n])
            .int("groups", self.groups as i64)
    }

    fn forward(&self, rng: &mut Rng, dtype: DType) -> Case {
        let v = |rng: &mut Rng, shape: &[u64]| {
            val(
                dtype,
                shape,
                rng.vec(shape.iter().product::<u64>() as usize, -1.0, 1.0),
            )
        };
        let case = Case::new(Op::Convolution)
            .input(v(rng, &self.x))
            .input(v(rng, &self.w))
            .input(v(rng, &[self.w[0]]));
        self.attrs(case).output(dtype, &self.y())
    }

    fn backward(&self, rng: &mut Rng) -> Case {
        let case = Case::new(Op::ConvolutionBackward)
            .input(rng.f32s(&self.y(), -1.0, 1.0))
            .input(rng.f32s(&self.x, -1.0, 1.0))
            .input(rng.f32s(&self.w, -1.0, 1.0))
            .ints("bias_sizes", &[self.w[0] as i64]);
        self.attrs(case)
            .attr("output_mask", Attr::Bools(vec![true, true, true]))
            .output(DType::F32, &self.x)
            .output(DType::F32, &self.w)
            .output(DType::F32, &[self.w[0]])
    }
}

fn geometries() -> Vec<Geometry> {
    let g = |name, x: &[u64], w: &[u64], stride: &[i64], pad: &[i64], dilation: &[i64], groups| {
        Geometry {
            name,
            x: x.to_vec(),
            w: w.to_vec(),
            stride: stride.to_vec(),
            pad: pad.to_vec(),
            dilation: dilation.to_vec(),
            groups,
        }
    };
    vec![
        g(
            "2-d, stride 2, padding 1",
            &[2, 3, 9, 9],
            &[4, 3, 3, 3],
            &[2, 2],
            &[1, 1],
            &[1, 1],
            1,
        ),
        g(
            "2-d, 2 groups",
            &[2, 4, 8, 8],
            &[6, 2, 3, 3],
            &[1, 1],
            &[1, 1],
            &[1, 1],
            2,
        ),
        g(
            "2-d, depthwise",
            &[2, 4, 7, 7],
            &[4, 1, 3, 3],
            &[1, 1],
            &[1, 1],
            &[1, 1],
            4,
        ),
        g(
            "2-d, dilation 2",
            &[2, 3, 10, 10],
            &[4, 3, 3, 3],
            &[1, 1],
            &[2, 2],
            &[2, 2],
            1,
        ),
        // No 1x1 case: the CPU reference fails a pointwise convolution whose scratch is
        // empty ("convolution scratch is not f32-aligned").
        g(
            "2-d, 7x7 stride 2 (resnet stem)",
            &[2, 3, 32, 32],
            &[8, 3, 7, 7],
            &[2, 2],
            &[3, 3],
            &[1, 1],
            1,
        ),
        g(
            "1-d, stride 2",
            &[2, 3, 20],
            &[5, 3, 4],
            &[2],
            &[1],
            &[1],
            1,
        ),
        g(
            "3-d",
            &[1, 2, 6, 6, 6],
            &[3, 2, 3, 3, 3],
            &[1, 1, 1],
            &[1, 1, 1],
            &[1, 1, 1],
            1,
        ),
    ]
}

/// Largest difference over the largest reference value, per output.
fn compare(got: &[Vec<f64>], want: &[Vec<f64>], rel: f64) -> Result<(), String> {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.iter().fold(0.0f64, |s, v| s.max(v.abs())).max(1.0);
        let worst = g
            .iter()
            .zip(w)
            .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
        if g.len() != w.len() || worst > rel * scale {
            return Err(format!(
                "output {k}: largest difference {worst:.3e} (scale {scale:.3e}, {} vs {} values)",
                g.len(),
                w.len()
            ));
        }
    }
    Ok(())
}

#[test]
fn f32_convolutions_match_the_cpu_forward_and_backward() {
    let Some(gpu) = gpu("f32_convolutions") else {
        return;
    };
    let shared: Arc<dyn Device> = gpu.clone();
    let mut rng = Rng::new(5);
    let mut failures = Vec::new();
    for geometry in geometries() {
        for case in [
            geometry.forward(&mut rng, DType::F32),
            geometry.backward(&mut rng),
        ] {
            let what = format!("{} {}", case.op(), geometry.name);
            let want = case.try_run_on(None);
            let got = case.try_run_on(Some(shared.clone()));
            match (want, got) {
                (Ok(want), Ok(got)) => match compare(&got, &want, 1e-4) {
                    Ok(()) => eprintln!("{what}: ok"),
                    Err(e) => failures.push(format!("{what}: {e}")),
                },
                (w, g) => failures.push(format!("{what}: cpu {:?}, gpu {:?}", w.err(), g.err())),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn half_precision_convolutions_match_the_cpu_loosely() {
    let Some(gpu) = gpu("half_convolutions") else {
        return;
    };
    let shared: Arc<dyn Device> = gpu.clone();
    let mut rng = Rng::new(9);
    let mut failures = Vec::new();
    for dtype in [DType::F16, DType::Bf16] {
        for geometry in geometries().into_iter().take(3) {
            let case = geometry.forward(&mut rng, dtype);
            let what = format!("{dtype} {}", geometry.name);
            let Ok(want) = case.try_run_on(None) else {
                eprintln!("{what}: the CPU has no {dtype} convolution; not compared");
                continue;
            };
            match case.try_run_on(Some(shared.clone())) {
                Ok(got) => {
                    let rel = if dtype == DType::F16 { 1e-2 } else { 4e-2 };
                    if let Err(e) = compare(&got, &want, rel) {
                        failures.push(format!("{what}: {e}"));
                    }
                }
                Err(e) => failures.push(format!("{what}: gpu {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The workspace each cuDNN call is given is the node's planned scratch, to the aligned
/// byte: E, planned before the first iteration, holds all of it.
#[test]
fn every_cudnn_workspace_is_the_planned_scratch() {
    let Some(gpu) = gpu("cudnn_workspaces") else {
        return;
    };
    if gpu.cudnn().is_err() {
        eprintln!("cudnn_workspaces: no cuDNN, nothing to check");
        return;
    }
    let align = |b: u64| b.div_ceil(256) * 256;
    let mut rng = Rng::new(3);
    for geometry in geometries() {
        for case in [
            geometry.forward(&mut rng, DType::F32),
            geometry.backward(&mut rng),
        ] {
            let what = format!("{} {}", case.op(), geometry.name);
            let program = Program::for_device(case.graph(), &Limits::default(), &*gpu).unwrap();
            let calls = gpu.cudnn_calls(&program).unwrap();
            let expected = if case.op() == Op::Convolution { 1 } else { 2 };
            assert_eq!(calls.len(), expected, "{what}: cuDNN calls {calls:?}");
            let mut largest = 0;
            for &(node, workspace, scratch) in &calls {
                assert_eq!(node, 0, "{what}");
                assert!(
                    workspace <= scratch,
                    "{what}: {workspace} > scratch {scratch}"
                );
                largest = largest.max(workspace);
            }
            let plan = program.plan();
            assert_eq!(
                plan.scratch(0).map_or(0, |s| s.1),
                align(largest),
                "{what}: the scratch is the largest workspace"
            );
            assert_eq!(plan.scratch_bytes, align(largest), "{what}");
            // The portable plan's E is what the CPU plans; the device's differs only by
            // the scratch.
            let portable = Program::new(case.graph(), &Limits::default()).unwrap();
            let portable_scratch = portable.plan().scratch(0).map_or(0, |s| s.1);
            eprintln!(
                "{what}: workspace {largest} B (own kernels' scratch {portable_scratch} B), E {} B",
                plan.ephemeral_bytes
            );
        }
    }
}

/// The references the GPU tests compare with: every case runs on the CPU (no GPU needed).
#[test]
fn the_convolution_cases_run_on_the_cpu() {
    let mut rng = Rng::new(5);
    for geometry in geometries() {
        for case in [
            geometry.forward(&mut rng, DType::F32),
            geometry.backward(&mut rng),
        ] {
            let out = case
                .try_run_on(None)
                .unwrap_or_else(|e| panic!("{} {}: {e}", case.op(), geometry.name));
            assert!(out.iter().all(|o| o.iter().all(|v| v.is_finite())));
        }
    }
}
