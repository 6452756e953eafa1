//! Locks that outlive a panic. A deleter or a helper thread that panicked
//! while holding a lock must not take every later allocation down with it:
//! the state each lock guards is kept consistent at every unlock point, so
//! gpuptr takes a poisoned lock as it is. Every lock in the crate goes
//! through these helpers.

use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// Which of `n` lock shards the block at `address` goes to, so that
/// threads freeing different blocks rarely share a lock. Blocks are at
/// least 512-byte aligned: the bits above that are mixed.
#[inline]
pub(crate) fn shard_of(address: u64, n: usize) -> usize {
    ((address >> 9) ^ (address >> 17)) as usize % n
}

/// Lock `m`, ignoring poison.
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Read-lock `l`, ignoring poison.
#[inline]
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

/// Write-lock `l`, ignoring poison.
#[inline]
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}

/// Wait on `c` with `g`, ignoring poison.
#[inline]
pub(crate) fn wait<'a, T>(c: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    c.wait(g).unwrap_or_else(|p| p.into_inner())
}

/// Wait on `c` with `g` for at most `d`, ignoring poison.
#[inline]
pub(crate) fn wait_timeout<'a, T>(
    c: &Condvar,
    g: MutexGuard<'a, T>,
    d: Duration,
) -> MutexGuard<'a, T> {
    c.wait_timeout(g, d)
        .map_or_else(|p| p.into_inner().0, |r| r.0)
}

/// Wait on `c` while `cond` holds, for at most `d`, ignoring poison;
/// whether `cond` stopped holding (not timed out).
#[inline]
pub(crate) fn wait_while<T>(
    c: &Condvar,
    g: MutexGuard<'_, T>,
    d: Duration,
    cond: impl FnMut(&mut T) -> bool,
) -> bool {
    let (_g, r) = c
        .wait_timeout_while(g, d, cond)
        .unwrap_or_else(|p| p.into_inner());
    !r.timed_out()
}

/// What runs a wait for the GPU or for another thread's work
/// ([`blocking`]): set once by an embedding that must let its own threads
/// go on meanwhile (the Python binding lets the GIL go).
pub(crate) type Blocking = fn(&mut dyn FnMut());

static BLOCKING: std::sync::OnceLock<Blocking> = std::sync::OnceLock::new();

/// Set what runs [`blocking`] waits (once; later calls are ignored).
#[cfg_attr(not(feature = "python"), allow(dead_code))]
pub(crate) fn set_blocking(f: Blocking) {
    let _ = BLOCKING.set(f);
}

/// Run `f`, a wait that may last (a fence, a driver call that waits for
/// the GPU, another thread's growth), as the embedding asks: the Python
/// binding lets the GIL go around it, so that a Python thread whose work
/// ends the wait (a stream callback, a thread that feeds the GPU) runs.
/// A hit comes here only for a large request's wait for a better fit.
pub(crate) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match BLOCKING.get() {
        None => f(),
        Some(run) => {
            let mut f = Some(f);
            let mut out = None;
            run(&mut || out = f.take().map(|f| f()));
            match out {
                Some(r) => r,
                // `run` must call its argument once; if it did not, run it
                // here.
                None => (f.take().expect("not run yet"))(),
            }
        }
    }
}
