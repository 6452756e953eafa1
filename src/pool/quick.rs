//! The quick list (as dlmalloc's fast bins): blocks a fence freed, kept
//! whole for a request without a stream of exactly their size, which skips
//! a merge at the fence and a split at the take. Free for anyone, counted
//! so, not in the free set: any other look at the free blocks, and a free
//! on a stream, merges the list first (oldest first), as eager merging.

use super::arena::{Arena, Kind, State, ANY};
use super::blocks::Slot;

/// Blocks on an arena's list at most: one batch (`fence_count`, 64 blocks).
pub(super) const QUICK: usize = 64;

impl Arena {
    /// Block `s`, which a fence freed, joins the list; past [`QUICK`]
    /// blocks the oldest merges into the free set.
    pub(super) fn quick_push(&mut self, s: Slot) {
        if self.quick.len() == QUICK {
            self.quick_merge_oldest();
        }
        self.blocks[s].state = State::Quick;
        self.quick_bytes += self.blocks[s].size;
        self.quick.push_back(s);
    }

    /// The newest listed block of exactly `size` bytes and `kind`, handed out.
    pub(super) fn quick_take(&mut self, kind: Kind, size: usize) -> Option<Slot> {
        let fits = |&s: &Slot| self.blocks[s].size == size && self.blocks[s].kind == kind;
        let i = self.quick.iter().rposition(fits)?;
        let s = self.quick.remove(i).expect("found");
        self.quick_bytes -= size;
        self.blocks[s].state = State::Used;
        Some(s)
    }

    /// [`Arena::quick_take`] when the newest listed block fits (a loop of
    /// one size): no search, no shift.
    #[inline]
    pub(super) fn quick_take_newest(&mut self, size: usize) -> Option<Slot> {
        let &s = self.quick.back()?;
        let b = &mut self.blocks[s];
        if b.size != size || b.kind != Kind::of(size) {
            return None;
        }
        b.state = State::Used;
        self.quick.pop_back();
        self.quick_bytes -= size;
        Some(s)
    }

    /// Every block on the list merges into the free set, oldest first.
    pub(crate) fn flush_quick(&mut self) {
        while self.quick_merge_oldest() {}
    }

    /// The oldest block on the list merges into the free set; whether one did.
    fn quick_merge_oldest(&mut self) -> bool {
        let Some(s) = self.quick.pop_front() else {
            return false;
        };
        self.quick_bytes -= self.blocks[s].size;
        self.free_slot(s, ANY);
        true
    }
}
