//! Compressed cluster writes, as QEMU's `qcow2_co_pwritev_compressed_part`
//! makes them: each whole cluster (the disk's last one may be partial, and
//! is padded with zeroes) compressed by the image's method, or written as
//! usual if that does not shrink it below a cluster. Compressed clusters
//! are packed back to back in host clusters ([`Meta::alloc_bytes`]).
//!
//! The order is that of any allocating write: under the metadata mutex the
//! bytes are allocated (refcounts raised, in memory) and the cluster marked
//! in flight; its data is written without the mutex; then its L2 entry
//! names it. A flush writes data and refcounts before tables, so a crash
//! leaks at worst.

use std::io;

use super::write::Fill;
use super::{Allocation, Image, ImageIo, Meta};
use crate::buf::AlignedBuf;
use crate::compress::compress_cluster;

fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

impl Image {
    /// Writes `len` guest bytes at `offset` compressed, `fill` supplying
    /// them. The range starts on a cluster and ends on one or at the end
    /// of the disk (else EINVAL). A cluster this image holds data for
    /// already fails the write with EIO, as in QEMU: compression can't
    /// overwrite anything. Images with an external data file refuse it
    /// (ENOTSUP).
    pub fn write_compressed(&self, io: &mut ImageIo, offset: u64, len: u64, fill: Fill) -> io::Result<()> {
        self.check_writable()?;
        if self.layout.data_file {
            return Err(errno(libc::ENOTSUP));
        }
        let cs = self.cluster_size();
        if !offset.is_multiple_of(cs) || (!len.is_multiple_of(cs) && offset + len != self.size()) {
            return Err(errno(libc::EINVAL));
        }
        // Checked for the whole range first: a retry after a busy cluster
        // would find the clusters before it written.
        self.check_idle(&self.lock(), offset, len)?;
        let mut plain = AlignedBuf::zeroed(cs as usize);
        for pos in (0..len).step_by(cs as usize) {
            let n = (len - pos).min(cs) as usize;
            plain[n..].fill(0);
            fill(pos, &mut plain[..n]);
            match compress_cluster(self.compression(), &plain, cs as usize - 1) {
                Some(packed) => self.write_packed(io, offset + pos, &packed)?,
                None => self.write(io, offset + pos, n as u64, &mut |at, buf| {
                    buf.copy_from_slice(&plain[at as usize..at as usize + buf.len()])
                })?,
            }
        }
        Ok(())
    }

    /// Stores `bytes`, guest `cluster` compressed.
    fn write_packed(&self, io: &mut ImageIo, cluster: u64, bytes: &[u8]) -> io::Result<()> {
        let mut meta = self.lock();
        let planned = self.place_packed(&mut meta, io, cluster, bytes.len() as u64);
        self.note_dirty(&meta);
        drop(meta);
        let a = planned?;
        let result = io.meta.write_at(&AlignedBuf::copy_of(bytes), a.host);
        let linked = self.finish_allocation(io.meta, a, result.is_ok());
        result.and(linked)
    }

    /// Allocates `len` bytes for guest `cluster` compressed, marked in flight.
    fn place_packed(&self, meta: &mut Meta, io: &mut ImageIo, cluster: u64, len: u64) -> io::Result<Allocation> {
        self.check_idle(meta, cluster, 1)?;
        self.prepare_change(meta, io)?;
        let (table, index, old) = self.entry_for_write(meta, io, cluster)?;
        if old.host.is_some() || old.compressed.is_some() {
            log::warn!("qcow2: compression can't overwrite anything (guest cluster {cluster:#x} is allocated)");
            return Err(errno(libc::EIO));
        }
        let host = meta.alloc_bytes(io.meta, len)?;
        meta.allocating.insert(cluster);
        Ok(Allocation::compressed(cluster, (table.offset, index, old), host, len))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use super::*;
    use crate::mem::MemFile;
    use crate::{Mapping, Options};

    const KIB: u64 = 1024;

    fn open(file: &mut MemFile) -> Image {
        let len = file.bytes.len() as u64;
        Image::open(file, len, Options { writable: true, ..Options::default() }).unwrap()
    }

    fn io(file: &mut MemFile) -> ImageIo<'_> {
        ImageIo { meta: file, data: None, backing: None }
    }

    /// `random` bytes of noise (seeded by `seed`), then zeroes: compresses
    /// to a little more than `random` bytes.
    fn cluster(seed: u64, random: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut out = vec![0; 64 * KIB as usize];
        for b in &mut out[..random] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        out
    }

    fn compressed_at(image: &Image, file: &mut MemFile, offset: u64) -> (u64, u64) {
        match image.map(&mut Default::default(), file, offset, 512).unwrap().mapping {
            Mapping::Compressed { host, len } => (host, len),
            other => panic!("{other:?} at {offset:#x}"),
        }
    }

    fn refcount(image: &Image, file: &mut MemFile, host: u64) -> u64 {
        image.lock().refcounts.get(file, host >> 16).unwrap()
    }

    fn run(args: &[&str]) -> String {
        let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {text}");
        text
    }

    /// The bytes `qemu-img map --output=json` says are compressed.
    fn compressed_bytes(map: &str) -> u64 {
        let length = |line: &str| line.split("\"length\": ").nth(1)?.split(',').next()?.trim().parse::<u64>().ok();
        map.lines().filter(|l| l.contains("\"compressed\": true")).filter_map(length).sum()
    }

    /// Writes the image and a raw file of `contents` (by guest offset) to
    /// disk; QEMU checks the image and compares the two.
    fn qemu_agrees(name: &str, file: &MemFile, size: u64, contents: &[(u64, Vec<u8>)]) -> String {
        let dir = std::env::temp_dir();
        let image = dir.join(format!("vsd-qcow2-{name}-{}.qcow2", std::process::id()));
        let raw: PathBuf = image.with_extension("raw");
        std::fs::write(&image, &file.bytes).unwrap();
        let mut expected = vec![0; size as usize];
        for (at, bytes) in contents {
            expected[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
        }
        std::fs::write(&raw, &expected).unwrap();
        let (image_path, raw_path) = (image.to_str().unwrap(), raw.to_str().unwrap());
        let check = run(&["qemu-img", "check", image_path]);
        assert!(check.contains("No errors were found"), "{check}");
        run(&["qemu-img", "compare", "-f", "raw", "-F", "qcow2", raw_path, image_path]);
        let map = run(&["qemu-img", "map", "--output=json", image_path]);
        std::fs::remove_file(&image).unwrap();
        std::fs::remove_file(&raw).unwrap();
        map
    }

    /// Compressed clusters go back to back: two and the start of a third
    /// in one host cluster, the third running on into the next, which a
    /// fourth shares; each host cluster counts the compressed clusters in
    /// it. vsd reads them back, QEMU finds the refcounts right and the
    /// contents equal.
    #[test]
    fn compressed_clusters_are_packed_and_counted_per_host_cluster() {
        for (name, args) in [("packed-zlib", &[][..]), ("packed-zstd", &["-o", "compression_type=zstd"][..])] {
            let mut file = MemFile::made_by_qemu_img_with(name, args, "4M");
            let image = open(&mut file);
            let sizes = [20000, 20000, 30000, 1000];
            let contents: Vec<(u64, Vec<u8>)> =
                sizes.iter().enumerate().map(|(i, &n)| (i as u64 * 64 * KIB, cluster(i as u64, n))).collect();
            for (at, bytes) in &contents {
                image
                    .write_compressed(&mut io(&mut file), *at, 64 * KIB, &mut |p, buf| {
                        buf.copy_from_slice(&bytes[p as usize..p as usize + buf.len()])
                    })
                    .unwrap();
            }
            let extents: Vec<(u64, u64)> = (0..4).map(|i| compressed_at(&image, &mut file, i * 64 * KIB)).collect();
            let first = extents[0].0;
            assert!(first.is_multiple_of(64 * KIB), "{name}: a fresh host cluster: {extents:x?}");
            for pair in extents.windows(2) {
                // The decoded length reaches the end of the last sector.
                assert!(pair[1].0 >= pair[0].0 + pair[0].1 - 511 && pair[1].0 <= pair[0].0 + pair[0].1, "{extents:x?}");
            }
            assert!(extents[2].0 < first + 64 * KIB && extents[2].0 + extents[2].1 > first + 64 * KIB, "spans");
            assert_eq!(refcount(&image, &mut file, first), 3, "{name}");
            assert_eq!(refcount(&image, &mut file, first + 64 * KIB), 2, "{name}");
            for (i, (at, bytes)) in contents.iter().enumerate() {
                let mut out = vec![0; 64 * KIB as usize];
                let (host, len) = extents[i];
                image.read_compressed(&mut file, host, len, &mut out).unwrap();
                assert!(out == *bytes, "{name}: cluster at {at:#x}");
            }
            image.close(&mut io(&mut file)).unwrap();
            let map = qemu_agrees(name, &file, 4 << 20, &contents);
            assert_eq!(compressed_bytes(&map), 4 * 64 * KIB, "{map}");
        }
    }

    /// What does not shrink is written as usual; an allocated cluster is
    /// not overwritten compressed (EIO); a misaligned range is refused;
    /// the disk's partial last cluster is padded; freeing compressed
    /// clusters frees their host clusters.
    #[test]
    fn incompressible_allocated_misaligned_and_freed() {
        let mut file = MemFile::made_by_qemu_img("compress-edges", "1000k");
        let image = open(&mut file);
        let noise = cluster(7, 64 * KIB as usize);
        fn copy(bytes: &[u8]) -> impl FnMut(u64, &mut [u8]) + '_ {
            move |p, buf| buf.copy_from_slice(&bytes[p as usize..][..buf.len()])
        }
        image.write_compressed(&mut io(&mut file), 0, 64 * KIB, &mut copy(&noise)).unwrap();
        let mapped = image.map(&mut Default::default(), &mut file, 0, 64 * KIB).unwrap().mapping;
        assert!(matches!(mapped, Mapping::Data { .. }), "{mapped:?}");
        let err = |r: io::Result<()>| r.unwrap_err().raw_os_error();
        let small = cluster(8, 100);
        assert_eq!(err(image.write_compressed(&mut io(&mut file), 0, 64 * KIB, &mut copy(&small))), Some(libc::EIO));
        let misaligned = image.write_compressed(&mut io(&mut file), 4 * KIB, 64 * KIB, &mut copy(&small));
        assert_eq!(err(misaligned), Some(libc::EINVAL));
        // 1000 KiB: the last cluster holds 40 KiB of the disk.
        let tail = &small[..40 * KIB as usize];
        image.write_compressed(&mut io(&mut file), 960 * KIB, 40 * KIB, &mut copy(tail)).unwrap();
        image.write_compressed(&mut io(&mut file), 64 * KIB, 64 * KIB, &mut copy(&small)).unwrap();
        let (host, _) = compressed_at(&image, &mut file, 64 * KIB);
        assert_eq!(refcount(&image, &mut file, host), 2);
        image.close(&mut io(&mut file)).unwrap();
        let contents = [(0, noise.clone()), (64 * KIB, small.clone()), (960 * KIB, tail.to_vec())];
        qemu_agrees("compress-edges", &file, 1000 * KIB, &contents);

        let image = open(&mut file);
        image.discard(&mut io(&mut file), 64 * KIB, 64 * KIB).unwrap();
        image.discard(&mut io(&mut file), 960 * KIB, 40 * KIB).unwrap();
        image.flush(&mut io(&mut file)).unwrap();
        assert_eq!(refcount(&image, &mut file, host), 0, "freed with both clusters in it");
        image.write_compressed(&mut io(&mut file), 128 * KIB, 64 * KIB, &mut copy(&small)).unwrap();
        image.close(&mut io(&mut file)).unwrap();
        qemu_agrees("compress-freed", &file, 1000 * KIB, &[(0, noise), (128 * KIB, small)]);
    }

    /// With subclusters, a compressed entry has an empty bitmap.
    #[test]
    fn extended_l2_entries_compressed() {
        let mut file = MemFile::made_by_qemu_img_with("compress-ext", &["-o", "extended_l2=on"], "1M");
        let image = open(&mut file);
        let bytes = cluster(3, 5000);
        let contents: Vec<(u64, Vec<u8>)> = [0, 192 * KIB].into_iter().map(|at| (at, bytes.clone())).collect();
        for (at, bytes) in &contents {
            image
                .write_compressed(&mut io(&mut file), *at, 64 * KIB, &mut |p, buf| {
                    buf.copy_from_slice(&bytes[p as usize..][..buf.len()])
                })
                .unwrap();
        }
        image.close(&mut io(&mut file)).unwrap();
        let map = qemu_agrees("compress-ext", &file, 1 << 20, &contents);
        assert_eq!(compressed_bytes(&map), 2 * 64 * KIB, "{map}");
    }

    /// Zeroing whole subclusters of a compressed cluster decompresses it
    /// into a cluster of its own, without the metadata mutex held while it
    /// reads; the other bytes stay, and QEMU agrees.
    #[test]
    fn zeroing_part_of_a_compressed_cluster_reads_it_without_the_mutex() {
        let mut file = MemFile::made_by_qemu_img_with("compress-zero", &["-o", "extended_l2=on"], "1M");
        let image = open(&mut file);
        let mut bytes = cluster(5, 30000);
        image
            .write_compressed(&mut io(&mut file), 0, 64 * KIB, &mut |p, buf| {
                buf.copy_from_slice(&bytes[p as usize..][..buf.len()])
            })
            .unwrap();
        // Subclusters of 2 KiB: 4 KiB..12 KiB are four of them.
        let mut watched = super::super::tests::Watched { file: &mut file, image: &image, reads: 0, under_mutex: 0 };
        let mut through = ImageIo { meta: &mut watched, data: None, backing: None };
        image.write_zeroes(&mut through, 4 * KIB, 8 * KIB, true, false).unwrap();
        assert!(watched.reads > 0, "the compressed cluster was read");
        assert_eq!(watched.under_mutex, 0, "of {} reads", watched.reads);
        bytes[4 * KIB as usize..12 * KIB as usize].fill(0);
        image.close(&mut io(&mut file)).unwrap();
        let map = qemu_agrees("compress-zero", &file, 1 << 20, &[(0, bytes)]);
        assert_eq!(compressed_bytes(&map), 0, "{map}");
    }
}
