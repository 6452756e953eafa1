//! One error enum for the whole crate. The binding maps each variant to one
//! Python exception class (`gpuptr.GpuptrError` and its subclasses).

use thiserror::Error;

/// `CUDA_ERROR_INVALID_VALUE`
pub const CUDA_ERROR_INVALID_VALUE: i32 = 1;
/// `cuMemHostRegister` of a range that overlaps one already registered.
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: i32 = 712;
/// `CUDA_ERROR_OUT_OF_MEMORY`
pub const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`
pub const CUDA_ERROR_NOT_INITIALIZED: i32 = 3;
/// `CUDA_ERROR_DEINITIALIZED`
pub const CUDA_ERROR_DEINITIALIZED: i32 = 4;
/// `CUDA_ERROR_NO_DEVICE`
pub const CUDA_ERROR_NO_DEVICE: i32 = 100;
/// `CUDA_ERROR_INVALID_DEVICE`
pub const CUDA_ERROR_INVALID_DEVICE: i32 = 101;
/// `CUDA_ERROR_INVALID_CONTEXT`
pub const CUDA_ERROR_INVALID_CONTEXT: i32 = 201;
/// `CUDA_ERROR_MAP_FAILED`
pub const CUDA_ERROR_MAP_FAILED: i32 = 205;
/// `CUDA_ERROR_INVALID_HANDLE`
pub const CUDA_ERROR_INVALID_HANDLE: i32 = 400;
/// `CUDA_ERROR_NOT_READY`
pub const CUDA_ERROR_NOT_READY: i32 = 600;
/// `CUDA_ERROR_LAUNCH_FAILED`
pub const CUDA_ERROR_LAUNCH_FAILED: i32 = 719;
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: a call not allowed while a
/// stream captures.
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: the capture was invalidated by
/// an earlier error.
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: i32 = 901;
/// `CUDA_ERROR_UNKNOWN`
pub const CUDA_ERROR_UNKNOWN: i32 = 999;

/// Name of a `CUresult` code, for the codes the simulator can produce and
/// the common ones; the CUDA driver path names every code through cudarc.
pub fn cuda_error_name(code: i32) -> &'static str {
    match code {
        0 => "CUDA_SUCCESS",
        CUDA_ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
        CUDA_ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
        CUDA_ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
        CUDA_ERROR_DEINITIALIZED => "CUDA_ERROR_DEINITIALIZED",
        CUDA_ERROR_NO_DEVICE => "CUDA_ERROR_NO_DEVICE",
        CUDA_ERROR_INVALID_DEVICE => "CUDA_ERROR_INVALID_DEVICE",
        CUDA_ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
        CUDA_ERROR_MAP_FAILED => "CUDA_ERROR_MAP_FAILED",
        CUDA_ERROR_INVALID_HANDLE => "CUDA_ERROR_INVALID_HANDLE",
        CUDA_ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
        CUDA_ERROR_LAUNCH_FAILED => "CUDA_ERROR_LAUNCH_FAILED",
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        CUDA_ERROR_UNKNOWN => "CUDA_ERROR_UNKNOWN",
        _ => "CUDA_ERROR_OTHER",
    }
}

/// Every failure gpuptr reports.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    /// No usable CUDA driver (libcuda missing, too old, no device, or an
    /// unknown `GPUPTR_DRIVER`). The message carries a hint.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// A driver call failed with a `CUresult`.
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        /// The driver function, e.g. `"cuMemAlloc"`.
        call: &'static str,
        /// The `CUresult`.
        code: i32,
        /// Its name, e.g. `"CUDA_ERROR_OUT_OF_MEMORY"`.
        name: String,
    },
    /// The device (or the pool in front of it) cannot satisfy a request.
    #[error("out of memory on device {device}: could not allocate {} ({requested} bytes){detail}", crate::error::bytes(*requested))]
    OutOfMemory {
        /// The device ordinal.
        device: usize,
        /// The bytes asked for.
        requested: usize,
        /// What the pool and the device held when it failed (empty, or
        /// starting with "; ").
        detail: String,
    },
    /// A pointer that is freed, stale, out of range or not device memory.
    #[error("invalid pointer: {0}")]
    InvalidPointer(String),
    /// An argument with a bad value (negative size, unknown device, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Memory that cannot be freed now: buffer exports of it are alive.
    #[error("{0}")]
    BufferExported(String),
    /// The host cannot give the bytes a copy needs.
    #[error("out of host memory: could not allocate {0} bytes")]
    HostOutOfMemory(usize),
    /// A panic caught at an FFI edge; it never unwinds further.
    #[error("internal error (caught panic): {0}")]
    Panic(String),
}

impl Error {
    /// A driver failure for `call` with code `code`, named with `name`.
    pub fn cuda(call: &'static str, code: i32, name: impl Into<String>) -> Self {
        Error::Cuda {
            call,
            code,
            name: name.into(),
        }
    }

    /// The `CUresult` code, where there is one.
    pub fn cuda_code(&self) -> Option<i32> {
        match self {
            Error::Cuda { code, .. } => Some(*code),
            Error::OutOfMemory { .. } => Some(CUDA_ERROR_OUT_OF_MEMORY),
            _ => None,
        }
    }

    /// Whether this is an out-of-memory condition (worth a release-and-retry).
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. } | Error::HostOutOfMemory(_))
            || matches!(self, Error::Cuda { code, .. } if *code == CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Turn a raw `CUDA_ERROR_OUT_OF_MEMORY` into the typed variant.
    /// `Ok` unless `size` is past the largest request any allocation can
    /// meet (`isize::MAX` bytes, Rust's own bound and the Python binding's):
    /// such a size is out of memory at once, before any size class (whose
    /// rounding would overflow) or counter sees it.
    pub(crate) fn check_request(device: usize, size: usize) -> Result<()> {
        if size > isize::MAX as usize {
            return Err(Error::OutOfMemory {
                device,
                requested: size,
                detail: "; no allocation can be larger than isize::MAX bytes".into(),
            });
        }
        Ok(())
    }

    pub(crate) fn oom_on(self, device: usize, requested: usize) -> Self {
        if self.is_oom() {
            Error::OutOfMemory {
                device,
                requested,
                detail: String::new(),
            }
        } else {
            self
        }
    }
}

/// `n` bytes for a person: "1.50 GiB", "512 bytes".
pub(crate) fn bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} bytes");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Ok` if `device` is one of the `count` devices present, else the
/// [`Error::InvalidArgument`] that says so (the one message for every
/// device check: the drivers' and the runtime's).
pub(crate) fn check_device(device: usize, count: usize) -> Result<()> {
    if device >= count {
        return Err(Error::InvalidArgument(format!(
            "device {device} does not exist ({count} device(s) present)"
        )));
    }
    Ok(())
}
