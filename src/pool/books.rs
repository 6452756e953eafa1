//! An arena's books: its counts by size class and client, and what a
//! memory snapshot or a wrap sees of its blocks.

use super::arena::{Arena, BlockState, Info, Slot, State};
use super::class::{class_index, class_of_index, size_class, ClassCount, FastMap};
use crate::driver::DevicePtr;
use crate::stats::{ClassStats, Client};

impl Arena {
    /// The blocks of the segment at `base` of `size` bytes, sizes and states
    /// (snapshots), in address order, the quick list merged first.
    pub(crate) fn segment_blocks(
        &mut self,
        base: DevicePtr,
        size: usize,
    ) -> Vec<(DevicePtr, usize, BlockState)> {
        self.flush_quick();
        let state = |s: State| match s {
            State::Used => BlockState::Used,
            State::Free(_) | State::Quick => BlockState::Free,
            State::Waiting | State::Claimed => BlockState::Waiting,
        };
        let view = |i: &Info| (i.at, i.size, state(i.state));
        let slots = self.segment_slots(base, size).into_iter();
        slots.map(|s| view(&self.blocks[s])).collect()
    }

    /// The segment's blocks' slots, in address order (none if none is at `base`).
    pub(super) fn segment_slots(&self, base: DevicePtr, size: usize) -> Vec<Slot> {
        let (mut out, end) = (Vec::new(), base + size as u64);
        let mut s = self.blocks.slot(base).unwrap_or(0);
        while s != 0 && self.blocks[s].at < end {
            out.push(s);
            s = self.blocks[s].next;
        }
        out
    }

    /// In the segment at `base`, the used block holding `address`: start, size.
    pub(crate) fn used_block_at(
        &self,
        base: DevicePtr,
        address: DevicePtr,
    ) -> Option<(DevicePtr, usize)> {
        let mut s = self.blocks.slot(base)?;
        while s != 0 && self.blocks[s].at <= address {
            let i = &self.blocks[s];
            if address < i.at + i.size as u64 {
                return (i.state == State::Used).then_some((i.at, i.size));
            }
            s = i.next;
        }
        None
    }

    /// Count a hand-out of `size` bytes (asked for) to `client`.
    #[inline]
    pub(crate) fn handed_out(&mut self, size: usize, client: Client, hit: bool) {
        let c = self.class_count(size_class(size.max(1)));
        c.live += 1;
        c.peak = c.peak.max(c.live);
        let k = &mut self.clients[client.index()];
        k.live_bytes += size;
        k.live_count += 1;
        k.alloc_count += 1;
        self.live_bytes += size;
        self.live_count += 1;
        self.peak_bytes = self.peak_bytes.max(self.live_bytes);
        self.alloc_count += 1;
        self.hits += u64::from(hit);
        self.misses += u64::from(!hit);
    }

    /// Count the return of a block handed out for `size` bytes to
    /// `client`. Saturating: a count a reset zeroed stays at zero.
    #[inline]
    pub(crate) fn returned(&mut self, size: usize, client: Client) {
        self.live_bytes = self.live_bytes.saturating_sub(size);
        self.live_count = self.live_count.saturating_sub(1);
        let c = self.class_count(size_class(size.max(1)));
        c.live = c.live.saturating_sub(1);
        let k = &mut self.clients[client.index()];
        k.live_bytes = k.live_bytes.saturating_sub(size);
        k.live_count = k.live_count.saturating_sub(1);
    }

    #[inline]
    pub(crate) fn class_count(&mut self, class: usize) -> &mut ClassCount {
        match class_index(class) {
            Some(i) => &mut self.class_live.0[i],
            None => self.large_live.entry(class).or_default(),
        }
    }

    /// Live and peak blocks per size class, and cached ones (quick list
    /// merged) by their size's class, added into `out` (`class` not set).
    pub(crate) fn class_counts(&mut self, out: &mut FastMap<usize, ClassStats>) {
        self.flush_quick();
        let live = self.class_live.0.iter().enumerate();
        let small = live.map(|(i, c)| (class_of_index(i), *c));
        for (class, c) in small.chain(self.large_live.iter().map(|(k, c)| (*k, *c))) {
            if c.peak > 0 {
                let e = out.entry(class).or_default();
                e.live_blocks += c.live;
                e.peak_blocks += c.peak;
            }
        }
        for i in self.blocks.iter() {
            if i.state != State::Used {
                out.entry(size_class(i.size)).or_default().cached_blocks += 1;
            }
        }
    }
}
