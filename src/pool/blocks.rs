//! An arena's blocks ([`Blocks`]): a table addressed by slot, and an
//! index of each segment's first block by address.

use std::collections::BTreeMap;

use super::arena::{Kind, State};
use crate::driver::DevicePtr;

/// A block's place in its arena's table ([`Blocks`]); 0: none.
pub(super) type Slot = u32;

/// One block: address, size, neighbours in its segment, state; free, its
/// neighbours in its bin of the [`FreeSet`](super::freeset::FreeSet).
#[derive(Copy, Clone, Debug)]
pub(super) struct Info {
    pub(super) at: DevicePtr,
    pub(super) size: usize,
    pub(super) prev: Slot,
    pub(super) next: Slot,
    pub(super) state: State,
    pub(super) kind: Kind,
    pub(super) bin_prev: Slot,
    pub(super) bin_next: Slot,
}

impl Info {
    /// The block at `at` of `size` bytes between `prev` and `next`.
    pub(super) fn new(
        at: DevicePtr,
        size: usize,
        prev: Slot,
        next: Slot,
        state: State,
        kind: Kind,
    ) -> Info {
        Info {
            at,
            size,
            prev,
            next,
            state,
            kind,
            bin_prev: 0,
            bin_next: 0,
        }
    }
}

/// An arena's blocks: a table, so a split, a merge and the free set reach
/// a block's neighbours by slot rather than hash an address (a pair's dozen
/// lookups were most of its time); and an index of each segment's first
/// block by address, updated only as segments come and go. An owner keeps
/// its block's slot (`Block::slot`); a lookup by address walks the segment
/// from its first block, which keeps its slot while the segment is held (a
/// split keeps the front part in it, a merge the front block's).
#[derive(Default)]
pub(super) struct Blocks {
    pub(super) table: Vec<Info>,
    pub(super) vacant: Vec<Slot>,
    pub(super) heads: BTreeMap<DevicePtr, Slot>,
}

impl Blocks {
    /// The entry of a new segment's one block; its slot.
    pub(super) fn add_segment(&mut self, info: Info) -> Slot {
        let s = self.add(info);
        self.heads.insert(info.at, s);
        s
    }

    /// A new block's entry; its slot.
    pub(super) fn add(&mut self, info: Info) -> Slot {
        match self.vacant.pop() {
            Some(s) => {
                self.table[s as usize] = info;
                s
            }
            None => {
                if self.table.is_empty() {
                    self.table
                        .push(Info::new(0, 0, 0, 0, State::Used, Kind::Small));
                }
                self.table.push(info);
                // Each block is at least 512 bytes of one device.
                Slot::try_from(self.table.len() - 1).expect("fewer than 2^32 blocks")
            }
        }
    }

    /// The block in slot `s` is gone (merged, or its segment given back).
    pub(super) fn remove(&mut self, s: Slot) {
        // Only a segment's first block has no neighbour before it.
        let at = self.table[s as usize].at;
        if self.table[s as usize].prev == 0 && self.heads.get(&at) == Some(&s) {
            self.heads.remove(&at);
        }
        self.table[s as usize].at = 0;
        self.vacant.push(s);
    }

    /// The slot of the block at `at`: a walk of its segment (owners and
    /// the hot paths know their slots).
    pub(super) fn slot(&self, at: DevicePtr) -> Option<Slot> {
        let (_, &first) = self.heads.range(..=at).next_back()?;
        let mut s = first;
        while s != 0 {
            let i = &self.table[s as usize];
            if i.at >= at {
                return (i.at == at).then_some(s);
            }
            s = i.next;
        }
        None
    }

    /// Every block.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Info> {
        self.table.iter().filter(|i| i.at != 0)
    }
}

impl std::ops::Index<Slot> for Blocks {
    type Output = Info;
    #[inline]
    fn index(&self, s: Slot) -> &Info {
        &self.table[s as usize]
    }
}

impl std::ops::IndexMut<Slot> for Blocks {
    #[inline]
    fn index_mut(&mut self, s: Slot) -> &mut Info {
        &mut self.table[s as usize]
    }
}
