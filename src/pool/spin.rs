//! Whether a fence spins: the fence thread's CPU clock, read by misses, tells a
//! busy GPU (its `cuCtxSynchronize` spins on the thread's CPU while queued work
//! runs) from a loaded host (the thread waits for a CPU, spending none). Not
//! under a blocking sync, which spends none either: `Fencer::spun` skips it.

use std::sync::Mutex;
use std::time::Duration;

use crate::sync::lock;

/// No thread CPU clock.
pub(super) const NO_CLOCK: i64 = i64::MIN;

/// The calling thread's CPU-time clock, for other threads to read.
pub(super) fn own_cpu_clock() -> i64 {
    #[cfg(target_os = "linux")]
    {
        let mut id: libc::clockid_t = 0;
        // SAFETY: pthread_self() is the calling thread, alive for the call;
        // `id` is a valid place for the result.
        if unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) } == 0 {
            return i64::from(id);
        }
    }
    NO_CLOCK
}

/// The CPU time in ns of the thread whose clock is `clock`
/// ([`own_cpu_clock`]); `None` if unreadable (no clock, or the thread ended).
pub(super) fn thread_cpu_ns(clock: i64) -> Option<u64> {
    if clock == NO_CLOCK {
        return None;
    }
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid place for the result; an id of a thread
        // that ended makes the call fail (EINVAL), never touch memory.
        if unsafe { libc::clock_gettime(clock as libc::clockid_t, &mut ts) } == 0 {
            return Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
        }
    }
    None
}

/// CPU a fence spends only by spinning: ten times the most an idle fence
/// spent on a noisy 2-CPU VM (110 µs, on the simulator). A fence that spent
/// this was a busy GPU's when its thread last ran, even if a CPU-starved
/// host (or valgrind, one thread at a time) has not let it run since.
const SURELY_SPUN: u64 = 1_100_000;

/// One look at a running fence: when it started (wall ns, its id), and
/// the wall and CPU clocks at the look.
#[derive(Copy, Clone, Default)]
struct Look {
    fence: u64,
    wall: u64,
    cpu: u64,
}

/// The last look at the running fence, kept between misses.
#[derive(Default)]
pub(super) struct Probe(Mutex<Look>);

impl Probe {
    /// Whether a fence spins that started at `start` and is at `now` (each
    /// a wall ns and its thread's CPU ns): it has spent `cost` of CPU and
    /// keeps spending. Either it was on a CPU for a quarter of its run or
    /// more (alone, or sharing a CPU with up to three threads), or its CPU
    /// grew by a sixteenth of the wall time or more since a look `cost` or
    /// more ago (under valgrind, one thread at a time, a busy GPU's fence
    /// got a sixth to an eighth beside a growth), or it spent
    /// [`SURELY_SPUN`]. A fence thread that spent 21 µs, then waited 2 ms
    /// for a CPU (the simulator beside spinning processes), does none.
    pub(super) fn spins(&self, start: (u64, u64), now: (u64, u64), cost: Duration) -> bool {
        let cost = cost.as_nanos() as u64;
        let cpu = now.1.saturating_sub(start.1);
        if cpu < cost {
            return false;
        }
        if cpu >= SURELY_SPUN || u128::from(cpu) * 4 >= u128::from(now.0.saturating_sub(start.0)) {
            return true;
        }
        let mut last = lock(&self.0);
        if last.fence != start.0 {
            *last = Look {
                fence: start.0,
                wall: now.0,
                cpu: now.1,
            };
            return false;
        }
        let wall = now.0.saturating_sub(last.wall);
        if wall < cost {
            // Too soon to tell: the next look compares with this one's.
            return false;
        }
        let grew = now.1.saturating_sub(last.cpu);
        (last.wall, last.cpu) = (now.0, now.1);
        u128::from(grew) * 16 >= u128::from(wall)
    }
}
