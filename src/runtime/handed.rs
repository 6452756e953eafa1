//! Allocations handed to another library's allocator interface (PyTorch's
//! pluggable allocator, CuPy's and RMM's allocation callbacks), by
//! address: the one record that keeps each alive until that library frees
//! its address through the same interface, the library's own counts of
//! them, as PyTorch's `memory_stats()` reports its allocations, and the
//! library's memory pools over them.
//!
//! A library's memory pool (PyTorch's `MemPool`: `torch.cuda.use_mem_pool`,
//! a CUDA graph tree's pool, `torch.cuda.graph(pool=…)`) is a tag here,
//! not memory of its own: while a thread (or every thread) allocates to a
//! pool, what is handed to that library on that device is noted under the
//! pool's id, and forgotten when it is taken back. The memory itself comes
//! from, and goes back to, the one pool every library shares; the tags
//! only answer what a pool holds.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::Runtime;
use crate::error::Result;
use crate::memory::{DevicePointer, Origin};
use crate::pool::FastMap;
use crate::stats::{Client, LibraryStats, MemPoolStats};
use crate::sync::{lock, shard_of};

const SHARDS: usize = 64;

/// One shard of the record: address to allocation and the client that
/// holds it.
type Shard = FastMap<u64, (Arc<DevicePointer>, Client)>;

/// A library's memory pool's id (PyTorch's `MempoolId_t`: two integers).
pub type PoolId = (u64, u64);

/// Where a thread's allocations go: a runtime's record (by address), a
/// client, a device, and the pool.
type Begun = (usize, Client, usize, PoolId);

thread_local! {
    /// The pools this thread allocates to, latest last.
    static MINE: RefCell<Vec<Begun>> = const { RefCell::new(Vec::new()) };
}

/// The pools' tags (see the module documentation).
#[derive(Default)]
struct Tags {
    /// Pools begun for every thread, latest last.
    all_threads: Vec<Begun>,
    /// Tagged allocations: address to (device, pool, bytes asked for).
    live: HashMap<u64, (usize, PoolId, usize)>,
    /// Counts by (client, device, pool).
    counts: HashMap<(Client, usize, PoolId), MemPoolStats>,
}

/// The record (see the module documentation): the allocations in shards,
/// so that threads rarely share a lock, each device's counts by client,
/// under one lock per device (exact peaks, as PyTorch's), and the pools'
/// tags (one load each way while no pool is begun).
pub(super) struct HandedOut {
    shards: [Mutex<Shard>; SHARDS],
    counts: Vec<Mutex<[LibraryStats; Client::COUNT]>>,
    tags: Mutex<Tags>,
    /// This record's identity in threads' lists of begun pools: unique in
    /// the process (an address could be a dropped runtime's).
    id: usize,
    /// Pools begun on some thread: zero means nothing is tagged now.
    active: AtomicUsize,
    /// Live tagged allocations: zero means no take-back looks them up.
    tagged: AtomicUsize,
}

impl HandedOut {
    pub(super) fn new(devices: usize) -> Self {
        HandedOut {
            shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
            counts: (0..devices)
                .map(|_| Mutex::new([LibraryStats::default(); Client::COUNT]))
                .collect(),
            tags: Mutex::default(),
            id: {
                static NEXT: AtomicUsize = AtomicUsize::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            active: AtomicUsize::new(0),
            tagged: AtomicUsize::new(0),
        }
    }

    /// The pool an allocation of `client` on `device` by this thread goes
    /// to now, if any.
    fn current_pool(&self, client: Client, device: usize) -> Option<PoolId> {
        let me = (self.id, client, device);
        let find = |v: &[Begun]| v.iter().rev().find(|b| (b.0, b.1, b.2) == me).map(|b| b.3);
        let mine = MINE.try_with(|m| find(&m.borrow())).ok().flatten();
        mine.or_else(|| find(&lock(&self.tags).all_threads))
    }

    /// Note `address` (`size` bytes asked for) under the pool this thread
    /// allocates to for `client` on `device`, if any.
    fn tag(&self, client: Client, device: usize, address: u64, size: usize) {
        if self.active.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some(pool) = self.current_pool(client, device) else {
            return;
        };
        let mut t = lock(&self.tags);
        if t.live.insert(address, (device, pool, size)).is_none() {
            self.tagged.fetch_add(1, Ordering::AcqRel);
        }
        let c = t.counts.entry((client, device, pool)).or_default();
        c.live += 1;
        c.live_bytes += size as u64;
        c.peak_bytes = c.peak_bytes.max(c.live_bytes);
        c.allocations += 1;
        c.allocated_bytes += size as u64;
    }

    /// `address` of `client` was taken back: its pool forgets it.
    fn untag(&self, client: Client, address: u64) {
        if self.tagged.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut t = lock(&self.tags);
        let Some((device, pool, size)) = t.live.remove(&address) else {
            return;
        };
        self.tagged.fetch_sub(1, Ordering::AcqRel);
        if let Some(c) = t.counts.get_mut(&(client, device, pool)) {
            c.live = c.live.saturating_sub(1);
            c.live_bytes = c.live_bytes.saturating_sub(size as u64);
            c.frees += 1;
            c.freed_bytes += size as u64;
        }
    }

    fn shard(&self, address: u64) -> std::sync::MutexGuard<'_, Shard> {
        lock(&self.shards[shard_of(address, SHARDS)])
    }

    fn count(&self, device: usize, client: Client, f: impl FnOnce(&mut LibraryStats)) {
        if let Some(c) = self.counts.get(device) {
            f(&mut lock(c)[client.index()]);
        }
    }
}

/// The bytes an allocation takes: its pool block's, or its own.
fn block_bytes(mem: &DevicePointer) -> usize {
    match mem.origin() {
        Origin::Pool(class) => class,
        _ => mem.size(),
    }
}

impl Runtime {
    /// Record `mem` as handed to `client`'s allocator interface, tagged to
    /// the pool this thread allocates to (see [`Runtime::begin_pool`]) and
    /// counted in its [`LibraryStats`] before it is recorded (so a free on
    /// another thread, which can find it only then, never counts or untags
    /// before it); its address. Memory already recorded is counted once.
    pub fn hand_out(&self, mem: Arc<DevicePointer>, client: Client) -> u64 {
        let (address, device) = (mem.address(), mem.context().device());
        let (requested, block) = (mem.size() as u64, block_bytes(&mem));
        let mut shard = self.handed.shard(address);
        let slot = match shard.entry(address) {
            Entry::Vacant(slot) => slot,
            // An entry of a context reset since (its memory went with it)
            // at an address the driver has handed out again gives way:
            // kept, it would pass the new allocation off as another handle
            // of itself, and dropping that would free memory its caller
            // holds.
            Entry::Occupied(e) if e.get().0.is_stale() => {
                let dead = e.get().1;
                drop(shard);
                drop(self.take_back(address, dead));
                return self.hand_out(mem, client);
            }
            // Handed out already (its holder keeps the address from reuse):
            // this is another handle of the same memory, counted once.
            Entry::Occupied(_) => return address,
        };
        self.handed.tag(client, device, address, mem.size());
        self.handed.count(device, client, |c| {
            c.allocation.add(block, 1);
            c.allocated_bytes.add(block, block as u64);
            c.requested_bytes.add(block, requested);
        });
        slot.insert((mem, client));
        address
    }

    /// `size` bytes of `device`'s pool for `client`'s allocator interface,
    /// made on `stream` (stream-ordered; `None`: freed through the fence)
    /// and handed out ([`Runtime::hand_out`]) until taken back; 0 for zero
    /// bytes. The runtime holds the device's context for it
    /// ([`Runtime::held_context`]): an interface keeps none between calls,
    /// and without the hold freeing its last allocation would end the
    /// context and its pool. `site` says where the allocation was made,
    /// when the leak report or the history asks.
    pub fn alloc_for(
        self: &Arc<Self>,
        client: Client,
        device: usize,
        size: usize,
        stream: Option<crate::RawStream>,
        site: impl FnOnce() -> crate::Site,
    ) -> Result<u64> {
        self.hand_out_new(client, device, size, |ctx| {
            ctx.alloc_at(size, stream, client, site)
        })
    }

    /// [`Runtime::alloc_for`] by a caller whose current stream `seen` is
    /// known (PyTorch's): a capture under way on it keeps the memory for
    /// its graph.
    ///
    /// # Safety
    /// `seen` is a live stream of `device`'s context while this runs.
    pub unsafe fn alloc_seen_for(
        self: &Arc<Self>,
        client: Client,
        device: usize,
        size: usize,
        stream: Option<crate::RawStream>,
        seen: crate::RawStream,
        site: impl FnOnce() -> crate::Site,
    ) -> Result<u64> {
        self.hand_out_new(client, device, size, |ctx| {
            // SAFETY: this fn's contract.
            unsafe { ctx.alloc_seen_at(size, stream, seen, client, site) }
        })
    }

    /// What [`Runtime::alloc_for`] and [`Runtime::alloc_seen_for`] share:
    /// null for zero bytes, else `make` in `device`'s held context, handed
    /// out.
    fn hand_out_new(
        self: &Arc<Self>,
        client: Client,
        device: usize,
        size: usize,
        make: impl FnOnce(&Arc<crate::Context>) -> Result<Arc<DevicePointer>>,
    ) -> Result<u64> {
        if size == 0 {
            return Ok(0);
        }
        let mem = make(&self.held_context(device)?)?;
        Ok(self.hand_out(mem, client))
    }

    /// Take back what `client` was handed at `address` and let it go: an
    /// allocation made stream-ordered on `stream` where given (reused there
    /// at once), else as it was made (one made with no stream, through the
    /// fence); whether `client` held it (another client's, or one taken
    /// back already, is left alone).
    pub fn free_for(&self, address: u64, client: Client, stream: Option<crate::RawStream>) -> bool {
        let Some(mem) = self.take_back(address, client) else {
            return false;
        };
        if let (Some(s), Some(_)) = (stream, mem.stream()) {
            mem.release_on(s);
        }
        // The last holder releases it (a loan may hold it longer).
        drop(mem);
        true
    }

    /// Take back what [`Runtime::hand_out`] recorded at `address` for
    /// `client` (dropping it releases it); `None` for an address not handed
    /// to `client` (another client's is left alone) or taken back already.
    pub fn take_back(&self, address: u64, client: Client) -> Option<Arc<DevicePointer>> {
        let mem = {
            let mut shard = self.handed.shard(address);
            match shard.entry(address) {
                Entry::Occupied(e) if e.get().1 == client => {
                    // Untagged before it goes: a pool's listing never shows
                    // an allocation its library has let go.
                    self.handed.untag(client, address);
                    e.remove().0
                }
                _ => return None,
            }
        };
        let (requested, block) = (mem.size() as u64, block_bytes(&mem));
        self.handed.count(mem.context().device(), client, |c| {
            c.allocation.sub(block, 1);
            c.allocated_bytes.sub(block, block as u64);
            c.requested_bytes.sub(block, requested);
        });
        Some(mem)
    }

    /// The allocation handed to `client` at `address` (any client's with
    /// `None`), still recorded.
    pub fn handed_out(&self, address: u64, client: Option<Client>) -> Option<Arc<DevicePointer>> {
        match self.handed.shard(address).get(&address) {
            Some((mem, c)) if client.is_none_or(|want| want == *c) => Some(mem.clone()),
            _ => None,
        }
    }

    /// How many allocations are handed out (every client).
    pub fn handed_out_count(&self) -> usize {
        self.handed.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// `client`'s counts on `device`.
    pub fn library_stats(&self, device: usize, client: Client) -> Result<LibraryStats> {
        self.check_device(device)?;
        Ok(lock(&self.handed.counts[device])[client.index()])
    }

    /// An out-of-memory error given to `client` on `device`.
    pub fn library_out_of_memory(&self, device: usize, client: Client) {
        self.handed.count(device, client, |c| c.num_ooms += 1);
    }

    /// `client`'s peaks on `device` become the values now, as do the
    /// pool's there (one pool: its peak is the library's).
    pub fn reset_library_peaks(&self, device: usize, client: Client) -> Result<()> {
        self.reset_device_peak_stats(device)?;
        self.handed.count(device, client, LibraryStats::reset_peak);
        Ok(())
    }

    /// `client`'s totals on `device` start again from zero (PyTorch's
    /// `reset_accumulated_memory_stats`): its allocated and freed counts
    /// and out-of-memory errors, and the pool's segment totals and retries
    /// as the library reports them, from their values now.
    pub fn reset_library_accumulated(&self, device: usize, client: Client) -> Result<()> {
        let s = self.device_stats(device)?;
        self.handed.count(device, client, |c| {
            c.reset_accumulated(s.segments, s.num_alloc_retries)
        });
        Ok(())
    }

    /// `client`'s allocations on `device` go to `pool` from now: this
    /// thread's, or every thread's with `all_threads`, until
    /// [`Runtime::end_pool`].
    pub fn begin_pool(&self, client: Client, device: usize, pool: PoolId, all_threads: bool) {
        let begun = (self.handed.id, client, device, pool);
        if all_threads {
            lock(&self.handed.tags).all_threads.push(begun);
        } else {
            let _ = MINE.try_with(|m| m.borrow_mut().push(begun));
        }
        self.handed.active.fetch_add(1, Ordering::AcqRel);
    }

    /// `client`'s allocations on `device` no longer go to `pool` (the
    /// latest begin of it on this thread, else for all threads). Whether
    /// one was under way.
    pub fn end_pool(&self, client: Client, device: usize, pool: PoolId) -> bool {
        let begun = (self.handed.id, client, device, pool);
        let remove = |v: &mut Vec<Begun>| match v.iter().rposition(|b| *b == begun) {
            Some(i) => {
                v.remove(i);
                true
            }
            None => false,
        };
        let ended = MINE
            .try_with(|m| remove(&mut m.borrow_mut()))
            .unwrap_or(false)
            || remove(&mut lock(&self.handed.tags).all_threads);
        if ended {
            self.handed.active.fetch_sub(1, Ordering::AcqRel);
        }
        ended
    }

    /// The live allocations of `pool` on `device`: `(address, bytes asked
    /// for)` pairs, by address.
    pub fn pool_live(&self, device: usize, pool: PoolId) -> Vec<(u64, usize)> {
        let t = lock(&self.handed.tags);
        let mut v: Vec<(u64, usize)> = t
            .live
            .iter()
            .filter(|(_, (d, id, _))| *d == device && *id == pool)
            .map(|(a, (_, _, s))| (*a, *s))
            .collect();
        v.sort_unstable();
        v
    }

    /// The counts of `client`'s `pool` on `device` (zeros for a pool that
    /// never allocated).
    pub fn pool_stats(&self, client: Client, device: usize, pool: PoolId) -> MemPoolStats {
        let t = lock(&self.handed.tags);
        t.counts
            .get(&(client, device, pool))
            .copied()
            .unwrap_or_default()
    }
}
