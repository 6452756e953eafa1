//! Sharing a PyTorch allocation with another process, for
//! `gpuptr._torch_ipc`: [`_torch_lend`] exports an IPC handle of an
//! allocation of the hooks (`gpuptr_torch_alloc`) and lends it (a
//! [`Loan`]), so that a free by PyTorch leaves the release to the loan's
//! holder: the sender keeps the memory until the receiver lets go.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::args::runtime;
use crate::Loan;

/// A PyTorch allocation lent to another process: until it is dropped, a
/// free by PyTorch leaves the release to it.
#[pyclass(frozen, module = "gpuptr._core", name = "TorchLoan")]
pub(crate) struct TorchLoan(#[allow(dead_code)] Loan);

/// An IPC handle (as bytes) of the PyTorch allocation that starts at
/// ``address``, and a loan that keeps it alive. ``InvalidPointerError`` for
/// an address the hooks did not hand out (or freed).
#[pyfunction]
pub(crate) fn _torch_lend<'py>(
    py: Python<'py>,
    address: u64,
) -> PyResult<(Bound<'py, PyBytes>, TorchLoan)> {
    let Some(mem) = super::hooks::torch_allocation(address) else {
        return Err(crate::Error::InvalidPointer(format!(
            "{address:#x} is not the start of memory gpuptr's PyTorch allocator handed out"
        ))
        .into());
    };
    let loan = mem.lend()?;
    let handle = py.detach(|| runtime()?.ipc_export(&mem.view_all()).map_err(PyErr::from))?;
    Ok((PyBytes::new(py, &handle.to_bytes()), TorchLoan(loan)))
}

/// Whether ``address`` starts a live allocation of gpuptr's PyTorch hooks.
#[pyfunction]
pub(crate) fn _torch_is_live(address: u64) -> bool {
    super::hooks::torch_allocation(address).is_some()
}
