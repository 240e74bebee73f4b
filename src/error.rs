//! One error type for every operation, carrying enough context to name the cause.
//! `abi::result` maps it exhaustively onto `ncclResult_t`.
use std::fmt;

/// The result type of every core operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An OS error number, printed with its description.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current `errno`.
    pub fn last() -> Errno {
        Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // the OS's words without std's own " (os error N)": the number once
        let msg = std::io::Error::from_raw_os_error(self.0).to_string();
        let text = msg.strip_suffix(&format!(" (os error {})", self.0)).unwrap_or(&msg);
        write!(f, "{text} (errno {})", self.0)
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<std::io::Error> for Errno {
    fn from(e: std::io::Error) -> Self {
        Errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

/// Everything that can go wrong, per operation, with its context.
#[derive(thiserror::Error, Debug, Clone)]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum Error {
    /// An environment variable holds a value we cannot use.
    #[error("invalid value {value:?} for {name}: expected {accepts}")]
    Config { name: &'static str, value: String, accepts: String },
    /// NCCL (or a test) passed a null pointer where one is required.
    #[error("{slot}: argument `{arg}` is NULL")]
    NullArg { slot: &'static str, arg: &'static str },
    /// An argument is out of range or malformed.
    #[error("invalid argument: {0}")]
    InvalidArg(String),
    /// A legal call in an illegal state or with sizes the peer did not agree to.
    #[error("invalid usage: {0}")]
    Usage(String),
    /// The plugin was called before a successful `init`.
    #[error("the plugin is not initialised (init failed or was not called)")]
    NotInitialised,
    /// A system call or library call failed.
    #[error("{op}: {errno}")]
    Sys { op: String, errno: Errno },
    /// The peer went away or failed.
    #[error("peer {peer}: {what}")]
    Remote { peer: String, what: String },
    /// The peer sent something that is not our protocol.
    #[error("peer {peer} broke the protocol: {what}")]
    Protocol { peer: String, what: String },
    /// A bug in the plugin (or NCCL calling it in a way it never should).
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A failed system call: `op` says what we were doing (and to what).
    pub fn sys(op: impl Into<String>, errno: impl Into<Errno>) -> Error {
        Error::Sys { op: op.into(), errno: errno.into() }
    }
    /// A failed system call whose errno is the thread's last one.
    pub fn last_os(op: impl Into<String>) -> Error {
        Error::sys(op, Errno::last())
    }
}

/// The message of a caught panic (its payload is usually a `&str` or a `String`).
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// The protocol core's errors. Only NCCL's handle bytes reach us through `?`
/// (an invalid argument, as before); callers of the peer-facing decoders map
/// theirs to [`Error::Protocol`] with the peer's name.
impl From<rustnet_proto::ProtoError> for Error {
    fn from(e: rustnet_proto::ProtoError) -> Self {
        if e.is_handle() {
            Error::InvalidArg(e.to_string())
        } else {
            Error::Internal(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Errno;

    #[test]
    fn an_errno_reads_once() {
        assert_eq!(Errno(libc::EHOSTUNREACH).to_string(), "No route to host (errno 113)");
        assert_eq!(Errno(libc::ECONNRESET).to_string(), "Connection reset by peer (errno 104)");
    }
}
