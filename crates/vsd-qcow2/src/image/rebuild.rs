//! Rebuilding refcounts of an image left dirty (lazy refcounts and a
//! crash), as QEMU does on open: count every reference from the tables,
//! write a fresh refcount table and blocks past the end of the image, then
//! switch the header to them and clear the dirty bit in one write.

use crate::buf::AlignedBuf;
use crate::entry::{self, Layout};
use crate::header::{Header, field, incompatible};
use crate::refcount::Width;
use crate::{FormatError, SyncIo};

/// The new refcount table: its entries and offset.
pub(super) struct Rebuilt {
    pub(super) table: Vec<u64>,
    pub(super) table_offset: u64,
}

/// Counts references and writes new refcount structures. `structures`
/// are the byte ranges of the header, L1 tables, snapshot table and kept
/// bitmaps (directory, tables and data clusters); `l1s`
/// every L1 table (active and snapshots). `header_chunk` is updated to the
/// header as written.
pub(super) fn rebuild(
    io: &mut dyn SyncIo,
    header: &Header,
    layout: &Layout,
    structures: &[(u64, u64)],
    l1s: &[&[u64]],
    file_len: u64,
    header_chunk: &mut AlignedBuf,
) -> Result<Rebuilt, FormatError> {
    let cs = header.cluster_size();
    let width = Width::new(header.refcount_order);
    let mut counts = vec![0u64; file_len.div_ceil(cs) as usize];
    let mut bump = |cluster: u64| -> Result<(), FormatError> {
        let i = cluster as usize;
        if i >= counts.len() {
            return Err(corrupt(format!("a table references cluster {cluster}, past the end of the file")));
        }
        counts[i] += 1;
        if counts[i] > width.max() {
            return Err(FormatError::Corrupt(format!("refcount of cluster {cluster} overflows")));
        }
        Ok(())
    };
    for &(offset, len) in structures {
        for cluster in offset / cs..(offset + len).div_ceil(cs) {
            bump(cluster)?;
        }
    }
    let mut l2 = AlignedBuf::zeroed(cs as usize);
    let stride = header.l2_entry_size() as usize;
    for l1 in l1s {
        for (i, &e) in l1.iter().enumerate() {
            let Some((l2_offset, _)) = entry::l1(e, cs).map_err(|e| corrupt(format!("L1 entry {i}: {e}")))? else {
                continue;
            };
            bump(l2_offset / cs)?;
            io.read_at(&mut l2, l2_offset)?;
            for raw in l2.chunks_exact(stride) {
                let word = |at: usize| u64::from_be_bytes(raw[at..at + 8].try_into().unwrap());
                let bitmap = if layout.extended { word(8) } else { 0 };
                let e = layout.decode(word(0), bitmap).map_err(|e| corrupt(format!("L2 table {l2_offset:#x}: {e}")))?;
                if let Some((host, len)) = e.compressed {
                    for cluster in host / cs..=(host + len - 1) / cs {
                        bump(cluster)?;
                    }
                } else if let Some(host) = e.host.filter(|_| !layout.data_file) {
                    bump(host / cs)?;
                }
            }
        }
    }

    // New blocks and table after everything counted, covering themselves.
    let per_block = width.entries(cs);
    let area = counts.len() as u64;
    let mut entries = area.div_ceil(per_block).max(1);
    let (blocks, table_clusters) = loop {
        let table_clusters = (entries * 8).div_ceil(cs);
        let needed = (area + entries + table_clusters).div_ceil(per_block);
        if needed <= entries {
            break (entries, table_clusters);
        }
        entries = needed;
    };
    counts.resize((area + blocks + table_clusters) as usize, 1);

    let mut table = Vec::with_capacity(blocks as usize);
    let mut block = AlignedBuf::zeroed(cs as usize);
    for index in 0..blocks {
        block.fill(0);
        let first = index * per_block;
        for (slot, &count) in counts.iter().skip(first as usize).take(per_block as usize).enumerate() {
            width.set(&mut block, slot as u64, count);
        }
        let offset = (area + index) * cs;
        io.write_at(&block, offset)?;
        table.push(offset);
    }
    let table_offset = (area + blocks) * cs;
    let mut raw = AlignedBuf::zeroed((table_clusters * cs) as usize);
    for (out, entry) in raw.chunks_exact_mut(8).zip(&table) {
        out.copy_from_slice(&entry.to_be_bytes());
    }
    io.write_at(&raw, table_offset)?;
    io.flush()?;

    let at = field::REFCOUNT_TABLE as usize;
    header_chunk[at..at + 8].copy_from_slice(&table_offset.to_be_bytes());
    header_chunk[at + 8..at + 12].copy_from_slice(&(table_clusters as u32).to_be_bytes());
    let at = field::INCOMPATIBLE as usize;
    header_chunk[at..at + 8].copy_from_slice(&(header.incompatible & !incompatible::DIRTY).to_be_bytes());
    io.write_at(header_chunk, 0)?;
    io.flush()?;
    log::info!("qcow2: rebuilt refcounts of a dirty image ({blocks} blocks)");
    Ok(Rebuilt { table, table_offset })
}

fn corrupt(what: String) -> FormatError {
    FormatError::Corrupt(format!("cannot rebuild refcounts: {what}"))
}
