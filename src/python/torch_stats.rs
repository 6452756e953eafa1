//! PyTorch's own statistics of the memory it gets through gpuptr's
//! allocator hooks, which `torch.cuda.memory_stats()` (and so
//! `memory_allocated`, `max_memory_allocated`, `memory_summary`, ...)
//! reads under `gpuptr.torch.install()` (`gpuptr/_torch_stats.py` maps
//! them, with the pool's segments, onto PyTorch's keys).
//!
//! The counts are the core's ([`Runtime::library_stats`](crate::Runtime::library_stats)
//! for [`Client::Torch`], kept as the hooks hand allocations out and take
//! them back): this module reads them and writes PyTorch's layout.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{ByPool, Client, SegmentStats, Stat};

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
    let rt = super::args::runtime()?;
    let pool = rt.device_stats(device)?;
    let c = rt.library_stats(device, Client::Torch)?;
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
    super::args::runtime()?.reset_library_peaks(device, Client::Torch)?;
    Ok(())
}

/// PyTorch's ``reset_accumulated_memory_stats(device)``: its totals
/// (``allocated``, ``freed``, ``num_ooms``, ``num_alloc_retries``) start
/// again from zero on ``device``; the pool's own totals are kept, and
/// PyTorch's are counted from what they are now.
#[pyfunction]
pub(crate) fn _torch_reset_accumulated(device: &Bound<'_, PyAny>) -> PyResult<()> {
    let device = checked_device(device)?;
    super::args::runtime()?.reset_library_accumulated(device, Client::Torch)?;
    Ok(())
}
