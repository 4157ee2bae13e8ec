//! Reading serve's `/metrics` as a Prometheus parser would: the samples, one by name and
//! labels, and `onebit_requests_total` summed over the labels asked.

use std::process::{Command, Stdio};

use crate::{Serve, get};

/// One sample of a Prometheus text exposition, as a real parser read it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    pub value: f64,
}

/// Parse Prometheus text (format 0.0.4) with the reference parser, Python's `prometheus_client`
/// (installed by `cargo xtask setup`), and return its samples in order; panics with the
/// parser's complaint when the text does not parse.
pub fn parse_prometheus(text: &str) -> Vec<Sample> {
    use std::io::Write;
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        v = s.value if s.value == s.value and abs(s.value) != float('inf') else None
        out.append([s.name, s.labels, v])
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs (cargo xtask setup installs prometheus_client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused the text: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(
        String,
        std::collections::BTreeMap<String, String>,
        Option<f64>,
    )> = serde_json::from_slice(&out.stdout).expect("the parser's JSON");
    rows.into_iter()
        .map(|(name, labels, value)| Sample {
            name,
            labels,
            value: value.unwrap_or(f64::NAN),
        })
        .collect()
}

/// The value of the sample `name` whose labels include `labels`, if present.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// `onebit_generation_deadlines_total` from serve's `/metrics` (None: not in it).
pub fn generation_deadlines(serve: &Serve) -> Option<f64> {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    sample(
        &parse_prometheus(&text),
        "onebit_generation_deadlines_total",
        &[],
    )
}

/// `onebit_requests_total` from serve's `/metrics`, summed over the series whose labels
/// include `labels` (e.g. `[("engine", "fast"), ("path_class", "chat")]`). Read with a plain
/// line parser, so the relay tests need no Python.
pub fn requests_total(serve: &Serve, labels: &[(&str, &str)]) -> u64 {
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    requests_total_in(&text, labels)
}

/// [`requests_total`] of a `/metrics` text already read.
pub fn requests_total_in(text: &str, labels: &[(&str, &str)]) -> u64 {
    let mut total = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("onebit_requests_total{") else {
            continue;
        };
        let Some((set, value)) = rest.split_once("} ") else {
            continue;
        };
        let matches = labels
            .iter()
            .all(|(k, v)| set.split(',').any(|pair| pair == format!("{k}=\"{v}\"")));
        if matches {
            total += value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        }
    }
    total
}
