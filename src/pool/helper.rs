//! The one skeleton of the pool's helper threads, the fence
//! ([`Fencer`](super::fence::Fencer)) and growth ahead
//! ([`Grower`](super::ahead::Grower)): a thread started on first use, woken
//! through a condition variable only when it sleeps, stopped with no one
//! waiting for it, replaced by work on the caller's thread if none starts.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::sync::{lock, wait};

/// A helper thread over state `S` (under its lock) and `E` (outside it).
pub(crate) struct Helper<S, E> {
    pub(crate) shared: Arc<Shared<S, E>>,
    name: &'static str,
}

/// What the helper and the threads that use it share.
pub(crate) struct Shared<S, E> {
    pub(crate) state: Mutex<State<S>>,
    /// Wakes the helper.
    pub(crate) work: Condvar,
    /// Wakes threads waiting for the helper's work (a fence, its jobs).
    pub(crate) done: Condvar,
    /// What is read without the lock.
    pub(crate) ext: E,
}

/// The helper's state under the lock.
#[derive(Default)]
pub(crate) struct State<S> {
    pub(crate) s: S,
    /// The thread runs.
    pub(crate) spawned: bool,
    pub(crate) shutdown: bool,
    /// The helper waits on `work`: a request must wake it.
    pub(crate) sleeping: bool,
}

impl<S: Default + Send + 'static, E: Send + Sync + 'static> Helper<S, E> {
    /// A helper named `name` (not started).
    pub(crate) fn new(name: &'static str, ext: E) -> Self {
        Helper {
            name,
            shared: Arc::new(Shared {
                state: Mutex::default(),
                work: Condvar::new(),
                done: Condvar::new(),
                ext,
            }),
        }
    }

    /// Start the thread, running `body`, unless it runs; `false` if no
    /// thread can be started (the caller then does the work itself).
    pub(crate) fn start(&self, st: &mut State<S>, body: fn(&Shared<S, E>)) -> bool {
        if st.spawned {
            return true;
        }
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                short_timer_slack();
                body(&shared)
            });
        st.spawned = spawned.is_ok();
        st.spawned
    }
}

impl<S, E> Helper<S, E> {
    /// Lock its state.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State<S>> {
        lock(&self.shared.state)
    }

    /// Unlock, waking the helper if it sleeps.
    pub(crate) fn wake(&self, st: MutexGuard<'_, State<S>>) {
        let sleeping = st.sleeping;
        drop(st);
        if sleeping {
            self.shared.work.notify_one();
        }
    }

    /// Stop the helper after what it does now; `take` runs under the lock
    /// (taking its undone work). No one waits: it never hangs on the GPU.
    pub(crate) fn shutdown<R>(&self, take: impl FnOnce(&mut S) -> R) -> R {
        let r = {
            let mut st = self.lock();
            st.shutdown = true;
            take(&mut st.s)
        };
        self.shared.work.notify_all();
        self.shared.done.notify_all();
        r
    }
}

impl<S, E> Shared<S, E> {
    /// On the helper: sleep until woken (`sleeping` is set, and read by a
    /// request, under the lock: a request is seen before this, or wakes it).
    pub(crate) fn sleep<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<S>>,
    ) -> MutexGuard<'a, State<S>> {
        st.sleeping = true;
        st = wait(&self.work, st);
        st.sleeping = false;
        st
    }
}

impl<S, E> Drop for Helper<S, E> {
    fn drop(&mut self) {
        self.shutdown(|_| ());
    }
}

/// Punctual timed waits on this thread (Linux lets them run up to 50 µs late).
fn short_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes an integer and changes only the
    // calling thread's timer slack; no memory is passed. prctl is variadic
    // and reads five words: pass them all, so none is uninitialised.
    unsafe {
        let (slack, zero): (libc::c_ulong, libc::c_ulong) = (1000, 0);
        libc::prctl(libc::PR_SET_TIMERSLACK, slack, zero, zero, zero);
    }
}
