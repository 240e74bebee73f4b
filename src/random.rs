//! Random ids that tell things apart and are not secrets: listener nonces,
//! connection ids, connect progress tokens.
/// A random 64-bit id (listener nonces, connection ids). These tell
/// connections apart and are not secrets, so the call never waits for the
/// kernel's entropy pool (a freshly booted VM or container host may not have
/// one yet, and a blocking getrandom stalls connection set-up for seconds).
pub fn random_u64() -> u64 {
    let mut v = [0u8; 8];
    // SAFETY: v is a valid 8-byte buffer. GRND_INSECURE (Linux 5.6+) never
    // blocks; older kernels reject it and GRND_NONBLOCK is tried.
    let mut r = unsafe { libc::getrandom(v.as_mut_ptr() as *mut libc::c_void, 8, libc::GRND_INSECURE) };
    if r != 8 {
        // SAFETY: v is a valid 8-byte buffer; GRND_NONBLOCK never blocks.
        r = unsafe { libc::getrandom(v.as_mut_ptr() as *mut libc::c_void, 8, libc::GRND_NONBLOCK) };
    }
    if r != 8 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        return t ^ ((std::process::id() as u64) << 32) ^ (&v as *const _ as u64);
    }
    u64::from_ne_bytes(v) | 1
}
