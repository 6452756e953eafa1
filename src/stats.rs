//! The one vocabulary of gpuptr's statistics: which library asked
//! ([`Client`]), the counters a device keeps for driver allocations, the
//! pool's own per-shard counts, and the snapshots both make.
//!
//! Two kinds of counters feed one [`DeviceStats`]: driver allocations are
//! counted in shared atomics ([`DeviceCounters`]), and pool blocks under the
//! shard lock that the allocation takes anyway ([`PoolStats`], summed over
//! shards): a shared atomic on the pool's fast path would cost more than
//! the rest of it. A device's snapshot adds the two; its peak is the larger
//! of the two peaks (they need not coincide).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Which library asked for an allocation, for per-client statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Client {
    /// gpuptr's own API (Python `gpuptr.alloc`, Rust `Context::alloc`).
    #[default]
    Direct = 0,
    /// numba, through the `gpuptr.numba` memory manager.
    Numba = 1,
    /// CuPy, through `gpuptr.cupy`.
    Cupy = 2,
    /// PyTorch, through `gpuptr.torch`.
    Torch = 3,
    /// cuda.core, through `gpuptr.cuda_core`'s memory resources.
    CudaCore = 4,
    /// RMM (and RAPIDS through it), through `gpuptr.rmm`'s device memory
    /// resource.
    Rmm = 5,
}

impl Client {
    /// Every client, in index order.
    pub const ALL: [Client; Client::COUNT] = [
        Client::Direct,
        Client::Numba,
        Client::Cupy,
        Client::Torch,
        Client::CudaCore,
        Client::Rmm,
    ];
    /// How many clients there are.
    pub const COUNT: usize = 6;

    /// Its name: `"direct"`, `"numba"`, `"cupy"`, `"torch"`, `"cuda_core"`
    /// or `"rmm"`.
    pub fn name(self) -> &'static str {
        match self {
            Client::Direct => "direct",
            Client::Numba => "numba",
            Client::Cupy => "cupy",
            Client::Torch => "torch",
            Client::CudaCore => "cuda_core",
            Client::Rmm => "rmm",
        }
    }

    /// The client of that name.
    pub fn from_name(name: &str) -> Option<Client> {
        Client::ALL.into_iter().find(|c| c.name() == name)
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Allocation counters of one device (allocations made outside the pool).
#[derive(Default, Debug)]
pub(crate) struct DeviceCounters {
    pub live_bytes: AtomicUsize,
    pub live_count: AtomicUsize,
    pub peak_bytes: AtomicUsize,
    pub alloc_count: AtomicU64,
    /// Allocations that failed as out of memory (after the pool's retry).
    pub ooms: AtomicU64,
    /// Allocations the pool retried after giving its cache back.
    pub alloc_retries: AtomicU64,
    /// Live bytes, live count and allocations per client.
    clients: [[AtomicU64; 3]; Client::COUNT],
}

impl DeviceCounters {
    /// Count a driver allocation of `size` bytes (pool blocks are counted by
    /// the pool).
    pub(crate) fn allocated(&self, size: usize, client: Client) {
        self.alloc_count.fetch_add(1, Ordering::Relaxed);
        self.live_count.fetch_add(1, Ordering::Relaxed);
        let live = self.live_bytes.fetch_add(size, Ordering::Relaxed) + size;
        self.peak_bytes.fetch_max(live, Ordering::Relaxed);
        let [bytes, count, allocs] = &self.clients[client.index()];
        bytes.fetch_add(size as u64, Ordering::Relaxed);
        count.fetch_add(1, Ordering::Relaxed);
        allocs.fetch_add(1, Ordering::Relaxed);
    }

    /// Count the release of a driver allocation. Never below zero: a
    /// reset zeroes the counts, and an allocation counted just before it
    /// may be released after.
    pub(crate) fn released(&self, size: usize, client: Client) {
        fn sub(a: &AtomicU64, n: u64) {
            let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
        }
        for (a, n) in [(&self.live_count, 1), (&self.live_bytes, size)] {
            let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(n))
            });
        }
        let [bytes, count, _] = &self.clients[client.index()];
        sub(bytes, size as u64);
        sub(count, 1);
    }

    pub(crate) fn client_stats(&self, client: Client) -> ClientStats {
        let [bytes, count, allocs] = &self.clients[client.index()];
        ClientStats {
            live_bytes: bytes.load(Ordering::Relaxed) as usize,
            live_count: count.load(Ordering::Relaxed) as usize,
            alloc_count: allocs.load(Ordering::Relaxed),
        }
    }

    /// A reset: nothing is live any more.
    pub(crate) fn forget_live(&self) {
        self.live_bytes.store(0, Ordering::Relaxed);
        self.live_count.store(0, Ordering::Relaxed);
        for [bytes, count, _] in &self.clients {
            bytes.store(0, Ordering::Relaxed);
            count.store(0, Ordering::Relaxed);
        }
    }
}

/// One client's share of a device's allocations ([`Client`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Bytes in its live allocations.
    pub live_bytes: usize,
    /// Its live allocations.
    pub live_count: usize,
    /// Allocations it made so far.
    pub alloc_count: u64,
}

impl std::ops::AddAssign for ClientStats {
    fn add_assign(&mut self, o: ClientStats) {
        self.live_bytes += o.live_bytes;
        self.live_count += o.live_count;
        self.alloc_count += o.alloc_count;
    }
}

/// A snapshot of one device's allocation counters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Device ordinal.
    pub device: usize,
    /// Bytes in live allocations made by gpuptr.
    pub live_bytes: usize,
    /// Number of live allocations made by gpuptr.
    pub live_count: usize,
    /// The most `live_bytes` has been.
    pub peak_bytes: usize,
    /// Allocations made so far.
    pub alloc_count: u64,
    /// Bytes the pool holds for reuse (ready, on a stream's list, or
    /// waiting for a fence).
    pub cached_bytes: usize,
    /// The part of `cached_bytes` waiting for a fence: freed blocks that
    /// queued work may still use.
    pub pending_bytes: usize,
    /// Allocations served from the pool's cache.
    pub pool_hits: u64,
    /// Allocations that went to the driver.
    pub pool_misses: u64,
    /// Fences completed (each makes a batch of freed blocks reusable).
    pub fences: u64,
    /// The live allocations per client, in [`Client::ALL`] order.
    pub clients: [ClientStats; Client::COUNT],
    /// Bytes the pool holds from the driver (handed out or cached).
    pub pool_bytes: usize,
    /// The cap on `pool_bytes`, if one is set ([`Runtime::set_pool_limit`](crate::Runtime::set_pool_limit)).
    pub pool_limit: Option<usize>,
    /// The most `pool_bytes` has been (PyTorch's `max_memory_reserved`).
    pub peak_pool_bytes: usize,
    /// Bytes held from the driver: the pool's, and live allocations that
    /// bypass it (PyTorch's `memory_reserved`).
    pub reserved_bytes: usize,
    /// Allocations that failed as out of memory, after the pool gave its
    /// cache back and retried (PyTorch's `num_ooms`).
    pub num_ooms: u64,
    /// Allocations the pool retried after giving its cache back to the
    /// driver (PyTorch's `num_alloc_retries`).
    pub num_alloc_retries: u64,
    /// The cache of pinned host memory (all zero without a pool).
    pub host: HostStats,
    /// The pool's driver allocations, as PyTorch counts segments (all
    /// zero without a pool).
    pub segments: SegmentStats,
}

/// One statistic as PyTorch keeps it: its value now, the most it has been
/// since the last peak reset, and the totals added to it and taken from
/// it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// The value now.
    pub current: u64,
    /// The most `current` has been since the last peak reset.
    pub peak: u64,
    /// The total added to it.
    pub allocated: u64,
    /// The total taken from it.
    pub freed: u64,
}

impl Stat {
    /// Add `n`.
    #[inline]
    pub fn add(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    /// Take `n` away (never below zero: a reset may have zeroed it first).
    #[inline]
    pub fn sub(&mut self, n: u64) {
        self.current = self.current.saturating_sub(n);
        self.freed += n;
    }

    /// Make the peak the value now.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A statistic split as PyTorch splits its pools: requests of at most
/// 1 MiB (its small pool) and larger ones (its large pool), and both.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ByPool {
    /// Small and large together (its peak is the peak of the sum).
    pub all: Stat,
    /// Blocks (or segments of blocks) of at most 1 MiB.
    pub small: Stat,
    /// Larger ones.
    pub large: Stat,
}

impl ByPool {
    /// The largest block size PyTorch's small pool serves.
    pub const SMALL_MAX: usize = 1 << 20;

    /// Add `n` to the pool that blocks of `block` bytes belong to.
    #[inline]
    pub fn add(&mut self, block: usize, n: u64) {
        self.all.add(n);
        self.of(block).add(n);
    }

    /// Take `n` from the pool that blocks of `block` bytes belong to.
    #[inline]
    pub fn sub(&mut self, block: usize, n: u64) {
        self.all.sub(n);
        self.of(block).sub(n);
    }

    #[inline]
    fn of(&mut self, block: usize) -> &mut Stat {
        if block <= Self::SMALL_MAX {
            &mut self.small
        } else {
            &mut self.large
        }
    }

    /// Make every peak the value now.
    pub fn reset_peak(&mut self) {
        for s in [&mut self.all, &mut self.small, &mut self.large] {
            s.reset_peak();
        }
    }

    /// Take everything current away (a reset took the memory).
    pub(crate) fn clear(&mut self) {
        let (small, large) = (self.small.current, self.large.current);
        self.all.sub(small + large);
        self.small.sub(small);
        self.large.sub(large);
    }
}

/// One of a library's memory pools (PyTorch's `MemPool`) on one device,
/// as its tags count it ([`Runtime::begin_pool`](crate::Runtime::begin_pool)):
/// in bytes asked for.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MemPoolStats {
    /// Live allocations.
    pub live: u64,
    /// Their bytes.
    pub live_bytes: u64,
    /// The most bytes live at once.
    pub peak_bytes: u64,
    /// Allocations made in the pool.
    pub allocations: u64,
    /// Their bytes.
    pub allocated_bytes: u64,
    /// Allocations of the pool freed.
    pub frees: u64,
    /// Their bytes.
    pub freed_bytes: u64,
}

/// What another library holds on a device through its allocator
/// interface ([`Runtime::hand_out`](crate::Runtime::hand_out)), counted as
/// PyTorch's `memory_stats()` counts its own allocations: live
/// allocations, their blocks' bytes and the bytes asked for, each by pool
/// with exact peaks; the out-of-memory errors it was given; and where its
/// totals of the pool's segments and retries start (see
/// [`Runtime::reset_library_accumulated`](crate::Runtime::reset_library_accumulated)).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LibraryStats {
    /// Live allocations (PyTorch's `allocation` and `active`).
    pub allocation: ByPool,
    /// Their blocks' bytes (`allocated_bytes` and `active_bytes`).
    pub allocated_bytes: ByPool,
    /// The bytes asked for (`requested_bytes`).
    pub requested_bytes: ByPool,
    /// Out-of-memory errors given to the library (`num_ooms`).
    pub num_ooms: u64,
    /// The pool's segment totals at the last reset of the totals, which
    /// the library's start from.
    pub segments_base: SegmentStats,
    /// The pool's retries then.
    pub retries_base: u64,
}

impl LibraryStats {
    /// Make every peak the value now.
    pub fn reset_peak(&mut self) {
        self.allocation.reset_peak();
        self.allocated_bytes.reset_peak();
        self.requested_bytes.reset_peak();
    }

    /// Start the totals again from zero, the pool's from `segments` and
    /// `retries`.
    pub(crate) fn reset_accumulated(&mut self, segments: SegmentStats, retries: u64) {
        for b in [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
        ] {
            for st in [&mut b.all, &mut b.small, &mut b.large] {
                (st.allocated, st.freed) = (0, 0);
            }
        }
        self.num_ooms = 0;
        self.segments_base = segments;
        self.retries_base = retries;
    }
}

/// What a device's pool holds from the driver, as PyTorch counts its
/// segments: driver allocations (`segment`) and their bytes
/// (`reserved_bytes`), split by the size of the blocks in them. The
/// totals count every allocation made (`allocated`) and freed (`freed`)
/// since the pool began.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SegmentStats {
    /// Driver allocations.
    pub count: ByPool,
    /// Their bytes.
    pub bytes: ByPool,
}

impl SegmentStats {
    pub(crate) fn made(&mut self, class: usize, bytes: usize) {
        self.count.add(class, 1);
        self.bytes.add(class, bytes as u64);
    }

    pub(crate) fn freed(&mut self, class: usize, bytes: usize) {
        self.count.sub(class, 1);
        self.bytes.sub(class, bytes as u64);
    }

    pub(crate) fn reset_peak(&mut self) {
        self.count.reset_peak();
        self.bytes.reset_peak();
    }
}

/// A snapshot of one device's cache of pinned host memory (`alloc_host`,
/// CuPy's pinned allocator and numba's pinned and mapped arrays through
/// gpuptr); registered memory is not in it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Bytes of pinned blocks held from the driver (handed out or cached).
    pub held_bytes: usize,
    /// Bytes handed out now (as requested).
    pub live_bytes: usize,
    /// Blocks handed out now.
    pub live_count: usize,
    /// Bytes cached for reuse: ready, or waiting for a fence.
    pub cached_bytes: usize,
    /// The part of `cached_bytes` waiting for a fence.
    pub pending_bytes: usize,
    /// Allocations served from the cache.
    pub hits: u64,
    /// Allocations that went to the driver.
    pub misses: u64,
    /// The most bytes the cache keeps ([`PoolConfig::host_cache_bytes`](crate::PoolConfig::host_cache_bytes)).
    pub cache_limit: usize,
}

/// A snapshot of one pool's statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolStats {
    pub live_bytes: usize,
    pub live_count: usize,
    /// The sum of the shards' peaks: the peak of `live_bytes` when one
    /// thread allocates, an upper bound of it when several do.
    pub peak_bytes: usize,
    pub alloc_count: u64,
    /// Every byte held for reuse: ready, on a stream's list, or pending.
    pub cached_bytes: usize,
    /// The part of `cached_bytes` waiting for a fence.
    pub pending_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub fences: u64,
    pub clients: [ClientStats; Client::COUNT],
}

/// One size class of a pool, in blocks of `class` bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// The block size.
    pub class: usize,
    /// Blocks handed out now.
    pub live_blocks: usize,
    /// The most handed out at once (an upper bound when several threads
    /// allocate).
    pub peak_blocks: usize,
    /// Blocks held for reuse (ready, on a stream, or waiting for a fence).
    pub cached_blocks: usize,
}

impl DeviceCounters {
    /// Make the peak equal to the live bytes now.
    pub(crate) fn reset_peak(&self) {
        self.peak_bytes
            .store(self.live_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl DeviceStats {
    /// Device `device`'s snapshot: its driver allocations' counters plus
    /// its pool's, which holds `pool_bytes` from the driver under `limit`.
    pub(crate) fn combine(
        device: usize,
        c: &DeviceCounters,
        p: PoolStats,
        pool_bytes: usize,
        peak_pool_bytes: usize,
        pool_limit: Option<usize>,
        host: HostStats,
    ) -> DeviceStats {
        DeviceStats {
            device,
            live_bytes: c.live_bytes.load(Ordering::Relaxed) + p.live_bytes,
            live_count: c.live_count.load(Ordering::Relaxed) + p.live_count,
            // Peaks of the two kinds may not coincide: report the larger.
            peak_bytes: c.peak_bytes.load(Ordering::Relaxed).max(p.peak_bytes),
            alloc_count: c.alloc_count.load(Ordering::Relaxed) + p.alloc_count,
            cached_bytes: p.cached_bytes,
            pending_bytes: p.pending_bytes,
            pool_hits: p.hits,
            pool_misses: p.misses,
            fences: p.fences,
            clients: Client::ALL.map(|k| {
                let mut s = c.client_stats(k);
                s += p.clients[k.index()];
                s
            }),
            pool_bytes,
            pool_limit,
            peak_pool_bytes,
            reserved_bytes: pool_bytes + c.live_bytes.load(Ordering::Relaxed),
            num_ooms: c.ooms.load(Ordering::Relaxed),
            num_alloc_retries: c.alloc_retries.load(Ordering::Relaxed),
            host,
            segments: SegmentStats::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Client;

    #[test]
    fn every_client_is_listed_once_in_index_order_under_its_own_name() {
        for (i, c) in Client::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i, "{c:?}");
            assert_eq!(Client::from_name(c.name()), Some(c));
        }
        assert_eq!(Client::from_name("rmm"), Some(Client::Rmm));
        assert_eq!(Client::from_name("jax"), None);
    }
}
