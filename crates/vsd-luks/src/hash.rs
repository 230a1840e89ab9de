//! The hashes a LUKS header may name, for PBKDF2, the splitter and ESSIV.

use hmac::Hmac;
use sha1::Sha1;
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};

use crate::{Result, err};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlg {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
}

impl HashAlg {
    pub fn parse(name: &str) -> Result<HashAlg> {
        Ok(match name {
            "sha1" => HashAlg::Sha1,
            "sha224" => HashAlg::Sha224,
            "sha256" => HashAlg::Sha256,
            "sha384" => HashAlg::Sha384,
            "sha512" => HashAlg::Sha512,
            _ => return err(format!("hash algorithm '{name}' not supported")),
        })
    }

    pub fn digest_len(self) -> usize {
        match self {
            HashAlg::Sha1 => 20,
            HashAlg::Sha224 => 28,
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
            HashAlg::Sha512 => 64,
        }
    }

    /// The digest of the concatenated `parts`, into `out` (digest_len bytes).
    pub fn digest(self, parts: &[&[u8]], out: &mut [u8]) {
        fn run<D: Digest>(parts: &[&[u8]], out: &mut [u8]) {
            let mut d = D::new();
            parts.iter().for_each(|p| d.update(p));
            out.copy_from_slice(&d.finalize());
        }
        match self {
            HashAlg::Sha1 => run::<Sha1>(parts, out),
            HashAlg::Sha224 => run::<Sha224>(parts, out),
            HashAlg::Sha256 => run::<Sha256>(parts, out),
            HashAlg::Sha384 => run::<Sha384>(parts, out),
            HashAlg::Sha512 => run::<Sha512>(parts, out),
        }
    }

    pub fn pbkdf2(self, password: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2;
        // An HMAC key of any length is valid, so these cannot fail.
        let done = match self {
            HashAlg::Sha1 => pbkdf2::<Hmac<Sha1>>(password, salt, rounds, out),
            HashAlg::Sha224 => pbkdf2::<Hmac<Sha224>>(password, salt, rounds, out),
            HashAlg::Sha256 => pbkdf2::<Hmac<Sha256>>(password, salt, rounds, out),
            HashAlg::Sha384 => pbkdf2::<Hmac<Sha384>>(password, salt, rounds, out),
            HashAlg::Sha512 => pbkdf2::<Hmac<Sha512>>(password, salt, rounds, out),
        };
        done.expect("HMAC takes keys of any length");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_matches_rfc6070() {
        let mut out = [0u8; 20];
        HashAlg::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        assert_eq!(out[..4], [0xea, 0x6c, 0x01, 0x4d]);
    }

    #[test]
    fn unknown_hash_is_refused() {
        assert_eq!(HashAlg::parse("md4").unwrap_err().0, "hash algorithm 'md4' not supported");
    }
}
