//! The one mapping from [`Error`] to Python exceptions. The classes live in
//! `gpuptr/_errors.py`, so they can inherit from both `GpuptrError` and a
//! builtin (`MemoryError`, `ValueError`, `RuntimeError`).

use pyo3::prelude::*;

use crate::Error;

pyo3::import_exception!(gpuptr._errors, GpuptrError);
pyo3::import_exception!(gpuptr._errors, NoDriverError);
pyo3::import_exception!(gpuptr._errors, CudaError);
pyo3::import_exception!(gpuptr._errors, OutOfMemoryError);
pyo3::import_exception!(gpuptr._errors, InvalidPointerError);
pyo3::import_exception!(gpuptr._errors, InvalidArgumentError);

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let msg = e.to_string();
        match e {
            Error::NoDriver(_) => NoDriverError::new_err(msg),
            Error::Cuda { code, name, .. } if code == crate::codes::CUDA_ERROR_OUT_OF_MEMORY => {
                OutOfMemoryError::new_err((msg, code, name))
            }
            Error::Cuda { code, name, .. } => CudaError::new_err((msg, code, name)),
            Error::OutOfMemory { .. } | Error::HostOutOfMemory(_) => OutOfMemoryError::new_err(msg),
            Error::BufferExported(_) => pyo3::exceptions::PyBufferError::new_err(msg),
            Error::InvalidPointer(_) => InvalidPointerError::new_err(msg),
            Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            Error::Panic(_) => GpuptrError::new_err(msg),
        }
    }
}
