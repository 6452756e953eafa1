//! Before any other call: [`probe`] checks that libcuda loads and is new
//! enough (cudarc panics where it is missing); and [`guard`], which runs
//! every FFI call under `catch_unwind`, so that a panic becomes
//! [`Error::Panic`], never an unwind.

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::error::{Error, Result, CUDA_ERROR_NO_DEVICE};

/// The oldest driver API gpuptr's bindings (cudarc `cuda-12000`) are built for.
const MIN_DRIVER_VERSION: i32 = 12000;

const NO_DRIVER_HINT: &str =
    "install the NVIDIA driver (libcuda.so.1 must be on the loader path), \
or set GPUPTR_DRIVER=sim to run on gpuptr's simulator";

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn cuda_error(call: &'static str, e: DriverError) -> Error {
    // The enum's Debug is the CUresult's name, e.g. CUDA_ERROR_OUT_OF_MEMORY.
    Error::cuda(call, e.0 as i32, format!("{:?}", e.0))
}

/// A query's answer: `CUDA_ERROR_NOT_READY` means "not done yet", not failure.
pub(super) fn done(r: Result<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(Error::Cuda { code, .. }) if code == crate::error::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(e),
    }
}

/// Run one FFI call; a panic inside it is caught and returned as an error.
#[inline]
pub(super) fn guard<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(cuda_error(call, e)),
        Err(payload) => Err(Error::Panic(format!("{call}: {}", panic_message(payload)))),
    }
}

/// Check that libcuda loads, initialises and is new enough, and return the
/// driver version. The answer is computed once per process.
pub fn probe() -> Result<i32> {
    static PROBE: OnceLock<Result<i32>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: only loads the library and resolves symbols; a panic
            // (missing symbol) is caught.
            let found = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
            if !found {
                return Err(Error::NoDriver(format!(
                    "libcuda was not found; {NO_DRIVER_HINT}"
                )));
            }
            match guard("cuInit", result::init) {
                Ok(()) => {}
                Err(Error::Cuda { code, name, .. }) if code == CUDA_ERROR_NO_DEVICE => {
                    return Err(Error::NoDriver(format!(
                        "cuInit found no CUDA device ({name}); {NO_DRIVER_HINT}"
                    )))
                }
                Err(e) => return Err(Error::NoDriver(format!("{e}; {NO_DRIVER_HINT}"))),
            }
            let mut version: c_int = 0;
            // SAFETY: the out-pointer is a live local.
            guard("cuDriverGetVersion", || unsafe {
                sys::cuDriverGetVersion(&mut version).result()
            })
            .map_err(|e| Error::NoDriver(format!("{e}; {NO_DRIVER_HINT}")))?;
            if version < MIN_DRIVER_VERSION {
                return Err(Error::NoDriver(format!(
                    "the driver supports CUDA {}.{}, gpuptr needs 12.0 or newer; {NO_DRIVER_HINT}",
                    version / 1000,
                    (version % 1000) / 10
                )));
            }
            Ok(version)
        })
        .clone()
}
