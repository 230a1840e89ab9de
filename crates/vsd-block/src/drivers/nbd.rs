//! `driver=nbd`: an export on an NBD server, with QEMU's options.

use std::io;
use std::time::Duration;

use vsd_engine::IoQueue;
use vsd_nbd_client::{Address, Config, NbdClient, Tls};
use vsd_nbd_proto::{state, tx_flag};

use crate::options::OptionMap;
use crate::{Allocation, BlockGraph, BlockNode, GraphError};

pub(crate) struct NbdNode {
    name: String,
    client: NbdClient,
    read_only: bool,
}

impl NbdNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let context = opts.context().to_string();
        let invalid = |reason: String| GraphError::Invalid { context: context.clone(), reason };
        let server = opts.take_address("server")?;
        let export = opts.take("export").unwrap_or_default();
        let reconnect_delay = Duration::from_secs(opts.take_u64("reconnect-delay")?.unwrap_or(0));
        let hostname = opts.take("tls-hostname");
        let tls = match opts.take("tls-creds") {
            Some(id) => {
                let creds = graph.tls_client_creds(&id).map_err(&invalid)?;
                let hostname = hostname.or_else(|| match &server {
                    Address::Inet { host, .. } => Some(host.clone()),
                    Address::Unix(_) | Address::Fd(_) => None,
                });
                Some(Tls { creds, hostname })
            }
            None => None,
        };
        let read_only = opts.take_bool("read-only")?.unwrap_or(false);
        let config = Config { server, export, reconnect_delay, tls };
        let client = NbdClient::connect(config).map_err(|e| invalid(e.to_string()))?;
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

    /// The server's `base:allocation`, when it has it. A hole is what reads
    /// as zeroes and is not allocated (HOLE and ZERO); zeroes that are
    /// allocated (ZERO alone) and holes that may not read as zeroes (HOLE
    /// alone, over a backing file) are data, which is never wrong: the
    /// enum has no allocated-zero kind, and a hole there would let a copy
    /// skip bytes that are not zeroes.
    ///
    /// The server may refuse a range that is not in whole blocks of its
    /// minimum size (QEMU's client only asks such ranges): bytes up to the
    /// next block are data without asking, and a range is asked in whole
    /// blocks (the export's end excepted) and the answer cut to it.
    fn block_status(&self, offset: u64, len: u64) -> io::Result<(Allocation, u64)> {
        let export = self.client.export();
        let align = u64::from(export.min_block.max(1));
        if !offset.is_multiple_of(align) {
            return Ok((Allocation::Data, len.min(align - offset % align)));
        }
        let ask = len.next_multiple_of(align).min(export.size.saturating_sub(offset)).max(len);
        Ok(match self.client.block_status(offset, ask)? {
            Some((n, flags)) if flags & (state::HOLE | state::ZERO) == state::HOLE | state::ZERO => {
                (Allocation::Hole, n.min(len))
            }
            Some((n, _)) => (Allocation::Data, n.min(len)),
            None => (Allocation::Data, len),
        })
    }
}
