//! An arena: one lock's share of a pool, a best-fit allocator over the driver
//! allocations (*segments*) it owns, as PyTorch's caching allocator keeps its
//! blocks. Blocks tile a segment; each is *used*, *free* on a stream or for
//! anyone ([`ANY`]), *waiting* for a fence (freed without a stream), or on the
//! quick list (`quick.rs`). A request takes the smallest free block of its kind
//! it may use and splits off the rest worth keeping; a freed one merges with
//! its free neighbours. Small requests (at most 1 MiB) and large ones never
//! share a segment (PyTorch's two pools). No driver call, no wait here.

use std::collections::VecDeque;

pub(super) use super::blocks::{Blocks, Info, Slot};
use super::class::{ClassCount, FastMap, SmallCounts};
use super::freeset::FreeSet;
use crate::driver::{DevicePtr, RawStream};
use crate::stats::{Client, ClientStats};

/// Whom a free block may serve: the stream it was freed on, or anyone.
pub(crate) type Tag = RawStream;

/// A free block anyone may take: fresh from the driver, or freed before a
/// fence that has since run (every stream's work queued before it is done).
pub(crate) const ANY: Tag = RawStream::MAX;

/// Requests up to this many bytes are small ([`Kind::Small`]).
pub(crate) const SMALL_MAX: usize = 1 << 20;

/// Sizes round up to a multiple of this, and no block is smaller.
pub(crate) const MIN_BLOCK: usize = 512;

/// Which of the two pools a request or segment belongs to.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Kind {
    /// Requests of at most [`SMALL_MAX`] bytes.
    Small = 0,
    /// Larger ones.
    Large = 1,
}

impl Kind {
    /// The kind of a request of `size` bytes.
    #[inline]
    pub(crate) fn of(size: usize) -> Kind {
        if size <= SMALL_MAX {
            Kind::Small
        } else {
            Kind::Large
        }
    }

    /// Whether a block with `rest` bytes over the request splits: small,
    /// when a request could use the rest; large, when the rest is more than
    /// a small request (a sliver of a large segment would only cut it up).
    #[inline]
    fn splits(self, rest: usize) -> bool {
        match self {
            Kind::Small => rest >= MIN_BLOCK,
            Kind::Large => rest > SMALL_MAX,
        }
    }
}

/// A block's bytes if it is large, else 0.
fn large(i: &Info) -> usize {
    usize::from(i.kind == Kind::Large) * i.size
}

/// `size` rounded up to the arena's granule (at least [`MIN_BLOCK`]).
#[inline]
pub(crate) fn round(size: usize) -> usize {
    size.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK
}

/// What a block's state looks like to a memory snapshot.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Handed out.
    Used,
    /// Cached, free for reuse now (on its stream, or by anyone).
    Free,
    /// Cached, waiting for a fence.
    Waiting,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum State {
    Used,
    Free(Tag),
    Waiting,
    /// Waiting, and claimed by an allocation out of memory that waits for
    /// the fence ([`Arena::claim_waiting`]): no one else takes or frees it.
    Claimed,
    /// Free for anyone, kept whole on the quick list (`quick.rs`).
    Quick,
}

/// A batch of blocks freed without a stream, waiting for fence `seq`.
pub(super) struct Batch {
    pub(super) seq: u64,
    pub(super) blocks: Vec<Slot>,
    pub(super) bytes: usize,
}

/// One arena (see the module documentation).
#[derive(Default)]
pub(crate) struct Arena {
    pub(super) blocks: Blocks,
    /// Free blocks by kind, tag and size.
    pub(super) free: FreeSet,
    /// Freed without a stream, not yet sealed into a batch.
    pub(super) pending: Vec<Slot>,
    pub(super) pending_bytes: usize,
    /// Sealed batches, oldest first.
    pub(super) sealed: VecDeque<Batch>,
    pub(super) sealed_bytes: usize,
    /// Of the bytes pending or sealed, those of large blocks.
    pub(super) waiting_large: usize,
    /// Emptied batch vectors, reused (no allocation per batch).
    spare: Vec<Vec<Slot>>,
    /// Blocks a fence freed, kept whole, oldest first (`quick.rs`).
    pub(super) quick: VecDeque<Slot>,
    pub(super) quick_bytes: usize,
    // Statistics, kept under the lock every allocation takes anyway.
    pub(crate) live_bytes: usize,
    pub(crate) live_count: usize,
    pub(crate) peak_bytes: usize,
    pub(crate) alloc_count: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) fences: u64,
    pub(crate) clients: [ClientStats; Client::COUNT],
    /// Live blocks per size class of the request ([`size_class`]).
    pub(crate) class_live: SmallCounts,
    pub(crate) large_live: FastMap<usize, ClassCount>,
    /// A growth ahead for this arena was asked for and not yet done.
    pub(crate) ahead_asked: bool,
    /// Hits that skip the look at the GPU
    /// ([`Pool::busy_look`](super::Pool::busy_look)).
    pub(super) idle_skips: u32,
}

/// The tag two merged free blocks keep: the same, or a stream's over
/// [`ANY`] (safe on that stream too); `None` for two streams, never merged.
#[inline]
pub(super) fn merged(a: Tag, b: Tag) -> Option<Tag> {
    if a == b || b == ANY {
        Some(a)
    } else if a == ANY {
        Some(b)
    } else {
        None
    }
}

impl Arena {
    /// The best fit for `size` bytes of `kind` on `tag`: the smallest free
    /// block of that stream's or of anyone's ([`ANY`]), the stream's on a
    /// tie (it keeps the blocks anyone may use for anyone).
    #[inline]
    fn best_fit(&self, kind: Kind, tag: Tag, size: usize) -> Option<(Tag, usize, Slot)> {
        let fit = |t| self.free.fit(kind, t, size).map(|(s, a)| (t, s, a));
        let own = fit(tag);
        if tag == ANY {
            return own;
        }
        match (own, fit(ANY)) {
            (Some(o), Some(a)) if a.1 < o.1 => Some(a),
            (o, a) => o.or(a),
        }
    }

    /// Whether the best fit for a large `size` on [`ANY`] is larger than
    /// `size` while blocks wait for a fence: one of them, or one merged
    /// with its free neighbours once its fence is done, may fit better.
    /// (A small block never merges into a large one; an exact fit on the
    /// quick list is taken as it is.)
    pub(crate) fn better_fit_waits(&self, size: usize) -> bool {
        let exact = |&s: &Slot| self.blocks[s].size == size && self.blocks[s].kind == Kind::Large;
        self.waiting_large > 0
            && !self.quick.iter().any(exact)
            && self
                .best_fit(Kind::Large, ANY, size)
                .is_some_and(|(_, have, _)| have > size)
    }

    /// A block of `size` bytes (rounded, [`round`]) for an owner on `tag`
    /// ([`ANY`]: no stream, so only blocks anyone may use): the best fit,
    /// split when the rest is worth keeping; its address, size and slot. (A
    /// hit first tries [`Arena::quick_take_newest`] inline.)
    pub(crate) fn take_slot(&mut self, tag: Tag, size: usize) -> Option<(DevicePtr, usize, Slot)> {
        let kind = Kind::of(size);
        if !self.quick.is_empty() {
            // Not a stream's request: its best fit prefers its own blocks.
            let quick = (tag == ANY).then(|| self.quick_take(kind, size));
            if let Some(s) = quick.flatten() {
                return Some((self.blocks[s].at, size, s));
            }
            self.flush_quick();
        }
        let (t, have, s) = self.best_fit(kind, tag, size)?;
        self.free.remove(&mut self.blocks, kind, t, have, s);
        let mut info = self.blocks[s];
        if kind.splits(have - size) {
            let next = info.next;
            let rest = Info::new(
                info.at + size as u64,
                have - size,
                s,
                next,
                State::Free(t),
                kind,
            );
            let r = self.blocks.add(rest);
            if next != 0 {
                self.blocks[next].prev = r;
            }
            self.free.insert(&mut self.blocks, kind, t, have - size, r);
            info.next = r;
            info.size = size;
        }
        info.state = State::Used;
        self.blocks[s] = info;
        Some((info.at, info.size, s))
    }

    /// The slot of `at` if this arena handed it out: `hint` (its slot when
    /// handed out, kept while used), or by address if that slot holds another
    /// block (a vacant slot's entry is at 0 and keeps its old state).
    #[inline]
    pub(crate) fn used_at(&self, hint: Slot, at: DevicePtr) -> Option<Slot> {
        match self.blocks.table.get(hint as usize) {
            Some(i) if hint != 0 && at != 0 && i.at == at => {
                (i.state == State::Used).then_some(hint)
            }
            _ => self.slot_in(at, State::Used),
        }
    }

    /// The slot of the block at `at`, if it is in `state`.
    #[inline]
    fn slot_in(&self, at: DevicePtr, state: State) -> Option<Slot> {
        let s = self.blocks.slot(at)?;
        (self.blocks[s].state == state).then_some(s)
    }

    /// A block handed out comes back free on `tag` (a stream, or [`ANY`]
    /// for memory a fence made safe): it merges with its free neighbours
    /// where their tags allow ([`merged`]).
    pub(crate) fn free_slot(&mut self, s: Slot, tag: Tag) {
        if tag != ANY {
            // The quick list first, as its blocks merged when their fence
            // ended: a stream's block never takes a tag they had not.
            self.flush_quick();
        }
        let Info {
            at,
            mut size,
            mut prev,
            mut next,
            kind,
            ..
        } = self.blocks[s];
        let (mut start, mut at, mut tag) = (s, at, tag);
        if prev != 0 {
            let p = self.blocks[prev];
            if let Some((t, old)) = Self::joins(tag, p) {
                self.free.remove(&mut self.blocks, kind, old, p.size, prev);
                self.blocks.remove(s);
                (start, at, tag, size, prev) = (prev, p.at, t, size + p.size, p.prev);
            }
        }
        if next != 0 {
            let n = self.blocks[next];
            if let Some((t, old)) = Self::joins(tag, n) {
                self.free.remove(&mut self.blocks, kind, old, n.size, next);
                self.blocks.remove(next);
                (tag, size, next) = (t, size + n.size, n.next);
            }
        }
        // `start` is this block's own entry or its merged neighbour's.
        self.blocks[start] = Info::new(at, size, prev, next, State::Free(tag), kind);
        if next != 0 {
            self.blocks[next].prev = start;
        }
        self.free.insert(&mut self.blocks, kind, tag, size, start);
    }

    /// If a block freed on `tag` merges with its neighbour `n` (see
    /// [`merged`]): the tag they keep, and `n`'s own.
    #[inline]
    fn joins(tag: Tag, n: Info) -> Option<(Tag, Tag)> {
        match n.state {
            State::Free(t) => merged(tag, t).map(|m| (m, t)),
            _ => None,
        }
    }

    /// A block handed out comes back freed without a stream: it waits for
    /// the next fence sealed ([`Arena::seal`]).
    pub(crate) fn wait_slot(&mut self, s: Slot) {
        let i = &mut self.blocks[s];
        i.state = State::Waiting;
        self.pending_bytes += i.size;
        self.waiting_large += large(i);
        self.pending.push(s);
    }

    /// Blocks freed without a stream and not sealed yet.
    #[inline]
    pub(crate) fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Bytes freed without a stream and not sealed yet.
    #[inline]
    pub(crate) fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Bytes waiting for a fence, sealed or not.
    #[inline]
    pub(crate) fn waiting_bytes(&self) -> usize {
        self.pending_bytes + self.sealed_bytes
    }

    /// A block sealed for a fence, of `want` to `most` bytes (of its kind),
    /// out of its batch, claimed for the caller (no one else takes it), who
    /// waits for its fence, then takes it ([`Arena::take_claimed`]) or puts
    /// it back ([`Arena::unclaim`]). Its address, size and fence. Pending
    /// blocks are not claimed: the caller seals them first.
    pub(crate) fn claim_waiting(
        &mut self,
        want: usize,
        most: usize,
    ) -> Option<(DevicePtr, usize, u64)> {
        let kind = Kind::of(want);
        let fits = |&s: &Slot| {
            let i = &self.blocks[s];
            i.kind == kind && (want..=most).contains(&i.size)
        };
        let (b, i) = self
            .sealed
            .iter()
            .enumerate()
            .find_map(|(b, batch)| batch.blocks.iter().position(fits).map(|i| (b, i)))?;
        let batch = &mut self.sealed[b];
        let s = batch.blocks.swap_remove(i);
        let info = &mut self.blocks[s];
        info.state = State::Claimed;
        batch.bytes -= info.size;
        self.sealed_bytes -= info.size;
        self.waiting_large -= large(info);
        Some((info.at, info.size, batch.seq))
    }

    /// The block claimed at `at`, its fence done, handed out: its slot,
    /// if it still was claimed (a reset may have forgotten it meanwhile).
    pub(crate) fn take_claimed(&mut self, at: DevicePtr) -> Option<Slot> {
        self.slot_in(at, State::Claimed)
            .inspect(|&s| self.blocks[s].state = State::Used)
    }

    /// The claimed block at `at` waits for the next fence (its own failed).
    pub(crate) fn unclaim(&mut self, at: DevicePtr) {
        if let Some(s) = self.slot_in(at, State::Claimed) {
            self.wait_slot(s);
        }
    }

    /// Whether a sealed batch waits for its fence.
    #[inline]
    pub(crate) fn has_sealed(&self) -> bool {
        !self.sealed.is_empty()
    }

    /// The fence the newest sealed batch waits for (0: none waits).
    pub(crate) fn newest_sealed(&self) -> u64 {
        self.sealed.back().map_or(0, |b| b.seq)
    }

    /// Seal the pending blocks into a batch for fence `seq` (asked for by
    /// the caller, after every free in it).
    pub(crate) fn seal(&mut self, seq: u64) {
        if self.pending.is_empty() {
            return;
        }
        let next = self.spare.pop().unwrap_or_default();
        let mut blocks = std::mem::replace(&mut self.pending, next);
        let bytes = std::mem::take(&mut self.pending_bytes);
        self.sealed_bytes += bytes;
        match self.sealed.back_mut() {
            // Requests before the fence starts share its number.
            Some(last) if last.seq == seq => {
                last.blocks.append(&mut blocks);
                last.bytes += bytes;
                self.spare.push(blocks);
            }
            _ => self.sealed.push_back(Batch { seq, blocks, bytes }),
        }
    }

    /// Free for anyone the blocks of every batch whose fence is done
    /// (`done`: the last finished fence); whether any was.
    #[inline]
    pub(crate) fn promote(&mut self, done: u64) -> bool {
        // Every hit and free looks: inline, and the work out of line.
        self.sealed.front().is_some_and(|b| b.seq <= done) && self.promote_done(done)
    }

    #[inline(never)]
    fn promote_done(&mut self, done: u64) -> bool {
        let mut any = false;
        while self.sealed.front().is_some_and(|b| b.seq <= done) {
            let mut batch = self.sealed.pop_front().expect("checked");
            self.sealed_bytes -= batch.bytes;
            for s in batch.blocks.drain(..) {
                self.waiting_large -= large(&self.blocks[s]);
                self.quick_push(s);
            }
            self.spare.push(batch.blocks);
            self.fences += 1;
            any = true;
        }
        any
    }

    /// Every block free on a stream waits for the next fence sealed, as a
    /// block freed without a stream does: once it has run, every stream's
    /// work queued before it is done, and the block is free for anyone.
    pub(crate) fn wait_all_tagged(&mut self) {
        self.flush_quick();
        let tagged = self.free.tagged(&self.blocks);
        for (kind, tag, size, s) in tagged {
            self.free.remove(&mut self.blocks, kind, tag, size, s);
            self.blocks[s].state = State::Used;
            self.wait_slot(s);
        }
    }

    /// A new segment of `size` bytes at `base`, of `kind`, free for anyone.
    pub(crate) fn add_segment(&mut self, base: DevicePtr, size: usize, kind: Kind) {
        let info = Info::new(base, size, 0, 0, State::Free(ANY), kind);
        let s = self.blocks.add_segment(info);
        self.free.insert(&mut self.blocks, kind, ANY, size, s);
    }

    /// Take out each of `segments` (base, size) whose memory is all free
    /// (any tag), or with `waiting` free or waiting for a fence; their bases.
    pub(crate) fn take_free_segments(
        &mut self,
        segments: &[(DevicePtr, usize)],
        waiting: bool,
    ) -> Vec<DevicePtr> {
        self.flush_quick();
        let (mut out, mut waited) = (Vec::new(), false);
        for &(base, size) in segments {
            let blocks = self.segment_slots(base, size);
            let cached = |&s: &Slot| match self.blocks[s].state {
                State::Free(_) => true,
                State::Waiting => waiting,
                State::Used | State::Claimed | State::Quick => false,
            };
            if blocks.is_empty() || !blocks.iter().all(cached) {
                continue;
            }
            for s in blocks {
                let i = self.blocks[s];
                match i.state {
                    State::Free(t) => self.free.remove(&mut self.blocks, i.kind, t, i.size, s),
                    _ => waited = true,
                }
                self.blocks.remove(s);
            }
            out.push(base);
        }
        if waited {
            // Slots removed above are vacant now; the lists keep the rest,
            // their bytes counted afresh.
            let live = |s: &Slot| self.blocks[*s].at != 0;
            self.pending.retain(live);
            self.pending_bytes = self.pending.iter().map(|&s| self.blocks[s].size).sum();
            self.sealed_bytes = 0;
            for b in &mut self.sealed {
                b.blocks.retain(live);
                b.bytes = b.blocks.iter().map(|&s| self.blocks[s].size).sum();
                self.sealed_bytes += b.bytes;
            }
            let sealed = self.sealed.iter().flat_map(|b| &b.blocks);
            let waiting = self.pending.iter().chain(sealed);
            self.waiting_large = waiting.map(|&s| large(&self.blocks[s])).sum();
        }
        out
    }

    /// A segment whose free failed comes back, waiting for a fence as a
    /// whole (its blocks' queued work may not be done).
    pub(crate) fn add_waiting_segment(&mut self, base: DevicePtr, size: usize, kind: Kind) {
        let info = Info::new(base, size, 0, 0, State::Used, kind);
        let s = self.blocks.add_segment(info);
        self.wait_slot(s);
    }

    /// Drop every block and count (the context was reset, its memory gone).
    pub(crate) fn forget_all(&mut self) {
        self.blocks = Blocks::default();
        self.free = FreeSet::default();
        (self.quick, self.quick_bytes) = (VecDeque::new(), 0);
        self.pending.clear();
        self.sealed.clear();
        (self.pending_bytes, self.sealed_bytes, self.waiting_large) = (0, 0, 0);
        (self.live_bytes, self.live_count) = (0, 0);
        self.class_live.0.iter_mut().for_each(|c| c.live = 0);
        self.large_live.clear();
        for k in &mut self.clients {
            (k.live_bytes, k.live_count) = (0, 0);
        }
        self.ahead_asked = false;
    }

    /// Bytes of free blocks (any tag).
    #[inline]
    pub(crate) fn free_bytes(&self) -> usize {
        self.free.bytes + self.quick_bytes
    }

    /// Bytes of free blocks anyone may take.
    #[inline]
    pub(crate) fn free_any_bytes(&self) -> usize {
        self.free.any_bytes + self.quick_bytes
    }
}
