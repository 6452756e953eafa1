//! The core's `log` records, delivered to Python's `logging.getLogger("gpuptr")`.
//!
//! A record is never handed to Python where it is made: the core logs from
//! threads that may not hold the GIL, and while it holds its own locks,
//! where a Python handler that called back into gpuptr would deadlock. The
//! core's logger only queues it ([`crate::log_queue`]), and the binding
//! delivers the queue at its safe points: the entry points Python calls,
//! which hold the GIL and no gpuptr lock.
//!
//! The level comes from Python: `gpuptr/_log.py` pushes the `gpuptr`
//! logger's effective level here whenever Python's logging levels change,
//! and `log::max_level` follows it, so with DEBUG off a `debug!` in the core
//! costs one relaxed load.

use log::{Level, LevelFilter};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::log_queue::{self, Queued, QUEUE_MAX};

/// Install the core's queueing logger (once per process; the level starts
/// off until Python sets it).
pub(crate) fn init() {
    log_queue::install();
}

fn python_level(level: Level) -> i32 {
    match level {
        Level::Error => 40,
        Level::Warn => 30,
        Level::Info => 20,
        Level::Debug => 10,
        Level::Trace => 5,
    }
}

/// Delivers the queued records when dropped: the first line of an entry
/// point, so that what the call logged reaches Python as it returns.
pub(crate) struct Deliver<'py>(pub Python<'py>);

impl Drop for Deliver<'_> {
    #[inline]
    fn drop(&mut self) {
        flush(self.0);
    }
}

/// Deliver the queued records, if any: call at a safe point (the GIL held,
/// no gpuptr lock held).
#[inline]
pub(crate) fn flush(py: Python<'_>) {
    if log_queue::pending() {
        deliver(py);
    }
}

#[cold]
fn deliver(py: Python<'_>) {
    // Handlers are Python code: none runs on another thread once Python is
    // exiting (the exiting thread delivers what is left).
    let Some(_region) = super::shutdown::Region::enter() else {
        return;
    };
    let (records, dropped) = log_queue::take();
    // A handler's error must not surface in an unrelated gpuptr call: each
    // is reported as unraisable, and the records after it are still
    // delivered.
    static LOGGER_OBJ: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let logger = match LOGGER_OBJ.get_or_try_init(py, || {
        py.import("logging")?
            .call_method1("getLogger", ("gpuptr",))
            .map(Bound::unbind)
    }) {
        Ok(l) => l.bind(py),
        Err(e) => return e.write_unraisable(py, None),
    };
    if dropped > 0 {
        let warned = logger.call_method1(
            "warning",
            (format!(
                "{dropped} gpuptr log records were dropped (more than {QUEUE_MAX} queued)"
            ),),
        );
        if let Err(e) = warned {
            e.write_unraisable(py, None);
        }
    }
    for r in records {
        if let Err(e) = deliver_one(logger, r) {
            e.write_unraisable(py, None);
        }
    }
}

/// Hand one record to `logger` (if it is enabled for its level).
fn deliver_one(logger: &Bound<'_, PyAny>, r: Queued) -> PyResult<()> {
    let py = logger.py();
    let level = python_level(r.level);
    if !logger.call_method1("isEnabledFor", (level,))?.is_truthy()? {
        return Ok(());
    }
    let record = logger.call_method1(
        "makeRecord",
        (
            "gpuptr",
            level,
            r.file.as_deref().unwrap_or("<rust>"),
            r.line,
            r.message,
            py.None(),
            py.None(),
            r.target,
        ),
    )?;
    record.setattr("created", r.created)?;
    record.setattr("msecs", (r.created.fract() * 1000.0).floor())?;
    if let Some(name) = r.thread {
        record.setattr("threadName", name)?;
    }
    logger.call_method1("handle", (record,))?;
    Ok(())
}

/// Set the level records are kept at, from a Python logging level (the
/// `gpuptr` logger's effective level), and deliver what is queued. Any int
/// is a level (``setLevel(2**70)`` is allowed, and turns records off).
#[pyfunction]
pub(crate) fn _set_log_level(py: Python<'_>, level: &Bound<'_, PyAny>) -> PyResult<()> {
    let level = match level.extract::<i64>() {
        Ok(l) => l,
        Err(_) if level.gt(0)? => i64::MAX,
        Err(_) => i64::MIN,
    };
    let filter = match level {
        i64::MIN..=5 => LevelFilter::Trace,
        6..=10 => LevelFilter::Debug,
        11..=20 => LevelFilter::Info,
        21..=30 => LevelFilter::Warn,
        31..=40 => LevelFilter::Error,
        _ => LevelFilter::Off,
    };
    log::set_max_level(filter);
    flush(py);
    Ok(())
}

/// Deliver the records the core queued (gpuptr's entry points do this
/// themselves; this is for the end of a program, or a test).
#[pyfunction]
pub(crate) fn _flush_log(py: Python<'_>) {
    flush(py);
}
