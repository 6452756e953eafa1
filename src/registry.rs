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
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::driver::DevicePtr;
use crate::sync::{read, write};

struct Entry<T: ?Sized> {
    end: DevicePtr,
    owner: Weak<T>,
    token: NonZeroU64,
    refs: usize,
}

/// A registration, returned by [`Registry::insert_weak`] and given back to
/// [`Registry::remove`]. Removal with an old token never removes a newer entry
/// at the same address.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Registration {
    start: DevicePtr,
    /// Never zero, so that an `Option<Registration>` takes two words.
    token: NonZeroU64,
}

/// Known address ranges and their owners.
pub(crate) struct Registry<T: ?Sized> {
    ranges: RwLock<BTreeMap<DevicePtr, Entry<T>>>,
    next_token: AtomicU64,
}

impl<T: ?Sized> Default for Registry<T> {
    fn default() -> Self {
        Registry {
            ranges: RwLock::new(BTreeMap::new()),
            next_token: AtomicU64::new(0),
        }
    }
}

impl<T: ?Sized> Registry<T> {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Record `[start, start+size)` as memory of `owner`, held weakly (an
    /// entry never keeps a context alive past its last user). The same
    /// range registered again for the same owner (two wraps of one foreign
    /// buffer) shares one entry.
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
        let token = NonZeroU64::MIN.saturating_add(self.next_token.fetch_add(1, Ordering::Relaxed));
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

/// Address ranges that must not be written through gpuptr's pointers: the
/// host memory registered from read-only objects, at its host address and,
/// when mapped, at its device address. A pointer or host object made over
/// any byte of one is read-only too, whichever route made it (a wrap of the
/// device address, a CUDA Array Interface or DLPack import, numba's
/// constructor shapes). Kept apart from [`Registry`] (which maps addresses
/// to owners), so that the common case, no read-only range at all, costs
/// one relaxed load.
#[derive(Default)]
pub(crate) struct ReadOnlyRanges {
    /// How many ranges are marked (the fast path: none).
    count: AtomicU64,
    /// `(start, end)` → how many marks it has (a mapped range whose host and
    /// device addresses are one is marked twice).
    ranges: RwLock<BTreeMap<(u64, u64), usize>>,
    /// The longest range marked, so that a lookup scans only the ranges that
    /// start close enough to reach the address asked about.
    longest: AtomicU64,
}

impl ReadOnlyRanges {
    /// Mark `[start, start+size)` read-only (nothing for an empty range).
    pub fn mark(&self, start: u64, size: usize) {
        let Some(end) = start.checked_add(size as u64).filter(|_| size != 0) else {
            return;
        };
        let mut map = write(&self.ranges);
        *map.entry((start, end)).or_insert(0) += 1;
        self.longest.fetch_max(size as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Release);
    }

    /// Drop one mark of `[start, start+size)`, made by [`ReadOnlyRanges::mark`].
    pub fn unmark(&self, start: u64, size: usize) {
        let Some(end) = start.checked_add(size as u64).filter(|_| size != 0) else {
            return;
        };
        let mut map = write(&self.ranges);
        if let Some(refs) = map.get_mut(&(start, end)) {
            *refs -= 1;
            if *refs == 0 {
                map.remove(&(start, end));
            }
            self.count.fetch_sub(1, Ordering::Release);
        }
    }

    /// Whether any byte of `[start, start+size)` lies in a marked range.
    #[inline]
    pub fn overlaps(&self, start: u64, size: usize) -> bool {
        if size == 0 || self.count.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.overlaps_slow(start, start.saturating_add(size as u64))
    }

    #[cold]
    fn overlaps_slow(&self, start: u64, end: u64) -> bool {
        let map = read(&self.ranges);
        let reach = start.saturating_sub(self.longest.load(Ordering::Relaxed));
        map.range(..(end, 0))
            .rev()
            .take_while(|((s, _), _)| *s >= reach)
            .any(|((_, e), _)| *e > start)
    }
}

#[cfg(test)]
mod tests {
    use super::ReadOnlyRanges;

    #[test]
    fn a_read_only_range_covers_every_range_that_overlaps_it() {
        let r = ReadOnlyRanges::default();
        assert!(!r.overlaps(0x1000, 16));
        r.mark(0x1000, 0x100);
        r.mark(0x5000, 0x10);
        for (start, size) in [(0x1000, 1), (0x10ff, 1), (0xff0, 0x20), (0x800, 0x10000)] {
            assert!(r.overlaps(start, size), "{start:#x}+{size}");
        }
        for (start, size) in [(0x1100, 1), (0xf00, 0x100), (0x1000, 0), (0x5010, 4)] {
            assert!(!r.overlaps(start, size), "{start:#x}+{size}");
        }
        r.mark(0x1000, 0x100); // the same range twice: host and device address
        r.unmark(0x1000, 0x100);
        assert!(r.overlaps(0x1080, 1));
        r.unmark(0x1000, 0x100);
        assert!(!r.overlaps(0x1080, 1));
        assert!(r.overlaps(0x5008, 100));
        r.unmark(0x5000, 0x10);
        assert!(!r.overlaps(0, usize::MAX));
    }
}
