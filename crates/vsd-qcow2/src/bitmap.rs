//! Persistent dirty bitmaps as qcow2 stores them (qcow2 spec, "Bitmaps"):
//! the bitmap directory, bitmap tables, and the data clusters' bit order.
//! Everything read is checked against QEMU's limits before it is trusted
//! or sizes an allocation.

use crate::FormatError;
use crate::header::bitmap_limits::{MAX_BITMAPS, MAX_DIRECTORY};

/// A persistent dirty bitmap as a qcow2 image stores it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBitmap {
    /// Its name, unique in the image: 1 to 1023 bytes.
    pub name: String,
    /// Bytes of guest data one bit covers: a power of two, 512 bytes to
    /// 2 GiB (QEMU's limits).
    pub granularity: u64,
    /// The image says the bitmap was in use (open writable) and not stored
    /// back: after a crash, it is inconsistent. Its data is then neither
    /// read nor written (`words` is empty when loaded, ignored when stored).
    pub in_use: bool,
    /// The "auto" flag: the bitmap records writes (enabled); QEMU's
    /// `recording`.
    pub enabled: bool,
    /// Bit i covers guest bytes `[i * granularity, (i + 1) * granularity)`;
    /// bit i is bit `i % 64` of `words[i / 64]`, and there are exactly
    /// [`StoredBitmap::words_for`] words (bits past the disk's end are 0).
    pub words: Vec<u64>,
}

impl StoredBitmap {
    /// Words a bitmap of `granularity` needs for a disk of `disk_size` bytes.
    pub fn words_for(disk_size: u64, granularity: u64) -> usize {
        bits_for(disk_size, granularity).div_ceil(64) as usize
    }

    /// Whether bit `i` is set.
    pub fn get(&self, i: u64) -> bool {
        self.words.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

/// Flags of a directory entry.
const IN_USE: u32 = 1 << 0;
const AUTO: u32 = 1 << 1;
/// The only bitmap type: dirty tracking.
const DIRTY_TRACKING: u8 = 1;
/// QEMU's limits on one bitmap: granularity 512 bytes to 2 GiB, a name of
/// at most 1023 bytes, 2^27 table entries and 512 MiB of data.
const GRANULARITY_BITS: std::ops::RangeInclusive<u32> = 9..=31;
const MAX_NAME: usize = 1023;
const MAX_TABLE_ENTRIES: u64 = 0x800_0000;
const MAX_DATA_BYTES: u64 = 512 << 20;
/// The fixed part of a directory entry.
const ENTRY_HEAD: usize = 24;
/// Bitmap table entry fields.
const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;
const ENTRY_RESERVED: u64 = 0xff00_0000_0000_01fe;
const ENTRY_ALL_ONES: u64 = 1;

/// One bitmap directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DirEntry {
    pub(crate) table_offset: u64,
    /// Entries in the bitmap table.
    pub(crate) table_size: u32,
    pub(crate) in_use: bool,
    pub(crate) enabled: bool,
    pub(crate) granularity_bits: u32,
    pub(crate) name: String,
}

/// What a bitmap table entry says about its cluster of bitmap data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TableEntry {
    Zeroes,
    Ones,
    Data(u64),
}

fn corrupt(what: String) -> FormatError {
    FormatError::Corrupt(format!("bitmap directory: {what}"))
}

fn bits_for(disk_size: u64, granularity: u64) -> u64 {
    disk_size.div_ceil(granularity)
}

/// Entries the bitmap table of a bitmap of `granularity_bits` needs for a
/// disk of `disk_size` bytes: one per cluster of bitmap data.
pub(crate) fn table_size_for(disk_size: u64, granularity_bits: u32, cluster_size: u64) -> u64 {
    bits_for(disk_size, 1 << granularity_bits).div_ceil(8).div_ceil(cluster_size)
}

/// The granularity's log2, if QEMU accepts it.
pub(crate) fn granularity_bits(granularity: u64) -> Option<u32> {
    let bits = granularity.trailing_zeros();
    (granularity.is_power_of_two() && GRANULARITY_BITS.contains(&bits)).then_some(bits)
}

impl DirEntry {
    /// Bytes of the entry in the directory.
    fn len(&self) -> usize {
        (ENTRY_HEAD + self.name.len()).next_multiple_of(8)
    }

    /// Checks the entry's table against QEMU's limits.
    fn check_table(&self, cluster_size: u64) -> Result<(), String> {
        let size = u64::from(self.table_size);
        if self.table_offset == 0 || !self.table_offset.is_multiple_of(cluster_size) {
            return Err(format!("table offset {:#x} is zero or unaligned", self.table_offset));
        }
        if size == 0 || size > MAX_TABLE_ENTRIES || size * cluster_size > MAX_DATA_BYTES {
            return Err(format!("a table of {size} entries"));
        }
        Ok(())
    }

    /// A bitmap's data is readable if its table is exactly what a disk of
    /// `disk_size` bytes needs. Checked only when the data is read: one in
    /// use may be left from before a resize, and a stale one is freed
    /// whatever its size.
    pub(crate) fn check_size(&self, cluster_size: u64, disk_size: u64) -> Result<(), FormatError> {
        let needed = table_size_for(disk_size, self.granularity_bits, cluster_size);
        if u64::from(self.table_size) != needed {
            return Err(corrupt(format!(
                "bitmap '{}': a table of {} entries where a disk of {disk_size} bytes needs {needed}",
                self.name, self.table_size
            )));
        }
        Ok(())
    }
}

/// Parses and checks a bitmap directory of `count` entries.
pub(crate) fn parse_directory(raw: &[u8], count: u32, cluster_size: u64) -> Result<Vec<DirEntry>, FormatError> {
    let mut entries: Vec<DirEntry> = Vec::new();
    let mut at = 0;
    while at < raw.len() {
        if entries.len() == count as usize {
            return Err(corrupt(format!("more than the {count} entries the header announces")));
        }
        let entry = parse_entry(&raw[at..]).map_err(|e| corrupt(format!("entry {}: {e}", entries.len())))?;
        entry.check_table(cluster_size).map_err(|e| corrupt(format!("bitmap '{}': {e}", entry.name)))?;
        if entries.iter().any(|e| e.name == entry.name) {
            return Err(corrupt(format!("two bitmaps named '{}'", entry.name)));
        }
        at += entry.len();
        entries.push(entry);
    }
    if entries.len() != count as usize {
        return Err(corrupt(format!("{} entries where the header announces {count}", entries.len())));
    }
    Ok(entries)
}

/// Parses the entry at the start of `raw`.
fn parse_entry(raw: &[u8]) -> Result<DirEntry, String> {
    let Some(head) = raw.get(..ENTRY_HEAD) else { return Err("truncated".into()) };
    let be32 = |at: usize| u32::from_be_bytes(head[at..at + 4].try_into().unwrap());
    let flags = be32(12);
    let (kind, granularity_bits) = (head[16], u32::from(head[17]));
    let name_len = usize::from(u16::from_be_bytes([head[18], head[19]]));
    let extra_len = be32(20);
    if extra_len != 0 {
        return Err(format!("{extra_len} bytes of extra data (unsupported, as in QEMU)"));
    }
    if kind != DIRTY_TRACKING {
        return Err(format!("bitmap type {kind} (only 1, dirty tracking, exists)"));
    }
    if flags & !(IN_USE | AUTO) != 0 {
        return Err(format!("unknown flags {flags:#x}"));
    }
    if !GRANULARITY_BITS.contains(&granularity_bits) {
        return Err(format!("granularity bits {granularity_bits} (QEMU allows 9 to 31)"));
    }
    if name_len == 0 || name_len > MAX_NAME {
        return Err(format!("a name of {name_len} bytes"));
    }
    let len = (ENTRY_HEAD + name_len).next_multiple_of(8);
    let Some(name) = raw.get(ENTRY_HEAD..ENTRY_HEAD + name_len).filter(|_| raw.len() >= len) else {
        return Err("runs past the end of the directory".into());
    };
    let name = String::from_utf8(name.to_vec()).map_err(|_| "the name is not UTF-8".to_string())?;
    Ok(DirEntry {
        table_offset: u64::from_be_bytes(head[0..8].try_into().unwrap()),
        table_size: be32(8),
        in_use: flags & IN_USE != 0,
        enabled: flags & AUTO != 0,
        granularity_bits,
        name,
    })
}

/// The directory's bytes, each entry padded to 8 bytes.
pub(crate) fn serialize_directory(entries: &[DirEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.iter().map(DirEntry::len).sum());
    for e in entries {
        let start = out.len();
        let flags = if e.in_use { IN_USE } else { 0 } | if e.enabled { AUTO } else { 0 };
        out.extend_from_slice(&e.table_offset.to_be_bytes());
        out.extend_from_slice(&e.table_size.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&[DIRTY_TRACKING, e.granularity_bits as u8]);
        out.extend_from_slice(&(e.name.len() as u16).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(e.name.as_bytes());
        out.resize(start + e.len(), 0);
    }
    out
}

/// Checks bitmaps to be stored against QEMU's limits for a disk of
/// `disk_size` bytes.
pub(crate) fn check_for_store(bitmaps: &[StoredBitmap], disk_size: u64, cluster_size: u64) -> Result<(), FormatError> {
    let bad = |what: String| Err(FormatError::Unsupported(format!("cannot store bitmaps: {what}")));
    if bitmaps.len() > MAX_BITMAPS as usize {
        return bad(format!("{} bitmaps (QEMU allows {MAX_BITMAPS})", bitmaps.len()));
    }
    let mut directory = 0;
    for (i, b) in bitmaps.iter().enumerate() {
        let Some(bits) = granularity_bits(b.granularity) else {
            return bad(format!(
                "bitmap '{}': granularity {} is not a power of two in 512..=2G",
                b.name, b.granularity
            ));
        };
        if b.name.is_empty() || b.name.len() > MAX_NAME {
            return bad(format!("a name of {} bytes (1 to {MAX_NAME} allowed)", b.name.len()));
        }
        if bitmaps[..i].iter().any(|o| o.name == b.name) {
            return bad(format!("two bitmaps named '{}'", b.name));
        }
        let table = table_size_for(disk_size, bits, cluster_size);
        if table == 0 {
            return bad("a disk of 0 bytes has no room for bitmaps (QEMU refuses empty tables)".into());
        }
        if table > MAX_TABLE_ENTRIES || table * cluster_size > MAX_DATA_BYTES {
            return bad(format!("bitmap '{}' is too large; use a larger granularity", b.name));
        }
        let words = StoredBitmap::words_for(disk_size, b.granularity);
        if !b.in_use && b.words.len() != words {
            return bad(format!("bitmap '{}' has {} words, the disk needs {words}", b.name, b.words.len()));
        }
        directory += (ENTRY_HEAD + b.name.len()).next_multiple_of(8) as u64;
    }
    if directory > MAX_DIRECTORY {
        return bad(format!("a directory of {directory} bytes (QEMU allows {MAX_DIRECTORY})"));
    }
    Ok(())
}

/// Decodes a bitmap table entry.
pub(crate) fn table_entry(raw: u64, cluster_size: u64) -> Result<TableEntry, String> {
    let offset = raw & ENTRY_OFFSET;
    if raw & ENTRY_RESERVED != 0 || (offset != 0 && (raw & ENTRY_ALL_ONES != 0 || !offset.is_multiple_of(cluster_size)))
    {
        return Err(format!("invalid bitmap table entry {raw:#018x}"));
    }
    Ok(match (offset, raw & ENTRY_ALL_ONES != 0) {
        (0, false) => TableEntry::Zeroes,
        (0, true) => TableEntry::Ones,
        (offset, _) => TableEntry::Data(offset),
    })
}

/// The bitmap data's words one cluster holds: the data is the words in
/// order, each little-endian (bit i at byte i / 8, bit i % 8).
pub(crate) fn words_per_cluster(cluster_size: u64) -> usize {
    (cluster_size / 8) as usize
}

/// Fills `words` (one cluster's worth, or fewer at the end) from a data
/// cluster's bytes.
pub(crate) fn words_from_bytes(words: &mut [u64], bytes: &[u8]) {
    for (w, b) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        *w = u64::from_le_bytes(b.try_into().unwrap());
    }
}

/// Writes `words` into the start of a data cluster's bytes.
pub(crate) fn words_to_bytes(words: &[u64], bytes: &mut [u8]) {
    for (w, b) in words.iter().zip(bytes.chunks_exact_mut(8)) {
        b.copy_from_slice(&w.to_le_bytes());
    }
}

/// Clears the bits past the last one a disk of `disk_size` bytes needs,
/// which the spec requires to be zero but an image may still set.
pub(crate) fn clear_tail(words: &mut [u64], disk_size: u64, granularity: u64) {
    let bits = bits_for(disk_size, granularity);
    if let Some(last) = words.last_mut()
        && !bits.is_multiple_of(64)
    {
        *last &= (1 << (bits % 64)) - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, table_size: u32) -> DirEntry {
        DirEntry {
            table_offset: 0x30000,
            table_size,
            in_use: false,
            enabled: true,
            granularity_bits: 16,
            name: name.into(),
        }
    }

    const CS: u64 = 65536;
    const DISK: u64 = 1 << 30;

    #[test]
    fn a_directory_round_trips_with_padding() {
        let entries = vec![entry("a", 1), DirEntry { in_use: true, enabled: false, ..entry("bitmap-two", 7) }];
        let raw = serialize_directory(&entries);
        assert_eq!(raw.len(), 32 + 40);
        assert_eq!(&raw[12..18], &[0, 0, 0, 2, 1, 16], "flags auto, type 1, granularity 2^16");
        assert_eq!(parse_directory(&raw, 2, CS).unwrap(), entries);
    }

    #[test]
    fn table_sizes_follow_the_disk() {
        // 1 GiB at 64 KiB granularity: 16384 bits, 2 KiB, one cluster.
        assert_eq!(table_size_for(DISK, 16, CS), 1);
        // 2 TiB at 512 bytes: 2^32 bits, 512 MiB, 8192 clusters.
        assert_eq!(table_size_for(2 << 40, 9, CS), 8192);
        assert_eq!(table_size_for(0, 9, CS), 0);
        assert_eq!(StoredBitmap::words_for(DISK + 1, 65536), 257);
    }

    #[test]
    fn bad_entries_are_refused_by_what_is_wrong() {
        type Damage = fn(&mut Vec<u8>);
        let cases: [(Damage, &str); 13] = [
            (|r| r[16] = 2, "bitmap type 2"),
            (|r| r[15] = 4, "unknown flags"),
            (|r| r[17] = 8, "granularity bits 8"),
            (|r| r[17] = 32, "granularity bits 32"),
            (|r| r[18..20].copy_from_slice(&0u16.to_be_bytes()), "a name of 0 bytes"),
            (|r| r[18..20].copy_from_slice(&1024u16.to_be_bytes()), "a name of 1024 bytes"),
            (|r| r[18..20].copy_from_slice(&9u16.to_be_bytes()), "runs past the end"),
            (|r| r[23] = 8, "extra data"),
            (|r| r[7] = 1, "unaligned"),
            (|r| r[0..8].fill(0), "zero or unaligned"),
            (|r| r[8..12].copy_from_slice(&u32::MAX.to_be_bytes()), "a table of 4294967295"),
            (|r| r[24] = 0xff, "not UTF-8"),
            (|r| r.truncate(20), "truncated"),
        ];
        for (damage, want) in cases {
            let mut raw = serialize_directory(&[entry("a", 1)]);
            damage(&mut raw);
            let err = parse_directory(&raw, 1, CS).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn counts_and_names_must_agree_with_the_header() {
        let raw = serialize_directory(&[entry("a", 1), entry("a", 1)]);
        assert!(parse_directory(&raw, 2, CS).unwrap_err().to_string().contains("two bitmaps named 'a'"));
        assert!(parse_directory(&raw, 1, CS).unwrap_err().to_string().contains("more than the 1"));
        let raw = serialize_directory(&[entry("a", 1), entry("b", 1)]);
        assert!(parse_directory(&raw, 3, CS).unwrap_err().to_string().contains("2 entries where"));
    }

    #[test]
    fn a_table_must_match_the_disk_only_to_be_read() {
        let raw = serialize_directory(&[entry("a", 2)]);
        let parsed = parse_directory(&raw, 1, CS).unwrap();
        assert!(parsed[0].check_size(CS, DISK).unwrap_err().to_string().contains("needs 1"));
        assert!(parsed[0].check_size(CS, 33 * DISK).is_ok(), "32 GiB per cluster of bitmap");
    }

    #[test]
    fn table_entries_zeroes_ones_and_data() {
        assert_eq!(table_entry(0, CS), Ok(TableEntry::Zeroes));
        assert_eq!(table_entry(1, CS), Ok(TableEntry::Ones));
        assert_eq!(table_entry(0x50000, CS), Ok(TableEntry::Data(0x50000)));
        for bad in [0x50001, 0x50200, 1 << 56, 2] {
            assert!(table_entry(bad, CS).is_err(), "{bad:#x}");
        }
    }

    #[test]
    fn words_are_little_endian_bit_i_in_byte_i_over_8() {
        let mut bytes = [0u8; 16];
        words_to_bytes(&[1 << 9, 1 << 63], &mut bytes);
        assert_eq!(bytes[1], 0b10, "bit 9 is bit 1 of byte 1");
        assert_eq!(bytes[15], 0x80);
        let mut words = [0u64; 2];
        words_from_bytes(&mut words, &bytes);
        assert_eq!(words, [1 << 9, 1 << 63]);
        let mut tail = [u64::MAX; 2];
        clear_tail(&mut tail, 70 * 512, 512);
        assert_eq!(tail, [u64::MAX, 0b11_1111]);
    }

    #[test]
    fn stores_are_checked_before_anything_is_written() {
        let ok = StoredBitmap {
            name: "b".into(),
            granularity: 65536,
            in_use: false,
            enabled: true,
            words: vec![0; StoredBitmap::words_for(DISK, 65536)],
        };
        assert!(check_for_store(std::slice::from_ref(&ok), DISK, CS).is_ok());
        let cases = [
            (StoredBitmap { granularity: 3 << 16, ..ok.clone() }, "granularity"),
            (StoredBitmap { granularity: 256, ..ok.clone() }, "granularity"),
            (StoredBitmap { granularity: 1 << 32, ..ok.clone() }, "granularity"),
            (StoredBitmap { name: String::new(), ..ok.clone() }, "a name of 0 bytes"),
            (StoredBitmap { name: "n".repeat(1024), ..ok.clone() }, "a name of 1024 bytes"),
            (StoredBitmap { words: vec![0; 3], ..ok.clone() }, "has 3 words"),
        ];
        for (b, want) in cases {
            let err = check_for_store(&[b], DISK, CS).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        let err = check_for_store(&[ok.clone(), ok.clone()], DISK, CS).unwrap_err().to_string();
        assert!(err.contains("two bitmaps"), "{err}");
        let huge = StoredBitmap { granularity: 512, words: Vec::new(), in_use: true, ..ok };
        assert!(
            check_for_store(std::slice::from_ref(&huge), 1 << 50, CS).unwrap_err().to_string().contains("too large")
        );
        assert!(check_for_store(&[huge], 0, CS).unwrap_err().to_string().contains("0 bytes"));
    }
}
