//! The few calls into the CUDA driver, cuBLAS and NVRTC that the backend makes, each a
//! small function over raw handles. Every `unsafe` block of the backend is here, with the
//! reason it is sound next to it.

#![allow(unsafe_code)]

pub(crate) mod cudnn;
pub(crate) mod green;
pub(crate) mod host;

use std::ffi::c_void;

use cudarc::cublas::result as cublas;
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc_sys;

use crate::abi::LaunchArgs;

/// Raw handles are plain pointers; the backend uses each one under a lock (a lane's
/// stream and cuBLAS handle) or only for calls the driver allows from any thread
/// (functions, modules, the context).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Raw<T>(pub T);
// SAFETY: CUDA driver handles may be used from any thread once the context is current;
// the backend binds its context on every thread that calls in and serialises the use of
// each stream and cuBLAS handle with the lock of its lane.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Raw<T> {}

/// True when the dynamic libraries are there: without this check cudarc panics on first
/// use.
pub(crate) fn libraries() -> Result<(), String> {
    // SAFETY: these only try to dlopen the libraries; they call nothing in them.
    let (driver, nvrtc, blas) = unsafe {
        (
            sys::is_culib_present(),
            nvrtc_sys::is_culib_present(),
            cublas_sys::is_culib_present(),
        )
    };
    if !driver {
        return Err("no CUDA driver (libcuda.so) found".into());
    }
    if !nvrtc {
        return Err("the CUDA driver is there but NVRTC (libnvrtc.so) is not".into());
    }
    if !blas {
        return Err("the CUDA driver is there but cuBLAS (libcublas.so) is not".into());
    }
    Ok(())
}

pub(crate) fn driver_error(what: &str, e: cu::DriverError) -> String {
    let name = e.error_name().map(|c| c.to_string_lossy().into_owned());
    format!("{what}: {}", name.unwrap_or_else(|_| format!("{:?}", e.0)))
}

/// True for errors after which the context is unusable ("sticky" errors).
pub(crate) fn is_sticky(e: &cu::DriverError) -> bool {
    use sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_UNKNOWN
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// The CUDA version the driver supports, as 1000 * major + 10 * minor.
pub(crate) fn driver_version() -> DResult<i32> {
    let mut v = 0;
    // SAFETY: writes one int; the library is loaded (checked by `libraries`).
    unsafe { sys::cuDriverGetVersion(&mut v).result()? };
    Ok(v)
}

pub(crate) fn device_attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, String> {
    // SAFETY: a device handle from cuDeviceGet; a read of one property.
    unsafe { cu::device::get_attribute(dev, a) }
        .map_err(|e| driver_error("cuDeviceGetAttribute", e))
}

pub(crate) fn device_total(dev: sys::CUdevice) -> Result<u64, String> {
    // SAFETY: as above.
    unsafe { cu::device::total_mem(dev) }
        .map(|b| b as u64)
        .map_err(|e| driver_error("cuDeviceTotalMem", e))
}

pub(crate) type DResult<T> = Result<T, cu::DriverError>;

pub(crate) fn malloc(bytes: usize) -> DResult<u64> {
    // SAFETY: plain allocation in the current context; freed by `free`.
    unsafe { cu::malloc_sync(bytes) }
}

pub(crate) fn free(ptr: u64) {
    // SAFETY: `ptr` came from `malloc` and is freed once, by its owner's Drop.
    let _ = unsafe { cu::free_sync(ptr) };
}

pub(crate) fn mem_info() -> DResult<(usize, usize)> {
    cu::mem_get_info()
}

pub(crate) fn new_stream() -> DResult<Raw<sys::CUstream>> {
    cu::stream::create(cu::stream::StreamKind::NonBlocking).map(Raw)
}

/// The current context's stream priorities, `(least, greatest)`: a lower number is a
/// higher priority, and the default (0) is the least.
pub(crate) fn stream_priorities() -> DResult<(i32, i32)> {
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: writes two ints; a context is bound to the thread.
    unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest).result()? };
    Ok((least, greatest))
}

/// A non-blocking stream at `priority` (within [`stream_priorities`]).
pub(crate) fn new_stream_at(priority: i32) -> DResult<Raw<sys::CUstream>> {
    let mut stream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: writes one stream handle; destroyed by `destroy_stream`.
    unsafe { sys::cuStreamCreateWithPriority(&mut stream, flags, priority).result()? };
    Ok(Raw(stream))
}

pub(crate) fn destroy_stream(s: Raw<sys::CUstream>) {
    // SAFETY: destroyed once, by its lane's Drop, after the lane's last use.
    let _ = unsafe { cu::stream::destroy(s.0) };
}

pub(crate) fn sync(s: Raw<sys::CUstream>) -> DResult<()> {
    // SAFETY: a live stream of this context.
    unsafe { cu::stream::synchronize(s.0) }
}

pub(crate) fn new_event() -> DResult<Raw<sys::CUevent>> {
    cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map(Raw)
}

pub(crate) fn destroy_event(e: Raw<sys::CUevent>) {
    // SAFETY: destroyed once, by its lane's Drop.
    let _ = unsafe { cu::event::destroy(e.0) };
}

pub(crate) fn record(e: Raw<sys::CUevent>, s: Raw<sys::CUstream>) -> DResult<()> {
    // SAFETY: live event and stream of this context.
    unsafe { cu::event::record(e.0, s.0) }
}

/// Makes `s` wait, on the GPU, for the work before `e`'s last record.
pub(crate) fn wait_event(s: Raw<sys::CUstream>, e: Raw<sys::CUevent>) -> DResult<()> {
    // SAFETY: a live stream and event of this context.
    unsafe { cu::stream::wait_event(s.0, e.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
}

/// Waits on the host for the work before `e`'s last record.
pub(crate) fn event_sync(e: Raw<sys::CUevent>) -> DResult<()> {
    // SAFETY: a live event of this context.
    unsafe { cu::event::synchronize(e.0) }
}

pub(crate) fn elapsed_ms(start: Raw<sys::CUevent>, end: Raw<sys::CUevent>) -> DResult<f32> {
    // SAFETY: both recorded on a stream that has been synchronised.
    unsafe { cu::event::elapsed(start.0, end.0) }
}

/// Host to device, ordered on `s`; the call returns once `src` has been read (pageable
/// host memory is staged before the call returns).
pub(crate) fn htod(dst: u64, src: &[u8], s: Raw<sys::CUstream>) -> DResult<()> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst..dst + len` lies inside the arena (checked by the caller); `src` is
    // pageable, so the driver copies it out before returning.
    unsafe { cu::memcpy_htod_async(dst, src, s.0) }
}

/// Device to host, ordered on `s`; the caller synchronises `s` before reading `dst`.
pub(crate) fn dtoh(dst: &mut [u8], src: u64, s: Raw<sys::CUstream>) -> DResult<()> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `src..src + len` lies inside the arena or the lane's error block; `dst`
    // outlives the copy because the caller synchronises the stream before using or
    // dropping it.
    unsafe { cu::memcpy_dtoh_async(dst, src, s.0) }
}

pub(crate) fn zero(ptr: u64, bytes: usize, s: Raw<sys::CUstream>) -> DResult<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: `ptr..ptr + bytes` lies inside memory this backend owns.
    unsafe { cu::memset_d8_async(ptr, 0, bytes, s.0) }
}

pub(crate) fn load_module(image: &[u8]) -> DResult<Raw<sys::CUmodule>> {
    // SAFETY: `image` is a CUBIN or a NUL-terminated PTX produced by NVRTC; the driver
    // copies it while loading.
    unsafe { cu::module::load_data(image.as_ptr() as *const c_void).map(Raw) }
}

pub(crate) fn function(m: Raw<sys::CUmodule>, name: &str) -> DResult<Raw<sys::CUfunction>> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| cu::DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE))?;
    // SAFETY: a loaded module, never unloaded while the device lives.
    unsafe { cu::module::get_function(m.0, c).map(Raw) }
}

/// Launches `f` with `args`, the kernel's one by-value argument struct.
pub(crate) fn launch(
    f: Raw<sys::CUfunction>,
    (grid, grid_y): (u32, u32),
    block: u32,
    args: &dyn LaunchArgs,
    s: Raw<sys::CUstream>,
) -> DResult<()> {
    let mut param = args as *const dyn LaunchArgs as *const c_void as *mut c_void;
    // SAFETY: `LaunchArgs` is implemented only by the `#[repr(C)]` argument structs of
    // `abi`, whose layout is the C struct the kernel takes (field by field, checked by
    // abi's tests against the source NVRTC compiles), and the lowering pairs each kernel
    // with its own struct. The driver copies the parameter block at launch (or capture),
    // and all pointers inside it lie in memory this backend owns.
    unsafe {
        cu::launch_kernel(
            f.0,
            (grid.max(1), grid_y.max(1), 1),
            (block.max(1), 1, 1),
            0,
            s.0,
            std::slice::from_mut(&mut param),
        )
    }
}

pub(crate) fn begin_capture(s: Raw<sys::CUstream>) -> DResult<()> {
    // SAFETY: a live stream; thread-local mode only forbids unsafe calls on this thread.
    unsafe {
        cu::stream::begin_capture(
            s.0,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    }
}

pub(crate) fn end_capture(s: Raw<sys::CUstream>) -> DResult<Raw<sys::CUgraph>> {
    // SAFETY: the stream is capturing (begin_capture succeeded).
    unsafe { cu::stream::end_capture(s.0).map(Raw) }
}

pub(crate) fn instantiate(g: Raw<sys::CUgraph>) -> DResult<Raw<sys::CUgraphExec>> {
    // SAFETY: a graph just captured; destroyed right after instantiation.
    let exec = unsafe { cu::graph::instantiate(g.0, sys::CUgraphInstantiate_flags(0)) };
    // SAFETY: the graph is no longer needed once instantiated (or on failure).
    let _ = unsafe { cu::graph::destroy(g.0) };
    exec.map(Raw)
}

pub(crate) fn destroy_graph(g: Raw<sys::CUgraph>) {
    // SAFETY: a graph owned by the caller, destroyed once.
    let _ = unsafe { cu::graph::destroy(g.0) };
}

pub(crate) fn launch_graph(g: Raw<sys::CUgraphExec>, s: Raw<sys::CUstream>) -> DResult<()> {
    // SAFETY: an instantiated graph of this context, on a live stream.
    unsafe { cu::graph::launch(g.0, s.0) }
}

pub(crate) fn destroy_exec(g: Raw<sys::CUgraphExec>) {
    // SAFETY: destroyed once, when its cache entry goes.
    let _ = unsafe { cu::graph::exec_destroy(g.0) };
}

/// A cuBLAS handle bound to one lane's stream and workspace.
pub(crate) fn new_blas(
    s: Raw<sys::CUstream>,
    workspace: u64,
    bytes: usize,
) -> Result<Raw<cublas_sys::cublasHandle_t>, String> {
    let h = Raw(cublas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?);
    set_blas_stream(h, s, workspace, bytes)?;
    Ok(h)
}

/// Orders a cuBLAS handle's later calls on `s`, in `workspace` (`bytes` long): setting
/// the stream resets cuBLAS to its own workspace pool, which would allocate outside the
/// arena (and cannot while a graph is captured), so the lane's is set again.
pub(crate) fn set_blas_stream(
    h: Raw<cublas_sys::cublasHandle_t>,
    s: Raw<sys::CUstream>,
    workspace: u64,
    bytes: usize,
) -> Result<(), String> {
    // SAFETY: a live handle, and a stream and workspace of the lane that owns all three.
    unsafe {
        cublas::set_stream(h.0, s.0 as cublas_sys::cudaStream_t)
            .map_err(|e| format!("cublasSetStream: {e:?}"))?;
        cublas_sys::cublasSetWorkspace_v2(h.0, workspace as *mut c_void, bytes)
            .result()
            .map_err(|e| format!("cublasSetWorkspace: {e:?}"))
    }
}

pub(crate) fn destroy_blas(h: Raw<cublas_sys::cublasHandle_t>) {
    // SAFETY: destroyed once, by its lane's Drop.
    let _ = unsafe { cublas::destroy_handle(h.0) };
}

/// Element type of a cuBLAS product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GemmType {
    F32,
    F16,
    Bf16,
}

/// One strided-batched product in cuBLAS's column-major terms.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub ty: GemmType,
    /// f32 may run on TF32 tensor cores (as the job's PyTorch allowed).
    pub tf32: bool,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    pub a: u64,
    pub lda: i32,
    pub stride_a: i64,
    pub b: u64,
    pub ldb: i32,
    pub stride_b: i64,
    pub beta: f32,
    pub c: u64,
    pub ldc: i32,
    pub stride_c: i64,
    pub batch: i32,
}

pub(crate) fn gemm(h: Raw<cublas_sys::cublasHandle_t>, g: &Gemm) -> Result<(), String> {
    let op = |t: bool| {
        if t {
            cublas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            cublas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (alpha, beta) = (g.alpha, g.beta);
    // Plain f32 goes through sgemm; TF32 and half precision through gemmEx, storing the
    // operands in `data` and accumulating in f32 (with TF32 tensor cores for TF32).
    let ex = match g.ty {
        GemmType::F32 if !g.tf32 => None,
        GemmType::F32 => Some((
            cublas_sys::cudaDataType::CUDA_R_32F,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        )),
        GemmType::F16 => Some((
            cublas_sys::cudaDataType::CUDA_R_16F,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )),
        GemmType::Bf16 => Some((
            cublas_sys::cudaDataType::CUDA_R_16BF,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )),
    };
    // SAFETY: the operands lie in the arena or the lane's scratch with the sizes the
    // lowering computed from the tensors' shapes; alpha and beta are host scalars that
    // live across the call (cuBLAS reads them before returning in host pointer mode).
    let r = unsafe {
        match ex {
            None => cublas::sgemm_strided_batched(
                h.0,
                op(g.trans_a),
                op(g.trans_b),
                g.m,
                g.n,
                g.k,
                &alpha,
                g.a as *const f32,
                g.lda,
                g.stride_a,
                g.b as *const f32,
                g.ldb,
                g.stride_b,
                &beta,
                g.c as *mut f32,
                g.ldc,
                g.stride_c,
                g.batch,
            ),
            Some((data, compute)) => cublas::gemm_strided_batched_ex(
                h.0,
                op(g.trans_a),
                op(g.trans_b),
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                data,
                g.lda,
                g.stride_a,
                g.b as *const c_void,
                data,
                g.ldb,
                g.stride_b,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                data,
                g.ldc,
                g.stride_c,
                g.batch,
                compute,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            ),
        }
    };
    r.map_err(|e| format!("cuBLAS gemm: {e:?}"))
}

/// Compiles `source` with NVRTC for `arch` (e.g. 90): a CUBIN for `sm_XX`, or a PTX for
/// `compute_XX` when NVRTC cannot make machine code for it. Returns (image, is_cubin).
pub(crate) fn nvrtc_compile(source: &str, arch: u32) -> Result<(Vec<u8>, bool), String> {
    use cudarc::nvrtc::result as nvrtc;
    let src = std::ffi::CString::new(source).map_err(|e| e.to_string())?;
    let attempt = |target: String, cubin: bool| -> Result<Vec<u8>, String> {
        let prog = nvrtc::create_program(&src, None).map_err(|e| format!("nvrtc: {e:?}"))?;
        let options = [target, "--std=c++14".to_string(), "-lineinfo".to_string()];
        // SAFETY: `prog` was just created and is destroyed below, once.
        let compiled = unsafe { nvrtc::compile_program(prog, &options) };
        let result = match compiled {
            Err(e) => {
                // SAFETY: as above.
                let log = unsafe { nvrtc::get_program_log(prog) }
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(format!("nvrtc compile: {e:?}\n{log}"))
            }
            Ok(()) if cubin => {
                let mut size = 0usize;
                // SAFETY: compiled program; the buffer has the size NVRTC reports.
                unsafe {
                    nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
                    let mut buf = vec![0u8; size];
                    nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char)
                        .result()
                        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
                    Ok(buf)
                }
            }
            Ok(()) => {
                // SAFETY: compiled program.
                let ptx =
                    unsafe { nvrtc::get_ptx(prog) }.map_err(|e| format!("nvrtc ptx: {e:?}"))?;
                let mut bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
                if bytes.last() != Some(&0) {
                    bytes.push(0);
                }
                Ok(bytes)
            }
        };
        // SAFETY: destroyed once.
        let _ = unsafe { nvrtc::destroy_program(prog) };
        result
    };
    match attempt(format!("--gpu-architecture=sm_{arch}"), true) {
        Ok(image) => Ok((image, true)),
        Err(first) => attempt(format!("--gpu-architecture=compute_{arch}"), false)
            .map(|image| (image, false))
            .map_err(|second| format!("{first}\n(and as PTX: {second})")),
    }
}

/// NVRTC's version, for the cache key.
pub(crate) fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    let _ = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// Events for timing, destroyed together when dropped.
pub(crate) struct Events(Vec<Raw<sys::CUevent>>);

impl Events {
    /// `n` events with timing enabled.
    pub(crate) fn new(n: usize) -> DResult<Events> {
        let mut events = Events(Vec::with_capacity(n));
        for _ in 0..n {
            events.0.push(new_event()?);
        }
        Ok(events)
    }

    pub(crate) fn get(&self, k: usize) -> Raw<sys::CUevent> {
        self.0[k]
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // cuEventDestroy on an event still pending on a stream releases it once it
        // completes, so this is safe on any path.
        for &e in &self.0 {
            destroy_event(e);
        }
    }
}

/// The longest a [`Gate`] holds its stream: past this the stream goes on (and the gate
/// says so) rather than hang, e.g. when the driver's launch queue filled up behind it.
const GATE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Default)]
struct GateState {
    open: std::sync::atomic::AtomicBool,
    timed_out: std::sync::atomic::AtomicBool,
}

/// Holds a stream at a point until opened: work queued behind it starts only once all of
/// it has been issued, so the GPU runs it back to back, without the gaps of host launch
/// latency (for timing kernels one by one). Opens when dropped.
pub(crate) struct Gate(std::sync::Arc<GateState>);

/// The host function queued by [`Gate::hold`]: waits for the gate to open, at most
/// [`GATE_TIMEOUT`]. Makes no CUDA call, as host functions must not.
unsafe extern "C" fn wait_at_gate(user: *mut c_void) {
    use std::sync::atomic::Ordering;
    // SAFETY: `user` is the `Arc::into_raw` of `Gate::hold`, whose count the driver hands
    // to this call exactly once.
    let state = unsafe { std::sync::Arc::from_raw(user as *const GateState) };
    let start = std::time::Instant::now();
    while !state.open.load(Ordering::Acquire) {
        if start.elapsed() > GATE_TIMEOUT {
            state.timed_out.store(true, Ordering::Release);
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

impl Gate {
    /// Queues the gate on `s`, closed.
    pub(crate) fn hold(s: Raw<sys::CUstream>) -> DResult<Gate> {
        let state = std::sync::Arc::new(GateState::default());
        let user = std::sync::Arc::into_raw(state.clone()) as *mut c_void;
        // SAFETY: a live stream; `wait_at_gate` makes no CUDA call and takes ownership of
        // `user` (one count of the Arc), which stays valid until it runs.
        match unsafe { cu::stream::launch_host_function(s.0, wait_at_gate, user) } {
            Ok(()) => Ok(Gate(state)),
            Err(e) => {
                // SAFETY: the launch failed, so the host function will never run and
                // the count it would have taken is still ours to release.
                drop(unsafe { std::sync::Arc::from_raw(user as *const GateState) });
                Err(e)
            }
        }
    }

    /// Lets the stream go on.
    pub(crate) fn open(&self) {
        self.0
            .open
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// True when the gate gave up waiting (final once the stream has been synchronised).
    pub(crate) fn timed_out(&self) -> bool {
        self.0.timed_out.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}
