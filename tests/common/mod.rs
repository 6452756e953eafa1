//! Helpers shared by the simulator tests (each test file uses a subset).
#![allow(dead_code)]

use std::sync::Arc;

use gpuptr::{PoolConfig, Runtime, SimConfig, SimDriver};

/// Stream handles for the simulator's queued work: a non-blocking and a
/// blocking stream.
pub const NON_BLOCKING: usize = 0x7e57_0001;
pub const BLOCKING: usize = 0x7e57_0002;
/// Every stream kind: legacy (both handles), per-thread default, a blocking
/// and a non-blocking stream.
pub const STREAMS: [usize; 5] = [0, 1, 2, BLOCKING, NON_BLOCKING];

/// A simulator and a runtime without the pool, so driver-side counters
/// show each allocation and free directly.
pub fn sim(devices: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(devices, 1 << 20)));
    let rt = Runtime::with_pool(drv.clone(), None).unwrap();
    (drv, rt)
}

/// A simulator and a runtime with the default caching pool.
pub fn sim_pooled(devices: usize, memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(devices, memory)));
    let rt = Runtime::new(drv.clone()).unwrap();
    (drv, rt)
}

/// A pool with so many shards that two threads started one after the other
/// always land in different ones.
pub fn sim_sharded(memory: usize) -> (Arc<SimDriver>, Arc<Runtime>) {
    let drv = Arc::new(SimDriver::new(SimConfig::new(1, memory)));
    let cfg = PoolConfig {
        shards: 1024,
        ..PoolConfig::default()
    };
    let rt = Runtime::with_pool(drv.clone(), Some(cfg)).unwrap();
    (drv, rt)
}

/// Completes the simulator's queued work when dropped: a test that fails
/// while a kernel is queued then ends, instead of waiting for it in its
/// context's teardown.
pub struct EndsKernels<'a>(pub &'a SimDriver);

impl Drop for EndsKernels<'_> {
    fn drop(&mut self) {
        self.0.complete(None);
    }
}
