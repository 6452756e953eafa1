//! The README's Rust example, as it is printed there (`tests/test_readme.py`
//! checks that the README's block is this file's, word for word).
//!
//! `cargo test` builds it and runs it on the simulator (the test below);
//! `GPUPTR_DRIVER=sim cargo run --example readme` runs it by hand.

// README: begin
use gpuptr::Runtime;

fn main() -> gpuptr::Result<()> {
    let rt = Runtime::global()?; // GPUPTR_DRIVER=auto|cuda|sim
    let ctx = rt.context(0)?; // Arc<Context>: the retained primary context
    let mem = ctx.alloc(1 << 20)?; // Arc<DevicePointer>, from the pool, released on last drop
    let view = mem.view_all().view(0, Some(4096))?;
    view.memset(0, None)?; // all 4096 bytes; Some(n): the first n
    assert_eq!(rt.context_of(view.address())?.device(), 0);
    println!("{} bytes zeroed on device {}", view.size(), ctx.device());
    // 4096 bytes zeroed on device 0
    Ok(())
}
// README: end

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpuptr::{Runtime, SimConfig, SimDriver};

    #[test]
    fn the_readme_examples_run_on_the_simulator() {
        // One test, so nothing else reads the environment while it is set.
        std::env::set_var("GPUPTR_DRIVER", "sim");
        super::main().unwrap();
        // The README's runtime for tests and benches.
        let rt = Runtime::new(Arc::new(SimDriver::new(SimConfig::new(2, 1 << 30)))).unwrap();
        assert_eq!(rt.context(1).unwrap().alloc(4096).unwrap().size(), 4096);
    }
}
