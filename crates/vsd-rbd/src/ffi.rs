//! librados' and librbd's C API, the calls vsd makes, loaded when the
//! first RBD node opens.
//!
//! Loaded at run time rather than linked: the daemon starts, and serves
//! files, on hosts without Ceph's libraries (as QEMU's rbd driver is a
//! module of its own); only `driver=rbd` needs them. No crate binds the
//! asynchronous calls with completion callbacks that this driver needs.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

pub(crate) type Rados = *mut c_void;
pub(crate) type IoCtx = *mut c_void;
pub(crate) type Image = *mut c_void;
pub(crate) type AioCompletion = *mut c_void;
pub(crate) type Callback = unsafe extern "C" fn(completion: AioCompletion, arg: *mut c_void);

/// `RBD_WRITE_ZEROES_FLAG_THICK_PROVISION`: zeroes are written, not unmapped.
pub(crate) const WRITE_ZEROES_THICK: c_int = 1;

/// The calls, resolved from the libraries kept open beside them.
pub(crate) struct Api {
    pub rados_create: unsafe extern "C" fn(*mut Rados, *const c_char) -> c_int,
    pub rados_conf_read_file: unsafe extern "C" fn(Rados, *const c_char) -> c_int,
    pub rados_conf_set: unsafe extern "C" fn(Rados, *const c_char, *const c_char) -> c_int,
    pub rados_conf_get: unsafe extern "C" fn(Rados, *const c_char, *mut c_char, usize) -> c_int,
    pub rados_connect: unsafe extern "C" fn(Rados) -> c_int,
    pub rados_shutdown: unsafe extern "C" fn(Rados),
    pub rados_ioctx_create: unsafe extern "C" fn(Rados, *const c_char, *mut IoCtx) -> c_int,
    pub rados_ioctx_set_namespace: unsafe extern "C" fn(IoCtx, *const c_char),
    pub rados_ioctx_destroy: unsafe extern "C" fn(IoCtx),
    pub rbd_open: unsafe extern "C" fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_open_read_only: unsafe extern "C" fn(IoCtx, *const c_char, *mut Image, *const c_char) -> c_int,
    pub rbd_close: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_get_size: unsafe extern "C" fn(Image, *mut u64) -> c_int,
    pub rbd_resize: unsafe extern "C" fn(Image, u64) -> c_int,
    pub rbd_invalidate_cache: unsafe extern "C" fn(Image) -> c_int,
    pub rbd_aio_create_completion: unsafe extern "C" fn(*mut c_void, Callback, *mut AioCompletion) -> c_int,
    pub rbd_aio_get_return_value: unsafe extern "C" fn(AioCompletion) -> isize,
    pub rbd_aio_release: unsafe extern "C" fn(AioCompletion),
    pub rbd_aio_readv: unsafe extern "C" fn(Image, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_writev: unsafe extern "C" fn(Image, *const libc::iovec, c_int, u64, AioCompletion) -> c_int,
    pub rbd_aio_discard: unsafe extern "C" fn(Image, u64, u64, AioCompletion) -> c_int,
    pub rbd_aio_write_zeroes: unsafe extern "C" fn(Image, u64, usize, AioCompletion, c_int, c_int) -> c_int,
    pub rbd_aio_flush: unsafe extern "C" fn(Image, AioCompletion) -> c_int,
    _rados: Library,
    _rbd: Library,
}

/// The API, loaded once; the error says what is missing.
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn open(name: &str) -> Result<Library, String> {
    // SAFETY: loading runs the libraries' initialisers, which are Ceph's
    // own and set up nothing vsd relies on.
    unsafe { Library::new(name) }.map_err(|e| format!("cannot load {name} ({e}); is Ceph's librbd1 installed?"))
}

fn load() -> Result<Api, String> {
    let rados = open("librados.so.2")?;
    let rbd = open("librbd.so.1")?;
    macro_rules! resolve {
        ($lib:expr, $name:ident) => {
            // SAFETY: the symbol's type is its declaration in librados.h or
            // librbd.h (Ceph 16), and `Api` keeps the library loaded as
            // long as the pointer is used.
            *unsafe { $lib.get(concat!(stringify!($name), "\0").as_bytes()) }
                .map_err(|e| format!("{} lacks {}: {e}", stringify!($lib), stringify!($name)))?
        };
    }
    Ok(Api {
        rados_create: resolve!(rados, rados_create),
        rados_conf_read_file: resolve!(rados, rados_conf_read_file),
        rados_conf_set: resolve!(rados, rados_conf_set),
        rados_conf_get: resolve!(rados, rados_conf_get),
        rados_connect: resolve!(rados, rados_connect),
        rados_shutdown: resolve!(rados, rados_shutdown),
        rados_ioctx_create: resolve!(rados, rados_ioctx_create),
        rados_ioctx_set_namespace: resolve!(rados, rados_ioctx_set_namespace),
        rados_ioctx_destroy: resolve!(rados, rados_ioctx_destroy),
        rbd_open: resolve!(rbd, rbd_open),
        rbd_open_read_only: resolve!(rbd, rbd_open_read_only),
        rbd_close: resolve!(rbd, rbd_close),
        rbd_get_size: resolve!(rbd, rbd_get_size),
        rbd_resize: resolve!(rbd, rbd_resize),
        rbd_invalidate_cache: resolve!(rbd, rbd_invalidate_cache),
        rbd_aio_create_completion: resolve!(rbd, rbd_aio_create_completion),
        rbd_aio_get_return_value: resolve!(rbd, rbd_aio_get_return_value),
        rbd_aio_release: resolve!(rbd, rbd_aio_release),
        rbd_aio_readv: resolve!(rbd, rbd_aio_readv),
        rbd_aio_writev: resolve!(rbd, rbd_aio_writev),
        rbd_aio_discard: resolve!(rbd, rbd_aio_discard),
        rbd_aio_write_zeroes: resolve!(rbd, rbd_aio_write_zeroes),
        rbd_aio_flush: resolve!(rbd, rbd_aio_flush),
        _rados: rados,
        _rbd: rbd,
    })
}
