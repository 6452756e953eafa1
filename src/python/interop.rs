//! The CUDA Array Interface and DLPack import paths, parsed in Rust because
//! they sit on the per-array hot path of `as_cuda_array`.

use pyo3::exceptions::PyBufferError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use super::args::runtime;
use super::dlpack::{
    self, _dlpack_consume, describe, dtype_name_of_typestr, dtype_named, ArraySpec, Request,
};
use super::pointer::PyMemoryPointer;
use crate::{typestr_itemsize, Error, Layout, RawStream, View};

fn bad(msg: impl Into<String>) -> PyErr {
    Error::InvalidArgument(msg.into()).into()
}

/// An int that is not a bool.
fn int_of(obj: &Bound<'_, PyAny>) -> Option<i64> {
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    obj.extract::<i64>().ok()
}

fn ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    let err = || {
        bad(format!(
            "{what} must be a tuple of ints, got {}",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    };
    if obj.is_instance_of::<PyString>() {
        return Err(err());
    }
    let iter = obj.try_iter().map_err(|_| err())?;
    iter.map(|v| v.ok().as_ref().and_then(int_of).ok_or_else(err))
        .collect()
}

fn shape_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    ints(obj, "shape")?
        .into_iter()
        .map(|n| {
            usize::try_from(n).map_err(|_| bad(format!("shape must not be negative, got {n}")))
        })
        .collect()
}

/// An imported strided device array: a MemoryPointer starting where the
/// array's memory starts, and the layout over it. The Python side reads it
/// by name.
#[pyclass(frozen, module = "gpuptr._core", name = "ImportedArray")]
pub(crate) struct ImportedArray {
    /// The memory the array spans, keeping the exporter alive.
    #[pyo3(get)]
    pointer: Py<PyMemoryPointer>,
    /// Elements per dimension.
    #[pyo3(get)]
    shape: Py<PyTuple>,
    /// Bytes between neighbours in each dimension.
    #[pyo3(get)]
    strides: Py<PyTuple>,
    /// The element type, as the array interface writes it (``"<f4"``).
    #[pyo3(get)]
    typestr: Py<PyString>,
    /// Bytes per element.
    #[pyo3(get)]
    itemsize: usize,
    /// Whether the exporter marked it read-only.
    #[pyo3(get)]
    readonly: bool,
    /// Bytes from the start of ``pointer`` to element 0 (non-zero only
    /// with negative strides).
    #[pyo3(get)]
    offset: usize,
    /// The stream the exporter named (the interface's v3), or None.
    #[pyo3(get)]
    stream: Option<usize>,
    /// The element type's name, where DLPack gave it (its bfloat16 and
    /// float8 types share void typestrs); CAI imports derive it on demand.
    dlpack_dtype: Option<&'static str>,
}

#[pymethods]
impl ImportedArray {
    /// The element type's name (``"float32"``, ``"bfloat16"``), or None
    /// for a typestr that names none (``"|V16"``).
    #[getter]
    fn dtype(&self, py: Python<'_>) -> PyResult<Option<&'static str>> {
        match self.dlpack_dtype {
            Some(name) => Ok(Some(name)),
            None => Ok(dtype_name_of_typestr(self.typestr.bind(py).to_str()?)),
        }
    }
}

/// The pointer over a layout, as an [`ImportedArray`]. The exporter's own
/// shape tuple is handed back when it is already exactly what we would build.
#[allow(clippy::too_many_arguments)]
fn finish<'py>(
    view: View,
    layout: Layout,
    shape: &Bound<'py, PyAny>,
    typestr: Bound<'py, PyString>,
    dlpack_dtype: Option<&'static str>,
    readonly: bool,
    owner: Option<Py<PyAny>>,
    stream: Option<usize>,
) -> PyResult<ImportedArray> {
    let py = shape.py();
    // The exporter's own tuple only if it holds plain ints, the values just
    // checked; else the checked values (an object's `__index__` may answer
    // differently the next time it is read).
    let shape = match shape.cast_exact::<PyTuple>() {
        Ok(t)
            if t.iter()
                .all(|d| d.is_exact_instance_of::<pyo3::types::PyInt>()) =>
        {
            t.clone()
        }
        _ => PyTuple::new(py, &layout.shape)?,
    };
    // Read-only also where the memory is (read-only host memory), whatever
    // the exporter said.
    let readonly = readonly || view.parent().is_readonly();
    Ok(ImportedArray {
        pointer: Py::new(py, PyMemoryPointer::over(view, owner))?,
        shape: shape.unbind(),
        strides: PyTuple::new(py, &layout.strides)?.unbind(),
        typestr: typestr.unbind(),
        itemsize: layout.itemsize,
        readonly,
        offset: (-layout.lo) as usize,
        stream,
        dlpack_dtype,
    })
}

/// Import a CUDA Array Interface dict (v0-v3) as an ``ImportedArray``.
/// With ``sync`` and a named stream, waits for that stream (v3's rule)
/// unless it is idle.
#[pyfunction]
#[pyo3(signature = (desc, owner=None, sync=true))]
pub(crate) fn _import_cai<'py>(
    desc: &Bound<'py, PyAny>,
    owner: Option<Py<PyAny>>,
    sync: bool,
) -> PyResult<ImportedArray> {
    let py = desc.py();
    // The descriptor's values may be objects whose conversions are Python code.
    let _region = super::shutdown::Region::enter_or_hang(py);
    let desc = desc
        .cast::<PyDict>()
        .map_err(|_| bad("__cuda_array_interface__ must be a dict"))?;
    let version = match desc.get_item(intern!(py, "version"))? {
        None => 0,
        Some(v) => int_of(&v)
            .filter(|v| (0..=3).contains(v))
            .ok_or_else(|| bad(format!("unsupported CUDA Array Interface version {v}")))?,
    };
    if let Some(mask) = desc.get_item(intern!(py, "mask"))? {
        if !mask.is_none() {
            return Err(bad("masked arrays are not supported"));
        }
    }
    let get = |key: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyAny>> {
        desc.get_item(key)?
            .ok_or_else(|| bad(format!("the interface lacks {key}")))
    };
    let (shape, typestr, data) = (
        get(intern!(py, "shape"))?,
        get(intern!(py, "typestr"))?,
        get(intern!(py, "data"))?,
    );
    let data = data
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 2)
        .ok_or_else(|| bad(format!("data must be (address, readonly), got {data}")))?;
    let address = data.get_item(0)?;
    let address = int_of(&address)
        .and_then(|a| u64::try_from(a).ok())
        .ok_or_else(|| {
            Error::InvalidPointer(format!("data address {address} is not an address"))
        })?;
    let readonly = data.get_item(1)?.is_truthy()?;
    let typestr = typestr
        .cast_into::<PyString>()
        .map_err(|e| bad(format!("typestr must be a str, got {}", e.into_inner())))?;
    // Lossy: a lone surrogate (no UTF-8 has one) is refused below as any
    // unknown typestr is, not raised as `UnicodeEncodeError`.
    let itemsize = typestr_itemsize(&typestr.to_string_lossy())?;
    let strides = match desc.get_item(intern!(py, "strides"))? {
        Some(s) if !s.is_none() => Some(ints(&s, "strides")?),
        _ => None,
    };
    let stream = match desc.get_item(intern!(py, "stream"))? {
        Some(s) if version >= 3 && !s.is_none() => match int_of(&s) {
            Some(0) => {
                return Err(bad(
                    "stream 0 is disallowed by the interface (ambiguous); use 1 or 2",
                ))
            }
            Some(v) if v > 0 => Some(v as usize),
            _ => return Err(bad(format!("stream must be an int handle, got {s}"))),
        },
        _ => None,
    };
    let layout = Layout::new(shape_of(&shape)?, strides, itemsize)?;
    // A writable array of a gpuptr pointer's memory is a view of it (see
    // `owner_view`): freeing the pointer turns the array stale.
    let start = address.checked_add_signed(layout.lo);
    let own = match start.filter(|_| !readonly && layout.span > 0 && address != 0) {
        Some(a) => PyMemoryPointer::owner_view(py, owner.as_ref(), a, layout.span)?,
        None => None,
    };
    let view = match own {
        Some(v) => v.view((-layout.lo) as usize, None)?,
        None => runtime()?.wrap_layout(address, &layout, readonly, None)?,
    };
    if let (Some(stream), true) = (stream, sync) {
        let ctx = view.context();
        // Most imports find the stream idle: a query, no GIL release, no wait.
        // SAFETY: the exporter names a live stream of its array (the CUDA
        // array interface's contract), as numba trusts it.
        if !unsafe { ctx.stream_is_idle(stream) }? {
            // SAFETY: as above.
            py.detach(|| unsafe { ctx.stream_synchronize(stream) })?;
        }
    }
    finish(view, layout, &shape, typestr, None, readonly, owner, stream)
}

/// Import a DLPack ``"dltensor"`` or ``"dltensor_versioned"`` capsule as an
/// ``ImportedArray``, consuming it as the protocol asks: the capsule is
/// renamed ``"used_…"``, and the pointer keeps an owner that calls the
/// tensor's deleter when the last holder goes (also when the import fails).
#[pyfunction]
pub(crate) fn _import_dlpack(capsule: &Bound<'_, PyAny>) -> PyResult<ImportedArray> {
    let py = capsule.py();
    let d = describe(capsule)?;
    let owner = Py::new(py, _dlpack_consume(capsule)?)?.into_any();
    let itemsize = typestr_itemsize(d.typestr)?;
    let layout = Layout::new(
        d.shape
            .iter()
            .map(|&n| usize::try_from(n).map_err(|_| bad(format!("negative dimension {n}"))))
            .collect::<PyResult<_>>()?,
        d.strides,
        itemsize,
    )?;
    let view = runtime()?.wrap_layout(d.address, &layout, d.readonly, None)?;
    let shape = PyTuple::new(py, &layout.shape)?.into_any();
    let typestr = PyString::new(py, d.typestr);
    finish(
        view,
        layout,
        &shape,
        typestr,
        Some(d.dtype),
        d.readonly,
        Some(owner),
        None,
    )
}

/// Export an array over ``pointer`` (element 0 at its address, byte
/// ``strides`` or None for C order, element type ``dtype`` by name) as a
/// DLPack capsule for a consumer's ``__dlpack__`` call. ``producer_stream``
/// is a stream whose queued work may still use the memory.
#[pyfunction]
#[pyo3(signature = (pointer, shape, strides, dtype, readonly, producer_stream, stream=None, max_version=None, dl_device=None, copy=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _dlpack_export<'py>(
    pointer: &Bound<'py, PyMemoryPointer>,
    shape: Vec<usize>,
    strides: Option<Vec<i64>>,
    dtype: &Bound<'py, PyString>,
    readonly: bool,
    producer_stream: Option<RawStream>,
    stream: Option<&Bound<'py, PyAny>>,
    max_version: Option<&Bound<'py, PyAny>>,
    dl_device: Option<&Bound<'py, PyAny>>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    let dtype = dtype.to_string_lossy(); // as `_dtype_info` reads it
    let (dt, _) = dtype_named(&dtype).ok_or_else(|| {
        PyBufferError::new_err(format!("element type {dtype:?} has no DLPack code"))
    })?;
    let spec = ArraySpec {
        shape,
        strides,
        dtype: dt,
        // Read-only memory is never exported writable.
        readonly: readonly || pointer.get().view.parent().is_readonly(),
        producer_stream: producer_stream.and_then(crate::ordering_stream),
    };
    let request = Request {
        stream,
        max_version,
        dl_device,
        copy,
    };
    dlpack::export(&pointer.get().view, pointer.as_any(), spec, request)
}

/// ``(strides, lo, span)`` of an array of ``shape`` with byte ``strides``
/// (None: C order) and elements of ``itemsize`` bytes, as the importers
/// compute them: the strides, the lowest byte offset from element 0 (at
/// most 0), and the bytes from there to the end of the highest element.
#[pyfunction]
pub(crate) fn _layout(
    shape: Vec<usize>,
    strides: Option<Vec<i64>>,
    itemsize: usize,
) -> PyResult<(Vec<i64>, i64, usize)> {
    let l = Layout::new(shape, strides, itemsize)?;
    Ok((l.strides, l.lo, l.span))
}
