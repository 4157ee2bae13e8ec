//! `cargo xtask bench`'s report: the rows and targets made from the measurements, the table,
//! `results/bench.json` and the latency chart.

use std::path::Path;
use std::time::SystemTime;

use super::measures::{Hop, Sse, late_ms};
use super::{
    ARMS, CLIENTS, Gate, SSE_EVENTS, SSE_INTERVAL_MS, arms, chart, gate_verdict, idle_path,
    loadavg, mem_check, percentile, write_result,
};
use crate::Failure;

/// One row of the table: a figure per arm (direct, serve, nginx; absent where not measured).
pub(super) struct Row {
    pub(super) figure: String,
    pub(super) unit: &'static str,
    pub(super) values: [Option<f64>; 3],
    /// How a proxy compares with direct: as a difference (latency) or a fraction (throughput).
    pub(super) compare: Compare,
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Compare {
    Difference,
    Fraction,
    None,
}

pub(super) struct Target {
    pub(super) text: &'static str,
    pub(super) measured: String,
    pub(super) met: bool,
}

pub(super) struct Report {
    pub(super) quick: bool,
    /// Busy loops run beside the arms (`--hog`): 0 on a quiet run.
    pub(super) hog_loops: usize,
    pub(super) load_before: String,
    /// How an idle CPU waits (`idle_path`): what a woken thread pays there.
    pub(super) idle_path: String,
    pub(super) hop: Option<Hop>,
    pub(super) throughput: Option<[f64; 3]>,
    pub(super) sse: Option<Sse>,
    pub(super) startup_ms: Option<[f64; 2]>,
    /// The median of the paired differences, serve minus direct.
    pub(super) startup_added_ms: Option<f64>,
    pub(super) rss_idle_kib: Option<u64>,
    pub(super) rss_load_kib: Option<u64>,
    pub(super) mem_check: Option<(f64, f64)>,
    pub(super) rows: Vec<Row>,
    pub(super) targets: Vec<Target>,
}

impl Report {
    pub(super) fn new(quick: bool) -> Report {
        Report {
            quick,
            hog_loops: 0,
            load_before: loadavg(),
            idle_path: idle_path(Path::new("/sys")),
            hop: None,
            throughput: None,
            sse: None,
            startup_ms: None,
            startup_added_ms: None,
            rss_idle_kib: None,
            rss_load_kib: None,
            mem_check: None,
            rows: Vec::new(),
            targets: Vec::new(),
        }
    }

    pub(super) fn mem_check(&mut self, found: &mem_check::MemCheck) {
        let own = |i: usize| found.cases.get(i).map_or(f64::NAN, |c| c.3);
        self.mem_check = Some((own(0), own(1)));
    }

    /// serve's and nginx's added p50 on the hop, keep-alive and new connection.
    pub(super) fn added_p50(&self) -> Option<[[f64; 2]; 2]> {
        let hop = self.hop.as_ref()?;
        let added = |samples: &[Vec<f64>; 4], arm: usize| {
            percentile(&samples[arm], 0.5) - percentile(&samples[0], 0.5)
        };
        Some([
            [added(&hop.keep_alive, 1), added(&hop.keep_alive, 2)],
            [added(&hop.new_connection, 1), added(&hop.new_connection, 2)],
        ])
    }

    /// The CI rule: serve's added p50 on the keep-alive hop at most twice nginx's. One line per
    /// breach. Keep-alive only: with a new connection per request, nginx's added p50 is the
    /// small difference of two large figures (its accept path is cheaper than llama-server's,
    /// which it replaces), 10-30 µs from run to run, so twice it is no stable bound.
    ///
    /// A run where nginx adds under 10 µs to a loopback hop measured noise, not the hop (a proxy
    /// cannot be free; nginx adds 55-105 µs here): it is Noisy, neither passed nor failed.
    pub(super) fn gate(&self) -> Gate {
        let Some([[serve, nginx], _]) = self.added_p50() else {
            return Gate::Passed;
        };
        gate_verdict(serve, nginx)
    }

    pub(super) fn build_rows(&mut self) {
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        self.hop_rows(&mut rows, &mut targets);
        self.load_rows(&mut rows, &mut targets);
        self.resource_rows(&mut rows, &mut targets);
        self.rows = rows;
        self.targets = targets;
    }

    /// The hop's latencies and targets (and the baseline's, when there is one).
    pub(super) fn hop_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some(hop) = &self.hop {
            for (mode, samples) in [
                ("keep-alive", &hop.keep_alive),
                ("new conn", &hop.new_connection),
            ] {
                for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                    rows.push(Row {
                        figure: format!("hop /tokenize {mode} {name}"),
                        unit: "µs",
                        values: [0, 1, 2].map(|a| Some(percentile(&samples[a], q))),
                        compare: Compare::Difference,
                    });
                }
            }
            let [[ka_serve, ka_nginx], [nc_serve, nc_nginx]] =
                self.added_p50().unwrap_or([[f64::NAN; 2]; 2]);
            targets.push(Target {
                text: "hop added p50 ≤ nginx's and ≤ 50 µs (keep-alive)",
                measured: format!("serve {ka_serve:+.1} µs, nginx {ka_nginx:+.1} µs"),
                met: ka_serve <= ka_nginx && ka_serve <= 50.0,
            });
            targets.push(Target {
                text: "hop added p50 ≤ nginx's and ≤ 50 µs (new connection)",
                measured: format!("serve {nc_serve:+.1} µs, nginx {nc_nginx:+.1} µs"),
                met: nc_serve <= nc_nginx && nc_serve <= 50.0,
            });
            if !hop.keep_alive[3].is_empty() {
                for (text, samples) in [
                    (
                        "hop added p50 within 2 µs of the --baseline build's (keep-alive)",
                        &hop.keep_alive,
                    ),
                    (
                        "hop added p50 within 2 µs of the --baseline build's (new connection)",
                        &hop.new_connection,
                    ),
                ] {
                    let [this, baseline] = baseline_added_p50(samples);
                    targets.push(Target {
                        text,
                        measured: format!(
                            "this {this:+.1} µs, baseline {baseline:+.1} µs ({:+.1})",
                            this - baseline
                        ),
                        met: this - baseline <= 2.0,
                    });
                }
            }
        }
    }

    /// Throughput and the SSE stream's delays.
    pub(super) fn load_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some(rps) = self.throughput {
            rows.push(Row {
                figure: format!("throughput /tokenize, {CLIENTS} clients"),
                unit: "req/s",
                values: rps.map(Some),
                compare: Compare::Fraction,
            });
            let fraction = rps[1] / rps[0];
            targets.push(Target {
                text: "throughput through serve ≥ 90% of direct",
                measured: format!(
                    "{:.1}% (nginx {:.1}%)",
                    fraction * 100.0,
                    rps[2] / rps[0] * 100.0
                ),
                met: fraction >= 0.9,
            });
        }
        if let Some(sse) = &self.sse {
            for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
                rows.push(Row {
                    figure: format!("SSE per-event delay {name}"),
                    unit: "µs",
                    values: [0, 1, 2].map(|a| Some(percentile(&sse.delays[a], q))),
                    compare: Compare::Difference,
                });
            }
            rows.push(Row {
                figure: "SSE events held back".into(),
                unit: "events",
                values: sse.held.map(|n| Some(n as f64)),
                compare: Compare::None,
            });
            let added = percentile(&sse.delays[1], 0.5) - percentile(&sse.delays[0], 0.5);
            targets.push(Target {
                text: "SSE added delay p50 ≤ 50 µs",
                measured: format!("{added:+.1} µs"),
                met: added <= 50.0,
            });
            targets.push(Target {
                text: "SSE: no event held back",
                measured: format!(
                    "{} of {} paced events{} (direct {}, nginx {})",
                    sse.held[1],
                    sse.paced[1],
                    late_ms(&sse.held_late_us[1]),
                    sse.held[0],
                    sse.held[2]
                ),
                met: sse.held[1] == 0,
            });
        }
    }

    /// Start-up, serve's RSS and the memory check.
    pub(super) fn resource_rows(&self, rows: &mut Vec<Row>, targets: &mut Vec<Target>) {
        if let Some([direct, serve]) = self.startup_ms {
            rows.push(Row {
                figure: "start-up to /health 200 (median)".into(),
                unit: "ms",
                values: [Some(direct), Some(serve), None],
                compare: Compare::Difference,
            });
            let added = self.startup_added_ms.unwrap_or(serve - direct);
            targets.push(Target {
                text: "start-up ≤ llama-server's own + 50 ms",
                measured: format!("{added:+.1} ms (median of the paired differences)"),
                met: added <= 50.0,
            });
        }
        let mib = |kib: u64| kib as f64 / 1024.0;
        if let Some(idle) = self.rss_idle_kib.filter(|_| self.rss_load_kib.is_some()) {
            rows.push(Row {
                figure: "serve RSS idle (child excluded)".into(),
                unit: "MiB",
                values: [None, Some(mib(idle)), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "serve RSS ≤ 20 MiB idle",
                measured: format!("{:.1} MiB", mib(idle)),
                met: mib(idle) <= 20.0,
            });
        }
        if let Some(load) = self.rss_load_kib {
            rows.push(Row {
                figure: format!("serve RSS, {CLIENTS} clients (peak)"),
                unit: "MiB",
                values: [None, Some(mib(load)), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "serve RSS ≤ 40 MiB under the 64-client load",
                measured: format!("{:.1} MiB", mib(load)),
                met: mib(load) <= 40.0,
            });
        }
        if let Some((model, huge)) = self.mem_check {
            rows.push(Row {
                figure: "--mem-check SmolLM2, beyond process start".into(),
                unit: "ms",
                values: [None, Some(model), None],
                compare: Compare::None,
            });
            rows.push(Row {
                figure: "--mem-check sparse 4 TiB, beyond process start".into(),
                unit: "ms",
                values: [None, Some(huge), None],
                compare: Compare::None,
            });
            targets.push(Target {
                text: "--mem-check on the sparse 4 TiB file ≤ 5 ms beyond process start",
                measured: format!("{huge:.2} ms"),
                met: huge <= 5.0,
            });
        }
    }

    /// Prints the table, the targets and the CI rule; writes the JSON and the chart.
    pub(super) fn finish(&mut self, out_dir: &Path) -> Result<(), Failure> {
        self.build_rows();
        let load_after = loadavg();
        println!();
        println!(
            "{:<54} {:>9} {:>9} {:>9}  {:<20} nginx vs direct",
            "figure", "direct", "serve", "nginx", "serve vs direct"
        );
        for row in &self.rows {
            let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
            let versus = |arm: usize| match (row.compare, row.values[0], row.values[arm]) {
                (Compare::Difference, Some(d), Some(v)) => {
                    format!("{:+.1} {} (×{:.2})", v - d, row.unit, v / d)
                }
                (Compare::Fraction, Some(d), Some(v)) => format!("{:.1}%", v / d * 100.0),
                _ => "-".to_string(),
            };
            println!(
                "{:<54} {:>9} {:>9} {:>9}  {:<20} {}",
                format!("{} ({})", row.figure, row.unit),
                cell(row.values[0]),
                cell(row.values[1]),
                cell(row.values[2]),
                versus(1),
                versus(2)
            );
        }
        println!();
        for t in &self.targets {
            println!(
                "{} {:<66} {}",
                if t.met { "met    " } else { "MISSED " },
                t.text,
                t.measured
            );
        }
        if self.hop.is_some() {
            match (self.gate(), self.added_p50()) {
                (Gate::Passed, Some([[serve, nginx], _])) => println!(
                    "CI rule (keep-alive: serve's added p50 ≤ 2 × nginx's): passed, {serve:.1} µs against {nginx:.1} µs"
                ),
                (Gate::Passed, None) => {}
                (Gate::Failed(lines), _) => {
                    for line in lines {
                        println!("CI rule FAILED: {line}");
                    }
                }
                (Gate::Noisy(why), _) => println!("CI rule not judged, the run was noise: {why}"),
            }
        }
        println!(
            "load average before: {}; after: {load_after}",
            self.load_before
        );
        println!("idle CPUs: {}", self.idle_path);
        if self.hog_loops > 0 {
            println!(
                "measured beside a CPU hog: {} busy loop(s) at the bench's priority",
                self.hog_loops
            );
        }

        let json = self.json(&load_after);
        write_result(
            &out_dir.join("bench.json"),
            &serde_json::to_string_pretty(&json).unwrap_or_default(),
        )?;
        if let Some(svg) = self.chart() {
            write_result(&out_dir.join("latency.svg"), &svg)?;
        }
        Ok(())
    }

    pub(super) fn json(&self, load_after: &str) -> serde_json::Value {
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                let [d, s, n] = r.values;
                let vs = |v: Option<f64>| match (r.compare, d, v) {
                    (Compare::Difference, Some(d), Some(v)) => {
                        serde_json::json!({"added": v - d, "ratio": v / d})
                    }
                    (Compare::Fraction, Some(d), Some(v)) => serde_json::json!({"fraction": v / d}),
                    _ => serde_json::Value::Null,
                };
                serde_json::json!({
                    "figure": r.figure, "unit": r.unit,
                    "direct": d, "serve": s, "nginx": n,
                    "serve_vs_direct": vs(s), "nginx_vs_direct": vs(n),
                })
            })
            .collect();
        let targets: Vec<_> = self
            .targets
            .iter()
            .map(|t| serde_json::json!({"target": t.text, "measured": t.measured, "met": t.met}))
            .collect();
        let quantiles = |data: &[f64]| -> Vec<f64> {
            (0..=100)
                .map(|k| percentile(data, k as f64 / 100.0))
                .collect()
        };
        let mut distributions = serde_json::Map::new();
        if let Some(hop) = &self.hop {
            for (mode, samples) in [
                ("hop_keep_alive", &hop.keep_alive),
                ("hop_new_connection", &hop.new_connection),
            ] {
                let arms: serde_json::Map<_, _> = ARMS
                    .iter()
                    .zip(samples)
                    .map(|(arm, d)| (arm.to_string(), serde_json::json!(quantiles(d))))
                    .collect();
                distributions.insert(mode.into(), serde_json::Value::Object(arms));
            }
            if !hop.keep_alive[3].is_empty() {
                distributions.insert(
                    "hop_keep_alive_baseline".into(),
                    serde_json::json!(quantiles(&hop.keep_alive[3])),
                );
                distributions.insert(
                    "hop_new_connection_baseline".into(),
                    serde_json::json!(quantiles(&hop.new_connection[3])),
                );
            }
            distributions.insert(
                "keep_alive_reconnects".into(),
                serde_json::json!(hop.reconnects),
            );
            distributions.insert(
                "requests_per_arm".into(),
                serde_json::json!(hop.keep_alive[0].len()),
            );
        }
        if let Some(sse) = &self.sse {
            let arms: serde_json::Map<_, _> = ARMS
                .iter()
                .zip(&sse.delays)
                .map(|(arm, d)| (arm.to_string(), serde_json::json!(quantiles(d))))
                .collect();
            distributions.insert("sse_delay".into(), serde_json::Value::Object(arms));
            distributions.insert("sse_streams_per_arm".into(), serde_json::json!(sse.streams));
            distributions.insert("sse_held_back".into(), serde_json::json!(sse.held));
            distributions.insert(
                "sse_held_back_late_us".into(),
                serde_json::json!(sse.held_late_us),
            );
            distributions.insert("sse_paced_pairs".into(), serde_json::json!(sse.paced));
        }
        serde_json::json!({
            "benchmark": "serve hop against llama-server direct and nginx",
            "quick": self.quick,
            "hog_loops": self.hog_loops,
            "unix_time": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "machine": {
                "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                "load_average_before": self.load_before,
                "load_average_after": load_after,
                "idle_path": self.idle_path,
            },
            "settings": {
                "llama_server_threads_http": arms::THREADS_HTTP,
                "clients": CLIENTS,
                "sse_events": SSE_EVENTS,
                "sse_interval_ms": SSE_INTERVAL_MS,
            },
            "rows": rows,
            "targets": targets,
            "quantiles_us": distributions,
        })
    }

    pub(super) fn chart(&self) -> Option<String> {
        let mut panels = Vec::new();
        if let Some(hop) = &self.hop {
            for (title, samples) in [
                ("POST /tokenize, keep-alive", &hop.keep_alive),
                ("POST /tokenize, new connection", &hop.new_connection),
            ] {
                panels.push(chart::Panel {
                    title: format!("{title} ({} requests per arm)", samples[0].len()),
                    arms: ARMS
                        .iter()
                        .copied()
                        .zip(samples.iter().map(Vec::as_slice))
                        .collect(),
                });
            }
        }
        if let Some(sse) = &self.sse {
            panels.push(chart::Panel {
                title: format!(
                    "SSE per-event delay ({} events per arm)",
                    sse.delays[0].len()
                ),
                arms: ARMS
                    .iter()
                    .copied()
                    .zip(sse.delays.iter().map(Vec::as_slice))
                    .collect(),
            });
        }
        (!panels.is_empty()).then(|| {
            chart::svg(
                "1bit serve vs llama-server direct vs nginx, one run, loopback (CDF; left is faster)",
                &panels,
            )
        })
    }
}

/// What this build's serve (arm 1) and the `--baseline` build's (arm 3) add to the direct
/// arm's p50, in µs.
fn baseline_added_p50(samples: &[Vec<f64>; 4]) -> [f64; 2] {
    let direct = percentile(&samples[0], 0.5);
    [1, 3].map(|arm| percentile(&samples[arm], 0.5) - direct)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With a baseline arm, each mode gets its own target, judged on that mode's samples:
    /// this build's added p50 against the baseline's, 2 µs allowed.
    #[test]
    fn the_baseline_is_compared_in_both_modes() {
        let arms = |direct: f64, serve: f64, baseline: f64| {
            [
                vec![direct],
                vec![serve],
                vec![direct + 50.0],
                vec![baseline],
            ]
        };
        let mut report = Report::new(false);
        report.hop = Some(Hop {
            keep_alive: arms(50.0, 90.0, 89.0),
            new_connection: arms(150.0, 180.0, 170.0),
            reconnects: [0; 4],
        });
        let (mut rows, mut targets) = (Vec::new(), Vec::new());
        report.hop_rows(&mut rows, &mut targets);
        let judged: Vec<(&str, bool, &str)> = targets
            .iter()
            .filter(|t| t.text.contains("--baseline"))
            .map(|t| (t.text, t.met, t.measured.as_str()))
            .collect();
        assert_eq!(
            judged,
            vec![
                (
                    "hop added p50 within 2 µs of the --baseline build's (keep-alive)",
                    true,
                    "this +40.0 µs, baseline +39.0 µs (+1.0)"
                ),
                (
                    "hop added p50 within 2 µs of the --baseline build's (new connection)",
                    false,
                    "this +30.0 µs, baseline +20.0 µs (+10.0)"
                ),
            ]
        );
    }
}
