//! An arena's quick list: the last few blocks freed, kept whole (not yet
//! merged with their free neighbours) so that a request of exactly their
//! size takes one back without touching the free-block index.
//!
//! A program that frees a block and asks for the same size again (a
//! temporary per step, numba's `device_array` in a loop, CuPy's
//! `a * 2 + 1`) would otherwise merge the block into its neighbours on the
//! free and split it off again on the next request: two searches, two
//! inserts and two removals in the free set and the block map, where the
//! quick list pushes and pops. A block of exactly the request's size is a
//! best fit (no smaller free block fits), so the choice stays best fit.
//!
//! The list is an internal deferral, never seen outside the arena: any
//! request it cannot serve, and every look at the blocks (snapshots, class
//! counts, trims, a fence of every stream), first merges it all
//! ([`Arena::settle`]), so the best-fit search and every view see exactly
//! what eager merging would leave. Its bytes count as free all along.

use super::arena::{Arena, Kind, State, Tag, ANY};
use crate::driver::DevicePtr;

/// The most blocks the quick list holds: the oldest is merged when a
/// newer one comes. A scan of this many entries costs less than one
/// search of the free set.
pub(super) const QUICK_MAX: usize = 8;

/// One block on the quick list: its tag, size, address and kind.
#[derive(Copy, Clone, Debug)]
pub(super) struct Quick {
    tag: Tag,
    size: usize,
    at: DevicePtr,
    kind: Kind,
}

impl Arena {
    /// A block handed out comes back free on `tag` (a stream, or [`ANY`]
    /// for memory a fence made safe): kept whole on the quick list, its
    /// merge deferred (the oldest entry merges when the list is full).
    pub(crate) fn free(&mut self, at: DevicePtr, tag: Tag) {
        if self.quick.len() == QUICK_MAX {
            let q = self.quick.remove(0);
            self.merge_quick(q);
        }
        let i = self.info(at);
        i.state = State::Quick(tag);
        let (size, kind) = (i.size, i.kind);
        self.quick.push(Quick {
            tag,
            size,
            at,
            kind,
        });
        self.count_free(tag, size, true);
    }

    /// A block on the quick list of exactly `size` bytes and `kind`, freed
    /// on `tag` itself (the newest such), taken off the list and marked
    /// handed out. Only the request's own tag: a stream's request that
    /// would take anyone's block goes to the best-fit search, which gives
    /// a tie to the stream's own block, as eager merging did.
    #[inline]
    pub(super) fn take_quick(&mut self, kind: Kind, tag: Tag, size: usize) -> Option<DevicePtr> {
        let found = self
            .quick
            .iter()
            .rposition(|q| q.size == size && q.kind == kind && q.tag == tag)?;
        let q = self.quick.remove(found);
        self.quick_hits += 1;
        self.count_free(q.tag, q.size, false);
        self.info(q.at).state = State::Used;
        Some(q.at)
    }

    /// Merge every block of the quick list with its free neighbours, as an
    /// eager free would have: afterwards the free set holds every free
    /// block.
    pub(crate) fn settle(&mut self) {
        // Oldest first, as they were freed: a block freed later was still
        // handed out when an older one merged under eager merging, and
        // which neighbour a block joins decides the tag it keeps.
        let list = std::mem::take(&mut self.quick);
        for &q in &list {
            self.merge_quick(q);
        }
        self.quick = list;
        self.quick.clear();
    }

    /// Whether the block at `at` is on the quick list (tests).
    #[cfg(test)]
    pub(super) fn quick_holds(&self, at: DevicePtr) -> bool {
        self.quick.iter().any(|q| q.at == at)
    }

    fn merge_quick(&mut self, q: Quick) {
        // `merge_free` counts the bytes as free again.
        self.count_free(q.tag, q.size, false);
        self.merge_free(q.at, q.tag);
    }

    /// Count `size` bytes on `tag` as free (`add`) or no longer.
    #[inline]
    pub(super) fn count_free(&mut self, tag: Tag, size: usize, add: bool) {
        let any = if tag == ANY { size } else { 0 };
        if add {
            self.free_bytes += size;
            self.free_any_bytes += any;
        } else {
            self.free_bytes -= size;
            self.free_any_bytes -= any;
        }
    }
}
