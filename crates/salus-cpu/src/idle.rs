//! The OS's idle scheduling class, for the threads of background iterations: Linux runs
//! a `SCHED_IDLE` thread only on a core no other thread wants, and preempts it as soon as
//! one does. The one call that needs `unsafe` (the system call) is here.

#![allow(unsafe_code)]

use std::io;
use std::sync::OnceLock;

/// Moves the calling thread into the idle scheduling class.
#[cfg(target_os = "linux")]
pub(crate) fn lower_this_thread() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 names the calling thread, and `param` is a valid `sched_param` that
    // outlives the call, which only reads it.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Moves the calling thread into the idle scheduling class: not on this OS.
#[cfg(not(target_os = "linux"))]
pub(crate) fn lower_this_thread() -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no idle scheduling class on this OS",
    ))
}

/// Whether threads of this process can enter the idle class (tried once per process, on
/// a thread made for the purpose, so that the caller's own stays as it is).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::thread::spawn(lower_this_thread)
            .join()
            .is_ok_and(|r| r.is_ok())
    })
}
