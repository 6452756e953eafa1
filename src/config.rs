//! Every `GPUPTR_*` environment variable, read in this one place.
//!
//! | variable | read by | meaning |
//! |---|---|---|
//! | `GPUPTR_DRIVER` | [`Runtime::global`](crate::Runtime::global) | `auto` (default), `cuda` or `sim` |
//! | `GPUPTR_SIM_DEVICES` | the simulator | its device count (default 1) |
//! | `GPUPTR_SIM_MEMORY` | the simulator | bytes per device (default 1 GiB) |
//! | `GPUPTR_POOL` | the global runtime | `0` or `off`: no caching pool |
//! | `GPUPTR_POOL_AHEAD` | the global runtime | bytes grown ahead per class ([`PoolConfig::ahead_bytes`](crate::PoolConfig::ahead_bytes)); 0 turns it off |
//! | `GPUPTR_TRACK` | the global runtime | `1` or `on`: the leak report from the start |
//!
//! The Python package reads its own (`GPUPTR_LOG`, the CLI's choices) in
//! Python; nothing in the crate reads the environment but this file.

use crate::error::{Error, Result};

/// `GPUPTR_DRIVER`.
pub(crate) const DRIVER: &str = "GPUPTR_DRIVER";
/// `GPUPTR_SIM_DEVICES`.
pub(crate) const SIM_DEVICES: &str = "GPUPTR_SIM_DEVICES";
/// `GPUPTR_SIM_MEMORY`.
pub(crate) const SIM_MEMORY: &str = "GPUPTR_SIM_MEMORY";
/// `GPUPTR_POOL`.
pub(crate) const POOL: &str = "GPUPTR_POOL";
/// `GPUPTR_POOL_AHEAD`.
pub(crate) const POOL_AHEAD: &str = "GPUPTR_POOL_AHEAD";
/// `GPUPTR_TRACK`.
pub(crate) const TRACK: &str = "GPUPTR_TRACK";

/// The text of `name` (empty when unset or not Unicode).
pub(crate) fn text(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

/// A non-negative integer setting from `name` (`default` when unset or
/// blank); a bad value is an [`Error::InvalidArgument`] that names it.
pub(crate) fn usize_or(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("{name}={v:?} is not a non-negative integer"))
        }),
        _ => Ok(default),
    }
}

/// Whether `name` is `1` or `on`.
pub(crate) fn on(name: &str) -> bool {
    matches!(text(name).as_str(), "1" | "on")
}

/// Whether `name` is `0` or `off`.
pub(crate) fn off(name: &str) -> bool {
    matches!(text(name).as_str(), "0" | "off")
}
