//! The CUDA device's lowering and kernels run on the CPU: a check of the GPU path where
//! there is no GPU. Tests only: it is slow (one host thread, a block's threads as fibers)
//! and needs a C++ compiler (`$CXX`, else `c++`).
//!
//! [`Emulator`] is a [`Device`] whose arena is host memory. An iteration lowers its program
//! exactly as [`crate::CudaDevice`] does (the same fused regions, batched launches, folded
//! transposes, command list; no cuDNN), then runs each command on the host: a kernel
//! launch calls the kernel's own source compiled for the CPU with `runtime.h` standing in
//! for CUDA's built-ins (block after block, each block's threads as fibers that switch at
//! `__syncthreads` and the warp shuffles); a generated fused kernel the same way; a cuBLAS
//! product through `driver::host::gemm` in f64. Feeds, fetches, the guarded update copies
//! and the error block behave as on the GPU, so what runs here is the GPU's command list
//! and kernel code, on other hardware: the same bugs of lowering and indexing show, the
//! same rounding mostly (host `expf` and friends may differ from CUDA's in the last bits;
//! no fused multiply-adds unless the host compiler makes them).
//!
//! Compiled libraries are kept under the system's temporary directory by a hash of their
//! source, so later test processes load them without compiling.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use salus_exec::{Device, ExecError, Location, Outcome, Placement, Program};
use salus_graph::{Graph, OpParams, ScratchSizer};

use crate::abi::{self, Kernel};
use crate::driver::host::{self, HostKernels, HostMemory};
use crate::lower::{self, Command, fusion};

/// Bytes of the error block, as a lane's on the GPU.
const ERROR_BLOCK: u64 = 256;

/// The CUDA device's command lists and kernels, run on the host.
#[derive(Debug)]
pub struct Emulator {
    capacity: u64,
    fusion: AtomicBool,
    tiled_attention: AtomicBool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The arena, then the error block.
    memory: HostMemory,
    kernels: Arc<HostKernels>,
    /// Libraries of generated kernels, by kernel name.
    generated: HashMap<String, Arc<HostKernels>>,
}

impl Emulator {
    /// An emulated GPU with an arena of `capacity` bytes. Compiles the kernels for the host
    /// on first use (tens of seconds), or loads them compiled before.
    pub fn new(capacity: u64) -> Result<Emulator, String> {
        let memory = HostMemory::new(capacity + ERROR_BLOCK)?;
        let entries: Vec<(&str, &str)> = Kernel::ALL
            .iter()
            .map(|k| (k.name(), k.args_struct()))
            .collect();
        let kernels = Arc::new(compile(&abi::kernel_source(), &entries)?);
        Ok(Emulator {
            capacity,
            fusion: AtomicBool::new(true),
            tiled_attention: AtomicBool::new(crate::lower::attention::tiled_by_default()),
            state: Mutex::new(State {
                memory,
                kernels,
                generated: HashMap::new(),
            }),
        })
    }

    /// Fuses pointwise regions (on by default), as [`crate::CudaDevice::set_fusion`].
    pub fn set_fusion(&self, on: bool) {
        self.fusion.store(on, Ordering::Relaxed);
    }

    /// Runs f32 attention's forward in register tiles, as
    /// [`crate::CudaDevice::set_tiled_attention`].
    pub fn set_tiled_attention(&self, on: bool) {
        self.tiled_attention.store(on, Ordering::Relaxed);
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>, ExecError> {
        self.state
            .lock()
            .map_err(|_| ExecError::Device("emulator lock poisoned".into()))
    }

    fn range(&self, offset: u64, len: u64) -> Result<(), ExecError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(ExecError::Device(format!(
                "bytes {offset}..+{len} lie outside the arena of {} bytes",
                self.capacity
            ))),
        }
    }
}

impl State {
    fn issue(&mut self, commands: &[Command]) -> Result<(), ExecError> {
        for command in commands {
            match command {
                Command::Launch(l) => {
                    self.kernels
                        .launch(l.kernel.name(), &*l.args, l.grid, l.block)
                        .map_err(ExecError::Device)?;
                }
                Command::Zero { ptr, bytes } => host::zero(*ptr, *bytes),
                Command::Gemm(g) => host::gemm(g),
                Command::Fused(f) => self
                    .generated(&f.name)?
                    .launch(&f.name, &*f.args, (f.grid, 1), f.block)
                    .map_err(ExecError::Device)?,
                Command::FusedBatch(f) => self
                    .generated(&f.name)?
                    .launch(&f.name, &*f.args, (f.grid, 1), f.block)
                    .map_err(ExecError::Device)?,
                Command::Dnn(_) => {
                    return Err(ExecError::Device(
                        "internal: a cuDNN call in the emulator, which has no cuDNN".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    fn generated(&self, name: &str) -> Result<Arc<HostKernels>, ExecError> {
        self.generated
            .get(name)
            .cloned()
            .ok_or_else(|| ExecError::Device(format!("internal: {name} is not compiled")))
    }

    /// Compiles the generated kernels not compiled yet, in one library.
    fn link(&mut self, kernels: &[(String, String)]) -> Result<(), ExecError> {
        let missing: Vec<&(String, String)> = kernels
            .iter()
            .filter(|(name, _)| !self.generated.contains_key(name))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let source = abi::fused_kernel_source(missing.iter().map(|(_, text)| text.as_str()));
        let entries: Vec<(&str, &str)> = missing
            .iter()
            .map(|(name, _)| {
                let args = if name.ends_with("_batch") {
                    "FusedBatchArgs"
                } else {
                    "FusedArgs"
                };
                (name.as_str(), args)
            })
            .collect();
        let library = Arc::new(compile(&source, &entries).map_err(ExecError::Device)?);
        for (name, _) in missing {
            self.generated.insert(name.clone(), library.clone());
        }
        Ok(())
    }
}

impl Device for Emulator {
    fn name(&self) -> String {
        "cuda-emulated (the CUDA kernels on the host)".into()
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ExecError> {
        self.range(offset, bytes.len() as u64)?;
        self.lock()?
            .memory
            .write(offset, bytes)
            .map_err(ExecError::Device)
    }

    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ExecError> {
        self.range(offset, len)?;
        self.lock()?
            .memory
            .read(offset, len)
            .map_err(ExecError::Device)
    }

    fn run(&self, program: &Program, at: Placement, feeds: &[&[u8]]) -> Result<Outcome, ExecError> {
        program.check_feeds(feeds)?;
        let plan = program.plan();
        self.range(at.persistent, plan.persistent_bytes)?;
        self.range(at.lane, plan.ephemeral_bytes)?;
        let start = Instant::now();
        let mut state = self.lock()?;
        let base = state.memory.base();
        let err = base + self.capacity;
        let addresses = (base + at.persistent, base + at.lane, err);
        let plan_of_regions = if self.fusion.load(Ordering::Relaxed) {
            fusion::plan(program)
        } else {
            fusion::FusionPlan::none()
        };
        let tiled = self.tiled_attention.load(Ordering::Relaxed);
        let list = lower::lower_program(program, addresses, None, &plan_of_regions, tiled)?;
        state.link(&list.kernels)?;
        let memory = &state.memory;
        memory
            .write(self.capacity, &[0; ERROR_BLOCK as usize])
            .map_err(ExecError::Device)?;
        for (&id, bytes) in program.feeds().iter().zip(feeds) {
            if let Some(Location::Lane(off)) = program.location(id) {
                memory
                    .write(at.lane + off, bytes)
                    .map_err(ExecError::Device)?;
            }
        }
        state.issue(&list.commands)?;
        let memory = &state.memory;
        let mut fetches = Vec::new();
        for &f in &program.graph().fetches {
            let offset = match program.location(f) {
                Some(Location::Lane(off)) => at.lane + off,
                Some(Location::Persistent(off)) => at.persistent + off,
                None => {
                    fetches.push(vec![0; program.bytes(f) as usize]);
                    continue;
                }
            };
            fetches.push(
                memory
                    .read(offset, program.bytes(f))
                    .map_err(ExecError::Device)?,
            );
        }
        state.issue(&list.updates)?;
        let block = state
            .memory
            .read(self.capacity, 40)
            .map_err(ExecError::Device)?;
        let mut words = [0u8; 40];
        words.copy_from_slice(&block);
        if let Some(e) = crate::reported_error(program, &words) {
            return Err(e);
        }
        Ok(Outcome {
            fetches,
            duration: start.elapsed().max(Duration::from_nanos(1)),
        })
    }

    fn scratch_sizer(&self) -> Option<&dyn ScratchSizer> {
        Some(self)
    }
}

/// Scratch as the CUDA device's own kernels need it (no cuDNN here).
impl ScratchSizer for Emulator {
    fn scratch_bytes(&self, graph: &Graph, node: usize, params: &OpParams) -> u64 {
        crate::kernel_scratch_bytes(graph, node, params)
    }

    fn extra_reads(&self, graph: &Graph, params: &[OpParams]) -> Vec<(usize, usize)> {
        crate::lower::folds::extra_reads(graph, params)
    }
}

/// Compiles `source` (a kernel program: prelude and kernels) for the host with the
/// runtime, and a launcher `emu_launch_NAME` for each (kernel, argument struct) of
/// `entries`; loads the library (compiled once per source, kept on disk).
fn compile(source: &str, entries: &[(&str, &str)]) -> Result<HostKernels, String> {
    let mut text = String::from(include_str!("runtime.h"));
    text.push_str(source);
    for (name, args) in entries {
        text.push_str(&format!(
            "\nextern \"C\" int emu_launch_{name}(const void* a, unsigned gx, unsigned gy, \
             unsigned bx) {{\n    return emu_launch([](const void* p) {{ {name}(*(const {args}*)p); }}, \
             a, gx, gy, bx);\n}}\n"
        ));
    }
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let hash = crate::image::fnv1a(&[text.as_bytes(), compiler.as_bytes()]);
    let dir = std::env::temp_dir().join("salus-emulator");
    let library = dir.join(format!("kernels-{hash:016x}.so"));
    if !library.exists() {
        build(&dir, &library, &text, &compiler)?;
    }
    HostKernels::load(&library)
}

/// Compiles `text` into `library` through a file of this process's own, renamed into place
/// when done (so concurrent test processes never load a half-written library).
fn build(dir: &Path, library: &Path, text: &str, compiler: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let unique = format!("{}-{:?}", std::process::id(), std::thread::current().id());
    let unique: String = unique.chars().filter(char::is_ascii_alphanumeric).collect();
    let source = dir.join(format!("build-{unique}.cpp"));
    let partial = dir.join(format!("build-{unique}.so"));
    std::fs::write(&source, text).map_err(|e| format!("{}: {e}", source.display()))?;
    let out = std::process::Command::new(compiler)
        .args(["-std=c++14", "-O2", "-shared", "-fPIC", "-w", "-o"])
        .arg(&partial)
        .arg(&source)
        .output()
        .map_err(|e| format!("running the C++ compiler {compiler:?}: {e}"))?;
    let _ = std::fs::remove_file(&source);
    if !out.status.success() {
        let _ = std::fs::remove_file(&partial);
        let log = String::from_utf8_lossy(&out.stderr);
        let head: String = log.lines().take(40).collect::<Vec<_>>().join("\n");
        return Err(format!("the kernels do not compile for the host:\n{head}"));
    }
    std::fs::rename(&partial, library).map_err(|e| format!("{}: {e}", library.display()))
}
