//! PyTorch's own statistics of the memory it gets through gpuptr's
//! allocator hooks, which `torch.cuda.memory_stats()` (and so
//! `memory_allocated`, `max_memory_allocated`, `memory_summary`, ...)
//! reads under `gpuptr.torch.install()` (`gpuptr/_torch_stats.py` maps
//! them, with the pool's segments, onto PyTorch's keys).
//!
//! PyTorch's peaks are exact, so these are counted in one place per
//! process, not per pool shard (a sum of shards' peaks overstates the peak
//! of a training step whose backward runs on autograd's thread): one
//! uncontended lock around a few additions per allocation and per free,
//! in the hooks, which take a lock for their live map anyway.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{ByPool, SegmentStats, Stat};

/// One device's counts for PyTorch.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct TorchCounts {
    /// Live allocations (PyTorch's `allocation` and `active`).
    allocation: ByPool,
    /// Their blocks' bytes (`allocated_bytes` and `active_bytes`).
    allocated_bytes: ByPool,
    /// The bytes PyTorch asked for (`requested_bytes`).
    requested_bytes: ByPool,
    /// Out-of-memory errors thrown to PyTorch (`num_ooms`).
    num_ooms: u64,
    /// The pool's segment totals and retries at the last
    /// `reset_accumulated_memory_stats()`, which PyTorch's totals start
    /// from.
    segments_base: SegmentStats,
    retries_base: u64,
}

static COUNTS: Mutex<Vec<TorchCounts>> = Mutex::new(Vec::new());

fn with_device<R>(device: usize, f: impl FnOnce(&mut TorchCounts) -> R) -> R {
    let mut all = crate::sync::lock(&COUNTS);
    if all.len() <= device {
        all.resize(device + 1, TorchCounts::default());
    }
    f(&mut all[device])
}

/// A block of `block` bytes handed to PyTorch for `requested` bytes.
#[inline]
pub(super) fn allocated(device: usize, requested: usize, block: usize) {
    with_device(device, |c| {
        c.allocation.add(block, 1);
        c.allocated_bytes.add(block, block as u64);
        c.requested_bytes.add(block, requested as u64);
    });
}

/// PyTorch freed a block [`allocated`] counted.
#[inline]
pub(super) fn freed(device: usize, requested: usize, block: usize) {
    with_device(device, |c| {
        c.allocation.sub(block, 1);
        c.allocated_bytes.sub(block, block as u64);
        c.requested_bytes.sub(block, requested as u64);
    });
}

/// An out of memory thrown to PyTorch on `device`.
pub(super) fn out_of_memory(device: usize) {
    with_device(device, |c| c.num_ooms += 1);
}

/// A ``device`` argument naming a device that exists.
fn checked_device(device: &Bound<'_, PyAny>) -> PyResult<usize> {
    let device = super::args::device_arg(device)?;
    super::args::runtime()?.check_device(device)?;
    Ok(device)
}

fn stat_dict<'py>(py: Python<'py>, s: &Stat) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("current", s.current)?;
    d.set_item("peak", s.peak)?;
    d.set_item("allocated", s.allocated)?;
    d.set_item("freed", s.freed)?;
    Ok(d)
}

/// `{"all": ..., "small_pool": ..., "large_pool": ...}`, each a
/// `{"current", "peak", "allocated", "freed"}` dict: PyTorch's layout.
pub(super) fn by_pool_dict<'py>(py: Python<'py>, b: &ByPool) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("all", stat_dict(py, &b.all)?)?;
    d.set_item("small_pool", stat_dict(py, &b.small)?)?;
    d.set_item("large_pool", stat_dict(py, &b.large)?)?;
    Ok(d)
}

/// `{"count": by pool, "bytes": by pool}` (see [`by_pool_dict`]).
pub(super) fn segments_dict<'py>(
    py: Python<'py>,
    s: &SegmentStats,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", by_pool_dict(py, &s.count)?)?;
    d.set_item("bytes", by_pool_dict(py, &s.bytes)?)?;
    Ok(d)
}

/// PyTorch's own counts on ``device``: ``allocation``,
/// ``allocated_bytes`` and ``requested_bytes`` (each by pool:
/// ``all``/``small_pool``/``large_pool`` of
/// ``current``/``peak``/``allocated``/``freed``), ``num_ooms``, and the
/// pool's ``segments_base`` and ``retries_base`` at the last
/// ``_torch_reset_accumulated``; and the pool's own ``segments`` and
/// ``num_alloc_retries`` on ``device`` now (as ``stats()`` has them). A
/// device PyTorch never used has zeros.
#[pyfunction]
pub(crate) fn _torch_counts<'py>(
    py: Python<'py>,
    device: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let device = checked_device(device)?;
    let pool = super::args::runtime()?.device_stats(device)?;
    let c = with_device(device, |c| *c);
    let d = PyDict::new(py);
    d.set_item("allocation", by_pool_dict(py, &c.allocation)?)?;
    d.set_item("allocated_bytes", by_pool_dict(py, &c.allocated_bytes)?)?;
    d.set_item("requested_bytes", by_pool_dict(py, &c.requested_bytes)?)?;
    d.set_item("num_ooms", c.num_ooms)?;
    d.set_item("segments_base", segments_dict(py, &c.segments_base)?)?;
    d.set_item("retries_base", c.retries_base)?;
    d.set_item("segments", segments_dict(py, &pool.segments)?)?;
    d.set_item("num_alloc_retries", pool.num_alloc_retries)?;
    Ok(d)
}

/// PyTorch's ``reset_peak_memory_stats(device)``: its peaks on ``device``
/// become the values now, and so do the pool's there (one pool: its
/// reserved peak is PyTorch's).
#[pyfunction]
pub(crate) fn _torch_reset_peak(device: &Bound<'_, PyAny>) -> PyResult<()> {
    let device = checked_device(device)?;
    super::args::runtime()?.reset_device_peak_stats(device)?;
    with_device(device, |c| {
        c.allocation.reset_peak();
        c.allocated_bytes.reset_peak();
        c.requested_bytes.reset_peak();
    });
    Ok(())
}

/// PyTorch's ``reset_accumulated_memory_stats(device)``: its totals
/// (``allocated``, ``freed``, ``num_ooms``, ``num_alloc_retries``) start
/// again from zero on ``device``; the pool's own totals are kept, and
/// PyTorch's are counted from what they are now.
#[pyfunction]
pub(crate) fn _torch_reset_accumulated(device: &Bound<'_, PyAny>) -> PyResult<()> {
    let device = checked_device(device)?;
    let rt = super::args::runtime()?;
    let s = rt.device_stats(device)?;
    with_device(device, |c| {
        for b in [
            &mut c.allocation,
            &mut c.allocated_bytes,
            &mut c.requested_bytes,
        ] {
            for st in [&mut b.all, &mut b.small, &mut b.large] {
                (st.allocated, st.freed) = (0, 0);
            }
        }
        c.num_ooms = 0;
        c.segments_base = s.segments;
        c.retries_base = s.num_alloc_retries;
    });
    Ok(())
}
