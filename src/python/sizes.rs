//! Size arguments from Python: an int of bytes, a size string (`"40GB"`,
//! `"40GiB"`, `"512M"`), a share of the device as a float in (0, 1], or
//! `"80%"`, read by the core's one parser ([`crate::sizes`]).

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBool, PyFloat, PyString};

use super::args::size_arg;
use crate::sizes::{self, Size};

/// The size `obj` gives for the argument `what`.
pub(crate) fn size_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Size> {
    if obj.is_instance_of::<PyFloat>() {
        return Ok(Size::share(obj.extract::<f64>()?, what)?);
    }
    if obj.is_instance_of::<PyString>() {
        return Ok(sizes::parse(&obj.extract::<String>()?, what)?);
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be a size (an int of bytes, \"40GB\", 0.8 or \"80%\"), not bool"
        )));
    }
    Ok(Size::Bytes(size_arg(obj, what)?))
}
