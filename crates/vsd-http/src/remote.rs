//! The requests: the size at open, then ranges, each checked to be the
//! bytes asked for before a byte of it is used.

use std::io::{self, Read};
use std::sync::Arc;

use base64::Engine;
use ureq::http::{HeaderMap, Response};
use ureq::tls::{Certificate, PemItem, RootCerts, TlsConfig, TlsProvider};
use ureq::{Agent, Body, Proxy};

use crate::cache::Cache;
use crate::{Config, OpenError, TRANSFERS};

/// Where libcurl on Debian finds the system's CAs when `SSL_CERT_FILE`
/// does not name a bundle.
const SYSTEM_CAS: &str = "/etc/ssl/certs/ca-certificates.crt";
/// libcurl's limit on redirects followed (QEMU's curl follows them).
const MAX_REDIRECTS: u32 = 30;

/// The image on its server, and what was read of it lately.
pub(crate) struct Remote {
    agent: Agent,
    url: String,
    /// `Cookie` and `Authorization`, sent with each request.
    headers: Vec<(&'static str, String)>,
    size: u64,
    readahead: u64,
    cache: Cache,
}

impl Remote {
    /// Asks for the size: a `HEAD` that gives a length and says it takes
    /// byte ranges is enough; otherwise a one-byte range answers both.
    pub(crate) fn open(config: &Config) -> Result<Self, OpenError> {
        let mut remote = Self {
            agent: agent(config)?,
            url: config.url.clone(),
            headers: headers(config),
            size: 0,
            readahead: config.readahead,
            cache: Cache::new(TRANSFERS),
        };
        let head = remote.call(remote.agent.head(&remote.url)).map_err(|e| OpenError(remote.describe(&e)))?;
        let length = header(head.headers(), "content-length").and_then(|v| v.parse().ok());
        let ranges = header(head.headers(), "accept-ranges").is_some_and(|v| v.eq_ignore_ascii_case("bytes"));
        remote.size = match (length, ranges) {
            (Some(length), true) => length,
            _ => remote.probe_size()?,
        };
        Ok(remote)
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// The size from the total of a one-byte range's `Content-Range`.
    fn probe_size(&self) -> Result<u64, OpenError> {
        let mut response = self.get_range(0, 1).map_err(|e| OpenError(self.describe(&e)))?;
        if response.status() != 206 {
            return Err(OpenError("Server does not support 'range' (byte ranges).".into()));
        }
        // The byte itself, so that the connection can be used again.
        let _ = response.body_mut().with_config().limit(1).read_to_vec();
        content_range(response.headers())
            .and_then(|(_, _, total)| total)
            .ok_or_else(|| OpenError("Server didn't report file size.".into()))
    }

    /// Reads `len` bytes at `offset` (inside the image) into `iov`: from
    /// the cache, or fetched with the readahead after them.
    pub(crate) fn read(&self, offset: u64, len: u64, iov: &vsd_engine::IoVecs) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let fetch_end = end.saturating_add(self.readahead).min(self.size);
        let fetch = |start, end| self.fetch(start, end);
        self.cache.read(offset, end, fetch_end, fetch, |bytes| {
            let at = usize::try_from(offset - bytes.start).map_err(io::Error::other)?;
            // SAFETY: the queue's caller keeps the buffers valid and
            // untouched until the request completes, after this returns.
            unsafe { iov.fill(0, len, Some(&bytes.data[at..at + len as usize])) };
            Ok(())
        })
    }

    /// Bytes `start..end`, exactly those, or an error saying what came.
    fn fetch(&self, start: u64, end: u64) -> io::Result<Vec<u8>> {
        let fault = |what: String| io::Error::other(format!("{}: {what}", self.url));
        let response = self.get_range(start, end).map_err(|e| fault(self.describe(&e)))?;
        let want = end - start;
        if response.status() != 206 {
            return Err(fault(format!("the server ignored the byte range (status {})", response.status())));
        }
        match content_range(response.headers()) {
            Some((first, last, _)) if first == start && last + 1 == end => {}
            _ => return Err(fault(format!("the server answered another range than bytes {start}-{}", end - 1))),
        }
        let mut data = Vec::with_capacity(usize::try_from(want).map_err(io::Error::other)?);
        // One byte past the range tells a body that is too long.
        let read = response.into_body().into_reader().take(want + 1).read_to_end(&mut data);
        read.map_err(|e| fault(e.to_string()))?;
        if data.len() as u64 != want {
            return Err(fault(format!("{} bytes came for a range of {want}", data.len())));
        }
        Ok(data)
    }

    /// `GET` of bytes `start..end`.
    fn get_range(&self, start: u64, end: u64) -> Result<Response<Body>, ureq::Error> {
        self.call(self.agent.get(&self.url).header("Range", format!("bytes={start}-{}", end - 1)))
    }

    /// Sends a request with the image's headers.
    fn call(
        &self,
        mut request: ureq::RequestBuilder<ureq::typestate::WithoutBody>,
    ) -> Result<Response<Body>, ureq::Error> {
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        request.call()
    }

    /// A failed request in the words libcurl uses for it.
    fn describe(&self, e: &ureq::Error) -> String {
        let uri: Option<ureq::http::Uri> = self.url.parse().ok();
        let host = uri.as_ref().and_then(|u| u.host()).unwrap_or_default().to_string();
        let port = uri.as_ref().and_then(|u| u.port_u16()).unwrap_or(match uri.as_ref().and_then(|u| u.scheme_str()) {
            Some("https") => 443,
            _ => 80,
        });
        match e {
            ureq::Error::StatusCode(code) => format!("The requested URL returned error: {code}"),
            ureq::Error::HostNotFound => format!("Could not resolve host: {host}"),
            ureq::Error::Io(io) if connect_failure(io) => format!("Failed to connect to {host} port {port}: {io}"),
            ureq::Error::ConnectionFailed => format!("Failed to connect to {host} port {port}"),
            ureq::Error::Timeout(_) => "Operation timed out".into(),
            ureq::Error::TooManyRedirects => format!("Maximum ({MAX_REDIRECTS}) redirects followed"),
            other => other.to_string(),
        }
    }
}

fn connect_failure(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(e.kind(), ConnectionRefused | HostUnreachable | NetworkUnreachable | AddrNotAvailable)
}

/// The agent, with QEMU's timeout, certificate checks and proxy.
fn agent(config: &Config) -> Result<Agent, OpenError> {
    let tls = TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .disable_verification(!config.sslverify);
    let tls = if config.sslverify && config.url.starts_with("https://") { tls.root_certs(roots()?) } else { tls };
    let timeout = (!config.timeout.is_zero()).then_some(config.timeout);
    Ok(Agent::config_builder()
        .tls_config(tls.build())
        .timeout_global(timeout)
        .max_redirects(MAX_REDIRECTS)
        .max_idle_connections_per_host(TRANSFERS)
        // Ranges are of the bytes as stored, never of a compressed body.
        .accept_encoding("identity")
        .proxy(proxy(config))
        .build()
        .new_agent())
}

/// The CAs that libcurl would trust: those of `SSL_CERT_FILE`, or the system's.
fn roots() -> Result<RootCerts, OpenError> {
    let path = std::env::var_os("SSL_CERT_FILE").unwrap_or_else(|| SYSTEM_CAS.into());
    let shown = path.to_string_lossy().into_owned();
    let pem = std::fs::read(&path).map_err(|e| OpenError(format!("error setting certificate file: {shown}: {e}")))?;
    let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
        .filter_map(|item| match item {
            Ok(PemItem::Certificate(cert)) => Some(cert),
            _ => None,
        })
        .collect();
    if certs.is_empty() {
        return Err(OpenError(format!("error setting certificate file: {shown}: no certificate in it")));
    }
    Ok(RootCerts::new_with_certs(&certs))
}

/// The environment's proxy (libcurl's variables), with the credentials
/// of the options in place of any the variable has.
fn proxy(config: &Config) -> Option<Proxy> {
    let found = Proxy::try_from_env()?;
    let Some(user) = &config.proxy_username else { return Some(found) };
    let mut proxy = Proxy::builder(found.protocol()).host(found.host()).port(found.port()).username(user);
    if let Some(password) = &config.proxy_password {
        proxy = proxy.password(password);
    }
    if let Some(skip) = ["NO_PROXY", "no_proxy"].into_iter().find_map(|name| std::env::var(name).ok()) {
        proxy = proxy.no_proxy(&skip);
    }
    proxy.build().ok().or(Some(found))
}

/// `Cookie` and basic `Authorization`, as libcurl sends them.
fn headers(config: &Config) -> Vec<(&'static str, String)> {
    let mut headers = Vec::new();
    if let Some(cookie) = &config.cookie {
        headers.push(("Cookie", cookie.clone()));
    }
    if let Some(user) = &config.username {
        let pair = format!("{user}:{}", config.password.as_deref().unwrap_or_default());
        headers.push(("Authorization", format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))));
    }
    headers
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// `Content-Range: bytes FIRST-LAST/TOTAL` (TOTAL may be `*`).
fn content_range(headers: &HeaderMap) -> Option<(u64, u64, Option<u64>)> {
    let value = header(headers, "content-range")?.strip_prefix("bytes ")?;
    let (range, total) = value.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last): (u64, u64) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last).then_some((first, last, total.trim().parse().ok()))
}
