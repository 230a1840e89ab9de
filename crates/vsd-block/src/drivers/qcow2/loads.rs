//! A queue's reads of L2 table slices (and refcount blocks) the cache
//! lacks, and the guest requests waiting for them: a request waits for its
//! slice while the queue serves the others, requests needing the same
//! slice share one read, and a few reads are in flight at once.

use std::collections::VecDeque;

use vsd_engine::{IoOp, IoVecs};
use vsd_qcow2::{Image, MissingTable, TableLoad};

/// How many slices one queue reads at once; requests needing another wait
/// for one of these to finish (each holds a slice's buffer).
pub(crate) const LOADS: u16 = 8;

/// How many times a request waits for slices before it loads the next one
/// it lacks under the metadata mutex: slices other queues evict as fast as
/// this one loads them cannot keep it from progressing.
const PATIENCE: u8 = 4;

/// A guest request routed as far as `from` (bytes of it sent on), waiting
/// for an L2 table slice.
pub(super) struct Waiting {
    pub(super) tag: u32,
    pub(super) op: IoOp,
    pub(super) from: u64,
    /// Slices it waited for without progress.
    pub(super) waits: u8,
}

/// Whether a request that waited `waits` times may wait for a slice again
/// rather than load it under the metadata mutex.
pub(super) fn patient(waits: u8) -> bool {
    waits < PATIENCE
}

/// One slice read in flight, and the requests waiting for it.
struct Load {
    table: Option<TableLoad>,
    /// The buffer the child request reads into.
    iov: libc::iovec,
    waiting: Vec<Waiting>,
}

pub(super) struct Loads {
    /// By load number (the child tag minus the queue's other tags).
    loads: Vec<Load>,
    free: Vec<u32>,
    /// Requests waiting for a load number.
    want_number: VecDeque<Waiting>,
    /// Requests whose slice came in, or that may take a freed load number:
    /// the queue routes them again.
    pub(super) resumable: Vec<Waiting>,
}

impl Loads {
    pub(super) fn new() -> Self {
        let unset = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        Self {
            loads: (0..LOADS).map(|_| Load { table: None, iov: unset, waiting: Vec::new() }).collect(),
            free: (0..u32::from(LOADS)).rev().collect(),
            want_number: VecDeque::new(),
            resumable: Vec::new(),
        }
    }

    /// Whether no read is in flight.
    pub(super) fn idle(&self) -> bool {
        self.free.len() == self.loads.len()
    }

    /// Holds `w` back until the slice `missing` is in: joins the read of it
    /// in flight, or starts one (returned: its load number and the read to
    /// send to the image file), or waits for a load number.
    pub(super) fn wait(&mut self, image: &Image, missing: MissingTable, mut w: Waiting) -> Option<(u32, IoOp)> {
        let reading = |l: &&mut Load| !l.waiting.is_empty() && l.table.as_ref().is_some_and(|t| t.loads(missing));
        if let Some(load) = self.loads.iter_mut().find(reading) {
            w.waits += 1;
            load.waiting.push(w);
            return None;
        }
        let Some(number) = self.free.pop() else {
            self.want_number.push_back(w);
            return None;
        };
        w.waits += 1;
        let load = &mut self.loads[number as usize];
        let table = load.table.get_or_insert_with(|| TableLoad::new(image));
        image.start_load(table, missing);
        let (buf, len) = table.buffer();
        load.iov = libc::iovec { iov_base: buf.cast(), iov_len: len };
        load.waiting.push(w);
        // SAFETY: `load.iov` and the buffer it names live in `self.loads`,
        // which never grows, and are not touched until the read completes.
        let iov = unsafe { IoVecs::new(&load.iov, 1) };
        Some((number, IoOp::Read { offset: table.at(), len: len as u64, iov }))
    }

    /// Read `number` done with `errno`: its requests become resumable, or,
    /// if it failed, are returned to fail with its error.
    pub(super) fn finish(&mut self, image: &Image, number: u32, errno: i32) -> Vec<Waiting> {
        let load = &mut self.loads[number as usize];
        let table = load.table.as_mut().expect("a load in flight has its table");
        let failed = if errno == 0 {
            // SAFETY: the read into its buffer succeeded, which fills it
            // whole (IoQueue's contract: zeroes past the end of the file).
            unsafe { image.finish_load(table) };
            self.resumable.append(&mut load.waiting);
            Vec::new()
        } else {
            log::error!("qcow2: reading the metadata table at {:#x} failed: errno {errno}", table.at());
            std::mem::take(&mut load.waiting)
        };
        self.free.push(number);
        // A load number is free: the first to wait for one tries again.
        self.resumable.extend(self.want_number.pop_front());
        failed
    }
}
