//! Ways into the arena's parts that only tests take.

use super::super::arena::{Arena, Blocks, Info, Tag};
use super::super::freeset::FreeSet;
use crate::driver::DevicePtr;

impl Arena {
    /// [`Arena::take_slot`] without the slot.
    pub(crate) fn take(&mut self, tag: Tag, size: usize) -> Option<(DevicePtr, usize)> {
        self.take_slot(tag, size).map(|(p, n, _)| (p, n))
    }

    /// The block handed out at `at` comes back free on `tag` (see
    /// [`Arena::free_slot`]).
    pub(crate) fn free(&mut self, at: DevicePtr, tag: Tag) {
        self.free_slot(self.blocks.slot(at).expect("a block of this arena"), tag);
    }

    /// The block handed out at `at` comes back freed without a stream
    /// (see [`Arena::wait_slot`]).
    pub(crate) fn wait(&mut self, at: DevicePtr) {
        self.wait_slot(self.blocks.slot(at).expect("a block of this arena"));
    }
}

impl Blocks {
    /// The block at `at`.
    pub(crate) fn get(&self, at: DevicePtr) -> Option<&Info> {
        self.slot(at).map(|s| &self[s])
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }
}

impl FreeSet {
    /// How many bitmaps of kinds and tags are held.
    pub(crate) fn maps_held(&self) -> usize {
        self.maps.len()
    }
}
