//! Differential property test of kvroute-cp's exposition reader against `openmetrics-parser`
//! (a pest grammar of both text formats) on generated expositions: every sample the
//! reference reads — name, labels, value (NaN, ±Inf included), timestamp — kvroute reads
//! the same, and nothing else. Generated: gauges, counters with `_total`, `_created` and
//! exemplars, unknown/untyped families, `# HELP`/`# TYPE`/`# UNIT`, `# EOF`, names with
//! colons, label values with escapes, commas, quotes and non-ASCII text, integer and float
//! timestamps. OpenMetrics 1.0 and the Prometheus text format 0.0.4 are rendered from the
//! same model.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use kvroute_cp::expo::Exposition;
use openmetrics_parser::{MetricNumber, OpenMetricsValue, PrometheusValue};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Gauge,
    Counter,
    Unknown,
}

#[derive(Debug, Clone)]
struct Row {
    labels: Vec<String>,
    value: f64,
    ts: Option<f64>,
    created: Option<f64>,
    exemplar: bool,
}

#[derive(Debug, Clone)]
struct Family {
    name: String,
    kind: Kind,
    label_names: Vec<String>,
    rows: Vec<Row>,
}

/// One sample as both parsers see it: name, sorted labels, value bits (NaN normalised),
/// timestamp bits.
type Flat = (String, BTreeMap<String, String>, u64, Option<u64>);

fn bits(v: f64) -> u64 {
    if v.is_nan() {
        f64::NAN.to_bits()
    } else {
        v.to_bits()
    }
}

fn value() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => (-1e6f64..1e6).prop_map(|v| (v * 1000.0).round() / 1000.0),
        2 => (0u32..100_000).prop_map(f64::from),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => 1e-9f64..1e-3,
    ]
}

fn counter_value() -> impl Strategy<Value = f64> {
    prop_oneof![
        (0u32..10_000_000).prop_map(f64::from),
        (0.0f64..1e9).prop_map(|v| (v * 10.0).round() / 10.0),
    ]
}

fn label_value() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            6 => proptest::char::range('a', 'z'),
            1 => Just(','),
            1 => Just('"'),
            1 => Just('\\'),
            1 => Just('\n'),
            1 => Just('='),
            1 => Just('{'),
            1 => Just('é'),
            1 => Just('語'),
            1 => Just(' '),
            1 => Just('#'),
        ],
        0..8,
    )
    .prop_map(|v| v.into_iter().collect())
}

fn family(idx: usize) -> impl Strategy<Value = Family> {
    let name = proptest::string::string_regex("[a-z][a-z0-9_]{0,6}(:[a-z][a-z0-9]{0,5})?")
        .unwrap()
        .prop_map(move |n| format!("f{idx}_{n}_g"));
    let kind = prop_oneof![Just(Kind::Gauge), Just(Kind::Counter), Just(Kind::Unknown)];
    let label_names = proptest::collection::btree_set("[a-z_][a-z0-9_]{0,5}", 0..3).prop_map(|s| {
        s.into_iter()
            .filter(|n| !n.starts_with("__"))
            .collect::<Vec<_>>()
    });
    (name, kind, label_names).prop_flat_map(|(name, kind, label_names)| {
        let n = label_names.len();
        let row = (
            proptest::collection::vec(label_value(), n),
            value(),
            counter_value(),
            proptest::option::of(prop_oneof![
                (1_600_000_000u64..1_800_000_000).prop_map(|t| t as f64),
                (1_600_000_000_000u64..1_800_000_000_000).prop_map(|t| t as f64 / 1000.0),
            ]),
            proptest::option::of((1_600_000_000u64..1_700_000_000).prop_map(|t| t as f64 + 0.5)),
            any::<bool>(),
        )
            .prop_map(move |(labels, v, cv, ts, created, exemplar)| Row {
                labels,
                value: if kind == Kind::Counter { cv } else { v },
                ts,
                created: if kind == Kind::Counter { created } else { None },
                exemplar: kind == Kind::Counter && exemplar,
            });
        let rows = if n == 0 {
            proptest::collection::vec(row, 1..=1).boxed()
        } else {
            proptest::collection::vec(row, 1..5).boxed()
        };
        rows.prop_map(move |rows| {
            // Label sets must be unique within a family.
            let mut seen = std::collections::BTreeSet::new();
            let rows = rows
                .into_iter()
                .filter(|r| seen.insert(r.labels.clone()))
                .collect();
            Family {
                name: name.clone(),
                kind,
                label_names: label_names.clone(),
                rows,
            }
        })
    })
}

fn families() -> impl Strategy<Value = Vec<Family>> {
    (1usize..6).prop_flat_map(|n| (0..n).map(family).collect::<Vec<_>>())
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn num(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v:?}")
    }
}

fn series(name: &str, names: &[String], values: &[String]) -> String {
    if names.is_empty() {
        return name.to_owned();
    }
    let l: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    format!("{name}{{{}}}", l.join(","))
}

/// OpenMetrics 1.0 text, and what it contains.
fn render_openmetrics(fams: &[Family]) -> (String, Vec<Flat>) {
    let mut out = String::new();
    let mut want = Vec::new();
    for f in fams {
        let t = match f.kind {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
            Kind::Unknown => "unknown",
        };
        out.push_str(&format!(
            "# TYPE {} {t}\n# HELP {} generated \\\\ help\n",
            f.name, f.name
        ));
        if f.kind == Kind::Gauge {
            out.push_str(&format!("# UNIT {} \n", f.name));
        }
        for r in &f.rows {
            let labels: BTreeMap<String, String> = f
                .label_names
                .iter()
                .cloned()
                .zip(r.labels.iter().cloned())
                .collect();
            let name = if f.kind == Kind::Counter {
                format!("{}_total", f.name)
            } else {
                f.name.clone()
            };
            out.push_str(&series(&name, &f.label_names, &r.labels));
            out.push_str(&format!(" {}", num(r.value)));
            if let Some(ts) = r.ts {
                out.push_str(&format!(" {ts:?}"));
            }
            if r.exemplar {
                out.push_str(" # {trace_id=\"0af7\"} 1.0 1754832641.5");
            }
            out.push('\n');
            want.push((name, labels.clone(), bits(r.value), r.ts.map(bits)));
            if let Some(c) = r.created {
                let cname = format!("{}_created", f.name);
                out.push_str(&series(&cname, &f.label_names, &r.labels));
                out.push_str(&format!(" {c:?}"));
                if let Some(ts) = r.ts {
                    out.push_str(&format!(" {ts:?}"));
                }
                out.push('\n');
                want.push((cname, labels, bits(c), r.ts.map(bits)));
            }
        }
    }
    out.push_str("# EOF\n");
    (out, want)
}

/// Prometheus text 0.0.4 (integer millisecond timestamps, no `_created`, no exemplars).
fn render_prometheus(fams: &[Family]) -> String {
    let mut out = String::new();
    for f in fams {
        let (name, t) = match f.kind {
            Kind::Gauge => (f.name.clone(), "gauge"),
            Kind::Counter => (format!("{}_total", f.name), "counter"),
            Kind::Unknown => (f.name.clone(), "untyped"),
        };
        out.push_str(&format!(
            "# HELP {name} generated help\n# TYPE {name} {t}\n"
        ));
        for r in &f.rows {
            out.push_str(&series(&name, &f.label_names, &r.labels));
            out.push_str(&format!(" {}", num(r.value)));
            if let Some(ts) = r.ts {
                out.push_str(&format!(" {}", (ts * 1000.0).round() as i64));
            }
            out.push('\n');
        }
    }
    out
}

fn number(n: &MetricNumber) -> f64 {
    n.as_f64()
}

fn ours(text: &str) -> Vec<Flat> {
    let e = Exposition::parse(text).unwrap();
    assert_eq!(e.skipped, 0, "{:?}", e.first_skipped);
    let mut v: Vec<Flat> = e
        .samples
        .into_iter()
        .map(|s| {
            (
                s.name,
                s.labels.into_iter().collect(),
                bits(s.value),
                s.timestamp.map(bits),
            )
        })
        .collect();
    v.sort();
    v
}

fn reference_openmetrics(text: &str) -> Vec<Flat> {
    let r = openmetrics_parser::openmetrics::parse_openmetrics(text)
        .unwrap_or_else(|e| panic!("reference rejected:\n{text}\n{e:?}"));
    let mut v = Vec::new();
    for (name, fam) in &r.families {
        for s in fam.iter_samples() {
            let labels: BTreeMap<String, String> = s
                .get_labelset()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let ts = s.timestamp.map(bits);
            match &s.value {
                OpenMetricsValue::Gauge(n) | OpenMetricsValue::Unknown(n) => {
                    v.push((name.clone(), labels, bits(number(n)), ts));
                }
                OpenMetricsValue::Counter(c) => {
                    v.push((
                        format!("{name}_total"),
                        labels.clone(),
                        bits(number(&c.value)),
                        ts,
                    ));
                    if let Some(cr) = c.created {
                        v.push((format!("{name}_created"), labels, bits(cr), ts));
                    }
                }
                other => panic!("not generated: {other:?}"),
            }
        }
    }
    v.sort();
    v
}

fn reference_prometheus(text: &str) -> Vec<Flat> {
    let r = openmetrics_parser::prometheus::parse_prometheus(text)
        .unwrap_or_else(|e| panic!("reference rejected:\n{text}\n{e:?}"));
    let mut v = Vec::new();
    for (name, fam) in &r.families {
        for s in fam.iter_samples() {
            let labels: BTreeMap<String, String> = s
                .get_labelset()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let ts = s.timestamp.map(bits);
            let n = match &s.value {
                PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => number(n),
                PrometheusValue::Counter(c) => number(&c.value),
                other => panic!("not generated: {other:?}"),
            };
            v.push((name.clone(), labels, bits(n), ts));
        }
    }
    v.sort();
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn openmetrics_samples_match_the_reference(fams in families()) {
        let (text, mut want) = render_openmetrics(&fams);
        want.sort();
        let reference = reference_openmetrics(&text);
        // The generator and the reference agree on what the text holds ...
        prop_assert_eq!(&reference, &want, "{}", text);
        // ... and so does kvroute.
        prop_assert_eq!(ours(&text), reference, "{}", text);
    }

    #[test]
    fn prometheus_text_samples_match_the_reference(fams in families()) {
        let text = render_prometheus(&fams);
        prop_assert_eq!(ours(&text), reference_prometheus(&text), "{}", text);
    }
}
