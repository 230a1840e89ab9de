//! The LUKS anti-forensic splitter's merge: the master key is spread over
//! `stripes` blocks so that losing any one block loses the key.

use crate::HashAlg;
use crate::secret::SecretBuf;

/// Hashes `block` in place in digest-sized pieces, each prefixed with its
/// big-endian index (the last piece truncated).
fn diffuse(hash: HashAlg, block: &mut [u8]) {
    let mut digest = SecretBuf::zeroed(hash.digest_len());
    for (i, piece) in block.chunks_mut(hash.digest_len()).enumerate() {
        let index = (i as u32).to_be_bytes();
        hash.digest(&[&index, piece], &mut digest);
        let len = piece.len();
        piece.copy_from_slice(&digest[..len]);
    }
}

/// The key that `material` (`stripes` blocks of `key.len()` bytes) was split from.
pub fn merge(hash: HashAlg, material: &[u8], key: &mut [u8]) {
    key.fill(0);
    let mut stripes = material.chunks_exact(key.len()).peekable();
    while let Some(stripe) = stripes.next() {
        key.iter_mut().zip(stripe).for_each(|(k, s)| *k ^= s);
        if stripes.peek().is_some() {
            diffuse(hash, key);
        }
    }
}

/// Splits `key` into `material`, `random` giving the first stripes-1 blocks.
#[cfg(test)]
pub fn split(hash: HashAlg, key: &[u8], random: &[u8], material: &mut [u8]) {
    let mut acc = vec![0u8; key.len()];
    let last = material.len() - key.len();
    material[..last].copy_from_slice(&random[..last]);
    for stripe in material[..last].chunks_exact(key.len()) {
        acc.iter_mut().zip(stripe).for_each(|(a, s)| *a ^= s);
        diffuse(hash, &mut acc);
    }
    for ((m, a), k) in material[last..].iter_mut().zip(&acc).zip(key) {
        *m = a ^ k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_undoes_split() {
        let key: Vec<u8> = (0..32).collect();
        let random: Vec<u8> = (0..32 * 4000).map(|i| (i * 7 % 251) as u8).collect();
        for hash in [HashAlg::Sha1, HashAlg::Sha256, HashAlg::Sha512] {
            let mut material = vec![0u8; 32 * 4000];
            split(hash, &key, &random, &mut material);
            let mut back = [0u8; 32];
            merge(hash, &material, &mut back);
            assert_eq!(back[..], key[..]);
        }
    }
}
