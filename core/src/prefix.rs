//! Prefix block hashing, compatible with the Gateway API Inference Extension approximate
//! prefix-cache scorer.
//!
//! CONTRACT SKELETON (see `analysis.rs`).

/// Prefix hashing parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixConfig {
    /// Block size in characters (bytes of UTF-8 text), default 64.
    pub block_chars: usize,
    /// Maximum number of blocks hashed, default 256.
    pub max_blocks: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        Self {
            block_chars: 64,
            max_blocks: 256,
        }
    }
}

/// Chain of block hashes of `text`: block *i*'s hash covers blocks 0..=i, seeded with the
/// model name and `cache_salt`. A trailing partial block is not hashed.
pub fn block_hashes(
    model: &str,
    cache_salt: Option<&str>,
    text: &str,
    config: &PrefixConfig,
) -> Vec<u64> {
    let _ = (model, cache_salt, text, config);
    Vec::new()
}
