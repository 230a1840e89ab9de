//! Serde for per-stage and per-kind arrays: a JSON object keyed by name,
//! readable and independent of the enums' order.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{OpKind, Stage};

/// An enum whose values index an array.
pub(crate) trait Key: Copy + 'static {
    /// Every value, in index order.
    const ALL: &'static [Self];
    /// The value's name, as a map key.
    fn name(self) -> &'static str;
}

impl Key for Stage {
    const ALL: &'static [Self] = &Stage::ALL;
    fn name(self) -> &'static str {
        Stage::name(self)
    }
}

impl Key for OpKind {
    const ALL: &'static [Self] = &OpKind::ALL;
    fn name(self) -> &'static str {
        OpKind::name(self)
    }
}

/// Serializes `values` as a map from `K`'s names.
pub(crate) fn serialize<K: Key, T: Serialize, S: Serializer, const N: usize>(
    values: &[T; N],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(K::ALL.iter().map(|k| k.name()).zip(values))
}

/// Deserializes a map from `K`'s names. Missing keys read as the default and
/// unknown ones are ignored, so daemon and client versions need not match.
pub(crate) fn deserialize<'de, K, T, D, const N: usize>(deserializer: D) -> Result<[T; N], D::Error>
where
    K: Key,
    T: Deserialize<'de> + Default,
    D: Deserializer<'de>,
{
    let mut map = BTreeMap::<String, T>::deserialize(deserializer)?;
    Ok(std::array::from_fn(|i| map.remove(K::ALL[i].name()).unwrap_or_default()))
}
