//! `driver=nbd`: an export on an NBD server, with QEMU's options.

use std::io;
use std::time::Duration;

use vsd_engine::IoQueue;
use vsd_nbd_client::{Config, NbdClient};
use vsd_nbd_proto::tx_flag;

use crate::options::OptionMap;
use crate::{BlockNode, GraphError};

pub(crate) struct NbdNode {
    name: String,
    client: NbdClient,
    read_only: bool,
}

impl NbdNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let invalid = |reason: String| GraphError::Invalid { context: context.clone(), reason };
        let server = opts.take_address("server")?;
        let export = opts.take("export").unwrap_or_default();
        let reconnect_delay = Duration::from_secs(opts.take_u64("reconnect-delay")?.unwrap_or(0));
        if let Some(id) = opts.take("tls-creds") {
            return Err(invalid(format!("tls-creds={id}: vsd's NBD client does not speak TLS")));
        }
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        let client =
            NbdClient::connect(Config { server, export, reconnect_delay }).map_err(|e| invalid(e.to_string()))?;
        if !read_only && client.export().has(tx_flag::READ_ONLY) {
            // QEMU's words, when auto-read-only is off.
            return Err(invalid("NBD export is read-only".into()));
        }
        Ok(Self { name, client, read_only })
    }
}

impl BlockNode for NbdNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "nbd"
    }

    fn size(&self) -> u64 {
        self.client.export().size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn request_alignment(&self) -> u32 {
        self.client.export().min_block
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        Ok(Box::new(self.client.open_queue(depth)?))
    }
}
