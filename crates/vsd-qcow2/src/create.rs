//! A new, empty image, as QEMU's `blockdev-create` (and `qemu-img create`)
//! lays it out: the header in cluster 0, then the refcount table, the
//! refcount blocks covering those clusters, and an L1 table of zeroes.
//! No I/O here: [`new_image`] returns the bytes and where they go.

use crate::header::{compatible, incompatible};
use crate::refcount::Width;

const MAGIC: u32 = 0x5146_49fb;
/// A version 3 header with the compression type field, padded (QEMU's).
const V3_HEADER_LEN: usize = 112;
const V2_HEADER_LEN: usize = 72;
const BACKING_FORMAT_EXTENSION: u32 = 0xe279_2aca;

/// What the new image is to be; the defaults are QEMU's.
#[derive(Clone, Debug)]
pub struct NewImage {
    /// Virtual size in bytes, a multiple of 512.
    pub size: u64,
    /// 2 or 3.
    pub version: u32,
    /// A power of two from 512 to 2 MiB.
    pub cluster_size: u64,
    /// Version 3 only.
    pub lazy_refcounts: bool,
    /// A power of two up to 64 (16 in version 2).
    pub refcount_bits: u32,
    /// Subclusters (version 3, clusters of 16 KiB or more).
    pub extended_l2: bool,
    /// zstd instead of zlib for compressed clusters (version 3).
    pub zstd: bool,
    /// The backing file, as written in the header.
    pub backing_file: Option<String>,
    /// Its format.
    pub backing_format: Option<String>,
}

impl Default for NewImage {
    fn default() -> Self {
        Self {
            size: 0,
            version: 3,
            cluster_size: 65536,
            lazy_refcounts: false,
            refcount_bits: 16,
            extended_l2: false,
            zstd: false,
            backing_file: None,
            backing_format: None,
        }
    }
}

/// The bytes of a new image and their offsets in the file, or why the
/// image cannot be made (QEMU's words).
pub fn new_image(spec: &NewImage) -> Result<Vec<(u64, Vec<u8>)>, String> {
    check(spec)?;
    let cs = spec.cluster_size;
    let width = Width::new(spec.refcount_bits.trailing_zeros());
    let entry_size = if spec.extended_l2 { 16 } else { 8 };
    let l2_entries = cs / entry_size;
    let l1_entries = spec.size.div_ceil(cs * l2_entries);
    let l1_clusters = (l1_entries * 8).div_ceil(cs);
    // Refcount blocks must cover every cluster made here, themselves too.
    let (mut table_clusters, mut blocks) = (1, 1);
    loop {
        let clusters = 1 + table_clusters + blocks + l1_clusters;
        let need_blocks = clusters.div_ceil(width.entries(cs));
        let need_table = (need_blocks * 8).div_ceil(cs);
        if (need_blocks, need_table) == (blocks, table_clusters) {
            break;
        }
        (blocks, table_clusters) = (need_blocks, need_table);
    }
    let table_at = cs;
    let blocks_at = table_at + table_clusters * cs;
    let l1_at = blocks_at + blocks * cs;
    let clusters = 1 + table_clusters + blocks + l1_clusters;
    let l1_size = u32::try_from(l1_entries).map_err(|_| "The image size is too large".to_string())?;

    let header = header(spec, l1_size, l1_at, table_at, table_clusters)?;
    let mut table = vec![0u8; (table_clusters * cs) as usize];
    for i in 0..blocks {
        put64(&mut table, (i * 8) as usize, blocks_at + i * cs);
    }
    let mut refcounts = vec![0u8; (blocks * cs) as usize];
    for cluster in 0..clusters {
        let block = (cluster / width.entries(cs)) as usize * cs as usize;
        width.set(&mut refcounts[block..block + cs as usize], cluster % width.entries(cs), 1);
    }
    let mut out = vec![(0, header), (table_at, table), (blocks_at, refcounts)];
    if l1_clusters > 0 {
        out.push((l1_at, vec![0; (l1_clusters * cs) as usize]));
    }
    Ok(out)
}

fn check(spec: &NewImage) -> Result<(), String> {
    let v3 = "compatibility level 1.1 and above (use version=v3 or greater)";
    if !spec.size.is_multiple_of(512) {
        return Err("Image size must be a multiple of 512 bytes".into());
    }
    if !spec.cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&spec.cluster_size) {
        return Err("Cluster size must be a power of two between 512 and 2048k".into());
    }
    if !matches!(spec.version, 2 | 3) {
        return Err(format!("Invalid version {}", spec.version));
    }
    if spec.version == 2 && spec.lazy_refcounts {
        return Err(format!("Lazy refcounts only supported with {v3}"));
    }
    if !spec.refcount_bits.is_power_of_two() || spec.refcount_bits > 64 {
        return Err("Refcount width must be a power of two and may not exceed 64 bits".into());
    }
    if spec.version == 2 && spec.refcount_bits != 16 {
        return Err(format!("Different refcount widths than 16 bits require {v3}"));
    }
    if spec.extended_l2 && spec.version == 2 {
        return Err(format!("Extended L2 entries are only supported with {v3}"));
    }
    if spec.extended_l2 && spec.cluster_size < 16384 {
        return Err("Extended L2 entries are only supported with cluster sizes of at least 16384 bytes".into());
    }
    if spec.zstd && spec.version == 2 {
        return Err(format!("Non-zlib compression type is only supported with {v3}"));
    }
    if spec.backing_format.is_some() && spec.backing_file.is_none() {
        return Err("Backing format cannot be used without backing file".into());
    }
    Ok(())
}

/// Cluster 0: the header, its extensions, and the backing file's name.
fn header(spec: &NewImage, l1_size: u32, l1_at: u64, table_at: u64, table_clusters: u64) -> Result<Vec<u8>, String> {
    let mut h = vec![0u8; if spec.version == 3 { V3_HEADER_LEN } else { V2_HEADER_LEN }];
    put32(&mut h, 0, MAGIC);
    put32(&mut h, 4, spec.version);
    put32(&mut h, 20, spec.cluster_size.trailing_zeros());
    put64(&mut h, 24, spec.size);
    put32(&mut h, 36, l1_size);
    put64(&mut h, 40, l1_at);
    put64(&mut h, 48, table_at);
    put32(&mut h, 56, table_clusters as u32);
    if spec.version == 3 {
        let mut features = 0;
        if spec.extended_l2 {
            features |= incompatible::EXTENDED_L2;
        }
        if spec.zstd {
            features |= incompatible::COMPRESSION_TYPE;
            h[104] = 1;
        }
        put64(&mut h, 72, features);
        put64(&mut h, 80, if spec.lazy_refcounts { compatible::LAZY_REFCOUNTS } else { 0 });
        put32(&mut h, 96, spec.refcount_bits.trailing_zeros());
        put32(&mut h, 100, V3_HEADER_LEN as u32);
    }
    if let Some(format) = &spec.backing_format {
        h.extend_from_slice(&BACKING_FORMAT_EXTENSION.to_be_bytes());
        h.extend_from_slice(&(format.len() as u32).to_be_bytes());
        h.extend_from_slice(format.as_bytes());
        h.resize(h.len().next_multiple_of(8), 0);
    }
    h.extend_from_slice(&[0; 8]); // the end of the extensions
    if let Some(name) = &spec.backing_file {
        let at = h.len();
        put64(&mut h, 8, at as u64);
        put32(&mut h, 16, name.len() as u32);
        h.extend_from_slice(name.as_bytes());
    }
    if h.len() as u64 > spec.cluster_size {
        return Err("Backing file name too long".into());
    }
    h.resize(spec.cluster_size as usize, 0);
    Ok(h)
}

fn put32(buf: &mut [u8], at: usize, value: u32) {
    buf[at..at + 4].copy_from_slice(&value.to_be_bytes());
}

fn put64(buf: &mut [u8], at: usize, value: u64) {
    buf[at..at + 8].copy_from_slice(&value.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::Header;

    fn file(spec: &NewImage) -> Vec<u8> {
        let mut file = Vec::new();
        for (at, bytes) in new_image(spec).unwrap() {
            let end = at as usize + bytes.len();
            file.resize(file.len().max(end), 0);
            file[at as usize..end].copy_from_slice(&bytes);
        }
        file
    }

    #[test]
    fn the_header_reads_back_as_made() {
        let spec = NewImage {
            size: 10 << 30,
            lazy_refcounts: true,
            extended_l2: true,
            zstd: true,
            backing_file: Some("base.img".into()),
            backing_format: Some("raw".into()),
            ..Default::default()
        };
        let image = file(&spec);
        let header = Header::parse(&image, image.len() as u64).unwrap();
        assert_eq!((header.version, header.size, header.cluster_bits), (3, 10 << 30, 16));
        assert_eq!(header.backing_file.as_deref(), Some("base.img"));
        assert_eq!(header.backing_format.as_deref(), Some("raw"));
        assert!(header.extended_l2() && header.compatible & compatible::LAZY_REFCOUNTS != 0);
        // 10 GiB over 256 MiB per extended L2 table (4096 entries of 16
        // bytes): 40 entries, one cluster.
        assert_eq!((header.l1_size, header.l1_offset, image.len() as u64), (40, 3 << 16, 4 << 16));
    }

    #[test]
    fn small_clusters_get_as_many_refcount_blocks_as_they_need() {
        let spec = NewImage { size: 1 << 30, cluster_size: 512, refcount_bits: 64, ..Default::default() };
        let image = file(&spec);
        let header = Header::parse(&image, image.len() as u64).unwrap();
        let clusters = image.len() as u64 / 512;
        let width = Width::new(6);
        let table = &image[header.refcount_table_offset as usize..];
        for cluster in 0..clusters {
            let block = u64::from_be_bytes(table[(cluster / 64 * 8) as usize..][..8].try_into().unwrap());
            let refcount = width.get(&image[block as usize..block as usize + 512], cluster % 64);
            assert_eq!(refcount, 1, "cluster {cluster}");
        }
    }

    #[test]
    fn mistakes_are_qemu_s_words() {
        let refused = |spec: NewImage| new_image(&spec).unwrap_err();
        assert_eq!(
            refused(NewImage { size: 1000, ..Default::default() }),
            "Image size must be a multiple of 512 bytes"
        );
        assert!(refused(NewImage { cluster_size: 1000, ..Default::default() }).starts_with("Cluster size must be"));
        assert!(refused(NewImage { version: 2, lazy_refcounts: true, ..Default::default() }).starts_with("Lazy"));
        assert!(refused(NewImage { backing_format: Some("raw".into()), ..Default::default() }).starts_with("Backing"));
    }
}
