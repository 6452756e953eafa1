//! Fork detection. CUDA state does not survive `fork()`: a child that
//! touches its parent's contexts, or a lock another parent thread held at
//! the fork, crashes or hangs. So the first runtime registers an at-fork
//! hook, and in a child every entry point fails with [`Error::NoDriver`]
//! and every deleter does nothing (the child's copies of the parent's
//! allocations are not its to free).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};

static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn in_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// Register the at-fork hook (once per process).
pub(crate) fn watch() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: `in_child` is a plain `extern "C" fn` that only stores to
        // an atomic, which is async-signal-safe as the child handler must be.
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
}

/// Whether this process is a fork of one that used gpuptr.
#[inline]
pub fn forked() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// `Ok` unless this process is such a fork.
#[inline]
pub(crate) fn check() -> Result<()> {
    if forked() {
        return Err(Error::NoDriver(
            "CUDA cannot be used in a process forked from one that initialised it \
(its contexts and memory do not survive fork); start workers with the 'spawn' method"
                .into(),
        ));
    }
    Ok(())
}
