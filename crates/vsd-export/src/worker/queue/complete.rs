//! The completing half of a queue's round: what the engine finished is
//! given its status, returned to the guest in the used ring (and marked in
//! the dirty log while migrating), and the guest is notified.

use std::io;
use std::os::fd::AsFd;

use vsd_block::Completion;
use vsd_trace::OpKind;
use vsd_virtio::dirty_log::{GuestWrites, Unlogged};
use vsd_virtio::ram::GuestRam;
use vsd_virtio::request::status;

use super::QueueWorker;
use crate::worker::front_end_io;

impl QueueWorker {
    pub(super) fn complete_requests(&mut self) {
        self.io.reap(&mut self.completions);
        if self.completions.is_empty() {
            return;
        }
        self.dirty.completed(&self.completions);
        // The used ring is written through the current memory map.
        self.current_ram();
        let completed_at = self.trace.now();
        let mut completions = std::mem::take(&mut self.completions);
        // Chosen once per batch: without a log, nothing per request.
        match self.run.log.clone() {
            Some(log) => {
                self.finish_completed(&completions, &*log);
                self.signal_log_call();
            }
            None => self.finish_completed(&completions, &Unlogged),
        }
        self.trace.published(&self.stats, completed_at, completions.len());
        completions.clear();
        self.completions = completions;
    }

    /// Writes the status of each completed request and returns it to the
    /// guest, recording in `writes` the guest memory it wrote.
    fn finish_completed<W: GuestWrites>(&mut self, completions: &[Completion], writes: &W) {
        for done in completions {
            let tag = done.tag as u16;
            self.account(tag, done.errno);
            let slot = self.slots.slot_mut(tag);
            // Keeps the buffers and the status byte mapped until they are
            // written and marked.
            let held = slot.ram.take();
            let (head, status) = (slot.head, slot.status);
            let (code, used_len) = if done.errno == 0 { (status::OK, slot.used_len) } else { (status::IOERR, 1) };
            if done.errno != 0 {
                log::debug!(
                    "queue {}: request {head} failed: {}",
                    self.run.index,
                    io::Error::from_raw_os_error(done.errno)
                );
            }
            self.finish(head, status, code, used_len);
            if let (true, Some(ram)) = (W::RECORDS, &held) {
                self.record_writes(writes, ram, tag);
            }
            self.slots.release(tag);
        }
    }

    /// Records what the request in slot `tag` wrote to guest memory: a
    /// read's buffers (even a failed read may have written part of them)
    /// and the status byte.
    fn record_writes(&self, writes: &impl GuestWrites, ram: &GuestRam, tag: u16) {
        let slot = self.slots.slot(tag);
        if slot.kind == OpKind::Read {
            // A read's used length is its data and the status byte.
            let mut left = u64::from(slot.used_len.saturating_sub(1));
            for v in self.slots.iovecs(tag) {
                if left == 0 {
                    break;
                }
                let n = left.min(v.iov_len as u64);
                writes.wrote(ram, v.iov_base.cast(), n as usize);
                left -= n;
            }
        }
        writes.wrote(ram, slot.status, 1);
    }

    /// Tells the front-end that the dirty log was written, if it asked to be.
    fn signal_log_call(&self) {
        if let Some(call) = &self.run.log_call
            && let Err(e) = front_end_io(&self.front_end_io, || vsd_sys::signal_counter(call.as_fd()))
        {
            log::warn!("queue {}: cannot signal the dirty log's eventfd: {e}", self.run.index);
        }
    }

    /// Counts a completed request and keeps its stamps for its stages.
    // Always: per request, and a call costs as much as its body.
    #[inline(always)]
    fn account(&mut self, tag: u16, errno: i32) {
        let slot = self.slots.slot(tag);
        let op = self.stats.op(slot.kind);
        op.ops.add(1);
        if errno == 0 {
            op.bytes.add(slot.bytes);
        } else {
            op.failed.add(1);
        }
        self.trace.completed(slot.stamps, slot.kind);
    }

    /// Writes the status byte and returns the chain to the guest.
    #[inline]
    pub(super) fn finish(&mut self, head: u16, status: *mut u8, code: u8, used_len: u32) {
        // SAFETY: `status` was found inside guest memory when the request
        // was parsed, and the caller holds that memory map.
        unsafe { status.write_volatile(code) };
        self.publish(head, used_len);
    }

    #[inline]
    pub(super) fn publish(&mut self, head: u16, used_len: u32) {
        if let Some(inflight) = &self.run.inflight {
            inflight.publishing(head);
        }
        match self.run.queue.push_used(&self.ram, head, used_len) {
            Ok(()) => {
                if let Some(inflight) = &self.run.inflight {
                    inflight.published(head, self.run.queue.next_used());
                }
                self.calls.published(self.trace.clock());
            }
            Err(e) => {
                self.mark_broken(e);
            }
        }
    }

    pub(super) fn signal_guest(&mut self) {
        self.calls.signalled();
        self.run.queue.mark_published();
        let wanted = self.run.queue.needs_notification(&self.ram).unwrap_or(true);
        if let (true, Some(call)) = (wanted, &self.run.call) {
            match front_end_io(&self.front_end_io, || vsd_sys::signal_counter(call.as_fd())) {
                Ok(()) => self.stats.calls.add(1),
                Err(e) => log::warn!("queue {}: cannot signal the guest: {e}", self.run.index),
            }
        }
        self.trace.called(&self.stats);
    }
}
