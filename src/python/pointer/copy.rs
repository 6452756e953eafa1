//! `MemoryPointer`'s bytes: `memset`, `view`, and the copies to and from
//! the host and other device memory (numba's names).

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes};

use super::{contiguous, PyMemoryPointer};
use crate::python::args::{self, int_arg, optional_size, stream_arg};
use crate::Error;

/// A bound of `view` named `what`: negative, or past 64 bits, is an
/// `InvalidArgumentError` (as every int out of its argument's range is); a
/// bound past the end of the memory is the core's `InvalidPointerError`.
fn view_bound(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let bad = || -> PyErr {
        Error::InvalidArgument(format!(
            "view {what} {} is out of range: a bound is an int from 0 to 2**63-1",
            args::shown(obj)
        ))
        .into()
    };
    match int_arg(obj, what) {
        Ok(v) => usize::try_from(v).map_err(|_| bad()),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(obj.py()) => Err(e),
        Err(_) => Err(bad()),
    }
}

/// The ``byte`` of a memset: an int from 0 to 255, else an
/// `InvalidArgumentError` that says so.
fn byte_arg(obj: &Bound<'_, PyAny>) -> PyResult<u8> {
    let bad = || -> PyErr {
        Error::InvalidArgument(format!(
            "byte {} is out of range: it must be an int from 0 to 255",
            args::shown(obj)
        ))
        .into()
    };
    match int_arg(obj, "byte") {
        Ok(v) => u8::try_from(v).map_err(|_| bad()),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(obj.py()) => Err(e),
        Err(_) => Err(bad()),
    }
}

#[pymethods]
impl PyMemoryPointer {
    /// Set ``count`` bytes (default: all) to ``byte``, on ``stream``
    /// (0: synchronously).
    #[pyo3(signature = (byte, count=None, stream=None))]
    fn memset(
        &self,
        py: Python<'_>,
        byte: &Bound<'_, PyAny>,
        count: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let byte = byte_arg(byte)?;
        let count = optional_size(count, "count")?;
        let stream = stream_arg(stream)?;
        // SAFETY: a stream handle is the caller's, as numba and CuPy take
        // them; stream objects give their own live handle.
        Ok(py.detach(|| unsafe { self.view.memset_on(byte, count, stream) })?)
    }

    /// A pointer to bytes ``[start, stop)`` of this one (``stop`` defaults to
    /// the end). It keeps the allocation alive. Bounds past the end, or
    /// reversed, raise `InvalidPointerError`; a negative one
    /// `InvalidArgumentError`.
    #[pyo3(signature = (start, stop=None))]
    fn view(
        slf: &Bound<'_, Self>,
        start: &Bound<'_, PyAny>,
        stop: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let me = slf.get();
        me.view.parent().check_live()?;
        let start = view_bound(start, "start")?;
        let stop = stop
            .filter(|s| !s.is_none())
            .map(|s| view_bound(s, "stop"))
            .transpose()?;
        let view = me.view.view(start, stop)?;
        let owner = Self::owner(slf);
        Ok(me.sibling(view, false, Some(owner), slf.py()))
    }

    /// Copy a C-contiguous host buffer (bytes, numpy array, ...) to the
    /// start of this memory, on ``stream`` if given (it returns once the
    /// buffer may be reused). Other Python threads run during the copy, as
    /// they do during numba's.
    #[pyo3(signature = (src, stream=None))]
    fn copy_from_host(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stream = stream_arg(stream)?;
        let buf = PyUntypedBuffer::get(src)?;
        contiguous(&buf)?;
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        // SAFETY: the buffer is held (valid, and not resized) until `buf`
        // drops, after the copy; it is passed as a raw pointer, since it may
        // overlap this memory (mapped memory). The stream is the caller's.
        Ok(py.detach(|| unsafe { self.view.copy_from_host_raw(ptr as *const u8, len, stream) })?)
    }

    /// Copy this memory to the host: into the writable buffer ``dst`` if
    /// given (exactly this memory's size), else into new ``bytes``; on
    /// ``stream`` if given (it returns once the bytes are there). Other
    /// Python threads run during the copy.
    #[pyo3(signature = (dst=None, stream=None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        dst: Option<&Bound<'py, PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let stream = stream_arg(stream)?;
        let size = self.view.size();
        match dst {
            None => {
                // Liveness first, then a fallible allocation of the result.
                self.view.parent().check_live()?;
                let out = PyBytes::new_with(py, size, |bytes: &mut [u8]| {
                    let (p, n) = (bytes.as_mut_ptr() as usize, bytes.len());
                    // SAFETY: `bytes` is the new object's buffer, exclusively ours
                    // until it is returned; the stream is the caller's.
                    py.detach(|| unsafe { self.view.copy_to_host_raw(p as *mut u8, n, stream) })?;
                    Ok(())
                })
                .map_err(|e| {
                    if e.is_instance_of::<pyo3::exceptions::PyMemoryError>(py) {
                        Error::HostOutOfMemory(size).into()
                    } else {
                        e
                    }
                })?;
                Ok(out.into_any())
            }
            Some(dst) => {
                let buf = PyUntypedBuffer::get(dst)?;
                contiguous(&buf)?;
                if buf.readonly() {
                    return Err(
                        Error::InvalidArgument("the host buffer is read-only".into()).into(),
                    );
                }
                if buf.len_bytes() < size {
                    return Err(Error::InvalidArgument(format!(
                        "the host buffer holds {} bytes; this memory has {size}",
                        buf.len_bytes()
                    ))
                    .into());
                }
                let (p, n) = (buf.buf_ptr() as usize, buf.len_bytes());
                // SAFETY: writable, contiguous, held until `buf` drops, after
                // the copy; a raw pointer, since it may overlap this memory.
                py.detach(|| unsafe { self.view.copy_to_host_raw(p as *mut u8, n, stream) })?;
                Ok(dst.clone())
            }
        }
    }

    /// Copy ``count`` bytes (default: all of ``src``) from device memory
    /// ``src`` to the start of this memory, on ``stream`` if given.
    #[pyo3(signature = (src, count=None, stream=None))]
    fn copy_from_device(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyMemoryPointer>,
        count: Option<&Bound<'_, PyAny>>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let count = optional_size(count, "count")?;
        let stream = stream_arg(stream)?;
        let src = &src.get().view;
        // SAFETY: the stream is the caller's (see `memset`).
        Ok(py.detach(|| unsafe { self.view.copy_from_device_on(src, count, stream) })?)
    }
}
