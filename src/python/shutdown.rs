//! Exit while daemon threads are inside gpuptr calls that run Python.
//!
//! CPython 3.11 to 3.13 ends a thread that takes the GIL back after
//! finalization began with `pthread_exit`: a forced unwind. Through Python's
//! own frames that is harmless, but an unwind that reaches Rust frames
//! aborts the process ("FATAL: exception not rethrown", rc -6). PyO3 makes
//! its own re-takes (`Python::attach`, the end of `py.detach`) hang the
//! thread instead, as Python 3.14 does. What it cannot guard is Python code
//! that gpuptr runs from Rust (a stream object's `__cuda_stream__`, a log
//! handler, a finalizer, an `__index__`): such code re-takes the GIL inside
//! the interpreter, and its unwind then crosses gpuptr's frames.
//!
//! So each such call is a [`Region`]. An `atexit` hook, which runs on the
//! exiting thread before finalization begins, closes them: no other thread
//! enters one from then on (the work is skipped, or, where the call cannot
//! go on without it, the thread hangs with the GIL released), and the hook
//! waits, without the GIL, for the threads inside one to leave it. When finalization then ends the daemon threads,
//! none is under a gpuptr frame in Python code; one in `py.detach` hangs
//! (PyO3's guard), one in Python's own frames exits as Python's threads do.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// Set by the exit hook: regions are closed to every other thread.
static CLOSED: AtomicBool = AtomicBool::new(false);
/// How many threads are inside a region now.
static INSIDE: AtomicUsize = AtomicUsize::new(0);
/// The thread that ran the exit hook (it finalizes; it may still enter).
static EXITING: OnceLock<ThreadId> = OnceLock::new();

/// How long the exit hook waits for a region to end: a callback that
/// blocks forever must not keep the process from exiting.
const WAIT: Duration = Duration::from_secs(2);

/// A call from gpuptr into Python code, on some thread (see the module
/// documentation). Held until the call returns.
#[must_use]
pub(crate) struct Region(());

impl Region {
    /// Enter a region, unless the exit hook closed them and this is not
    /// the exiting thread (`None`: skip the Python call).
    #[inline]
    pub(crate) fn enter() -> Option<Region> {
        INSIDE.fetch_add(1, Ordering::SeqCst);
        if CLOSED.load(Ordering::SeqCst) && !exiting_thread() {
            INSIDE.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Region(()))
    }

    /// [`Region::enter`] for a call that cannot go without its Python code
    /// (a stream object's handle, an address object's value): once the
    /// regions are closed, any thread but the exiting one hangs here, the
    /// GIL released, until the process exits (what Python 3.14 does to a
    /// thread that wants the GIL back during finalization). Only daemon
    /// threads run then: the others were joined before `atexit`.
    #[inline]
    pub(crate) fn enter_or_hang(py: Python<'_>) -> Region {
        match Region::enter() {
            Some(r) => r,
            None => hang(py),
        }
    }
}

#[cold]
fn hang(py: Python<'_>) -> ! {
    py.detach(|| loop {
        std::thread::park();
    })
}

impl Drop for Region {
    #[inline]
    fn drop(&mut self) {
        INSIDE.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cold]
fn exiting_thread() -> bool {
    EXITING.get() == Some(&std::thread::current().id())
}

/// The exit hook (registered with `atexit` when `_core` is imported): close
/// the regions to every other thread, then wait without the GIL, at most a
/// few seconds, for the threads inside one to leave it.
#[pyfunction]
fn close_regions(py: Python<'_>) {
    let _ = EXITING.set(std::thread::current().id());
    CLOSED.store(true, Ordering::SeqCst);
    if INSIDE.load(Ordering::SeqCst) == 0 {
        return;
    }
    py.detach(|| {
        let start = Instant::now();
        while INSIDE.load(Ordering::SeqCst) != 0 && start.elapsed() < WAIT {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Register [`close_regions`] with `atexit` (a function of no module's: it
/// is not part of gpuptr's surface).
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = pyo3::wrap_pyfunction!(close_regions, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}
