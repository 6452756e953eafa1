//! Criterion benches of the core's own costs. They run over the simulator
//! (isolating gpuptr's overhead) and, where libcuda works, over CudaDriver.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use gpuptr::driver::{self, DriverChoice};
use gpuptr::{Driver, PoolConfig, Runtime, SimConfig, SimDriver};

fn runtimes() -> Vec<(&'static str, Arc<Runtime>)> {
    let mut out = vec![(
        "sim",
        Runtime::new(Arc::new(SimDriver::new(SimConfig::new(1, 1 << 30)))).unwrap(),
    )];
    if let Ok(d) = driver::open(DriverChoice::Cuda) {
        let d: Arc<dyn Driver> = d;
        out.push(("cuda", Runtime::new(d).unwrap()));
    }
    out
}

/// Wall time per 1 MiB alloc+free pair with `threads` threads each making
/// `iters` pairs, all contending for the pool.
fn pairs_on_threads(ctx: &Arc<gpuptr::Context>, threads: u32, iters: u64) -> std::time::Duration {
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let ctx = ctx.clone();
            s.spawn(move || {
                for _ in 0..iters {
                    black_box(ctx.alloc(1 << 20).unwrap());
                }
            });
        }
    });
    start.elapsed() / threads
}

/// The allocations of CuPy's `b = a * 2 + 1` on a fresh array, through the
/// runtime's entry for a library's hook (`alloc_for`/`free_for`, what the
/// CuPy hooks call), on one stream: `a`, the temporary `a * 2` and `b` of
/// one size (log-uniform, 1 KiB to 64 MiB, seeded), the temporary and `a`
/// freed, the last 20 `b` kept. Time per step of three allocations.
fn cupy_pattern(rt: &Arc<Runtime>, iters: u64) -> std::time::Duration {
    use gpuptr::{Client, Site};
    let stream = Some(0x5000 as gpuptr::RawStream);
    let site = || Site::Described("bench".into());
    let mut kept = std::collections::VecDeque::new();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let start = std::time::Instant::now();
    for _ in 0..iters {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let size = (1024.0 * 65536f64.powf((x >> 11) as f64 / (1u64 << 53) as f64)) as usize;
        let a = rt.alloc_for(Client::Cupy, 0, size, stream, site).unwrap();
        let t = rt.alloc_for(Client::Cupy, 0, size, stream, site).unwrap();
        let b = rt.alloc_for(Client::Cupy, 0, size, stream, site).unwrap();
        rt.free_for(t, Client::Cupy, None);
        rt.free_for(a, Client::Cupy, None);
        kept.push_back(b);
        if kept.len() > 20 {
            rt.free_for(kept.pop_front().unwrap(), Client::Cupy, None);
        }
    }
    let took = start.elapsed();
    for b in kept {
        rt.free_for(b, Client::Cupy, None);
    }
    took
}

fn bench(c: &mut Criterion) {
    for (name, rt) in runtimes() {
        let ctx = rt.context(0).unwrap();
        c.bench_function(&format!("{name}/context_clone_drop"), |b| {
            b.iter(|| black_box(ctx.clone()))
        });
        for (label, size) in [("512B", 512usize), ("64KiB", 64 << 10), ("1MiB", 1 << 20)] {
            c.bench_function(&format!("{name}/pool_alloc_free_{label}"), |b| {
                b.iter(|| black_box(ctx.alloc(size).unwrap()))
            });
        }
        c.bench_function(&format!("{name}/context_clone_drop_4_threads"), |b| {
            b.iter_custom(|iters| {
                let start = std::time::Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..4 {
                        let ctx = &ctx;
                        s.spawn(move || {
                            for _ in 0..iters {
                                black_box(ctx.clone());
                            }
                        });
                    }
                });
                start.elapsed() / 4
            })
        });
        for threads in [4u32, 16] {
            c.bench_function(
                &format!("{name}/pool_alloc_free_1MiB_{threads}_threads"),
                |b| b.iter_custom(|iters| pairs_on_threads(&ctx, threads, iters)),
            );
        }
        c.bench_function(&format!("{name}/cupy_pattern_3_allocs"), |b| {
            b.iter_custom(|iters| cupy_pattern(&rt, iters))
        });
        let mem = ctx.alloc(1 << 20).unwrap();
        let all = mem.view_all();
        c.bench_function(&format!("{name}/view"), |b| {
            b.iter(|| black_box(all.view(black_box(64), Some(4096)).unwrap()))
        });
        let inside = mem.address() + 1000;
        c.bench_function(&format!("{name}/context_of_registered"), |b| {
            b.iter(|| black_box(rt.context_of(black_box(inside)).unwrap()))
        });
        c.bench_function(&format!("{name}/wrap_known_range"), |b| {
            b.iter(|| black_box(rt.wrap(inside, 64, None, None).unwrap()))
        });
    }
}

/// The driver calls the pool's design weighs (CUDA only): the fence
/// thread's `cuCtxSynchronize` on an idle device, and what a miss costs.
fn driver_calls(c: &mut Criterion) {
    let Ok(drv) = driver::open(DriverChoice::Cuda) else {
        return;
    };
    let rt = Runtime::new(drv.clone()).unwrap();
    let ctx = rt.context(0).unwrap();
    c.bench_function("cuda/driver/ctx_synchronize_idle", |b| {
        b.iter(|| ctx.synchronize().unwrap())
    });
    c.bench_function("cuda/driver/mem_alloc+free_1MiB", |b| {
        b.iter(|| {
            drop(black_box(
                gpuptr::DevicePointer::alloc_uncached(&ctx, 1 << 20).unwrap(),
            ))
        })
    });
    let mem = ctx.alloc(1 << 20).unwrap();
    c.bench_function("cuda/driver/pointer_attributes", |b| {
        b.iter(|| black_box(drv.pointer_attributes(mem.address() + 64).unwrap()))
    });
}

/// What the fence thread's pace buys: the pool pair with the helper fencing
/// back to back (pace 0) against the default pace, one thread and four.
fn fence_pace(c: &mut Criterion) {
    let mut drivers: Vec<(&str, Arc<dyn Driver>)> =
        vec![("sim", Arc::new(SimDriver::new(SimConfig::new(1, 1 << 30))))];
    if let Ok(d) = driver::open(DriverChoice::Cuda) {
        drivers.push(("cuda", d));
    }
    for (name, drv) in drivers {
        for pace_us in [0u64, 20] {
            let config = PoolConfig {
                fence_pace: std::time::Duration::from_micros(pace_us),
                ..PoolConfig::default()
            };
            let rt = Runtime::with_pool(drv.clone(), Some(config)).unwrap();
            let ctx = rt.context(0).unwrap();
            c.bench_function(
                &format!("{name}/pace_{pace_us}us/pool_alloc_free_1MiB"),
                |b| b.iter(|| black_box(ctx.alloc(1 << 20).unwrap())),
            );
            c.bench_function(
                &format!("{name}/pace_{pace_us}us/pool_alloc_free_1MiB_4_threads"),
                |b| b.iter_custom(|iters| pairs_on_threads(&ctx, 4, iters)),
            );
        }
    }
}

criterion_group!(benches, bench, driver_calls, fence_pace);
criterion_main!(benches);
