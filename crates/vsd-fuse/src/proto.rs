//! The FUSE kernel protocol, as far as one regular file needs it: the
//! layouts of `<linux/fuse.h>` (protocol 7.31) and their numbers.

/// The protocol version vsd speaks: 7.31 has every message used here
/// (lseek 7.24, max_pages 7.28) in the layouts below.
pub(crate) const MAJOR: u32 = 7;
pub(crate) const MINOR: u32 = 31;

/// The inode of the mount's root: the file itself.
pub(crate) const ROOT_ID: u64 = 1;

pub(crate) mod op {
    pub(crate) const LOOKUP: u32 = 1;
    pub(crate) const FORGET: u32 = 2;
    pub(crate) const GETATTR: u32 = 3;
    pub(crate) const SETATTR: u32 = 4;
    pub(crate) const OPEN: u32 = 14;
    pub(crate) const READ: u32 = 15;
    pub(crate) const WRITE: u32 = 16;
    pub(crate) const STATFS: u32 = 17;
    pub(crate) const RELEASE: u32 = 18;
    pub(crate) const FSYNC: u32 = 20;
    pub(crate) const FLUSH: u32 = 25;
    pub(crate) const INIT: u32 = 26;
    pub(crate) const INTERRUPT: u32 = 36;
    pub(crate) const DESTROY: u32 = 38;
    pub(crate) const BATCH_FORGET: u32 = 42;
    pub(crate) const FALLOCATE: u32 = 43;
    pub(crate) const LSEEK: u32 = 46;
}

/// `FUSE_INIT` flags.
pub(crate) mod init {
    pub(crate) const ASYNC_READ: u32 = 1 << 0;
    pub(crate) const BIG_WRITES: u32 = 1 << 5;
    pub(crate) const ASYNC_DIO: u32 = 1 << 15;
    pub(crate) const MAX_PAGES: u32 = 1 << 22;
}

/// `fuse_open_out.open_flags`.
pub(crate) mod fopen {
    pub(crate) const DIRECT_IO: u32 = 1 << 0;
    pub(crate) const PARALLEL_DIRECT_WRITES: u32 = 1 << 6;
}

/// `fuse_setattr_in.valid`.
pub(crate) mod fattr {
    pub(crate) const MODE: u32 = 1 << 0;
    pub(crate) const UID: u32 = 1 << 1;
    pub(crate) const GID: u32 = 1 << 2;
    pub(crate) const SIZE: u32 = 1 << 3;
    /// Which open file asks, and for which lock owner: nothing to set.
    pub(crate) const FH: u32 = 1 << 6;
    pub(crate) const LOCKOWNER: u32 = 1 << 9;
}

/// Marks a message layout as plain bytes, read from and written to the
/// device as they are.
///
/// # Safety
/// Only for `repr(C)` structs of integers without padding.
pub(crate) unsafe trait Pod: Copy + Default {
    /// Reads one from the start of `bytes`, if they hold it.
    fn read(bytes: &[u8]) -> Option<Self> {
        // SAFETY: Pod types are plain integers, valid for any bytes;
        // the length is checked and the read is unaligned.
        (bytes.len() >= size_of::<Self>()).then(|| unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: a Pod has no padding, so all its bytes are initialised.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast(), size_of::<Self>()) }
    }
}

macro_rules! pod {
    ($($(#[$meta:meta])* struct $name:ident { $($field:ident: $ty:ty),* $(,)? })*) => {$(
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default)]
        pub(crate) struct $name { $(pub(crate) $field: $ty),* }
        // SAFETY: repr(C), integers only, laid out without padding (the
        // kernel's own layouts, which are so by design).
        unsafe impl Pod for $name {}
    )*};
}

pod! {
    struct InHeader { len: u32, opcode: u32, unique: u64, nodeid: u64, uid: u32, gid: u32, pid: u32, total_extlen: u16, padding: u16 }
    struct OutHeader { len: u32, error: i32, unique: u64 }
    struct InitIn { major: u32, minor: u32, max_readahead: u32, flags: u32 }
    struct InitOut {
        major: u32, minor: u32, max_readahead: u32, flags: u32, max_background: u16, congestion_threshold: u16,
        max_write: u32, time_gran: u32, max_pages: u16, map_alignment: u16, flags2: u32, unused: [u32; 7],
    }
    struct Attr {
        ino: u64, size: u64, blocks: u64, atime: u64, mtime: u64, ctime: u64, atimensec: u32, mtimensec: u32,
        ctimensec: u32, mode: u32, nlink: u32, uid: u32, gid: u32, rdev: u32, blksize: u32, flags: u32,
    }
    struct AttrOut { attr_valid: u64, attr_valid_nsec: u32, dummy: u32, attr: Attr }
    struct SetattrIn {
        valid: u32, padding: u32, fh: u64, size: u64, lock_owner: u64, atime: u64, mtime: u64, ctime: u64,
        atimensec: u32, mtimensec: u32, ctimensec: u32, mode: u32, unused4: u32, uid: u32, gid: u32, unused5: u32,
    }
    struct OpenOut { fh: u64, open_flags: u32, padding: u32 }
    /// `fuse_read_in` and `fuse_write_in` share their layout.
    struct IoIn { fh: u64, offset: u64, size: u32, flags: u32, lock_owner: u64, open_flags: u32, padding: u32 }
    struct WriteOut { size: u32, padding: u32 }
    struct FallocateIn { fh: u64, offset: u64, length: u64, mode: u32, padding: u32 }
    struct LseekIn { fh: u64, offset: u64, whence: u32, padding: u32 }
    struct LseekOut { offset: u64 }
    struct StatfsOut { blocks: u64, bfree: u64, bavail: u64, files: u64, ffree: u64, bsize: u32, namelen: u32, frsize: u32, padding: u32, spare: [u32; 6] }
}
