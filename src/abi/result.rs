//! The one map from our errors to `ncclResult_t`.
use super::sys::ncclResult_t;
use crate::error::Error;

/// Exhaustive: a new error variant does not compile until it is mapped here.
pub fn to_nccl(e: &Error) -> ncclResult_t {
    match e {
        Error::Config { .. } => ncclResult_t::ncclInvalidUsage,
        Error::NullArg { .. } => ncclResult_t::ncclInvalidArgument,
        Error::InvalidArg(_) => ncclResult_t::ncclInvalidArgument,
        Error::Usage(_) => ncclResult_t::ncclInvalidUsage,
        Error::NotInitialised => ncclResult_t::ncclInvalidUsage,
        Error::Sys { .. } => ncclResult_t::ncclSystemError,
        Error::Remote { .. } => ncclResult_t::ncclRemoteError,
        Error::Protocol { .. } => ncclResult_t::ncclRemoteError,
        Error::Internal(_) => ncclResult_t::ncclInternalError,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Errno;

    #[test]
    fn every_kind_maps_to_the_documented_code() {
        use ncclResult_t::*;
        let cases = [
            (Error::Config { name: "X", value: "v".into(), accepts: "a".into() }, ncclInvalidUsage),
            (Error::NullArg { slot: "isend", arg: "request" }, ncclInvalidArgument),
            (Error::InvalidArg("x".into()), ncclInvalidArgument),
            (Error::Usage("x".into()), ncclInvalidUsage),
            (Error::NotInitialised, ncclInvalidUsage),
            (Error::sys("bind", Errno(libc::EADDRINUSE)), ncclSystemError),
            (Error::Remote { peer: "p".into(), what: "w".into() }, ncclRemoteError),
            (Error::Protocol { peer: "p".into(), what: "w".into() }, ncclRemoteError),
            (Error::Internal("x".into()), ncclInternalError),
        ];
        for (e, want) in cases {
            assert_eq!(to_nccl(&e), want, "{e}");
        }
    }
}
