//! All logging goes through NCCL's logger once `init` handed it to us; before
//! that (tools, tests) it goes to stderr. `tracing` is the front end: a layer
//! formats each event and forwards it.
//!
//! Levels: `warn!` -> NCCL WARN, `info!` -> NCCL INFO, `debug!`/`trace!` ->
//! NCCL TRACE. Per-request events on the data path use `trace!` only, and are
//! not even formatted unless `NCCL_DEBUG=TRACE`.
use std::ffi::CString;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use once_cell::sync::OnceCell;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

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
static INSTALLED: OnceCell<()> = OnceCell::new();

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

/// Install our subscriber as the process default, once. Harmless if the
/// host process already installed one (then events go there).
pub fn install() {
    INSTALLED.get_or_init(|| {
        if let Ok(v) = std::env::var("NCCL_DEBUG") {
            if let Some(l) = <crate::config::LogLevel as crate::config::KnobValue>::parse_knob(v.trim()) {
                set_max_level(l);
            }
        }
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(NcclLayer));
    });
}

struct NcclLayer;

#[derive(Default)]
struct MsgVisitor {
    msg: String,
}

impl Visit for MsgVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.msg.push_str(value);
        } else {
            let _ = write!(self.msg, " {}={}", field.name(), value);
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.msg, "{value:?}");
        } else {
            let _ = write!(self.msg, " {}={:?}", field.name(), value);
        }
    }
}

fn level_rank(l: &Level) -> u8 {
    match *l {
        Level::ERROR | Level::WARN => 0,
        Level::INFO => 1,
        _ => 2,
    }
}

impl<S: Subscriber> Layer<S> for NcclLayer {
    fn enabled(&self, metadata: &tracing::Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        level_rank(metadata.level()) <= MAX_LEVEL.load(Ordering::Relaxed)
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut v = MsgVisitor::default();
        event.record(&mut v);
        let text = format!("NET/rustnet : {}", v.msg);
        let logger = LOGGER.load(Ordering::Acquire);
        if logger == 0 {
            let tag = match level_rank(meta.level()) {
                0 => "WARN",
                1 => "INFO",
                _ => "TRACE",
            };
            eprintln!("[rustnet {tag}] {}", v.msg);
            return;
        }
        // SAFETY: `logger` was stored from a valid `NcclLogger` by set_nccl_logger.
        let f: NcclLogger = unsafe { std::mem::transmute::<usize, NcclLogger>(logger) };
        let (level, flags) = match level_rank(meta.level()) {
            0 => (NCCL_LOG_WARN, NCCL_ALL),
            1 => (NCCL_LOG_INFO, NCCL_INIT | NCCL_NET),
            _ => (NCCL_LOG_TRACE, NCCL_NET),
        };
        let file = CString::new(meta.file().unwrap_or("rustnet")).unwrap_or_default();
        let msg = CString::new(text.replace('\0', " ")).unwrap_or_default();
        // SAFETY: NCCL's logger is printf-like; "%s" with a NUL-terminated
        // string is always a valid call; the CStrings outlive the call.
        unsafe {
            f(level, flags, file.as_ptr(), meta.line().unwrap_or(0) as libc::c_int, c"%s".as_ptr(), msg.as_ptr());
        }
    }
}
