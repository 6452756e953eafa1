//! Graph memory: pool blocks a CUDA graph may still touch are not reused
//! while the graph can replay.
//!
//! A graph captured from a stream replays the kernels it captured, at the
//! addresses they had during the capture. So a block allocated during a
//! capture, or freed during it by the capturing thread, belongs to the
//! graph: when it is freed (during the capture or later) it goes to the
//! graph's [`Kept`] instead of the pool, and back to the pool only when the
//! graph is destroyed. PyTorch keeps graph memory in private pools for the
//! same reason; gpuptr ties it to the graph itself, through a CUDA user
//! object that the graph owns. The driver runs its destructor once the
//! graph and every executable graph made from it are destroyed and their
//! launches are done, whichever library made the graph.
//!
//! Which allocations belong to a capture: one made on a stream that takes
//! part in it (the driver says so), or, when the caller gave no stream, one
//! made by the thread that began it (CuPy and numba allocate with no
//! stream, on the capturing thread). Only captures announced by the thread
//! that began them ([`GraphMemory::start`]) keep memory: that thread alone
//! touches the graph being captured (CUDA's graphs are not thread-safe).
//!
//! A freed block may belong to several graphs at once (one graph's output,
//! freed during the capture of the next): each keeps it, and it goes back
//! to the pool when the last of them is destroyed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use crate::driver::{DevicePtr, Driver, RawContext, RawStream, STREAM_LEGACY, STREAM_PER_THREAD};
use crate::error::{Error, Result};
use crate::pool::Block;
use crate::sync::lock;

/// What a graph holds while it may replay: the context its blocks live in
/// (so their pool outlives the graph), known here only as the way back to
/// its device's [`GraphMemory`].
pub(crate) trait Owner: Send + Sync {
    /// The graph memory of the owner's device.
    fn graph_memory(&self) -> &GraphMemory;
    /// The device ordinal (for messages).
    fn device(&self) -> usize;
}

/// The memory one graph keeps: the blocks freed while it may replay.
pub(crate) struct Kept {
    /// The context the blocks live in.
    raw: RawContext,
    /// `None` once the graph was destroyed. A block shared by several
    /// graphs is one `Arc`, given back by the last to let go.
    blocks: Mutex<Option<Vec<Arc<Block>>>>,
    /// The graph owns the destructor: only then does it give the blocks back.
    armed: AtomicBool,
}

impl Kept {
    /// Keep `block` if the graph is alive (a destroyed one keeps nothing).
    fn keep(&self, block: &Arc<Block>) {
        if let Some(v) = lock(&self.blocks).as_mut() {
            v.push(block.clone());
        }
    }
}

/// A destroyed graph waiting to give its blocks back, with the owner it
/// held (dropped only after they went back, on a caller's thread).
type Dead = (Arc<Kept>, Arc<dyn Owner>);

/// A capture under way that keeps memory.
struct Active {
    id: u64,
    stream: RawStream,
    /// The thread that began it.
    thread: ThreadId,
    kept: Arc<Kept>,
}

/// Shards of the map of tagged blocks: frees on many threads rarely share one.
const TAG_SHARDS: usize = 16;

/// The graphs a live block allocated during captures belongs to (every
/// capture it may take part in), with the reset epoch it was made in (a
/// stale pointer's address may be reused).
type Tag = (u64, Vec<Arc<Kept>>);

/// One device's graph memory (see the module documentation).
#[derive(Default)]
pub(crate) struct GraphMemory {
    active_n: AtomicUsize,
    active: Mutex<Vec<Active>>,
    tagged_n: AtomicUsize,
    /// Live blocks allocated during a capture, by address, in shards.
    tagged: [Mutex<HashMap<DevicePtr, Tag>>; TAG_SHARDS],
    /// Bytes freed and kept by graphs.
    bytes: AtomicUsize,
    /// Graphs whose destructor ran, waiting to give their blocks back on a
    /// thread of gpuptr's caller: the destructor may run on a driver
    /// thread, where no CUDA call (such as a context's teardown) may be
    /// made. Held while they are given back, so a caller that finds it
    /// empty knows every destroyed graph's blocks are back.
    dead: Mutex<Vec<Dead>>,
    dead_n: AtomicUsize,
}

impl GraphMemory {
    /// Hand each destroyed graph's blocks that no other live graph keeps
    /// to `give_back`, with the context they live in (one load when no
    /// graph was destroyed).
    #[inline]
    pub(crate) fn bury(
        &self,
        mut give_back: impl FnMut(RawContext, &mut dyn Iterator<Item = Block>),
    ) {
        if self.dead_n.load(Ordering::Acquire) != 0 {
            self.bury_now(&mut give_back);
        }
    }

    #[cold]
    fn bury_now(&self, give_back: &mut dyn FnMut(RawContext, &mut dyn Iterator<Item = Block>)) {
        let mut dead = lock(&self.dead);
        let gone = std::mem::take(&mut *dead);
        self.dead_n.fetch_sub(gone.len(), Ordering::AcqRel);
        for (k, _) in &gone {
            let blocks = lock(&k.blocks).take().unwrap_or_default();
            let mut unshared = blocks.into_iter().filter_map(Arc::into_inner).inspect(|b| {
                self.bytes.fetch_sub(b.size, Ordering::Relaxed);
            });
            give_back(k.raw, &mut unshared);
        }
        drop(dead);
        // Outside the lock: the last holder of a context may end it here.
        drop(gone);
    }

    /// Whether a capture that keeps memory is under way.
    #[inline]
    pub(crate) fn watching(&self) -> bool {
        self.active_n.load(Ordering::Acquire) != 0
    }

    /// The capture `stream` takes part in now begins to keep memory (a
    /// second call for the same capture does nothing). `Err` if `stream`
    /// is not capturing. The graph holds `owner`, whose context is `raw`
    /// (of `driver`), until it is destroyed.
    ///
    /// # Safety
    /// `stream` is a live stream of `raw` that the calling thread began
    /// capturing, and it stays alive until the capture has ended and the
    /// device heard so ([`GraphMemory::end`]): only the capturing thread
    /// may touch the graph being captured.
    pub(crate) unsafe fn start(
        &self,
        driver: &dyn Driver,
        raw: RawContext,
        owner: Arc<dyn Owner>,
        stream: RawStream,
    ) -> Result<()> {
        // SAFETY: this fn's contract.
        let Some((id, graph)) = (unsafe { capture_of(driver, raw, stream) })? else {
            return Err(Error::InvalidArgument(format!(
                "stream {stream:#x} is not capturing"
            )));
        };
        let mut active = lock(&self.active);
        if active.iter().any(|a| a.id == id) {
            return Ok(());
        }
        let kept = Arc::new(Kept {
            raw,
            blocks: Mutex::new(Some(Vec::new())),
            armed: AtomicBool::new(false),
        });
        // The graph holds its `Kept` and its owner through the destructor
        // (the lists here hold no owner: the device owns them).
        let owned = kept.clone();
        let held = owner.clone();
        let on_destroy = Box::new(move || {
            if owned.armed.load(Ordering::Acquire) {
                // Never the last holder dropped here (maybe a driver
                // thread): the blocks go back on a caller's thread (`bury`),
                // which drops the owner after.
                let graphs = held.graph_memory();
                let mut dead = lock(&graphs.dead);
                graphs.dead_n.fetch_add(1, Ordering::AcqRel);
                dead.push((owned, held.clone()));
                drop(dead);
                // Not the last holder: the one in the list holds it too.
                drop(held);
            } else {
                // Run at once because the graph refused it: the graph
                // lives on with the memory, which is never reused.
                std::mem::forget((owned, held));
            }
        });
        // SAFETY: `graph` is the graph of the capture this thread runs on
        // `stream` (this fn's contract), which the driver just returned; the
        // capture cannot end meanwhile (this thread would end it).
        let attached = crate::driver::relaxed(driver, || unsafe {
            driver.graph_on_destroy(raw, graph, on_destroy)
        });
        match attached {
            Ok(()) => kept.armed.store(true, Ordering::Release),
            Err(e) => {
                log::warn!(
                    target: "gpuptr::pool",
                    "device {}: cannot tie capture {} to its graph ({}): the memory it keeps stays kept until exit",
                    owner.device(),
                    id,
                    e
                );
                // The graph lives on for good as far as gpuptr knows: its
                // memory is never reused, so its `Kept` and its owner are
                // never dropped.
                std::mem::forget((kept.clone(), owner));
            }
        }
        active.push(Active {
            id,
            stream,
            thread: std::thread::current().id(),
            kept,
        });
        self.active_n.store(active.len(), Ordering::Release);
        Ok(())
    }

    /// Captures that have ended keep no more new memory (their graphs keep
    /// what they have). Called when a capture ends on the device.
    pub(crate) fn end(&self, driver: &dyn Driver, raw: RawContext) {
        let mut active = lock(&self.active);
        active.retain(|a| {
            // SAFETY: the stream was capturing in `raw` when it was noted,
            // and stays alive until the device hears its capture ended
            // (`start`'s contract): this is that call.
            let now = unsafe { capture_of(driver, raw, a.stream) };
            matches!(now, Ok(Some((id, _))) if id == a.id)
        });
        self.active_n.store(active.len(), Ordering::Release);
    }

    /// The tag shard of `address`.
    fn tags(&self, address: DevicePtr) -> std::sync::MutexGuard<'_, HashMap<DevicePtr, Tag>> {
        lock(&self.tagged[crate::sync::shard_of(address, TAG_SHARDS)])
    }

    /// A block allocated at `address` in reset epoch `epoch` while a capture
    /// is under way: it belongs to the announced capture its stream takes
    /// part in (`seen`) and to every capture this thread began.
    pub(crate) fn tag(
        &self,
        driver: &dyn Driver,
        raw: RawContext,
        address: DevicePtr,
        epoch: u64,
        seen: Option<RawStream>,
    ) {
        if !self.watching() {
            return;
        }
        let on_stream = match seen {
            Some(s) if s != 0 && s != STREAM_LEGACY && s != STREAM_PER_THREAD => {
                // SAFETY: a stream the caller allocates on, live in `raw`.
                match unsafe { capture_of(driver, raw, s) } {
                    Ok(Some((id, _))) => {
                        let active = lock(&self.active);
                        active.iter().find(|a| a.id == id).map(|a| a.kept.clone())
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        let mut graphs = self.on_this_thread();
        if let Some(k) = on_stream {
            if !graphs.iter().any(|g| Arc::ptr_eq(g, &k)) {
                graphs.push(k);
            }
        }
        if !graphs.is_empty()
            && self
                .tags(address)
                .insert(address, (epoch, graphs))
                .is_none()
        {
            self.tagged_n.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Forget the tag of a stale block at `address` (its context was reset
    /// since epoch `epoch`, so it goes back to no pool).
    pub(crate) fn untag(&self, address: DevicePtr, epoch: u64) {
        if self.tagged_n.load(Ordering::Acquire) != 0 {
            let mut tags = self.tags(address);
            if tags.get(&address).is_some_and(|t| t.0 == epoch) {
                tags.remove(&address);
                self.tagged_n.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Every capture under way that the calling thread began (a thread
    /// may capture several streams at once).
    fn on_this_thread(&self) -> Vec<Arc<Kept>> {
        if !self.watching() {
            return Vec::new();
        }
        let me = std::thread::current().id();
        let active = lock(&self.active);
        let mine = active.iter().filter(|a| a.thread == me);
        mine.map(|a| a.kept.clone()).collect()
    }

    /// A pool block is being freed: keep it for its graphs (`None`), or
    /// hand it back to the caller to release (`Some`). A block allocated
    /// during a capture whose graph lives, and one freed during a capture
    /// by the capturing thread, are kept (by every such graph, until the
    /// last of them is destroyed).
    #[inline]
    pub(crate) fn keep(&self, block: Block) -> Option<Block> {
        if self.tagged_n.load(Ordering::Acquire) == 0 && !self.watching() {
            return Some(block);
        }
        self.keep_slow(block)
    }

    #[cold]
    fn keep_slow(&self, block: Block) -> Option<Block> {
        let tag = {
            let mut tags = self.tags(block.address);
            let t = tags.remove(&block.address);
            if t.is_some() {
                self.tagged_n.fetch_sub(1, Ordering::AcqRel);
            }
            // A tag from another epoch was a stale pointer's: not this block's.
            t.filter(|t| t.0 == block.epoch)
                .map(|t| t.1)
                .unwrap_or_default()
        };
        // The captures this thread runs now, but for the tag's own.
        let mut now = self.on_this_thread();
        now.retain(|n| !tag.iter().any(|t| Arc::ptr_eq(t, n)));
        if tag.is_empty() && now.is_empty() {
            return Some(block);
        }
        let size = block.size;
        // Counted before any owner can give it back (and count it out).
        self.bytes.fetch_add(size, Ordering::Relaxed);
        let shared = Arc::new(block);
        for k in tag.iter().chain(&now) {
            k.keep(&shared);
        }
        // No live graph took it (each was destroyed meanwhile): the caller
        // releases it. Otherwise the last graph to go gives it back.
        let mine = Arc::into_inner(shared);
        if mine.is_some() {
            self.bytes.fetch_sub(size, Ordering::Relaxed);
        }
        mine
    }

    /// Bytes that graphs keep now (freed, not yet reusable).
    pub(crate) fn kept_bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// The capture `stream` takes part in, if any (relaxed mode: asking never
/// disturbs a capture).
///
/// # Safety
/// `stream` is a live stream of `raw` (or a default-stream handle).
unsafe fn capture_of(
    driver: &dyn Driver,
    raw: RawContext,
    stream: RawStream,
) -> Result<Option<(u64, usize)>> {
    // SAFETY: this fn's contract.
    crate::driver::relaxed(driver, || unsafe { driver.stream_capture(raw, stream) })
}
