//! The pointer→context registry: address ranges gpuptr knows, each with the
//! context its memory lives in, so resolving the context of an address is a
//! map lookup instead of a driver query.
//!
//! It holds every live allocation gpuptr made and the allocation ranges of
//! live wrapped foreign pointers. An entry lives exactly as long as the
//! memory it describes is kept alive by gpuptr, so it never goes stale.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::context::Context;
use crate::driver::DevicePtr;

struct Entry {
    end: DevicePtr,
    context: Weak<Context>,
    token: u64,
    refs: usize,
}

/// A registration, returned by [`Registry::insert`] and given back to
/// [`Registry::remove`]. Removal with an old token never removes a newer entry
/// at the same address.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Registration {
    start: DevicePtr,
    token: u64,
}

/// Known address ranges and their contexts.
#[derive(Default)]
pub(crate) struct Registry {
    ranges: RwLock<BTreeMap<DevicePtr, Entry>>,
    next_token: AtomicU64,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Record `[start, start+size)` as memory of `context`. The same range
    /// registered again (two wraps of one foreign buffer) shares one entry.
    pub fn insert(&self, start: DevicePtr, size: usize, context: &Arc<Context>) -> Registration {
        self.insert_weak(start, size, &Arc::downgrade(context))
    }

    /// [`Registry::insert`] for a context held weakly (the pool's growth
    /// helper, which must not keep a context alive past its last user).
    pub fn insert_weak(
        &self,
        start: DevicePtr,
        size: usize,
        context: &Weak<Context>,
    ) -> Registration {
        let end = start + size as u64;
        let mut map = self.ranges.write().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = map.get_mut(&start) {
            if e.end == end && Weak::ptr_eq(&e.context, context) {
                e.refs += 1;
                return Registration {
                    start,
                    token: e.token,
                };
            }
        }
        // A different entry at this start is stale (its memory was freed
        // behind gpuptr's back): the new one replaces it.
        let token = self.next_token.fetch_add(1, Ordering::Relaxed) + 1;
        map.insert(
            start,
            Entry {
                end,
                context: context.clone(),
                token,
                refs: 1,
            },
        );
        Registration { start, token }
    }

    /// Drop one reference to a registration.
    pub fn remove(&self, reg: Registration) {
        let mut map = self.ranges.write().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = map.get_mut(&reg.start) {
            if e.token == reg.token {
                e.refs -= 1;
                if e.refs == 0 {
                    map.remove(&reg.start);
                }
            }
        }
    }

    /// The context of the known range containing `address`, if any.
    #[inline]
    pub fn lookup(&self, address: DevicePtr) -> Option<Arc<Context>> {
        self.lookup_range(address).map(|(ctx, _, _)| ctx)
    }

    /// The context and the range `[start, end)` of the known range containing
    /// `address`, if any.
    #[inline]
    pub fn lookup_range(&self, address: DevicePtr) -> Option<(Arc<Context>, DevicePtr, DevicePtr)> {
        let map = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        let (start, e) = map.range(..=address).next_back()?;
        if address < e.end {
            Some((e.context.upgrade()?, *start, e.end))
        } else {
            None
        }
    }

    /// Number of registered ranges.
    pub fn len(&self) -> usize {
        self.ranges.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}
