//! The caching pool in front of `cuMemAlloc`, one per device.
//!
//! **The reuse rule.** numba's `memalloc` gets no stream, so a freed block
//! may still be in use by work queued on any stream. A freed block is first
//! *pending*. Before pending blocks are handed out again, the pool records
//! one event on the legacy default stream (a *fence*). The legacy stream
//! waits for all earlier work on every blocking stream, and all later work
//! on blocking streams (and on the legacy stream) waits for it. So whatever
//! the new owner queues on the legacy stream or on any blocking stream runs
//! after every use of the old owner. Work on non-blocking streams or the
//! per-thread default stream is not covered: synchronize such a stream
//! before dropping memory it uses.
//!
//! One fence covers a whole batch: it is recorded when a miss finds at least
//! [`PoolConfig::fence_count`] blocks or [`PoolConfig::fence_bytes`] pending,
//! or when the driver is out of memory. Smaller misses get fresh memory from
//! the driver, so in steady state one fence serves a batch of frees and the
//! common path makes no driver call.
//!
//! Blocks are whole `cuMemAlloc` allocations, never carved, so IPC
//! (`cuIpcGetMemHandle` on the block) works for pooled pointers.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::context::Context;
use crate::driver::{DevicePtr, RawEvent};
use crate::error::Result;
use crate::registry::Registration;

/// How a pool batches fences and rounds sizes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Fence once this many blocks are pending.
    pub fence_count: usize,
    /// Fence once this many bytes are pending.
    pub fence_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            // One ~0.4 us event record per 32 frees; the byte cap bounds how
            // much memory waits for a fence.
            fence_count: 32,
            fence_bytes: 64 << 20,
        }
    }
}

/// The size class of a request: at least 512 bytes; up to 256 MiB, four
/// classes per power of two (waste under 25%); above, a multiple of 2 MiB.
pub fn size_class(size: usize) -> usize {
    const MIN: usize = 512;
    const LARGE: usize = 256 << 20;
    if size <= MIN {
        return MIN;
    }
    if size > LARGE {
        return size.div_ceil(2 << 20) * (2 << 20);
    }
    let pow = usize::BITS - 1 - (size - 1).leading_zeros(); // 2^pow < size <= 2^(pow+1)
    let step = 1usize << (pow - 2);
    size.div_ceil(step) * step
}

/// Size classes and addresses are already well spread integers: hash them
/// as they are (SipHash costs more than the rest of an allocation).
#[derive(Default)]
struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        // Classes are multiples of 512: drop the always-zero bits.
        self.0 >> 9 ^ self.0.rotate_left(29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdentityHasher>>;

#[derive(Default)]
struct State {
    ready: FastMap<usize, Vec<DevicePtr>>,
    pending: Vec<(DevicePtr, usize)>,
    pending_bytes: usize,
    ready_bytes: usize,
    /// Registry entries of the blocks this pool holds from the driver.
    blocks: FastMap<DevicePtr, (usize, Registration)>,
    event: Option<RawEvent>,
    // Statistics, kept under the lock the allocation takes anyway (atomics
    // would cost more than the rest of the fast path).
    live_bytes: usize,
    live_count: usize,
    peak_bytes: usize,
    alloc_count: u64,
    hits: u64,
    misses: u64,
    fences: u64,
}

/// A snapshot of one pool's statistics.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolStats {
    pub live_bytes: usize,
    pub live_count: usize,
    pub peak_bytes: usize,
    pub alloc_count: u64,
    pub cached_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub fences: u64,
}

/// A device's caching pool. Use it through [`Context::alloc`].
pub struct Pool {
    config: PoolConfig,
    state: Mutex<State>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Pool {
    pub(crate) fn new(config: PoolConfig) -> Self {
        Pool {
            config,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handed_out(st: &mut State, size: usize, hit: bool) {
        st.live_bytes += size;
        st.live_count += 1;
        st.peak_bytes = st.peak_bytes.max(st.live_bytes);
        st.alloc_count += 1;
        if hit {
            st.hits += 1;
        } else {
            st.misses += 1;
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            live_bytes: st.live_bytes,
            live_count: st.live_count,
            peak_bytes: st.peak_bytes,
            alloc_count: st.alloc_count,
            cached_bytes: st.ready_bytes + st.pending_bytes,
            hits: st.hits,
            misses: st.misses,
            fences: st.fences,
        }
    }

    /// Record the fence and make every pending block ready.
    fn fence(&self, ctx: &Context, st: &mut State) -> Result<()> {
        if st.pending.is_empty() {
            return Ok(());
        }
        let drv = ctx.driver();
        let event = match st.event {
            Some(e) => e,
            None => {
                let e = drv.event_create(ctx.raw())?;
                st.event = Some(e);
                e
            }
        };
        drv.event_record(ctx.raw(), event, 0)?;
        for (ptr, class) in std::mem::take(&mut st.pending) {
            st.ready.entry(class).or_default().push(ptr);
        }
        st.ready_bytes += st.pending_bytes;
        st.pending_bytes = 0;
        st.fences += 1;
        Ok(())
    }

    fn take_ready(&self, st: &mut State, class: usize) -> Option<DevicePtr> {
        let p = st.ready.get_mut(&class)?.pop()?;
        st.ready_bytes -= class;
        Some(p)
    }

    /// A block of at least `size` bytes: `(address, class)`.
    pub(crate) fn alloc(
        &self,
        ctx: &std::sync::Arc<Context>,
        size: usize,
    ) -> Result<(DevicePtr, usize)> {
        let class = size_class(size);
        {
            let mut st = self.lock();
            if let Some(p) = self.take_ready(&mut st, class) {
                Self::handed_out(&mut st, size, true);
                return Ok((p, class));
            }
            let due = st.pending.len() >= self.config.fence_count
                || st.pending_bytes >= self.config.fence_bytes;
            if due {
                self.fence(ctx, &mut st)?;
                if let Some(p) = self.take_ready(&mut st, class) {
                    Self::handed_out(&mut st, size, true);
                    return Ok((p, class));
                }
            }
        }
        let got = match self.alloc_new(ctx, class) {
            Err(e) if e.is_oom() => {
                // Out of memory: reclaim what the pool caches, then retry once.
                {
                    let mut st = self.lock();
                    self.fence(ctx, &mut st)?;
                    if let Some(p) = self.take_ready(&mut st, class) {
                        Self::handed_out(&mut st, size, true);
                        return Ok((p, class));
                    }
                }
                self.trim(ctx)?;
                self.alloc_new(ctx, class)
            }
            other => other,
        }
        .map_err(|e| e.oom_on(ctx.device(), size))?;
        Self::handed_out(&mut self.lock(), size, false);
        Ok(got)
    }

    fn alloc_new(&self, ctx: &std::sync::Arc<Context>, class: usize) -> Result<(DevicePtr, usize)> {
        let p = ctx.driver().mem_alloc(ctx.raw(), class)?;
        let reg = ctx.runtime().registry().insert(p, class, ctx);
        self.lock().blocks.insert(p, (class, reg));
        Ok((p, class))
    }

    /// Take back a block of `size` requested bytes handed out by
    /// [`Pool::alloc`]. No driver call.
    pub(crate) fn release(&self, ptr: DevicePtr, class: usize, size: usize) {
        let mut st = self.lock();
        if !st.blocks.contains_key(&ptr) {
            return; // forgotten by a reset: not ours any more
        }
        st.live_bytes -= size;
        st.live_count -= 1;
        st.pending.push((ptr, class));
        st.pending_bytes += class;
    }

    /// Return every cached block to the driver (`cuMemFree`). Blocks still
    /// handed out are kept.
    pub fn trim(&self, ctx: &Context) -> Result<usize> {
        let blocks: Vec<(DevicePtr, usize, Registration)> = {
            let mut st = self.lock();
            let mut out = Vec::new();
            let pending = std::mem::take(&mut st.pending);
            let ready = std::mem::take(&mut st.ready);
            for (ptr, class) in pending.into_iter().chain(
                ready
                    .into_iter()
                    .flat_map(|(c, v)| v.into_iter().map(move |p| (p, c))),
            ) {
                if let Some((_, reg)) = st.blocks.remove(&ptr) {
                    out.push((ptr, class, reg));
                }
            }
            st.pending_bytes = 0;
            st.ready_bytes = 0;
            out
        };
        let mut freed = 0;
        let mut first_err = None;
        for (ptr, class, reg) in blocks {
            // cuMemFree waits for the device, so pending blocks are safe too.
            match ctx.driver().mem_free(ctx.raw(), ptr) {
                Ok(()) => {
                    ctx.runtime().registry().remove(reg);
                    freed += class;
                }
                Err(e) => {
                    // Still allocated: keep it cached, so nothing is lost.
                    let mut st = self.lock();
                    st.blocks.insert(ptr, (class, reg));
                    st.ready.entry(class).or_default().push(ptr);
                    st.ready_bytes += class;
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Forget every block without freeing it: the context was reset and the
    /// memory is gone. Blocks handed out before are refused on release.
    pub(crate) fn forget(&self, ctx: &Context) {
        let mut st = self.lock();
        for (_, (_, reg)) in st.blocks.drain() {
            ctx.runtime().registry().remove(reg);
        }
        st.ready.clear();
        st.pending.clear();
        st.pending_bytes = 0;
        st.ready_bytes = 0;
        st.event = None;
        st.live_bytes = 0;
        st.live_count = 0;
    }

    /// Bytes the pool holds for reuse (pending and ready).
    pub fn cached_bytes(&self) -> usize {
        let st = self.lock();
        st.ready_bytes + st.pending_bytes
    }

    /// Number of blocks the pool holds from the driver (cached or handed out).
    pub fn held_blocks(&self) -> usize {
        self.lock().blocks.len()
    }
}

impl Pool {
    /// Destroy the pool's event (at context teardown).
    pub(crate) fn close(&self, ctx: &Context) {
        if let Some(e) = self.lock().event.take() {
            let _ = ctx.driver().event_destroy(ctx.raw(), e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_with_bounded_waste() {
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(512), 512);
        assert_eq!(size_class(513), 640);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 18));
        assert_eq!(size_class((256 << 20) + 1), (256 << 20) + (2 << 20));
        for s in [600usize, 1000, 4097, 123_457, 9_999_999, 300 << 20] {
            let c = size_class(s);
            assert!(c >= s && (c - s) * 4 <= s.max(2 << 20), "{s} -> {c}");
        }
    }
}
