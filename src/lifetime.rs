//! The lifetime of a piece of memory, shared by device memory
//! ([`DevicePointer`](crate::DevicePointer)) and host memory
//! ([`HostMemory`](crate::HostMemory)): what it keeps alive, whether it may
//! be used, and who runs its one release.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};

/// Anything a pointer must keep alive until its memory is released (a
/// foreign owner, a finalizer object). Dropped when the pointer is freed.
pub type KeepAlive = Box<dyn Any + Send + Sync>;

/// Drop whatever `slot` keeps alive (outside the lock: a finalizer may run).
pub(crate) fn release_keepalive(slot: &Mutex<Option<KeepAlive>>) {
    let keep = crate::sync::lock(slot).take();
    drop(keep);
}

/// `Ok` for usable memory; else why `what` at `address` is not: freed, or
/// made in a context that was reset since (`stale`).
pub(crate) fn check_live(what: &str, address: u64, freed: bool, stale: bool) -> Result<()> {
    crate::fork::check()?;
    if freed {
        Err(Error::InvalidPointer(format!(
            "{what} at {address:#x} was freed"
        )))
    } else if stale {
        Err(Error::InvalidPointer(format!(
            "{what} at {address:#x} belongs to a context that was reset"
        )))
    } else {
        Ok(())
    }
}

/// The lifetime of a piece of memory, in one atomic word: whether a free
/// was asked for, whether the release was claimed, and how many operations
/// and buffer exports use it now. A free waits for neither: it refuses while
/// exports are alive (a `BufferError`, as `mmap.close()` does), and it
/// leaves the release to the last operation in flight when there is one. So
/// no copy that passed its liveness check ever writes into memory that was
/// released, or reused, under it.
#[derive(Debug, Default)]
pub(crate) struct Lifetime(AtomicU64);

const FREED: u64 = 1 << 63;
const RELEASED: u64 = 1 << 62;
const EXPORT: u64 = 1 << 32;
const EXPORTS: u64 = ((1 << 30) - 1) << 32;
const OPS: u64 = (1 << 32) - 1;

impl Lifetime {
    #[inline]
    pub(crate) fn is_freed(&self) -> bool {
        self.0.load(Ordering::Acquire) & FREED != 0
    }

    /// Ask for a free. `release` runs now, or is left to the last operation
    /// in flight (`Ok(true)` either way); `Ok(false)` if already freed, and
    /// `Err` while buffer exports are alive or if `release` failed (the
    /// memory then stays live, for a later retry).
    pub(crate) fn free(&self, what: &str, release: impl FnOnce() -> Result<()>) -> Result<bool> {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            if s & FREED != 0 {
                return Ok(false);
            }
            if s & EXPORTS != 0 {
                return Err(Error::BufferExported(format!(
                    "{what} cannot be freed while {} buffer export(s) of it are alive \
(release the numpy arrays or memoryviews first)",
                    (s & EXPORTS) >> 32
                )));
            }
            match self
                .0
                .compare_exchange_weak(s, s | FREED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if s & OPS == 0 && self.claim() => return self.run(release).map(|()| true),
                Ok(_) if s & OPS == 0 => return Ok(false),
                Ok(_) => return Ok(true),
                Err(now) => s = now,
            }
        }
    }

    /// Claim the release; `true` for exactly one caller.
    fn claim(&self) -> bool {
        self.0.fetch_or(RELEASED, Ordering::AcqRel) & RELEASED == 0
    }

    /// Run a claimed release; if it fails, the memory is live again (a
    /// later free or the deleter retries).
    fn run(&self, release: impl FnOnce() -> Result<()>) -> Result<()> {
        release().inspect_err(|_| {
            self.0.fetch_and(!(FREED | RELEASED), Ordering::AcqRel);
        })
    }

    /// Start a use (`unit` is one op, [`Lifetime::OP`], or one export,
    /// [`Lifetime::EXPORT`]). `false` if freed; a free that saw this
    /// transient use left the release to it, so `release` may run here.
    #[inline]
    pub(crate) fn begin(&self, unit: u64, release: impl FnOnce() -> Result<()>) -> bool {
        let prev = self.0.fetch_add(unit, Ordering::Acquire);
        if prev & FREED != 0 {
            self.end(unit, release);
            return false;
        }
        true
    }

    /// One operation.
    pub(crate) const OP: u64 = 1;
    /// One buffer export.
    pub(crate) const EXPORT: u64 = EXPORT;

    /// End a use; the last use after a deferred free runs `release` (a
    /// deleter has no one to report a failure to).
    #[inline]
    pub(crate) fn end(&self, unit: u64, release: impl FnOnce() -> Result<()>) {
        let prev = self.0.fetch_sub(unit, Ordering::AcqRel);
        let after = prev - unit;
        if after & FREED != 0 && after & (OPS | EXPORTS) == 0 && self.claim() {
            let _ = self.run(release);
        }
    }

    /// Whether the release is still owed (for a deleter).
    pub(crate) fn owed(&mut self) -> bool {
        *self.0.get_mut() & RELEASED == 0
    }
}
