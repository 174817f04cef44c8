//! Prometheus text format 0.0.4 and OpenMetrics 1.0 text format reader.
//!
//! Reads the sample lines of a `/metrics` body into [`Sample`]s: metric name, labels,
//! value, optional timestamp. What both formats allow is accepted:
//! - names `[a-zA-Z_:][a-zA-Z0-9_:]*` (the colon matters: `vllm:kv_cache_usage_perc`);
//! - label values with the `\\`, `\"` and `\n` escapes and any other character (commas
//!   included: `running_lora_adapters="a,b"`); whitespace around labels (0.0.4) and a
//!   trailing comma (`{a="b",}`);
//! - values as Go's `ParseFloat` writes them, including `NaN`, `+Inf`, `-Inf` (any case);
//! - a timestamp: integer milliseconds (0.0.4) or float seconds (OpenMetrics:
//!   `… 0.25 1754832641.771`);
//! - an exemplar after the value (`… 34567503 # {trace_id="0af7"} 1.0 1754832641.5`),
//!   read past and dropped;
//! - `# HELP`, `# TYPE`, `# UNIT` and other comments (skipped: the adapters key on names,
//!   not types; llama.cpp declares ratios as counters, TGI omits HELP lines);
//! - `# EOF` ends the exposition (OpenMetrics: nothing may follow it);
//! - `_created` series are ordinary samples (vLLM's adapter reads one).
//!
//! Sources: <https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format>,
//! <https://github.com/prometheus/OpenMetrics/blob/v1.0.0/specification/OpenMetrics.md>.
//!
//! **A line kvroute does not understand never rejects the whole scrape.** Unlike
//! Prometheus, which drops a whole target on one bad line, each malformed line is skipped
//! and counted ([`Exposition::skipped`], [`Exposition::first_skipped`]); the rest of the
//! body is read. A KV gauge on a good line must not be lost over an unrelated histogram
//! a server got wrong. Only a body where *no* line is a sample or comment (HTML, JSON)
//! is an error ([`ExpoError::NotAnExposition`]), so a wrong `metrics_url` still shows as
//! one clear error instead of an empty, healthy-looking server. Lines that are not UTF-8
//! are skipped like malformed ones.
//!
//! Cost: the body is scanned as bytes, line ends found with `memchr`. With
//! [`Exposition::parse_bytes_with`], a line whose name the caller does not keep is
//! checked only for a valid name followed by `{` or whitespace, and allocates nothing;
//! the scrape path keeps the few dozen families the adapters read out of hundreds of
//! histogram lines ([`crate::adapters::is_relevant`]).
//!
//! Why not a crate: `prometheus-parse` 0.2.5 matches names with `\w+`, so it silently drops
//! every `vllm:`/`sglang:`/`llamacpp:` sample, and splits labels on `,`, corrupting LoRA
//! adapter lists (test `prometheus_parse_drops_colon_names`). `openmetrics-parser` 0.5
//! builds typed families and rejects a whole body over one histogram without a `+Inf`
//! bucket (`tests/parser_eval.rs`). Both serve as the reference in the differential
//! property test `tests/expo_diff.rs`.

use memchr::memchr;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `vllm:num_requests_running` or `tgi_queue_size`.
    pub name: String,
    /// Labels in exposition order, values unescaped.
    pub labels: Vec<(String, String)>,
    /// Sample value.
    pub value: f64,
    /// Timestamp as written: milliseconds (0.0.4) or seconds (OpenMetrics); the format
    /// does not say which, and kvroute does not use it.
    pub timestamp: Option<f64>,
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
    /// All kept samples in body order.
    pub samples: Vec<Sample>,
    /// Lines skipped as malformed (or not UTF-8).
    pub skipped: usize,
    /// The first skipped line: 1-based line number and what is wrong with it.
    pub first_skipped: Option<(usize, &'static str)>,
}

/// Why a body is not an exposition at all.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExpoError {
    /// Not one line is a sample or a comment; names the first bad line.
    #[error("no line is a metric sample; line {line}: {reason}")]
    NotAnExposition {
        /// 1-based line number of the first malformed line.
        line: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl Exposition {
    /// Parse bytes, keeping every sample.
    pub fn parse_bytes(body: &[u8]) -> Result<Self, ExpoError> {
        Self::parse_bytes_with(body, |_| true)
    }

    /// Parse a text body, keeping every sample.
    pub fn parse(text: &str) -> Result<Self, ExpoError> {
        Self::parse_bytes_with(text.as_bytes(), |_| true)
    }

    /// Parse a text body, keeping only samples whose name passes `keep`.
    pub fn parse_with(text: &str, keep: impl Fn(&str) -> bool) -> Result<Self, ExpoError> {
        Self::parse_bytes_with(text.as_bytes(), keep)
    }

    /// Parse bytes, keeping only samples whose name passes `keep` (see the module docs for
    /// what is accepted and what a skipped line costs). Errors only when no line at all is
    /// a sample or a comment.
    pub fn parse_bytes_with(body: &[u8], keep: impl Fn(&str) -> bool) -> Result<Self, ExpoError> {
        let mut out = Self::default();
        let mut good = 0usize;
        let mut rest = body;
        let mut line_no = 0usize;
        while !rest.is_empty() {
            line_no += 1;
            let (line, next) = match memchr(b'\n', rest) {
                Some(i) => (
                    rest.get(..i).unwrap_or_default(),
                    rest.get(i + 1..).unwrap_or_default(),
                ),
                None => (rest, &[][..]),
            };
            rest = next;
            let line = trim(line);
            match line.first() {
                None => continue,
                Some(b'#') => {
                    if line == b"# EOF" {
                        break;
                    }
                    good += 1;
                    continue;
                }
                Some(_) => {}
            }
            match parse_line(line, &keep) {
                Ok(sample) => {
                    good += 1;
                    if let Some(s) = sample {
                        out.samples.push(s);
                    }
                }
                Err(reason) => {
                    out.skipped += 1;
                    if out.first_skipped.is_none() {
                        out.first_skipped = Some((line_no, reason));
                    }
                }
            }
        }
        match out.first_skipped {
            Some((line, reason)) if good == 0 => Err(ExpoError::NotAnExposition { line, reason }),
            _ => Ok(out),
        }
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

    /// Sum of the finite values of family `name`, every sample counted; `None` when the
    /// family is absent. Adapters use [`crate::adapters::sum_ranks`] instead, which does
    /// not add up copies of one engine.
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

/// Strip leading/trailing spaces, tabs and a trailing `\r`.
fn trim(mut line: &[u8]) -> &[u8] {
    while let [b' ' | b'\t' | b'\r', rest @ ..] = line {
        line = rest;
    }
    while let [rest @ .., b' ' | b'\t' | b'\r'] = line {
        line = rest;
    }
    line
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_' || c == b':'
}

fn is_name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

fn is_label_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn utf8(b: &[u8]) -> Result<&str, &'static str> {
    std::str::from_utf8(b).map_err(|_| "not UTF-8")
}

/// A tiny cursor over one line.
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cur<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }
    fn ws(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b' ' | b'\t')) {
            self.pos += 1;
        }
        self.pos - start
    }
    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> &'a [u8] {
        let start = self.pos;
        while self.peek().is_some_and(&f) {
            self.pos += 1;
        }
        self.b.get(start..self.pos).unwrap_or_default()
    }
    /// A token up to the next space or tab.
    fn token(&mut self) -> &'a [u8] {
        self.take_while(|c| c != b' ' && c != b'\t')
    }
    /// `{name="value",...}` at the cursor; labels are collected when `out` is given.
    fn labels(&mut self, mut out: Option<&mut Vec<(String, String)>>) -> Result<(), &'static str> {
        if self.peek() != Some(b'{') {
            return Err("expected `{`");
        }
        self.pos += 1;
        loop {
            self.ws();
            match self.peek() {
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(());
                }
                Some(c) if c.is_ascii_alphabetic() || c == b'_' => {}
                _ => return Err("expected a label name or `}`"),
            }
            let key = self.take_while(is_label_char);
            self.ws();
            if self.peek() != Some(b'=') {
                return Err("expected `=` after label name");
            }
            self.pos += 1;
            self.ws();
            if self.peek() != Some(b'"') {
                return Err("label value must be quoted");
            }
            self.pos += 1;
            // Scan bytes: `"` and `\` never occur inside a multi-byte UTF-8 sequence.
            let vstart = self.pos;
            let mut escaped = false;
            loop {
                match self.peek() {
                    None => return Err("unterminated label value"),
                    Some(b'"') => break,
                    Some(b'\\') => {
                        if self.b.get(self.pos + 1).is_none() {
                            return Err("unterminated label value");
                        }
                        escaped = true;
                        self.pos += 2;
                    }
                    Some(_) => self.pos += 1,
                }
            }
            let raw = self.b.get(vstart..self.pos).unwrap_or_default();
            self.pos += 1;
            if let Some(out) = out.as_deref_mut() {
                let raw = utf8(raw)?;
                let value = if escaped {
                    unescape(raw)
                } else {
                    raw.to_owned()
                };
                out.push((utf8(key)?.to_owned(), value));
            }
            self.ws();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {}
                _ => return Err("expected `,` or `}` after label value"),
            }
        }
    }
}

fn parse_line(line: &[u8], keep: &impl Fn(&str) -> bool) -> Result<Option<Sample>, &'static str> {
    let mut c = Cur { b: line, pos: 0 };
    match c.peek() {
        Some(ch) if is_name_start(ch) => {}
        _ => return Err("metric name must start with a letter, `_` or `:`"),
    }
    let name = c.take_while(is_name_char);
    // ASCII by construction.
    let name = utf8(name)?;
    if !keep(name) {
        // Lines nobody reads (hundreds of histogram buckets) are only checked for a valid
        // name followed by labels or a value: this keeps a 1,000-endpoint fleet cheap.
        return match c.peek() {
            Some(b'{' | b' ' | b'\t') => Ok(None),
            _ => Err("expected `{` or whitespace after the metric name"),
        };
    }
    let mut labels = Vec::new();
    let mut gap = c.ws();
    if c.peek() == Some(b'{') {
        c.labels(Some(&mut labels))?;
        gap = c.ws();
    }
    if gap == 0 {
        return Err("expected whitespace before the value");
    }
    let value = parse_value(c.token())?;
    c.ws();
    let mut timestamp = None;
    if c.peek().is_some_and(|b| b != b'#') {
        timestamp = Some(parse_timestamp(c.token())?);
        c.ws();
    }
    if c.peek() == Some(b'#') {
        // Exemplar: `# {labels} value [timestamp]`.
        c.pos += 1;
        c.ws();
        c.labels(None).map_err(|_| "malformed exemplar")?;
        if c.ws() == 0 {
            return Err("malformed exemplar");
        }
        parse_value(c.token()).map_err(|_| "malformed exemplar")?;
        c.ws();
        if c.peek().is_some() {
            parse_timestamp(c.token()).map_err(|_| "malformed exemplar")?;
            c.ws();
        }
    }
    if c.peek().is_some() {
        return Err("unexpected text after the value");
    }
    Ok(Some(Sample {
        name: name.to_owned(),
        labels,
        value,
        timestamp,
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

/// A value as Go's `ParseFloat` accepts it (Rust's parser agrees on decimal and exponent
/// forms and on `inf`, `infinity`, `nan` in any case, with an optional sign).
fn parse_value(s: &[u8]) -> Result<f64, &'static str> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or("value is not a number")
}

/// A timestamp: integer milliseconds (0.0.4) or float seconds (OpenMetrics).
fn parse_timestamp(s: &[u8]) -> Result<f64, &'static str> {
    let t = std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or("timestamp is not a number")?;
    if t.is_finite() {
        Ok(t)
    } else {
        Err("timestamp is not a number")
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
        assert_eq!(e.samples[1].timestamp, Some(1.7e12));
        assert_eq!(e.samples[2].value, 1000.0);
        assert_eq!(e.sum("c"), Some(1000.0));
        assert_eq!(e.sum("d"), None);
        assert_eq!(e.skipped, 0);
    }

    /// The two lines of issue 14 that used to reject the whole scrape.
    #[test]
    fn float_timestamp_and_exemplar_are_read() {
        let e = Exposition::parse(concat!(
            "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25 1754832641.771\n",
            "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 34567503 # {trace_id=\"0af7\"} 1.0 1754832641.5\n",
            "vllm:prompt_tokens_created{engine=\"0\",model_name=\"m\"} 1754832000.25\n",
            "x_total 3 # {} 1\n",
            "# UNIT x seconds\n",
            "# EOF\n",
            "after_eof 1\n",
        ))
        .unwrap();
        assert_eq!(e.skipped, 0, "{:?}", e.first_skipped);
        assert_eq!(e.sum("vllm:kv_cache_usage_perc"), Some(0.25));
        assert_eq!(e.samples[0].timestamp, Some(1754832641.771));
        assert_eq!(e.sum("vllm:prompt_tokens_total"), Some(34567503.0));
        assert_eq!(e.samples[1].timestamp, None);
        assert_eq!(e.sum("vllm:prompt_tokens_created"), Some(1754832000.25));
        assert_eq!(e.sum("x_total"), Some(3.0));
        assert!(!e.has("after_eof"));
    }

    #[test]
    fn special_values_in_any_case_and_whitespace_forms() {
        let e = Exposition::parse(
            "a NaN\nb -Inf\nc +inf\nd nan\ne{ x = \"1\" , } 2\nf\t7\t8\r\n  g{} 9\n",
        )
        .unwrap();
        assert!(e.samples[0].value.is_nan());
        assert_eq!(e.samples[1].value, f64::NEG_INFINITY);
        assert_eq!(e.samples[2].value, f64::INFINITY);
        assert!(e.samples[3].value.is_nan());
        assert_eq!(e.samples[4].label("x"), Some("1"));
        assert_eq!(
            (e.samples[5].value, e.samples[5].timestamp),
            (7.0, Some(8.0))
        );
        assert_eq!(e.samples[6].value, 9.0);
        assert_eq!(e.skipped, 0);
    }

    /// A malformed line is skipped and counted; the rest of the body is read.
    #[test]
    fn malformed_lines_are_skipped_not_fatal() {
        let e = Exposition::parse(concat!(
            "a 1\n",
            "<html>oops</html>\n",
            "b{x=\"y} 1\n",
            "c one\n",
            "d 1 2 3\n",
            "e 1 # {bad} 1\n",
            "g 2\n",
        ))
        .unwrap();
        let names: Vec<&str> = e.samples.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["a", "g"]);
        assert_eq!(e.skipped, 5);
        assert_eq!(
            e.first_skipped,
            Some((2, "metric name must start with a letter, `_` or `:`"))
        );
        let bytes = b"a 1\nb{x=\"\xff\"} 2\n";
        let e = Exposition::parse_bytes(bytes).unwrap();
        assert_eq!(
            (e.samples.len(), e.first_skipped),
            (1, Some((2, "not UTF-8")))
        );
    }

    #[test]
    fn a_body_without_any_sample_line_is_an_error() {
        assert_eq!(
            Exposition::parse("<html>\n<body>oops</body>\n"),
            Err(ExpoError::NotAnExposition {
                line: 1,
                reason: "metric name must start with a letter, `_` or `:`"
            })
        );
        assert_eq!(
            Exposition::parse("{\"error\":\"x\"}"),
            Err(ExpoError::NotAnExposition {
                line: 1,
                reason: "metric name must start with a letter, `_` or `:`"
            })
        );
        assert_eq!(
            Exposition::parse_bytes(&[0xff, 0xfe]),
            Err(ExpoError::NotAnExposition {
                line: 1,
                reason: "metric name must start with a letter, `_` or `:`"
            })
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
            Err(ExpoError::NotAnExposition {
                line: 1,
                reason: "metric name must start with a letter, `_` or `:`"
            })
        );
        let e = Exposition::parse_with("a_bucket=3\nb 1", |n| n == "b").unwrap();
        assert_eq!(
            e.first_skipped,
            Some((1, "expected `{` or whitespace after the metric name"))
        );
        assert_eq!(e.sum("b"), Some(1.0));
    }

    #[test]
    fn empty_body_has_no_samples() {
        assert_eq!(Exposition::parse("").unwrap().samples.len(), 0);
        assert_eq!(Exposition::parse("# EOF\n").unwrap().samples.len(), 0);
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
