//! The image header and its extensions (qcow2 spec, "Header" and "Header
//! extensions"): parsed once at open, validated before anything else is
//! trusted, and changed afterwards only field by field in place.

use crate::FormatError;

const MAGIC: u32 = 0x5146_49fb; // "QFI\xfb"
const V2_HEADER_LEN: u32 = 72;
const V3_MIN_HEADER_LEN: u32 = 104;

/// Byte offsets of the fields vsd rewrites in place.
pub mod field {
    /// `refcount_table_offset` (u64) followed by `refcount_table_clusters`
    /// (u32): one 12-byte write moves the refcount table atomically.
    pub const REFCOUNT_TABLE: u64 = 48;
    /// `size` (u64): the virtual disk size.
    pub const SIZE: u64 = 24;
    /// `l1_size` (u32): entries in the active L1 table.
    pub const L1_SIZE: u64 = 36;
    /// `l1_table_offset` (u64): where the active L1 table is.
    pub const L1_TABLE_OFFSET: u64 = 40;
    /// `incompatible_features` (u64).
    pub const INCOMPATIBLE: u64 = 72;
    /// `autoclear_features` (u64).
    pub const AUTOCLEAR: u64 = 88;
}

/// `incompatible_features` bits.
pub mod incompatible {
    /// Refcounts may be stale (lazy refcounts after a crash).
    pub const DIRTY: u64 = 1 << 0;
    /// QEMU found the metadata corrupt and stopped writing.
    pub const CORRUPT: u64 = 1 << 1;
    /// Guest data lives in an external data file.
    pub const DATA_FILE: u64 = 1 << 2;
    /// The compression type field is meaningful.
    pub const COMPRESSION_TYPE: u64 = 1 << 3;
    /// L2 entries carry subcluster bitmaps.
    pub const EXTENDED_L2: u64 = 1 << 4;
    /// Every bit vsd understands.
    pub const KNOWN: u64 = DIRTY | CORRUPT | DATA_FILE | COMPRESSION_TYPE | EXTENDED_L2;
}

/// `compatible_features` bits.
pub mod compatible {
    /// Refcount updates may be delayed; the dirty bit covers them.
    pub const LAZY_REFCOUNTS: u64 = 1 << 0;
}

/// `autoclear_features` bits.
pub mod autoclear {
    /// The bitmaps extension is consistent.
    pub const BITMAPS: u64 = 1 << 0;
    /// The external data file is a valid raw image on its own.
    pub const DATA_FILE_RAW: u64 = 1 << 1;
    /// Every bit vsd keeps consistent when it writes.
    pub const KEPT: u64 = DATA_FILE_RAW;
}

mod extension {
    pub const END: u32 = 0;
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    pub const FEATURE_TABLE: u32 = 0x6803_f857;
    pub const BITMAPS: u32 = 0x2385_2875;
    pub const ENCRYPTION: u32 = 0x0537_be77;
    pub const DATA_FILE: u32 = 0x4441_5441;
}

/// How compressed clusters are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (no zlib header), window of 4 KiB.
    Zlib,
    /// A zstd frame.
    Zstd,
}

/// The parts of the header vsd needs, checked for sanity.
#[derive(Clone, Debug)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size, 9 to 21.
    pub cluster_bits: u32,
    /// The virtual disk size in bytes.
    pub size: u64,
    /// Entries in the active L1 table.
    pub l1_size: u32,
    /// Where the active L1 table is.
    pub l1_offset: u64,
    /// Where the refcount table is.
    pub refcount_table_offset: u64,
    /// Its length in clusters.
    pub refcount_table_clusters: u32,
    /// log2 of the refcount width in bits, 0 to 6.
    pub refcount_order: u32,
    /// Internal snapshots.
    pub nb_snapshots: u32,
    /// Where the snapshot table is.
    pub snapshots_offset: u64,
    /// `incompatible_features`.
    pub incompatible: u64,
    /// `compatible_features`.
    pub compatible: u64,
    /// `autoclear_features`.
    pub autoclear: u64,
    /// How compressed clusters are encoded.
    pub compression: Compression,
    /// The backing file named in the header, if any.
    pub backing_file: Option<String>,
    /// Its format, from the backing format extension.
    pub backing_format: Option<String>,
    /// The external data file's name, if the image has one.
    pub data_file: Option<String>,
    /// The bitmaps extension is present, consistent or not.
    pub has_bitmaps: bool,
    /// The bitmaps extension, if present and consistent (autoclear bit 0
    /// set): without the bit another program changed the image since, and
    /// the bitmaps are stale.
    pub bitmaps: Option<BitmapsExtension>,
}

/// Where the bitmap directory is (qcow2 spec, "Bitmaps extension").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitmapsExtension {
    /// Bitmaps in the directory, 1 to 65535.
    pub count: u32,
    /// The directory's length in bytes.
    pub directory_size: u64,
    /// Its offset, cluster aligned.
    pub directory_offset: u64,
}

/// QEMU's limits on bitmaps, which vsd shares so that either reads what
/// the other writes.
pub mod bitmap_limits {
    /// Bitmaps in one image.
    pub const MAX_BITMAPS: u32 = 65535;
    /// Bytes of bitmap directory.
    pub const MAX_DIRECTORY: u64 = 64 << 20;
}

/// Bytes of the bitmaps extension's data.
const BITMAPS_EXTENSION_LEN: usize = 24;

impl Header {
    /// Parses and validates the header in `buf`: the image's first cluster,
    /// or at least its first 4 KiB when the cluster size is not known yet.
    /// `file_len` is the length of the image file, to catch tables that
    /// point past its end.
    pub fn parse(buf: &[u8], file_len: u64) -> Result<Self, FormatError> {
        let bad = |what: String| Err(FormatError::Header(what));
        if buf.len() < V2_HEADER_LEN as usize || be32(buf, 0) != MAGIC {
            return bad("not a qcow2 image (no QFI\\xfb magic)".into());
        }
        let version = be32(buf, 4);
        if version != 2 && version != 3 {
            return bad(format!("qcow2 version {version} is not supported (only 2 and 3)"));
        }
        let cluster_bits = be32(buf, 20);
        if !(9..=21).contains(&cluster_bits) {
            return bad(format!("cluster_bits {cluster_bits} is outside 9..=21"));
        }
        let cluster_size = 1u64 << cluster_bits;
        if (buf.len() as u64) < cluster_size.min(4096) {
            return bad("header buffer shorter than the first cluster".into());
        }
        let crypt_method = be32(buf, 32);
        if crypt_method != 0 {
            return Err(FormatError::Unsupported(format!("encrypted image (crypt_method {crypt_method})")));
        }

        let (incompatible, compatible, autoclear, refcount_order, header_len, compression_byte) = if version == 3 {
            let header_len = be32(buf, 100);
            if header_len < V3_MIN_HEADER_LEN || !header_len.is_multiple_of(8) || u64::from(header_len) > cluster_size {
                return bad(format!("header_length {header_len} is invalid"));
            }
            let compression = if header_len > V3_MIN_HEADER_LEN { buf[104] } else { 0 };
            (be64(buf, 72), be64(buf, 80), be64(buf, 88), be32(buf, 96), header_len, compression)
        } else {
            (0, 0, 0, 4, V2_HEADER_LEN, 0)
        };
        if refcount_order > 6 {
            return bad(format!("refcount_order {refcount_order} is outside 0..=6"));
        }

        let mut header = Header {
            version,
            cluster_bits,
            size: be64(buf, 24),
            l1_size: be32(buf, 36),
            l1_offset: be64(buf, 40),
            refcount_table_offset: be64(buf, 48),
            refcount_table_clusters: be32(buf, 56),
            refcount_order,
            nb_snapshots: be32(buf, 60),
            snapshots_offset: be64(buf, 64),
            incompatible,
            compatible,
            autoclear,
            compression: Compression::Zlib,
            backing_file: None,
            backing_format: None,
            data_file: None,
            has_bitmaps: false,
            bitmaps: None,
        };
        let feature_names = header.read_extensions(buf, header_len as usize)?;

        let unknown = incompatible & !incompatible::KNOWN;
        if unknown != 0 {
            let names: Vec<String> = (0..64)
                .filter(|bit| unknown & (1 << bit) != 0)
                .map(|bit| match feature_names.iter().find(|(b, _)| *b == bit) {
                    Some((_, name)) => format!("bit {bit} ({name})"),
                    None => format!("bit {bit}"),
                })
                .collect();
            return Err(FormatError::Unsupported(format!("unknown incompatible features: {}", names.join(", "))));
        }
        if incompatible & incompatible::CORRUPT != 0 {
            return Err(FormatError::Corrupt(
                "the image is marked corrupt; repair it with 'qemu-img check -r all'".into(),
            ));
        }
        header.compression = match (incompatible & incompatible::COMPRESSION_TYPE != 0, compression_byte) {
            (_, 0) => Compression::Zlib,
            (true, 1) => Compression::Zstd,
            (false, 1) => return bad("compression type zstd without the compression type feature bit".into()),
            (_, other) => return Err(FormatError::Unsupported(format!("compression type {other}"))),
        };
        if header.extended_l2() && cluster_bits < 14 {
            return bad(format!("extended L2 entries need clusters of 16 KiB or more, not {cluster_size}"));
        }
        if header.data_file.is_some() && !header.has_data_file() {
            return bad("an external data file name without the external data file feature bit".into());
        }
        if autoclear & autoclear::DATA_FILE_RAW != 0 && !header.has_data_file() {
            return bad("data_file_raw without an external data file".into());
        }
        header.check_tables(file_len)?;
        Ok(header)
    }

    /// Reads the extensions after the fixed header; returns the feature
    /// name table (bit, name) of incompatible features, for error messages.
    fn read_extensions(&mut self, buf: &[u8], mut at: usize) -> Result<Vec<(u32, String)>, FormatError> {
        let end_of_header = buf.len().min(1 << self.cluster_bits);
        let mut names = Vec::new();
        loop {
            if at + 8 > end_of_header {
                return Err(FormatError::Header("header extensions run past the first cluster".into()));
            }
            let (kind, len) = (be32(buf, at), be32(buf, at + 4) as usize);
            let data_at = at + 8;
            let Some(data) = buf.get(data_at..data_at + len).filter(|_| data_at + len <= end_of_header) else {
                return Err(FormatError::Header(format!("header extension {kind:#x} runs past the first cluster")));
            };
            match kind {
                extension::END => break,
                extension::BACKING_FORMAT => self.backing_format = Some(text(data, "backing format")?),
                extension::DATA_FILE => self.data_file = Some(text(data, "external data file name")?),
                extension::BITMAPS => {
                    self.has_bitmaps = true;
                    if self.autoclear & autoclear::BITMAPS != 0 {
                        self.bitmaps = Some(bitmaps_extension(data)?);
                    }
                }
                extension::ENCRYPTION => {
                    return Err(FormatError::Unsupported("encrypted image (full disk encryption header)".into()));
                }
                extension::FEATURE_TABLE => {
                    for entry in data.chunks_exact(48) {
                        if entry[0] == 0 {
                            let name = String::from_utf8_lossy(&entry[2..]).trim_end_matches('\0').to_string();
                            names.push((u32::from(entry[1]), name));
                        }
                    }
                }
                _ => {} // unknown extensions are ignored, as the spec says
            }
            at = data_at + len.next_multiple_of(8);
        }

        let backing_offset = be64(buf, 8);
        let backing_len = be32(buf, 16) as usize;
        if backing_offset != 0 {
            let start = backing_offset as usize;
            if backing_len > 1023 || start.checked_add(backing_len).is_none_or(|e| e > end_of_header) {
                return Err(FormatError::Header("the backing file name lies outside the first cluster".into()));
            }
            self.backing_file = Some(text(&buf[start..start + backing_len], "backing file name")?);
        }
        Ok(names)
    }

    /// Every table the header names must be cluster aligned and inside
    /// sane limits, so later arithmetic cannot overflow.
    fn check_tables(&self, file_len: u64) -> Result<(), FormatError> {
        let cs = self.cluster_size();
        let aligned = |name: &str, offset: u64| {
            if !offset.is_multiple_of(cs) {
                Err(FormatError::Header(format!("{name} offset {offset:#x} is not cluster aligned")))
            } else {
                Ok(())
            }
        };
        // QEMU's limits: 32 MiB of L1 table, 8 MiB of refcount table, and
        // images of at most 2^61 bytes so offsets fit the L2 entry format.
        if self.size > (1 << 61) {
            return Err(FormatError::Header(format!("virtual size {} is too large", self.size)));
        }
        if u64::from(self.l1_size) * 8 > 32 << 20 {
            return Err(FormatError::Header(format!("L1 table of {} entries is too large", self.l1_size)));
        }
        if u64::from(self.l1_size) < self.l1_entries_needed() {
            return Err(FormatError::Header(format!(
                "L1 table of {} entries is too small for {} bytes",
                self.l1_size, self.size
            )));
        }
        aligned("L1 table", self.l1_offset)?;
        if self.l1_size > 0 && self.l1_offset == 0 {
            return Err(FormatError::Header("L1 table at offset 0 (over the header)".into()));
        }
        if u64::from(self.refcount_table_clusters) * cs > 8 << 20 {
            return Err(FormatError::Header("refcount table larger than 8 MiB".into()));
        }
        if self.refcount_table_clusters == 0 || self.refcount_table_offset == 0 {
            return Err(FormatError::Header("no refcount table".into()));
        }
        aligned("refcount table", self.refcount_table_offset)?;
        if self.nb_snapshots > 0 {
            aligned("snapshot table", self.snapshots_offset)?;
        }
        let past_end = |name: &str, offset: u64, len: u64| {
            if offset.saturating_add(len) > file_len {
                Err(FormatError::Corrupt(format!("{name} at {offset:#x} lies past the end of the image file")))
            } else {
                Ok(())
            }
        };
        past_end("L1 table", self.l1_offset, u64::from(self.l1_size) * 8)?;
        past_end("refcount table", self.refcount_table_offset, u64::from(self.refcount_table_clusters) * cs)?;
        if let Some(ext) = self.bitmaps {
            aligned("bitmap directory", ext.directory_offset)?;
            past_end("bitmap directory", ext.directory_offset, ext.directory_size)?;
        }
        Ok(())
    }

    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// L2 entries carry subcluster bitmaps.
    pub fn extended_l2(&self) -> bool {
        self.incompatible & incompatible::EXTENDED_L2 != 0
    }

    /// Guest data lives in an external data file.
    pub fn has_data_file(&self) -> bool {
        self.incompatible & incompatible::DATA_FILE != 0
    }

    /// Refcounts may be stale and must be rebuilt before writing.
    pub fn dirty(&self) -> bool {
        self.incompatible & incompatible::DIRTY != 0
    }

    /// Bytes per L2 entry.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2() { 16 } else { 8 }
    }

    /// Guest clusters one L2 table maps.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_size()
    }

    /// L1 entries needed to map the whole virtual disk.
    pub fn l1_entries_needed(&self) -> u64 {
        self.l1_entries_for(self.size)
    }

    /// L1 entries a disk of `size` bytes needs.
    pub fn l1_entries_for(&self, size: u64) -> u64 {
        size.div_ceil(self.cluster_size()).div_ceil(self.l2_entries())
    }
}

/// Parses and checks the bitmaps extension's data (its placement is
/// checked with the other tables').
fn bitmaps_extension(data: &[u8]) -> Result<BitmapsExtension, FormatError> {
    let bad = |what: &str| Err(FormatError::Header(format!("bitmaps extension: {what}")));
    if data.len() != BITMAPS_EXTENSION_LEN {
        return bad(&format!("{} bytes long instead of {BITMAPS_EXTENSION_LEN}", data.len()));
    }
    let ext =
        BitmapsExtension { count: be32(data, 0), directory_size: be64(data, 8), directory_offset: be64(data, 16) };
    if be32(data, 4) != 0 {
        return bad("reserved field is not zero");
    }
    if ext.count == 0 || ext.count > bitmap_limits::MAX_BITMAPS {
        return bad(&format!("{} bitmaps (1 to {} allowed)", ext.count, bitmap_limits::MAX_BITMAPS));
    }
    if ext.directory_size == 0 || ext.directory_size > bitmap_limits::MAX_DIRECTORY {
        return bad(&format!("a bitmap directory of {} bytes", ext.directory_size));
    }
    Ok(ext)
}

/// Rewrites the header extensions in `chunk` (the start of the header
/// cluster, as on disk) with `bitmaps` as the bitmaps extension (`None`:
/// without one), and autoclear bit 0 to match. The other extensions keep
/// their order; the backing file name moves to follow them, as QEMU lays
/// it out. Fails, leaving `chunk` unchanged, if they do not fit in it.
pub fn set_bitmaps_extension(chunk: &mut [u8], bitmaps: Option<BitmapsExtension>) -> Result<(), FormatError> {
    if be32(chunk, 4) < 3 {
        return Err(unfit("a version 2 image has no autoclear bits for bitmaps"));
    }
    let mut area = extensions_without(chunk, extension::BITMAPS)?;
    if let Some(ext) = bitmaps {
        let data = [
            &ext.count.to_be_bytes()[..],
            &[0; 4],
            &ext.directory_size.to_be_bytes(),
            &ext.directory_offset.to_be_bytes(),
        ];
        append_extension(&mut area, extension::BITMAPS, &data.concat());
    }
    let name = backing_name(chunk)?.map(<[u8]>::to_vec);
    lay_out(chunk, &area, name.as_deref())?;
    let at = field::AUTOCLEAR as usize;
    let bits = be64(chunk, at) & !autoclear::BITMAPS | if bitmaps.is_some() { autoclear::BITMAPS } else { 0 };
    chunk[at..at + 8].copy_from_slice(&bits.to_be_bytes());
    Ok(())
}

/// The longest backing file name QEMU opens.
const MAX_BACKING_NAME: usize = 1023;

/// Names `backing` (file name, format) as the backing file in `chunk` (the
/// start of the header cluster, as on disk), or none with `None`, as
/// `qemu-img rebase -u` does: the backing format extension comes first
/// (QEMU's order), the other extensions keep theirs, and the name follows
/// them. Fails, leaving `chunk` unchanged, if the name is empty, longer
/// than QEMU takes, or does not fit in it.
pub fn set_backing_file(chunk: &mut [u8], backing: Option<(&str, &str)>) -> Result<(), FormatError> {
    let mut area = Vec::new();
    if let Some((name, format)) = backing {
        if name.is_empty() || name.len() > MAX_BACKING_NAME {
            return Err(FormatError::Option(format!(
                "a backing file name must be 1 to {MAX_BACKING_NAME} bytes long, not {}",
                name.len()
            )));
        }
        append_extension(&mut area, extension::BACKING_FORMAT, format.as_bytes());
    }
    area.extend(extensions_without(chunk, extension::BACKING_FORMAT)?);
    lay_out(chunk, &area, backing.map(|(name, _)| name.as_bytes())).map_err(|_| {
        FormatError::Option(format!(
            "the backing file name does not fit in the image header (its first {} bytes)",
            chunk.len()
        ))
    })
}

fn unfit(what: &str) -> FormatError {
    FormatError::Unsupported(format!("cannot rewrite the header extensions: {what}"))
}

/// Where the extensions start: after the fixed header.
fn header_length(chunk: &[u8]) -> usize {
    if be32(chunk, 4) >= 3 { be32(chunk, 100) as usize } else { V2_HEADER_LEN as usize }
}

/// The header extensions in `chunk` but those of kind `dropped`, each
/// whole (padding included), without the end marker.
fn extensions_without(chunk: &[u8], dropped: u32) -> Result<Vec<u8>, FormatError> {
    let mut area = Vec::new();
    let mut at = header_length(chunk);
    loop {
        let Some(head) = chunk.get(at..at + 8) else { return Err(unfit("they run past the first 4 KiB")) };
        let (kind, len) = (be32(head, 0), be32(head, 4) as usize);
        if kind == extension::END {
            return Ok(area);
        }
        let padded = len.next_multiple_of(8);
        let Some(whole) = chunk.get(at..at + 8 + padded) else { return Err(unfit("they run past the first 4 KiB")) };
        if kind != dropped {
            area.extend_from_slice(whole);
        }
        at += 8 + padded;
    }
}

/// Appends an extension of `kind` holding `data`, padded to 8 bytes.
fn append_extension(area: &mut Vec<u8>, kind: u32, data: &[u8]) {
    area.extend_from_slice(&kind.to_be_bytes());
    area.extend_from_slice(&(data.len() as u32).to_be_bytes());
    area.extend_from_slice(data);
    area.resize(area.len().next_multiple_of(8), 0);
}

/// The backing file name `chunk` holds, if any.
fn backing_name(chunk: &[u8]) -> Result<Option<&[u8]>, FormatError> {
    let (offset, len) = (be64(chunk, 8) as usize, be32(chunk, 16) as usize);
    if offset == 0 {
        return Ok(None);
    }
    match chunk.get(offset..offset.saturating_add(len)) {
        Some(name) => Ok(Some(name)),
        None => Err(unfit("the backing file name lies past the first 4 KiB")),
    }
}

/// Writes the header's variable part into `chunk`: the extensions of
/// `area`, the end marker, then the backing file name (`None`: none),
/// which the header is pointed at; zeroes after it. Fails, leaving `chunk`
/// unchanged, if they do not fit in it.
fn lay_out(chunk: &mut [u8], area: &[u8], backing: Option<&[u8]>) -> Result<(), FormatError> {
    let header_len = header_length(chunk);
    let backing_at = header_len + area.len() + 8;
    let name = backing.unwrap_or_default();
    if backing_at + name.len() > chunk.len() {
        return Err(unfit("they would run past the first 4 KiB"));
    }
    chunk[header_len..header_len + area.len()].copy_from_slice(area);
    chunk[header_len + area.len()..backing_at].fill(0); // the end marker
    chunk[backing_at..backing_at + name.len()].copy_from_slice(name);
    chunk[backing_at + name.len()..].fill(0);
    let offset = if backing.is_some() { backing_at as u64 } else { 0 };
    chunk[8..16].copy_from_slice(&offset.to_be_bytes());
    chunk[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
    Ok(())
}

fn be32(buf: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(buf[at..at + 4].try_into().unwrap())
}

fn be64(buf: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(buf[at..at + 8].try_into().unwrap())
}

fn text(data: &[u8], what: &str) -> Result<String, FormatError> {
    String::from_utf8(data.to_vec()).map_err(|_| FormatError::Header(format!("the {what} is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal valid v3 header with 64 KiB clusters for a 1 GiB disk.
    fn v3() -> Vec<u8> {
        let mut b = vec![0u8; 65536];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        b[20..24].copy_from_slice(&16u32.to_be_bytes());
        b[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes());
        b[36..40].copy_from_slice(&2u32.to_be_bytes());
        b[40..48].copy_from_slice(&0x30000u64.to_be_bytes());
        b[48..56].copy_from_slice(&0x10000u64.to_be_bytes());
        b[56..60].copy_from_slice(&1u32.to_be_bytes());
        b[96..100].copy_from_slice(&4u32.to_be_bytes());
        b[100..104].copy_from_slice(&112u32.to_be_bytes());
        b
    }

    #[test]
    fn parses_a_plain_v3_header() {
        let h = Header::parse(&v3(), 1 << 20).unwrap();
        assert_eq!((h.version, h.cluster_size(), h.size, h.l1_size), (3, 65536, 1 << 30, 2));
        assert_eq!(h.l2_entries(), 8192);
        assert!(h.backing_file.is_none() && !h.extended_l2());
    }

    #[test]
    fn refuses_unknown_incompatible_bits_by_name() {
        let mut b = v3();
        b[72..80].copy_from_slice(&(1u64 << 9).to_be_bytes());
        // A feature name table naming bit 9.
        b[112..116].copy_from_slice(&extension::FEATURE_TABLE.to_be_bytes());
        b[116..120].copy_from_slice(&48u32.to_be_bytes());
        b[120] = 0;
        b[121] = 9;
        b[122..126].copy_from_slice(b"warp");
        let err = Header::parse(&b, 1 << 20).unwrap_err().to_string();
        assert!(err.contains("bit 9 (warp)"), "{err}");
    }

    #[test]
    fn refuses_encryption_and_bad_geometry() {
        let mut b = v3();
        b[32..36].copy_from_slice(&1u32.to_be_bytes());
        assert!(Header::parse(&b, 1 << 20).unwrap_err().to_string().contains("encrypted"));
        let mut b = v3();
        b[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert!(Header::parse(&b, 1 << 20).unwrap_err().to_string().contains("cluster_bits"));
        let mut b = v3();
        b[36..40].copy_from_slice(&1u32.to_be_bytes());
        assert!(Header::parse(&b, 1 << 20).unwrap_err().to_string().contains("too small"));
        let b = v3();
        assert!(Header::parse(&b, 0x20000).unwrap_err().to_string().contains("past the end"));
    }

    #[test]
    fn an_extension_running_past_the_cluster_is_refused() {
        let mut b = v3();
        b[112..116].copy_from_slice(&extension::BACKING_FORMAT.to_be_bytes());
        b[116..120].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(Header::parse(&b, 1 << 20).is_err());
    }

    /// Appends an extension at `at` (after the fixed header); returns where
    /// the next one goes.
    fn put_extension(b: &mut [u8], at: usize, kind: u32, data: &[u8]) -> usize {
        b[at..at + 4].copy_from_slice(&kind.to_be_bytes());
        b[at + 4..at + 8].copy_from_slice(&(data.len() as u32).to_be_bytes());
        b[at + 8..at + 8 + data.len()].copy_from_slice(data);
        at + 8 + data.len().next_multiple_of(8)
    }

    fn bitmaps_data(count: u32, size: u64, offset: u64) -> Vec<u8> {
        [&count.to_be_bytes()[..], &[0; 4], &size.to_be_bytes(), &offset.to_be_bytes()].concat()
    }

    #[test]
    fn the_bitmaps_extension_counts_only_with_its_autoclear_bit() {
        let mut b = v3();
        put_extension(&mut b, 112, extension::BITMAPS, &bitmaps_data(2, 64, 0x40000));
        let h = Header::parse(&b, 1 << 20).unwrap();
        assert!(h.has_bitmaps && h.bitmaps.is_none(), "stale without the bit");
        b[88..96].copy_from_slice(&autoclear::BITMAPS.to_be_bytes());
        let h = Header::parse(&b, 1 << 20).unwrap();
        let want = BitmapsExtension { count: 2, directory_size: 64, directory_offset: 0x40000 };
        assert_eq!(h.bitmaps, Some(want));
        for (data, err) in [
            (bitmaps_data(0, 64, 0x40000), "0 bitmaps"),
            (bitmaps_data(65536, 64, 0x40000), "65536 bitmaps"),
            (bitmaps_data(1, 0, 0x40000), "directory of 0 bytes"),
            (bitmaps_data(1, (64 << 20) + 1, 0x40000), "directory of 67108865"),
            (bitmaps_data(1, 64, 0x40200), "not cluster aligned"),
            (bitmaps_data(1, 64, 0x100000), "past the end"),
            (bitmaps_data(1, 64, 0x40000)[..16].to_vec(), "16 bytes long"),
        ] {
            put_extension(&mut b, 112, extension::BITMAPS, &data);
            let got = Header::parse(&b, 1 << 20).unwrap_err().to_string();
            assert!(got.contains(err), "{err}: {got}");
        }
    }

    #[test]
    fn setting_the_bitmaps_extension_keeps_the_others_and_moves_the_backing_name() {
        let mut b = v3();
        let at = put_extension(&mut b, 112, extension::BACKING_FORMAT, b"qcow2");
        let at = put_extension(&mut b, at, extension::BITMAPS, &bitmaps_data(1, 32, 0x40000));
        let at = put_extension(&mut b, at, 0x1234_5678, b"unknown, kept");
        let name_at = at + 8;
        b[name_at..name_at + 8].copy_from_slice(b"base.img");
        b[8..16].copy_from_slice(&(name_at as u64).to_be_bytes());
        b[16..20].copy_from_slice(&8u32.to_be_bytes());
        b[88..96].copy_from_slice(&(autoclear::BITMAPS | 1 << 7).to_be_bytes());
        let mut chunk = b[..4096].to_vec();

        let ext = BitmapsExtension { count: 3, directory_size: 96, directory_offset: 0x50000 };
        set_bitmaps_extension(&mut chunk, Some(ext)).unwrap();
        let h = Header::parse(&chunk, 1 << 20).unwrap();
        assert_eq!(h.bitmaps, Some(ext));
        assert_eq!((h.backing_file.as_deref(), h.backing_format.as_deref()), (Some("base.img"), Some("qcow2")));
        assert_eq!(h.autoclear, autoclear::BITMAPS | 1 << 7, "other autoclear bits are the caller's");
        assert!(chunk.windows(13).any(|w| w == b"unknown, kept"));

        set_bitmaps_extension(&mut chunk, None).unwrap();
        let h = Header::parse(&chunk, 1 << 20).unwrap();
        assert!(!h.has_bitmaps && h.autoclear == 1 << 7);
        assert_eq!(h.backing_file.as_deref(), Some("base.img"));
        assert_eq!(be64(&chunk, 8) as usize, name_at - 32, "the name follows the shorter extensions");
    }

    /// `b` with `name` at `name_at` as its backing file name, cut to its
    /// first 4 KiB.
    fn with_backing_name(mut b: Vec<u8>, name_at: usize, name: &[u8]) -> Vec<u8> {
        b[name_at..name_at + name.len()].copy_from_slice(name);
        b[8..16].copy_from_slice(&(name_at as u64).to_be_bytes());
        b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        b.truncate(4096);
        b
    }

    #[test]
    fn setting_the_backing_file_replaces_name_and_format_and_keeps_the_other_extensions() {
        let mut b = v3();
        let at = put_extension(&mut b, 112, 0x1234_5678, b"unknown, kept");
        let at = put_extension(&mut b, at, extension::BACKING_FORMAT, b"raw");
        let mut chunk = with_backing_name(b, at + 8, b"base.img");

        set_backing_file(&mut chunk, Some(("../other/base.qcow2", "qcow2"))).unwrap();
        let h = Header::parse(&chunk, 1 << 20).unwrap();
        assert_eq!(
            (h.backing_file.as_deref(), h.backing_format.as_deref()),
            (Some("../other/base.qcow2"), Some("qcow2"))
        );
        assert_eq!(be32(&chunk, 112), extension::BACKING_FORMAT, "the format first, as QEMU lays it out");
        assert!(chunk.windows(13).any(|w| w == b"unknown, kept"));
        assert!(!chunk.windows(8).any(|w| w == b"base.img"), "no trace of the old name");

        set_backing_file(&mut chunk, None).unwrap();
        let h = Header::parse(&chunk, 1 << 20).unwrap();
        assert_eq!((h.backing_file, h.backing_format), (None, None));
        assert_eq!((be64(&chunk, 8), be32(&chunk, 16)), (0, 0));
        assert!(chunk.windows(13).any(|w| w == b"unknown, kept"));
    }

    #[test]
    fn a_version_2_header_takes_a_backing_file_after_its_72_bytes() {
        let mut b = v3();
        b[4..8].copy_from_slice(&2u32.to_be_bytes());
        b[72..112].fill(0);
        let mut chunk = b[..4096].to_vec();
        set_backing_file(&mut chunk, Some(("base.raw", "raw"))).unwrap();
        let h = Header::parse(&chunk, 1 << 20).unwrap();
        assert_eq!(
            (h.version, h.backing_file.as_deref(), h.backing_format.as_deref()),
            (2, Some("base.raw"), Some("raw"))
        );
        assert_eq!(be32(&chunk, 72), extension::BACKING_FORMAT);
    }

    #[test]
    fn a_backing_file_name_that_does_not_fit_changes_nothing() {
        let before = with_backing_name(v3(), 120, b"base.img");
        let mut chunk = before.clone();
        let long = "x".repeat(1024);
        let err = set_backing_file(&mut chunk, Some((&long, "raw"))).unwrap_err().to_string();
        assert!(err.contains("1 to 1023 bytes"), "{err}");
        let mut small = before[..512].to_vec();
        let name = "y".repeat(400);
        let err = set_backing_file(&mut small, Some((&name, "raw"))).unwrap_err().to_string();
        assert!(err.contains("does not fit in the image header"), "{err}");
        assert_eq!((&small[..], &chunk[..]), (&before[..512], &before[..]), "unchanged");
    }

    #[test]
    fn setting_the_bitmaps_extension_refuses_what_does_not_fit() {
        let ext = Some(BitmapsExtension { count: 1, directory_size: 32, directory_offset: 0x40000 });
        let mut b = v3();
        b[4..8].copy_from_slice(&2u32.to_be_bytes());
        assert!(set_bitmaps_extension(&mut b[..4096], ext).unwrap_err().to_string().contains("version 2"));
        let mut b = v3();
        put_extension(&mut b, 112, 0x1234_5678, &[7; 4096 - 112 - 8 - 8]);
        let before = b[..4096].to_vec();
        let mut chunk = before.clone();
        assert!(set_bitmaps_extension(&mut chunk, ext).unwrap_err().to_string().contains("past the first 4 KiB"));
        assert_eq!(chunk, before, "unchanged");
    }
}
