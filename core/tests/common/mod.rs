//! Helpers shared by the integration tests: locating `../shared/data`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)] // test code: fail loudly
#![allow(dead_code)]

use std::path::PathBuf;

/// The shared fixture directory: `$KVROUTE_SHARED_DATA`, else `<workspace>/../shared/data`.
pub fn shared_data() -> PathBuf {
    kvroute_core::shared_data::dir()
}

/// Read a fixture file, failing the test with a clear message when it is missing.
pub fn read(rel: &str) -> Vec<u8> {
    let p = shared_data().join(rel);
    std::fs::read(&p).unwrap_or_else(|e| {
        panic!(
            "cannot read fixture {}: {e} (set KVROUTE_SHARED_DATA)",
            p.display()
        )
    })
}

/// Sorted file names in a fixture sub-directory.
pub fn list(rel: &str) -> Vec<String> {
    let p = shared_data().join(rel);
    let mut v: Vec<String> = std::fs::read_dir(&p)
        .unwrap_or_else(|e| panic!("cannot list {}: {e} (set KVROUTE_SHARED_DATA)", p.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Make a JSON text with invalid `\u` escapes parseable. The shared ShareGPT file had its
/// e-mail addresses replaced after escaping, which turned `\n@app.route` style sequences into
/// `\user@example.com` (an invalid `\u` escape; see `../shared/data/README.md`). Such a
/// backslash is doubled so the text reads as a literal backslash.
pub fn fix_invalid_escapes(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    let mut last = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            let next = b.get(i + 1).copied();
            if next == Some(b'u') {
                let ok = b.len() >= i + 6 && b[i + 2..i + 6].iter().all(|c| c.is_ascii_hexdigit());
                if !ok {
                    out.push_str(&s[last..i]);
                    out.push_str("\\\\");
                    last = i + 1;
                }
            }
            i += 2;
        } else {
            i += 1;
        }
    }
    out.push_str(&s[last..]);
    out
}

/// Every prompt text in `prompts/`: the human turns of `sharegpt_v3_filtered_1000.json` and
/// the `input` of each LMBenchmark multi-round entry. Returns (source file, text).
pub fn all_prompts() -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let sg = String::from_utf8(read("prompts/sharegpt_v3_filtered_1000.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&fix_invalid_escapes(&sg)).unwrap();
    for conv in v.as_array().unwrap() {
        for turn in conv["conversations"].as_array().unwrap() {
            if turn["from"] == "human" {
                out.push((
                    "sharegpt_v3_filtered_1000",
                    turn["value"].as_str().unwrap().to_string(),
                ));
            }
        }
    }
    for (name, f) in [
        (
            "lmbenchmark_run",
            "prompts/lmbenchmark_sharegpt_multiround_run.json",
        ),
        (
            "lmbenchmark_warmup",
            "prompts/lmbenchmark_sharegpt_multiround_warmup.json",
        ),
    ] {
        let s = String::from_utf8(read(f)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&fix_invalid_escapes(&s)).unwrap();
        for e in v.as_array().unwrap() {
            out.push((name, e["input"].as_str().unwrap().to_string()));
        }
    }
    out
}
