//! PyTorch's memory pools over the allocations of the hooks
//! (`gpuptr_torch_alloc`), for `gpuptr._torch_pool`.
//!
//! A pool under gpuptr is a tag, not memory of its own: while a thread has
//! begun allocating to a pool (`torch.cuda.use_mem_pool`, a CUDA graph tree's
//! pool manager, a `torch.cuda.graph(pool=…)` capture), the allocations the
//! hooks make for it on that device are noted under the pool's id, and
//! forgotten when PyTorch frees them. The memory itself comes from, and goes
//! back to, the one pool every library shares; the tags only answer what a
//! pool holds (its live allocations, bytes and counts).
//!
//! Sharing a PyTorch allocation with another process is `torch_share.rs`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A PyTorch memory pool's id (`MempoolId_t`: two unsigned integers).
type PoolId = (u64, u64);

/// Pools begun on some thread, or for all threads: zero means no allocation
/// is tagged (one load on the allocation path).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Live tagged allocations: zero means no free looks them up.
static TAGGED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The pools this thread allocates to, by device, latest last.
    static MINE: RefCell<Vec<(usize, PoolId)>> = const { RefCell::new(Vec::new()) };
}

/// What gpuptr knows of the pools.
#[derive(Default)]
struct Pools {
    /// Pools begun for every thread of a device, latest last.
    all_threads: Vec<(usize, PoolId)>,
    /// Live tagged allocations: address to (device, pool, bytes).
    live: HashMap<u64, (usize, PoolId, usize)>,
    /// Counts by (device, pool).
    counts: HashMap<(usize, PoolId), Counts>,
}

/// One pool's counts on one device.
#[derive(Default, Clone, Copy)]
struct Counts {
    live: u64,
    live_bytes: u64,
    peak_bytes: u64,
    allocations: u64,
    allocated_bytes: u64,
    frees: u64,
    freed_bytes: u64,
}

fn pools() -> &'static Mutex<Pools> {
    static POOLS: OnceLock<Mutex<Pools>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default)
}

/// The pool an allocation on `device` by this thread goes to now, if any.
fn current(device: usize) -> Option<PoolId> {
    let mine = MINE
        .try_with(|m| m.borrow().iter().rev().find(|p| p.0 == device).map(|p| p.1))
        .ok()
        .flatten();
    mine.or_else(|| {
        let p = crate::sync::lock(pools());
        p.all_threads
            .iter()
            .rev()
            .find(|p| p.0 == device)
            .map(|p| p.1)
    })
}

/// The hooks allocated `size` bytes at `address` on `device`: noted under
/// the pool this thread allocates to, if any.
#[inline]
pub(crate) fn note_alloc(address: u64, size: usize, device: usize) {
    if ACTIVE.load(Ordering::Acquire) == 0 || address == 0 {
        return;
    }
    note_alloc_slow(address, size, device);
}

#[cold]
fn note_alloc_slow(address: u64, size: usize, device: usize) {
    let Some(pool) = current(device) else {
        return;
    };
    let mut p = crate::sync::lock(pools());
    if p.live.insert(address, (device, pool, size)).is_none() {
        TAGGED.fetch_add(1, Ordering::AcqRel);
    }
    let c = p.counts.entry((device, pool)).or_default();
    c.live += 1;
    c.live_bytes += size as u64;
    c.peak_bytes = c.peak_bytes.max(c.live_bytes);
    c.allocations += 1;
    c.allocated_bytes += size as u64;
}

/// The hooks freed the allocation at `address`: its pool forgets it.
#[inline]
pub(crate) fn note_free(address: u64) {
    if TAGGED.load(Ordering::Acquire) == 0 {
        return;
    }
    note_free_slow(address);
}

#[cold]
fn note_free_slow(address: u64) {
    let mut p = crate::sync::lock(pools());
    let Some((device, pool, size)) = p.live.remove(&address) else {
        return;
    };
    TAGGED.fetch_sub(1, Ordering::AcqRel);
    if let Some(c) = p.counts.get_mut(&(device, pool)) {
        c.live = c.live.saturating_sub(1);
        c.live_bytes = c.live_bytes.saturating_sub(size as u64);
        c.frees += 1;
        c.freed_bytes += size as u64;
    }
}

/// Allocations on ``device`` go to ``pool`` from now: this thread's
/// (``all_threads=False``, ``_cuda_beginAllocateCurrentThreadToPool``) or
/// every thread's (``_cuda_beginAllocateToPool``), until
/// ``_torch_pool_end``.
#[pyfunction]
#[pyo3(signature = (device, pool, all_threads=false))]
pub(crate) fn _torch_pool_begin(device: usize, pool: PoolId, all_threads: bool) {
    if all_threads {
        crate::sync::lock(pools()).all_threads.push((device, pool));
    } else {
        let _ = MINE.try_with(|m| m.borrow_mut().push((device, pool)));
    }
    ACTIVE.fetch_add(1, Ordering::AcqRel);
}

/// Allocations on ``device`` no longer go to ``pool`` (the latest begin of
/// it on this thread, else for all threads). Whether one was under way.
#[pyfunction]
pub(crate) fn _torch_pool_end(device: usize, pool: PoolId) -> bool {
    let remove = |v: &mut Vec<(usize, PoolId)>| match v.iter().rposition(|p| *p == (device, pool)) {
        Some(i) => {
            v.remove(i);
            true
        }
        None => false,
    };
    let ended = MINE
        .try_with(|m| remove(&mut m.borrow_mut()))
        .unwrap_or(false)
        || remove(&mut crate::sync::lock(pools()).all_threads);
    if ended {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
    }
    ended
}

/// The live allocations of ``pool`` on ``device``: ``(address, bytes)``
/// pairs, by address.
#[pyfunction]
pub(crate) fn _torch_pool_live(device: usize, pool: PoolId) -> Vec<(u64, usize)> {
    let p = crate::sync::lock(pools());
    let mut v: Vec<(u64, usize)> = p
        .live
        .iter()
        .filter(|(_, (d, id, _))| *d == device && *id == pool)
        .map(|(a, (_, _, s))| (*a, *s))
        .collect();
    v.sort_unstable();
    v
}

/// The counts of ``pool`` on ``device`` (zeros for a pool that never
/// allocated): ``live``, ``live_bytes``, ``peak_bytes``, ``allocations``,
/// ``allocated_bytes``, ``frees``, ``freed_bytes``.
#[pyfunction]
pub(crate) fn _torch_pool_counts<'py>(
    py: Python<'py>,
    device: usize,
    pool: PoolId,
) -> PyResult<Bound<'py, PyDict>> {
    let c = crate::sync::lock(pools())
        .counts
        .get(&(device, pool))
        .copied()
        .unwrap_or_default();
    let d = PyDict::new(py);
    d.set_item("live", c.live)?;
    d.set_item("live_bytes", c.live_bytes)?;
    d.set_item("peak_bytes", c.peak_bytes)?;
    d.set_item("allocations", c.allocations)?;
    d.set_item("allocated_bytes", c.allocated_bytes)?;
    d.set_item("frees", c.frees)?;
    d.set_item("freed_bytes", c.freed_bytes)?;
    Ok(d)
}
