//! QEMU's LUKS1 format: the header and its checks, key slots unlocked with
//! PBKDF2 and the anti-forensic splitter, and the payload's sector cipher.
//!
//! The crypto comes from RustCrypto's `aes` (already in the workspace, with
//! runtime AES-NI detection and 8-block pipelining in `encrypt_blocks`) and
//! `sha1`/`sha2`/`pbkdf2`. XTS, CBC and the IV generators are done here on
//! the block cipher: each is a few lines, and doing them here lets a whole
//! sector run be handed to AES in one call per sector, which the mode crates
//! of this cipher generation (one call per 16-byte block for CBC, no XTS
//! crate on `cipher` 0.5) did not.

mod afsplit;
mod cipher;
pub use cipher::{IvGen, Mode, Spec};
mod hash;
mod header;
mod secret;

pub use cipher::{SECTOR_SIZE, SectorCipher};
pub use hash::HashAlg;
pub use header::{Header, KeySlot};
pub use secret::SecretBuf;

/// An error in QEMU's words.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct Error(pub String);

pub type Result<T> = std::result::Result<T, Error>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error(msg.into()))
}

/// An unlocked LUKS1 volume: where the payload starts and how to crypt it.
pub struct Volume {
    pub header: Header,
    pub cipher: SectorCipher,
}

impl Volume {
    /// Checks the header (the first `Header::LEN` bytes of `image`, whose
    /// whole length is `image_len`), then unlocks a key slot with
    /// `passphrase`, reading key material with `read_at`. This runs PBKDF2:
    /// call it where blocking for a while is fine.
    pub fn open(
        head: &[u8],
        image_len: u64,
        passphrase: &[u8],
        mut read_at: impl FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    ) -> Result<Volume> {
        let header = Header::parse(head, image_len)?;
        let spec = header.spec()?;
        let key_len = header.key_bytes as usize;
        for slot in header.key_slots.iter().filter(|s| s.is_enabled()) {
            let mut material = SecretBuf::zeroed(key_len * slot.stripes as usize);
            read_at(u64::from(slot.key_offset) * SECTOR_SIZE as u64, &mut material)
                .map_err(|e| Error(format!("Cannot read LUKS key slot: {e}")))?;
            if let Some(master) = header.try_slot(&spec, slot, passphrase, &mut material)? {
                let cipher = SectorCipher::new(&spec, &master)?;
                return Ok(Volume { header, cipher });
            }
        }
        err("Invalid password, cannot unlock any keyslot")
    }

    /// Where the payload starts in the image, in bytes.
    pub fn payload_offset(&self) -> u64 {
        self.header.payload_offset_bytes()
    }
}
