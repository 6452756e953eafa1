//! Size arguments from Python: an int of bytes, a size string (`"40GB"`,
//! `"40GiB"`, `"512M"`), a share of the device as a float in (0, 1], or
//! `"80%"`, read by the core's one parser ([`crate::sizes`]).

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBool, PyComplex, PyFloat, PyInt, PyString};

use super::args::size_arg;
use crate::sizes::{self, Size};

/// The size `obj` gives for the argument `what`.
pub(crate) fn size_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Size> {
    refuse_kind(obj, what, "an int of bytes, \"40GB\", 0.8 or \"80%\"")?;
    if obj.is_instance_of::<PyFloat>() {
        return Ok(Size::share(obj.extract::<f64>()?, what)?);
    }
    if is_float_scalar(obj) {
        // A numpy float scalar (np.float32 is no float subclass): the
        // same share a Python float gives.
        let f = obj.call_method0("__float__")?.extract::<f64>()?;
        return Ok(Size::share(f, what)?);
    }
    if let Ok(s) = obj.cast::<PyString>() {
        // Lossy: a lone surrogate is refused as a bad size, not raised as
        // `UnicodeEncodeError`.
        return Ok(sizes::parse(&s.to_string_lossy(), what)?);
    }
    Ok(Size::Bytes(size_arg(obj, what)?))
}

/// A `TypeError` for a bool or a complex number given as the size `what`,
/// whose forms are `forms`.
fn refuse_kind(obj: &Bound<'_, PyAny>, what: &str, forms: &str) -> PyResult<()> {
    match refused_kind(obj) {
        Some(kind) => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a size ({forms}), not {kind}"
        ))),
        None => Ok(()),
    }
}

/// `"bool"` or `"complex"` for the values no size may be, whatever their
/// type: Python's and numpy's bools (``np.True_`` is no int and has
/// ``__float__``, so it would read as a share of 1.0, the whole device),
/// and every complex number (Python's, numpy's ``complex64``, anything
/// with ``__complex__`` that is no float or int: it would read as its real
/// part).
fn refused_kind(obj: &Bound<'_, PyAny>) -> Option<&'static str> {
    if obj.is_instance_of::<PyBool>() {
        return Some("bool");
    }
    if obj.is_instance_of::<PyComplex>() {
        return Some("complex");
    }
    if obj.is_instance_of::<PyInt>()
        || obj.is_instance_of::<PyFloat>()
        || obj.is_instance_of::<PyString>()
    {
        return None;
    }
    let ty = obj.get_type();
    if ty.hasattr("__complex__").unwrap_or(false) {
        return Some("complex");
    }
    // numpy's bool scalar: `numpy.bool` (`numpy.bool_` before numpy 2).
    let numpy = ty
        .module()
        .is_ok_and(|m| m.to_str().is_ok_and(|m| m == "numpy"));
    let name = ty.name().map(|n| n.to_string()).unwrap_or_default();
    (numpy && matches!(name.as_str(), "bool" | "bool_")).then_some("bool")
}

/// A size in bytes only, for the argument `what` (``reserve``'s
/// ``block_size``): [`size_of`], but a share is refused and a bad string's
/// hint offers none ([`sizes::parse_bytes`]).
pub(crate) fn bytes_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    refuse_kind(obj, what, "an int of bytes or \"1GiB\"")?;
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(sizes::parse_bytes(&s.to_string_lossy(), what)?);
    }
    match size_of(obj, what)? {
        Size::Bytes(n) => Ok(n),
        Size::Share(_) => Err(sizes::not_a_share(&obj.str()?.to_string(), what).into()),
    }
}

/// A float-like scalar that is not an int (numpy's `float32`, `float16`):
/// `__float__` without `__index__`, which every int-like (numpy's integer
/// scalars too, taken as ints) has.
fn is_float_scalar(obj: &Bound<'_, PyAny>) -> bool {
    if obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyString>() {
        return false;
    }
    let ty = obj.get_type();
    ty.hasattr("__float__").unwrap_or(false) && !ty.hasattr("__index__").unwrap_or(true)
}
