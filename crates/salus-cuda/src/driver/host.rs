//! The emulator's host side (`crate::emulator`): the memory that stands in for the GPU's
//! arena, the kernels compiled for the CPU and loaded as a shared library, and cuBLAS's
//! products computed on the CPU. Every address a lowered command holds is a host address
//! inside a [`HostMemory`].

use std::ffi::c_void;
use std::path::Path;

use crate::abi::LaunchArgs;
use crate::driver::{Gemm, GemmType};

/// Zeroed host memory at a fixed address, 256-byte aligned like a CUDA allocation.
#[derive(Debug)]
pub(crate) struct HostMemory {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the memory is owned by this value; the emulator serialises every access to it
// (reads, writes and the kernels it runs) with one lock.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    pub(crate) fn new(bytes: u64) -> Result<HostMemory, String> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(256) as usize, 256)
            .map_err(|e| e.to_string())?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("no host memory for {bytes} bytes"));
        }
        Ok(HostMemory { ptr, layout })
    }

    /// The address of byte 0.
    pub(crate) fn base(&self) -> u64 {
        self.ptr as u64
    }

    pub(crate) fn len(&self) -> u64 {
        self.layout.size() as u64
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(format!(
                "bytes {offset}..+{len} lie outside the {} bytes of host memory",
                self.len()
            )),
        }
    }

    pub(crate) fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.check(offset, bytes.len() as u64)?;
        // SAFETY: the range lies inside the allocation (checked) and the caller holds the
        // emulator's lock, so nothing else touches it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.ptr.add(offset as usize),
                bytes.len(),
            )
        };
        Ok(())
    }

    pub(crate) fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        self.check(offset, len)?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(out)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// Kernels compiled for the host (`emulator/runtime.h` and a launcher per kernel).
#[derive(Debug)]
pub(crate) struct HostKernels {
    library: libloading::Library,
}

type Launcher = unsafe extern "C" fn(*const c_void, u32, u32, u32) -> i32;

impl HostKernels {
    pub(crate) fn load(path: &Path) -> Result<HostKernels, String> {
        // SAFETY: the library is one the emulator compiled from the kernels' source and its
        // runtime; loading it runs no initialisers beyond the C++ runtime's own.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("loading {}: {e}", path.display()))?;
        Ok(HostKernels { library })
    }

    /// Runs kernel `name` over `grid` blocks of `block` threads with `args`, the struct the
    /// kernel takes (the lowering pairs them, as for the GPU).
    pub(crate) fn launch(
        &self,
        name: &str,
        args: &dyn LaunchArgs,
        grid: (u32, u32),
        block: u32,
    ) -> Result<(), String> {
        let symbol = format!("emu_launch_{name}");
        // SAFETY: every `emu_launch_*` the emulator generates has the `Launcher` signature.
        let launch = unsafe { self.library.get::<Launcher>(symbol.as_bytes()) }
            .map_err(|e| format!("{name}: no such host kernel ({e})"))?;
        let param = args as *const dyn LaunchArgs as *const c_void;
        // The runtime's fiber state is global in each library, and every emulator of the
        // process loads the same libraries: one launch at a time.
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: `param` points at the `#[repr(C)]` struct the kernel takes (as
        // `driver::launch` hands it to the GPU), and every address inside it lies in the
        // emulator's host memory, which its lock keeps to this call.
        let code = unsafe { launch(param, grid.0, grid.1, block) };
        match code {
            0 => Ok(()),
            1 => Err(format!(
                "{name}: a thread waited in a block the emulator ran as plain calls (its first block never waited)"
            )),
            2 => Err(format!(
                "{name}: a block deadlocked (a barrier some live thread never reached)"
            )),
            _ => Err(format!(
                "{name}: {block} threads per block are more than the emulator runs"
            )),
        }
    }
}

/// Zeroes `bytes` at host address `ptr` (a lowered `Zero`).
pub(crate) fn zero(ptr: u64, bytes: u64) {
    // SAFETY: the lowering only zeroes ranges of the memory it lowered into, which the
    // emulator allocated and holds locked.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes as usize) }
}

fn load(ty: GemmType, base: u64, index: i64) -> f64 {
    // SAFETY: the product's operands lie in the emulator's host memory (the lowering
    // checked their extents against the planned tensors).
    unsafe {
        match ty {
            GemmType::F32 => f64::from(std::ptr::read_unaligned(
                (base as *const f32).offset(index as isize),
            )),
            GemmType::F16 | GemmType::Bf16 => {
                let bits = std::ptr::read_unaligned((base as *const u16).offset(index as isize));
                f64::from(if ty == GemmType::F16 {
                    half_to_f32(bits)
                } else {
                    f32::from_bits(u32::from(bits) << 16)
                })
            }
        }
    }
}

fn store(ty: GemmType, base: u64, index: i64, v: f64) {
    let v = v as f32;
    // SAFETY: as in `load`.
    unsafe {
        match ty {
            GemmType::F32 => {
                std::ptr::write_unaligned((base as *mut f32).offset(index as isize), v)
            }
            GemmType::F16 => {
                std::ptr::write_unaligned((base as *mut u16).offset(index as isize), f32_to_half(v))
            }
            GemmType::Bf16 => {
                std::ptr::write_unaligned((base as *mut u16).offset(index as isize), f32_to_bf16(v))
            }
        }
    }
}

/// A cuBLAS strided-batched product (column-major, as `driver::gemm` calls it), summed in
/// f64 and stored in the operands' type. With `beta` 0, C is not read (as in cuBLAS).
pub(crate) fn gemm(g: &Gemm) {
    let a = |b: i64, r: i64, p: i64| {
        let i = if g.trans_a {
            p + r * i64::from(g.lda)
        } else {
            r + p * i64::from(g.lda)
        };
        load(g.ty, g.a, b * g.stride_a + i)
    };
    let bm = |b: i64, p: i64, j: i64| {
        let i = if g.trans_b {
            j + p * i64::from(g.ldb)
        } else {
            p + j * i64::from(g.ldb)
        };
        load(g.ty, g.b, b * g.stride_b + i)
    };
    for b in 0..i64::from(g.batch) {
        for j in 0..i64::from(g.n) {
            for r in 0..i64::from(g.m) {
                let sum: f64 = (0..i64::from(g.k)).map(|p| a(b, r, p) * bm(b, p, j)).sum();
                let at = b * g.stride_c + r + j * i64::from(g.ldc);
                let mut v = f64::from(g.alpha) * sum;
                if g.beta != 0.0 {
                    v += f64::from(g.beta) * load(g.ty, g.c, at);
                }
                store(g.ty, g.c, at, v);
            }
        }
    }
}

fn half_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = i32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (31, 0) => sign | 0x7f80_0000,
        (31, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | (((e - 15 + 127) as u32) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 to IEEE half, rounding to nearest even (through f64's exact arithmetic).
fn f32_to_half(v: f32) -> u16 {
    if v.is_nan() {
        return 0x7e00;
    }
    let sign = if v.is_sign_negative() { 0x8000 } else { 0 };
    let a = f64::from(v.abs());
    if a >= 65520.0 {
        return sign | 0x7c00;
    }
    // The spacing of halves at `a`: 2^-24 below 2^-14, else 2^(e-10).
    let e = if a < f64::powi(2.0, -14) {
        -14
    } else {
        a.log2().floor() as i32
    };
    let step = f64::powi(2.0, e - 10);
    let q = (a / step).round_ties_even() * step;
    if q == 0.0 {
        return sign;
    }
    let qe = q.log2().floor() as i32;
    if qe < -14 {
        return sign | (q / f64::powi(2.0, -24)) as u16;
    }
    let man = ((q / f64::powi(2.0, qe) - 1.0) * 1024.0) as u16;
    sign | (((qe + 15) as u16) << 10) | man
}

fn f32_to_bf16(v: f32) -> u16 {
    if v.is_nan() {
        return 0x7fc0;
    }
    let bits = v.to_bits();
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_round_trip_and_round_to_nearest_even() {
        for bits in [
            0u16, 1, 0x3ff, 0x400, 0x3c00, 0x7bff, 0xbc00, 0x7c00, 0xfc00, 0x8001,
        ] {
            assert_eq!(f32_to_half(half_to_f32(bits)), bits, "{bits:#x}");
        }
        // 1 + 2^-11 lies halfway between 1 and the next half: ties go to even (1).
        assert_eq!(f32_to_half(1.0 + f32::powi(2.0, -11)), 0x3c00);
        assert_eq!(f32_to_half(1.0 + 3.0 * f32::powi(2.0, -11)), 0x3c02);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
    }
}
