//! The pointer→context registry: address ranges gpuptr knows, each with the
//! owner its memory lives in (for gpuptr, its [`Context`](crate::Context)),
//! so resolving the context of an address is a map lookup instead of a
//! driver query.
//!
//! It holds every live allocation gpuptr made and the allocation ranges of
//! live wrapped foreign pointers. An entry lives exactly as long as the
//! memory it describes is kept alive by gpuptr, so it never goes stale.
//!
//! The registry is generic over the owner type and holds it weakly: it knows
//! nothing of what uses it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::driver::DevicePtr;
use crate::sync::{read, write};

struct Entry<T> {
    end: DevicePtr,
    owner: Weak<T>,
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

/// Known address ranges and their owners.
pub(crate) struct Registry<T> {
    ranges: RwLock<BTreeMap<DevicePtr, Entry<T>>>,
    next_token: AtomicU64,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            ranges: RwLock::new(BTreeMap::new()),
            next_token: AtomicU64::new(0),
        }
    }
}

impl<T> Registry<T> {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Record `[start, start+size)` as memory of `owner`. The same range
    /// registered again (two wraps of one foreign buffer) shares one entry.
    pub fn insert(&self, start: DevicePtr, size: usize, owner: &Arc<T>) -> Registration {
        self.insert_weak(start, size, &Arc::downgrade(owner))
    }

    /// [`Registry::insert`] for an owner held weakly (the pool's growth
    /// helper, which must not keep a context alive past its last user).
    pub fn insert_weak(&self, start: DevicePtr, size: usize, owner: &Weak<T>) -> Registration {
        let end = start + size as u64;
        let mut map = write(&self.ranges);
        if let Some(e) = map.get_mut(&start) {
            if e.end == end && Weak::ptr_eq(&e.owner, owner) {
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
                owner: owner.clone(),
                token,
                refs: 1,
            },
        );
        Registration { start, token }
    }

    /// Drop one reference to a registration.
    pub fn remove(&self, reg: Registration) {
        let mut map = write(&self.ranges);
        if let Some(e) = map.get_mut(&reg.start) {
            if e.token == reg.token {
                e.refs -= 1;
                if e.refs == 0 {
                    map.remove(&reg.start);
                }
            }
        }
    }

    /// Drop one reference to each entry at `starts`: for memory whose
    /// registrations its holder does not keep (the pool's blocks). Sound
    /// where the holder alone registers those addresses, and unregisters
    /// them before the memory goes back to the driver: no newer entry can be
    /// at them yet.
    pub fn remove_at(&self, starts: impl IntoIterator<Item = DevicePtr>) {
        let mut map = write(&self.ranges);
        for start in starts {
            if let Some(e) = map.get_mut(&start) {
                e.refs -= 1;
                if e.refs == 0 {
                    map.remove(&start);
                }
            }
        }
    }

    /// The owner of the known range containing `address`, if any.
    #[inline]
    pub fn lookup(&self, address: DevicePtr) -> Option<Arc<T>> {
        self.lookup_range(address).map(|(owner, _, _)| owner)
    }

    /// The owner and the range `[start, end)` of the known range containing
    /// `address`, if any.
    #[inline]
    pub fn lookup_range(&self, address: DevicePtr) -> Option<(Arc<T>, DevicePtr, DevicePtr)> {
        let map = read(&self.ranges);
        let (start, e) = map.range(..=address).next_back()?;
        if address < e.end {
            Some((e.owner.upgrade()?, *start, e.end))
        } else {
            None
        }
    }

    /// Number of registered ranges.
    pub fn len(&self) -> usize {
        read(&self.ranges).len()
    }
}
