//! `gpuptr._testing`: hooks for gpuptr's own tests and benchmarks (the
//! simulator's fault injection and counters, driver queries that bypass the
//! registry). Not part of the public API: `gpuptr._core` does not list it,
//! and it is reached as `import gpuptr._testing`.

use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::args::pointer_arg;
use super::args::runtime;
use super::py_context::{py_context, PyContext};
use crate::{CallKind, Error, SimDriver};

fn sim() -> PyResult<&'static SimDriver> {
    runtime()?.sim().ok_or_else(|| {
        Error::NoDriver("this needs the simulator (GPUPTR_DRIVER=sim)".into()).into()
    })
}

/// Simulator: fail the ``nth`` next call of ``kind`` with CUresult ``code``.
#[pyfunction]
fn sim_fail_nth(kind: &str, nth: u64, code: i32) -> PyResult<()> {
    sim()?.fail_nth(call_kind(kind)?, nth, code);
    Ok(())
}

fn call_kind(name: &str) -> PyResult<CallKind> {
    CallKind::from_name(name)
        .ok_or_else(|| Error::InvalidArgument(format!("unknown call kind {name:?}")).into())
}

/// Simulator: drop every armed fault.
#[pyfunction]
fn sim_clear_faults() -> PyResult<()> {
    sim()?.clear_faults();
    Ok(())
}

/// Simulator: queue a write of ``data`` at ``address`` on ``stream``, done
/// only by ``sim_complete`` (a kernel that is still running).
#[pyfunction]
fn sim_queue_write(stream: usize, address: u64, data: &[u8]) -> PyResult<()> {
    Ok(sim()?.queue_write(stream, address, data)?)
}

/// Simulator: run the oldest ``n`` queued operations (all with None).
#[pyfunction]
#[pyo3(signature = (n=None))]
fn sim_complete(py: Python<'_>, n: Option<usize>) -> PyResult<usize> {
    let s = sim()?;
    Ok(py.detach(|| s.complete(n)))
}

/// Simulator: queued writes that found their memory freed, and quarantined
/// host buffers written after their free.
#[pyfunction]
fn sim_stale_writes() -> PyResult<(u64, u64)> {
    let s = sim()?;
    Ok((s.lost_writes(), s.stale_host_writes()))
}

/// Simulator: device bytes allocated now (over all devices).
#[pyfunction]
fn sim_live_bytes() -> PyResult<usize> {
    Ok(sim()?.live_bytes())
}

/// Simulator: pinned host bytes allocated now.
#[pyfunction]
fn sim_live_host_bytes() -> PyResult<usize> {
    Ok(sim()?.live_host_bytes())
}

/// Simulator: host ranges registered now.
#[pyfunction]
fn sim_live_registrations() -> PyResult<usize> {
    Ok(sim()?.live_registrations())
}

/// Simulator: the primary-context retain count of ``device``.
#[pyfunction]
fn sim_retain_count(device: usize) -> PyResult<u32> {
    Ok(sim()?.retain_count(device))
}

/// Simulator: how many calls of ``kind`` were made.
#[pyfunction]
fn sim_calls(kind: &str) -> PyResult<u64> {
    Ok(sim()?.calls(call_kind(kind)?))
}

/// `cuDevicePrimaryCtxGetState(device)`: ``(flags, active)``.
#[pyfunction]
fn primary_context_state(device: usize) -> PyResult<(u32, bool)> {
    Ok(runtime()?.primary_context_state(device)?)
}

/// The context of ``address`` from a driver query, bypassing the registry
/// (the baseline the registry is measured against).
#[pyfunction]
fn query_context(py: Python<'_>, address: &Bound<'_, PyAny>) -> PyResult<Py<PyContext>> {
    let address = pointer_arg(address)?;
    py_context(py, &runtime()?.query_context(address)?)
}

/// Simulator: begin a global-mode capture of ``stream`` (an int handle),
/// as ``cuStreamBeginCapture`` would.
#[pyfunction]
fn sim_begin_capture(stream: usize) -> PyResult<()> {
    sim()?.begin_capture(stream);
    Ok(())
}

/// Simulator: end the capture of ``stream``; the graph it made, destroyed
/// by ``destroy()`` or when it is collected.
#[pyfunction]
fn sim_end_capture(stream: usize) -> PyResult<SimGraphObject> {
    let g = sim()?.end_capture_graph(stream)?;
    Ok(SimGraphObject(std::sync::Mutex::new(Some(g))))
}

/// A simulated CUDA graph: destroying it runs its user objects.
#[pyclass(frozen, name = "SimGraph", module = "gpuptr._testing")]
struct SimGraphObject(std::sync::Mutex<Option<crate::SimGraph>>);

#[pymethods]
impl SimGraphObject {
    /// Destroy the graph now (a second call does nothing).
    fn destroy(&self) {
        let g = crate::sync::lock(&self.0).take();
        drop(g);
    }
}

/// Make the `gpuptr._testing` module, importable by that name but not an
/// attribute of `_core`.
pub(crate) fn register(py: Python<'_>) -> PyResult<()> {
    let m = PyModule::new(py, "gpuptr._testing")?;
    m.add_function(wrap_pyfunction!(sim_fail_nth, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_clear_faults, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_queue_write, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_complete, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_stale_writes, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_live_bytes, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_live_host_bytes, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_live_registrations, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_retain_count, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_calls, &m)?)?;
    m.add_function(wrap_pyfunction!(primary_context_state, &m)?)?;
    m.add_function(wrap_pyfunction!(query_context, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_begin_capture, &m)?)?;
    m.add_function(wrap_pyfunction!(sim_end_capture, &m)?)?;
    m.add_class::<SimGraphObject>()?;
    py.import("sys")?
        .getattr("modules")?
        .set_item("gpuptr._testing", m)?;
    Ok(())
}
