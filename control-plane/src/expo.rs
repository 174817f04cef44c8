//! Prometheus text exposition format (0.0.4) reader.
//!
//! Reads the sample lines of a `/metrics` body into [`Sample`]s: metric name, labels, value.
//! `# HELP` / `# TYPE` and other comments are skipped (the adapters key on names, not types:
//! llama.cpp declares ratios as counters, TGI omits HELP lines). Timestamps are accepted
//! and dropped.
//!
//! Grammar (<https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format>):
//! `name{label="value",...} value [timestamp]`, names `[a-zA-Z_:][a-zA-Z0-9_:]*` (the colon
//! matters: `vllm:kv_cache_usage_perc`), label values with `\\`, `\"` and `\n` escapes and any
//! other character (commas included: `running_lora_adapters="a,b"`), values as Go
//! `ParseFloat` (including `+Inf`, `-Inf`, `NaN`).
//!
//! Like Prometheus itself, one malformed line fails the whole body ([`ExpoError`]): a
//! half-read exposition could report a missing KV gauge as present-but-stale. (With
//! [`Exposition::parse_with`], lines that are not kept get a lighter check.)
//!
//! Why not a crate: `prometheus-parse` 0.2.5 (the usual choice) matches names with `\w+`,
//! so it silently drops every `vllm:`/`sglang:`/`llamacpp:` sample, and splits labels on
//! `,`, corrupting LoRA adapter lists. The test `prometheus_parse_drops_colon_names` pins
//! that; the README records the evaluation.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `vllm:num_requests_running` or `tgi_queue_size`.
    pub name: String,
    /// Labels in exposition order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// Sample value.
    pub value: f64,
}

impl Sample {
    /// Value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A parsed `/metrics` body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    /// All samples in body order.
    pub samples: Vec<Sample>,
}

/// Why a body is not a valid exposition.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExpoError {
    /// A sample line does not follow the grammar.
    #[error("line {line}: {reason}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// The body is not UTF-8.
    #[error("body is not UTF-8")]
    NotUtf8,
}

impl Exposition {
    /// Parse bytes (must be UTF-8).
    pub fn parse_bytes(body: &[u8]) -> Result<Self, ExpoError> {
        let text = std::str::from_utf8(body).map_err(|_| ExpoError::NotUtf8)?;
        Self::parse(text)
    }

    /// Parse a text body. Errors on the first malformed sample line.
    pub fn parse(text: &str) -> Result<Self, ExpoError> {
        Self::parse_with(text, |_| true)
    }

    /// Parse a text body, keeping only samples whose name passes `keep`. Kept lines are
    /// checked against the whole grammar; skipped lines only for a valid name followed by
    /// `{` or whitespace, and allocate nothing. The scrape path keeps the few dozen
    /// families the adapters read out of hundreds of histogram lines
    /// ([`crate::adapters::is_relevant`]); garbage (HTML, JSON) still fails on its first line.
    pub fn parse_with(text: &str, keep: impl Fn(&str) -> bool) -> Result<Self, ExpoError> {
        let mut samples = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let sample = parse_line(line, &keep).map_err(|reason| ExpoError::Malformed {
                line: i + 1,
                reason,
            })?;
            if let Some(sample) = sample {
                samples.push(sample);
            }
        }
        Ok(Self { samples })
    }

    /// Samples named exactly `name`.
    pub fn family<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// Whether any sample is named `name`.
    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }

    /// Whether any sample name starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.samples.iter().any(|s| s.name.starts_with(prefix))
    }

    /// Sum of the finite values of family `name`; `None` when the family is absent.
    pub fn sum(&self, name: &str) -> Option<f64> {
        let mut found = false;
        let mut total = 0.0;
        for s in self.family(name) {
            found = true;
            if s.value.is_finite() {
                total += s.value;
            }
        }
        found.then_some(total)
    }

    /// Value of the first sample of `name` whose label `key` equals `value`.
    pub fn labelled(&self, name: &str, key: &str, value: &str) -> Option<f64> {
        self.family(name)
            .find(|s| s.label(key) == Some(value))
            .map(|s| s.value)
    }
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

fn parse_line(line: &str, keep: &impl Fn(&str) -> bool) -> Result<Option<Sample>, &'static str> {
    let bytes = line.as_bytes();
    match bytes.first() {
        Some(&c) if is_name_start(c) => {}
        _ => return Err("metric name must start with a letter, `_` or `:`"),
    }
    let mut pos = bytes
        .iter()
        .position(|&c| !is_name_char(c))
        .unwrap_or(bytes.len());
    let name = line.get(..pos).ok_or("bad metric name")?;
    let kept = keep(name);
    if !kept {
        // Lines nobody reads (hundreds of histogram buckets) are only checked for a valid
        // name followed by labels or a value: this keeps a 1,000-endpoint fleet cheap.
        return match bytes.get(pos) {
            Some(b'{' | b' ' | b'\t') => Ok(None),
            _ => Err("expected `{` or whitespace after the metric name"),
        };
    }
    let mut labels = Vec::new();
    if bytes.get(pos) == Some(&b'{') {
        pos += 1;
        loop {
            skip_ws(bytes, &mut pos);
            match bytes.get(pos) {
                Some(b'}') => {
                    pos += 1;
                    break;
                }
                Some(&c) if is_name_start(c) && c != b':' => {}
                _ => return Err("expected a label name or `}`"),
            }
            let start = pos;
            while bytes
                .get(pos)
                .is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_')
            {
                pos += 1;
            }
            let key = line.get(start..pos).ok_or("bad label name")?;
            skip_ws(bytes, &mut pos);
            if bytes.get(pos) != Some(&b'=') {
                return Err("expected `=` after label name");
            }
            pos += 1;
            skip_ws(bytes, &mut pos);
            if bytes.get(pos) != Some(&b'"') {
                return Err("label value must be quoted");
            }
            pos += 1;
            // Scan bytes: `"` and `\` never occur inside a multi-byte UTF-8 sequence.
            let vstart = pos;
            let mut escaped = false;
            loop {
                match bytes.get(pos) {
                    None => return Err("unterminated label value"),
                    Some(b'"') => break,
                    Some(b'\\') => {
                        if bytes.get(pos + 1).is_none() {
                            return Err("unterminated label value");
                        }
                        escaped = true;
                        pos += 2;
                    }
                    Some(_) => pos += 1,
                }
            }
            let raw = line.get(vstart..pos).ok_or("bad label value")?;
            pos += 1;
            if kept {
                let value = if escaped {
                    unescape(raw)
                } else {
                    raw.to_owned()
                };
                labels.push((key.to_owned(), value));
            }
            skip_ws(bytes, &mut pos);
            match bytes.get(pos) {
                Some(b',') => pos += 1,
                Some(b'}') => {}
                _ => return Err("expected `,` or `}` after label value"),
            }
        }
    }
    let rest = line.get(pos..).ok_or("missing value")?;
    if !rest.starts_with([' ', '\t']) {
        return Err("expected whitespace before the value");
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next().ok_or("missing value")?)?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| "timestamp is not an integer")?;
    }
    if fields.next().is_some() {
        return Err("unexpected text after the timestamp");
    }
    Ok(kept.then(|| Sample {
        name: name.to_owned(),
        labels,
        value,
    }))
}

/// Undo the text format's label-value escapes (`\\`, `\"`, `\n`); other backslashes stay.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    out
}

fn skip_ws(bytes: &[u8], pos: &mut usize) {
    while bytes.get(*pos).is_some_and(|c| *c == b' ' || *c == b'\t') {
        *pos += 1;
    }
}

fn parse_value(s: &str) -> Result<f64, &'static str> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| "value is not a number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colon_names_labels_and_escapes() {
        let e = Exposition::parse(
            "# HELP x y\n# TYPE vllm:a gauge\nvllm:a{engine=\"0\",m=\"a,b=c\"} 0.5\n\
             b{v=\"q\\\"\\\\\\n\"} +Inf 1700000000000\nc 1e3\n",
        )
        .unwrap();
        assert_eq!(e.samples.len(), 3);
        assert_eq!(e.samples[0].name, "vllm:a");
        assert_eq!(
            e.samples[0].labels,
            vec![("engine".into(), "0".into()), ("m".into(), "a,b=c".into())]
        );
        assert_eq!(e.samples[0].value, 0.5);
        assert_eq!(e.samples[1].label("v"), Some("q\"\\\n"));
        assert_eq!(e.samples[1].value, f64::INFINITY);
        assert_eq!(e.samples[2].value, 1000.0);
        assert_eq!(e.sum("c"), Some(1000.0));
        assert_eq!(e.sum("d"), None);
    }

    #[test]
    fn malformed_lines_name_the_line() {
        assert_eq!(
            Exposition::parse("a 1\n<html>oops</html>\n"),
            Err(ExpoError::Malformed {
                line: 2,
                reason: "metric name must start with a letter, `_` or `:`"
            })
        );
        assert_eq!(
            Exposition::parse("a{b=\"c} 1"),
            Err(ExpoError::Malformed {
                line: 1,
                reason: "unterminated label value"
            })
        );
        assert_eq!(
            Exposition::parse("a one"),
            Err(ExpoError::Malformed {
                line: 1,
                reason: "value is not a number"
            })
        );
        assert_eq!(
            Exposition::parse_bytes(&[0xff, 0xfe]),
            Err(ExpoError::NotUtf8)
        );
    }

    #[test]
    fn filtered_parse_keeps_only_wanted_names_and_still_rejects_garbage() {
        let body = "a_bucket{le=\"1\"} 3\nb{x=\"y\"} 2\n";
        let e = Exposition::parse_with(body, |n| n == "b").unwrap();
        assert_eq!(e.samples.len(), 1);
        assert_eq!(e.samples[0].label("x"), Some("y"));
        assert_eq!(
            Exposition::parse_with("<html>", |n| n == "b"),
            Err(ExpoError::Malformed {
                line: 1,
                reason: "metric name must start with a letter, `_` or `:`"
            })
        );
        assert_eq!(
            Exposition::parse_with("a_bucket=3", |n| n == "b"),
            Err(ExpoError::Malformed {
                line: 1,
                reason: "expected `{` or whitespace after the metric name"
            })
        );
    }

    #[test]
    fn empty_body_has_no_samples() {
        assert_eq!(Exposition::parse("").unwrap().samples.len(), 0);
    }

    /// The evaluated crate loses every colon-named sample, so it cannot read vLLM/SGLang.
    #[test]
    fn prometheus_parse_drops_colon_names() {
        let body = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 24.0\nplain 1\n";
        let lines = body.lines().map(|l| Ok(l.to_owned()));
        let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
        let names: Vec<&str> = scrape.samples.iter().map(|s| s.metric.as_str()).collect();
        assert_eq!(names, vec!["plain"]);
        let ours = Exposition::parse(body).unwrap();
        assert_eq!(ours.sum("vllm:num_requests_running"), Some(24.0));
    }
}
