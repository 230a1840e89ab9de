//! Files: reading and writing at offsets, space, holes, sizes, and where
//! a file's data lives.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd};

use crate::check;

/// `fallocate(2)` modes used by the engines.
pub mod falloc {
    /// Allocate the range (a plain `fallocate`).
    pub const ALLOCATE: i32 = 0;
    /// Deallocate the range; reads return zeroes afterwards.
    pub const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    /// Zero the range, keeping it allocated.
    pub const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
}

/// `fallocate(2)` on `fd`; `mode` is one of [`falloc`].
pub fn fallocate(fd: BorrowedFd<'_>, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (offset, len) = (to_off(offset)?, to_off(len)?);
    // SAFETY: fallocate reads no memory of ours; fd is a live borrowed descriptor.
    let ret = unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, len) };
    check(ret.into()).map(drop)
}

/// Where the data at or after `offset` begins (`lseek(2)` `SEEK_DATA`), or
/// `None` if only a hole is left up to the end of the file. With `hole`,
/// where the hole at or after `offset` begins instead (`SEEK_HOLE`; the
/// end of the file counts as one). File systems without holes report all
/// data.
pub fn seek_data_or_hole(fd: BorrowedFd<'_>, offset: u64, hole: bool) -> io::Result<Option<u64>> {
    let whence = if hole { libc::SEEK_HOLE } else { libc::SEEK_DATA };
    // SAFETY: lseek reads no memory of ours; fd is a live borrowed
    // descriptor. It moves the file offset, which vsd never uses: every
    // transfer is positional.
    let ret = unsafe { libc::lseek(fd.as_raw_fd(), to_off(offset)?, whence) };
    match check(ret) {
        Ok(at) => Ok(Some(at as u64)),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `fdatasync(2)`.
pub fn fdatasync(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fdatasync reads no memory of ours; fd is a live borrowed descriptor.
    let ret = unsafe { libc::fdatasync(fd.as_raw_fd()) };
    check(ret.into()).map(drop)
}

/// `preadv2(2)`: reads into the buffers `iov` names.
///
/// # Safety
/// Every iovec must describe memory that is valid for writes of its length
/// and that nothing else accesses during the call.
pub unsafe fn preadv2(fd: BorrowedFd<'_>, iov: &[libc::iovec], offset: u64, flags: i32) -> io::Result<usize> {
    let offset = to_off(offset)?;
    // SAFETY: the caller guarantees the buffers are writable; the iovec
    // array itself is a live slice.
    let ret = unsafe { libc::preadv2(fd.as_raw_fd(), iov.as_ptr(), iov_count(iov)?, offset, flags) };
    check(ret as libc::c_long)
}

/// `pwritev2(2)`: writes the buffers `iov` names; `flags` may hold `RWF_DSYNC`.
///
/// # Safety
/// Every iovec must describe memory that is valid for reads of its length.
pub unsafe fn pwritev2(fd: BorrowedFd<'_>, iov: &[libc::iovec], offset: u64, flags: i32) -> io::Result<usize> {
    let offset = to_off(offset)?;
    // SAFETY: the caller guarantees the buffers are readable; the iovec
    // array itself is a live slice.
    let ret = unsafe { libc::pwritev2(fd.as_raw_fd(), iov.as_ptr(), iov_count(iov)?, offset, flags) };
    check(ret as libc::c_long)
}

/// The size in bytes of a regular file or a block device.
pub fn file_size(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if !std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
        return Ok(meta.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points
    // at a live local.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size) };
    check(ret.into())?;
    Ok(size)
}

/// What O_DIRECT transfers on `file` must be aligned to, as `statx`
/// reports it (`STATX_DIOALIGN`, Linux 6.1+): (memory, file offset and
/// length) in bytes, or `None` where the kernel or file system does not
/// say.
pub fn dio_alignment(file: &File) -> io::Result<Option<(u32, u32)>> {
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: statx fills the statx structure it is given; the path is an
    // empty C string, which AT_EMPTY_PATH makes name the descriptor itself.
    let ret = unsafe {
        libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, st.as_mut_ptr())
    };
    check(ret.into())?;
    // SAFETY: zeroed is a valid statx, and statx succeeded.
    let st = unsafe { st.assume_init() };
    if st.stx_mask & libc::STATX_DIOALIGN == 0 || st.stx_dio_offset_align == 0 {
        return Ok(None);
    }
    Ok(Some((st.stx_dio_mem_align, st.stx_dio_offset_align)))
}

/// The logical block size of a block device (`BLKSSZGET`): the smallest
/// unit it transfers.
pub fn logical_block_size(file: &File) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points
    // at a live local.
    let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut size) };
    check(ret.into())?;
    u32::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// How a file's data is held, for deciding whether I/O on it can block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residence {
    /// Opened with O_DIRECT: every transfer waits for the device.
    pub direct: bool,
    /// On a file system that keeps its files in memory (tmpfs, ramfs,
    /// hugetlbfs): transfers never wait for a device.
    pub in_memory: bool,
}

/// Where `file`'s data lives (see [`Residence`]).
pub fn residence(file: &File) -> io::Result<Residence> {
    // SAFETY: F_GETFL on a descriptor the file keeps open.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    check(flags.into())?;
    let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the statfs structure it is given.
    check(unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) }.into())?;
    // SAFETY: fstatfs succeeded, so it initialised the structure.
    let kind = unsafe { fs.assume_init() }.f_type;
    // ramfs' magic number is not in libc (linux/magic.h: RAMFS_MAGIC).
    const IN_MEMORY: [libc::__fsword_t; 3] = [libc::TMPFS_MAGIC, 0x8584_58f6, libc::HUGETLBFS_MAGIC];
    Ok(Residence { direct: flags & libc::O_DIRECT != 0, in_memory: IN_MEMORY.contains(&kind) })
}

/// `_IOR(0x12, 114, size_t)`: the size of a block device in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

fn to_off(value: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(value).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn iov_count(iov: &[libc::iovec]) -> io::Result<libc::c_int> {
    libc::c_int::try_from(iov.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// A new anonymous file in memory (`memfd_create(2)`, close-on-exec), empty:
/// size it with `set_len`, whose new bytes read as zeroes.
pub fn memfd(name: &str) -> io::Result<File> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    check(libc::c_long::from(fd))?;
    // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::path::Path;

    use super::*;

    #[test]
    fn residence_tells_memory_and_direct_files() {
        let shm = tempfile_in(Path::new("/dev/shm"), 0);
        assert_eq!(residence(&shm).unwrap(), Residence { direct: false, in_memory: true });
        // The source tree is on a disk, whose file system takes O_DIRECT.
        let disk = tempfile_in(Path::new(env!("CARGO_MANIFEST_DIR")), libc::O_DIRECT);
        assert_eq!(residence(&disk).unwrap(), Residence { direct: true, in_memory: false });
    }

    #[test]
    fn punch_hole_reads_back_zeroes() {
        let mut file = tempfile();
        file.write_all(&[0xaa; 8192]).unwrap();
        fallocate(file.as_fd(), falloc::PUNCH_HOLE, 0, 4096).unwrap();
        let mut buf = [0xffu8; 8192];
        let iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
        // SAFETY: iov names `buf`, a live local array.
        let n = unsafe { preadv2(file.as_fd(), &iov, 0, 0) }.unwrap();
        assert_eq!(n, 8192);
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..].iter().all(|&b| b == 0xaa));
        assert_eq!(file_size(&file).unwrap(), 8192);
    }

    #[test]
    fn negative_offsets_are_refused() {
        let file = tempfile();
        let err = fallocate(file.as_fd(), falloc::ALLOCATE, u64::MAX, 1).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    pub(crate) fn tempfile() -> File {
        tempfile_in(&std::env::temp_dir(), 0)
    }

    /// An unlinked file open in `dir` with `flags` added (shared with the
    /// other modules' tests).
    pub(crate) fn tempfile_in(dir: &Path, flags: i32) -> File {
        let path = dir.join(format!("vsd-sys-{}-{:?}", std::process::id(), std::thread::current().id()));
        let file =
            File::options().read(true).write(true).create(true).truncate(true).custom_flags(flags).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }
}
