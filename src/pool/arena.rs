//! An arena: one lock's share of a pool, a best-fit allocator over the
//! driver allocations (*segments*) it owns, as PyTorch's caching allocator
//! keeps its blocks.
//!
//! A segment is cut into blocks that tile it, linked to their neighbours.
//! A block is *used* (handed out), *free* on a stream, free for anyone
//! ([`ANY`]: fresh memory, or memory a fence has made safe), or *waiting*
//! for a fence (freed without a stream). A request takes the smallest free
//! block of its kind that it may use and fits, splits off the rest when the
//! rest is worth keeping, and a freed block merges with its free
//! neighbours, so a segment whose blocks are all free is one block again.
//!
//! Requests of at most 1 MiB (*small*) and larger ones (*large*) never
//! share a segment: PyTorch's two pools, which keep small, short-lived
//! blocks from cutting up the large segments.
//!
//! Nothing here calls the driver or waits: the pool ([`super::Pool`])
//! does, outside the arena's lock.

use std::collections::{BTreeSet, VecDeque};

use super::class::{class_index, class_of_index, size_class, FastMap, SMALL_CLASSES};
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

    /// Whether a block of this kind with `rest` bytes over the request is
    /// split: the rest is kept as a free block when a request could use it
    /// (small), or when it is more than a small request (large: a sliver
    /// of a large segment would only cut it up).
    #[inline]
    fn splits(self, rest: usize) -> bool {
        match self {
            Kind::Small => rest >= MIN_BLOCK,
            Kind::Large => rest > SMALL_MAX,
        }
    }
}

/// `size` rounded up to the arena's granule (at least [`MIN_BLOCK`]).
#[inline]
pub(crate) fn round(size: usize) -> usize {
    size.max(1).div_ceil(MIN_BLOCK) * MIN_BLOCK
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum State {
    Used,
    Free(Tag),
    Waiting,
    /// Waiting, and claimed by an allocation out of memory that waits for
    /// the fence ([`Arena::claim_waiting`]): no one else takes or frees it.
    Claimed,
}

/// One block: its size, its neighbours in its segment (0: none), its state.
#[derive(Copy, Clone, Debug)]
struct Info {
    size: usize,
    prev: DevicePtr,
    next: DevicePtr,
    state: State,
    kind: Kind,
}

/// A batch of blocks freed without a stream, waiting for fence `seq`.
struct Batch {
    seq: u64,
    blocks: Vec<DevicePtr>,
    bytes: usize,
}

/// Blocks handed out of one size class: now, and at most.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct ClassCount {
    pub(crate) live: usize,
    pub(crate) peak: usize,
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

/// One arena (see the module documentation).
pub(crate) struct Arena {
    blocks: FastMap<DevicePtr, Info>,
    /// Free blocks by (kind, tag, size, address): the first at or after
    /// `(kind, tag, size, 0)` is the best fit for `tag`.
    free: BTreeSet<(Kind, Tag, usize, DevicePtr)>,
    /// Bytes of free blocks, all tags; and of those free for anyone.
    free_bytes: usize,
    free_any_bytes: usize,
    /// Freed without a stream, not yet sealed into a batch.
    pending: Vec<DevicePtr>,
    pending_bytes: usize,
    /// Sealed batches, oldest first.
    sealed: VecDeque<Batch>,
    sealed_bytes: usize,
    /// Emptied batch vectors, reused (no allocation per batch).
    spare: Vec<Vec<DevicePtr>>,
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
    pub(crate) class_live: Vec<ClassCount>,
    pub(crate) large_live: FastMap<usize, ClassCount>,
    /// A growth ahead for this arena was asked for and not yet done.
    pub(crate) ahead_asked: bool,
}

impl Default for Arena {
    fn default() -> Self {
        Arena {
            blocks: FastMap::default(),
            free: BTreeSet::new(),
            free_bytes: 0,
            free_any_bytes: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            sealed: VecDeque::new(),
            sealed_bytes: 0,
            spare: Vec::new(),
            live_bytes: 0,
            live_count: 0,
            peak_bytes: 0,
            alloc_count: 0,
            hits: 0,
            misses: 0,
            fences: 0,
            clients: Default::default(),
            class_live: vec![ClassCount::default(); SMALL_CLASSES],
            large_live: FastMap::default(),
            ahead_asked: false,
        }
    }
}

/// The tag two merged free blocks keep: the same tag, or a stream's over
/// [`ANY`] (memory anyone may use is safe on that stream too); `None` for
/// two different streams, which never merge.
#[inline]
fn merged(a: Tag, b: Tag) -> Option<Tag> {
    if a == b || b == ANY {
        Some(a)
    } else if a == ANY {
        Some(b)
    } else {
        None
    }
}

impl Arena {
    fn insert_free(&mut self, kind: Kind, tag: Tag, size: usize, at: DevicePtr) {
        self.free.insert((kind, tag, size, at));
        self.free_bytes += size;
        if tag == ANY {
            self.free_any_bytes += size;
        }
    }

    fn remove_free(&mut self, kind: Kind, tag: Tag, size: usize, at: DevicePtr) {
        let was = self.free.remove(&(kind, tag, size, at));
        debug_assert!(was, "a free block is in the free set");
        self.free_bytes -= size;
        if tag == ANY {
            self.free_any_bytes -= size;
        }
    }

    /// The smallest free block of `kind` with `tag` of at least `size`.
    #[inline]
    fn fit_of(&self, kind: Kind, tag: Tag, size: usize) -> Option<(Tag, usize, DevicePtr)> {
        self.free
            .range((kind, tag, size, 0)..=(kind, tag, usize::MAX, DevicePtr::MAX))
            .next()
            .map(|&(_, t, s, a)| (t, s, a))
    }

    /// The best fit for `size` bytes of `kind` on `tag`: the smallest free
    /// block of that stream's or of anyone's ([`ANY`]), the stream's on a
    /// tie (it keeps the blocks anyone may use for anyone).
    #[inline]
    fn best_fit(&self, kind: Kind, tag: Tag, size: usize) -> Option<(Tag, usize, DevicePtr)> {
        let own = self.fit_of(kind, tag, size);
        if tag == ANY {
            return own;
        }
        match (own, self.fit_of(kind, ANY, size)) {
            (Some(o), Some(a)) if a.1 < o.1 => Some(a),
            (o, a) => o.or(a),
        }
    }

    /// A block of `size` bytes (rounded, [`round`]) for an owner on `tag`
    /// ([`ANY`]: no stream known, so only blocks anyone may use): the best
    /// fit, split when the rest is worth keeping. Its address and size.
    pub(crate) fn take(&mut self, tag: Tag, size: usize) -> Option<(DevicePtr, usize)> {
        let kind = Kind::of(size);
        let (t, have, at) = self.best_fit(kind, tag, size)?;
        self.remove_free(kind, t, have, at);
        let mut info = self.blocks[&at];
        if kind.splits(have - size) {
            let rest = at + size as u64;
            let next = info.next;
            self.blocks.insert(
                rest,
                Info {
                    size: have - size,
                    prev: at,
                    next,
                    state: State::Free(t),
                    kind,
                },
            );
            if next != 0 {
                self.info(next).prev = rest;
            }
            self.insert_free(kind, t, have - size, rest);
            info.next = rest;
            info.size = size;
        }
        info.state = State::Used;
        *self.info(at) = info;
        Some((at, info.size))
    }

    #[inline]
    fn info(&mut self, at: DevicePtr) -> &mut Info {
        self.blocks.get_mut(&at).expect("a block of this arena")
    }

    /// Whether `at` is a block this arena handed out.
    pub(crate) fn is_used(&self, at: DevicePtr) -> bool {
        self.blocks.get(&at).is_some_and(|i| i.state == State::Used)
    }

    /// A block handed out comes back free on `tag` (a stream, or [`ANY`]
    /// for memory a fence made safe): it merges with its free neighbours
    /// where their tags allow ([`merged`]).
    pub(crate) fn free(&mut self, at: DevicePtr, tag: Tag) {
        let Info {
            mut size,
            mut prev,
            mut next,
            kind,
            ..
        } = self.blocks[&at];
        let (mut start, mut tag) = (at, tag);
        if prev != 0 {
            let p = self.blocks[&prev];
            if let Some((t, old)) = Self::joins(tag, p) {
                self.remove_free(kind, old, p.size, prev);
                self.blocks.remove(&at);
                (start, tag, size, prev) = (prev, t, size + p.size, p.prev);
            }
        }
        if next != 0 {
            let n = self.blocks[&next];
            if let Some((t, old)) = Self::joins(tag, n) {
                self.remove_free(kind, old, n.size, next);
                self.blocks.remove(&next);
                (tag, size, next) = (t, size + n.size, n.next);
            }
        }
        // `start` is this block's own entry or its merged neighbour's.
        *self.info(start) = Info {
            size,
            prev,
            next,
            state: State::Free(tag),
            kind,
        };
        if next != 0 {
            self.info(next).prev = start;
        }
        self.insert_free(kind, tag, size, start);
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
    pub(crate) fn wait(&mut self, at: DevicePtr) {
        let i = self.info(at);
        i.state = State::Waiting;
        let size = i.size;
        self.pending.push(at);
        self.pending_bytes += size;
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

    /// Out of memory: take a block of at least `want` bytes (of its kind)
    /// that waits for a fence out of its batch, claimed for the caller, who
    /// waits for the fence and then takes it ([`Arena::take_claimed`]) or
    /// puts it back ([`Arena::unclaim`]). Threads that churn the arena
    /// meanwhile cannot take it first. Its address and size.
    pub(crate) fn claim_waiting(&mut self, want: usize) -> Option<(DevicePtr, usize)> {
        let kind = Kind::of(want);
        let fits = |p: &DevicePtr| {
            self.blocks
                .get(p)
                .is_some_and(|i| i.kind == kind && i.size >= want)
        };
        let (at, batch) = if let Some(i) = self.pending.iter().position(fits) {
            (self.pending.swap_remove(i), None)
        } else {
            let (b, i) = self
                .sealed
                .iter()
                .enumerate()
                .find_map(|(b, batch)| batch.blocks.iter().position(fits).map(|i| (b, i)))?;
            (self.sealed[b].blocks.swap_remove(i), Some(b))
        };
        let i = self.info(at);
        i.state = State::Claimed;
        let size = i.size;
        match batch {
            None => self.pending_bytes -= size,
            Some(b) => {
                self.sealed[b].bytes -= size;
                self.sealed_bytes -= size;
            }
        }
        Some((at, size))
    }

    /// The block claimed at `at`, its fence done, handed out: whether it
    /// still was (a reset may have forgotten it meanwhile).
    pub(crate) fn take_claimed(&mut self, at: DevicePtr) -> bool {
        match self.blocks.get_mut(&at) {
            Some(i) if i.state == State::Claimed => {
                i.state = State::Used;
                true
            }
            _ => false,
        }
    }

    /// The block claimed at `at` waits for the next fence again (its fence
    /// failed).
    pub(crate) fn unclaim(&mut self, at: DevicePtr) {
        if self
            .blocks
            .get(&at)
            .is_some_and(|i| i.state == State::Claimed)
        {
            self.wait(at);
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
    pub(crate) fn promote(&mut self, done: u64) -> bool {
        let mut any = false;
        while self.sealed.front().is_some_and(|b| b.seq <= done) {
            let mut batch = self.sealed.pop_front().expect("checked");
            self.sealed_bytes -= batch.bytes;
            for at in batch.blocks.drain(..) {
                self.free(at, ANY);
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
        let tagged: Vec<_> = self.free.iter().filter(|k| k.1 != ANY).copied().collect();
        for (kind, tag, size, at) in tagged {
            self.remove_free(kind, tag, size, at);
            self.info(at).state = State::Used;
            self.wait(at);
        }
    }

    /// A new segment of `size` bytes at `base`, of `kind`, free for anyone.
    pub(crate) fn add_segment(&mut self, base: DevicePtr, size: usize, kind: Kind) {
        self.blocks.insert(
            base,
            Info {
                size,
                prev: 0,
                next: 0,
                state: State::Free(ANY),
                kind,
            },
        );
        self.insert_free(kind, ANY, size, base);
    }

    /// Take out of the arena each of `segments` (base, size) whose memory
    /// is all cached: free on any tag, or, with `waiting`, waiting for a
    /// fence too. Their bases.
    pub(crate) fn take_free_segments(
        &mut self,
        segments: &[(DevicePtr, usize)],
        waiting: bool,
    ) -> Vec<DevicePtr> {
        let mut out = Vec::new();
        let mut gone = FastMap::default();
        for &(base, size) in segments {
            let blocks = self.segment_blocks(base, size);
            let cached = |b: &(DevicePtr, usize, BlockState)| match self.blocks[&b.0].state {
                State::Free(_) => true,
                State::Waiting => waiting,
                State::Used | State::Claimed => false,
            };
            if blocks.is_empty() || !blocks.iter().all(cached) {
                continue;
            }
            for (at, _, _) in blocks {
                let i = self.blocks[&at];
                match i.state {
                    State::Free(t) => self.remove_free(i.kind, t, i.size, at),
                    _ => {
                        gone.insert(at, ());
                    }
                }
                self.blocks.remove(&at);
            }
            out.push(base);
        }
        if !gone.is_empty() {
            self.pending.retain(|p| !gone.contains_key(p));
            for b in &mut self.sealed {
                b.blocks.retain(|p| !gone.contains_key(p));
            }
            self.recount_waiting();
        }
        out
    }

    /// Count the bytes of the pending and sealed lists afresh (after
    /// blocks left them other than by a seal or a fence).
    fn recount_waiting(&mut self) {
        let size =
            |p: &DevicePtr, blocks: &FastMap<DevicePtr, Info>| blocks.get(p).map_or(0, |i| i.size);
        self.pending_bytes = self.pending.iter().map(|p| size(p, &self.blocks)).sum();
        self.sealed_bytes = 0;
        for b in &mut self.sealed {
            b.bytes = b.blocks.iter().map(|p| size(p, &self.blocks)).sum();
            self.sealed_bytes += b.bytes;
        }
    }

    /// A segment whose free failed comes back, waiting for a fence as a
    /// whole (its blocks' queued work may not be done).
    pub(crate) fn add_waiting_segment(&mut self, base: DevicePtr, size: usize, kind: Kind) {
        self.blocks.insert(
            base,
            Info {
                size,
                prev: 0,
                next: 0,
                state: State::Waiting,
                kind,
            },
        );
        self.pending.push(base);
        self.pending_bytes += size;
    }

    /// Drop every block and count (the context was reset and its memory is
    /// gone).
    pub(crate) fn forget_all(&mut self) {
        self.blocks.clear();
        self.free.clear();
        self.free_bytes = 0;
        self.free_any_bytes = 0;
        self.pending.clear();
        self.pending_bytes = 0;
        self.sealed.clear();
        self.sealed_bytes = 0;
        self.live_bytes = 0;
        self.live_count = 0;
        self.class_live.iter_mut().for_each(|c| c.live = 0);
        self.large_live.clear();
        for k in &mut self.clients {
            (k.live_bytes, k.live_count) = (0, 0);
        }
        self.ahead_asked = false;
    }

    /// Bytes of free blocks (any tag).
    #[inline]
    pub(crate) fn free_bytes(&self) -> usize {
        self.free_bytes
    }

    /// Bytes of free blocks anyone may take.
    #[inline]
    pub(crate) fn free_any_bytes(&self) -> usize {
        self.free_any_bytes
    }

    /// The blocks of the segment at `base` of `size` bytes, in address
    /// order, with their sizes and states (memory snapshots). Empty if the
    /// arena holds no block at `base`.
    pub(crate) fn segment_blocks(
        &self,
        base: DevicePtr,
        size: usize,
    ) -> Vec<(DevicePtr, usize, BlockState)> {
        let mut out = Vec::new();
        let end = base + size as u64;
        let mut at = base;
        while at != 0 && at < end {
            let Some(i) = self.blocks.get(&at) else { break };
            let state = match i.state {
                State::Used => BlockState::Used,
                State::Free(_) => BlockState::Free,
                State::Waiting | State::Claimed => BlockState::Waiting,
            };
            out.push((at, i.size, state));
            at = i.next;
        }
        out
    }

    /// The block handed out that holds `address`, in the segment at
    /// `base`: its start and size.
    pub(crate) fn used_block_at(
        &self,
        base: DevicePtr,
        address: DevicePtr,
    ) -> Option<(DevicePtr, usize)> {
        let mut at = base;
        while at != 0 && at <= address {
            let i = self.blocks.get(&at)?;
            if address < at + i.size as u64 {
                return (i.state == State::Used).then_some((at, i.size));
            }
            at = i.next;
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
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
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

    pub(crate) fn class_count(&mut self, class: usize) -> &mut ClassCount {
        match class_index(class) {
            Some(i) => &mut self.class_live[i],
            None => self.large_live.entry(class).or_default(),
        }
    }

    /// Live and peak blocks per size class, with the cached blocks by the
    /// size class of their sizes, into `out` (class → (live, peak, cached)).
    pub(crate) fn class_counts(&self, out: &mut FastMap<usize, (usize, usize, usize)>) {
        let small = self
            .class_live
            .iter()
            .enumerate()
            .map(|(i, c)| (class_of_index(i), *c));
        for (class, c) in small.chain(self.large_live.iter().map(|(k, c)| (*k, *c))) {
            if c.peak > 0 {
                let e = out.entry(class).or_default();
                e.0 += c.live;
                e.1 += c.peak;
            }
        }
        for i in self.blocks.values() {
            if i.state != State::Used {
                out.entry(size_class(i.size)).or_default().2 += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn arena_with(base: DevicePtr, size: usize) -> Arena {
        let mut a = Arena::default();
        a.add_segment(base, size, Kind::of(size.min(SMALL_MAX)));
        a
    }

    /// Every block of the segment at `base`: sizes tile it, links agree.
    fn check_tiles(a: &Arena, base: DevicePtr, size: usize) {
        let blocks = a.segment_blocks(base, size);
        let total: usize = blocks.iter().map(|b| b.1).sum();
        assert_eq!(total, size, "blocks tile the segment: {blocks:?}");
        for w in blocks.windows(2) {
            assert_eq!(w[0].0 + w[0].1 as u64, w[1].0);
            assert_eq!(a.blocks[&w[1].0].prev, w[0].0);
        }
        // No two neighbours free for the same tag (they would have merged).
        for w in blocks.windows(2) {
            let (x, y) = (a.blocks[&w[0].0].state, a.blocks[&w[1].0].state);
            if let (State::Free(s), State::Free(t)) = (x, y) {
                assert!(merged(s, t).is_none(), "{x:?} and {y:?} should have merged");
            }
        }
    }

    #[test]
    fn a_small_request_splits_and_the_free_merges_the_segment_back() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        let (p, n) = a.take(ANY, 4096).unwrap();
        assert_eq!((p, n), (1 << 32, 4096));
        let (q, _) = a.take(ANY, 8192).unwrap();
        assert_eq!(q, (1 << 32) + 4096, "the rest of the split serves the next");
        check_tiles(&a, 1 << 32, 2 * MIB);
        a.free(p, ANY);
        a.free(q, ANY);
        check_tiles(&a, 1 << 32, 2 * MIB);
        assert_eq!(
            a.segment_blocks(1 << 32, 2 * MIB).len(),
            1,
            "one block again"
        );
        assert_eq!(a.free_bytes(), 2 * MIB);
    }

    #[test]
    fn best_fit_takes_the_smallest_block_that_fits() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        let blocks: Vec<_> = [1024, 4096, 2048, 8192, 512]
            .iter()
            .map(|&n| a.take(ANY, n).unwrap().0)
            .collect();
        // Free the 4096 and the 8192 (not neighbours: a 2048 lies between).
        a.free(blocks[1], ANY);
        a.free(blocks[3], ANY);
        let (p, _) = a.take(ANY, 3000 / 512 * 512 + 512).unwrap();
        assert_eq!(p, blocks[1], "the 4096-byte hole, not the 8192 one");
        check_tiles(&a, 1 << 32, 2 * MIB);
    }

    #[test]
    fn a_large_block_keeps_a_rest_of_one_mib_or_less_whole() {
        let mut a = Arena::default();
        a.add_segment(1 << 32, 20 * MIB, Kind::Large);
        let (_, n) = a.take(ANY, 19 * MIB + MIB / 2).unwrap();
        assert_eq!(n, 20 * MIB, "a 0.5 MiB rest is not split off");
        let mut b = Arena::default();
        b.add_segment(1 << 32, 20 * MIB, Kind::Large);
        let (_, n) = b.take(ANY, 18 * MIB).unwrap();
        assert_eq!(n, 18 * MIB, "a 2 MiB rest is");
    }

    #[test]
    fn small_and_large_requests_never_share_a_segment() {
        let mut a = Arena::default();
        a.add_segment(1 << 32, 20 * MIB, Kind::Large);
        assert_eq!(
            a.take(ANY, 4096),
            None,
            "a small request needs a small segment"
        );
        a.add_segment(2 << 32, 2 * MIB, Kind::Small);
        assert_eq!(
            a.take(ANY, 2 * MIB).map(|b| b.0),
            Some(1 << 32),
            "not the small one"
        );
        assert_eq!(a.take(ANY, 4096).map(|b| b.0), Some(2 << 32));
    }

    #[test]
    fn a_block_freed_on_a_stream_serves_that_stream_only() {
        let (s, t) = (0x1000, 0x2000);
        let mut a = Arena::default();
        a.add_segment(1 << 32, 20 * MIB, Kind::Large);
        let (p, _) = a.take(s, 20 * MIB).unwrap();
        a.free(p, s);
        assert_eq!(a.take(t, 2 * MIB), None, "another stream waits for a fence");
        assert_eq!(
            a.take(ANY, 2 * MIB),
            None,
            "so does an owner with no stream"
        );
        assert_eq!(
            a.take(s, 2 * MIB).map(|x| x.0),
            Some(p),
            "its own stream at once"
        );
    }

    #[test]
    fn memory_anyone_may_use_merges_into_a_streams_block() {
        let s = 0x1000;
        let mut a = arena_with(1 << 32, 2 * MIB);
        let (p, _) = a.take(s, 4096).unwrap();
        // The rest of the segment is fresh memory, free for anyone.
        assert_eq!(a.free_any_bytes(), 2 * MIB - 4096);
        a.free(p, s);
        check_tiles(&a, 1 << 32, 2 * MIB);
        assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 1);
        assert_eq!(
            a.free_any_bytes(),
            0,
            "the whole segment is the stream's now"
        );
        assert_eq!(a.take(ANY, MIB), None, "no longer anyone's");
        assert!(a.take(s, MIB).is_some(), "the stream's");
    }

    #[test]
    fn two_streams_blocks_never_merge() {
        let (s, t) = (0x1000, 0x2000);
        let mut a = arena_with(1 << 32, 2 * MIB);
        let (p, _) = a.take(s, MIB).unwrap();
        let (q, _) = a.take(t, MIB).unwrap();
        a.free(p, s);
        a.free(q, t);
        check_tiles(&a, 1 << 32, 2 * MIB);
        assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 2);
        a.wait_all_tagged();
        a.seal(1);
        assert_eq!(a.take(s, 4096), None, "both wait for the fence");
        a.promote(1);
        check_tiles(&a, 1 << 32, 2 * MIB);
        assert_eq!(
            a.segment_blocks(1 << 32, 2 * MIB).len(),
            1,
            "after a fence they do"
        );
        assert_eq!(a.free_any_bytes(), 2 * MIB);
    }

    #[test]
    fn a_block_freed_without_a_stream_waits_for_its_fence() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        let (p, _) = a.take(ANY, MIB).unwrap();
        let (q, _) = a.take(ANY, MIB).unwrap();
        a.wait(p);
        a.wait(q);
        assert_eq!(a.take(ANY, 4096), None, "pending");
        a.seal(7);
        assert!(!a.promote(6), "its fence is not done");
        assert_eq!(a.take(ANY, 4096), None, "sealed");
        assert_eq!(
            a.take_free_segments(&[(1 << 32, 2 * MIB)], false),
            Vec::<DevicePtr>::new(),
            "waiting is not free"
        );
        assert!(a.promote(7));
        assert_eq!(a.take(ANY, 4096).map(|x| x.0), Some(p));
    }

    #[test]
    fn whole_free_segments_are_taken_out_and_others_stay() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        a.add_segment(2 << 32, 2 * MIB, Kind::Small);
        let segs = [(1u64 << 32, 2 * MIB), (2u64 << 32, 2 * MIB)];
        let (p, _) = a.take(ANY, 4096).unwrap();
        let q = a.take(ANY, 8192).unwrap().0;
        a.wait(q);
        let bases = a.take_free_segments(&segs, false);
        let other = if p >> 32 == 1 { 2 << 32 } else { 1 << 32 };
        assert_eq!(bases, vec![other]);
        assert_eq!(a.free_bytes(), 2 * MIB - 4096 - 8192);
        a.free(p, 0x1000);
        assert_eq!(
            a.take_free_segments(&segs, false),
            Vec::<DevicePtr>::new(),
            "a block waits"
        );
        assert_eq!(
            a.take_free_segments(&segs, true).len(),
            1,
            "unless waiting counts"
        );
        assert_eq!((a.free_bytes(), a.waiting_bytes()), (0, 0));
        assert!(a.blocks.is_empty());
    }

    #[test]
    fn used_block_at_finds_only_blocks_handed_out() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        let (p, n) = a.take(ANY, 8192).unwrap();
        assert_eq!(a.used_block_at(1 << 32, p + 100), Some((p, n)));
        assert_eq!(a.used_block_at(1 << 32, p + 8192), None, "the free rest");
        a.free(p, ANY);
        assert_eq!(a.used_block_at(1 << 32, p), None);
    }

    /// Random takes and frees on three tags keep the segment tiled, the
    /// byte counts exact, and end as one free block.
    #[test]
    fn random_churn_keeps_the_books() {
        let mut a = arena_with(1 << 32, 2 * MIB);
        let mut used: Vec<(DevicePtr, Tag)> = Vec::new();
        let mut x: u64 = 0x9e3779b97f4a7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let r = next();
            let tag = [ANY, 0x1000, 0x2000][(r % 3) as usize];
            if r & 8 == 0 || used.is_empty() {
                let size = round(((r >> 8) % 65536) as usize + 1);
                if let Some((p, _)) = a.take(tag, size) {
                    used.push((p, tag));
                }
            } else {
                let i = (r >> 8) as usize % used.len();
                let (p, t) = used.swap_remove(i);
                a.free(p, t);
            }
            let in_use: usize = a
                .segment_blocks(1 << 32, 2 * MIB)
                .iter()
                .filter(|b| b.2 == BlockState::Used)
                .map(|b| b.1)
                .sum();
            assert_eq!(in_use + a.free_bytes(), 2 * MIB);
        }
        check_tiles(&a, 1 << 32, 2 * MIB);
        for (p, t) in used {
            a.free(p, t);
        }
        a.wait_all_tagged();
        a.seal(1);
        a.promote(1);
        assert_eq!(a.segment_blocks(1 << 32, 2 * MIB).len(), 1);
        assert_eq!(a.free_any_bytes(), 2 * MIB);
    }
}
