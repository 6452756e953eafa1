//! DLPack, both ways and both ABIs: the pre-1.0 `"dltensor"` capsule and
//! the 1.x `"dltensor_versioned"` one (with its read-only flag).
//!
//! Importing consumes the capsule as the protocol asks: it is renamed
//! `"used_…"` (so no one imports it twice), and the returned
//! [`DLPackOwner`] calls the tensor's deleter when the last gpuptr holder
//! goes. Exporting hands out a tensor whose deleter lets go of a [`Loan`]
//! of the memory and of the exporting Python object: a `free()` meanwhile
//! leaves the release to the consumer, and the deleter takes no lock and
//! needs no GIL (consumers call it from any thread).

use std::ffi::{c_void, CStr};

use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyString, PyTuple};

use crate::{Error, Layout, Loan, RawStream, View};

/// `kDLCUDA`: the device type gpuptr exports (and imports, with managed).
pub(crate) const DEVICE_CUDA: i32 = 2;
const FLAG_READ_ONLY: u64 = 1;
/// The DLPack version gpuptr exports: 1.1, whose element types it knows.
const VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 1 };

#[repr(C)]
#[derive(Copy, Clone)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct DLDataType {
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

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Copy, Clone)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// What the two managed-tensor ABIs share, so that what is the same for
/// both (consuming, deleting, exporting) is written once.
trait Managed: Sized + 'static {
    /// The name of an unconsumed capsule of this ABI.
    const NAME: &'static CStr;
    fn manager_ctx(&self) -> *mut c_void;
    fn set_manager_ctx(&mut self, ctx: *mut c_void);
    fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)>;
}

/// The two ABIs' structs name their fields alike: one impl, twice.
macro_rules! managed {
    ($t:ty, $name:expr) => {
        impl Managed for $t {
            const NAME: &'static CStr = $name;
            fn manager_ctx(&self) -> *mut c_void {
                self.manager_ctx
            }
            fn set_manager_ctx(&mut self, ctx: *mut c_void) {
                self.manager_ctx = ctx;
            }
            fn deleter(&self) -> Option<unsafe extern "C" fn(*mut Self)> {
                self.deleter
            }
        }
    };
}
managed!(DLManagedTensor, c"dltensor");
managed!(DLManagedTensorVersioned, c"dltensor_versioned");

/// Call the producer's deleter of `t`, if it has one.
///
/// # Safety
/// `t` is a live managed tensor whose deleter is ours to call, once.
unsafe fn call_deleter<T: Managed>(t: *mut T) {
    // SAFETY: live (this fn's contract).
    if let Some(deleter) = unsafe { (*t).deleter() } {
        // SAFETY: the producer's deleter, called once with its own tensor.
        unsafe { deleter(t) };
    }
}

/// The element types gpuptr exchanges: name, DLPack code and bits, and the
/// array-interface typestr (bfloat16 and the float8 types have none of
/// their own: numpy shows them, through ml_dtypes, as void of their size).
const DTYPES: &[(&str, u8, u8, &str)] = &[
    ("bool", 6, 8, "|b1"),
    ("int8", 0, 8, "|i1"),
    ("int16", 0, 16, "<i2"),
    ("int32", 0, 32, "<i4"),
    ("int64", 0, 64, "<i8"),
    ("uint8", 1, 8, "|u1"),
    ("uint16", 1, 16, "<u2"),
    ("uint32", 1, 32, "<u4"),
    ("uint64", 1, 64, "<u8"),
    ("float16", 2, 16, "<f2"),
    ("float32", 2, 32, "<f4"),
    ("float64", 2, 64, "<f8"),
    ("complex64", 5, 64, "<c8"),
    ("complex128", 5, 128, "<c16"),
    ("bfloat16", 4, 16, "<V2"),
    ("float8_e3m4", 7, 8, "|V1"),
    ("float8_e4m3", 8, 8, "|V1"),
    ("float8_e4m3b11fnuz", 9, 8, "|V1"),
    ("float8_e4m3fn", 10, 8, "|V1"),
    ("float8_e4m3fnuz", 11, 8, "|V1"),
    ("float8_e5m2", 12, 8, "|V1"),
    ("float8_e5m2fnuz", 13, 8, "|V1"),
    ("float8_e8m0fnu", 14, 8, "|V1"),
];

/// An element type by its name (`"float32"`, `"bfloat16"`): its DLPack
/// type and typestr.
pub(crate) fn dtype_named(name: &str) -> Option<(DLDataType, &'static str)> {
    DTYPES.iter().find(|d| d.0 == name).map(|d| {
        let dt = DLDataType {
            code: d.1,
            bits: d.2,
            lanes: 1,
        };
        (dt, d.3)
    })
}

/// The name of an array-interface typestr's type, where it names one
/// (void typestrs name none: `"<V2"` is not necessarily bfloat16).
pub(crate) fn dtype_name_of_typestr(typestr: &str) -> Option<&'static str> {
    // `=` (native order) reads as `<`: the table is little-endian.
    let (order, rest) = typestr.split_at_checked(1)?;
    let order = if order == "=" { "<" } else { order };
    DTYPES
        .iter()
        .find(|d| d.3.split_at(1) == (order, rest) && !rest.starts_with('V'))
        .map(|d| d.0)
}

fn dtype_of(dt: &DLDataType) -> PyResult<(&'static str, &'static str)> {
    DTYPES
        .iter()
        .find(|d| d.1 == dt.code && d.2 == dt.bits && dt.lanes == 1)
        .map(|d| (d.0, d.3))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "DLPack element type (code {}, {} bits, {} lanes) is not supported",
                dt.code, dt.bits, dt.lanes
            ))
            .into()
        })
}

/// A consumed DLPack tensor, of either ABI.
enum Consumed {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

/// Owns a consumed DLPack tensor: calls its deleter once, when dropped.
#[pyclass(frozen, module = "gpuptr._core", name = "DLPackOwner")]
pub(crate) struct DLPackOwner(Consumed);

// SAFETY: the tensor is the producer's, handed over with the capsule; its
// deleter may run on any thread (DLPack's contract), and nothing else
// touches the pointer.
unsafe impl Send for DLPackOwner {}
// SAFETY: as above; `&DLPackOwner` reads nothing through the pointer.
unsafe impl Sync for DLPackOwner {}

impl Drop for DLPackOwner {
    fn drop(&mut self) {
        // SAFETY: the managed tensor of a capsule this owner consumed
        // (renamed), so calling its deleter once is ours to do. Python
        // objects drop with the GIL held, as producers' deleters expect.
        unsafe {
            match self.0 {
                Consumed::Legacy(t) => call_deleter(t),
                Consumed::Versioned(t) => call_deleter(t),
            }
        }
    }
}

const LEGACY: &CStr = DLManagedTensor::NAME;
const VERSIONED: &CStr = DLManagedTensorVersioned::NAME;

fn as_capsule<'a, 'py>(obj: &'a Bound<'py, PyAny>) -> PyResult<&'a Bound<'py, PyCapsule>> {
    obj.cast::<PyCapsule>()
        .map_err(|_| Error::InvalidArgument("__dlpack__() did not return a capsule".into()).into())
}

/// Consume a `"dltensor"` or `"dltensor_versioned"` capsule (after
/// [`describe`] read it): rename it `"used_…"` and return the owner that
/// frees the tensor.
#[pyfunction]
pub(crate) fn _dlpack_consume(capsule: &Bound<'_, PyAny>) -> PyResult<DLPackOwner> {
    let capsule = as_capsule(capsule)?;
    let (consumed, used) = if let Ok(p) = capsule.pointer_checked(Some(VERSIONED)) {
        (
            Consumed::Versioned(p.as_ptr().cast()),
            c"used_dltensor_versioned",
        )
    } else if let Ok(p) = capsule.pointer_checked(Some(LEGACY)) {
        (Consumed::Legacy(p.as_ptr().cast()), c"used_dltensor")
    } else {
        return Err(Error::InvalidArgument("the capsule was already consumed".into()).into());
    };
    // SAFETY: a live capsule; the name is a static C string that outlives it.
    let r = unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), used.as_ptr()) };
    if r != 0 {
        return Err(PyErr::fetch(capsule.py()));
    }
    Ok(DLPackOwner(consumed))
}

/// What a DLPack capsule describes.
pub(crate) struct Described {
    /// The data pointer plus the byte offset: element 0's address.
    pub address: u64,
    pub shape: Vec<i64>,
    /// In bytes (DLPack counts elements); `None`: C-contiguous.
    pub strides: Option<Vec<i64>>,
    pub typestr: &'static str,
    /// The element type's name (`"float32"`, `"bfloat16"`).
    pub dtype: &'static str,
    /// The producer set the read-only flag (1.x only).
    pub readonly: bool,
}

/// Read a `"dltensor"` or `"dltensor_versioned"` capsule without consuming
/// it. A versioned tensor of a major version other than 1 is refused, as
/// the protocol asks (its layout may differ).
pub(crate) fn describe(capsule: &Bound<'_, PyAny>) -> PyResult<Described> {
    let capsule = as_capsule(capsule)?;
    let (t, readonly) = if let Ok(p) = capsule.pointer_checked(Some(VERSIONED)) {
        // SAFETY: a live "dltensor_versioned" capsule points at a
        // DLManagedTensorVersioned, kept alive by the capsule the caller holds.
        let m = unsafe { &*(p.as_ptr() as *const DLManagedTensorVersioned) };
        if m.version.major != 1 {
            return Err(Error::InvalidArgument(format!(
                "DLPack {}.{} tensors are not supported (gpuptr reads 1.x)",
                m.version.major, m.version.minor
            ))
            .into());
        }
        check_ours(m)?;
        (&m.dl_tensor, m.flags & FLAG_READ_ONLY != 0)
    } else if let Ok(p) = capsule.pointer_checked(Some(LEGACY)) {
        // SAFETY: a live "dltensor" capsule points at a DLManagedTensor, kept
        // alive by the held capsule; its first member is the DLTensor.
        let m = unsafe { &*(p.as_ptr() as *const DLManagedTensor) };
        check_ours(m)?;
        (&m.dl_tensor, false)
    } else {
        let got = capsule
            .name()
            .ok()
            .flatten()
            .map(|n| {
                // SAFETY: the capsule (held) keeps its name alive.
                unsafe { n.as_cstr() }.to_string_lossy().into_owned()
            })
            .unwrap_or_default();
        return Err(Error::InvalidArgument(format!(
            "expected an unconsumed 'dltensor' or 'dltensor_versioned' capsule, got {got:?}"
        ))
        .into());
    };
    if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
        return Err(Error::InvalidArgument("malformed DLPack tensor".into()).into());
    }
    // CUDA memory, pinned host memory (kDLCUDAHost) or managed memory
    // (kDLCUDAManaged): what a CUDA address may name.
    if !matches!(t.device.device_type, DEVICE_CUDA | 3 | 13) {
        return Err(Error::InvalidArgument(format!(
            "a DLPack tensor on device type {} is not CUDA memory",
            t.device.device_type
        ))
        .into());
    }
    let ndim = t.ndim as usize;
    // SAFETY: a well-formed DLTensor has `ndim` shape entries (checked non-null).
    let shape: Vec<i64> = (0..ndim).map(|i| unsafe { *t.shape.add(i) }).collect();
    let (dtype, typestr) = dtype_of(&t.dtype)?;
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
        dtype,
        readonly,
    })
}

/// A tensor gpuptr exported (its deleter is ours) lends memory of a context
/// that may have been reset since: its address may be another allocation's
/// now, so it is refused as the exporting pointer is.
fn check_ours<T: Managed>(m: &T) -> PyResult<()> {
    let ours = m
        .deleter()
        .is_some_and(|d| std::ptr::fn_addr_eq(d, delete::<T> as unsafe extern "C" fn(*mut T)));
    if ours {
        // SAFETY: our deleter's tensor is the first field of an `Exported`
        // box, its manager context, alive while its unconsumed capsule is.
        let e = unsafe { &*(m.manager_ctx() as *const Exported<T>) };
        let p = e._loan.pointer();
        if p.is_stale() {
            let at = p.address();
            return Err(Error::InvalidPointer(format!(
                "the tensor's memory at {at:#x} belongs to a context that was reset"
            ))
            .into());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- export

/// What an exported tensor keeps until its deleter runs: the tensor itself
/// (first, so the capsule's pointer is this box's), its shape and strides,
/// a loan of the memory, and the exporting Python object (which keeps
/// foreign owners alive; dropped without the GIL, pyo3 defers the decref).
#[repr(C)]
struct Exported<T> {
    tensor: T,
    shape: Box<[i64]>,
    strides: Box<[i64]>,
    _loan: Loan,
    _keep: Py<PyAny>,
}

/// The deleter of an exported tensor: frees its `Exported` box.
unsafe extern "C" fn delete<T: Managed>(t: *mut T) {
    if t.is_null() {
        return;
    }
    // SAFETY: `t` is the tensor of an `Exported` box this module leaked
    // (its manager context); its deleter runs once (the protocol's
    // contract), so the box is ours.
    let exported = unsafe { (*t).manager_ctx() } as *mut Exported<T>;
    // No unwinding crosses the C boundary: a panic stops here.
    let exported = std::panic::AssertUnwindSafe(exported);
    let _ = std::panic::catch_unwind(move || {
        let exported = exported;
        // SAFETY: as above.
        drop(unsafe { Box::from_raw(exported.0) })
    });
}

/// The capsule's destructor: a capsule nobody consumed frees its tensor.
unsafe extern "C" fn destroy<T: Managed>(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: CPython calls this with the dying capsule; IsValid and
    // GetPointer with its own name set no error.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, T::NAME.as_ptr()) == 1 {
            let t = pyo3::ffi::PyCapsule_GetPointer(capsule, T::NAME.as_ptr());
            delete::<T>(t.cast());
        }
    }
}

/// Leak `tensor` with what it keeps, in an `Exported` box its deleter frees,
/// and wrap it in a capsule of its ABI (freed by the capsule unless consumed).
fn into_capsule<'py, T: Managed>(
    py: Python<'py>,
    tensor: T,
    shape: Box<[i64]>,
    strides: Box<[i64]>,
    loan: Loan,
    keep: Py<PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let b = Box::into_raw(Box::new(Exported {
        tensor,
        shape,
        strides,
        _loan: loan,
        _keep: keep,
    }));
    // SAFETY: `b` was just leaked; the capsule or its consumer frees it.
    unsafe { (*b).tensor.set_manager_ctx(b.cast()) };
    // SAFETY: `b` is a leaked `Exported` whose first field is the managed
    // tensor; the name is static; the destructor frees it unless consumed.
    let capsule =
        unsafe { pyo3::ffi::PyCapsule_New(b.cast(), T::NAME.as_ptr(), Some(destroy::<T>)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so nobody else frees the box.
        unsafe { delete::<T>(b.cast()) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, checked non-null.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// An array to export, element 0 at a MemoryPointer's address; the
/// elements may reach below it (negative strides) within its allocation.
pub(crate) struct ArraySpec {
    pub shape: Vec<usize>,
    /// In bytes; `None`: C-contiguous.
    pub strides: Option<Vec<i64>>,
    pub dtype: DLDataType,
    pub readonly: bool,
    /// The stream whose queued work may still use the memory, if any (the
    /// legacy default stream is 0).
    pub producer_stream: Option<RawStream>,
}

impl ArraySpec {
    /// A one-dimensional `uint8` array of `size` bytes.
    pub(crate) fn bytes(size: usize, producer_stream: Option<RawStream>) -> Self {
        ArraySpec {
            shape: vec![size],
            strides: None,
            dtype: DLDataType {
                code: 1,
                bits: 8,
                lanes: 1,
            },
            readonly: false,
            producer_stream,
        }
    }
}

fn buffer_error(msg: impl Into<String>) -> PyErr {
    PyBufferError::new_err(msg.into())
}

/// The consumer's `stream` argument: `None` (the legacy default stream, as
/// the protocol says), -1 (no synchronization), 1, 2 or a handle. 0 is
/// ambiguous and refused.
fn consumer_stream(stream: Option<&Bound<'_, PyAny>>) -> PyResult<Option<RawStream>> {
    let Some(s) = stream.filter(|s| !s.is_none()) else {
        return Ok(Some(crate::STREAM_LEGACY));
    };
    let handle = match s.is_instance_of::<pyo3::types::PyBool>() {
        true => Err(()), // a bool is no handle (every stream= argument refuses it)
        false => s.extract::<i64>().map_err(drop),
    };
    match handle {
        Ok(-1) => Ok(None),
        Ok(v) if v > 0 => Ok(Some(v as RawStream)),
        _ => Err(Error::InvalidArgument(format!(
            "stream must be None, -1 or a positive CUDA stream handle, got {s}"
        ))
        .into()),
    }
}

/// Export `spec` over `pointer` as a DLPack capsule, answering a consumer's
/// `__dlpack__(stream, max_version, dl_device, copy)`. The data is made
/// ready on the consumer's stream: if the memory is ordered on another
/// stream, that stream is synchronized first.
///
/// `view` is the memory of `exporter`, the Python object the tensor keeps
/// alive (it may hold the memory's foreign owner).
pub(crate) fn export<'py>(
    view: &View,
    exporter: &Bound<'py, PyAny>,
    spec: ArraySpec,
    request: Request<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let Request {
        stream,
        max_version,
        dl_device,
        copy,
    } = request;
    let py = exporter.py();
    let device = view.context().device() as i32;
    if copy == Some(true) {
        return Err(buffer_error("gpuptr exports device memory without copying"));
    }
    if let Some(d) = dl_device.filter(|d| !d.is_none()) {
        let (t, id): (i32, i32) = d.extract().map_err(|_| {
            Error::InvalidArgument(format!(
                "dl_device must be a (device type, device id) pair of C ints, got {d}"
            ))
        })?;
        if (t, id) != (DEVICE_CUDA, device) {
            return Err(buffer_error(format!(
                "the memory is on CUDA device {device}; it cannot be exported to device ({t}, {id})"
            )));
        }
    }
    let versioned = match max_version.filter(|v| !v.is_none()) {
        Some(v) => {
            let (major, _minor) = v.extract::<(u32, u32)>().map_err(|_| {
                Error::InvalidArgument(format!(
                    "max_version must be a (major, minor) pair of unsigned ints, got {v}"
                ))
            })?;
            major >= 1
        }
        None => false,
    };
    if spec.readonly && !versioned {
        return Err(buffer_error(
            "read-only memory needs a DLPack 1.x consumer (pass max_version=(1, 0) or later)",
        ));
    }
    let itemsize = usize::from(spec.dtype.bits / 8);
    let layout = Layout::new(spec.shape, spec.strides, itemsize)?;
    // Within the allocation the pointer views, from the lowest element to
    // the end of the highest.
    let lowest = (view.offset() as i64).checked_add(layout.lo);
    let fits = lowest
        .and_then(|lo| usize::try_from(lo).ok())
        .and_then(|lo| lo.checked_add(layout.span))
        .is_some_and(|end| end <= view.parent().size());
    // An empty array reaches no byte (its data pointer is null), wherever
    // its view starts: numba asks for empty views past the end.
    if !fits && layout.span != 0 {
        return Err(Error::InvalidArgument(format!(
            "the array ({} bytes, {} of them below element 0) does not fit in its allocation",
            layout.span, -layout.lo
        ))
        .into());
    }
    let strides: Box<[i64]> = layout
        .strides
        .iter()
        .map(|s| {
            (s % itemsize as i64 == 0)
                .then_some(s / itemsize as i64)
                .ok_or_else(|| buffer_error("DLPack strides count whole elements"))
        })
        .collect::<PyResult<_>>()?;
    let shape: Box<[i64]> = layout.shape.iter().map(|&n| n as i64).collect();
    // Ready on the consumer's stream: wait for the producer's, unless they
    // are one (the per-thread default stream orders nothing we can see).
    if let (Some(p), Some(c)) = (spec.producer_stream, consumer_stream(stream)?) {
        if crate::ordering_stream(c) != Some(p) {
            let ctx = view.context().clone();
            // SAFETY: `p` is the stream the memory was allocated or freed on,
            // named by its owner (`alloc(stream=…)`), or a default stream.
            py.detach(|| unsafe { ctx.stream_synchronize(p) })?;
        }
    }
    let loan = view.parent().lend()?;
    let data = if layout.span == 0 {
        std::ptr::null_mut()
    } else {
        view.address() as usize as *mut c_void
    };
    let tensor = DLTensor {
        data,
        device: DLDevice {
            device_type: DEVICE_CUDA,
            device_id: device,
        },
        ndim: shape.len() as i32,
        dtype: spec.dtype,
        shape: shape.as_ptr(),
        strides: strides.as_ptr(),
        byte_offset: 0,
    };
    let keep = exporter.clone().unbind();
    if versioned {
        let tensor = DLManagedTensorVersioned {
            version: VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DLManagedTensorVersioned>),
            flags: if spec.readonly { FLAG_READ_ONLY } else { 0 },
            dl_tensor: tensor,
        };
        into_capsule(py, tensor, shape, strides, loan, keep)
    } else {
        let tensor = DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DLManagedTensor>),
        };
        into_capsule(py, tensor, shape, strides, loan, keep)
    }
}

/// ``(device_type, device_id)`` for ``__dlpack_device__`` of memory in
/// `view`.
pub(crate) fn device_of<'py>(py: Python<'py>, view: &View) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(py, [DEVICE_CUDA, view.context().device() as i32])
}

/// A consumer's `__dlpack__` arguments.
pub(crate) struct Request<'a, 'py> {
    pub stream: Option<&'a Bound<'py, PyAny>>,
    pub max_version: Option<&'a Bound<'py, PyAny>>,
    pub dl_device: Option<&'a Bound<'py, PyAny>>,
    pub copy: Option<bool>,
}

/// ``(typestr, itemsize, DLPack code, bits)`` of an element type named as
/// numpy names it (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``).
#[pyfunction]
pub(crate) fn _dtype_info(name: &Bound<'_, PyString>) -> PyResult<(&'static str, usize, u8, u8)> {
    // Lossy: a lone surrogate (no UTF-8 has one) names no type, and is
    // refused below, not raised as `UnicodeEncodeError`.
    let name = name.to_string_lossy();
    let (dt, typestr) = dtype_named(&name).ok_or_else(|| {
        PyErr::from(Error::InvalidArgument(format!(
            "element type {name:?} is not supported (supported: {})",
            DTYPES.iter().map(|d| d.0).collect::<Vec<_>>().join(", ")
        )))
    })?;
    Ok((typestr, usize::from(dt.bits / 8), dt.code, dt.bits))
}
