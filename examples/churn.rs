//! What a tight alloc+free churn does to the pool: time per pair, misses,
//! fences, growths ahead of demand, and the bytes the pool holds after it.
//!
//! `cargo run --release --example churn -- [sim|cuda] [threads] [pairs]`
//! runs it with growth ahead on (the default), off, and on under a 1 GiB
//! pool limit (a miss at the limit waits for the fence), side by side. Each
//! round spawns fresh threads, as criterion's multi-thread rows do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use gpuptr::driver::{self, DriverChoice};
use gpuptr::{Driver, PoolConfig, Runtime, SimConfig, SimDriver};

/// Counts the pool's "grew ahead" records (the runtime logs one per growth).
struct Growths(AtomicU64);

impl log::Log for Growths {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.target() == "gpuptr::pool" && m.level() <= log::Level::Debug
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) && r.args().to_string().contains("grew ahead") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn flush(&self) {}
}

static GROWTHS: Growths = Growths(AtomicU64::new(0));

fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "sim".into());
    let threads: usize = args.next().map_or(4, |s| s.parse().expect("threads"));
    let pairs: u64 = args.next().map_or(200_000, |s| s.parse().expect("pairs"));
    log::set_logger(&GROWTHS).expect("one logger");
    log::set_max_level(log::LevelFilter::Debug);
    let drv: Arc<dyn Driver> = match which.as_str() {
        "cuda" => driver::open(DriverChoice::Cuda).expect("the CUDA driver"),
        _ => Arc::new(SimDriver::new(SimConfig::new(1, 8 << 30))),
    };
    for (ahead, limit) in [
        (64usize << 20, None),
        (0, None),
        (64 << 20, Some(1usize << 30)),
    ] {
        let config = PoolConfig {
            ahead_bytes: ahead,
            ..PoolConfig::default()
        };
        let rt = Runtime::with_pool(drv.clone(), Some(config)).expect("runtime");
        rt.set_pool_limit(0, limit).expect("limit");
        let ctx = rt.context(0).expect("context 0");
        GROWTHS.0.store(0, Ordering::Relaxed);
        for round in 0..5 {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    let ctx = ctx.clone();
                    s.spawn(move || {
                        for _ in 0..pairs {
                            std::hint::black_box(ctx.alloc(1 << 20).expect("alloc"));
                        }
                    });
                }
            });
            let ns = start.elapsed().as_nanos() as f64 / pairs as f64;
            let st = &rt.stats()[0];
            println!(
                "{which} ahead={:>2}MiB limit={:>4} threads={threads} round {round}: {ns:7.1} ns/pair  misses {:>5}  fences {:>7}  growths {:>4}  pool {:>6} MiB  pending {:>5} MiB",
                ahead >> 20,
                limit.map_or("none".into(), |l| format!("{}G", l >> 30)),
                st.pool_misses,
                st.fences,
                GROWTHS.0.load(Ordering::Relaxed),
                st.pool_bytes >> 20,
                st.pending_bytes >> 20,
            );
        }
    }
}
