//! The cuDNN calls of the backend: loading the library from a folder, handles, the
//! descriptors of one convolution, the heuristics that choose its algorithms, their
//! workspace sizes, and the three convolution calls. Legacy API only (`cudnnConvolution*`
//! and `cudnnGetConvolution*Algorithm_v7`): nothing here runs a kernel while choosing.

use std::ffi::{c_int, c_void};
use std::path::Path;

use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys as dnn_sys;
use cudarc::driver::sys;

use super::Raw;

pub(crate) type Handle = Raw<dnn_sys::cudnnHandle_t>;

fn status(what: &str, e: dnn::CudnnError) -> String {
    format!("{what}: {:?}", e.0)
}

/// Loads `dir/libcudnn.so.9`, then every `dir/libcudnn_*.so.9` sub-library, by absolute
/// path and into the global namespace, and keeps them loaded for the life of the process.
/// The `libcudnn.so.9` shim opens its sub-libraries by soname, and cudarc opens
/// `libcudnn.so.9` by soname too: the loader answers both with these copies, whatever
/// `LD_LIBRARY_PATH` says. Sub-libraries load in rounds, since one may need another
/// loaded first; one that never loads is named in the result (cuDNN then reports the
/// calls that need it as failures, which planning turns into a fallback).
pub(crate) fn preload(dir: &Path) -> Result<Vec<String>, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    let open = |path: &Path| {
        // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's cuDNN
        // libraries from the folder discovery chose, the same files PyTorch loads.
        unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
    };
    let shim = dir.join(crate::cudnn::SONAME);
    let lib = open(&shim).map_err(|e| format!("loading {}: {e}", shim.display()))?;
    std::mem::forget(lib);
    let mut pending: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(crate::cudnn::is_sublibrary)
        })
        .collect();
    pending.sort();
    loop {
        let before = pending.len();
        pending.retain(|p| match open(p) {
            Ok(lib) => {
                std::mem::forget(lib);
                false
            }
            Err(_) => true,
        });
        if pending.is_empty() || pending.len() == before {
            break;
        }
    }
    Ok(pending
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect())
}

/// True when `libcudnn.so.9` opens by name (the loader path, or preloaded).
pub(crate) fn present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { dnn_sys::is_culib_present() }
}

/// The library's version as (major, minor, patch), after checking that its convolution
/// and ops parts load.
pub(crate) fn version() -> Result<(usize, usize, usize), String> {
    // SAFETY: plain queries of a loaded library (present() was true).
    unsafe {
        dnn_sys::cudnnOpsVersionCheck()
            .result()
            .map_err(|e| status("cudnnOpsVersionCheck", e))?;
        dnn_sys::cudnnCnnVersionCheck()
            .result()
            .map_err(|e| status("cudnnCnnVersionCheck", e))?;
    }
    let v = dnn::get_version();
    Ok((v / 10_000, v % 10_000 / 100, v % 100))
}

/// A handle in the current context, its work ordered on `stream` (the default stream when
/// `None`: planning runs nothing on it).
pub(crate) fn new_handle(stream: Option<Raw<sys::CUstream>>) -> Result<Handle, String> {
    let h = dnn::create_handle().map_err(|e| status("cudnnCreate", e))?;
    if let Some(s) = stream {
        // SAFETY: a handle just created and a live stream of the current context; the
        // lane that owns both destroys the handle before the stream.
        if let Err(e) = unsafe { dnn::set_stream(h, s.0 as dnn_sys::cudaStream_t) } {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { dnn::destroy_handle(h) };
            return Err(status("cudnnSetStream", e));
        }
    }
    Ok(Raw(h))
}

/// Orders a handle's later calls on `s`.
pub(crate) fn set_stream(h: Handle, s: Raw<sys::CUstream>) -> Result<(), String> {
    // SAFETY: a live handle and stream of the lane that owns both.
    unsafe { dnn::set_stream(h.0, s.0 as dnn_sys::cudaStream_t) }
        .map_err(|e| status("cudnnSetStream", e))
}

pub(crate) fn destroy_handle(h: Handle) {
    // SAFETY: destroyed once, by its owner's Drop.
    let _ = unsafe { dnn::destroy_handle(h.0) };
}

/// Element type of a convolution's operands (all the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum DnnType {
    F32,
    F16,
    Bf16,
}

/// Which of the three calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Direction {
    Forward,
    BackwardData,
    BackwardFilter,
}

/// One convolution in cuDNN's terms: NC(D)HW tensors, a K C/groups (D)HW filter, 2 or 3
/// spatial dimensions (a 1-d convolution is a 2-d one of height 1), cross-correlation as
/// PyTorch computes it, f32 accumulation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ConvShape {
    pub ty: DnnType,
    /// f32 may use TF32 tensor cores.
    pub tf32: bool,
    pub x: Vec<i32>,
    pub w: Vec<i32>,
    pub y: Vec<i32>,
    pub pad: Vec<i32>,
    pub stride: Vec<i32>,
    pub dilation: Vec<i32>,
    pub groups: i32,
}

impl ConvShape {
    fn data_type(&self) -> dnn_sys::cudnnDataType_t {
        match self.ty {
            DnnType::F32 => dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            DnnType::F16 => dnn_sys::cudnnDataType_t::CUDNN_DATA_HALF,
            DnnType::Bf16 => dnn_sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        }
    }

    /// f32 without TF32: only FMA math may run it.
    fn ieee(&self) -> bool {
        self.ty == DnnType::F32 && !self.tf32
    }

    /// The math type asked for before the heuristics answer (PyTorch's choice).
    fn requested_math(&self) -> dnn_sys::cudnnMathType_t {
        use dnn_sys::cudnnMathType_t::*;
        match self.ty {
            DnnType::F32 if self.tf32 => CUDNN_DEFAULT_MATH,
            DnnType::F32 => CUDNN_FMA_MATH,
            DnnType::F16 | DnnType::Bf16 => CUDNN_TENSOR_OP_MATH,
        }
    }
}

fn contiguous(dims: &[i32]) -> Vec<i32> {
    let mut s = vec![1i32; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1].saturating_mul(dims[d + 1]);
    }
    s
}

/// The four descriptors of one convolution, destroyed together.
#[derive(Debug)]
pub(crate) struct ConvDescriptors {
    x: dnn_sys::cudnnTensorDescriptor_t,
    w: dnn_sys::cudnnFilterDescriptor_t,
    y: dnn_sys::cudnnTensorDescriptor_t,
    conv: dnn_sys::cudnnConvolutionDescriptor_t,
}

// SAFETY: descriptors are host structures cuDNN only reads during a call; the backend
// sets them once, when built, and uses each set under the lock of the lane that owns it
// (or the planner's lock).
unsafe impl Send for ConvDescriptors {}
// SAFETY: as above.
unsafe impl Sync for ConvDescriptors {}

impl Drop for ConvDescriptors {
    fn drop(&mut self) {
        // SAFETY: each created once in `build`, destroyed once here; null ones skipped.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
        }
    }
}

impl ConvDescriptors {
    /// Descriptors for `shape` with math type `math`; checks that cuDNN computes the
    /// output size the graph has.
    pub(crate) fn build(
        shape: &ConvShape,
        math: dnn_sys::cudnnMathType_t,
    ) -> Result<ConvDescriptors, String> {
        let nd = shape.x.len();
        let spatial = nd - 2;
        if !(4..=5).contains(&nd)
            || shape.w.len() != nd
            || shape.y.len() != nd
            || [&shape.pad, &shape.stride, &shape.dilation]
                .iter()
                .any(|v| v.len() != spatial)
        {
            return Err(format!("cuDNN: unsupported convolution shape {shape:?}"));
        }
        let mut d = ConvDescriptors {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
        };
        let dt = shape.data_type();
        let fail = |what: &str, e: dnn::CudnnError| status(what, e);
        d.x =
            dnn::create_tensor_descriptor().map_err(|e| fail("cudnnCreateTensorDescriptor", e))?;
        d.y =
            dnn::create_tensor_descriptor().map_err(|e| fail("cudnnCreateTensorDescriptor", e))?;
        d.w =
            dnn::create_filter_descriptor().map_err(|e| fail("cudnnCreateFilterDescriptor", e))?;
        d.conv = dnn::create_convolution_descriptor()
            .map_err(|e| fail("cudnnCreateConvolutionDescriptor", e))?;
        let (xs, ys) = (contiguous(&shape.x), contiguous(&shape.y));
        // SAFETY: descriptors just created; every array has `nd` (or `spatial`) entries,
        // checked above, and cuDNN copies them during the call.
        unsafe {
            dnn::set_tensornd_descriptor(d.x, dt, nd as c_int, shape.x.as_ptr(), xs.as_ptr())
                .map_err(|e| fail("cudnnSetTensorNdDescriptor (input)", e))?;
            dnn::set_tensornd_descriptor(d.y, dt, nd as c_int, shape.y.as_ptr(), ys.as_ptr())
                .map_err(|e| fail("cudnnSetTensorNdDescriptor (output)", e))?;
            dnn::set_filternd_descriptor(
                d.w,
                dt,
                dnn_sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
                nd as c_int,
                shape.w.as_ptr(),
            )
            .map_err(|e| fail("cudnnSetFilterNdDescriptor", e))?;
            dnn::set_convolutionnd_descriptor(
                d.conv,
                spatial as c_int,
                shape.pad.as_ptr(),
                shape.stride.as_ptr(),
                shape.dilation.as_ptr(),
                dnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(|e| fail("cudnnSetConvolutionNdDescriptor", e))?;
            dnn::set_convolution_group_count(d.conv, shape.groups)
                .map_err(|e| fail("cudnnSetConvolutionGroupCount", e))?;
            dnn::set_convolution_math_type(d.conv, math)
                .map_err(|e| fail("cudnnSetConvolutionMathType", e))?;
            let mut out = vec![0 as c_int; nd];
            dnn_sys::cudnnGetConvolutionNdForwardOutputDim(
                d.conv,
                d.x,
                d.w,
                nd as c_int,
                out.as_mut_ptr(),
            )
            .result()
            .map_err(|e| fail("cudnnGetConvolutionNdForwardOutputDim", e))?;
            if out != shape.y {
                return Err(format!(
                    "cuDNN computes output {out:?} where the graph has {:?}",
                    shape.y
                ));
            }
        }
        Ok(d)
    }
}

/// One algorithm perf record as the `_v7` heuristics write it, read as plain integers so
/// that a value this binding does not know can never become an invalid Rust enum. The
/// layout is that of `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t` (checked by a
/// test).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PerfRecord {
    pub algo: u32,
    pub status: u32,
    pub time: f32,
    pub memory: usize,
    pub determinism: u32,
    pub math: u32,
    pub reserved: [c_int; 3],
}

/// The algorithm chosen for one direction of one convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Choice {
    pub direction: Direction,
    pub algo: u32,
    /// The math type the descriptors are set to when it runs.
    pub math: u32,
    /// Bytes of workspace it is given.
    pub workspace: u64,
}

const MAX_RESULTS: usize = 16;

fn math_from(v: u32) -> Option<dnn_sys::cudnnMathType_t> {
    use dnn_sys::cudnnMathType_t::*;
    Some(match v {
        0 => CUDNN_DEFAULT_MATH,
        1 => CUDNN_TENSOR_OP_MATH,
        2 => CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        3 => CUDNN_FMA_MATH,
        _ => return None,
    })
}

fn fwd_algo(v: u32) -> Option<dnn_sys::cudnnConvolutionFwdAlgo_t> {
    use dnn_sys::cudnnConvolutionFwdAlgo_t::*;
    Some(match v {
        0 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        1 => CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        2 => CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        3 => CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        4 => CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        5 => CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        6 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        7 => CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
        _ => return None,
    })
}

fn data_algo(v: u32) -> Option<dnn_sys::cudnnConvolutionBwdDataAlgo_t> {
    use dnn_sys::cudnnConvolutionBwdDataAlgo_t::*;
    Some(match v {
        0 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        1 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        2 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        3 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        4 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        5 => CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
        _ => return None,
    })
}

fn filter_algo(v: u32) -> Option<dnn_sys::cudnnConvolutionBwdFilterAlgo_t> {
    use dnn_sys::cudnnConvolutionBwdFilterAlgo_t::*;
    Some(match v {
        0 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
        1 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
        2 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
        3 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
        4 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
        5 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
        6 => CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
        _ => return None,
    })
}

/// Workspace bytes of `algo` for `direction` with descriptors `d`.
fn workspace(
    h: Handle,
    d: &ConvDescriptors,
    direction: Direction,
    algo: u32,
) -> Result<usize, String> {
    let unknown = || format!("cuDNN: unknown {direction:?} algorithm {algo}");
    // SAFETY: live handle and descriptors; cuDNN writes one size_t.
    unsafe {
        match direction {
            Direction::Forward => dnn::get_convolution_forward_workspace_size(
                h.0,
                d.x,
                d.w,
                d.conv,
                d.y,
                fwd_algo(algo).ok_or_else(unknown)?,
            ),
            Direction::BackwardData => dnn::get_convolution_backward_data_workspace_size(
                h.0,
                d.w,
                d.y,
                d.conv,
                d.x,
                data_algo(algo).ok_or_else(unknown)?,
            ),
            Direction::BackwardFilter => dnn::get_convolution_backward_filter_workspace_size(
                h.0,
                d.x,
                d.y,
                d.conv,
                d.w,
                filter_algo(algo).ok_or_else(unknown)?,
            ),
        }
    }
    .map_err(|e| status("cudnnGetConvolution*WorkspaceSize", e))
}

/// Chooses the algorithm for one direction of `shape` from cuDNN's heuristics
/// (`cudnnGetConvolution*Algorithm_v7`, which runs nothing on the GPU): the first one
/// cuDNN ranks that succeeded, needs at most `limit` bytes of workspace, and, for f32
/// without TF32, does not use tensor cores. Its workspace is asked again with the
/// descriptors set to the math type it will run with.
pub(crate) fn choose(
    h: Handle,
    shape: &ConvShape,
    direction: Direction,
    limit: u64,
) -> Result<Choice, String> {
    let d = ConvDescriptors::build(shape, shape.requested_math())?;
    let mut perf = [PerfRecord::default(); MAX_RESULTS];
    let mut count: c_int = 0;
    // SAFETY: live handle and descriptors; `perf` has room for MAX_RESULTS records of the
    // perf struct's layout (PerfRecord mirrors it) and cuDNN writes at most that many.
    let r = unsafe {
        match direction {
            Direction::Forward => dnn::get_convolution_forward_algorithm(
                h.0,
                d.x,
                d.w,
                d.conv,
                d.y,
                MAX_RESULTS as c_int,
                &mut count,
                perf.as_mut_ptr().cast(),
            ),
            Direction::BackwardData => dnn::get_convolution_backward_data_algorithm(
                h.0,
                d.w,
                d.y,
                d.conv,
                d.x,
                MAX_RESULTS as c_int,
                &mut count,
                perf.as_mut_ptr().cast(),
            ),
            Direction::BackwardFilter => dnn::get_convolution_backward_filter_algorithm(
                h.0,
                d.x,
                d.y,
                d.conv,
                d.w,
                MAX_RESULTS as c_int,
                &mut count,
                perf.as_mut_ptr().cast(),
            ),
        }
    };
    r.map_err(|e| status("cudnnGetConvolution*Algorithm_v7", e))?;
    let count = (count.max(0) as usize).min(MAX_RESULTS);
    let mut why = Vec::new();
    for p in &perf[..count] {
        if p.status != 0 {
            continue;
        }
        let tensor_ops = p.math == 1 || p.math == 2;
        if shape.ieee() && tensor_ops {
            continue;
        }
        let math = if shape.ieee() { 3 } else { p.math };
        let Some(math_type) = math_from(math) else {
            continue;
        };
        if p.memory as u64 > limit {
            why.push(format!("algorithm {} needs {} bytes", p.algo, p.memory));
            continue;
        }
        let run = match ConvDescriptors::build(shape, math_type) {
            Ok(run) => run,
            Err(e) => {
                why.push(e);
                continue;
            }
        };
        match workspace(h, &run, direction, p.algo) {
            Ok(bytes) if bytes as u64 <= limit => {
                return Ok(Choice {
                    direction,
                    algo: p.algo,
                    math,
                    workspace: bytes as u64,
                });
            }
            Ok(bytes) => why.push(format!("algorithm {} needs {bytes} bytes", p.algo)),
            Err(e) => why.push(format!("algorithm {}: {e}", p.algo)),
        }
    }
    Err(format!(
        "cuDNN offers no usable {direction:?} algorithm ({count} ranked{}{})",
        if why.is_empty() { "" } else { ": " },
        why.join("; ")
    ))
}

/// The descriptors `choice` runs with.
pub(crate) fn descriptors_for(
    shape: &ConvShape,
    choice: &Choice,
) -> Result<ConvDescriptors, String> {
    let math = math_from(choice.math).ok_or("cuDNN: unknown math type")?;
    ConvDescriptors::build(shape, math)
}

/// One convolution call, every address absolute: `a`, `b` the operands read and `c` the
/// one written, in the order of the direction's formula (forward: x, w -> y; backward
/// data: w, dy -> dx; backward filter: x, dy -> dw).
#[derive(Debug, Clone)]
pub(crate) struct DnnConv {
    /// The node it lowers, for errors.
    pub node: usize,
    pub descriptors: std::sync::Arc<ConvDescriptors>,
    pub choice: Choice,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub workspace: u64,
}

/// Runs `call` on `h` (bound to the lane's stream).
pub(crate) fn convolve(h: Handle, call: &DnnConv) -> Result<(), String> {
    let d = &*call.descriptors;
    let (alpha, beta) = (1.0f32, 0.0f32);
    let alpha = &alpha as *const f32 as *const c_void;
    let beta = &beta as *const f32 as *const c_void;
    let ws = call.workspace as *mut c_void;
    let bytes = call.choice.workspace as usize;
    let algo = call.choice.algo;
    let unknown = || format!("cuDNN: unknown algorithm {algo}");
    // SAFETY: live handle (bound to the lane's stream) and descriptors matching the
    // operands' shapes and dtype; the operands lie in the arena at the addresses the
    // lowering computed from the program's plan, the workspace in the node's scratch of at
    // least `bytes` bytes (checked when lowered); alpha and beta are host f32 scalars read
    // before the call returns.
    let r = unsafe {
        match call.choice.direction {
            Direction::Forward => dnn::convolution_forward(
                h.0,
                alpha,
                d.x,
                call.a as *const c_void,
                d.w,
                call.b as *const c_void,
                d.conv,
                fwd_algo(algo).ok_or_else(unknown)?,
                ws,
                bytes,
                beta,
                d.y,
                call.c as *mut c_void,
            ),
            Direction::BackwardData => dnn::convolution_backward_data(
                h.0,
                alpha,
                d.w,
                call.a as *const c_void,
                d.y,
                call.b as *const c_void,
                d.conv,
                data_algo(algo).ok_or_else(unknown)?,
                ws,
                bytes,
                beta,
                d.x,
                call.c as *mut c_void,
            ),
            Direction::BackwardFilter => dnn::convolution_backward_filter(
                h.0,
                alpha,
                d.x,
                call.a as *const c_void,
                d.y,
                call.b as *const c_void,
                d.conv,
                filter_algo(algo).ok_or_else(unknown)?,
                ws,
                bytes,
                beta,
                d.w,
                call.c as *mut c_void,
            ),
        }
    };
    r.map_err(|e| status(&format!("cuDNN {:?} convolution", call.choice.direction), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_records_have_the_layout_of_cudnns() {
        use std::mem::{align_of, size_of};
        for (size, align) in [
            (
                size_of::<dnn_sys::cudnnConvolutionFwdAlgoPerf_t>(),
                align_of::<dnn_sys::cudnnConvolutionFwdAlgoPerf_t>(),
            ),
            (
                size_of::<dnn_sys::cudnnConvolutionBwdDataAlgoPerf_t>(),
                align_of::<dnn_sys::cudnnConvolutionBwdDataAlgoPerf_t>(),
            ),
            (
                size_of::<dnn_sys::cudnnConvolutionBwdFilterAlgoPerf_t>(),
                align_of::<dnn_sys::cudnnConvolutionBwdFilterAlgoPerf_t>(),
            ),
        ] {
            assert_eq!(size, size_of::<PerfRecord>());
            assert_eq!(align, align_of::<PerfRecord>());
        }
        use std::mem::offset_of;
        type Fwd = dnn_sys::cudnnConvolutionFwdAlgoPerf_t;
        assert_eq!(offset_of!(PerfRecord, status), offset_of!(Fwd, status));
        assert_eq!(offset_of!(PerfRecord, memory), offset_of!(Fwd, memory));
        assert_eq!(offset_of!(PerfRecord, math), offset_of!(Fwd, mathType));
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous(&[2, 3, 4, 5]), vec![60, 20, 5, 1]);
    }
}
