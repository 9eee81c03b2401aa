//! Green contexts: a part of the GPU's SMs that the kernels of a stream made in it are
//! confined to (drivers of CUDA 12.4 and newer; the bindings' floor is 12.8). A green
//! context is a view of the primary context with fewer SMs: the same memory, the same
//! loaded kernels, the same cuBLAS and cuDNN handles (set to its stream), so work moves
//! between the two by stream alone.

use std::ffi::c_uint;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{DResult, Raw};

/// A device resource as the driver writes it, with room to spare: newer drivers' resource
/// structs are larger than these bindings' (CUDA 13.1 appended a field), and the split
/// writes whole structs.
#[repr(C)]
struct Resource {
    resource: sys::CUdevResource,
    _spare: [u8; 256],
}

fn blank() -> Resource {
    // SAFETY: a plain C struct (integers, bytes and a union of them) for which all-zero
    // bytes are a valid value, as the driver's own headers initialise it.
    unsafe { std::mem::zeroed() }
}

fn sm_resource(dev: sys::CUdevice) -> DResult<Resource> {
    let mut all = blank();
    // SAFETY: writes one resource struct (with spare room after it) for a valid device.
    unsafe {
        sys::cuDeviceGetDevResource(
            dev,
            &mut all.resource,
            sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
        )
        .result()?
    };
    Ok(all)
}

fn sm_count(r: &Resource) -> u32 {
    // SAFETY: the resource was filled as an SM resource, so `sm` is the union's live field.
    unsafe { r.resource.__bindgen_anon_1.sm.smCount }
}

/// The GPU's SMs.
pub(crate) fn device_sms(dev: sys::CUdevice) -> DResult<u32> {
    sm_resource(dev).map(|r| sm_count(&r))
}

/// A green context over part of the GPU's SMs; destroyed when dropped, which must come
/// after every stream made in it.
#[derive(Debug)]
pub(crate) struct SmPartition {
    ctx: Raw<sys::CUgreenCtx>,
    /// The SMs it has (the driver rounds the asked count up to its granularity).
    pub(crate) sms: u32,
}

/// A green context of at least `min_sms` of the GPU's SMs (rounded up by the driver).
pub(crate) fn sm_partition(dev: sys::CUdevice, min_sms: u32) -> DResult<SmPartition> {
    let all = sm_resource(dev)?;
    let (mut part, mut rest) = (blank(), blank());
    let mut groups: c_uint = 1;
    // SAFETY: one result struct (with spare room) for the one group asked, the input the
    // driver filled above, a remainder struct; flags 0.
    unsafe {
        sys::cuDevSmResourceSplitByCount(
            &mut part.resource,
            &mut groups,
            &all.resource,
            &mut rest.resource,
            0,
            min_sms,
        )
        .result()?
    };
    if groups == 0 {
        return Err(cu::DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    }
    let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
    // SAFETY: one SM resource the split produced; the descriptor lives as long as the
    // primary context.
    unsafe { sys::cuDevResourceGenerateDesc(&mut desc, &mut part.resource, 1).result()? };
    let mut ctx: sys::CUgreenCtx = std::ptr::null_mut();
    let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32;
    // SAFETY: a descriptor just generated for this device; the context is destroyed by
    // the partition's Drop.
    unsafe { sys::cuGreenCtxCreate(&mut ctx, desc, dev, flags).result()? };
    Ok(SmPartition {
        ctx: Raw(ctx),
        sms: sm_count(&part),
    })
}

/// A non-blocking stream in `partition`, at `priority`; destroyed by `destroy_stream`
/// before the partition.
pub(crate) fn partition_stream(
    partition: &SmPartition,
    priority: i32,
) -> DResult<Raw<sys::CUstream>> {
    let mut stream = std::ptr::null_mut();
    let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: a live green context; writes one stream handle.
    unsafe { sys::cuGreenCtxStreamCreate(&mut stream, partition.ctx.0, flags, priority).result()? };
    Ok(Raw(stream))
}

impl Drop for SmPartition {
    fn drop(&mut self) {
        // SAFETY: destroyed once; its streams went before it (their owners hold the
        // partition until they are destroyed).
        let _ = unsafe { sys::cuGreenCtxDestroy(self.ctx.0) };
    }
}
