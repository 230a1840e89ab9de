//! A connection to the cluster and one open image on it.

use std::ffi::{CString, c_int};
use std::io;
use std::num::NonZero;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::ffi::{self, Api};

/// Where the image is and how to reach its cluster: QEMU's `rbd` options.
#[derive(Clone, Debug, Default)]
pub struct Location {
    /// `conf`: a ceph.conf; `None` reads librados' default places.
    pub conf: Option<String>,
    /// `user`: the client's id (`admin` if `None`).
    pub user: Option<String>,
    /// The key of `key-secret`, as Ceph's keyrings write it (base64).
    pub key: Option<String>,
    /// `auth-client-required`: `cephx`, `none`, or both (`cephx;none`).
    pub auth_client_required: Option<String>,
    /// `server`: the monitors, as ceph.conf's `mon_host` lists them.
    pub mon_host: Option<String>,
    /// `pool`.
    pub pool: String,
    /// `namespace` in the pool.
    pub namespace: Option<String>,
    /// `image`.
    pub image: String,
    /// `snapshot`: a read-only view of the image as it was.
    pub snapshot: Option<String>,
    /// librbd's own cache (`rbd_cache`): off with `cache.direct=on`, as
    /// QEMU sets it.
    pub cache: bool,
}

/// Why an image could not be opened, in QEMU's words.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// librbd or librados could not be loaded.
    #[error("{0}")]
    Library(String),
    /// An option holds a NUL byte.
    #[error("'{0}' must not contain a NUL byte")]
    Nul(&'static str),
    /// A step of connecting failed.
    #[error("{what}: {source}")]
    Cluster {
        /// QEMU's description of the step.
        what: String,
        /// librados' or librbd's answer.
        #[source]
        source: io::Error,
    },
}

/// An open image, shared by every queue of its node: librbd's handles are
/// safe to use from several threads, and one handle per node keeps one
/// owner of the image's exclusive lock (two handles in one process would
/// pass the lock back and forth on every write).
pub struct Image {
    pub(crate) api: &'static Api,
    rados: ffi::Rados,
    ioctx: ffi::IoCtx,
    pub(crate) handle: ffi::Image,
    size: AtomicU64,
    /// Serialises growing the image for writes past its end.
    grow: Mutex<()>,
    read_only: bool,
}

// SAFETY: librados' cluster and I/O context handles and librbd's image
// handles may be used from any thread and from several at once (librbd
// locks inside); vsd never frees them while a request is in flight (queues
// hold the image until their requests complete).
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

/// librados' and librbd's negative errno return, as a result.
pub(crate) fn check(ret: c_int) -> io::Result<()> {
    if ret < 0 { Err(io::Error::from_raw_os_error(-ret)) } else { Ok(()) }
}

fn text(what: &'static str, value: &str) -> Result<CString, OpenError> {
    CString::new(value).map_err(|_| OpenError::Nul(what))
}

/// A librados cluster handle being set up: shut down unless connected and
/// handed to an image.
struct Connecting {
    api: &'static Api,
    rados: ffi::Rados,
    ioctx: ffi::IoCtx,
}

impl Drop for Connecting {
    fn drop(&mut self) {
        // SAFETY: the handles were created by this API and are not used
        // after this; a null I/O context was never created.
        unsafe {
            if !self.ioctx.is_null() {
                (self.api.rados_ioctx_destroy)(self.ioctx);
            }
            if !self.rados.is_null() {
                (self.api.rados_shutdown)(self.rados);
            }
        }
    }
}

impl Connecting {
    fn set(&self, option: &'static str, value: &str) -> Result<(), OpenError> {
        let (name, value) = (text(option, option)?, text(option, value)?);
        // SAFETY: a live, unconnected handle and two C strings that outlive the call.
        let ret = unsafe { (self.api.rados_conf_set)(self.rados, name.as_ptr(), value.as_ptr()) };
        check(ret).map_err(|source| OpenError::Cluster { what: format!("invalid conf option {option}"), source })
    }

    /// Sizes librados' thread pool, on which librbd dispatches and
    /// completes every request, to one thread when the threads librados
    /// starts (they inherit this one's CPUs, and the cgroup's quota) have
    /// one CPU's worth to run on. The two default threads cannot run at
    /// once there; they only hand requests to each other, at twice the
    /// switches per request. A size ceph.conf sets stays, unless it is the
    /// default's 2, which librados does not tell apart from the default.
    fn fit_thread_pool(&self) -> Result<(), OpenError> {
        let cpus = std::thread::available_parallelism().map_or(1, NonZero::get);
        if cpus == 1 && self.get("librados_thread_count") == LIBRADOS_THREAD_COUNT {
            self.set("librados_thread_count", "1")?;
        }
        Ok(())
    }

    /// An option's value as librados has it now ("" if it cannot say).
    fn get(&self, option: &'static str) -> String {
        let Ok(name) = text(option, option) else { return String::new() };
        let mut value = [0u8; 64];
        // SAFETY: a live handle, a C string, and a buffer of the length given.
        let ret =
            unsafe { (self.api.rados_conf_get)(self.rados, name.as_ptr(), value.as_mut_ptr().cast(), value.len()) };
        if ret < 0 {
            return String::new();
        }
        let end = value.iter().position(|&b| b == 0).unwrap_or(value.len());
        String::from_utf8_lossy(&value[..end]).into_owned()
    }
}

/// librados waits this long for an unreachable cluster before `rados_connect` fails.
const LIBRADOS_MOUNT_TIMEOUT: &str = "300";
/// The threads of librados' pool, unless ceph.conf says.
const LIBRADOS_THREAD_COUNT: &str = "2";

impl Image {
    /// Connects to the cluster and opens the image (read-only if
    /// `read_only`, as a snapshot always is).
    pub fn open(location: &Location, read_only: bool) -> Result<Image, OpenError> {
        let api = ffi::api().map_err(OpenError::Library)?;
        let failed = |what: String| move |source| OpenError::Cluster { what, source };
        let user_name = location.user.as_deref().unwrap_or("admin");
        let user = text("user", user_name)?;
        let mut c = Connecting { api, rados: ptr::null_mut(), ioctx: ptr::null_mut() };
        // SAFETY: `c.rados` receives the new handle; `user` outlives the call.
        check(unsafe { (api.rados_create)(&mut c.rados, user.as_ptr()) })
            .map_err(failed("error initializing".into()))?;
        let conf = location.conf.as_deref().map(|path| text("conf", path)).transpose()?;
        // SAFETY: a live handle; a null path makes librados search its default places.
        let ret = unsafe { (api.rados_conf_read_file)(c.rados, conf.as_ref().map_or(ptr::null(), |p| p.as_ptr())) };
        // Without `conf` a missing default file is fine: `server` may say it all.
        if location.conf.is_some() || location.mon_host.is_none() {
            let path = location.conf.as_deref().unwrap_or("(default)");
            check(ret).map_err(failed(format!("error reading conf file {path}")))?;
        }
        // A cluster that cannot be reached fails the open after 30 s, not
        // librados' 5 minutes, unless ceph.conf says how long.
        if c.get("client_mount_timeout") == LIBRADOS_MOUNT_TIMEOUT {
            c.set("client_mount_timeout", "30")?;
        }
        c.fit_thread_pool()?;
        c.set("rbd_cache", if location.cache { "true" } else { "false" })?;
        for (option, value) in [
            ("mon_host", &location.mon_host),
            ("key", &location.key),
            ("auth_client_required", &location.auth_client_required),
        ] {
            if let Some(value) = value {
                c.set(option, value)?;
            }
        }
        // QEMU's words, and whose key a refusal would be about.
        // SAFETY: a live, configured handle.
        check(unsafe { (api.rados_connect)(c.rados) })
            .map_err(failed(format!("error connecting (as client.{user_name})")))?;
        let pool = text("pool", &location.pool)?;
        // SAFETY: a connected handle; `c.ioctx` receives the context.
        check(unsafe { (api.rados_ioctx_create)(c.rados, pool.as_ptr(), &mut c.ioctx) })
            .map_err(failed(format!("error opening pool {}", location.pool)))?;
        if let Some(namespace) = &location.namespace {
            let namespace = text("namespace", namespace)?;
            // SAFETY: a live context; librados copies the name.
            unsafe { (api.rados_ioctx_set_namespace)(c.ioctx, namespace.as_ptr()) };
        }
        let image = text("image", &location.image)?;
        let snapshot = location.snapshot.as_deref().map(|s| text("snapshot", s)).transpose()?;
        let open = if read_only { api.rbd_open_read_only } else { api.rbd_open };
        let mut handle = ptr::null_mut();
        // SAFETY: a live context; `handle` receives the image; the names
        // outlive the call (a null snapshot opens the image itself).
        let ret = unsafe {
            open(c.ioctx, image.as_ptr(), &mut handle, snapshot.as_ref().map_or(ptr::null(), |s| s.as_ptr()))
        };
        check(ret).map_err(failed(format!("error reading header from {}", location.image)))?;
        let (rados, ioctx) = (c.rados, c.ioctx);
        std::mem::forget(c);
        let image = Image { api, rados, ioctx, handle, size: AtomicU64::new(0), grow: Mutex::new(()), read_only };
        image.refresh_size().map_err(failed(format!("cannot size {}", location.image)))?;
        Ok(image)
    }

    /// The size in bytes, as of the last time this process asked or changed it.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    /// Whether the image was opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Asks the cluster for the size (another client may have resized it).
    pub fn refresh_size(&self) -> io::Result<u64> {
        let mut size = 0;
        // SAFETY: a live image; `size` receives the answer.
        check(unsafe { (self.api.rbd_get_size)(self.handle, &mut size) })?;
        self.size.store(size, Ordering::Relaxed);
        Ok(size)
    }

    /// Resizes the image (`block_resize`).
    pub fn resize(&self, size: u64) -> io::Result<()> {
        let _serialised = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        self.set_size(size)
    }

    /// Grows the image to at least `end` bytes: a format on top writes past
    /// its end, as it does on a file.
    pub(crate) fn grow_to(&self, end: u64) -> io::Result<()> {
        let _serialised = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        if end <= self.size() { Ok(()) } else { self.set_size(end) }
    }

    fn set_size(&self, size: u64) -> io::Result<()> {
        // SAFETY: a live image.
        check(unsafe { (self.api.rbd_resize)(self.handle, size) })?;
        self.size.store(size, Ordering::Relaxed);
        Ok(())
    }

    /// Drops what librbd caches of the image (another process wrote it
    /// while this one held it inactive).
    pub fn invalidate_cache(&self) -> io::Result<()> {
        // SAFETY: a live image.
        check(unsafe { (self.api.rbd_invalidate_cache)(self.handle) })?;
        self.refresh_size().map(drop)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: no queue is left (each holds the image), so no request is
        // in flight; the handles are not used after this.
        unsafe {
            if let Err(e) = check((self.api.rbd_close)(self.handle)) {
                log::warn!("closing an RBD image: {e}");
            }
            (self.api.rados_ioctx_destroy)(self.ioctx);
            (self.api.rados_shutdown)(self.rados);
        }
    }
}
