//! Compiled kernel images: NVRTC's machine code for the kernels' source (and generated
//! fused kernels), cached on disk by source, NVRTC version and architecture so a device
//! starts without recompiling.

use std::path::PathBuf;

use crate::{abi, driver};

/// The kernels' machine code for `arch`: from the disk cache, or compiled and cached.
pub(crate) fn kernel_image(arch: u32) -> Result<Vec<u8>, String> {
    cached_image(&abi::kernel_source(), arch)
}

/// Says why fusion was given up for a program (its kernels did not build).
pub(crate) fn tracing_note(message: &str) {
    eprintln!("salus-cuda: running unfused: {message}");
}

/// The machine code of `source` for `arch`: from the disk cache, or compiled and cached.
pub(crate) fn cached_image(source: &str, arch: u32) -> Result<Vec<u8>, String> {
    let (major, minor) = driver::nvrtc_version();
    let key = fnv1a(&[
        source.as_bytes(),
        format!("nvrtc {major}.{minor} sm_{arch}").as_bytes(),
    ]);
    let dir = cache_dir();
    let path = dir
        .as_ref()
        .map(|d| d.join(format!("sm{arch}-{key:016x}.bin")));
    if let Some(path) = &path
        && let Ok(image) = std::fs::read(path)
        && !image.is_empty()
    {
        return Ok(image);
    }
    let (image, _cubin) = driver::nvrtc_compile(source, arch)?;
    if let (Some(dir), Some(path)) = (dir, path)
        && std::fs::create_dir_all(&dir).is_ok()
    {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &image).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(image)
}

/// `$SALUS_NVRTC_CACHE`, `$XDG_CACHE_HOME/salus/nvrtc` or `~/.cache/salus/nvrtc`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("SALUS_NVRTC_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("salus/nvrtc")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/salus/nvrtc")))
}

pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
