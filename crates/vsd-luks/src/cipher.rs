//! The payload's sector cipher: AES in XTS or CBC, with LUKS's IV generators.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes128, Aes192, Aes256, Block};

use crate::{HashAlg, Result, SecretBuf, err};

/// LUKS1 encrypts in 512-byte sectors whatever the device's block size.
pub const SECTOR_SIZE: usize = 512;
const BLOCKS_PER_SECTOR: usize = SECTOR_SIZE / 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Xts,
    Cbc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IvGen {
    Plain,
    Plain64,
    Essiv(HashAlg),
}

/// What a header names: the key length is that of the whole cipher key
/// (both halves for XTS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub key_len: usize,
    pub mode: Mode,
    pub ivgen: IvGen,
    pub hash: HashAlg,
}

impl Spec {
    /// From the header's cipher name, cipher mode (`xts-plain64`,
    /// `cbc-essiv:sha256`), hash spec and key length.
    pub fn parse(name: &str, mode: &str, hash: &str, key_len: u32) -> Result<Spec> {
        let Some((mode, ivgen)) = mode.split_once('-') else {
            return err(format!("Unexpected cipher mode string format {mode}"));
        };
        let (ivgen, ivhash) = match ivgen.split_once(':') {
            Some((ivgen, ivhash)) => (ivgen, Some(HashAlg::parse(ivhash)?)),
            None => (ivgen, None),
        };
        let mode = match mode {
            "xts" => Mode::Xts,
            "cbc" => Mode::Cbc,
            _ => return err(format!("Cipher mode '{mode}' not supported")),
        };
        let aes_key = if mode == Mode::Xts { key_len / 2 } else { key_len };
        if name != "aes" || ![16, 24, 32].contains(&aes_key) || (mode == Mode::Xts && !key_len.is_multiple_of(2)) {
            return err(format!("Algorithm '{name}' with key size {key_len} bytes not supported"));
        }
        let hash = HashAlg::parse(hash)?;
        let ivgen = match ivgen {
            "plain" => IvGen::Plain,
            "plain64" => IvGen::Plain64,
            "essiv" => {
                let ivhash = ivhash.ok_or_else(|| crate::Error("Missing IV generator hash specification".into()))?;
                if ![16, 24, 32].contains(&ivhash.digest_len()) {
                    return err(format!("No AES cipher with key size {} available", ivhash.digest_len()));
                }
                IvGen::Essiv(ivhash)
            }
            _ => return err(format!("IV generator '{ivgen}' not supported")),
        };
        Ok(Spec { key_len: key_len as usize, mode, ivgen, hash })
    }
}

/// AES of the key's size; the key schedules are zeroized on drop.
enum Aes {
    A128(Box<Aes128>),
    A192(Box<Aes192>),
    A256(Box<Aes256>),
}

impl Aes {
    fn new(key: &[u8]) -> Aes {
        match key.len() {
            16 => Aes::A128(Box::new(Aes128::new_from_slice(key).expect("16-byte key"))),
            24 => Aes::A192(Box::new(Aes192::new_from_slice(key).expect("24-byte key"))),
            _ => Aes::A256(Box::new(Aes256::new_from_slice(key).expect("32-byte key"))),
        }
    }

    fn encrypt(&self, blocks: &mut [Block]) {
        match self {
            Aes::A128(c) => c.encrypt_blocks(blocks),
            Aes::A192(c) => c.encrypt_blocks(blocks),
            Aes::A256(c) => c.encrypt_blocks(blocks),
        }
    }

    fn decrypt(&self, blocks: &mut [Block]) {
        match self {
            Aes::A128(c) => c.decrypt_blocks(blocks),
            Aes::A192(c) => c.decrypt_blocks(blocks),
            Aes::A256(c) => c.decrypt_blocks(blocks),
        }
    }
}

enum Engine {
    Xts { data: Aes, tweak: Aes },
    Cbc(Aes),
}

/// Encrypts and decrypts whole 512-byte sectors numbered from the payload's start.
pub struct SectorCipher {
    engine: Engine,
    essiv: Option<Aes>,
    plain32: bool,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SectorCipher")
    }
}

fn blocks(buf: &mut [u8]) -> &mut [Block] {
    let (blocks, rest) = Array::slice_as_chunks_mut(buf);
    debug_assert!(rest.is_empty());
    blocks
}

fn xor(block: &mut Block, with: &Block) {
    block.iter_mut().zip(with.iter()).for_each(|(b, w)| *b ^= w);
}

/// Multiplies an XTS tweak by the primitive element of GF(2^128).
fn next_tweak(tweak: &mut Block) {
    let t = u128::from_le_bytes(tweak.0);
    let t = (t << 1) ^ if t >> 127 == 1 { 0x87 } else { 0 };
    tweak.0 = t.to_le_bytes();
}

impl SectorCipher {
    pub fn new(spec: &Spec, key: &[u8]) -> Result<SectorCipher> {
        let engine = match spec.mode {
            Mode::Xts => {
                let (data, tweak) = key.split_at(key.len() / 2);
                Engine::Xts { data: Aes::new(data), tweak: Aes::new(tweak) }
            }
            Mode::Cbc => Engine::Cbc(Aes::new(key)),
        };
        let essiv = match spec.ivgen {
            IvGen::Essiv(hash) => {
                let mut salt = SecretBuf::zeroed(hash.digest_len());
                hash.digest(&[key], &mut salt);
                Some(Aes::new(&salt))
            }
            _ => None,
        };
        Ok(SectorCipher { engine, essiv, plain32: spec.ivgen == IvGen::Plain })
    }

    fn iv(&self, sector: u64) -> Block {
        let sector = if self.plain32 { sector & 0xffff_ffff } else { sector };
        let mut iv = Block::default();
        iv[..8].copy_from_slice(&sector.to_le_bytes());
        if let Some(essiv) = &self.essiv {
            essiv.encrypt(std::slice::from_mut(&mut iv));
        }
        iv
    }

    /// Encrypts `buf` (whole sectors) in place; its first sector is `sector`.
    pub fn encrypt(&self, sector: u64, buf: &mut [u8]) {
        for (n, chunk) in buf.chunks_exact_mut(SECTOR_SIZE).enumerate() {
            let iv = self.iv(sector + n as u64);
            let chunk = blocks(chunk);
            match &self.engine {
                Engine::Xts { data, tweak } => xts(data, tweak, iv, chunk, Aes::encrypt),
                Engine::Cbc(aes) => {
                    let mut prev = iv;
                    for block in chunk {
                        xor(block, &prev);
                        aes.encrypt(std::slice::from_mut(block));
                        prev = *block;
                    }
                }
            }
        }
    }

    /// Decrypts `buf` (whole sectors) in place; its first sector is `sector`.
    pub fn decrypt(&self, sector: u64, buf: &mut [u8]) {
        for (n, chunk) in buf.chunks_exact_mut(SECTOR_SIZE).enumerate() {
            let iv = self.iv(sector + n as u64);
            let chunk = blocks(chunk);
            match &self.engine {
                Engine::Xts { data, tweak } => xts(data, tweak, iv, chunk, Aes::decrypt),
                Engine::Cbc(aes) => {
                    // CBC decryption is parallel: all blocks at once, then
                    // each XORed with the ciphertext before it.
                    let mut before = [Block::default(); BLOCKS_PER_SECTOR];
                    before[0] = iv;
                    before[1..].copy_from_slice(&chunk[..BLOCKS_PER_SECTOR - 1]);
                    aes.decrypt(chunk);
                    chunk.iter_mut().zip(&before).for_each(|(b, p)| xor(b, p));
                }
            }
        }
    }
}

/// One XTS sector: tweak every block, run the whole sector through AES in
/// one call (which pipelines blocks), tweak again.
fn xts(data: &Aes, tweak: &Aes, iv: Block, chunk: &mut [Block], run: fn(&Aes, &mut [Block])) {
    let mut tweaks = [iv; BLOCKS_PER_SECTOR];
    tweak.encrypt(&mut tweaks[..1]);
    for i in 1..BLOCKS_PER_SECTOR {
        tweaks[i] = tweaks[i - 1];
        next_tweak(&mut tweaks[i]);
    }
    chunk.iter_mut().zip(&tweaks).for_each(|(b, t)| xor(b, t));
    run(data, chunk);
    chunk.iter_mut().zip(&tweaks).for_each(|(b, t)| xor(b, t));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mode: &str, key_len: u32) -> Spec {
        Spec::parse("aes", mode, "sha256", key_len).unwrap()
    }

    #[test]
    fn xts_matches_ieee_vector() {
        // IEEE 1619 XTS-AES-128 vector 1: zero keys, zero tweak, zero data.
        let cipher = SectorCipher::new(&spec("xts-plain64", 32), &[0; 32]).unwrap();
        let mut sector = [0u8; SECTOR_SIZE];
        cipher.encrypt(0, &mut sector);
        assert_eq!(sector[..8], [0x91, 0x7c, 0xf6, 0x9e, 0xbd, 0x68, 0xb2, 0xec]);
        assert_eq!(sector[16..24], [0xcd, 0x43, 0xd2, 0xf5, 0x95, 0x98, 0xed, 0x85]);
    }

    #[test]
    fn every_mode_round_trips_and_depends_on_the_sector() {
        let plain: Vec<u8> = (0..4 * SECTOR_SIZE).map(|i| (i % 253) as u8).collect();
        for (mode, key_len) in
            [("xts-plain64", 64), ("xts-plain", 48), ("cbc-essiv:sha256", 16), ("cbc-plain64", 24), ("cbc-plain", 32)]
        {
            let key: Vec<u8> = (0..key_len as u8).collect();
            let cipher = SectorCipher::new(&spec(mode, key_len), &key).unwrap();
            let mut buf = plain.clone();
            cipher.encrypt(7, &mut buf);
            assert_ne!(buf, plain, "{mode}");
            assert_ne!(buf[..SECTOR_SIZE], buf[SECTOR_SIZE..2 * SECTOR_SIZE], "{mode}");
            let mut one = plain[SECTOR_SIZE..2 * SECTOR_SIZE].to_vec();
            cipher.encrypt(8, &mut one);
            assert_eq!(one[..], buf[SECTOR_SIZE..2 * SECTOR_SIZE], "{mode}: sector runs split anywhere");
            cipher.decrypt(7, &mut buf);
            assert_eq!(buf, plain, "{mode}");
        }
    }

    #[test]
    fn unsupported_algorithms_in_qemus_words() {
        let refuse = |name, mode, key| Spec::parse(name, mode, "sha256", key).unwrap_err().0;
        assert_eq!(refuse("serpent", "xts-plain64", 64), "Algorithm 'serpent' with key size 64 bytes not supported");
        assert_eq!(refuse("aes", "xts-plain64", 40), "Algorithm 'aes' with key size 40 bytes not supported");
        assert_eq!(refuse("aes", "ctr-plain64", 32), "Cipher mode 'ctr' not supported");
        assert_eq!(refuse("aes", "cbc-lmk", 32), "IV generator 'lmk' not supported");
        assert_eq!(refuse("aes", "cbc-essiv", 32), "Missing IV generator hash specification");
        assert_eq!(refuse("aes", "cbc-essiv:sha1", 32), "No AES cipher with key size 20 available");
        assert_eq!(refuse("aes", "xts", 32), "Unexpected cipher mode string format xts");
    }
}
