//! What one router instance learned from a response, in a form other instances can replay.
//!
//! Two learners feed on responses: the prefill-throughput learner
//! ([`crate::prefill_rate`], from each streamed response's first token) and the
//! output-length learner ([`crate::output_len`], from each finished response's `usage`).
//! Envoy runs one router per worker thread, so a worker's learners would see only the
//! responses of requests it routed: with `--concurrency N`, each learns from 1/N of the
//! traffic and converges N times slower, and two workers can hold different rates for the
//! same endpoint. Sharing the observations makes every worker learn from every response, as
//! one router would.
//!
//! An [`Observation`] travels as a record of the same journal that carries prefix affinity
//! ([`crate::affinity`]: a string key and a few `u64` words, bounded, dropped after a
//! retention time), under its own shared-data key in the filter. Encoding
//! ([`Observation::to_record`]):
//!
//! | kind | key | words |
//! |---|---|---|
//! | first token | endpoint id | `1`, predicted work (tokens, `f64` bits), TTFT (seconds, `f64` bits) |
//! | output length | model name | `2`, API code ([`api_code`]), prompt tokens, completion tokens |
//!
//! A record of another kind or length decodes to `None` and is skipped: a newer writer
//! can add kinds without breaking an older reader.

use crate::analysis::ApiKind;

/// Word 0 of a first-token record.
const FIRST_TOKEN: u64 = 1;
/// Word 0 of an output-length record.
const OUTPUT: u64 = 2;

/// One learner observation (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// A streamed response's first token: the request was routed to `endpoint` with
    /// `work_tokens` of predicted prefill work ahead of and including it, and its first
    /// token came `ttft_s` seconds after the decision
    /// ([`crate::router::Router::observe_first_token`]).
    FirstToken {
        /// Endpoint id (`EndpointStats::id`).
        endpoint: String,
        /// Predicted work at pick time, tokens.
        work_tokens: f64,
        /// Time to first token, seconds.
        ttft_s: f64,
    },
    /// A finished response's `usage` for a request to `model` over `api`
    /// ([`crate::router::Router::observe_output`]).
    Output {
        /// Requested model.
        model: String,
        /// API of the request.
        api: ApiKind,
        /// `usage.prompt_tokens`.
        prompt_tokens: u64,
        /// `usage.completion_tokens`.
        completion_tokens: u64,
    },
}

/// Stable wire code of an API kind: chat completions 0, completions 1, responses 2,
/// embeddings 3, other 4.
pub fn api_code(api: ApiKind) -> u64 {
    match api {
        ApiKind::ChatCompletions => 0,
        ApiKind::Completions => 1,
        ApiKind::Responses => 2,
        ApiKind::Embeddings => 3,
        ApiKind::Other => 4,
    }
}

/// The API kind of a wire code ([`api_code`]); `None` for an unknown code.
pub fn api_from_code(code: u64) -> Option<ApiKind> {
    Some(match code {
        0 => ApiKind::ChatCompletions,
        1 => ApiKind::Completions,
        2 => ApiKind::Responses,
        3 => ApiKind::Embeddings,
        4 => ApiKind::Other,
        _ => return None,
    })
}

impl Observation {
    /// The journal record (key, words) of this observation (see the module doc).
    pub fn to_record(&self) -> (String, Vec<u64>) {
        match self {
            Observation::FirstToken {
                endpoint,
                work_tokens,
                ttft_s,
            } => (
                endpoint.clone(),
                vec![FIRST_TOKEN, work_tokens.to_bits(), ttft_s.to_bits()],
            ),
            Observation::Output {
                model,
                api,
                prompt_tokens,
                completion_tokens,
            } => (
                model.clone(),
                vec![OUTPUT, api_code(*api), *prompt_tokens, *completion_tokens],
            ),
        }
    }

    /// Decode a journal record; `None` for an unknown kind, a wrong word count or an
    /// unknown API code (the record is skipped). Values are checked by the learners
    /// themselves, as for local observations.
    pub fn from_record(key: &str, words: &[u64]) -> Option<Self> {
        match *words {
            [FIRST_TOKEN, work, ttft] => Some(Observation::FirstToken {
                endpoint: key.to_owned(),
                work_tokens: f64::from_bits(work),
                ttft_s: f64::from_bits(ttft),
            }),
            [OUTPUT, api, prompt_tokens, completion_tokens] => Some(Observation::Output {
                model: key.to_owned(),
                api: api_from_code(api)?,
                prompt_tokens,
                completion_tokens,
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn records_have_the_documented_words_and_round_trip() {
        let ft = Observation::FirstToken {
            endpoint: "pool/e1".into(),
            work_tokens: 2048.0,
            ttft_s: 0.25,
        };
        let (k, w) = ft.to_record();
        assert_eq!(k, "pool/e1");
        assert_eq!(w, vec![1, 2048.0f64.to_bits(), 0.25f64.to_bits()]);
        assert_eq!(Observation::from_record(&k, &w), Some(ft));

        let out = Observation::Output {
            model: "m".into(),
            api: ApiKind::Responses,
            prompt_tokens: 700,
            completion_tokens: 90,
        };
        let (k, w) = out.to_record();
        assert_eq!((k.as_str(), w.as_slice()), ("m", &[2, 2, 700, 90][..]));
        assert_eq!(Observation::from_record(&k, &w), Some(out));
    }

    #[test]
    fn unknown_kinds_lengths_and_api_codes_are_skipped() {
        for words in [
            &[][..],
            &[1, 0][..],
            &[1, 0, 0, 0][..],
            &[2, 0, 1][..],
            &[2, 5, 1, 1][..],
            &[3, 0, 0][..],
            // An affinity chain's hashes are not observations.
            &[0x9E37_79B9_7F4A_7C15, 7, 9][..],
        ] {
            assert_eq!(Observation::from_record("x", words), None, "{words:?}");
        }
        for api in [
            ApiKind::ChatCompletions,
            ApiKind::Completions,
            ApiKind::Responses,
            ApiKind::Embeddings,
            ApiKind::Other,
        ] {
            assert_eq!(api_from_code(api_code(api)), Some(api));
        }
    }
}
