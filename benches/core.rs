//! Criterion benches of the core's own costs. They run over the simulator
//! (isolating gpuptr's overhead) and, where libcuda works, over CudaDriver.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use gpuptr::driver::{self, DriverChoice};
use gpuptr::{Driver, Runtime, SimConfig, SimDriver};

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

fn bench(c: &mut Criterion) {
    for (name, rt) in runtimes() {
        let ctx = rt.context(0).unwrap();
        c.bench_function(&format!("{name}/context_clone_drop"), |b| {
            b.iter(|| black_box(ctx.clone()))
        });
        c.bench_function(&format!("{name}/alloc_free_4KiB"), |b| {
            b.iter(|| black_box(ctx.alloc(4096).unwrap()))
        });
        let mem = ctx.alloc(1 << 20).unwrap();
        let all = mem.view_all();
        c.bench_function(&format!("{name}/view"), |b| {
            b.iter(|| black_box(all.view(black_box(64), Some(4096)).unwrap()))
        });
        let inside = mem.address() + 1000;
        c.bench_function(&format!("{name}/registry_lookup_hit"), |b| {
            b.iter(|| black_box(rt.registry().lookup(black_box(inside))))
        });
        c.bench_function(&format!("{name}/registry_lookup_miss"), |b| {
            b.iter(|| black_box(rt.registry().lookup(black_box(0x10))))
        });
        c.bench_function(&format!("{name}/wrap_known_range"), |b| {
            b.iter(|| black_box(rt.wrap(inside, 64, None, None).unwrap()))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
