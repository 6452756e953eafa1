//! Every `GPUPTR_*` environment variable, read in this one place.
//!
//! | variable | read by | meaning |
//! |---|---|---|
//! | `GPUPTR_DRIVER` | [`Runtime::global`](crate::Runtime::global) | `auto` (default), `cuda` or `sim` |
//! | `GPUPTR_SIM_DEVICES` | the simulator | its device count (default 1) |
//! | `GPUPTR_SIM_MEMORY` | the simulator | each device's size in bytes (`4GiB`; default 1 GiB); no share, as there is no device to take one of |
//! | `GPUPTR_POOL` | the global runtime | a switch: off (`0`, `off`, `false`, `no`) means no caching pool |
//! | `GPUPTR_POOL_HEADROOM` | the global runtime | the least the pool holds before a miss of memory freed without a stream waits for a fence rather than grow ([`PoolConfig::headroom_bytes`](crate::PoolConfig::headroom_bytes)); default 32 MiB |
//! | `GPUPTR_POOL_AHEAD` | the global runtime | the most a busy GPU's growth, and growth ahead, add for memory freed without a stream ([`PoolConfig::ahead_bytes`](crate::PoolConfig::ahead_bytes)); 0 turns it off |
//! | `GPUPTR_HOST_CACHE` | the global runtime | the most pinned host memory the pool caches ([`PoolConfig::host_cache_bytes`](crate::PoolConfig::host_cache_bytes)); 0 turns the host cache off |
//! | `GPUPTR_TRACK` | the global runtime | a switch: on (`1`, `on`, `true`, `yes`) means the leak report from the start |
//! | `GPUPTR_HISTORY` | the global runtime | a switch: on means the allocation history from the start ([`crate::history`]) |
//! | `GPUPTR_OOM_SNAPSHOT` | the global runtime | a path: on out of memory, a memory snapshot is written there ([`Runtime::set_oom_snapshot`](crate::Runtime::set_oom_snapshot)) |
//!
//! Sizes are read by [`crate::sizes::parse`] (`"1GiB"`, `"512M"`,
//! `1073741824`); switches by [`crate::sizes::switch`]. A bad value is an
//! error that names the variable, never a silent default; so is a value
//! that is no UTF-8 text, but for the path `GPUPTR_OOM_SNAPSHOT`, which is
//! taken as the bytes it is (a Linux path need not be UTF-8).
//!
//! The Python package's CLI reads `GPUPTR_DRIVER` too, to say what a bad
//! value is before the crate loads; records go to Python's `logging` under
//! `gpuptr`, set up as any logger is. Nothing in the crate reads the
//! environment but this file.

use crate::error::{Error, Result};

/// `GPUPTR_DRIVER`.
pub(crate) const DRIVER: &str = "GPUPTR_DRIVER";
/// `GPUPTR_SIM_DEVICES`.
pub(crate) const SIM_DEVICES: &str = "GPUPTR_SIM_DEVICES";
/// `GPUPTR_SIM_MEMORY`.
pub(crate) const SIM_MEMORY: &str = "GPUPTR_SIM_MEMORY";
/// `GPUPTR_POOL`.
pub(crate) const POOL: &str = "GPUPTR_POOL";
/// `GPUPTR_POOL_HEADROOM`.
pub(crate) const POOL_HEADROOM: &str = "GPUPTR_POOL_HEADROOM";
/// `GPUPTR_POOL_AHEAD`.
pub(crate) const POOL_AHEAD: &str = "GPUPTR_POOL_AHEAD";
/// `GPUPTR_HOST_CACHE`.
pub(crate) const HOST_CACHE: &str = "GPUPTR_HOST_CACHE";
/// `GPUPTR_TRACK`.
pub(crate) const TRACK: &str = "GPUPTR_TRACK";
/// `GPUPTR_HISTORY`.
pub(crate) const HISTORY: &str = "GPUPTR_HISTORY";
/// `GPUPTR_OOM_SNAPSHOT`.
pub(crate) const OOM_SNAPSHOT: &str = "GPUPTR_OOM_SNAPSHOT";

/// The text of `name` (empty when unset). A value that is no UTF-8 text
/// is an [`Error::InvalidArgument`] that names it, never read as unset.
pub(crate) fn text(name: &str) -> Result<String> {
    match std::env::var(name) {
        Ok(v) => Ok(v),
        Err(std::env::VarError::NotPresent) => Ok(String::new()),
        Err(std::env::VarError::NotUnicode(raw)) => Err(Error::InvalidArgument(format!(
            "{name}={raw:?} is not UTF-8 text"
        ))),
    }
}

/// A path from `name` (`None` when unset or blank), as the bytes it is:
/// a Linux path need not be UTF-8.
pub(crate) fn path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.as_encoded_bytes().trim_ascii().is_empty())
        .map(Into::into)
}

/// A non-negative integer setting from `name` (`default` when unset or
/// blank); a bad value is an [`Error::InvalidArgument`] that names it.
pub(crate) fn usize_or(name: &str, default: usize) -> Result<usize> {
    let v = text(name)?;
    if v.trim().is_empty() {
        return Ok(default);
    }
    v.trim()
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer")))
}

/// A size in bytes from `name` (`default` when unset or blank), as
/// [`crate::sizes::parse_bytes`] reads it: a share of the device is refused
/// here (these sizes are not per device), and no hint offers one.
pub(crate) fn size_or(name: &str, default: usize) -> Result<usize> {
    let v = text(name)?;
    if v.trim().is_empty() {
        return Ok(default);
    }
    crate::sizes::parse_bytes(&v, name)
}

/// A switch from `name` (`default` when unset or blank), as
/// [`crate::sizes::switch`] reads it.
pub(crate) fn switch_or(name: &str, default: bool) -> Result<bool> {
    Ok(crate::sizes::switch(&text(name)?, name)?.unwrap_or(default))
}
