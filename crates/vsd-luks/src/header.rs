//! The LUKS1 header: 592 big-endian bytes at the image's start, checked as
//! QEMU checks it.

use crate::cipher::{SECTOR_SIZE, SectorCipher, Spec};
use crate::{Result, SecretBuf, afsplit, err};

const MAGIC: &[u8; 6] = b"LUKS\xba\xbe";
const SLOTS: usize = 8;
const STRIPES: u32 = 4000;
const SLOT_ENABLED: u32 = 0x00ac_71f3;
const SLOT_DISABLED: u32 = 0x0000_dead;
const DIGEST_LEN: usize = 20;
/// Key material starts at or after 4 KiB and is laid out in 4 KiB units.
const HEADER_SECTORS: u64 = 4096 / SECTOR_SIZE as u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySlot {
    pub active: u32,
    pub iterations: u32,
    pub salt: [u8; 32],
    pub key_offset: u32,
    pub stripes: u32,
}

impl KeySlot {
    pub fn is_enabled(&self) -> bool {
        self.active == SLOT_ENABLED
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_LEN],
    pub mk_salt: [u8; 32],
    pub mk_iterations: u32,
    pub uuid: String,
    pub key_slots: [KeySlot; SLOTS],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn text(b: &[u8], what: &str) -> Result<String> {
    match b.iter().position(|&c| c == 0) {
        Some(end) => Ok(String::from_utf8_lossy(&b[..end]).into_owned()),
        None => err(format!("LUKS header {what} is not NUL terminated")),
    }
}

impl Header {
    pub const LEN: usize = 592;

    /// Parses and checks `head` (at least `LEN` bytes) of an image of
    /// `image_len` bytes, and checks that its algorithms are supported.
    pub fn parse(head: &[u8], image_len: u64) -> Result<Header> {
        if head.len() < Header::LEN || &head[..6] != MAGIC {
            return err("Volume is not in LUKS format");
        }
        let version = u16::from_be_bytes([head[6], head[7]]);
        if version != 1 {
            return err(format!("LUKS version {version} is not supported"));
        }
        let slot = |i: usize| {
            let s = &head[208 + 48 * i..208 + 48 * (i + 1)];
            KeySlot {
                active: be32(s, 0),
                iterations: be32(s, 4),
                salt: s[8..40].try_into().expect("32 bytes"),
                key_offset: be32(s, 40),
                stripes: be32(s, 44),
            }
        };
        let header = Header {
            cipher_name: text(&head[8..40], "cipher name")?,
            cipher_mode: text(&head[40..72], "cipher mode")?,
            hash_spec: text(&head[72..104], "hash spec")?,
            payload_offset: be32(head, 104),
            key_bytes: be32(head, 108),
            mk_digest: head[112..132].try_into().expect("20 bytes"),
            mk_salt: head[132..164].try_into().expect("32 bytes"),
            mk_iterations: be32(head, 164),
            uuid: String::from_utf8_lossy(&head[168..208]).trim_end_matches('\0').to_owned(),
            key_slots: std::array::from_fn(slot),
        };
        header.check_slots()?;
        header.spec()?;
        if header.mk_iterations == 0 {
            return err("LUKS master key iterations is zero");
        }
        if header.payload_offset_bytes() > image_len {
            return err(format!(
                "LUKS payload offset {} is past the end of the image ({image_len} bytes)",
                header.payload_offset_bytes()
            ));
        }
        Ok(header)
    }

    /// The sectors a slot's key material spans, rounded to 4 KiB as QEMU lays it out.
    fn slot_sectors(&self, slot: &KeySlot) -> u64 {
        let bytes = u64::from(self.key_bytes) * u64::from(slot.stripes);
        bytes.div_ceil(SECTOR_SIZE as u64).next_multiple_of(HEADER_SECTORS)
    }

    fn check_slots(&self) -> Result<()> {
        let span = |s: &KeySlot| {
            let start = u64::from(s.key_offset);
            (start, start + self.slot_sectors(s))
        };
        for (i, slot) in self.key_slots.iter().enumerate() {
            if slot.stripes != STRIPES {
                return err(format!("Keyslot {i} is corrupted (stripes {} != {STRIPES})", slot.stripes));
            }
            if slot.active != SLOT_ENABLED && slot.active != SLOT_DISABLED {
                return err(format!("Keyslot {i} state (active/disable) is corrupted"));
            }
            if slot.is_enabled() && slot.iterations == 0 {
                return err(format!("Keyslot {i} is enabled with zero iterations"));
            }
            let (start, end) = span(slot);
            if start < HEADER_SECTORS {
                return err(format!("Keyslot {i} is overlapping with the LUKS header"));
            }
            if end > u64::from(self.payload_offset) {
                return err(format!("Keyslot {i} is overlapping with the encrypted payload"));
            }
            for (j, other) in self.key_slots.iter().enumerate().skip(i + 1) {
                let (other_start, other_end) = span(other);
                if start < other_end && other_start < end {
                    return err(format!("Keyslots {i} and {j} are overlapping in the header"));
                }
            }
        }
        Ok(())
    }

    /// The algorithms the header names, or QEMU's refusal.
    pub fn spec(&self) -> Result<Spec> {
        Spec::parse(&self.cipher_name, &self.cipher_mode, &self.hash_spec, self.key_bytes)
    }

    pub fn payload_offset_bytes(&self) -> u64 {
        u64::from(self.payload_offset) * SECTOR_SIZE as u64
    }

    /// The master key if `passphrase` opens `slot`, whose encrypted key
    /// material is `material` (decrypted in place).
    pub(crate) fn try_slot(
        &self,
        spec: &Spec,
        slot: &KeySlot,
        passphrase: &[u8],
        material: &mut [u8],
    ) -> Result<Option<SecretBuf>> {
        let mut slot_key = SecretBuf::zeroed(spec.key_len);
        spec.hash.pbkdf2(passphrase, &slot.salt, slot.iterations, &mut slot_key);
        SectorCipher::new(spec, &slot_key)?.decrypt(0, material);
        let mut master = SecretBuf::zeroed(spec.key_len);
        afsplit::merge(spec.hash, material, &mut master);
        let mut digest = [0u8; DIGEST_LEN];
        spec.hash.pbkdf2(&master, &self.mk_salt, self.mk_iterations, &mut digest);
        Ok((digest == self.mk_digest).then_some(master))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{HashAlg, Volume};

    const PASS: &[u8] = b"correct horse";
    const KEY_LEN: usize = 32;
    const PAYLOAD_SECTORS: u32 = 4096;

    fn put32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }

    /// A LUKS1 image (aes-xts-plain64, sha256, key slot 0 enabled) of
    /// `PAYLOAD_SECTORS` header sectors and 8 payload sectors, laid out as
    /// QEMU lays it out; and its master key.
    pub fn image() -> (Vec<u8>, Vec<u8>) {
        let master: Vec<u8> = (100..100 + KEY_LEN as u8).collect();
        let mut img = vec![0u8; (PAYLOAD_SECTORS as usize + 8) * SECTOR_SIZE];
        img[..6].copy_from_slice(MAGIC);
        img[7] = 1;
        img[8..11].copy_from_slice(b"aes");
        img[40..51].copy_from_slice(b"xts-plain64");
        img[72..78].copy_from_slice(b"sha256");
        put32(&mut img, 104, PAYLOAD_SECTORS);
        put32(&mut img, 108, KEY_LEN as u32);
        img[132..164].fill(7);
        put32(&mut img, 164, 10);
        let mut digest = [0u8; DIGEST_LEN];
        HashAlg::Sha256.pbkdf2(&master, &[7; 32], 10, &mut digest);
        img[112..132].copy_from_slice(&digest);
        let material_sectors = (KEY_LEN * STRIPES as usize).div_ceil(SECTOR_SIZE).next_multiple_of(8);
        for i in 0..SLOTS {
            let at = 208 + 48 * i;
            put32(&mut img, at, if i == 0 { SLOT_ENABLED } else { SLOT_DISABLED });
            put32(&mut img, at + 4, 10);
            img[at + 8..at + 40].fill(i as u8);
            put32(&mut img, at + 40, (8 + i * material_sectors) as u32);
            put32(&mut img, at + 44, STRIPES);
        }
        let spec = Spec::parse("aes", "xts-plain64", "sha256", KEY_LEN as u32).unwrap();
        let mut slot_key = [0u8; KEY_LEN];
        HashAlg::Sha256.pbkdf2(PASS, &[0; 32], 10, &mut slot_key);
        let mut material = vec![0u8; KEY_LEN * STRIPES as usize];
        let random: Vec<u8> = (0..material.len()).map(|i| (i * 31 % 256) as u8).collect();
        afsplit::split(HashAlg::Sha256, &master, &random, &mut material);
        SectorCipher::new(&spec, &slot_key).unwrap().encrypt(0, &mut material);
        img[8 * SECTOR_SIZE..8 * SECTOR_SIZE + material.len()].copy_from_slice(&material);
        (img, master)
    }

    fn open(img: &[u8], pass: &[u8]) -> Result<Volume> {
        Volume::open(&img[..Header::LEN], img.len() as u64, pass, |at, buf| {
            let at = at as usize;
            match img.get(at..at + buf.len()) {
                Some(src) => {
                    buf.copy_from_slice(src);
                    Ok(())
                }
                None => Err(std::io::ErrorKind::UnexpectedEof.into()),
            }
        })
    }

    #[test]
    fn opens_with_the_right_passphrase_only() {
        let (img, master) = image();
        let volume = open(&img, PASS).unwrap();
        assert_eq!(volume.payload_offset(), u64::from(PAYLOAD_SECTORS) * 512);
        assert_eq!(volume.header.cipher_mode, "xts-plain64");
        let spec = volume.header.spec().unwrap();
        let mut data = vec![0x5au8; 1024];
        SectorCipher::new(&spec, &master).unwrap().encrypt(3, &mut data);
        volume.cipher.decrypt(3, &mut data);
        assert!(data.iter().all(|&b| b == 0x5a), "the unlocked key is the master key");
        let wrong = open(&img, b"wrong").err().unwrap();
        assert_eq!(wrong.0, "Invalid password, cannot unlock any keyslot");
    }

    /// Damages a copy of a good header and expects QEMU's error, never a panic.
    fn damaged(edit: impl Fn(&mut Vec<u8>)) -> String {
        let (mut img, _) = image();
        edit(&mut img);
        let len = img.len() as u64;
        Header::parse(&img, len).unwrap_err().0
    }

    #[test]
    fn damaged_headers_give_qemus_errors() {
        let slot = |i: usize, field: usize| 208 + 48 * i + field;
        type Edit = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("Volume is not in LUKS format", Box::new(|b| b[0] = b'X')),
            ("Volume is not in LUKS format", Box::new(|b| b.truncate(100))),
            ("LUKS version 2 is not supported", Box::new(|b| b[7] = 2)),
            ("LUKS header cipher name is not NUL terminated", Box::new(|b| b[8..40].fill(b'a'))),
            ("LUKS header hash spec is not NUL terminated", Box::new(|b| b[72..104].fill(b'a'))),
            ("Keyslot 3 is corrupted (stripes 1 != 4000)", Box::new(move |b| put32(b, slot(3, 44), 1))),
            ("Keyslot 0 is corrupted (stripes 0 != 4000)", Box::new(move |b| put32(b, slot(0, 44), 0))),
            ("Keyslot 2 state (active/disable) is corrupted", Box::new(move |b| put32(b, slot(2, 0), 1))),
            ("Keyslot 0 is enabled with zero iterations", Box::new(move |b| put32(b, slot(0, 4), 0))),
            ("Keyslot 0 is overlapping with the LUKS header", Box::new(move |b| put32(b, slot(0, 40), 1))),
            ("Keyslots 0 and 1 are overlapping in the header", Box::new(move |b| put32(b, slot(1, 40), 100))),
            ("Keyslot 7 is overlapping with the encrypted payload", Box::new(move |b| put32(b, slot(7, 40), 4090))),
            ("Keyslot 7 is overlapping with the encrypted payload", Box::new(move |b| put32(b, slot(7, 40), u32::MAX))),
            ("Keyslot 0 is overlapping with the encrypted payload", Box::new(|b| put32(b, 108, u32::MAX))),
            ("Keyslot 0 is overlapping with the encrypted payload", Box::new(|b| put32(b, 104, 100))),
            ("LUKS master key iterations is zero", Box::new(|b| put32(b, 164, 0))),
            ("Algorithm 'aes' with key size 20 bytes not supported", Box::new(|b| put32(b, 108, 20))),
            ("Cipher mode 'ecb' not supported", Box::new(|b| b[40..43].copy_from_slice(b"ecb"))),
            ("hash algorithm 'md5' not supported", Box::new(|b| b[72..79].copy_from_slice(b"md5\0\0\0\0"))),
        ];
        for (want, edit) in cases {
            assert_eq!(damaged(edit), want);
        }
    }

    #[test]
    fn payload_past_the_end_is_refused() {
        let (img, _) = image();
        let err = Header::parse(&img[..Header::LEN], 4096).unwrap_err().0;
        assert_eq!(err, "LUKS payload offset 2097152 is past the end of the image (4096 bytes)");
    }

    #[test]
    fn any_iteration_count_parses_without_overflow() {
        let (mut img, _) = image();
        for at in [208 + 4, 208 + 48 + 4, 164] {
            put32(&mut img, at, u32::MAX);
        }
        let header = Header::parse(&img, img.len() as u64).unwrap();
        assert_eq!(header.key_slots[0].iterations, u32::MAX);
        assert_eq!(header.mk_iterations, u32::MAX);
    }
}
