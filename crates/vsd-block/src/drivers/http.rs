//! `driver=http` and `driver=https`: a read-only image on a web server,
//! with the options and words of QEMU's curl driver.

use std::io;
use std::time::Duration;

use vsd_engine::IoQueue;
use vsd_http::{Config, Image};

use crate::options::OptionMap;
use crate::{BlockGraph, BlockNode, GraphError};

/// QEMU's defaults: 256 KiB read ahead, 5 seconds for a transfer.
const READAHEAD: u64 = 256 << 10;
const TIMEOUT: u64 = 5;
/// QEMU's longest `timeout`, in seconds.
const TIMEOUT_MAX: i64 = 10_000;

pub(crate) struct HttpNode {
    name: String,
    /// `http` or `https`, as the node was opened.
    driver: &'static str,
    image: Image,
}

impl HttpNode {
    /// Checks the options in QEMU's order, then asks the server for the size.
    pub(crate) fn open(
        name: String,
        driver: &'static str,
        opts: &mut OptionMap,
        graph: &BlockGraph,
    ) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let invalid = |reason: String| GraphError::Invalid { context: context.clone(), reason };
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        let auto_read_only = opts.take_bool("auto-read-only")?.unwrap_or(false);
        if !read_only && !auto_read_only {
            return Err(invalid("curl driver does not support writes".into()));
        }
        let readahead = opts.take_size("readahead")?.unwrap_or(READAHEAD);
        if readahead % 512 != 0 {
            return Err(invalid(format!("HTTP_READAHEAD_SIZE {readahead} is not a multiple of 512")));
        }
        let timeout = take_timeout(opts)?;
        let sslverify = opts.take_bool("sslverify")?.unwrap_or(true);
        let cookie = match (opts.take("cookie"), opts.take("cookie-secret")) {
            (Some(_), Some(_)) => {
                return Err(invalid("curl driver cannot handle both cookie and cookie secret".into()));
            }
            (_, Some(id)) => Some(secret(graph, &id).map_err(&invalid)?),
            (cookie, None) => cookie,
        };
        let url = opts.require("url")?;
        if !url.strip_prefix(driver).is_some_and(|rest| rest.starts_with("://")) {
            return Err(invalid(format!(
                "{driver} curl driver cannot handle the URL '{url}' (does not start with '{driver}://')"
            )));
        }
        let mut secret_of = |key: &str| match opts.take(key) {
            Some(id) => secret(graph, &id).map(Some).map_err(&invalid),
            None => Ok(None),
        };
        let password = secret_of("password-secret")?;
        let proxy_password = secret_of("proxy-password-secret")?;
        let config = Config {
            url,
            readahead,
            timeout,
            sslverify,
            cookie,
            username: opts.take("username"),
            password,
            proxy_username: opts.take("proxy-username"),
            proxy_password,
        };
        let image = Image::open(&config).map_err(|e| invalid(e.to_string()))?;
        Ok(Self { name, driver, image })
    }
}

/// `timeout`, in seconds: a number up to QEMU's limit.
fn take_timeout(opts: &mut OptionMap) -> Result<Duration, GraphError> {
    let Some(text) = opts.take_number("timeout")? else { return Ok(Duration::from_secs(TIMEOUT)) };
    match text.parse::<i64>() {
        Ok(secs) if (0..=TIMEOUT_MAX).contains(&secs) => Ok(Duration::from_secs(secs.unsigned_abs())),
        Ok(_) => Err(opts.rejected("timeout parameter is too large or negative").into()),
        Err(_) => Err(opts.invalid("timeout", &text, "an integer").into()),
    }
}

/// Secret `id` as text, as QEMU takes cookies and passwords.
fn secret(graph: &BlockGraph, id: &str) -> Result<String, String> {
    String::from_utf8(graph.secret(id)?).map_err(|_| format!("Data from secret {id} is not valid UTF-8"))
}

impl BlockNode for HttpNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        self.driver
    }

    fn size(&self) -> u64 {
        self.image.size()
    }

    fn read_only(&self) -> bool {
        true
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        Ok(Box::new(self.image.open_queue(depth)?))
    }
}
