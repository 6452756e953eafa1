//! The runtime's IPC state and its two calls: exporting memory as an
//! [`IpcHandle`] and opening one (see [`crate::ipc`] for what a handle is
//! and how freed memory is caught).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use super::Runtime;
use crate::driver::IpcMemHandle;
use crate::error::{Error, Result};
use crate::ipc::liveness::{check_alive, process_token};
use crate::ipc::{IpcHandle, NO_SLOT};
use crate::memory::{DevicePointer, Origin, View};
use crate::sync::lock;

/// The runtime's IPC state: what this process exported (for opens in this
/// process) and what it opened (one mapping per handle).
#[derive(Default)]
pub(crate) struct Ipc {
    exports: Mutex<Exported>,
    /// Driver handle -> the mapping made by opening it.
    opened: Mutex<HashMap<IpcMemHandle, Weak<DevicePointer>>>,
}

/// Export number -> the exported memory and its offset in its driver
/// allocation. Entries of released memory go at the sweep after the map
/// doubles: constant cost per export.
#[derive(Default)]
struct Exported {
    by_number: HashMap<u64, (Weak<DevicePointer>, usize)>,
    sweep_at: usize,
}

impl Exported {
    fn remember(&mut self, number: u64, memory: &Arc<DevicePointer>, start: usize) {
        if self.by_number.contains_key(&number) {
            return;
        }
        if self.by_number.len() >= self.sweep_at {
            self.by_number.retain(|_, (w, _)| w.strong_count() > 0);
            self.sweep_at = (2 * self.by_number.len()).max(1024);
        }
        self.by_number
            .insert(number, (Arc::downgrade(memory), start));
    }
}

/// `[offset, offset+size)` of `handle` as an offset in memory of `len`
/// bytes at `start` (in the same driver allocation), if it lies inside.
fn inside(handle: &IpcHandle, start: usize, len: usize) -> Result<usize> {
    handle
        .offset
        .checked_sub(start)
        .filter(|at| at.checked_add(handle.size).is_some_and(|end| end <= len))
        .ok_or_else(|| {
            Error::InvalidPointer(format!(
                "the IPC handle's [{}, +{}) runs outside the memory it names ([{start}, +{len}))",
                handle.offset, handle.size
            ))
        })
}

impl Runtime {
    /// A handle another process can open to use `view`'s memory. The memory
    /// must be device memory gpuptr allocated (pool or driver), not managed,
    /// host or foreign memory. An empty view gives a handle that opens to
    /// an empty view of the same allocation.
    pub fn ipc_export(self: &Arc<Self>, view: &View) -> Result<IpcHandle> {
        crate::fork::check()?;
        let parent = view.parent();
        parent.check_live()?;
        if !matches!(parent.origin(), Origin::Driver | Origin::Pool(_))
            || parent.is_managed()
            || parent.address() == 0
        {
            return Err(Error::InvalidArgument(
                "only device memory gpuptr allocated (not managed, host, foreign or empty memory) can be shared with another process".into(),
            ));
        }
        // Held until the export is recorded: a free meanwhile leaves the
        // release (which clears the record) to the end of this use.
        let _use = parent.begin_use()?;
        let ctx = view.context();
        // The allocation's own address: a view's may be its end, which is
        // the next allocation's start.
        let attrs = self.driver().pointer_attributes(parent.address())?;
        let range_end = attrs.range_start.saturating_add(attrs.range_size as u64);
        let start = parent
            .address()
            .checked_sub(attrs.range_start)
            .filter(|_| parent.address() + parent.size() as u64 <= range_end)
            .ok_or_else(|| {
                Error::InvalidPointer(format!("{:#x} is in no allocation", parent.address()))
            })? as usize;
        // SAFETY: `range_start` starts the live driver allocation that holds
        // this live gpuptr memory, in its context.
        let handle = unsafe { self.driver().ipc_get_handle(ctx.raw(), attrs.range_start)? };
        parent.mark_exported();
        let export = self
            .services()
            .exports
            .export(parent.export_key(), start, parent.size());
        if export.slot == NO_SLOT {
            // Without a record, another process could open a pool block after
            // it was freed and reused, and read its next owner's bytes; and
            // nothing would bound an altered handle to the allocation.
            return Err(Error::InvalidArgument(
                "device memory is shared only with a liveness record, and none is left (65536 allocations exported and live at once, or no /dev/shm)".into(),
            ));
        }
        lock(&self.ipc().exports).remember(export.number, parent, start);
        // An empty view may lie past the end: its handle names the end.
        let offset = start + view.offset().min(parent.size());
        Ok(IpcHandle {
            device: ctx.device(),
            handle,
            offset,
            size: view.size(),
            pid: std::process::id(),
            process: process_token(),
            export: export.number,
            slot: export.slot,
        })
    }

    /// The memory `handle` names. In the exporting process: the original
    /// memory, or `InvalidPointer` if it was freed. Elsewhere: the mapping
    /// of the exporter's allocation (made once per handle in this process,
    /// unmapped when its last view goes), or the driver's error for a
    /// handle whose allocation is gone. A handle whose range runs outside
    /// the exported allocation, or outside the driver's range of the
    /// mapping, is `InvalidPointer`.
    pub fn ipc_open(self: &Arc<Self>, handle: &IpcHandle) -> Result<View> {
        crate::fork::check()?;
        self.check_device(handle.device)?;
        let ipc = self.ipc();
        if handle.process == process_token() {
            let found = lock(&ipc.exports).by_number.get(&handle.export).cloned();
            let freed = || {
                Error::InvalidPointer(
                    "the memory this IPC handle names was freed by this process, which exported it"
                        .into(),
                )
            };
            let (weak, start) = found.ok_or_else(freed)?;
            let parent = weak.upgrade().filter(|p| !p.is_freed() && !p.is_stale());
            let parent = parent.ok_or_else(freed)?;
            if parent.context().device() != handle.device {
                return Err(Error::InvalidPointer(format!(
                    "this IPC handle names device {}, and its memory is on device {}",
                    handle.device,
                    parent.context().device()
                )));
            }
            let at = inside(handle, start, parent.size())?;
            return parent.view_all().view(at, Some(at + handle.size));
        }
        // Before mapping: memory freed, or an exporter gone, is never mapped,
        // and the handle stays inside the allocation its record bounds.
        let (start, len) = check_alive(handle)?;
        inside(handle, start, len)?;
        let ctx = self.context(handle.device)?;
        let mut opened = lock(&ipc.opened);
        let mapping = match opened.get(&handle.handle).and_then(Weak::upgrade) {
            Some(m) if !m.is_freed() && !m.is_stale() => m,
            _ => {
                // SAFETY: `ctx` is retained; the handle is data the driver
                // validates.
                let base = unsafe { self.driver().ipc_open_handle(ctx.raw(), &handle.handle)? };
                // The driver's own range bounds the mapping, never the handle.
                let range = match self.driver().pointer_attributes(base) {
                    Ok(a) if a.range_start == base && a.range_size > 0 => Ok(a.range_size),
                    Ok(_) => Err(Error::InvalidPointer(format!(
                        "the driver knows no range for the IPC mapping at {base:#x}"
                    ))),
                    Err(e) => Err(e),
                };
                let size = match range {
                    Ok(size) => size,
                    Err(e) => {
                        // SAFETY: `base` was just mapped in `ctx`, and nothing
                        // uses it.
                        let _ = unsafe { self.driver().ipc_close_handle(ctx.raw(), base) };
                        return Err(e);
                    }
                };
                let m = DevicePointer::ipc_mapping(&ctx, base, size);
                opened.retain(|_, w| w.strong_count() > 0);
                opened.insert(handle.handle, Arc::downgrade(&m));
                m
            }
        };
        drop(opened);
        let at = inside(handle, 0, mapping.size())?;
        // And after: memory freed while it was being mapped is caught too,
        // so only memory freed after this open is the importer's to mind.
        check_alive(handle)?;
        mapping.view_all().view(at, Some(at + handle.size))
    }
}
