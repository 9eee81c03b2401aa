//! The OS's idle scheduling class, for the threads of background iterations: Linux runs
//! a `SCHED_IDLE` thread only on a core no other thread wants, and preempts it as soon as
//! one does. The calls that need `unsafe` (the system calls) are here.

#![allow(unsafe_code)]

use std::io;
use std::sync::OnceLock;

/// A thread, by the id the OS gives it (0: the calling thread).
pub(crate) type ThreadId = i32;

/// Moves the calling thread into the idle scheduling class.
pub(crate) fn lower_this_thread() -> io::Result<()> {
    set_class(0, true)
}

/// The calling thread's id, for [`raise`] and [`lower`] from other threads.
#[cfg(target_os = "linux")]
pub(crate) fn this_thread() -> ThreadId {
    // SAFETY: gettid takes nothing and cannot fail.
    unsafe { libc::gettid() }
}

/// The calling thread's id: none on this OS.
#[cfg(not(target_os = "linux"))]
pub(crate) fn this_thread() -> ThreadId {
    0
}

/// Lifts `threads` out of the idle class into the ordinary one. Linux allows it only
/// with `CAP_SYS_NICE` or an `RLIMIT_NICE` of 20 or more (it treats the idle class as nice
/// 20): the error says so otherwise.
pub(crate) fn raise(threads: &[ThreadId]) -> io::Result<()> {
    threads.iter().try_for_each(|&t| set_class(t, false))
}

/// Puts `threads` back into the idle class.
pub(crate) fn lower(threads: &[ThreadId]) -> io::Result<()> {
    threads.iter().try_for_each(|&t| set_class(t, true))
}

#[cfg(target_os = "linux")]
fn set_class(thread: ThreadId, idle: bool) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: `thread` is a thread id of this process (0: the calling thread), and
    // `param` is a valid `sched_param` that outlives the call, which only reads it.
    let rc = unsafe { libc::sched_setscheduler(thread, policy, &param) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_class(_thread: ThreadId, _idle: bool) -> io::Result<()> {
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

/// Says once per process that abandoned background iterations stay in the idle class.
pub(crate) fn warn_once(e: &io::Error) {
    static WARNED: OnceLock<()> = OnceLock::new();
    WARNED.get_or_init(|| {
        eprintln!(
            "salus-cpu: an abandoned background iteration stays in the idle class until its \
             kernel ends ({e}); give salusd CAP_SYS_NICE or an RLIMIT_NICE of 20 to hurry it"
        )
    });
}
