//! The quick list: blocks a fence freed, kept whole (not merged) for a
//! request of exactly their size, as dlmalloc's fast bins keep small
//! chunks, so a loop that frees without a stream and asks for the same
//! size again skips a merge at the fence and a split at the take. A block
//! on the list is free for anyone and counted so, but not in the free set;
//! anything else that looks at the free blocks merges the list first
//! (oldest first), and sees what eager merging leaves.

use super::arena::{Arena, Kind, State, ANY};
use super::blocks::Slot;

/// Blocks on an arena's list at most: a batch of one fence in a tight loop
/// (the blocks of a pass of numba's temporaries), few enough that what
/// stays unmerged is a few blocks.
pub(super) const QUICK: usize = 64;

impl Arena {
    /// Block `s`, which a fence freed, joins the list; past [`QUICK`]
    /// blocks the oldest merges into the free set.
    pub(super) fn quick_push(&mut self, s: Slot) {
        if self.quick.len() == QUICK {
            let old = self.quick.pop_front().expect("a full list");
            self.quick_merge(old);
        }
        self.blocks[s].state = State::Quick;
        self.quick_bytes += self.blocks[s].size;
        self.quick.push_back(s);
    }

    /// The newest block on the list of exactly `size` bytes and `kind`,
    /// handed out; its slot.
    pub(super) fn quick_take(&mut self, kind: Kind, size: usize) -> Option<Slot> {
        let fits = |&s: &Slot| self.blocks[s].size == size && self.blocks[s].kind == kind;
        let i = self.quick.iter().rposition(fits)?;
        let s = self.quick.remove(i).expect("found");
        self.quick_bytes -= size;
        self.blocks[s].state = State::Used;
        Some(s)
    }

    /// Every block on the list merges into the free set, oldest first.
    pub(crate) fn flush_quick(&mut self) {
        while let Some(s) = self.quick.pop_front() {
            self.quick_merge(s);
        }
    }

    fn quick_merge(&mut self, s: Slot) {
        self.quick_bytes -= self.blocks[s].size;
        self.free_slot(s, ANY);
    }
}
