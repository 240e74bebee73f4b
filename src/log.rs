//! All logging goes through NCCL's logger once `init` handed it to us; before
//! that (tools, tests) it goes to stderr. `tracing` is the front end; with
//! no tracing subscriber installed its macros hand each event to the `log`
//! facade, whose logger is the static [`NcclLog`] here, which formats the
//! line and forwards it. Nothing here allocates state that outlives a call:
//! a global tracing subscriber would (tracing keeps it, and its registry, on
//! the heap for good), and each dlopen/dlclose cycle leaked it. A process
//! that installs its own tracing subscriber (the tests) gets the events there.
//!
//! Levels: `warn!` -> NCCL WARN, `info!` -> NCCL INFO, `debug!`/`trace!` ->
//! NCCL TRACE. Per-request events on the data path use `trace!` only, and are
//! not even formatted unless `NCCL_DEBUG=TRACE`.
use std::ffi::CString;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// C signature of NCCL's `ncclDebugLogger_t`.
pub type NcclLogger = unsafe extern "C" fn(
    level: libc::c_int,
    flags: libc::c_ulong,
    file: *const libc::c_char,
    line: libc::c_int,
    fmt: *const libc::c_char,
    ...
);

const NCCL_LOG_WARN: libc::c_int = 2;
const NCCL_LOG_INFO: libc::c_int = 3;
const NCCL_LOG_TRACE: libc::c_int = 5;
const NCCL_INIT: libc::c_ulong = 1;
const NCCL_NET: libc::c_ulong = 16;
const NCCL_ALL: libc::c_ulong = !0;

static LOGGER: AtomicUsize = AtomicUsize::new(0);
/// 0 = warn, 1 = info, 2 = trace (max level that is formatted at all).
static MAX_LEVEL: AtomicU8 = AtomicU8::new(1);
static INSTALLED: std::sync::Once = std::sync::Once::new();

/// Hand us NCCL's logger (or None to go back to stderr).
pub fn set_nccl_logger(f: Option<NcclLogger>) {
    LOGGER.store(f.map_or(0, |f| f as usize), Ordering::Release);
}

/// Raise or lower what is formatted (`NCCL_DEBUG`).
pub fn set_max_level(level: crate::config::LogLevel) {
    use crate::config::LogLevel::*;
    MAX_LEVEL.store(
        match level {
            Warn => 0,
            Info => 1,
            Trace => 2,
        },
        Ordering::Relaxed,
    );
}

/// Is TRACE formatted at all (`NCCL_DEBUG=TRACE`)?
pub fn trace_enabled() -> bool {
    MAX_LEVEL.load(Ordering::Relaxed) >= 2
}

/// Install our logger as the `log` facade's, once per copy of the library.
/// Harmless if it fails (then nothing of ours is logged through `log`).
pub fn install() {
    INSTALLED.call_once(|| {
        if let Ok(v) = std::env::var("NCCL_DEBUG") {
            if let Some(l) = <crate::config::LogLevel as crate::config::KnobValue>::parse_knob(v.trim()) {
                set_max_level(l);
            }
        }
        let _ = log::set_logger(&NCCL_LOG);
        log::set_max_level(log::LevelFilter::Trace);
    });
}

/// The `log` logger: formats and forwards to NCCL (or stderr).
pub struct NcclLog;

static NCCL_LOG: NcclLog = NcclLog;

fn level_rank(l: log::Level) -> u8 {
    match l {
        log::Level::Error | log::Level::Warn => 0,
        log::Level::Info => 1,
        _ => 2,
    }
}

impl log::Log for NcclLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        level_rank(m.level()) <= MAX_LEVEL.load(Ordering::Relaxed)
    }

    fn log(&self, r: &log::Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let rank = level_rank(r.level());
        let logger = LOGGER.load(Ordering::Acquire);
        if logger == 0 {
            let tag = match rank {
                0 => "WARN",
                1 => "INFO",
                _ => "TRACE",
            };
            eprintln!("[rustnet {tag}] {}", r.args());
            return;
        }
        // SAFETY: `logger` was stored from a valid `NcclLogger` by set_nccl_logger.
        let f: NcclLogger = unsafe { std::mem::transmute::<usize, NcclLogger>(logger) };
        let (level, flags) = match rank {
            0 => (NCCL_LOG_WARN, NCCL_ALL),
            1 => (NCCL_LOG_INFO, NCCL_INIT | NCCL_NET),
            _ => (NCCL_LOG_TRACE, NCCL_NET),
        };
        let text = format!("NET/rustnet : {}", r.args());
        let file = CString::new(r.file().unwrap_or("rustnet")).unwrap_or_default();
        let msg = CString::new(text.replace('\0', " ")).unwrap_or_default();
        // SAFETY: NCCL's logger is printf-like; "%s" with a NUL-terminated
        // string is always a valid call; the CStrings outlive the call.
        unsafe {
            f(level, flags, file.as_ptr(), r.line().unwrap_or(0) as libc::c_int, c"%s".as_ptr(), msg.as_ptr());
        }
    }

    fn flush(&self) {}
}
