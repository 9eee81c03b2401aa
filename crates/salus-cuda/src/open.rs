//! Finding GPUs and opening one: the driver's checks, the primary context, the arena,
//! the kernels, cuDNN and the stream priorities.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use cudarc::driver::CudaContext;
use cudarc::driver::sys;

use crate::abi::Kernel;
use crate::driver::{self, driver_error};
use crate::image::kernel_image;
use crate::{CudaDevice, DEFAULT_RESERVE, MIN_DRIVER, cudnn, no_panic};

/// One GPU the driver sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its index (`cuda:N`).
    pub ordinal: usize,
    /// The driver's name for it.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total memory in bytes.
    pub total_bytes: u64,
    /// Where it sits on the PCI bus (`domain:bus:device.function`, hexadecimal): how NVML
    /// finds the same GPU.
    pub pci_bus_id: String,
}

/// How to open a [`CudaDevice`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Which GPU.
    pub ordinal: usize,
    /// Bytes of free memory left out of the arena.
    pub reserve: u64,
    /// At most this many bytes of arena.
    pub cap: Option<u64>,
    /// Capture iterations into CUDA graphs and replay them.
    pub graphs: bool,
}

impl CudaOptions {
    /// GPU `ordinal`, the default reserve, no cap, graphs on.
    pub fn new(ordinal: usize) -> CudaOptions {
        CudaOptions {
            ordinal,
            reserve: DEFAULT_RESERVE,
            cap: None,
            graphs: true,
        }
    }
}

impl CudaDevice {
    /// The GPUs this host can use, or why none: safe to call anywhere (no driver, no GPU,
    /// a driver too old, a missing NVRTC or cuBLAS all give an `Err`, never a panic).
    pub fn probe() -> Result<Vec<GpuInfo>, String> {
        no_panic(|| {
            driver::libraries()?;
            let version =
                driver::driver_version().map_err(|e| driver_error("cuDriverGetVersion", e))?;
            if version < MIN_DRIVER {
                return Err(format!(
                    "the CUDA driver supports CUDA {}.{}; salus needs {}.{} or newer",
                    version / 1000,
                    version % 1000 / 10,
                    MIN_DRIVER / 1000,
                    MIN_DRIVER % 1000 / 10
                ));
            }
            use cudarc::driver::result as cu;
            cu::init().map_err(|e| driver_error("cuInit", e))?;
            let count = cu::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
            if count == 0 {
                return Err("the CUDA driver sees no GPU".into());
            }
            (0..count)
                .map(|i| {
                    let dev = cu::device::get(i).map_err(|e| driver_error("cuDeviceGet", e))?;
                    let name = cu::device::get_name(dev)
                        .map_err(|e| driver_error("cuDeviceGetName", e))?;
                    let attr = |a| driver::device_attr(dev, a);
                    let major = attr(
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    )?;
                    let minor = attr(
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    )?;
                    let total = driver::device_total(dev)?;
                    let pci_bus_id = format!(
                        "{:08x}:{:02x}:{:02x}.0",
                        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
                    );
                    Ok(GpuInfo {
                        ordinal: i as usize,
                        name,
                        compute_capability: (major, minor),
                        total_bytes: total,
                        pci_bus_id,
                    })
                })
                .collect()
        })
    }

    /// Opens GPU `options.ordinal`: its primary context, the arena (free memory minus the
    /// reserve, at most the cap) and the kernels.
    pub fn new(options: &CudaOptions) -> Result<CudaDevice, String> {
        let gpus = Self::probe()?;
        let gpu = gpus
            .iter()
            .find(|g| g.ordinal == options.ordinal)
            .ok_or_else(|| {
                format!(
                    "no GPU cuda:{} (this host has {}: {})",
                    options.ordinal,
                    gpus.len(),
                    gpus.iter()
                        .map(|g| g.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?
            .clone();
        no_panic(|| Self::open(options, gpu))
    }

    fn open(options: &CudaOptions, gpu: GpuInfo) -> Result<CudaDevice, String> {
        let ctx = CudaContext::new(options.ordinal)
            .map_err(|e| driver_error("creating the context", e))?;
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))?;
        let (major, minor) = gpu.compute_capability;
        let arch = (major * 10 + minor) as u32;
        let image = kernel_image(arch)?;
        let module =
            driver::load_module(&image).map_err(|e| driver_error("loading the kernels", e))?;
        let functions = Kernel::ALL
            .iter()
            .map(|k| driver::function(module, k.name()).map_err(|e| driver_error(k.name(), e)))
            .collect::<Result<Vec<_>, _>>()?;
        let transfer = driver::new_stream().map_err(|e| driver_error("creating a stream", e))?;
        let (free, _total) = driver::mem_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        let mut capacity = (free as u64).saturating_sub(options.reserve);
        if let Some(cap) = options.cap {
            capacity = capacity.min(cap);
        }
        capacity -= capacity % salus_graph::plan::ALIGNMENT;
        if capacity == 0 {
            return Err(format!(
                "cuda:{}: {} bytes free, reserve {}: nothing left for the arena",
                options.ordinal, free, options.reserve
            ));
        }
        let base = driver::malloc(capacity as usize)
            .map_err(|e| driver_error(&format!("allocating the {capacity}-byte arena"), e))?;
        let priorities = driver::stream_priorities()
            .map_err(|e| driver_error("cuCtxGetStreamPriorityRange", e))?;
        let priorities = (priorities.0 != priorities.1).then_some(priorities);
        let dnn = no_panic(cudnn::Dnn::open);
        let convolutions = match &dnn {
            Ok(dnn) => {
                tracing::info!(gpu = options.ordinal, "convolutions use {}", dnn.version);
                dnn.version
                    .split(" from ")
                    .next()
                    .unwrap_or("cuDNN")
                    .to_string()
            }
            Err(why) => {
                tracing::warn!(
                    gpu = options.ordinal,
                    "no cuDNN ({why}); convolutions use salus' own kernels"
                );
                "no cuDNN".to_string()
            }
        };
        let ctx_device = ctx.cu_device();
        Ok(CudaDevice {
            ctx,
            name: format!("cuda:{} ({}, {convolutions})", options.ordinal, gpu.name),
            base,
            capacity,
            functions,
            lanes: Mutex::new(HashMap::new()),
            transfer: Mutex::new(transfer),
            graphs: AtomicBool::new(options.graphs),
            poisoned: Mutex::new(None),
            arch,
            fusion: AtomicBool::new(std::env::var("SALUS_CUDA_FUSION").as_deref() != Ok("0")),
            tiled_attention: AtomicBool::new(crate::lower::attention::tiled_by_default()),
            fused: Mutex::new(HashMap::new()),
            dnn,
            priorities,
            pci_bus_id: gpu.pci_bus_id,
            partitions: crate::pieces::Partitions::open(ctx_device),
        })
    }
}
