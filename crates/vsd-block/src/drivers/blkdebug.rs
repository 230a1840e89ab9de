//! `driver=blkdebug`: a transparent filter over its `image` child that
//! fails chosen requests with a chosen errno, to test how the layers above
//! (formats, the export, guests) cope with a failing host.
//!
//! Rules are QEMU's `inject-error.N.*` keys, numbered from 0 without gaps:
//! `iotype` (default: every type), `errno` (default EIO), `sector` (default:
//! any; the rule matches a request touching that 512-byte sector)
//! and `once` (fire one time only, across all queues). The first rule that
//! matches answers the request without passing it down, so a failed read
//! never touches the caller's buffers.
//!
//! QEMU's rules also name an `event` (a point inside its block layer, such
//! as `l2_update`) and a `state`; vsd has neither, so those keys are refused
//! rather than ignored: a rule that silently matched more than asked would
//! fail a test for the wrong reason.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use vsd_engine::{IoOp, IoQueue};

use super::{Filter, FilteredQueue, Route};
use crate::options::OptionMap;
use crate::{BlockGraph, BlockNode, GraphError};

const SECTOR: u64 = 512;

/// The largest errno a rule may inject (the kernel's MAX_ERRNO).
const MAX_ERRNO: u64 = 4095;

/// The request types a rule can name, with QEMU's `iotype` spellings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IoType {
    Read,
    Write,
    WriteZeroes,
    Discard,
    Flush,
}

impl IoType {
    const NAMES: [&'static str; 5] = ["read", "write", "write-zeroes", "discard", "flush"];

    /// One of [`IoType::NAMES`] (as `take_choice` returns them).
    fn from_name(name: &str) -> Self {
        match name {
            "read" => Self::Read,
            "write" => Self::Write,
            "write-zeroes" => Self::WriteZeroes,
            "discard" => Self::Discard,
            _ => Self::Flush,
        }
    }

    fn of(op: &IoOp) -> Self {
        match op {
            IoOp::Read { .. } => Self::Read,
            IoOp::Write { .. } | IoOp::WriteCompressed { .. } => Self::Write,
            IoOp::WriteZeroes { .. } => Self::WriteZeroes,
            IoOp::Discard { .. } => Self::Discard,
            IoOp::Flush => Self::Flush,
        }
    }
}

/// One `inject-error.N` rule.
#[derive(Debug)]
struct Rule {
    /// `None`: requests of every type.
    iotype: Option<IoType>,
    errno: i32,
    /// Byte offset of the sector a request must touch; `None`: any request.
    /// A request without a range (flush) never touches one.
    at: Option<u64>,
    once: bool,
    /// A `once` rule has fired. Shared by every queue: once means once for
    /// the node, not once per queue.
    fired: AtomicBool,
}

impl Rule {
    fn matches(&self, iotype: IoType, extent: Option<(u64, u64)>) -> bool {
        let type_ok = self.iotype.is_none_or(|t| t == iotype);
        let sector_ok = match (self.at, extent) {
            (None, _) => true,
            // Any byte of the sector: a format's metadata requests need not
            // be sector-aligned.
            (Some(at), Some((offset, len))) => {
                len > 0 && offset < at.saturating_add(SECTOR) && at < offset.saturating_add(len)
            }
            (Some(_), None) => false,
        };
        type_ok && sector_ok
    }

    /// The errno to fail this request with, if the rule fires for it.
    fn fire(&self, iotype: IoType, extent: Option<(u64, u64)>) -> Option<i32> {
        if !self.matches(iotype, extent) {
            return None;
        }
        // Of several queues racing for a once-rule, exactly one wins.
        let first = || self.fired.compare_exchange(false, true, Ordering::Relaxed, Ordering::Relaxed).is_ok();
        (!self.once || first()).then_some(self.errno)
    }
}

/// Every rule of a node, shared by its queues.
#[derive(Clone)]
struct Rules(Arc<[Rule]>);

impl Rules {
    fn errno_for(&self, iotype: IoType, extent: Option<(u64, u64)>) -> Option<i32> {
        self.0.iter().find_map(|rule| rule.fire(iotype, extent))
    }
}

impl Filter for Rules {
    fn route(&self, op: IoOp) -> Route {
        match self.errno_for(IoType::of(&op), op.extent()) {
            Some(errno) => Route::Answer(errno),
            None => Route::Forward(op),
        }
    }
}

pub(crate) struct BlkdebugNode {
    name: String,
    child: Arc<dyn BlockNode>,
    rules: Rules,
    read_only: bool,
}

impl BlkdebugNode {
    pub(crate) fn open(name: String, opts: &mut OptionMap, graph: &BlockGraph) -> Result<Self, GraphError> {
        let child = graph.child(opts, "image")?;
        let rules = parse_rules(opts)?;
        let read_only = opts.take_bool("read-only")?.unwrap_or(false) || child.read_only();
        Ok(Self { name, child, rules: Rules(rules.into()), read_only })
    }
}

/// Takes the `inject-error.0.*`, `inject-error.1.*`, ... rules, stopping
/// at the first number with none of a rule's keys (a key left behind by a
/// gap in the numbers is then reported as unknown).
fn parse_rules(opts: &mut OptionMap) -> Result<Vec<Rule>, GraphError> {
    let mut rules = Vec::new();
    while let Some(rule) = parse_rule(opts, &format!("inject-error.{}.", rules.len()))? {
        rules.push(rule);
    }
    Ok(rules)
}

/// The rule whose keys start with `prefix`, if any of them is present.
fn parse_rule(opts: &mut OptionMap, prefix: &str) -> Result<Option<Rule>, GraphError> {
    let key = |name: &str| format!("{prefix}{name}");
    for unsupported in ["event", "state"] {
        if let Some(value) = opts.take(&key(unsupported)) {
            return Err(GraphError::Invalid {
                context: opts.context().into(),
                reason: format!(
                    "parameter '{}' ('{value}') is not supported: vsd has no blkdebug events or states; \
                     leave it out and the rule matches every request of its iotype (and sector)",
                    key(unsupported)
                ),
            });
        }
    }
    let iotype = opts.take_choice(&key("iotype"), &IoType::NAMES)?;
    let errno = opts.take_u64(&key("errno"))?;
    let sector = opts.take_u64(&key("sector"))?;
    let once = opts.take_bool(&key("once"))?;
    if iotype.is_none() && errno.is_none() && sector.is_none() && once.is_none() {
        return Ok(None);
    }
    let errno = match errno {
        None => libc::EIO,
        Some(e @ 1..=MAX_ERRNO) => e as i32,
        Some(e) => return Err(opts.invalid(&key("errno"), e, &format!("an errno from 1 to {MAX_ERRNO}")).into()),
    };
    let at = sector
        .map(|s| s.checked_mul(SECTOR).ok_or_else(|| opts.invalid(&key("sector"), s, "a sector number below 2^55")))
        .transpose()?;
    Ok(Some(Rule {
        iotype: iotype.map(IoType::from_name),
        errno,
        at,
        once: once.unwrap_or(false),
        fired: AtomicBool::new(false),
    }))
}

impl BlockNode for BlkdebugNode {
    fn name(&self) -> &str {
        &self.name
    }

    fn driver(&self) -> &'static str {
        "blkdebug"
    }

    fn size(&self) -> u64 {
        self.child.size()
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    /// The child's file: a format on top resolves its backing file's
    /// relative name against it, as it would without the filter.
    fn filename(&self) -> Option<&str> {
        self.child.filename()
    }

    fn claim(&self, claim: crate::Claim) -> Result<Vec<crate::ClaimGuard>, crate::LockError> {
        self.child.claim(claim)
    }

    fn children(&self) -> Vec<(&'static str, Arc<dyn BlockNode>)> {
        vec![("image", self.child.clone())]
    }

    fn resize(&self, size: u64) -> io::Result<()> {
        self.child.resize(size)
    }

    fn block_status(&self, offset: u64, len: u64) -> io::Result<(crate::Allocation, u64)> {
        self.child.block_status(offset, len)
    }

    fn allocation_depth(&self, offset: u64, len: u64) -> io::Result<(u32, u64)> {
        self.child.allocation_depth(offset, len)
    }

    fn open_queue(&self, depth: u16) -> io::Result<Box<dyn IoQueue>> {
        Ok(Box::new(FilteredQueue::new(self.child.open_queue(depth)?, self.rules.clone(), depth)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blkdebug node with options `opts`, in a graph holding a 1 MiB
    /// null-co node called `null`.
    fn node(opts: &str) -> Result<Arc<dyn BlockNode>, GraphError> {
        let mut graph = BlockGraph::new();
        graph.add(OptionMap::parse("--blockdev", "driver=null-co,node-name=null,size=1M").unwrap()).unwrap();
        graph.add(OptionMap::parse("--blockdev", &format!("driver=blkdebug,node-name=dbg{opts}"))?)
    }

    fn rules(text: &str) -> Rules {
        let mut opts = OptionMap::parse("--blockdev", text).unwrap();
        let rules = parse_rules(&mut opts).unwrap();
        opts.finish().unwrap();
        Rules(rules.into())
    }

    fn error_of(opts: &str) -> String {
        node(opts).err().expect("the options are refused").to_string()
    }

    #[test]
    fn a_rule_with_defaults_fails_every_request_with_eio() {
        let r = rules("inject-error.0.once=off");
        for t in [IoType::Read, IoType::Write, IoType::WriteZeroes, IoType::Discard] {
            assert_eq!(r.errno_for(t, Some((0, 4096))), Some(libc::EIO), "{t:?}");
        }
        assert_eq!(r.errno_for(IoType::Flush, None), Some(libc::EIO));
    }

    #[test]
    fn iotype_and_errno_select_requests() {
        let r = rules("inject-error.0.iotype=write,inject-error.0.errno=28,inject-error.1.iotype=flush");
        assert_eq!(r.errno_for(IoType::Write, Some((0, 512))), Some(libc::ENOSPC));
        assert_eq!(r.errno_for(IoType::Flush, None), Some(libc::EIO));
        assert_eq!(r.errno_for(IoType::Read, Some((0, 512))), None);
        assert_eq!(r.errno_for(IoType::WriteZeroes, Some((0, 512))), None);
    }

    #[test]
    fn a_sector_rule_matches_requests_touching_that_sector() {
        let r = rules("inject-error.0.sector=8");
        let (at, sector) = (8 * 512, 512);
        assert_eq!(r.errno_for(IoType::Read, Some((at, sector))), Some(libc::EIO));
        assert_eq!(r.errno_for(IoType::Read, Some((0, at + 1))), Some(libc::EIO), "its first byte is enough");
        assert_eq!(r.errno_for(IoType::Read, Some((at + sector - 1, 1))), Some(libc::EIO), "and its last byte");
        assert_eq!(r.errno_for(IoType::Read, Some((0, at))), None, "ends just before");
        assert_eq!(r.errno_for(IoType::Read, Some((at + sector, 4096))), None, "starts just after");
        assert_eq!(r.errno_for(IoType::Write, Some((at, 0))), None, "an empty range covers nothing");
        assert_eq!(r.errno_for(IoType::Flush, None), None, "a flush has no sectors");
    }

    #[test]
    fn a_once_rule_fires_one_time_across_queues() {
        let r = rules("inject-error.0.iotype=read,inject-error.0.once=on");
        let fired: usize = std::thread::scope(|s| {
            let queues: Vec<_> = (0..4)
                .map(|_| {
                    let r = r.clone();
                    s.spawn(move || (0..100).filter(|_| r.errno_for(IoType::Read, Some((0, 512))).is_some()).count())
                })
                .collect();
            queues.into_iter().map(|q| q.join().unwrap()).sum()
        });
        assert_eq!(fired, 1);
    }

    #[test]
    fn a_spent_once_rule_lets_the_next_rule_decide() {
        let r = rules("inject-error.0.once=on,inject-error.0.errno=28,inject-error.1.errno=5");
        assert_eq!(r.errno_for(IoType::Write, Some((0, 512))), Some(libc::ENOSPC));
        assert_eq!(r.errno_for(IoType::Write, Some((0, 512))), Some(libc::EIO));
    }

    #[test]
    fn the_node_is_a_transparent_filter() {
        let node = node(",image=null,inject-error.0.iotype=read").unwrap();
        assert_eq!(node.driver(), "blkdebug");
        assert_eq!(node.size(), 1 << 20);
        assert!(!node.read_only());
        let children = node.children();
        assert_eq!((children[0].0, children[0].1.name()), ("image", "null"));
        node.resize(2 << 20).unwrap();
        assert_eq!((node.size(), children[0].1.size()), (2 << 20, 2 << 20), "the child was resized");
    }

    #[test]
    fn option_mistakes_name_the_key() {
        let cases = [
            ("", "parameter 'image' is missing"),
            (",image=nowhere", "no node named 'nowhere'"),
            (
                ",inject-error.0.iotype=block-status",
                "'inject-error.0.iotype' does not accept value 'block-status' (one of read, write",
            ),
            (",inject-error.0.errno=0", "'inject-error.0.errno' expects an errno from 1 to 4095, not '0'"),
            (",inject-error.0.errno=-5", "'inject-error.0.errno' expects an unsigned integer"),
            (",inject-error.0.sector=36028797018963968", "'inject-error.0.sector' expects a sector number"),
            (",inject-error.0.once=sometimes", "'inject-error.0.once' expects on or off"),
            (",inject-error.0.sectr=1", "unknown parameter 'inject-error.0.sectr'"),
            (",inject-error.0.iotype=read,inject-error.2.iotype=write", "unknown parameter 'inject-error.2.iotype'"),
            (",inject-error.0.event=read_aio", "parameter 'inject-error.0.event' ('read_aio') is not supported"),
            (",inject-error.0.iotype=read,inject-error.1.state=1", "'inject-error.1.state' ('1') is not supported"),
            (",set-state.0.event=read_aio", "unknown parameter 'set-state.0.event'"),
        ];
        for (opts, expected) in cases {
            let image = if opts.is_empty() || opts.starts_with(",image=") { "" } else { ",image=null" };
            let err = error_of(&format!("{image}{opts}"));
            assert!(err.starts_with("--blockdev node-name=dbg: "), "{opts}: {err}");
            assert!(err.contains(expected), "{opts}: {err}");
        }
    }
}
