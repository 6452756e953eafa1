//! Reading a DLPack capsule (the pre-1.0 `"dltensor"` ABI). An importer
//! consumes the capsule as the protocol asks: it is renamed
//! `"used_dltensor"` (so no one imports it twice), and the returned
//! [`DLPackOwner`] calls the tensor's deleter when the last gpuptr holder
//! goes.

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;

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
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// Owns a consumed DLPack tensor: calls its deleter once, when dropped.
#[pyclass(frozen, module = "gpuptr._core", name = "DLPackOwner")]
pub(crate) struct DLPackOwner(usize);

impl Drop for DLPackOwner {
    fn drop(&mut self) {
        let t = self.0 as *mut DLManagedTensor;
        // SAFETY: `t` is the DLManagedTensor of a capsule this owner consumed
        // (renamed), so calling its deleter once is ours to do. Python objects
        // drop with the GIL held, as producers' deleters expect.
        unsafe {
            if let Some(deleter) = (*t).deleter {
                deleter(t);
            }
        }
    }
}

/// Consume a `"dltensor"` capsule (after [`describe`] read it):
/// rename it `"used_dltensor"` and return the owner that frees the tensor.
#[pyfunction]
pub(crate) fn _dlpack_consume(capsule: &Bound<'_, PyAny>) -> PyResult<DLPackOwner> {
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| Error::InvalidArgument("__dlpack__() did not return a capsule".into()))?;
    let ptr = capsule
        .pointer_checked(Some(c"dltensor"))
        .map_err(|_| Error::InvalidArgument("the capsule was already consumed".into()))?;
    // SAFETY: a live capsule; the name is a static C string that outlives it.
    let r = unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), c"used_dltensor".as_ptr()) };
    if r != 0 {
        return Err(PyErr::fetch(capsule.py()));
    }
    Ok(DLPackOwner(ptr.as_ptr() as usize))
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

/// What a `"dltensor"` capsule describes.
pub(crate) struct Described {
    /// The data pointer plus the byte offset: element 0's address.
    pub address: u64,
    pub shape: Vec<i64>,
    /// In bytes (DLPack counts elements); `None`: C-contiguous.
    pub strides: Option<Vec<i64>>,
    pub typestr: String,
}

/// Read a `"dltensor"` capsule without consuming it.
pub(crate) fn describe(capsule: &Bound<'_, PyAny>) -> PyResult<Described> {
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| Error::InvalidArgument("__dlpack__() did not return a capsule".into()))?;
    let name = c"dltensor";
    let ptr = capsule.pointer_checked(Some(name)).map_err(|_| {
        let got = capsule
            .name()
            .ok()
            .flatten()
            .map(|n| {
                // SAFETY: the capsule (held) keeps its name alive.
                unsafe { n.as_cstr() }.to_string_lossy().into_owned()
            })
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
    // SAFETY: a well-formed DLTensor has `ndim` shape entries (checked non-null).
    let shape: Vec<i64> = (0..ndim).map(|i| unsafe { *t.shape.add(i) }).collect();
    let typestr = typestr(&t.dtype)?;
    // DLPack counts strides in elements; the array interface, in bytes.
    let itemsize = i64::from(t.dtype.bits / 8);
    let strides: Option<Vec<i64>> = if t.strides.is_null() {
        None
    } else {
        // SAFETY: non-null strides have `ndim` entries.
        let bytes = (0..ndim).map(|i| unsafe { *t.strides.add(i) }.checked_mul(itemsize));
        Some(
            bytes
                .collect::<Option<_>>()
                .ok_or_else(|| Error::InvalidArgument("DLPack strides overflow in bytes".into()))?,
        )
    };
    let address = (t.data as usize as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| Error::InvalidArgument("DLPack byte_offset overflows the address".into()))?;
    Ok(Described {
        address,
        shape,
        strides,
        typestr,
    })
}
