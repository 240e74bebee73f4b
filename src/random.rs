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

/// 128 bits for a secret (the TCP resume token). Unlike [`random_u64`] this
/// waits for the kernel's entropy pool if it is not ready yet (only ever
/// early in a boot), so the secret is never one a stranger could predict.
pub fn secret_128() -> [u8; 16] {
    let mut v = [0u8; 16];
    let mut got = 0usize;
    while got < v.len() {
        // SAFETY: the pointer and length stay inside v.
        let r = unsafe { libc::getrandom(v[got..].as_mut_ptr() as *mut libc::c_void, v.len() - got, 0) };
        if r > 0 {
            got += r as usize;
        } else if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // no getrandom(2) (Linux < 3.17): the same pool through the file
            use std::io::Read;
            if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
                if f.read_exact(&mut v).is_ok() {
                    return v;
                }
            }
            // last resort: two ids (never expected on a supported kernel)
            v[..8].copy_from_slice(&random_u64().to_le_bytes());
            v[8..].copy_from_slice(&random_u64().to_le_bytes());
            return v;
        }
    }
    v
}
