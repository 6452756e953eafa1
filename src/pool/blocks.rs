//! An arena's blocks ([`Blocks`]): a table addressed by slot, and an
//! index by address.

use super::arena::{Kind, State};
use super::class::FastMap;
use crate::driver::DevicePtr;

/// A block's place in its arena's table ([`Blocks`]); 0: none.
pub(super) type Slot = u32;

/// One block: its address and size, its neighbours in its segment, its
/// state; free, its neighbours in its bin of the free set
/// ([`FreeSet`](super::freeset::FreeSet)).
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
        let (bin_prev, bin_next) = (0, 0);
        Info {
            at,
            size,
            prev,
            next,
            state,
            kind,
            bin_prev,
            bin_next,
        }
    }
}

/// An arena's blocks: a table, so that a split, a merge and the free set
/// reach a block's neighbours by slot rather than hash an address (a
/// pair's dozen lookups were most of its time); and an index by address,
/// for the blocks' owners, updated only when a block is cut or joined.
#[derive(Default)]
pub(super) struct Blocks {
    pub(super) table: Vec<Info>,
    pub(super) vacant: Vec<Slot>,
    pub(super) index: FastMap<DevicePtr, Slot>,
}

impl Blocks {
    /// A new block's entry; its slot.
    pub(super) fn add(&mut self, info: Info) -> Slot {
        let s = match self.vacant.pop() {
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
        };
        self.index.insert(info.at, s);
        s
    }

    /// The block in slot `s` is gone (merged, or its segment given back).
    pub(super) fn remove(&mut self, s: Slot) {
        self.index.remove(&self.table[s as usize].at);
        self.table[s as usize].at = 0;
        self.vacant.push(s);
    }

    /// The slot of the block at `at`.
    #[inline]
    pub(super) fn slot(&self, at: DevicePtr) -> Option<Slot> {
        self.index.get(&at).copied()
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
