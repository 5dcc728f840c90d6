//! Whose KV a cached entry holds. A LoRA adapter changes the keys and values of every layer it
//! touches, so a prompt's KV under one adapter serves only later prompts under the same
//! adapter: the prefix cache and the SSD tier keep each entry in its space and look up only
//! the space of the request at hand.
//!
//! A space is named by the adapter's content, not by the name it was loaded under or the id
//! the engine gave it: an adapter loaded again (or by a restarted engine, from the SSD tier)
//! finds its entries, and a different adapter under a reused name does not.
use std::path::Path;

use sha2::{Digest, Sha256};

use super::ssd::identity::hash_weight_file;

/// The base model's space, or an adapter's fingerprint (SHA-256 of its configuration and
/// weights). All zeros is the base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct KvSpace(pub [u8; 32]);

impl KvSpace {
    /// The base model, no adapter.
    pub const BASE: KvSpace = KvSpace([0; 32]);

    pub fn is_base(&self) -> bool {
        *self == Self::BASE
    }

    /// The space of the adapter in `dir` (mlx-lm's layout: `adapter_config.json` and
    /// `adapters.safetensors`).
    pub fn of_adapter_dir(dir: &Path) -> std::io::Result<Self> {
        let mut h = Sha256::new();
        h.update(b"mlxd-kv-adapter\0");
        let config = std::fs::read(dir.join("adapter_config.json"))?;
        h.update((config.len() as u64).to_le_bytes());
        h.update(&config);
        hash_weight_file(&mut h, &dir.join("adapters.safetensors"))?;
        Ok(KvSpace(h.finalize().into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(dir: &Path, config: &str, weights: &[u8]) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("adapter_config.json"), config).unwrap();
        std::fs::write(dir.join("adapters.safetensors"), weights).unwrap();
    }

    #[test]
    fn an_adapter_is_named_by_its_content() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, same, other_weights, other_config) = (
            tmp.path().join("a"),
            tmp.path().join("same"),
            tmp.path().join("w"),
            tmp.path().join("c"),
        );
        adapter(&a, r#"{"rank":8}"#, b"weights");
        adapter(&same, r#"{"rank":8}"#, b"weights");
        adapter(&other_weights, r#"{"rank":8}"#, b"Weights");
        adapter(&other_config, r#"{"rank":4}"#, b"weights");
        let space = KvSpace::of_adapter_dir(&a).unwrap();
        assert!(!space.is_base());
        assert_eq!(space, KvSpace::of_adapter_dir(&same).unwrap());
        assert_ne!(space, KvSpace::of_adapter_dir(&other_weights).unwrap());
        assert_ne!(space, KvSpace::of_adapter_dir(&other_config).unwrap());
        assert!(KvSpace::of_adapter_dir(&tmp.path().join("missing")).is_err());
    }
}
