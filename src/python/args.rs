//! Every argument converter of the binding, so that each bad argument gets
//! one error type everywhere: sizes, devices, addresses, streams, contexts.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyAny;

use super::shutdown::Region;
use crate::{DevicePtr, Error, RawStream, Runtime};

/// The process runtime (`GPUPTR_DRIVER` picks the driver on first use).
pub(crate) fn runtime() -> PyResult<&'static Arc<Runtime>> {
    Ok(Runtime::global()?)
}

/// The ordinal a ``device`` argument names, or the current device's when
/// it is absent or ``None``.
pub(crate) fn device_ordinal(device: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match optional_device(device)? {
        Some(d) => Ok(d),
        None => Ok(runtime()?.current_device()?),
    }
}

/// The context of a ``device`` argument, or of the current device when it
/// is absent or ``None``.
pub(crate) fn device_context(device: Option<&Bound<'_, PyAny>>) -> PyResult<Arc<crate::Context>> {
    Ok(runtime()?.context(device_ordinal(device)?)?)
}

/// [`device_context`], held by the runtime until a reset or exit (see
/// [`Runtime::held_context`](crate::Runtime::held_context)): for memory that
/// goes back to a cache (pinned host memory), which the context's last drop
/// would otherwise give back to the driver at every free, with the context
/// itself.
pub(crate) fn held_device_context(
    device: Option<&Bound<'_, PyAny>>,
) -> PyResult<Arc<crate::Context>> {
    Ok(runtime()?.held_context(device_ordinal(device)?)?)
}

/// An optional device ordinal (`None` or Python's ``None``: the current
/// device).
pub(crate) fn optional_device(device: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    device.filter(|d| !d.is_none()).map(device_arg).transpose()
}

/// The largest size, count or device ordinal an argument may name, as the
/// error messages write it.
const MAX: &str = "2**63-1";

/// `obj` (an int) as an error message shows it: its value, or how many
/// bits it has when its digits would not fit on a line.
pub(crate) fn shown(obj: &Bound<'_, PyAny>) -> String {
    // An int subclass may print itself with Python code.
    let _region = (!obj.is_exact_instance_of::<pyo3::types::PyInt>())
        .then(|| Region::enter_or_hang(obj.py()));
    match obj.str() {
        Ok(s) if s.to_str().is_ok_and(|s| s.len() <= 40) => s.to_string(),
        _ => match obj.call_method0("bit_length") {
            Ok(bits) => format!("an int of {bits} bits"),
            Err(_) => "an int".into(),
        },
    }
}

/// A file path as `open` takes it: a `str`, `bytes` (any bytes a POSIX
/// name holds, UTF-8 or not) or an `os.PathLike` of either.
pub(crate) fn fs_path(obj: &Bound<'_, PyAny>) -> PyResult<std::path::PathBuf> {
    let path = obj.py().import("os")?.call_method1("fspath", (obj,))?;
    if let Ok(b) = path.cast::<pyo3::types::PyBytes>() {
        use std::os::unix::ffi::OsStrExt;
        return Ok(std::ffi::OsStr::from_bytes(b.as_bytes()).into());
    }
    path.extract()
}

/// An integer argument named `what` that must not be a bool (``True`` is not
/// a size or a device): anything but an int is a `TypeError`; an int past
/// 64 bits is an `InvalidArgumentError` that names `what` and the range.
pub(crate) fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<isize> {
    int_value(obj, what).map_err(|e| match e {
        Err(e) => e,
        Ok(Past64Bits) => Error::InvalidArgument(format!(
            "{what} {} is out of range: it must be an int from -2**63 to {MAX}",
            shown(obj)
        ))
        .into(),
    })
}

/// [`int_arg`]'s int, or why not: an int past 64 bits (`Ok`, for the
/// caller to name its range), or the error to raise: a `TypeError`, or one
/// the object's own `__index__` raised (a KeyboardInterrupt among them),
/// which is the caller's to see, as Python's own calls let it be.
fn int_value(obj: &Bound<'_, PyAny>, what: &str) -> Result<isize, PyResult<Past64Bits>> {
    let type_error = || {
        let name = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be an int, not {name}"
        )))
    };
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_error());
    }
    // Anything but an int converts through `__index__`, which may be Python code.
    let _region =
        (!obj.is_instance_of::<pyo3::types::PyInt>()).then(|| Region::enter_or_hang(obj.py()));
    obj.extract::<isize>().map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) {
            Ok(Past64Bits)
        } else if e.is_instance_of::<pyo3::exceptions::PyTypeError>(obj.py()) {
            type_error()
        } else {
            Err(e)
        }
    })
}

/// An int argument past 64 bits ([`int_value`]).
struct Past64Bits;

/// A byte count named `what`: an int from 0 to 2**63-1 (see [`int_arg`]);
/// anything outside is an `InvalidArgumentError` naming `what` and the range.
pub(crate) fn size_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let out_of_range = || -> PyErr {
        Error::InvalidArgument(format!(
            "{what} {} is out of range: a size is an int from 0 to {MAX}",
            shown(obj)
        ))
        .into()
    };
    match int_value(obj, what) {
        Ok(n) => usize::try_from(n).map_err(|_| out_of_range()),
        Err(Ok(Past64Bits)) => Err(out_of_range()),
        Err(Err(e)) => Err(e),
    }
}

/// An optional byte count (``None``: absent).
pub(crate) fn optional_size(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<usize>> {
    obj.filter(|n| !n.is_none())
        .map(|n| size_arg(n, what))
        .transpose()
}

/// A device ordinal: negative is an `InvalidArgumentError`, and so is an int
/// past 64 bits (naming the range).
pub(crate) fn device_arg(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    match int_value(obj, "device") {
        Ok(d) => usize::try_from(d)
            .map_err(|_| Error::InvalidArgument(format!("device {d} does not exist")).into()),
        Err(Err(e)) => Err(e),
        Err(Ok(Past64Bits)) => Err(Error::InvalidArgument(format!(
            "device {} does not exist: a device ordinal is an int from 0 to {MAX}",
            shown(obj)
        ))
        .into()),
    }
}

/// An address from an int, `ctypes.c_void_p`, `CUdeviceptr` or anything
/// with `__int__` (``None``: the null address). A value of another type (a
/// float, a bool, a complex number, a string) is a `TypeError`; an int that
/// is no address (negative, or past 64 bits) is an `InvalidPointerError`,
/// as an address with no memory there is.
pub(crate) fn pointer_arg(obj: &Bound<'_, PyAny>) -> PyResult<DevicePtr> {
    use pyo3::types::{PyBool, PyBytes, PyComplex, PyFloat, PyString};
    if obj.is_none() {
        return Ok(0);
    }
    let type_name = || {
        obj.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    };
    let wrong_type = || -> PyErr {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "an address must be an int, ctypes.c_void_p, CUdeviceptr or None, not {}",
            type_name()
        ))
    };
    if obj.is_instance_of::<PyFloat>()
        || obj.is_instance_of::<PyBool>()
        || obj.is_instance_of::<PyComplex>()
        || obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
    {
        return Err(wrong_type());
    }
    let no_address = |v: &Bound<'_, PyAny>| -> PyErr {
        Error::InvalidPointer(format!(
            "{} is not a device address (an address is an int from 0 to 2**64-1)",
            shown(v)
        ))
        .into()
    };
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return obj.extract::<u64>().map_err(|_| no_address(obj));
    }
    // An address object's `value` and `__int__` may be Python code.
    let _region = Region::enter_or_hang(obj.py());
    // A float-like or complex scalar (numpy's `float32`, `bool`,
    // `complex64`) has `__int__` too, but is no address.
    let ty = obj.get_type();
    let has = |name: &str| ty.hasattr(name).unwrap_or(false);
    if has("__complex__") || (has("__float__") && !has("__index__")) {
        return Err(wrong_type());
    }
    let int_of = |v: PyResult<Bound<'_, PyAny>>| match v {
        Ok(v) if v.is_instance_of::<pyo3::types::PyInt>() => {
            v.extract::<u64>().map_err(|_| no_address(&v))
        }
        _ => Err(wrong_type()),
    };
    // An int-like (numpy's integer scalars).
    if has("__index__") {
        return int_of(obj.call_method0("__index__"));
    }
    if let Ok(v) = obj.getattr("value") {
        if v.is_none() {
            return Ok(0);
        }
        if v.is_instance_of::<pyo3::types::PyInt>() {
            return v.extract::<u64>().map_err(|_| no_address(&v));
        }
    }
    int_of(obj.call_method0("__int__"))
}

/// A stream argument: ``None`` (no stream), an int handle (0 and 1 are the
/// legacy default stream, 2 the per-thread one), or a stream object: anything
/// with ``__cuda_stream__()`` (cuda.core's protocol), ``.cuda_stream``
/// (torch), ``.ptr`` (CuPy) or ``.handle`` (numba). Anything else is an
/// `InvalidArgumentError`.
pub(crate) fn stream_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<RawStream>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    let bad = || -> PyErr {
        Error::InvalidArgument(format!(
            "stream must be None, an int handle, or a stream object (numba, CuPy, torch, __cuda_stream__), not {}",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
        .into()
    };
    let handle = |h: &Bound<'_, PyAny>| -> PyResult<RawStream> {
        if h.is_instance_of::<pyo3::types::PyBool>() || h.is_instance_of::<pyo3::types::PyFloat>() {
            return Err(bad());
        }
        if let Ok(v) = h.extract::<usize>() {
            return Ok(v);
        }
        // cuda-bindings' CUstream has __int__.
        h.call_method0("__int__")
            .and_then(|v| v.extract::<usize>())
            .map_err(|_| bad())
    };
    if obj.is_exact_instance_of::<pyo3::types::PyInt>() {
        return handle(obj).map(Some);
    }
    // A stream object's attributes, and `__cuda_stream__`, may be Python code.
    let _region = Region::enter_or_hang(obj.py());
    if obj.is_instance_of::<pyo3::types::PyInt>() {
        return handle(obj).map(Some);
    }
    // What the object's own code raises (a destroyed stream, Ctrl-C) goes
    // on as it is; only a missing attribute means "not a stream object".
    let attr = |name: &str| match obj.getattr(name) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyAttributeError>(obj.py()) => Ok(None),
        Err(e) => Err(e),
    };
    if let Some(f) = attr("__cuda_stream__")? {
        let t = f.call0()?;
        let (_version, h): (Bound<'_, PyAny>, Bound<'_, PyAny>) = t.extract().map_err(|_| bad())?;
        return handle(&h).map(Some);
    }
    for name in ["cuda_stream", "ptr", "handle"] {
        if let Some(h) = attr(name)? {
            return handle(&h).map(Some);
        }
    }
    Err(bad())
}
