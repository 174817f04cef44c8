//! A header map as one proxy-wasm host call returns it, read in place.
//!
//! `proxy_get_header_map_pairs` hands the module one buffer in the ABI's serialized layout
//! (proxy-wasm ABI v0.2.1, "Serialized maps";
//! <https://github.com/proxy-wasm/spec/tree/main/abi-versions/v0.2.1>): a little-endian `u32`
//! count *n*; *n* pairs of little-endian `u32` lengths (name, value); then each name and
//! each value in that order, each followed by a NUL byte.
//!
//! [`HeaderMap`] looks names up in that buffer instead of copying every pair into its own
//! `(String, String)` as the SDK's `get_http_request_headers` does. That copy cost two
//! allocations per header (~20 per request), and its `String::from_utf8(..).unwrap()`
//! panicked on a value that is not UTF-8: HTTP allows such bytes in a field value
//! (obs-text, RFC 9110 §5.5) and Envoy passes them on, so one request with a Latin-1 header
//! killed the Wasm VM of its worker for every request after it. Here values are bytes;
//! whoever needs text checks it.

/// Serialized header map ([module doc](self)). A malformed buffer (truncated, or lengths
/// past its end) reads as the pairs before the first bad one: lookups never panic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    raw: Vec<u8>,
}

/// Little-endian `u32` at `at` in `b`, as a length.
fn len_at(b: &[u8], at: usize) -> Option<usize> {
    let w: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(w)).ok()
}

impl HeaderMap {
    /// A map over `raw`, the host's serialized buffer (empty: no headers).
    pub fn from_serialized(raw: Vec<u8>) -> Self {
        Self { raw }
    }

    /// Serialize `pairs` in the host's layout: the native module's header reads (which get
    /// Envoy's headers as pairs), the mock host and tests.
    /// The pairs are walked three times (sizes, lengths, bytes), so the buffer is sized
    /// once and nothing else is allocated: grown by doubling, a request's ~10 headers took
    /// ~7 reallocations (~2 k instructions of the native module's request), and a list of
    /// the pairs collected first one allocation more (callgrind).
    pub fn from_pairs<'a, I>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (&'a [u8], &'a [u8])>,
        I::IntoIter: Clone,
    {
        let pairs = pairs.into_iter();
        let (count, text) = pairs.clone().fold((0usize, 0usize), |(n, t), (k, v)| {
            (n + 1, t + k.len() + v.len() + 2)
        });
        let mut raw = Vec::with_capacity(4 + 8 * count + text);
        let n = u32::try_from(count).unwrap_or(u32::MAX);
        raw.extend_from_slice(&n.to_le_bytes());
        for (k, v) in pairs.clone() {
            for s in [k, v] {
                let l = u32::try_from(s.len()).unwrap_or(u32::MAX);
                raw.extend_from_slice(&l.to_le_bytes());
            }
        }
        for (k, v) in pairs {
            for s in [k, v] {
                raw.extend_from_slice(s);
                raw.push(0);
            }
        }
        Self { raw }
    }

    /// The serialized buffer ([module doc](self)), as the host takes a map
    /// (`proxy_send_local_response`'s headers).
    pub fn as_bytes(&self) -> &[u8] {
        &self.raw
    }

    /// The `(name, value)` pairs in the host's order, up to the first malformed one.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let b = self.raw.as_slice();
        let n = len_at(b, 0).unwrap_or(0);
        // Where the names and values start: after the count and the length table.
        let mut data = n.checked_mul(8).and_then(|t| t.checked_add(4));
        (0..n).map_while(move |i| {
            let entry = i.checked_mul(8)?.checked_add(4)?;
            let (kl, vl) = (len_at(b, entry)?, len_at(b, entry.checked_add(4)?)?);
            let k_at = data?;
            let k_end = k_at.checked_add(kl)?;
            let v_at = k_end.checked_add(1)?;
            let v_end = v_at.checked_add(vl)?;
            let pair = (b.get(k_at..k_end)?, b.get(v_at..v_end)?);
            data = v_end.checked_add(1);
            Some(pair)
        })
    }

    /// Value of the first header named `name` (ASCII case-insensitive, as HTTP names
    /// are), as bytes; `None` when absent.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        let name = name.as_bytes();
        self.iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// The values of several headers in one walk over the map: item *i* is the first
    /// value of `names[i]` (ASCII case-insensitive), `None` when absent. One walk instead
    /// of one per name: the request-header callback looks up nine names, and a lookup
    /// walks the pairs up to its name (all of them for an absent one): ~300 instructions
    /// each in the native module (callgrind, 1 KiB request).
    pub fn get_all<const N: usize>(&self, names: [&str; N]) -> [Option<&[u8]>; N] {
        let mut out = [None; N];
        let mut left = N;
        for (k, v) in self.iter() {
            for (slot, name) in out.iter_mut().zip(names) {
                if slot.is_none()
                    && k.len() == name.len()
                    && k.eq_ignore_ascii_case(name.as_bytes())
                {
                    *slot = Some(v);
                    left -= 1;
                }
            }
            if left == 0 {
                break;
            }
        }
        out
    }

    /// [`Self::get`] as text: `None` when absent or not UTF-8.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.get(name)?).ok()
    }
}

/// Whether a `content-encoding` value encodes the body: anything but empty (or blank) and
/// `identity` (any case; RFC 9110 §8.4.1). Both the request path (an encoded body is routed
/// by load, unread) and the ingest listener (415) ask this; an empty value counted as
/// encoded until a breaker sent `content-encoding:` with nothing after it.
pub fn encodes(value: &[u8]) -> bool {
    let v = value.trim_ascii();
    !v.is_empty() && !v.eq_ignore_ascii_case(b"identity")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn map(pairs: &[(&str, &[u8])]) -> HeaderMap {
        HeaderMap::from_pairs(pairs.iter().map(|(k, v)| (k.as_bytes(), *v)))
    }

    /// The layout byte for byte, as Envoy writes it: two pairs.
    /// One walk finds what one lookup per name finds: the first of repeated names, any
    /// case, absent names `None`, a name asked twice found twice.
    #[test]
    fn get_all_is_get_per_name() {
        let m = map(&[
            (":path", b"/v1"),
            ("Content-Length", b"12"),
            ("x-a", b"1"),
            ("X-A", b"2"),
            ("upgrade", b""),
        ]);
        let names = [
            ":path",
            "content-length",
            "x-a",
            "absent",
            "UPGRADE",
            "x-a",
            "",
        ];
        let want = names.map(|n| m.get(n));
        assert_eq!(m.get_all(names), want);
        assert_eq!(
            want,
            [
                Some(&b"/v1"[..]),
                Some(&b"12"[..]),
                Some(&b"1"[..]),
                None,
                Some(&b""[..]),
                Some(&b"1"[..]),
                None
            ]
        );
        assert_eq!(HeaderMap::default().get_all([":path"]), [None]);
    }

    #[test]
    fn the_serialized_layout_is_the_abis() {
        let m = map(&[(":path", b"/v1"), ("a", b"")]);
        let mut want = Vec::new();
        for w in [2u32, 5, 3, 1, 0] {
            want.extend_from_slice(&w.to_le_bytes());
        }
        want.extend_from_slice(b":path\0/v1\0a\0\0");
        assert_eq!(m.raw, want);
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            [(&b":path"[..], &b"/v1"[..]), (&b"a"[..], &b""[..])]
        );
    }

    #[test]
    fn lookups_ignore_case_take_the_first_and_keep_bytes() {
        let m = map(&[
            ("Content-Length", b"12"),
            ("x-latin1", &[0x63, 0x61, 0x66, 0xe9]),
            ("content-length", b"99"),
        ]);
        assert_eq!(m.get("content-length"), Some(&b"12"[..]));
        assert_eq!(m.get_str("CONTENT-LENGTH"), Some("12"));
        assert_eq!(m.get("x-latin1"), Some(&[0x63, 0x61, 0x66, 0xe9][..]));
        assert_eq!(m.get_str("x-latin1"), None, "not UTF-8: no text");
        assert_eq!(m.get("absent"), None);
        assert_eq!(HeaderMap::default().get(":path"), None);
    }

    /// A buffer cut anywhere, or with a length past its end, reads as the whole pairs
    /// before the damage.
    #[test]
    fn a_damaged_buffer_reads_as_the_pairs_before_the_damage() {
        let whole = map(&[("a", b"1"), ("bb", b"22")]);
        for cut in 0..whole.raw.len() {
            let m = HeaderMap::from_serialized(whole.raw.get(..cut).unwrap_or_default().to_vec());
            let got: Vec<_> = m.iter().collect();
            // Pairs start after 4 + 2 × 8 bytes of lengths: "a" at 20, "1" at 22, "bb" at
            // 24..26, "22" at 27..29 (a value's closing NUL is not needed to read it).
            let want = match cut {
                0..=22 => 0,
                23..=28 => 1,
                _ => 2,
            };
            assert_eq!(got.len(), want, "cut at {cut}");
        }
        let mut huge = whole.raw.clone();
        if let Some(b) = huge.get_mut(12..16) {
            b.copy_from_slice(&u32::MAX.to_le_bytes());
        }
        let m = HeaderMap::from_serialized(huge);
        assert_eq!(m.iter().count(), 1);
        assert_eq!(m.get("bb"), None);
    }

    proptest! {
        /// Whatever pairs are serialized are read back in order, and a lookup finds the
        /// first pair of its name.
        #[test]
        fn pairs_read_back_as_written(
            pairs in proptest::collection::vec(
                ("[a-zA-Z:-]{1,12}", proptest::collection::vec(any::<u8>(), 0..40)),
                0..12,
            )
        ) {
            let m = HeaderMap::from_pairs(pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())));
            let got: Vec<_> = m.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            let want: Vec<_> = pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.clone())).collect();
            prop_assert_eq!(got, want);
            for (k, _) in &pairs {
                let first = pairs.iter().find(|(k2, _)| k2.eq_ignore_ascii_case(k)).map(|(_, v)| v.as_slice());
                prop_assert_eq!(m.get(k), first);
            }
        }

        /// Any bytes at all: reading never panics, and finds nothing past the buffer.
        #[test]
        fn any_bytes_read_without_panic(raw in proptest::collection::vec(any::<u8>(), 0..200)) {
            let m = HeaderMap::from_serialized(raw.clone());
            let total: usize = m.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
            prop_assert!(total <= raw.len());
            let _ = m.get(":path");
        }
    }
}
