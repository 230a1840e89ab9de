//! Persistent dirty bitmaps against the real QEMU tools: bitmaps made by
//! `qemu-img bitmap` and recorded by `qemu-io` writes load bit for bit;
//! bitmaps vsd stores are listed by `qemu-img info`, found clean by
//! `qemu-img check`, and read back by QEMU (qemu-nbd exporting them to
//! `nbdinfo --map`, `qemu-img bitmap --merge`) bit for bit. Damaged
//! bitmap metadata is refused with an error, never a panic.

use vsd_qcow2::{Mapping, StoredBitmap};

const DISK: u64 = 64 * MIB;

/// Five bitmaps through every `qemu-img bitmap` operation, with writes
/// recorded by the enabled ones in between.
#[test]
fn bitmaps_qemu_makes_load_bit_for_bit() {
    let dir = Scratch::new("bitmaps-load");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_img(&["bitmap", "--add", "-g", "4096", &img, "b"]);
    qemu_img(&["bitmap", "--add", &img, "gone"]);
    qemu_io(&img, &["write -q 0 64k", "write -q 10M 4k", "write -q 67108352 512"]);
    qemu_img(&["bitmap", "--disable", &img, "b"]);
    qemu_img(&["bitmap", "--remove", &img, "gone"]);
    qemu_io(&img, &["write -q 20M 4k"]);
    qemu_img(&["bitmap", "--add", "-g", "128K", "--disable", &img, "c"]);
    qemu_img(&["bitmap", "--merge", "a", &img, "c"]);
    qemu_img(&["bitmap", "--add", &img, "d"]);
    qemu_io(&img, &["write -q 30M 64k"]);
    qemu_img(&["bitmap", "--clear", &img, "d"]);
    qemu_img(&["bitmap", "--add", "--disable", &img, "e"]);
    qemu_img(&["bitmap", "--enable", &img, "e"]);

    let (image, mut file) = open(&img, false, false).unwrap();
    let mut loaded = image.load_bitmaps(&mut io(&mut file)).unwrap();
    loaded.sort_by(|x, y| x.name.cmp(&y.name));
    let summary: Vec<_> = loaded.iter().map(|b| (b.name.as_str(), b.granularity, b.enabled, b.in_use)).collect();
    assert_eq!(
        summary,
        [
            ("a", 65536, true, false),
            ("b", 4096, false, false),
            ("c", 131072, false, false),
            ("d", 65536, true, false),
            ("e", 65536, true, false)
        ]
    );
    let bits: Vec<_> = loaded.iter().map(set_bits).collect();
    assert_eq!(bits[0], [0, 160, 320, 480, 1023], "a: every write");
    assert_eq!(bits[1], [(0..16).collect::<Vec<_>>(), vec![2560, 16383]].concat(), "b: the writes before --disable");
    assert_eq!(bits[2], [0, 80, 160, 511], "c: a merged into it before the 30M write");
    assert!(bits[3].is_empty() && bits[4].is_empty(), "d cleared, e never written");
    for b in &loaded {
        assert_eq!(b.words.len(), StoredBitmap::words_for(DISK, b.granularity));
        assert_eq!(dirty_ranges(b, DISK), qemu_dirty_ranges(&img, &b.name), "bitmap {}", b.name);
    }
}

/// Small clusters spread a bitmap over several: QEMU leaves all-zero ones
/// out (entry 0), and all-ones entries (1), which QEMU reads but never
/// writes, read as every bit set.
#[test]
fn bitmaps_over_several_clusters_with_zero_and_all_ones_entries() {
    let dir = Scratch::new("bitmaps-clusters");
    let img = dir.path("a.qcow2");
    create(&img, "cluster_size=4096", DISK);
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "fine"]);
    // 512-byte granularity: each 4 KiB cluster of bitmap covers 16 MiB.
    qemu_io(&img, &["write -q 0 4k", "write -q 40M 512", "write -q 40M 1536"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let entry = directory_offset(&bytes);
    let (table, size) = (be64(&bytes, entry) as usize, be32(&bytes, entry + 8));
    assert_eq!(size, 4);
    let entries: Vec<u64> = (0..4).map(|i| be64(&bytes, table + 8 * i)).collect();
    assert!(entries[0] != 0 && entries[1] == 0 && entries[2] != 0 && entries[3] == 0, "{entries:x?}");

    let (image, mut file) = open(&img, false, false).unwrap();
    let fine = image.load_bitmaps(&mut io(&mut file)).unwrap().remove(0);
    assert_eq!(set_bits(&fine), [0, 1, 2, 3, 4, 5, 6, 7, 81920, 81921, 81922]);

    put64(&mut bytes, table + 8, 1);
    put64(&mut bytes, table + 24, 1);
    std::fs::write(&img, &bytes).unwrap();
    let (image, mut file) = open(&img, false, false).unwrap();
    let fine = image.load_bitmaps(&mut io(&mut file)).unwrap().remove(0);
    let ones = |from: u64, to: u64| (from * MIB / 512..to * MIB / 512).all(|i| fine.get(i));
    assert!(ones(16, 32) && ones(48, 64) && !fine.get(16 * MIB / 512 - 1) && !fine.get(40 * MIB / 512 + 3));
    assert_eq!(dirty_ranges(&fine, DISK), qemu_dirty_ranges(&img, "fine"), "QEMU reads the same");
}

/// A bit pattern over the whole disk: sparse bits in the first sixth, a
/// dense run across the three-quarter mark and the last bit; split in
/// four clusters (512-byte granularity, 4 KiB clusters), the second is
/// all zeroes and the run crosses from the third into the fourth.
fn pattern(granularity: u64, seed: u64) -> StoredBitmap {
    let mut b = StoredBitmap {
        name: String::new(),
        granularity,
        in_use: false,
        enabled: true,
        words: vec![0; StoredBitmap::words_for(DISK, granularity)],
    };
    let bits = DISK / granularity;
    let dense = bits * 3 / 4;
    for i in (seed % 7..bits / 6).step_by(997).chain(dense - 100..(dense + 300).min(bits)).chain([bits - 1]) {
        b.words[(i / 64) as usize] |= 1 << (i % 64);
    }
    b
}

fn named(name: &str, enabled: bool, b: StoredBitmap) -> StoredBitmap {
    StoredBitmap { name: name.into(), enabled, ..b }
}

/// What vsd stores, QEMU lists, checks clean and reads bit for bit, with
/// standard and small clusters, among guest writes allocating around it.
#[test]
fn bitmaps_vsd_stores_are_what_qemu_reads() {
    for cluster in ["65536", "4096"] {
        let dir = Scratch::new(&format!("bitmaps-store-{cluster}"));
        let img = dir.path("a.qcow2");
        create(&img, &format!("cluster_size={cluster}"), DISK);
        let (image, mut file) = open(&img, true, true).unwrap();
        let fill = |_, buf: &mut [u8]| buf.fill(0x5a);
        image.write(&mut io(&mut file), 0, 256 * KIB, &mut { fill }).unwrap();
        let stored = vec![
            named("x", true, pattern(65536, 1)),
            named("y", false, pattern(512, 2)),
            StoredBitmap { name: "z".into(), granularity: 1 << 31, in_use: false, enabled: true, words: vec![0] },
        ];
        image.store_bitmaps(&mut io(&mut file), &stored).unwrap();
        image.write(&mut io(&mut file), 32 * MIB, 256 * KIB, &mut { fill }).unwrap();
        image.close(&mut io(&mut file)).unwrap();
        save(&file, &img);

        let auto = || vec!["auto".to_string()];
        assert_eq!(
            qemu_bitmaps(&img),
            [("x".into(), 65536, auto()), ("y".into(), 512, vec![]), ("z".into(), 1 << 31, auto())],
            "cluster size {cluster}"
        );
        assert_check_clean(&img);
        if cluster == "4096" {
            let y = directory_offset(&file.bytes) + 32;
            let table = be64(&file.bytes, y) as usize;
            let entries: Vec<u64> = (0..4).map(|i| be64(&file.bytes, table + 8 * i)).collect();
            assert!(entries[0] != 0 && entries[1] == 0 && entries[2] != 0 && entries[3] != 0, "{entries:x?}");
        }
        for b in &stored {
            assert_eq!(qemu_dirty_ranges(&img, &b.name), dirty_ranges(b, DISK), "{} (clusters {cluster})", b.name);
        }
        // QEMU merges y into a new bitmap of its own, and vsd reads that.
        qemu_img(&["bitmap", "--add", "-g", "512", "--disable", &img, "m"]);
        qemu_img(&["bitmap", "--merge", "y", &img, "m"]);
        let (image, mut file) = open(&img, false, false).unwrap();
        let loaded = image.load_bitmaps(&mut io(&mut file)).unwrap();
        assert_eq!(&loaded[..3], &stored[..], "a round trip");
        assert_eq!(loaded[3].words, stored[1].words, "QEMU's copy of y");
        assert_eq!(loaded[3].name, "m");
    }
}

/// Each store replaces the bitmaps before it and frees their clusters;
/// storing none removes the extension and clears autoclear bit 0.
#[test]
fn bitmaps_stored_again_free_the_old_ones() {
    let dir = Scratch::new("bitmaps-replace");
    let img = dir.path("a.qcow2");
    create(&img, "cluster_size=4096", DISK);
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "a"]);
    qemu_img(&["bitmap", "--add", &img, "b"]);
    qemu_io(&img, &["write -q 0 1M", "write -q 50M 1M"]);

    let (image, mut file) = open(&img, true, true).unwrap();
    let mut loaded = image.load_bitmaps(&mut io(&mut file)).unwrap();
    let g = loaded[1].granularity;
    assert_eq!(g, 4096, "QEMU's default: the cluster size");
    assert_eq!(set_bits(&loaded[1]), (0..MIB / g).chain(50 * MIB / g..51 * MIB / g).collect::<Vec<_>>());
    loaded[0].words[1000] = u64::MAX;
    let c = named("c", false, pattern(4096, 3));
    image.store_bitmaps(&mut io(&mut file), &[loaded[0].clone(), c.clone()]).unwrap();
    image.store_bitmaps(&mut io(&mut file), &[c.clone(), loaded[0].clone()]).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_check_clean(&img);
    let names: Vec<_> = qemu_bitmaps(&img).into_iter().map(|(name, ..)| name).collect();
    assert_eq!(names, ["c", "a"]);
    assert_eq!(qemu_dirty_ranges(&img, "a"), dirty_ranges(&loaded[0], DISK));

    let (image, mut file) = open(&img, true, true).unwrap();
    image.store_bitmaps(&mut io(&mut file), &[]).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert!(bitmaps_extension_at(&file.bytes).is_none() && !bitmaps_bit(&file.bytes));
    assert!(qemu_bitmaps(&img).is_empty());
    assert_check_clean(&img);
}

/// The bitmaps extension grows and shrinks the header's extension area:
/// the backing file name after it moves, the other extensions stay.
#[test]
fn bitmaps_stored_keep_the_backing_file_and_other_extensions() {
    let dir = Scratch::new("bitmaps-backing");
    let (base, img) = (dir.path("base.qcow2"), dir.path("a.qcow2"));
    create(&base, "", DISK);
    let long_name = dir.path(&format!("{}.qcow2", "b".repeat(200)));
    std::fs::copy(&base, &long_name).unwrap();
    qemu_img(&["create", "-q", "-f", "qcow2", "-b", &long_name, "-F", "qcow2", &img]);
    let info = |path: &str| qemu_img(&["info", path]);
    let b = named("b", true, pattern(65536, 5));
    for stored in [vec![b.clone()], vec![b.clone(), named("c", false, pattern(65536, 6))], vec![]] {
        let (image, mut file) = open(&img, true, true).unwrap();
        image.store_bitmaps(&mut io(&mut file), &stored).unwrap();
        image.close(&mut io(&mut file)).unwrap();
        save(&file, &img);
        let text = info(&img);
        assert!(text.contains(&format!("backing file: {long_name}")), "{text}");
        assert!(text.contains("backing file format: qcow2"), "{text}");
        assert_eq!(qemu_bitmaps(&img).len(), stored.len(), "{text}");
        assert_check_clean(&img);
    }
}

/// After the disk grows, the old bitmaps no longer fit it: they cannot be
/// loaded, but storing new ones of the new size replaces and frees them.
#[test]
fn bitmaps_stored_after_the_disk_grew() {
    // Past 32 GiB, a 64 KiB-granularity bitmap needs a second cluster.
    const GROWN: u64 = 40 << 30;
    let dir = Scratch::new("bitmaps-grow");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k"]);
    let (image, mut file) = open(&img, true, true).unwrap();
    let mut a = image.load_bitmaps(&mut io(&mut file)).unwrap().remove(0);
    image.resize(&mut io(&mut file), GROWN).unwrap();
    let err = image.load_bitmaps(&mut io(&mut file)).unwrap_err().to_string();
    assert!(err.contains("needs 2"), "{err}");
    assert!(image.store_bitmaps(&mut io(&mut file), std::slice::from_ref(&a)).is_err(), "a is too short");
    a.words.resize(StoredBitmap::words_for(GROWN, a.granularity), 0);
    a.words[1000] = 1 << 5;
    image.store_bitmaps(&mut io(&mut file), std::slice::from_ref(&a)).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_check_clean(&img);
    assert_eq!(qemu_dirty_ranges(&img, "a"), [(0, 64 * KIB), (64005 * 64 * KIB, 64 * KIB)]);
}

/// Storing needs a writable version 3 image; storing none where there
/// are none changes nothing.
#[test]
fn bitmaps_are_stored_only_where_they_can_be() {
    let dir = Scratch::new("bitmaps-where");
    let img = dir.path("a.qcow2");
    create(&img, "compat=0.10", DISK);
    let (image, mut file) = open(&img, true, true).unwrap();
    let b = named("b", true, pattern(65536, 1));
    let err = image.store_bitmaps(&mut io(&mut file), std::slice::from_ref(&b)).unwrap_err().to_string();
    assert!(err.contains("version 3"), "{err}");
    let before = file.bytes.clone();
    image.store_bitmaps(&mut io(&mut file), &[]).unwrap();
    assert!(file.bytes == before, "untouched");

    create(&img, "", DISK);
    let (image, mut file) = open(&img, false, false).unwrap();
    let err = image.store_bitmaps(&mut io(&mut file), &[b]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert_eq!(image.mark_bitmaps_in_use(&mut io(&mut file)).unwrap_err().raw_os_error(), Some(libc::EROFS));
}

/// Every write and flush a store makes, to replay up to a crash.
struct Recorder {
    file: MemFile,
    /// Writes in order; `None` for a flush.
    ops: Vec<Option<(u64, Vec<u8>)>>,
}

impl SyncIo for Recorder {
    fn read_at(&mut self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.file.read_at(buf, offset)
    }

    fn write_at(&mut self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.ops.push(Some((offset, buf.to_vec())));
        self.file.write_at(buf, offset)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.ops.push(None);
        Ok(())
    }

    fn discard(&mut self, _: u64, _: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// A crash after any flush of a store (what was written before it
/// durable, nothing after) leaves either the old bitmaps or the new ones,
/// and no corruption: at worst leaked clusters.
#[test]
fn bitmaps_store_cut_short_by_a_crash_leaves_old_or_new() {
    let dir = Scratch::new("bitmaps-crash");
    let img = dir.path("a.qcow2");
    create(&img, "cluster_size=4096", DISK);
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k", "write -q 30M 4k"]);
    let (image, file) = open(&img, true, true).unwrap();
    let original = file.bytes.clone();
    let mut recorder = Recorder { file, ops: Vec::new() };
    let mut rio = ImageIo { meta: &mut recorder, data: None, backing: None };
    let old = image.load_bitmaps(&mut rio).unwrap();
    let mut a = old[0].clone();
    a.words[1500] = 0xff;
    let new = [named("n", false, pattern(4096, 9)), a];
    image.store_bitmaps(&mut rio, &new).unwrap();

    let crash = dir.path("crash.qcow2");
    let cuts = recorder.ops.iter().enumerate().filter(|(_, op)| op.is_none()).map(|(i, _)| i);
    let mut seen = BTreeSet::new();
    for cut in std::iter::once(0).chain(cuts) {
        let mut file = MemFile::new(original.clone(), 256 * MIB);
        for (offset, bytes) in recorder.ops[..cut].iter().flatten() {
            file.write_at(bytes, *offset).unwrap();
        }
        save(&file, &crash);
        let status = Command::new("qemu-img").args(["check", "-q", &crash]).output().unwrap().status;
        assert!(matches!(status.code(), Some(0 | 3)), "cut at {cut}: corruption ({status})");
        let names: Vec<_> = qemu_bitmaps(&crash).into_iter().map(|(name, ..)| name).collect();
        let state = if names == ["a"] { &old[..] } else { &new[..] };
        for b in state {
            assert_eq!(qemu_dirty_ranges(&crash, &b.name), dirty_ranges(b, DISK), "cut at {cut}: {names:?}");
        }
        seen.insert(names);
    }
    assert_eq!(seen.len(), 2, "both states were seen: {seen:?}");
}

/// A store that fails (the file cannot grow) gives its clusters back and
/// leaves the old bitmaps in place.
#[test]
fn bitmaps_store_that_fails_leaves_no_trace() {
    let dir = Scratch::new("bitmaps-enospc");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k"]);
    let bytes = std::fs::read(&img).unwrap();
    let mut file = MemFile::new(bytes.clone(), bytes.len() as u64 + 2 * 65536);
    let len = bytes.len() as u64;
    let opts = Options { writable: true, keep_bitmaps: true, ..Options::default() };
    let image = Image::open(&mut file, len, opts).unwrap();
    let big = [named("x", true, pattern(65536, 1)), named("y", true, pattern(65536, 2))];
    let err = image.store_bitmaps(&mut io(&mut file), &big).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::StorageFull);
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_check_clean(&img);
    assert_eq!(qemu_bitmaps(&img), [("a".into(), 65536, vec!["auto".to_string()])]);
    assert_eq!(qemu_dirty_ranges(&img, "a"), [(0, 64 * KIB)]);
}

/// Marked in use and never stored back (a crash): QEMU and vsd both see
/// the bitmap as in use; stored in use again, it keeps its table; stored
/// consistent, its new bits are what QEMU reads.
#[test]
fn bitmaps_marked_in_use_survive_a_crash_as_inconsistent() {
    let dir = Scratch::new("bitmaps-in-use");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_io(&img, &["write -q 1M 64k"]);

    let (image, mut file) = open(&img, true, true).unwrap();
    let before = image.load_bitmaps(&mut io(&mut file)).unwrap();
    image.mark_bitmaps_in_use(&mut io(&mut file)).unwrap();
    image.mark_bitmaps_in_use(&mut io(&mut file)).unwrap(); // nothing left to mark
    save(&file, &img); // no store, no close: a crash
    let in_use = || vec!["in-use".to_string(), "auto".to_string()];
    assert_eq!(qemu_bitmaps(&img), [("a".into(), 65536, in_use())]);
    assert_check_clean(&img);

    let (image, mut file) = open(&img, true, true).unwrap();
    let loaded = image.load_bitmaps(&mut io(&mut file)).unwrap();
    assert!(loaded[0].in_use && loaded[0].enabled && loaded[0].words.is_empty(), "{loaded:?}");
    image.store_bitmaps(&mut io(&mut file), &loaded).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_eq!(qemu_bitmaps(&img), [("a".into(), 65536, in_use())]);
    assert_check_clean(&img);

    let (image, mut file) = open(&img, true, true).unwrap();
    image.store_bitmaps(&mut io(&mut file), &before).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_eq!(qemu_bitmaps(&img), [("a".into(), 65536, vec!["auto".to_string()])]);
    assert_eq!(qemu_dirty_ranges(&img, "a"), [(MIB, 64 * KIB)]);
    assert_check_clean(&img);
}

/// Without `keep_bitmaps`, opening writable drops the bitmaps as before
/// (autoclear bit 0 cleared, QEMU ignores them); with it, they stay valid
/// through guest writes even if never stored.
#[test]
fn bitmaps_are_kept_only_when_the_caller_keeps_them() {
    let dir = Scratch::new("bitmaps-keep");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k"]);
    let original = std::fs::read(&img).unwrap();
    let fill = |_, buf: &mut [u8]| buf.fill(1);

    let (image, mut file) = open(&img, true, true).unwrap();
    image.write(&mut io(&mut file), 8 * MIB, 64 * KIB, &mut { fill }).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert!(bitmaps_bit(&file.bytes));
    assert_eq!(qemu_dirty_ranges(&img, "a"), [(0, 64 * KIB)]);
    assert_check_clean(&img);

    std::fs::write(&img, &original).unwrap();
    let (image, mut file) = open(&img, true, false).unwrap();
    assert!(image.load_bitmaps(&mut io(&mut file)).unwrap().is_empty());
    image.write(&mut io(&mut file), 8 * MIB, 64 * KIB, &mut { fill }).unwrap();
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert!(!bitmaps_bit(&file.bytes));
    assert!(qemu_bitmaps(&img).is_empty(), "QEMU ignores stale bitmaps");
    let (image, mut file) = open(&img, false, false).unwrap();
    assert!(image.load_bitmaps(&mut io(&mut file)).unwrap().is_empty(), "and so does vsd");
}

/// Dropping the bitmaps (clearing autoclear bit 0) is durable before the
/// open returns, so no guest write can reach the disk while the bitmaps
/// still look consistent.
#[test]
fn bitmaps_dropped_at_open_are_dropped_durably() {
    let dir = Scratch::new("bitmaps-drop");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    let bytes = std::fs::read(&img).unwrap();
    let mut recorder = Recorder { file: MemFile::new(bytes.clone(), 256 * MIB), ops: Vec::new() };
    let opts = Options { writable: true, ..Options::default() };
    Image::open(&mut recorder, bytes.len() as u64, opts).unwrap();
    assert!(
        matches!(&recorder.ops[..], [Some((0, header)), None] if !bitmaps_bit(header)),
        "{} writes and flushes",
        recorder.ops.len()
    );
}

/// Sets the dirty bit (lazy refcounts, then a crash) and zeroes every
/// refcount, so that opening writable must rebuild them all.
fn crash_with_lazy_refcounts(path: &str) {
    let mut bytes = std::fs::read(path).unwrap();
    let incompatible = be64(&bytes, 72);
    put64(&mut bytes, 72, incompatible | 1);
    let (table, cs) = (be64(&bytes, 48) as usize, 1usize << be32(&bytes, 20));
    let block = be64(&bytes, table) as usize;
    bytes[block..block + cs].fill(0);
    std::fs::write(path, &bytes).unwrap();
}

/// A refcount rebuild counts the bitmaps' clusters: QEMU finds the image
/// clean afterwards, and new allocations never land on them.
#[test]
fn bitmaps_survive_a_refcount_rebuild() {
    let dir = Scratch::new("bitmaps-rebuild");
    let img = dir.path("a.qcow2");
    create(&img, "lazy_refcounts=on,cluster_size=4096", DISK);
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k", "write -q 20M 64k", "write -q 40M 64k"]);
    crash_with_lazy_refcounts(&img);

    let (image, mut file) = open(&img, true, true).unwrap();
    let a = image.load_bitmaps(&mut io(&mut file)).unwrap().remove(0);
    let fill = |_, buf: &mut [u8]| buf.fill(7);
    for at in (0..DISK).step_by(MIB as usize) {
        image.write(&mut io(&mut file), at + 128 * KIB, 8 * KIB, &mut { fill }).unwrap();
    }
    image.close(&mut io(&mut file)).unwrap();
    save(&file, &img);
    assert_check_clean(&img);
    assert_eq!(qemu_dirty_ranges(&img, "a"), dirty_ranges(&a, DISK));
    assert_eq!(dirty_ranges(&a, DISK), [(0, 64 * KIB), (20 * MIB, 64 * KIB), (40 * MIB, 64 * KIB)]);
}

/// An L2 entry pointing at a bitmap's data cluster is corrupt: guest
/// reads and writes there fail rather than expose or overwrite it.
#[test]
fn bitmaps_clusters_are_metadata_to_the_overlap_checks() {
    let dir = Scratch::new("bitmaps-overlap");
    let img = dir.path("a.qcow2");
    create(&img, "", DISK);
    qemu_img(&["bitmap", "--add", &img, "a"]);
    qemu_io(&img, &["write -q 0 64k"]);
    let mut bytes = std::fs::read(&img).unwrap();
    let data = be64(&bytes, be64(&bytes, directory_offset(&bytes)) as usize);
    let l2 = (be64(&bytes, be64(&bytes, 40) as usize) & 0x00ff_ffff_ffff_fe00) as usize;
    put64(&mut bytes, l2, data | 1 << 63);
    std::fs::write(&img, &bytes).unwrap();

    let (image, mut file) = open(&img, true, true).unwrap();
    let mapping = image.map(&mut Default::default(), &mut file, 0, 512).unwrap().mapping;
    assert_eq!(mapping, Mapping::Invalid);
    let fill = |_, buf: &mut [u8]| buf.fill(7);
    assert!(image.write(&mut io(&mut file), 0, 4096, &mut { fill }).is_err());
    assert_eq!(be64(&file.bytes, data as usize), be64(&bytes, data as usize), "the bitmap is untouched");
}

/// A qemu-img image with two bitmaps ("a" with data over four table
/// entries, "b" empty), 4 KiB clusters, and where its metadata is.
struct Victim {
    bytes: Vec<u8>,
    ext: usize,
    dir: usize,
    /// Directory entry of "b".
    second: usize,
    table: usize,
}

fn victim(dir: &Scratch) -> Victim {
    let img = dir.path("victim.qcow2");
    create(&img, "cluster_size=4096", DISK);
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "a"]);
    qemu_img(&["bitmap", "--add", &img, "b"]);
    qemu_io(&img, &["write -q 0 4k", "write -q 20M 4k"]);
    let bytes = std::fs::read(&img).unwrap();
    let (ext, dir) = (bitmaps_extension_at(&bytes).unwrap(), directory_offset(&bytes));
    let table = be64(&bytes, dir) as usize;
    Victim { ext, dir, second: dir + 32, table, bytes }
}

/// The first error opening or loading bitmaps from `bytes` gives, read-only
/// and writable keeping bitmaps. Damage the header parse does not see must
/// not matter writable without keeping bitmaps: they are dropped unread.
fn errors(bytes: &[u8], dir: &Scratch) -> (String, String) {
    let path = dir.path("damaged.qcow2");
    std::fs::write(&path, bytes).unwrap();
    let first_error = |writable, keep| match open(&path, writable, keep) {
        Err(e) => e.to_string(),
        Ok((image, mut file)) => {
            image.load_bitmaps(&mut io(&mut file)).map(|_| String::new()).unwrap_or_else(|e| e.to_string())
        }
    };
    if open(&path, false, false).is_ok() {
        let (image, mut file) = open(&path, true, false).expect("bitmaps not kept are not read");
        assert!(image.load_bitmaps(&mut io(&mut file)).unwrap().is_empty());
    }
    (first_error(false, false), first_error(true, true))
}

/// Damaged bitmap metadata, as a fuzzer or an attacker would make it.
#[test]
fn bitmaps_damaged_are_refused_with_an_error() {
    let dir = Scratch::new("bitmaps-damaged");
    let v = victim(&dir);
    let (ext, d, second, table) = (v.ext, v.dir, v.second, v.table);
    let rt = be64(&v.bytes, 48);
    let l2 = be64(&v.bytes, be64(&v.bytes, 40) as usize) & 0x00ff_ffff_ffff_fe00;
    type Damage = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Damage, &str)> = vec![
        (
            "directory unaligned",
            Box::new(move |b| {
                let v = be64(b, ext + 16) + 8;
                put64(b, ext + 16, v)
            }),
            "not cluster aligned",
        ),
        ("directory past the end", Box::new(move |b| put64(b, ext + 16, 1 << 40)), "past the end"),
        ("no bitmaps", Box::new(move |b| put32(b, ext, 0)), "0 bitmaps"),
        ("too many bitmaps", Box::new(move |b| put32(b, ext, 65536)), "65536 bitmaps"),
        ("huge directory", Box::new(move |b| put64(b, ext + 8, 65 * MIB)), "a bitmap directory of"),
        ("reserved field", Box::new(move |b| put32(b, ext + 4, 1)), "reserved"),
        ("one bitmap fewer", Box::new(move |b| put32(b, ext, 1)), "more than the 1"),
        ("one bitmap more", Box::new(move |b| put32(b, ext, 3)), "2 entries where"),
        ("duplicate names", Box::new(move |b| b[second + 24] = b'a'), "two bitmaps named 'a'"),
        ("granularity", Box::new(move |b| b[d + 17] = 40), "granularity bits 40"),
        ("type", Box::new(move |b| b[d + 16] = 0), "bitmap type 0"),
        ("flags", Box::new(move |b| b[d + 15] |= 8), "unknown flags"),
        ("extra data", Box::new(move |b| put32(b, d + 20, 8)), "extra data"),
        ("long name", Box::new(move |b| b[d + 18..d + 20].copy_from_slice(&2000u16.to_be_bytes())), "a name of 2000"),
        ("table size", Box::new(move |b| put32(b, d + 8, 5)), "needs 4"),
        ("empty table", Box::new(move |b| put32(b, d + 8, 0)), "a table of 0"),
        ("table unaligned", Box::new(move |b| put64(b, d, table as u64 + 512)), "unaligned"),
        ("table past the end", Box::new(move |b| put64(b, d, 1 << 40)), "past the end"),
        (
            "entry reserved bits",
            Box::new(move |b| {
                let v = be64(b, table) | 2;
                put64(b, table, v)
            }),
            "invalid bitmap table entry",
        ),
        (
            "entry unaligned",
            Box::new(move |b| {
                let v = be64(b, table) + 512;
                put64(b, table, v)
            }),
            "invalid bitmap table entry",
        ),
        ("entry past the end", Box::new(move |b| put64(b, table, 1 << 40)), "past the end"),
        (
            "shared table",
            Box::new(move |b| {
                let v = be64(b, d);
                put64(b, second, v)
            }),
            "bitmap tables overlap",
        ),
        ("table in the directory", Box::new(move |b| put64(b, second, d as u64)), "bitmap tables overlap"),
    ];
    for (what, damage, want) in cases {
        let mut bytes = v.bytes.clone();
        damage(&mut bytes);
        let (read_only, kept) = errors(&bytes, &dir);
        assert!(read_only.contains(want), "{what}: read-only: '{read_only}'");
        assert!(kept.contains(want), "{what}: writable: '{kept}'");
    }

    // Well-formed, but sharing clusters: storing would free them in use.
    let shared: Vec<(&str, Damage, &str)> = vec![
        ("table over the refcount table", Box::new(move |b| put64(b, d, rt)), "also other metadata"),
        ("data in an L2 table", Box::new(move |b| put64(b, table + 8, l2)), "into other metadata"),
        (
            "one data cluster twice",
            Box::new(move |b| {
                let v = be64(b, table);
                put64(b, table + 8, v)
            }),
            "used twice",
        ),
        ("data in the directory", Box::new(move |b| put64(b, table + 8, d as u64)), "used twice"),
    ];
    for (what, damage, want) in shared {
        let mut bytes = v.bytes.clone();
        damage(&mut bytes);
        let (_, kept) = errors(&bytes, &dir);
        assert!(kept.contains(want), "{what}: '{kept}'");
    }
}

// Helpers.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use vsd_qcow2::mem::MemFile;
use vsd_qcow2::{Image, ImageIo, Options, SyncIo};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// A directory of its own for one test, removed afterwards.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("vsd-qcow2-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a program that must succeed; returns its stdout and stderr.
fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "`{program} {}` failed ({}): {text}", args.join(" "), out.status);
    text
}

fn qemu_img(args: &[&str]) -> String {
    run("qemu-img", args)
}

/// Runs qemu-io commands on a qcow2 image, in one process.
fn qemu_io(image: &str, commands: &[&str]) {
    let mut args = vec!["-f", "qcow2"];
    for c in commands {
        args.extend(["-c", c]);
    }
    args.push(image);
    let text = run("qemu-io", &args);
    assert!(!text.contains("failed") && !text.to_lowercase().contains("error"), "qemu-io: {text}");
}

/// A new qcow2 image of `size` with `opts` (qemu-img create -o).
fn create(path: &str, opts: &str, size: u64) {
    let size = size.to_string();
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    if !opts.is_empty() {
        args.extend(["-o", opts]);
    }
    qemu_img(&[&args[..], &[path, &size]].concat());
}

/// `qemu-img check` finds no corruption and no leak.
fn assert_check_clean(path: &str) {
    let out = Command::new("qemu-img").args(["check", path]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("No errors were found"),
        "qemu-img check {path}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The bitmaps `qemu-img info` lists: (name, granularity, flags).
fn qemu_bitmaps(path: &str) -> Vec<(String, u64, Vec<String>)> {
    let info = qemu_img(&["info", "--output=json", path]);
    // A small scan of the JSON rather than a parser dependency: the
    // bitmaps array lists objects with "flags", "name" and "granularity".
    let Some(start) = info.find("\"bitmaps\": [") else { return Vec::new() };
    let list = &info[start..start + info[start..].find("\n            ]").unwrap()];
    list.split("\n                {")
        .skip(1)
        .map(|obj| {
            let field = |key: &str| {
                let at = obj.find(&format!("\"{key}\": ")).unwrap() + key.len() + 4;
                obj[at..].split([',', '\n']).next().unwrap().trim().trim_matches('"').to_string()
            };
            let flags_at = obj.find('[').unwrap();
            let flags_end = obj.find(']').unwrap();
            let flags = obj[flags_at + 1..flags_end]
                .split(',')
                .map(|f| f.trim().trim_matches('"').to_string())
                .filter(|f| !f.is_empty())
                .collect();
            (field("name"), field("granularity").parse().unwrap(), flags)
        })
        .collect()
}

/// The dirty ranges QEMU reads from bitmap `name`, through qemu-nbd and
/// `nbdinfo --map=qemu:dirty-bitmap:NAME`.
fn qemu_dirty_ranges(path: &str, name: &str) -> Vec<(u64, u64)> {
    let map = format!("--map=qemu:dirty-bitmap:{name}");
    let out = run("nbdinfo", &[&map, "--", "[", "qemu-nbd", "-r", "-f", "qcow2", "-B", name, path, "]"]);
    out.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() >= 3 && f[2] == "1").then(|| (f[0].parse().unwrap(), f[1].parse().unwrap()))
        })
        .collect()
}

/// The dirty ranges of a bitmap of a disk of `disk_size` bytes, merged.
fn dirty_ranges(b: &StoredBitmap, disk_size: u64) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for i in 0..disk_size.div_ceil(b.granularity) {
        if !b.get(i) {
            continue;
        }
        let (start, end) = (i * b.granularity, ((i + 1) * b.granularity).min(disk_size));
        match ranges.last_mut() {
            Some((s, len)) if *s + *len == start => *len = end - *s,
            _ => ranges.push((start, end - start)),
        }
    }
    ranges
}

/// The indices of a bitmap's set bits.
fn set_bits(b: &StoredBitmap) -> Vec<u64> {
    (0..b.words.len() as u64 * 64).filter(|&i| b.get(i)).collect()
}

/// Opens an image file into memory.
fn open(path: &str, writable: bool, keep_bitmaps: bool) -> Result<(Image, MemFile), vsd_qcow2::FormatError> {
    let mut file = MemFile::new(std::fs::read(path).unwrap(), 256 * MIB);
    let len = file.bytes.len() as u64;
    let opts = Options { writable, keep_bitmaps, has_backing: Some(false), ..Options::default() };
    Image::open(&mut file, len, opts).map(|image| (image, file))
}

fn io(file: &mut MemFile) -> ImageIo<'_> {
    ImageIo { meta: file, data: None, backing: None }
}

/// Writes an in-memory image back to its file.
fn save(file: &MemFile, path: impl AsRef<Path>) {
    std::fs::write(path, &file.bytes).unwrap();
}

fn be32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn be64(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn put32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Where the bitmaps extension's data is in the header, if present.
fn bitmaps_extension_at(bytes: &[u8]) -> Option<usize> {
    let mut at = be32(bytes, 100) as usize;
    loop {
        let (kind, len) = (be32(bytes, at), be32(bytes, at + 4) as usize);
        match kind {
            0 => return None,
            0x2385_2875 => return Some(at + 8),
            _ => at += 8 + len.next_multiple_of(8),
        }
    }
}

/// The bitmap directory's offset.
fn directory_offset(bytes: &[u8]) -> usize {
    be64(bytes, bitmaps_extension_at(bytes).expect("a bitmaps extension") + 16) as usize
}

/// Autoclear bit 0: the bitmaps are consistent.
fn bitmaps_bit(bytes: &[u8]) -> bool {
    be64(bytes, 88) & 1 != 0
}
