//! The fence's reading of a busy GPU.

use std::time::Duration;

use super::super::fence::spins;

/// A fence spins ([`Fencer::spun`](crate::pool::fence::Fencer::spun)) when it has spent a growth's cost
/// of CPU and ran on a CPU for at least a quarter of its time: the
/// fence of a busy GPU, alone on a CPU or sharing one; not one that
/// lost its CPU after a little work (measured on the simulator beside
/// spinning processes: 20.8 µs of CPU, then 2 ms without), nor one
/// that has not yet spent the cost.
#[test]
fn a_fence_spins_only_while_it_spends_its_cpu_not_while_it_waits_for_one() {
    let us = Duration::from_micros;
    let cost = us(20);
    // Alone on a CPU, and sharing one with two or three other threads.
    assert!(spins(2_000_000, us(2_050), cost));
    assert!(spins(1_000_000, us(3_000), cost));
    assert!(spins(500_000, us(2_000), cost));
    // Waiting for a CPU since it spent 20.8 µs: not from 84 µs on.
    assert!(!spins(20_800, us(2_000), cost));
    assert!(!spins(20_800, us(84), cost));
    // Under the cost, however long it ran on a CPU.
    assert!(!spins(19_000, us(19), cost));
}
