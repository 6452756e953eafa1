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
//! stream, on the capturing thread).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use crate::context::Context;
use crate::driver::{DevicePtr, RawStream, STREAM_LEGACY, STREAM_PER_THREAD};
use crate::error::{Error, Result};
use crate::stats::Client;
use crate::sync::lock;

/// One pool block a graph keeps.
#[derive(Debug)]
pub(crate) struct KeptBlock {
    pub(crate) epoch: u64,
    pub(crate) address: DevicePtr,
    pub(crate) class: usize,
    pub(crate) shard: u16,
    pub(crate) size: usize,
    pub(crate) client: Client,
}

/// The memory one graph keeps: the blocks freed while it may replay.
pub(crate) struct Kept {
    /// The context the blocks live in: held, so its pool outlives the graph.
    ctx: Arc<Context>,
    /// `None` once the graph was destroyed.
    blocks: Mutex<Option<Vec<KeptBlock>>>,
    /// The graph owns the destructor: only then does it give the blocks back.
    armed: AtomicBool,
}

impl Kept {
    /// Keep `block` if the graph is alive; `Err` gives it back if not.
    fn keep(&self, block: KeptBlock) -> std::result::Result<(), KeptBlock> {
        match lock(&self.blocks).as_mut() {
            Some(v) => {
                let graphs = self.ctx.state().graphs();
                graphs.bytes.fetch_add(block.size, Ordering::Relaxed);
                v.push(block);
                Ok(())
            }
            None => Err(block),
        }
    }

    /// The graph is gone: hand every kept block back to the pool, through
    /// its fence (no driver call here, no wait).
    fn give_back(&self) {
        let blocks = lock(&self.blocks).take().unwrap_or_default();
        let (ctx, n) = (&self.ctx, blocks.len());
        let bytes: usize = blocks.iter().map(|b| b.size).sum();
        let graphs = ctx.state().graphs();
        graphs.bytes.fetch_sub(bytes, Ordering::Relaxed);
        for b in blocks {
            ctx.state().pool_release(
                ctx.raw(),
                b.epoch,
                b.address,
                b.class,
                u32::from(b.shard),
                b.size,
                None,
                b.client,
            );
        }
        if n != 0 {
            log::debug!(
                target: "gpuptr::pool",
                "device {}: a CUDA graph was destroyed; its {} block(s) ({} bytes) go back to the pool",
                ctx.device(),
                n,
                bytes
            );
        }
    }
}

/// A capture under way that keeps memory.
struct Active {
    id: u64,
    stream: RawStream,
    /// The thread that began it, if it said so ([`GraphMemory::start`]).
    thread: Option<ThreadId>,
    kept: Arc<Kept>,
}

/// One device's graph memory (see the module documentation).
#[derive(Default)]
pub(crate) struct GraphMemory {
    active_n: AtomicUsize,
    active: Mutex<Vec<Active>>,
    tagged_n: AtomicUsize,
    /// Live blocks allocated during a capture, by address.
    tagged: Mutex<HashMap<DevicePtr, Arc<Kept>>>,
    /// Bytes freed and kept by graphs.
    bytes: AtomicUsize,
    /// Graphs whose destructor ran, waiting to give their blocks back on a
    /// thread of gpuptr's caller: the destructor may run on a driver
    /// thread, where no CUDA call (such as a context's teardown) may be
    /// made. Held while they are given back, so a caller that finds it
    /// empty knows every destroyed graph's blocks are back.
    dead: Mutex<Vec<Arc<Kept>>>,
    dead_n: AtomicUsize,
}

impl GraphMemory {
    /// Give back the memory of this device's destroyed graphs, if any (one
    /// load when none).
    #[inline]
    pub(crate) fn bury(&self) {
        if self.dead_n.load(Ordering::Acquire) != 0 {
            self.bury_now();
        }
    }

    #[cold]
    fn bury_now(&self) {
        let mut dead = lock(&self.dead);
        let gone = std::mem::take(&mut *dead);
        self.dead_n.fetch_sub(gone.len(), Ordering::AcqRel);
        for k in &gone {
            k.give_back();
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
    /// is not capturing.
    ///
    /// # Safety
    /// `stream` is a live stream of `ctx` (or a default-stream handle).
    pub(crate) unsafe fn start(&self, ctx: &Arc<Context>, stream: RawStream) -> Result<()> {
        self.bury();
        // SAFETY: this fn's contract.
        match unsafe { capture_of(ctx, stream) }? {
            Some((id, graph)) => {
                self.join(ctx, stream, id, graph, true);
                Ok(())
            }
            None => Err(Error::InvalidArgument(format!(
                "stream {stream:#x} is not capturing"
            ))),
        }
    }

    /// The active capture `id` (graph `graph`, on `stream`), made now if
    /// new; `mine`: the calling thread began it.
    fn join(
        &self,
        ctx: &Arc<Context>,
        stream: RawStream,
        id: u64,
        graph: usize,
        mine: bool,
    ) -> Arc<Kept> {
        let me = std::thread::current().id();
        let mut active = lock(&self.active);
        if let Some(a) = active.iter_mut().find(|a| a.id == id) {
            if mine {
                a.thread = Some(me);
            }
            return a.kept.clone();
        }
        let kept = Arc::new(Kept {
            ctx: ctx.clone(),
            blocks: Mutex::new(Some(Vec::new())),
            armed: AtomicBool::new(false),
        });
        // The graph holds its `Kept` through the destructor.
        let owned = kept.clone();
        let on_destroy = Box::new(move || {
            if owned.armed.load(Ordering::Acquire) {
                // Never the last holder dropped here (maybe a driver
                // thread): the blocks go back on a caller's thread (`bury`).
                // (Not the last holder of the device either: `owned` holds
                // its context, which holds it.)
                let state = owned.ctx.state().clone();
                let graphs = state.graphs();
                let mut dead = lock(&graphs.dead);
                graphs.dead_n.fetch_add(1, Ordering::AcqRel);
                dead.push(owned);
            } else {
                // Run at once because the graph refused it: the graph
                // lives on with the memory, which is never reused.
                std::mem::forget(owned);
            }
        });
        let driver = ctx.driver();
        // SAFETY: `graph` is the graph of the capture under way on `stream`,
        // which the driver just returned.
        let attached = crate::driver::relaxed(driver, || unsafe {
            driver.graph_on_destroy(ctx.raw(), graph, on_destroy)
        });
        match attached {
            Ok(()) => kept.armed.store(true, Ordering::Release),
            Err(e) => log::warn!(
                target: "gpuptr::pool",
                "device {}: cannot tie capture {} to its graph ({}): the memory it keeps stays kept until exit",
                ctx.device(),
                id,
                e
            ),
        }
        active.push(Active {
            id,
            stream,
            thread: mine.then_some(me),
            kept: kept.clone(),
        });
        self.active_n.store(active.len(), Ordering::Release);
        // A graph that could not be tied to stays alive for good (its
        // memory is never reused), so its `Kept` is never dropped.
        if !kept.armed.load(Ordering::Acquire) {
            std::mem::forget(kept.clone());
        }
        kept
    }

    /// Captures that have ended keep no more new memory (their graphs keep
    /// what they have). Called when a capture ends on the device.
    pub(crate) fn end(&self, ctx: &Context) {
        self.bury();
        let mut active = lock(&self.active);
        active.retain(|a| {
            // SAFETY: the stream was capturing in `ctx` when it was noted,
            // and the caller keeps it alive through the capture.
            let now = unsafe { capture_of(ctx, a.stream) };
            matches!(now, Ok(Some((id, _))) if id == a.id)
        });
        self.active_n.store(active.len(), Ordering::Release);
    }

    /// A block allocated at `address` while a capture is under way: it
    /// belongs to the capture its stream takes part in (`seen`, if given),
    /// or, with no stream, to the capture begun on this thread.
    pub(crate) fn tag(&self, ctx: &Arc<Context>, address: DevicePtr, seen: Option<RawStream>) {
        let kept = match seen {
            Some(s) if s != 0 && s != STREAM_LEGACY && s != STREAM_PER_THREAD => {
                // SAFETY: a stream the caller allocates on, live in `ctx`.
                match unsafe { capture_of(ctx, s) } {
                    Ok(Some((id, graph))) => Some(self.join(ctx, s, id, graph, false)),
                    _ => None,
                }
            }
            _ => self.on_this_thread(),
        };
        if let Some(k) = kept {
            let mut tagged = lock(&self.tagged);
            tagged.insert(address, k);
            self.tagged_n.store(tagged.len(), Ordering::Release);
        }
    }

    /// The capture begun on the calling thread, if any.
    fn on_this_thread(&self) -> Option<Arc<Kept>> {
        if !self.watching() {
            return None;
        }
        let me = std::thread::current().id();
        let active = lock(&self.active);
        active
            .iter()
            .find(|a| a.thread == Some(me))
            .map(|a| a.kept.clone())
    }

    /// A pool block is being freed: keep it for its graph (`None`), or
    /// hand it back to the caller to release (`Some`). A block allocated
    /// during a capture whose graph lives, or freed during a capture by
    /// the capturing thread, is kept.
    #[inline]
    pub(crate) fn keep(&self, block: KeptBlock) -> Option<KeptBlock> {
        if self.tagged_n.load(Ordering::Acquire) == 0 && !self.watching() {
            return Some(block);
        }
        self.keep_slow(block)
    }

    #[cold]
    fn keep_slow(&self, block: KeptBlock) -> Option<KeptBlock> {
        let owner = {
            let mut tagged = lock(&self.tagged);
            let k = tagged.remove(&block.address);
            self.tagged_n.store(tagged.len(), Ordering::Release);
            k
        };
        let Some(kept) = owner.or_else(|| self.on_this_thread()) else {
            return Some(block);
        };
        kept.keep(block).err()
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
/// `stream` is a live stream of `ctx` (or a default-stream handle).
unsafe fn capture_of(ctx: &Context, stream: RawStream) -> Result<Option<(u64, usize)>> {
    let driver = ctx.driver();
    // SAFETY: this fn's contract.
    crate::driver::relaxed(driver, || unsafe {
        driver.stream_capture(ctx.raw(), stream)
    })
}
