//! Parsing of byte sizes such as `4k`, `1M` or `1073741824`, as every vsd
//! tool spells them (QEMU option values, vsd-bench flags, lab specs).

/// Parses a byte count: decimal digits with an optional binary suffix
/// `k`/`K` (KiB), `m`/`M` (MiB), `g`/`G` (GiB) or `t`/`T` (TiB), optionally
/// followed by `b`/`B` or `iB` (`4k`, `4K`, `4KiB`, `4kb` are all 4096).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!("{text:?} is not a size (expected e.g. 4096, 4k, 1M)"));
    }
    let value: u64 = digits.parse().map_err(|_| format!("{text:?} is too large"))?;
    let multiplier = suffix_multiplier(suffix)
        .ok_or_else(|| format!("{text:?} has an unknown suffix {suffix:?} (use k, m, g or t)"))?;
    value.checked_mul(multiplier).ok_or_else(|| format!("{text:?} is too large"))
}

fn suffix_multiplier(suffix: &str) -> Option<u64> {
    let mut chars = suffix.chars();
    let shift = match chars.next() {
        None => return Some(1),
        Some('k' | 'K') => 10,
        Some('m' | 'M') => 20,
        Some('g' | 'G') => 30,
        Some('t' | 'T') => 40,
        Some(_) => return None,
    };
    match chars.as_str() {
        "" | "b" | "B" | "iB" | "ib" => Some(1 << shift),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn plain_bytes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("1073741824"), Ok(1 << 30));
        assert_eq!(parse_size(" 4096 "), Ok(4096));
    }

    #[test]
    fn binary_suffixes() {
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4kb"), Ok(4096));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("128M"), Ok(128 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "k", "4x", "4kk", "-4k", "4.5k", "4 k", "1MiBs"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn rejects_overflow() {
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17179869184T").is_err());
    }
}
