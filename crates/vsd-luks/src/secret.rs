//! Key material in memory that stays out of swap and core dumps and is
//! wiped when dropped.

use std::fmt;
use std::ptr::NonNull;

use zeroize::Zeroize;

/// A fixed-length byte buffer for passphrases and keys: its own anonymous
/// mapping, `mlock`ed (best effort: a low RLIMIT_MEMLOCK must not stop an
/// open) and `MADV_DONTDUMP`, zeroed on drop, never shown by `Debug`.
pub struct SecretBuf {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
}

// SAFETY: the buffer is owned memory, like a Vec<u8>.
unsafe impl Send for SecretBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for SecretBuf {}

impl SecretBuf {
    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> SecretBuf {
        let page = page_size();
        let map_len = len.max(1).div_ceil(page) * page;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(addr != libc::MAP_FAILED, "out of memory for a key buffer");
        // SAFETY: addr/map_len is the mapping made above. Failures only
        // lose the hardening, not correctness.
        unsafe {
            libc::mlock(addr, map_len);
            libc::madvise(addr, map_len, libc::MADV_DONTDUMP);
        }
        SecretBuf { ptr: NonNull::new(addr.cast()).expect("mmap gave NULL"), len, map_len }
    }

    /// A copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> SecretBuf {
        let mut buf = SecretBuf::zeroed(bytes.len());
        buf.copy_from_slice(bytes);
        buf
    }
}

impl std::ops::Deref for SecretBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for SecretBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and uniquely borrowed through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SecretBuf {
    fn drop(&mut self) {
        self.zeroize();
        // SAFETY: unmapping the mapping this buffer owns, once.
        unsafe {
            libc::munlock(self.ptr.as_ptr().cast(), self.map_len);
            libc::munmap(self.ptr.as_ptr().cast(), self.map_len);
        }
    }
}

impl fmt::Debug for SecretBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretBuf({} bytes)", self.len)
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_bytes_and_hides_them() {
        let key = SecretBuf::from_slice(b"hunter2");
        assert_eq!(&key[..], b"hunter2");
        assert_eq!(format!("{key:?}"), "SecretBuf(7 bytes)");
        assert!(SecretBuf::zeroed(5000).iter().all(|&b| b == 0));
    }
}
