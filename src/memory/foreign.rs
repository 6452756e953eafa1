//! Memory gpuptr does not own: wrapping someone else's device memory
//! (checked against what the driver knows, and registered so its context
//! resolves by address), resolving the context of any address, and the
//! device view of mapped host memory.

use std::sync::{Arc, Mutex};

use super::HostMemory;
use super::{DevicePointer, Origin, View};
use crate::context::Context;
use crate::driver::DevicePtr;
use crate::error::{Error, Result};
use crate::lifetime::KeepAlive;
use crate::registry::Registration;

impl DevicePointer {
    /// Wrap memory someone else owns. `registration` is the registry entry
    /// the wrap holds (if it added one); `keepalive` is kept until release.
    /// It is read-only when `readonly` (the exporter said so), and when any
    /// of its bytes is host memory registered from a read-only object.
    pub(crate) fn foreign(
        context: Arc<Context>,
        address: DevicePtr,
        size: usize,
        registration: Option<Registration>,
        keepalive: Option<KeepAlive>,
        readonly: bool,
    ) -> Arc<Self> {
        let readonly = readonly || context.services().read_only.overlaps(address, size);
        let mut p = DevicePointer::base(context, address, size, Origin::Foreign);
        p.readonly = readonly;
        p.registration = registration;
        p.has_keepalive = keepalive.is_some();
        p.keepalive = Mutex::new(keepalive);
        Arc::new(p)
    }

    /// The device view of mapped host memory: its operations hold `host`,
    /// and it is read-only when `host` is.
    pub(crate) fn over_host(
        context: Arc<Context>,
        address: DevicePtr,
        host: Arc<HostMemory>,
    ) -> Arc<Self> {
        let mut p = DevicePointer::base(context, address, host.size(), Origin::Foreign);
        p.readonly = host.is_readonly();
        p.host = Some(host);
        Arc::new(p)
    }
}

impl DevicePointer {
    /// The mapping of another process's allocation at `address`, `size`
    /// bytes, made by opening an IPC handle: registered, so its context
    /// resolves by address, and unmapped on release.
    pub(crate) fn ipc_mapping(
        context: &Arc<Context>,
        address: DevicePtr,
        size: usize,
    ) -> Arc<Self> {
        let reg = context.register(address, size);
        let mut p = DevicePointer::base(context.clone(), address, size, Origin::Ipc);
        p.registration = Some(reg);
        Arc::new(p)
    }
}

impl HostMemory {
    /// A device view of mapped memory; it keeps this host memory alive, and
    /// its operations hold it. Empty memory gives a null view.
    pub fn device_view(self: &Arc<Self>) -> Result<View> {
        let ctx = self.context().clone();
        if self.size() == 0 && self.is_mapped() {
            // An empty range at address 0 reaches no memory.
            return Ok(DevicePointer::foreign(ctx, 0, 0, None, None, false).view_all());
        }
        let d = self.device_address().ok_or_else(|| {
            Error::InvalidPointer("host memory is not mapped into the device".into())
        })?;
        Ok(DevicePointer::over_host(ctx, d, self.clone()).view_all())
    }
}
