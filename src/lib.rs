//! # gpuptr
//!
//! Refcounted CUDA contexts and device pointers. Every pointer holds a real,
//! retained primary context (`Arc<Context>`), and a view holds its parent
//! allocation, so no holder can outlive what it points into.
//!
//! Calls flow one way, down one line of rooms (`src/README.md` says what
//! each owns, and a test checks that no room names one above it):
//! - the binding, `python` (feature `python`): the PyO3 module `gpuptr._core`;
//!   the Python package `gpuptr` (in `python/`) sits above it, outside this crate;
//! - [`Runtime`]: the façade, each device's context slot, the pointer→context
//!   lookups and wraps, IPC, and the allocations other libraries' allocator
//!   interfaces hold ([`Runtime::hand_out`]);
//! - memory: [`DevicePointer`], [`View`], [`HostMemory`], and what a context
//!   allocates ([`Context::alloc`] and its kin);
//! - [`Context`]: a retained primary context, a thin refcounted handle;
//! - the device: one owner per device of its pool, reset epoch, counters,
//!   graph memory and out-of-memory ladder, which knows no context type;
//! - the per-device caching pool;
//! - [`driver`]: the only code that calls CUDA, behind the [`Driver`] trait,
//!   with a real implementation ([`CudaDriver`], cudarc loaded dynamically)
//!   and a simulator ([`SimDriver`]);
//!
//! with the shared vocabulary (errors, sizes, statistics, the registry,
//! the history) under all of them. No Python below the binding.
//!
//! ```no_run
//! use gpuptr::Runtime;
//! let rt = Runtime::global()?;          // GPUPTR_DRIVER=auto|cuda|sim
//! let ctx = rt.context(0)?;             // retains device 0's primary context
//! let mem = ctx.alloc(1 << 20)?;        // Arc<DevicePointer>
//! let half = mem.view_all().view(0, Some(1 << 19))?;
//! half.memset(0xab, None)?;
//! assert_eq!(rt.context_of(half.address())?.device(), 0);
//! # Ok::<(), gpuptr::Error>(())
//! ```

#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

// The floor: errors, settings, locks, fork detection, and the driver.
mod config;
pub mod driver;
mod error;
mod fork;
pub mod log_queue;
mod sync;

// The vocabulary shared by every room above.
mod layout;
mod lifetime;
pub mod sizes;
mod stats;

// The services a device holds, and the pool.
mod graph;
pub mod history;
mod ipc;
mod pool;
mod registry;
mod snapshot;
mod track;

// One owner per device, its context, and the memory made in it (each
// using only the ones before it).
mod context;
mod device;
mod memory;

// The top: the façade Rust users and the binding call.
mod runtime;

#[cfg(feature = "python")]
mod python;

pub use context::Context;
pub use driver::{
    CallKind, CaptureMode, CudaDriver, DevicePtr, Driver, DriverKind, RawContext, RawStream,
    SimConfig, SimDriver, SimGraph, STREAM_LEGACY, STREAM_PER_THREAD,
};
pub use error::{cuda_error_name, Error, Result};
pub use fork::forked;
pub use ipc::IpcHandle;
pub use layout::{typestr_itemsize, Layout};
pub use lifetime::KeepAlive;
pub use memory::{
    ordering_stream, DevicePointer, HostFlags, HostKind, HostMemory, Loan, Origin, View,
};
pub use pool::{size_class, PoolConfig};
pub use runtime::{PoolId, Runtime};
pub use snapshot::{BlockState, Segment, Snapshot, SnapshotBlock};
pub use stats::{
    ByPool, ClassStats, Client, ClientStats, DeviceStats, HostStats, LibraryStats, MemPoolStats,
    SegmentStats, Stat,
};
pub use track::{Frame, Outstanding, Site};

/// `CUresult` codes gpuptr refers to by name.
pub mod codes {
    pub use crate::error::{
        CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE,
        CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILED,
        CUDA_ERROR_MAP_FAILED, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_READY,
        CUDA_ERROR_NO_DEVICE, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, CUDA_ERROR_UNKNOWN,
    };
}
