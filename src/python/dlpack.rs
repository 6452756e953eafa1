//! Reading a DLPack capsule (the pre-1.0 `"dltensor"` ABI). The capsule is
//! not renamed: the importer keeps it as the owner, so the producer's own
//! capsule destructor frees the tensor when the last gpuptr holder goes.

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

use crate::Error;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

fn typestr(dt: &DLDataType) -> PyResult<String> {
    let kind = match dt.code {
        0 => 'i',
        1 => 'u',
        2 => 'f',
        5 => 'c',
        6 => 'b',
        c => {
            return Err(Error::InvalidArgument(format!(
                "DLPack dtype code {c} has no array-interface typestr"
            ))
            .into())
        }
    };
    if dt.lanes != 1 || dt.bits % 8 != 0 || dt.bits == 0 {
        return Err(Error::InvalidArgument(format!(
            "DLPack dtype with {} bits x {} lanes is not supported",
            dt.bits, dt.lanes
        ))
        .into());
    }
    let order = if dt.bits == 8 { '|' } else { '<' };
    Ok(format!("{order}{kind}{}", dt.bits / 8))
}

/// Read a `"dltensor"` capsule: ``(data, device_type, device_id, shape,
/// strides_in_bytes_or_None, typestr, byte_offset)``.
#[pyfunction]
pub(crate) fn _dlpack_describe<'py>(capsule: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyTuple>> {
    let py = capsule.py();
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| Error::InvalidArgument("__dlpack__() did not return a capsule".into()))?;
    let name = c"dltensor";
    let ptr = capsule.pointer_checked(Some(name)).map_err(|_| {
        let got = capsule
            .name()
            .ok()
            .flatten()
            .map(|n| unsafe { n.as_cstr() }.to_string_lossy().into_owned())
            .unwrap_or_default();
        Error::InvalidArgument(format!(
            "expected an unconsumed 'dltensor' capsule, got {got:?}"
        ))
    })?;
    // SAFETY: a live "dltensor" capsule points at a DLManagedTensor whose
    // first member is the DLTensor; the capsule (held by the caller) keeps it
    // alive while we read.
    let t = unsafe { &*(ptr.as_ptr() as *const DLTensor) };
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(Error::InvalidArgument("malformed DLPack tensor".into()).into());
    }
    let ndim = t.ndim as usize;
    let shape: Vec<i64> = (0..ndim).map(|i| unsafe { *t.shape.add(i) }).collect();
    let typestr = typestr(&t.dtype)?;
    // DLPack counts strides in elements; the array interface, in bytes.
    let itemsize = i64::from(t.dtype.bits / 8);
    let strides: Option<Vec<i64>> = if t.strides.is_null() {
        None
    } else {
        let bytes = (0..ndim).map(|i| unsafe { *t.strides.add(i) }.checked_mul(itemsize));
        Some(
            bytes
                .collect::<Option<_>>()
                .ok_or_else(|| Error::InvalidArgument("DLPack strides overflow in bytes".into()))?,
        )
    };
    (
        t.data as usize as u64,
        t.device.device_type,
        t.device.device_id,
        PyTuple::new(py, shape)?,
        strides.map(|s| PyTuple::new(py, s)).transpose()?,
        typestr,
        t.byte_offset,
    )
        .into_pyobject(py)
}
