//! One call from request bytes to everything the picker needs.
//!
//! [`analyze_for_route`] chains the pipeline of the crate docs for callers (the filter, the
//! simulator, the benchmark): classify the path, [`crate::analysis::analyze`] the body, look
//! up the model's [`ModelProfile`], compute its [`KvDemand`], and hash the prefix text with
//! [`crate::prefix::block_hashes`]. [`RoutedRequest::pick_request`] then borrows the result as
//! a [`PickRequest`].
//!
//! Models without a profile get a generic demand: the analysed prompt tokens plus
//! [`crate::profile::DEFAULT_EXPECTED_OUTPUT_FRACTION`] of the output limit (explicit, else
//! [`crate::profile::DEFAULT_MAX_TOKENS`]) per choice, in blocks of
//! [`crate::profile::DEFAULT_BLOCK_SIZE`] tokens, with `bytes = 0` (unknown architecture).

use crate::analysis::{analyze, AnalysisError, ApiKind, RequestAnalysis};
use crate::estimate::Estimator;
use crate::picker::PickRequest;
use crate::prefix::{block_hashes, PrefixConfig};
use crate::profile::{
    KvDemand, ModelProfile, DEFAULT_BLOCK_SIZE, DEFAULT_EXPECTED_OUTPUT_FRACTION,
    DEFAULT_MAX_TOKENS,
};

/// A request analysed for routing.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutedRequest {
    /// The body analysis.
    pub analysis: RequestAnalysis,
    /// Prefix block hashes (GIE-compatible chain, see [`crate::prefix`]).
    pub hashes: Vec<u64>,
    /// Output-token limit in force (explicit or the profile's default), tokens.
    pub output_limit: u32,
    /// KV demand on the model.
    pub demand: KvDemand,
    /// Whether a model profile was found (else the generic demand of the module doc).
    pub profiled: bool,
}

impl RoutedRequest {
    /// The request side of a picker decision, borrowing the model name.
    pub fn pick_request(&self) -> PickRequest<'_> {
        PickRequest {
            model: self.analysis.model.as_deref(),
            api: self.analysis.api,
            prompt_tokens: self.analysis.prompt_tokens,
            output_limit: u64::from(self.output_limit),
            demand_tokens: self.demand.tokens,
            prefix_blocks: u32::try_from(self.hashes.len()).unwrap_or(u32::MAX),
        }
    }
}

/// Analyse `body` sent to `path` and compute demand and prefix hashes.
///
/// `profiles` are searched by exact served name (e.g. [`crate::profile::builtin_profiles`]).
/// Errors: the [`AnalysisError`] of [`analyze`]. Never panics.
pub fn analyze_for_route(
    path: &str,
    body: &[u8],
    estimator: &Estimator,
    prefix: &PrefixConfig,
    profiles: &[ModelProfile],
) -> Result<RoutedRequest, AnalysisError> {
    let api = ApiKind::from_path(path);
    let analysis = analyze(api, body, estimator)?;
    let model = analysis.model.as_deref().unwrap_or("");
    let profile = profiles.iter().find(|p| p.name == model);
    let (output_limit, demand) = match profile {
        Some(p) => (p.output_limit(&analysis), p.demand(&analysis)),
        None => {
            let limit = analysis.max_output_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
            (limit, generic_demand(&analysis, limit))
        }
    };
    let hashes = block_hashes(
        model,
        analysis.cache_salt.as_deref(),
        &analysis.prefix_text,
        prefix,
    );
    Ok(RoutedRequest {
        analysis,
        hashes,
        output_limit,
        demand,
        profiled: profile.is_some(),
    })
}

fn generic_demand(a: &RequestAnalysis, limit: u32) -> KvDemand {
    let per_choice = (f64::from(limit) * DEFAULT_EXPECTED_OUTPUT_FRACTION).ceil() as u64;
    let n = u64::from(a.n.max(1));
    let expected_output_tokens = per_choice.saturating_mul(n);
    let bs = u64::from(DEFAULT_BLOCK_SIZE);
    KvDemand {
        prompt_tokens: a.prompt_tokens,
        expected_output_tokens,
        tokens: a.prompt_tokens.saturating_add(expected_output_tokens),
        bytes: 0,
        blocks: a
            .prompt_tokens
            .div_ceil(bs)
            .saturating_add(per_choice.div_ceil(bs).saturating_mul(n)),
    }
}
