//! The core's `log` records, queued for a host to deliver.
//!
//! The core logs from threads that may hold its own locks or no
//! interpreter lock (the fence helper, allocator hooks called by PyTorch),
//! so a record is never handed to a host's logging where it is made: the
//! logger installed here only queues it (a leaf lock, never held across
//! anything else), and the host drains the queue at its own safe points
//! ([`take`]). Each record keeps the time and thread it was made on. With
//! the level off (`log::max_level`), a `debug!` in the core costs one
//! relaxed load.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use log::{Level, LevelFilter, Log, Metadata, Record};

/// Records waiting for a drain; beyond this many, new ones are dropped and
/// counted.
pub const QUEUE_MAX: usize = 4096;

/// One queued record.
#[derive(Debug, Clone)]
pub struct Queued {
    /// Its level.
    pub level: Level,
    /// The `log` target (a module path, or `gpuptr::context` and kin).
    pub target: String,
    /// The formatted message.
    pub message: String,
    /// The source file, where known.
    pub file: Option<String>,
    /// The source line (0: unknown).
    pub line: u32,
    /// Seconds since the epoch when it was made.
    pub created: f64,
    /// The name of the thread that made it, where the thread has one.
    pub thread: Option<String>,
}

static QUEUE: Mutex<VecDeque<Queued>> = Mutex::new(VecDeque::new());
static PENDING: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);

struct QueueLogger;

impl Log for QueueLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if self.enabled(record.metadata()) {
            push(Queued {
                level: record.level(),
                target: record.target().to_owned(),
                message: record.args().to_string(),
                file: record.file().map(str::to_owned),
                line: record.line().unwrap_or(0),
                created: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
                thread: std::thread::current().name().map(str::to_owned),
            });
        }
    }

    fn flush(&self) {}
}

static LOGGER: QueueLogger = QueueLogger;

/// Install the queueing logger as the process's `log` logger, its level
/// off until the host sets one (`log::set_max_level`); whether it was
/// installed (another logger may have been first).
pub fn install() -> bool {
    let ok = log::set_logger(&LOGGER).is_ok();
    if ok {
        log::set_max_level(LevelFilter::Off);
    }
    ok
}

fn push(q: Queued) {
    let mut queue = crate::sync::lock(&QUEUE);
    if queue.len() >= QUEUE_MAX {
        DROPPED.fetch_add(1, Ordering::Relaxed);
    } else {
        queue.push_back(q);
    }
    PENDING.store(true, Ordering::Release);
}

/// Whether records (or a count of dropped ones) wait for [`take`].
#[inline]
pub fn pending() -> bool {
    PENDING.load(Ordering::Acquire)
}

/// Every queued record, oldest first, and how many were dropped since the
/// last take because the queue was full.
pub fn take() -> (Vec<Queued>, u64) {
    let records = {
        let mut queue = crate::sync::lock(&QUEUE);
        PENDING.store(false, Ordering::Release);
        queue.drain(..).collect()
    };
    (records, DROPPED.swap(0, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(i: usize) -> Queued {
        Queued {
            level: Level::Debug,
            target: "t".into(),
            message: format!("m{i}"),
            file: None,
            line: 0,
            created: 0.0,
            thread: None,
        }
    }

    // One test: the queue is the process's.
    #[test]
    fn the_queue_keeps_order_caps_its_length_and_counts_what_it_dropped() {
        let _ = take();
        assert!(!pending());
        for i in 0..QUEUE_MAX + 3 {
            push(record(i));
        }
        assert!(pending());
        let (records, dropped) = take();
        assert_eq!((records.len(), dropped), (QUEUE_MAX, 3));
        assert_eq!(records[0].message, "m0");
        assert_eq!(
            records[QUEUE_MAX - 1].message,
            format!("m{}", QUEUE_MAX - 1)
        );
        assert!(!pending());
        assert_eq!(take().1, 0, "the dropped count starts again");
    }
}
