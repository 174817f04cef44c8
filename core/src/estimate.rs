//! Token estimation without vocabulary files.
//!
//! CONTRACT SKELETON (see `analysis.rs`).

use std::collections::BTreeMap;

/// Token allowances for non-text prompt items, in tokens per item.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediaAllowance {
    /// Tokens per image.
    pub image_tokens: u32,
    /// Tokens per audio clip.
    pub audio_tokens: u32,
    /// Tokens per video.
    pub video_tokens: u32,
}

impl Default for MediaAllowance {
    fn default() -> Self {
        Self {
            image_tokens: 576,
            audio_tokens: 750,
            video_tokens: 4096,
        }
    }
}

/// Estimator configuration: media allowances and per-model calibration factors.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EstimatorConfig {
    /// Per-item allowances.
    pub media: MediaAllowance,
    /// Multiplier on the text estimate per model name (default 1.0).
    pub calibration: BTreeMap<String, f64>,
}

/// Estimates token counts from text.
#[derive(Debug, Clone, Default)]
pub struct Estimator {
    /// Configuration in force.
    pub config: EstimatorConfig,
}

impl Estimator {
    /// Build an estimator from configuration.
    pub fn new(config: EstimatorConfig) -> Self {
        Self { config }
    }

    /// Estimated BPE tokens in `text` before calibration.
    pub fn estimate_text(&self, text: &str) -> u64 {
        (text.len() as u64).div_ceil(4)
    }

    /// Calibration factor for `model` (1.0 when unconfigured).
    pub fn calibration(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|m| self.config.calibration.get(m).copied())
            .unwrap_or(1.0)
    }
}
