//! A shard: one lock's share of a pool's cache and statistics, and the
//! thread-to-shard tickets.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::class::{class_index, class_of_index, FastMap, LARGE, SMALL_CLASSES};
use super::fence::Fencer;
use super::PoolConfig;
use crate::driver::{DevicePtr, RawContext, RawStream};
use crate::stats::ClientStats;

/// A batch of freed blocks waiting for fence `seq`.
pub(super) struct Sealed {
    pub(super) seq: u64,
    pub(super) blocks: Vec<(DevicePtr, usize)>,
    pub(super) bytes: usize,
}

/// One shard's cache and statistics.
pub(super) struct Shard {
    /// Ready blocks by class index; classes above 256 MiB live in `large`.
    pub(super) ready: Vec<Vec<DevicePtr>>,
    pub(super) large: FastMap<usize, Vec<DevicePtr>>,
    pub(super) ready_bytes: usize,
    /// Freed without a stream, not yet sealed.
    pub(super) pending: Vec<(DevicePtr, usize)>,
    pub(super) pending_bytes: usize,
    /// Freed on a stream: reusable at once on that stream.
    pub(super) on_stream: FastMap<(RawStream, usize), Vec<DevicePtr>>,
    pub(super) stream_bytes: usize,
    /// Sealed batches, oldest first.
    pub(super) sealed: VecDeque<Sealed>,
    pub(super) sealed_bytes: usize,
    /// Emptied batch vectors, reused as the next `pending` (no allocation
    /// per batch in steady state).
    pub(super) spare: Vec<Vec<(DevicePtr, usize)>>,
    // Statistics, kept under the lock the allocation takes anyway (an atomic
    // counter shared by all threads would cost more than the rest of the
    // fast path). A block comes back to the shard that handed it out, so
    // each shard's live counts stay exact.
    pub(super) live_bytes: usize,
    pub(super) peak_bytes: usize,
    pub(super) alloc_count: u64,
    pub(super) hits: u64,
    pub(super) misses: u64,
    pub(super) fences: u64,
    /// Blocks handed out now, and the most at once, per class (for
    /// `memory_summary`; a vector index under the lock already held).
    pub(super) class_live: Vec<ClassCount>,
    pub(super) large_live: FastMap<usize, ClassCount>,
    /// Live bytes and count, and allocations, per client.
    pub(super) clients: [ClientStats; crate::Client::COUNT],
    /// Classes (by index, bit per class) this shard asked the helper to
    /// grow ahead, not yet served.
    pub(super) wanted: u128,
    /// Hand-outs that would ask for growth ahead but wait, after the helper
    /// found nothing to grow (a fence had made the stock up again): a tight
    /// loop on an idle GPU would otherwise wake it at every dip.
    pub(super) ahead_cooldown: u32,
    /// When (`fence::now_ns`) such a hand-out last looked whether the GPU
    /// turned busy (see `Pool::ahead_wanted`).
    pub(super) busy_look_ns: u64,
}

/// Blocks of one class handed out from one shard: now, and at most.
#[derive(Copy, Clone, Debug, Default)]
pub(super) struct ClassCount {
    pub(super) live: usize,
    pub(super) peak: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            ready: vec![Vec::new(); SMALL_CLASSES],
            large: FastMap::default(),
            ready_bytes: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            on_stream: FastMap::default(),
            stream_bytes: 0,
            sealed: VecDeque::new(),
            sealed_bytes: 0,
            spare: Vec::new(),
            live_bytes: 0,
            peak_bytes: 0,
            alloc_count: 0,
            hits: 0,
            misses: 0,
            fences: 0,
            class_live: vec![ClassCount::default(); SMALL_CLASSES],
            large_live: FastMap::default(),
            clients: Default::default(),
            wanted: 0,
            ahead_cooldown: 0,
            busy_look_ns: 0,
        }
    }
}

impl Shard {
    pub(super) fn take_ready(&mut self, class: usize) -> Option<DevicePtr> {
        let p = match class_index(class) {
            Some(i) => self.ready[i].pop()?,
            None => self.large.get_mut(&class)?.pop()?,
        };
        self.ready_bytes -= class;
        Some(p)
    }

    /// A ready block of the smallest class above `class` and at most
    /// `max` bytes, with its class.
    pub(super) fn take_ready_larger(
        &mut self,
        class: usize,
        max: usize,
    ) -> Option<(DevicePtr, usize)> {
        let mut found = None;
        if let Some(i) = class_index(class) {
            found = (i + 1..SMALL_CLASSES)
                .map(|j| (j, class_of_index(j)))
                .take_while(|&(_, c)| c <= max)
                .find(|&(j, _)| !self.ready[j].is_empty())
                .map(|(_, c)| c);
        }
        if found.is_none() && max > LARGE {
            found = self
                .large
                .iter()
                .filter(|(&c, v)| c > class && c <= max && !v.is_empty())
                .map(|(&c, _)| c)
                .min();
        }
        let c = found?;
        self.take_ready(c).map(|p| (p, c))
    }

    pub(super) fn put_ready(&mut self, ptr: DevicePtr, class: usize) {
        match class_index(class) {
            Some(i) => self.ready[i].push(ptr),
            None => self.large.entry(class).or_default().push(ptr),
        }
        self.ready_bytes += class;
    }

    /// Any ready block, with its class (the host cache's cap gives them
    /// back to the driver).
    pub(super) fn take_any_ready(&mut self) -> Option<(DevicePtr, usize)> {
        let found = match self
            .ready
            .iter_mut()
            .enumerate()
            .find(|(_, v)| !v.is_empty())
        {
            Some((i, v)) => v.pop().map(|p| (p, class_of_index(i))),
            None => self
                .large
                .iter_mut()
                .find_map(|(class, v)| v.pop().map(|p| (p, *class))),
        };
        if let Some((_, class)) = found {
            self.ready_bytes -= class;
        }
        found
    }

    pub(super) fn class_count(&mut self, class: usize) -> &mut ClassCount {
        match class_index(class) {
            Some(i) => &mut self.class_live[i],
            None => self.large_live.entry(class).or_default(),
        }
    }

    /// Every block this shard holds for reuse: its address, its class, and
    /// whether its fence is done (ready for anyone now).
    fn blocks(&self) -> impl Iterator<Item = (DevicePtr, usize, bool)> + '_ {
        let unfenced = self
            .pending
            .iter()
            .chain(self.sealed.iter().flat_map(|b| &b.blocks))
            .map(|&(p, class)| (p, class, false));
        let on_stream = self
            .on_stream
            .iter()
            .flat_map(|(&(_, class), v)| v.iter().map(move |&p| (p, class, false)));
        let ready = self.ready.iter().enumerate().flat_map(|(i, v)| {
            let class = class_of_index(i);
            v.iter().map(move |&p| (p, class, true))
        });
        let large = self
            .large
            .iter()
            .flat_map(|(&class, v)| v.iter().map(move |&p| (p, class, true)));
        unfenced.chain(on_stream).chain(ready).chain(large)
    }

    /// Blocks of each class this shard holds for reuse.
    pub(super) fn cached_by_class(&self, out: &mut FastMap<usize, usize>) {
        for (_, class, _) in self.blocks() {
            *out.entry(class).or_default() += 1;
        }
    }

    /// Blocks handed out now (the class counts hold them).
    pub(super) fn live_count(&self) -> usize {
        let small: usize = self.class_live.iter().map(|c| c.live).sum();
        small + self.large_live.values().map(|c| c.live).sum::<usize>()
    }

    /// A freed block that waits for the next fence.
    pub(super) fn put_pending(&mut self, ptr: DevicePtr, class: usize) {
        self.pending.push((ptr, class));
        self.pending_bytes += class;
    }

    pub(super) fn fence_due(&self, config: &PoolConfig) -> bool {
        self.pending.len() >= config.fence_count || self.pending_bytes >= config.fence_bytes
    }

    /// Whether stream-held blocks should go to the fence too: too many
    /// bytes wait on streams that may not allocate again.
    pub(super) fn streams_due(&self, config: &PoolConfig) -> bool {
        self.stream_bytes >= config.fence_bytes
    }

    /// Make ready every sealed batch whose fence is done; whether any was.
    pub(super) fn promote(&mut self, done: u64) -> bool {
        let mut any = false;
        while self.sealed.front().is_some_and(|b| b.seq <= done) {
            let mut batch = self.sealed.pop_front().expect("checked");
            self.sealed_bytes -= batch.bytes;
            for (ptr, class) in batch.blocks.drain(..) {
                self.put_ready(ptr, class);
            }
            self.spare.push(batch.blocks);
            self.fences += 1;
            any = true;
        }
        any
    }

    /// Seal the pending blocks (and, with `streams`, the stream-held ones)
    /// into one batch for a fence of `context`.
    pub(super) fn seal(&mut self, fencer: &Fencer, context: RawContext, streams: bool) {
        let streams = streams && self.stream_bytes != 0;
        if self.pending.is_empty() && !streams {
            return;
        }
        let next = self.spare.pop().unwrap_or_default();
        let mut blocks = std::mem::replace(&mut self.pending, next);
        let mut bytes = self.pending_bytes;
        self.pending_bytes = 0;
        if streams {
            for ((_, class), v) in self.on_stream.drain() {
                blocks.extend(v.into_iter().map(|p| (p, class)));
            }
            bytes += self.stream_bytes;
            self.stream_bytes = 0;
        }
        let seq = fencer.request(context);
        match self.sealed.back_mut() {
            // Requests before the helper starts share its fence.
            Some(last) if last.seq == seq => {
                last.blocks.append(&mut blocks);
                last.bytes += bytes;
                self.spare.push(blocks);
            }
            _ => self.sealed.push_back(Sealed { seq, blocks, bytes }),
        }
        self.sealed_bytes += bytes;
    }

    /// A block of `class` this shard may hand to an owner on `stream`
    /// without waiting. `done` (the fences done) is read only when no
    /// ready block is left: the fence thread writes it at every fence
    /// (every few frees of a tight loop on an idle GPU), and a hit that read
    /// it would fetch its cache line from that thread's core.
    #[inline]
    pub(super) fn take(
        &mut self,
        class: usize,
        stream: Option<RawStream>,
        done: impl FnOnce() -> u64,
    ) -> Option<DevicePtr> {
        if let Some(s) = stream {
            if let Some(p) = self.on_stream.get_mut(&(s, class)).and_then(Vec::pop) {
                self.stream_bytes -= class;
                return Some(p);
            }
        }
        if let Some(p) = self.take_ready(class) {
            return Some(p);
        }
        if self.promote(done()) {
            return self.take_ready(class);
        }
        None
    }

    /// Take one block of `class` out of a sealed batch (the oldest that has
    /// one), with the number of the fence it waits for.
    pub(super) fn claim_sealed(&mut self, class: usize) -> Option<(DevicePtr, u64)> {
        self.sealed.iter_mut().find_map(|batch| {
            let at = batch.blocks.iter().position(|b| b.1 == class)?;
            let (p, _) = batch.blocks.swap_remove(at);
            batch.bytes -= class;
            self.sealed_bytes -= class;
            Some((p, batch.seq))
        })
    }

    /// Every block the shard holds, into `out`, with whether its fence is
    /// done (ready for anyone now); the cache stays as it is (snapshots).
    pub(super) fn cached(&self, out: &mut FastMap<DevicePtr, bool>) {
        out.extend(self.blocks().map(|(p, _, ready)| (p, ready)));
    }

    /// Empty the cache into `out`: every block the shard holds, with its
    /// class and whether its fence is done (safe for anyone now).
    pub(super) fn drain(&mut self, out: &mut Vec<(DevicePtr, usize, bool)>) {
        out.extend(self.blocks());
        self.pending.clear();
        self.on_stream.clear();
        self.sealed.clear();
        self.ready.iter_mut().for_each(Vec::clear);
        self.large.clear();
        self.pending_bytes = 0;
        self.stream_bytes = 0;
        self.sealed_bytes = 0;
        self.ready_bytes = 0;
        // A request for growth ahead whose job can no longer run (its
        // context went) would otherwise never be asked again.
        self.wanted = 0;
    }
}

/// A shard on its own cache lines, so threads on neighbouring shards do not
/// slow each other down.
#[repr(align(128))]
pub(super) struct Padded(pub(super) Mutex<Shard>);

thread_local! {
    /// This thread's ticket; its shard in a pool of `n` is `ticket % n`
    /// (`n` is a power of two).
    static TICKET: Cell<usize> = const { Cell::new(usize::MAX) };
}

pub(super) fn ticket() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    TICKET.with(|t| {
        let mut v = t.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed);
            t.set(v);
        }
        v
    })
}
