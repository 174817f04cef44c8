//! Router-local in-flight reservations. In the filter each Envoy worker keeps its own
//! table and publishes a copy for the other workers (`kvroute_filter::inflight`); a
//! decision counts its own table and its copy of the others' together ([`Reservations`]).
//!
//! When the filter routes a request it *reserves* the request's estimated KV demand
//! (tokens) on the chosen endpoint, so that the next decisions see that load before the
//! control plane's next scrape does (herd protection). The reservation is *released*
//! exactly once when the stream ends (completion, client reset or upstream error).
//!
//! Design:
//! - The table is a map from a reservation id (`u64`, unique per request across workers:
//!   the filter derives it from a per-worker random prefix and the context id) to the
//!   endpoint id, the reserved tokens and an expiry time.
//! - Per-endpoint totals ([`InflightTable::totals`]) are *computed* from the live entries,
//!   so a counter can never go negative and a double release cannot corrupt it:
//!   [`InflightTable::release`] of an unknown id is a no-op that returns `None`.
//! - What the picker sees ([`InflightTable::unseen_totals`]) is only the load the snapshot
//!   cannot show yet: reservations made at or after that endpoint's `scraped_at_ms`. A
//!   request routed before the scrape is already in the model server's `running` /
//!   `waiting` counts and KV usage; counting its reservation too would charge it twice and
//!   make a loaded fleet look full (found by the routing benchmark: 87–91% of picks refused
//!   at ×4 load before this rule). All reservations still count for release and expiry.
//! - **Pending prefill.** A reservation may also carry the request's expected prefill work
//!   (tokens: estimated prompt − prefix tokens the router expects cached on that endpoint,
//!   [`crate::picker::uncached_prompt_tokens`]), recorded by
//!   [`InflightTable::reserve_with_prefill`] and zeroed by [`InflightTable::first_token`]
//!   when the response's first token arrives (prefill is over once a first token exists;
//!   [`crate::usage::FirstTokenScanner`] tells it from keep-alives in an event stream).
//!   Unlike requests and KV tokens, pending prefill is a router-side fact no scrape reports
//!   (model servers export queued request *counts*, not queued prompt tokens), so
//!   [`InflightTable::unseen_totals`] sums it over **all** unexpired reservations. This is
//!   NVIDIA Dynamo's KV-router accounting of prefill per worker: `ActiveSequences` in
//!   `lib/llm/src/kv_router/sequence.rs` records `isl − overlap × block_size` tokens per
//!   routed request at `add_request` and removes them at `mark_prefill_completed` / `free`
//!   (design: <https://docs.nvidia.com/dynamo/design-docs/router-design>, "Potential New
//!   Prefill Blocks").
//! - A leaked reservation (a stream whose end was never observed, e.g. a VM restart)
//!   expires at `expires_at_ms` and is dropped by [`InflightTable::purge_expired`];
//!   expired entries are also ignored by [`InflightTable::totals`].
//! - The table is bounded ([`InflightTable::new`]'s `max_entries`): when full, the entry that
//!   expires first is evicted, so memory stays bounded under any load.
//! - Wire format: a compact binary layout ([`WIRE_MAGIC`]) via [`InflightTable::encode`] /
//!   [`InflightTable::decode`], stored in proxy-wasm shared data, one key per worker,
//!   written by that worker only. It is a flat copy, not JSON: the filter once read and
//!   wrote one shared table several times per request (docs/overhead.md).
//!
//! Default TTL: [`DEFAULT_TTL_MS`] = 10 minutes, longer than a typical completion
//! (vLLM's default request timeout is unbounded; Envoy's default route timeout is 15 s,
//! which LLM routes usually raise to minutes).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Router-local load on one endpoint.
///
/// `requests` and `tokens` cover only what the snapshot does not show yet (reservations made
/// since that endpoint's scrape); `prefill_tokens` covers every in-flight request the router
/// sent there that has not produced its first token, whatever the scrape age, because no
/// model-server metric reports queued prompt *tokens*.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct InFlight {
    /// Requests sent and not yet finished.
    pub requests: u32,
    /// Their reserved KV demand, tokens.
    pub tokens: u64,
    /// Pending prefill, tokens: Σ over the router's requests on this endpoint without a first
    /// token yet of (estimated prompt tokens − prefix tokens expected cached there), as
    /// recorded by [`InflightTable::reserve_with_prefill`]. This is the
    /// prefill half of NVIDIA Dynamo's router-side active-sequence accounting: its
    /// `ActiveSequences` (`lib/llm/src/kv_router/sequence.rs`) records per request
    /// `isl − overlap × block_size` prefill tokens at `add_request` and drops them at
    /// `mark_prefill_completed` or `free` ("Potential New Prefill Blocks" in
    /// <https://docs.nvidia.com/dynamo/design-docs/router-design>).
    #[serde(default)]
    pub prefill_tokens: u64,
}

/// Default reservation lifetime, milliseconds (10 minutes).
pub const DEFAULT_TTL_MS: u64 = 600_000;

/// Default bound on live reservations in one table.
pub const DEFAULT_MAX_ENTRIES: usize = 65_536;

/// One reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    /// Endpoint id (`EndpointStats::id`).
    pub endpoint: String,
    /// Reserved KV demand, tokens.
    pub tokens: u64,
    /// When the reservation lapses, Unix milliseconds.
    pub expires_at_ms: u64,
    /// When the reservation was made, Unix milliseconds (0 in tables written before this
    /// field existed: such entries count as already visible in the snapshot).
    #[serde(default)]
    pub reserved_at_ms: u64,
    /// Pending prefill, tokens (0 once the first token was seen, and in tables written
    /// before this field existed).
    #[serde(default)]
    pub prefill_tokens: u64,
}

/// Errors decoding a table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InflightError {
    /// The bytes are not a table.
    #[error("in-flight table is not valid: {0}")]
    Decode(String),
}

/// A reservation table (one per filter worker, or the routing benchmark's one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflightTable {
    /// Live reservations by id.
    entries: BTreeMap<u64, Reservation>,
    /// Bound on `entries.len()`.
    max_entries: usize,
}

impl Default for InflightTable {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_ENTRIES)
    }
}

impl InflightTable {
    /// An empty table holding at most `max_entries` reservations (at least 1).
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: BTreeMap::new(),
            max_entries: max_entries.max(1),
        }
    }

    /// Number of live (possibly expired, not yet purged) reservations.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Unexpired reservations at `now_ms` (those [`InflightTable::totals`] counts).
    pub fn live(&self, now_ms: u64) -> usize {
        self.entries
            .values()
            .filter(|r| r.expires_at_ms > now_ms)
            .count()
    }

    /// True when no reservation is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Reserve `tokens` on `endpoint` under `id`, lapsing `ttl_ms` after `now_ms`, without
    /// pending prefill (same as [`InflightTable::reserve_with_prefill`] with 0).
    ///
    /// Re-reserving an existing id replaces it (the caller's id is unique per request, so
    /// this only happens on a retried CAS write of the same request). When the table is
    /// full, the reservation expiring first is evicted and returned.
    pub fn reserve(
        &mut self,
        id: u64,
        endpoint: &str,
        tokens: u64,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Option<(u64, Reservation)> {
        self.reserve_with_prefill(id, endpoint, tokens, 0, now_ms, ttl_ms)
    }

    /// Reserve `tokens` of KV demand and `prefill_tokens` of pending prefill (tokens the
    /// endpoint must compute before the first token; see the module doc) on `endpoint` under
    /// `id`, lapsing `ttl_ms` after `now_ms`. Replacement and eviction as in
    /// [`InflightTable::reserve`].
    pub fn reserve_with_prefill(
        &mut self,
        id: u64,
        endpoint: &str,
        tokens: u64,
        prefill_tokens: u64,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Option<(u64, Reservation)> {
        let mut evicted = None;
        if !self.entries.contains_key(&id) && self.entries.len() >= self.max_entries {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(k, r)| (r.expires_at_ms, **k))
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                evicted = self.entries.remove(&k).map(|r| (k, r));
            }
        }
        self.entries.insert(
            id,
            Reservation {
                endpoint: endpoint.to_owned(),
                tokens,
                expires_at_ms: now_ms.saturating_add(ttl_ms),
                reserved_at_ms: now_ms,
                prefill_tokens,
            },
        );
        evicted
    }

    /// Release reservation `id`. Returns it the first time, `None` afterwards (and for
    /// unknown ids), so releasing twice is harmless.
    pub fn release(&mut self, id: u64) -> Option<Reservation> {
        self.entries.remove(&id)
    }

    /// Change the tokens held by `id` (e.g. once the actual prompt size is known from the
    /// response's `usage`). Returns false when `id` is not held.
    pub fn adjust(&mut self, id: u64, tokens: u64) -> bool {
        match self.entries.get_mut(&id) {
            Some(r) => {
                r.tokens = tokens;
                true
            }
            None => false,
        }
    }

    /// The first token of `id` was seen: its prefill is done, so its pending prefill drops to
    /// 0 (its KV reservation stays until release). Returns the prefill tokens cleared
    /// (`Some(0)` on a repeated call), `None` when `id` is not held.
    pub fn first_token(&mut self, id: u64) -> Option<u64> {
        self.entries
            .get_mut(&id)
            .map(|r| std::mem::take(&mut r.prefill_tokens))
    }

    /// The reservation held under `id`, if any.
    pub fn get(&self, id: u64) -> Option<&Reservation> {
        self.entries.get(&id)
    }

    /// Move every reservation of `other` into this table (an id held by both keeps
    /// `other`'s). Past `max_entries`, the reservations expiring first are evicted, as in
    /// [`InflightTable::reserve`]. The filter merges the other workers' published tables
    /// with it.
    pub fn absorb(&mut self, mut other: InflightTable) {
        self.entries.append(&mut other.entries);
        let over = self.entries.len().saturating_sub(self.max_entries);
        if over > 0 {
            let mut by_expiry: Vec<(u64, u64)> = self
                .entries
                .iter()
                .map(|(k, r)| (r.expires_at_ms, *k))
                .collect();
            by_expiry.sort_unstable();
            for (_, k) in by_expiry.into_iter().take(over) {
                self.entries.remove(&k);
            }
        }
    }

    /// Drop every reservation.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Drop every reservation with `expires_at_ms <= now_ms`; returns how many.
    pub fn purge_expired(&mut self, now_ms: u64) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, r| r.expires_at_ms > now_ms);
        before - self.entries.len()
    }

    /// Per-endpoint load of the unexpired reservations: requests, tokens and pending
    /// prefill tokens (saturating sums; never negative by construction).
    pub fn totals(&self, now_ms: u64) -> BTreeMap<String, InFlight> {
        let mut out: BTreeMap<String, InFlight> = BTreeMap::new();
        for r in self.entries.values().filter(|r| r.expires_at_ms > now_ms) {
            let e = out.entry(r.endpoint.clone()).or_default();
            e.requests = e.requests.saturating_add(1);
            e.tokens = e.tokens.saturating_add(r.tokens);
            e.prefill_tokens = e.prefill_tokens.saturating_add(r.prefill_tokens);
        }
        out
    }

    /// Per-endpoint load the snapshot does not show yet: unexpired reservations made at or
    /// after `scraped_at_ms(endpoint)` (all unexpired ones when that returns `None`, i.e. an
    /// endpoint without stats), plus the pending prefill tokens of **every** unexpired
    /// reservation (no scrape shows them). This is what [`crate::picker::PickInput::inflight`]
    /// expects.
    pub fn unseen_totals<F>(&self, now_ms: u64, scraped_at_ms: F) -> BTreeMap<String, InFlight>
    where
        F: Fn(&str) -> Option<u64>,
    {
        let mut out: BTreeMap<String, InFlight> = BTreeMap::new();
        for (endpoint, add) in self.unseen(now_ms, scraped_at_ms) {
            out.entry(endpoint.to_owned()).or_default().add(&add);
        }
        out
    }

    /// [`Self::unseen_totals`] added into `out` by position instead of collected in a map
    /// (the router's per-decision form: no allocation). `slot(endpoint)` gives the
    /// endpoint's index in `out` and its scrape time; reservations of endpoints without a
    /// slot (not in the snapshot: nothing to pick) are skipped.
    pub fn add_unseen<F>(&self, now_ms: u64, slot: F, out: &mut [InFlight])
    where
        F: Fn(&str) -> Option<(usize, u64)>,
    {
        for r in self.entries.values().filter(|r| r.expires_at_ms > now_ms) {
            let Some((i, scraped)) = slot(&r.endpoint) else {
                continue;
            };
            if let (Some(add), Some(o)) = (unseen_load(r, Some(scraped)), out.get_mut(i)) {
                o.add(&add);
            }
        }
    }

    /// Each unexpired reservation's load the snapshot has not seen: (endpoint, load).
    fn unseen<'a, F>(
        &'a self,
        now_ms: u64,
        scraped_at_ms: F,
    ) -> impl Iterator<Item = (&'a str, InFlight)> + 'a
    where
        F: Fn(&str) -> Option<u64> + 'a,
    {
        self.entries
            .values()
            .filter(move |r| r.expires_at_ms > now_ms)
            .filter_map(move |r| {
                Some((
                    r.endpoint.as_str(),
                    unseen_load(r, scraped_at_ms(&r.endpoint))?,
                ))
            })
    }

    /// Encode for shared data: the compact binary layout of the module doc ([`WIRE_MAGIC`]).
    pub fn encode(&self) -> Vec<u8> {
        // Endpoint ids are written once each; entries refer to them by index.
        let mut names: Vec<&str> = Vec::new();
        let mut index: BTreeMap<&str, u16> = BTreeMap::new();
        let mut rows: Vec<(u64, u16, &Reservation)> = Vec::with_capacity(self.entries.len());
        for (id, r) in &self.entries {
            let i = match index.get(r.endpoint.as_str()) {
                Some(i) => *i,
                None => {
                    let Ok(i) = u16::try_from(names.len()) else {
                        continue; // more than 65,535 distinct endpoints: never in practice
                    };
                    names.push(&r.endpoint);
                    index.insert(&r.endpoint, i);
                    i
                }
            };
            rows.push((*id, i, r));
        }
        let size = WIRE_MAGIC.len()
            + 10
            + names
                .iter()
                .map(|n| 2 + n.len().min(usize::from(u16::MAX)))
                .sum::<usize>()
            + rows.len() * ROW_BYTES;
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(WIRE_MAGIC);
        out.extend_from_slice(
            &u32::try_from(self.max_entries)
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        out.extend_from_slice(&(names.len() as u16).to_le_bytes());
        for n in &names {
            let b = n.as_bytes();
            let b = b.get(..usize::from(u16::MAX)).unwrap_or(b);
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        }
        let n_rows = u32::try_from(rows.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n_rows.to_le_bytes());
        for (id, i, r) in rows.iter().take(n_rows as usize) {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&i.to_le_bytes());
            out.extend_from_slice(&r.tokens.to_le_bytes());
            out.extend_from_slice(&r.expires_at_ms.to_le_bytes());
            out.extend_from_slice(&r.reserved_at_ms.to_le_bytes());
            out.extend_from_slice(&r.prefill_tokens.to_le_bytes());
        }
        out
    }

    /// Decode bytes written by [`InflightTable::encode`] (or the JSON of earlier filter
    /// versions, which a hot-reloaded VM may find in shared data). Empty input is an empty
    /// table (shared data not yet written). Errors on truncated or unknown bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, InflightError> {
        if bytes.is_empty() {
            return Ok(Self::default());
        }
        if bytes.first() == Some(&b'{') {
            let mut t: Self =
                serde_json::from_slice(bytes).map_err(|e| InflightError::Decode(e.to_string()))?;
            t.max_entries = t.max_entries.max(1);
            return Ok(t);
        }
        let mut r = Reader(bytes);
        if r.take(WIRE_MAGIC.len())? != WIRE_MAGIC {
            return Err(InflightError::Decode("unknown format".into()));
        }
        let max_entries = (r.u32()? as usize).max(1);
        let n_names = usize::from(r.u16()?);
        let mut names = Vec::with_capacity(n_names);
        for _ in 0..n_names {
            let len = usize::from(r.u16()?);
            let name = std::str::from_utf8(r.take(len)?)
                .map_err(|_| InflightError::Decode("endpoint id is not UTF-8".into()))?;
            names.push(name);
        }
        let n_rows = r.u32()? as usize;
        let mut entries = BTreeMap::new();
        for _ in 0..n_rows {
            let id = r.u64()?;
            let endpoint = names
                .get(usize::from(r.u16()?))
                .ok_or_else(|| InflightError::Decode("endpoint index out of range".into()))?;
            entries.insert(
                id,
                Reservation {
                    endpoint: (*endpoint).to_owned(),
                    tokens: r.u64()?,
                    expires_at_ms: r.u64()?,
                    reserved_at_ms: r.u64()?,
                    prefill_tokens: r.u64()?,
                },
            );
        }
        if !r.0.is_empty() {
            return Err(InflightError::Decode("trailing bytes".into()));
        }
        Ok(Self {
            entries,
            max_entries,
        })
    }
}

/// Reservations a decision counts: one [`InflightTable`], or several read together (a
/// filter worker's own table beside its copy of the other workers' tables). The router is
/// generic over it so that the tables need no merging per decision.
pub trait Reservations {
    /// Add the unseen load of every table into `out`, by position
    /// ([`InflightTable::add_unseen`]).
    fn add_unseen_into<F>(&self, now_ms: u64, slot: F, out: &mut [InFlight])
    where
        F: Fn(&str) -> Option<(usize, u64)>;
}

impl Reservations for InflightTable {
    fn add_unseen_into<F>(&self, now_ms: u64, slot: F, out: &mut [InFlight])
    where
        F: Fn(&str) -> Option<(usize, u64)>,
    {
        self.add_unseen(now_ms, slot, out);
    }
}

impl Reservations for [&InflightTable] {
    fn add_unseen_into<F>(&self, now_ms: u64, slot: F, out: &mut [InFlight])
    where
        F: Fn(&str) -> Option<(usize, u64)>,
    {
        for t in self {
            t.add_unseen(now_ms, &slot, out);
        }
    }
}

/// First bytes of the binary table (format version 1). Layout, little-endian: magic, then
/// `max_entries` u32, endpoint count u16, each endpoint id as length u16 + UTF-8 bytes,
/// reservation count u32, then per reservation id u64, endpoint index u16, tokens u64,
/// expires_at_ms u64, reserved_at_ms u64, prefill_tokens u64 ([`ROW_BYTES`]). It replaced
/// JSON: decoding 8 reservations went from serde_json's parse of ~1 KB with one `String`
/// per field name to a bounds-checked copy.
pub const WIRE_MAGIC: &[u8; 4] = b"KVI1";
/// Bytes per reservation in the binary table.
pub const ROW_BYTES: usize = 8 + 2 + 8 * 4;

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], InflightError> {
        if self.0.len() < n {
            return Err(InflightError::Decode("truncated".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, InflightError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([
            b.first().copied().unwrap_or(0),
            b.get(1).copied().unwrap_or(0),
        ]))
    }
    fn u32(&mut self) -> Result<u32, InflightError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, InflightError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
}

/// What reservation `r` adds to its endpoint's unseen load, given the endpoint's scrape
/// time: its pending prefill always (the snapshot has no per-request prefill), its request
/// and tokens only when reserved after the scrape; `None` when it adds nothing.
fn unseen_load(r: &Reservation, scraped_at_ms: Option<u64>) -> Option<InFlight> {
    let seen = scraped_at_ms.is_some_and(|t| r.reserved_at_ms < t);
    if seen && r.prefill_tokens == 0 {
        return None;
    }
    Some(InFlight {
        requests: u32::from(!seen),
        tokens: if seen { 0 } else { r.tokens },
        prefill_tokens: r.prefill_tokens,
    })
}

impl InFlight {
    /// Add `o` field by field (saturating).
    pub fn add(&mut self, o: &InFlight) {
        self.requests = self.requests.saturating_add(o.requests);
        self.tokens = self.tokens.saturating_add(o.tokens);
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    #[cfg(all(target_arch = "wasm32", target_os = "unknown"))]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn tables_read_together_count_like_one_merged_table() {
        let mut own = InflightTable::new(8);
        own.reserve_with_prefill(1, "a", 100, 30, 1_000, 60_000);
        own.reserve_with_prefill(2, "b", 50, 0, 500, 60_000);
        let mut peers = InflightTable::new(8);
        peers.reserve_with_prefill(3, "a", 7, 5, 1_000, 60_000);
        peers.reserve_with_prefill(4, "c", 9, 0, 1_000, 60_000);
        // "a" at slot 0 scraped at 900, "b" at slot 1 scraped at 900 (its reservation was
        // made before: seen), "c" not in the snapshot.
        let slot = |id: &str| match id {
            "a" => Some((0, 900)),
            "b" => Some((1, 900)),
            _ => None,
        };
        let mut split = vec![InFlight::default(); 2];
        [&own, &peers][..].add_unseen_into(1_000, slot, &mut split);
        let mut merged = own.clone();
        merged.absorb(peers);
        // Unexpired at 1,000; "b"'s, reserved at 500, lapses at 60,500, the others at 61,000.
        assert_eq!(merged.live(1_000), 4);
        assert_eq!(merged.live(60_500), 3);
        assert_eq!(merged.live(61_000), 0);
        let mut one = vec![InFlight::default(); 2];
        merged.add_unseen_into(1_000, slot, &mut one);
        assert_eq!(split, one);
        assert_eq!(
            split,
            [
                InFlight {
                    requests: 2,
                    tokens: 107,
                    prefill_tokens: 35
                },
                InFlight::default()
            ]
        );
    }

    #[test]
    fn absorbing_past_the_bound_evicts_what_expires_first() {
        let mut t = InflightTable::new(3);
        t.reserve(1, "a", 1, 0, 10);
        t.reserve(2, "a", 1, 0, 40);
        let mut other = InflightTable::new(3);
        other.reserve(3, "b", 1, 0, 20);
        other.reserve(4, "b", 1, 0, 30);
        other.reserve(2, "b", 5, 0, 50);
        t.absorb(other);
        assert_eq!(t.len(), 3);
        // 4 ids (2 is in both: the absorbed one wins), bound 3: the one expiring at 10 goes.
        assert!(t.get(1).is_none());
        assert_eq!(
            t.get(2).map(|r| (r.endpoint.as_str(), r.tokens)),
            Some(("b", 5))
        );
        assert!(t.get(3).is_some() && t.get(4).is_some());
        t.clear();
        assert!(t.is_empty());
    }

    #[test]
    fn reserve_release_exactly_once() {
        let mut t = InflightTable::default();
        assert_eq!(t.reserve(1, "a", 100, 0, 1000), None);
        t.reserve(2, "a", 50, 0, 1000);
        t.reserve(3, "b", 7, 0, 1000);
        let tot = t.totals(10);
        assert_eq!(
            tot["a"],
            InFlight {
                prefill_tokens: 0,
                requests: 2,
                tokens: 150
            }
        );
        assert_eq!(
            tot["b"],
            InFlight {
                prefill_tokens: 0,
                requests: 1,
                tokens: 7
            }
        );
        assert_eq!(t.release(1).map(|r| r.tokens), Some(100));
        assert_eq!(t.release(1), None);
        assert_eq!(
            t.totals(10)["a"],
            InFlight {
                prefill_tokens: 0,
                requests: 1,
                tokens: 50
            }
        );
    }

    #[test]
    fn expired_entries_are_ignored_and_purged() {
        let mut t = InflightTable::default();
        t.reserve(1, "a", 100, 0, 1000);
        t.reserve(2, "a", 10, 500, 1000);
        assert_eq!(t.totals(999)["a"].tokens, 110);
        assert_eq!(t.totals(1000)["a"].tokens, 10);
        assert_eq!(t.purge_expired(1000), 1);
        assert_eq!(t.len(), 1);
        assert!(t.totals(1500).is_empty());
    }

    #[test]
    fn unseen_totals_skip_reservations_older_than_the_scrape() {
        let mut t = InflightTable::new(16);
        t.reserve(1, "a", 100, 1_000, 60_000); // before a's scrape at 1_500: visible
        t.reserve(2, "a", 30, 1_500, 60_000); // at the scrape: not yet visible
        t.reserve(3, "a", 7, 1_800, 60_000);
        t.reserve(4, "b", 50, 1_000, 60_000); // b has no stats: always counted
        let scraped = |id: &str| (id == "a").then_some(1_500);
        let u = t.unseen_totals(2_000, scraped);
        assert_eq!(
            u["a"],
            InFlight {
                prefill_tokens: 0,
                requests: 2,
                tokens: 37
            }
        );
        assert_eq!(
            u["b"],
            InFlight {
                prefill_tokens: 0,
                requests: 1,
                tokens: 50
            }
        );
        // Every reservation still counts in the plain totals (release and expiry).
        assert_eq!(
            t.totals(2_000)["a"],
            InFlight {
                prefill_tokens: 0,
                requests: 3,
                tokens: 137
            }
        );
        // Tables written before `reserved_at_ms` existed decode with 0: visible.
        let old = br#"{"entries":{"9":{"endpoint":"a","tokens":5,"expires_at_ms":99999}},"max_entries":4}"#;
        let t = InflightTable::decode(old).unwrap();
        assert!(t.unseen_totals(2_000, scraped).is_empty());
    }

    #[test]
    fn pending_prefill_reserve_first_token_release() {
        let mut t = InflightTable::new(16);
        t.reserve_with_prefill(1, "a", 9_000, 8_000, 1_000, 60_000);
        t.reserve_with_prefill(2, "a", 600, 500, 1_100, 60_000);
        t.reserve(3, "b", 70, 1_100, 60_000);
        assert_eq!(
            t.totals(2_000)["a"],
            InFlight {
                requests: 2,
                tokens: 9_600,
                prefill_tokens: 8_500,
            }
        );
        assert_eq!(t.totals(2_000)["b"].prefill_tokens, 0);
        // First token of 1: its prefill is done, its KV reservation stays.
        assert_eq!(t.first_token(1), Some(8_000));
        assert_eq!(t.first_token(1), Some(0));
        assert_eq!(t.first_token(99), None);
        assert_eq!(
            t.totals(2_000)["a"],
            InFlight {
                requests: 2,
                tokens: 9_600,
                prefill_tokens: 500,
            }
        );
        // Release clears the rest, including a prefill never marked done.
        assert_eq!(t.release(2).map(|r| r.prefill_tokens), Some(500));
        assert_eq!(
            t.totals(2_000)["a"],
            InFlight {
                requests: 1,
                tokens: 9_000,
                prefill_tokens: 0,
            }
        );
        assert!(t.release(1).is_some());
        assert!(!t.totals(2_000).contains_key("a"));
    }

    #[test]
    fn unseen_totals_count_pending_prefill_whatever_the_scrape_age() {
        let mut t = InflightTable::new(16);
        // Both before a's scrape at 1_500: requests and KV tokens are in the snapshot, the
        // pending prefill of 1 is not.
        t.reserve_with_prefill(1, "a", 100, 80, 1_000, 60_000);
        t.reserve_with_prefill(2, "a", 50, 0, 1_200, 60_000);
        // After the scrape: everything counts.
        t.reserve_with_prefill(3, "a", 30, 20, 1_600, 60_000);
        let scraped = |id: &str| (id == "a").then_some(1_500);
        assert_eq!(
            t.unseen_totals(2_000, scraped)["a"],
            InFlight {
                requests: 1,
                tokens: 30,
                prefill_tokens: 100,
            }
        );
        t.first_token(3);
        assert_eq!(
            t.unseen_totals(2_000, scraped)["a"],
            InFlight {
                requests: 1,
                tokens: 30,
                prefill_tokens: 80,
            }
        );
        t.first_token(1);
        t.release(3);
        // Nothing unseen left on a: no entry at all.
        assert!(t.unseen_totals(2_000, scraped).is_empty());
        // Expired reservations carry no prefill.
        t.reserve_with_prefill(4, "a", 1, 1, 1_600, 100);
        assert!(t.unseen_totals(1_700, scraped).is_empty());
        // Tables written before `prefill_tokens` existed decode with 0.
        let old = br#"{"entries":{"9":{"endpoint":"a","tokens":5,"expires_at_ms":99999,"reserved_at_ms":1600}},"max_entries":4}"#;
        let t = InflightTable::decode(old).unwrap();
        assert_eq!(
            t.unseen_totals(2_000, scraped)["a"],
            InFlight {
                requests: 1,
                tokens: 5,
                prefill_tokens: 0,
            }
        );
    }

    #[test]
    fn full_table_evicts_the_earliest_expiry() {
        let mut t = InflightTable::new(2);
        t.reserve(1, "a", 1, 100, 10);
        t.reserve(2, "a", 2, 0, 10);
        let ev = t.reserve(3, "b", 3, 200, 10);
        assert_eq!(ev.map(|(k, _)| k), Some(2));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn adjust_changes_tokens_of_held_ids_only() {
        let mut t = InflightTable::default();
        t.reserve(1, "a", 100, 0, 1000);
        assert!(t.adjust(1, 40));
        assert!(!t.adjust(9, 40));
        assert_eq!(t.totals(0)["a"].tokens, 40);
    }

    #[test]
    fn encode_decode_roundtrip_and_errors() {
        let mut t = InflightTable::new(5);
        t.reserve(u64::MAX, "pool/x", 3, 1, 2);
        let back = InflightTable::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(
            InflightTable::decode(b"").unwrap(),
            InflightTable::default()
        );
        assert!(matches!(
            InflightTable::decode(b"{nope"),
            Err(InflightError::Decode(_))
        ));
    }

    #[test]
    fn binary_layout_is_exact_and_rejects_damage() {
        let mut t = InflightTable::new(7);
        t.reserve_with_prefill(2, "pool/b", 10, 4, 100, 50);
        t.reserve_with_prefill(1, "pool/a", 20, 0, 100, 50);
        t.reserve_with_prefill(3, "pool/a", 30, 6, 110, 50);
        let b = t.encode();
        // magic + max_entries + 2 names (2+6 each) + row count + 3 rows.
        assert_eq!(b.len(), 4 + 4 + 2 + 2 * 8 + 4 + 3 * ROW_BYTES);
        assert_eq!(&b[..4], WIRE_MAGIC);
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 7);
        assert_eq!(InflightTable::decode(&b).unwrap(), t);
        for cut in 1..b.len() {
            assert!(InflightTable::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(InflightTable::decode(&extra).is_err());
        assert!(InflightTable::decode(b"KVI9\0\0\0\0").is_err());
        // Tables written as JSON by an earlier filter still decode.
        let json = serde_json::to_vec(&t).unwrap();
        assert_eq!(InflightTable::decode(&json).unwrap(), t);
    }

    proptest! {
        #[test]
        fn binary_roundtrip(rows in proptest::collection::vec((any::<u64>(), "[a-z/0-9é]{0,12}", any::<u64>(), any::<u64>(), any::<u64>()), 0..40)) {
            let mut t = InflightTable::new(1000);
            for (id, ep, tokens, prefill, now) in rows {
                t.reserve_with_prefill(id, &ep, tokens, prefill, now, 7);
            }
            prop_assert_eq!(InflightTable::decode(&t.encode()).unwrap(), t);
        }

        /// Any interleaving of reserves and (double) releases leaves totals equal to the
        /// sum of the still-held reservations, and releasing everything leaves nothing.
        #[test]
        fn prefill_totals_match_live_entries(
            ops in proptest::collection::vec((0u64..20, 0u8..3, 0u64..1000, 0u8..4), 0..200),
            scrape in 0u64..200,
        ) {
            let mut t = InflightTable::default();
            // id → (endpoint, kv tokens, pending prefill, reserved at)
            let mut model: BTreeMap<u64, (String, u64, u64, u64)> = BTreeMap::new();
            for (step, (id, ep, tokens, op)) in ops.into_iter().enumerate() {
                let now = step as u64;
                match op {
                    0 => {
                        let got = t.release(id).map(|r| r.prefill_tokens);
                        prop_assert_eq!(got, model.remove(&id).map(|m| m.2));
                    }
                    1 => {
                        let got = t.first_token(id);
                        let want = model.get_mut(&id).map(|m| std::mem::take(&mut m.2));
                        prop_assert_eq!(got, want);
                    }
                    _ => {
                        let ep = format!("e{ep}");
                        let prefill = tokens / 2;
                        t.reserve_with_prefill(id, &ep, tokens, prefill, now, 1_000_000);
                        model.insert(id, (ep, tokens, prefill, now));
                    }
                }
                let tot = t.totals(now);
                let unseen = t.unseen_totals(now, |_| Some(scrape));
                for e in ["e0", "e1", "e2"] {
                    let live = model.values().filter(|m| m.0 == e);
                    let want: u64 = live.clone().map(|m| m.2).sum();
                    let got = tot.get(e).map_or(0, |v| v.prefill_tokens);
                    prop_assert_eq!(got, want);
                    // Pending prefill is counted whatever the scrape age.
                    let got = unseen.get(e).map_or(0, |v| v.prefill_tokens);
                    prop_assert_eq!(got, want);
                    let want_unseen: u64 = live.filter(|m| m.3 >= scrape).map(|m| m.1).sum();
                    prop_assert_eq!(unseen.get(e).map_or(0, |v| v.tokens), want_unseen);
                }
            }
            for id in model.keys() {
                prop_assert!(t.release(*id).is_some());
            }
            prop_assert!(t.totals(0).is_empty());
        }

        #[test]
        fn totals_match_held(ops in proptest::collection::vec((0u64..20, 0u8..3, 0u64..1000), 0..200)) {
            let mut t = InflightTable::default();
            let mut model: BTreeMap<u64, (String, u64)> = BTreeMap::new();
            for (id, ep, tokens) in ops {
                if tokens % 3 == 0 {
                    let got = t.release(id).map(|r| r.tokens);
                    prop_assert_eq!(got, model.remove(&id).map(|m| m.1));
                } else {
                    let ep = format!("e{ep}");
                    t.reserve(id, &ep, tokens, 0, 1000);
                    model.insert(id, (ep, tokens));
                }
                let tot = t.totals(0);
                let sum: u64 = tot.values().map(|v| v.tokens).sum();
                prop_assert_eq!(sum, model.values().map(|m| m.1).sum::<u64>());
                let reqs: u32 = tot.values().map(|v| v.requests).sum();
                prop_assert_eq!(reqs as usize, model.len());
            }
            for id in model.keys() {
                prop_assert!(t.release(*id).is_some());
            }
            prop_assert!(t.totals(0).is_empty());
        }
    }
}
