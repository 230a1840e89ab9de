//! An NBD client's bytes, as vsd's server reads them: the handshake
//! (`vsd_nbd::negotiate::Negotiation`, fed in chunks of any size), then the
//! transmission phase's request headers (`vsd_nbd::proto::Request::parse`
//! and `check`) in the reply mode the handshake agreed on.
//!
//! The first two input bytes choose how the rest is cut into chunks, and
//! whether the server requires TLS (the bytes after STARTTLS are then read
//! as the options that the TLS session would decrypt). What must hold,
//! besides not panicking:
//! - the handshake consumes no more than it is given, keeps at most one
//!   option's worth of data, and answers the same bytes however the input
//!   is chunked;
//! - after the handshake, every request `check` accepts stays inside the
//!   export and within the payload limit, and a write is never accepted on
//!   a read-only export.

#![no_main]

use libfuzzer_sys::fuzz_target;
use vsd_nbd::negotiate::{Catalog, ExportInfo, MAX_OPTION_DATA, Negotiation};
use vsd_nbd::proto::{Command, Limits, Request};

const SIZE: u64 = 1 << 20;
const MAX_PAYLOAD: u64 = 32 << 20;

/// One export, read-only or not.
struct OneExport(bool);

impl Catalog for OneExport {
    type Export = bool;

    fn find(&self, name: &str) -> Option<(bool, ExportInfo)> {
        let flags = if self.0 { 1 << 1 } else { 0 };
        let info = ExportInfo {
            name: "disk".into(),
            description: "fuzz".into(),
            size: SIZE,
            flags: 1 | flags,
            block_sizes: [1, 4096, MAX_PAYLOAD as u32],
            bitmaps: vec!["b".into()],
            allocation_depth: true,
        };
        (name.is_empty() || name == "disk").then_some((self.0, info))
    }

    fn list(&self) -> Vec<(String, String)> {
        vec![("disk".into(), "fuzz".into())]
    }
}

/// Feeds `input` in chunks whose sizes cycle through `cuts`; returns the
/// server's output, how much of the input the handshake took, and the
/// negotiation.
fn handshake(input: &[u8], cuts: &[usize], read_only: bool, tls: bool) -> (Vec<u8>, usize, Negotiation<OneExport>) {
    let mut negotiation = Negotiation::new(OneExport(read_only), tls);
    let (mut output, mut at) = (negotiation.take_output(), 0);
    for &cut in cuts.iter().cycle() {
        if at >= input.len() || negotiation.finished() {
            break;
        }
        let chunk = &input[at..(at + cut).min(input.len())];
        let taken = negotiation.feed(chunk);
        assert!(taken <= chunk.len(), "took {taken} of {} bytes", chunk.len());
        output.extend(negotiation.take_output());
        at += taken;
        if taken < chunk.len() && !negotiation.take_starttls() {
            assert!(negotiation.finished(), "stopped consuming before the end of the handshake");
        }
    }
    (output, at, negotiation)
}

fuzz_target!(|data: &[u8]| {
    let [seed, cut, rest @ ..] = data else { return };
    let (read_only, tls) = (seed & 1 != 0, cut & 0x80 != 0);
    let cuts = [usize::from(cut & 0x7f).max(1), usize::from(seed >> 1).max(1)];
    let (output, taken, mut negotiation) = handshake(rest, &cuts, read_only, tls);
    // The same bytes in one chunk: the same answer.
    let (whole, whole_taken, _) = handshake(rest, &[rest.len().max(1)], read_only, tls);
    assert_eq!((output.len(), taken), (whole.len(), whole_taken), "chunking changed the handshake");
    assert_eq!(output, whole);
    // Bounded: the answers to the options given, not to their data.
    assert!(output.len() <= 256 + 64 * taken + MAX_OPTION_DATA as usize);

    let Some(Ok(agreement)) = negotiation.outcome() else { return };
    let limits = Limits {
        size: agreement.info.size,
        read_only: agreement.export,
        mode: agreement.mode,
        block_status: !agreement.contexts.is_empty(),
        max_payload: MAX_PAYLOAD,
    };
    let mut stream = &rest[taken..];
    while let Ok(Some(request)) = Request::parse(stream, limits.mode) {
        stream = &stream[limits.mode.request_size()..];
        let Ok(command) = request.check(&limits) else { continue };
        match command {
            Command::Read { offset, len, .. } | Command::Write { offset, len, .. } => {
                assert!(len <= MAX_PAYLOAD && offset.checked_add(len).is_some_and(|end| end <= SIZE), "{command:?}");
                assert!(!(limits.read_only && matches!(command, Command::Write { .. })), "write on read-only");
            }
            Command::Trim { offset, len, .. }
            | Command::WriteZeroes { offset, len, .. }
            | Command::BlockStatus { offset, len, .. } => {
                assert!(offset.checked_add(len).is_some_and(|end| end <= SIZE), "{command:?}");
                if !matches!(command, Command::BlockStatus { .. }) {
                    assert!(!limits.read_only, "{command:?} on read-only");
                }
            }
            Command::Flush | Command::Cache | Command::Disconnect => {}
        }
        // A write's payload follows its header.
        let payload = usize::try_from(request.payload_len(limits.mode)).unwrap_or(usize::MAX);
        stream = stream.get(payload..).unwrap_or(&[]);
    }
});
