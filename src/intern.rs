//! The string interner. Strings NCCL keeps pointers to (`props.name`, `props.pciPath`) live here
//! for the life of the process: interned once, never freed.
use std::collections::HashSet;
use std::ffi::{CStr, CString};

use parking_lot::Mutex;

static STRINGS: Mutex<Option<HashSet<&'static CStr>>> = Mutex::new(None);

/// Unload: free the strings.
///
/// # Safety
/// Nobody (NCCL included: it is unloading us) uses a string from [`intern`] again.
pub(crate) unsafe fn release() {
    if let Some(set) = STRINGS.lock().take() {
        for s in set {
            // SAFETY: each came from Box::leak in intern and is dropped once.
            drop(unsafe { Box::from_raw(s as *const CStr as *mut CStr) });
        }
    }
}

/// A `'static` C string equal to `s` (interior NULs become spaces).
pub fn intern(s: &str) -> &'static CStr {
    let c = CString::new(s.replace('\0', " ")).expect("no NULs left");
    let mut g = STRINGS.lock();
    let set = g.get_or_insert_with(HashSet::new);
    if let Some(found) = set.get(c.as_c_str()) {
        return found;
    }
    let leaked: &'static CStr = Box::leak(c.into_boxed_c_str());
    set.insert(leaked);
    leaked
}

#[cfg(test)]
mod tests {
    #[test]
    fn same_string_same_pointer() {
        let a = super::intern("eth0");
        let b = super::intern("eth0");
        assert_eq!(a.as_ptr(), b.as_ptr());
        assert_eq!(a.to_str().unwrap(), "eth0");
    }
}
