//! Allocations handed to another library's allocator interface (PyTorch's
//! pluggable allocator, CuPy's and RMM's allocation callbacks), by
//! address: the one record that keeps each alive until that library frees
//! its address through the same interface, and the library's own counts of
//! them, as PyTorch's `memory_stats()` reports its allocations.

use std::sync::{Arc, Mutex};

use super::Runtime;
use crate::error::Result;
use crate::memory::{DevicePointer, Origin};
use crate::pool::FastMap;
use crate::stats::{Client, LibraryStats};
use crate::sync::{lock, shard_of};

const SHARDS: usize = 64;

/// One shard of the record: address to allocation and the client that
/// holds it.
type Shard = FastMap<u64, (Arc<DevicePointer>, Client)>;

/// The record (see the module documentation): the allocations in shards,
/// so that threads rarely share a lock, and each device's counts by
/// client, under one lock per device (exact peaks, as PyTorch's).
pub(super) struct HandedOut {
    shards: [Mutex<Shard>; SHARDS],
    counts: Vec<Mutex<[LibraryStats; Client::COUNT]>>,
}

impl HandedOut {
    pub(super) fn new(devices: usize) -> Self {
        HandedOut {
            shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
            counts: (0..devices)
                .map(|_| Mutex::new([LibraryStats::default(); Client::COUNT]))
                .collect(),
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
    /// Record `mem` as handed to `client`'s allocator interface, counted in
    /// its [`LibraryStats`] first (so a free on another thread, which can
    /// find it only once recorded, never counts before it); its address.
    pub fn hand_out(&self, mem: Arc<DevicePointer>, client: Client) -> u64 {
        let (address, device) = (mem.address(), mem.context().device());
        let (requested, block) = (mem.size() as u64, block_bytes(&mem));
        self.handed.count(device, client, |c| {
            c.allocation.add(block, 1);
            c.allocated_bytes.add(block, block as u64);
            c.requested_bytes.add(block, requested);
        });
        self.handed.shard(address).insert(address, (mem, client));
        address
    }

    /// Take back what [`Runtime::hand_out`] recorded at `address` for
    /// `client` (dropping it releases it); `None` for an address not handed
    /// to `client` (another client's is left alone) or taken back already.
    pub fn take_back(&self, address: u64, client: Client) -> Option<Arc<DevicePointer>> {
        let mem = {
            let mut shard = self.handed.shard(address);
            match shard.get(&address) {
                Some((_, c)) if *c == client => shard.remove(&address).map(|(m, _)| m),
                _ => None,
            }
        }?;
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
}
