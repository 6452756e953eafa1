//! PyTorch's memory pools over the allocations of the hooks
//! (`gpuptr_torch_alloc`), for `gpuptr._torch_pool`.
//!
//! A pool under gpuptr is a tag, not memory of its own, kept by the core
//! with the allocations handed to PyTorch (see [`Runtime::begin_pool`](crate::Runtime::begin_pool)):
//! these entry points begin and end PyTorch's pools and read them.
//!
//! Sharing a PyTorch allocation with another process is `torch_share.rs`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{Client, PoolId, Runtime};

/// The runtime, if it opens: these calls sit in PyTorch's context managers
/// (some in `finally` blocks), so where it does not (no driver, a forked
/// child) they do nothing rather than raise over PyTorch's own outcome.
fn opened() -> Option<&'static std::sync::Arc<Runtime>> {
    Runtime::global().ok()
}

/// Allocations on ``device`` go to ``pool`` from now: this thread's
/// (``all_threads=False``, ``_cuda_beginAllocateCurrentThreadToPool``) or
/// every thread's (``_cuda_beginAllocateToPool``), until
/// ``_torch_pool_end``.
#[pyfunction]
#[pyo3(signature = (device, pool, all_threads=false))]
pub(crate) fn _torch_pool_begin(device: usize, pool: PoolId, all_threads: bool) {
    if let Some(rt) = opened() {
        rt.begin_pool(Client::Torch, device, pool, all_threads);
    }
}

/// Allocations on ``device`` no longer go to ``pool`` (the latest begin of
/// it on this thread, else for all threads). Whether one was under way.
#[pyfunction]
pub(crate) fn _torch_pool_end(device: usize, pool: PoolId) -> bool {
    opened().is_some_and(|rt| rt.end_pool(Client::Torch, device, pool))
}

/// The live allocations of ``pool`` on ``device``: ``(address, bytes)``
/// pairs, by address.
#[pyfunction]
pub(crate) fn _torch_pool_live(device: usize, pool: PoolId) -> Vec<(u64, usize)> {
    opened().map_or_else(Vec::new, |rt| rt.pool_live(device, pool))
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
    let c = opened().map_or_else(Default::default, |rt| {
        rt.pool_stats(Client::Torch, device, pool)
    });
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
