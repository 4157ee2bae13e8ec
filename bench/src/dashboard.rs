//! `cargo xtask dashboard`: a picture of the Grafana dashboard's panels from one run of its test
//! (tests/tests/serve_prometheus.rs: a real Prometheus scraping serve while streamed chats go
//! through the real llama-server), written to docs/grafana/1bit-serve.svg. The test hands over
//! what Prometheus answered (`ONEBIT_DASHBOARD_DATA`); each time-series panel's range queries
//! are drawn as lines over the run, each stat panel's last value as a number, in hand-written
//! SVG as the benchmark draws its latency chart.

use std::fmt::Write;
use std::process::ExitCode;

use crate::bench::chart::{escape, nice_ceiling, opening};
use crate::{Failure, Prepare, Workspace, process};

/// Runs the dashboard's test with the data handed over, draws it, writes the picture.
pub fn run(ws: &Workspace, prep: &dyn Prepare, args: &[String]) -> Result<ExitCode, Failure> {
    if !args.is_empty() {
        return Err(Failure::new(
            format!("unexpected argument `{}`", args[0]),
            "use `cargo xtask dashboard`",
        ));
    }
    prep.setup(ws)?;
    let data = ws.root.join("results/dashboard.json");
    let _ = std::fs::create_dir_all(ws.root.join("results"));
    let _ = std::fs::remove_file(&data);
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["test", "-p", "onebit-tests", "--test", "serve_prometheus"])
        .env("ONEBIT_DASHBOARD_DATA", &data);
    println!("==> {}", process::describe(&cargo));
    process::run(
        &mut cargo,
        "the dashboard's test failed: see its output above",
    )?;
    let text = std::fs::read_to_string(&data).map_err(|e| {
        Failure::new(
            format!("the test wrote no {}: {e}", data.display()),
            "run it again",
        )
    })?;
    let answers: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Failure::new(format!("{}: {e}", data.display()), "run it again"))?;
    let out = ws.root.join("docs/grafana/1bit-serve.svg");
    let caption = answers["caption"].as_str().unwrap_or("1bit serve");
    std::fs::write(&out, svg(caption, &panels(&answers))).map_err(|e| {
        Failure::new(
            format!("cannot write {}: {e}", out.display()),
            "check the folder",
        )
    })?;
    println!("written to {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// The panels as the test handed them over: `{"panels": [{"title", "type", "unit", "series":
/// [{"legend", "points": [[seconds, value], ...]}]}]}`.
fn panels(answers: &serde_json::Value) -> Vec<Panel> {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
    answers["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|panel| {
            let series: Vec<Series> = panel["series"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|one| Series {
                    legend: text(&one["legend"]),
                    points: one["points"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                        .collect(),
                })
                .collect();
            if panel["type"] == "stat" {
                Panel::Stat {
                    title: text(&panel["title"]),
                    value: series.iter().find_map(|s| s.points.last().map(|p| p.1)),
                }
            } else {
                Panel::TimeSeries {
                    title: text(&panel["title"]),
                    unit: panel["unit"].as_str().unwrap_or("short").to_string(),
                    series,
                }
            }
        })
        .collect()
}

const PANEL_W: f64 = 440.0;
const PANEL_H: f64 = 230.0;
const STAT_H: f64 = 90.0;
const COLUMNS: usize = 2;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#555555",
];

/// One query's answer: its legend and its (seconds since the run began, value) points.
struct Series {
    legend: String,
    points: Vec<(f64, f64)>,
}

/// A panel as the dashboard draws it.
enum Panel {
    /// Lines over time, the values in Grafana's `unit` (`s`, `reqps`, `bytes`, `short`).
    TimeSeries {
        title: String,
        unit: String,
        series: Vec<Series>,
    },
    /// One number: the last value of its query.
    Stat { title: String, value: Option<f64> },
}

/// The SVG text: stat panels in one row on top, time-series panels below, two to a row.
fn svg(caption: &str, panels: &[Panel]) -> String {
    let stats: Vec<&Panel> = panels
        .iter()
        .filter(|p| matches!(p, Panel::Stat { .. }))
        .collect();
    let charts: Vec<&Panel> = panels
        .iter()
        .filter(|p| matches!(p, Panel::TimeSeries { .. }))
        .collect();
    let width = PANEL_W * COLUMNS as f64 + 20.0;
    let rows = charts.len().div_ceil(COLUMNS) as f64;
    let height = 30.0 + STAT_H + rows * PANEL_H + 10.0;
    let mut s = opening(width, height, caption);
    let stat_w = (width - 20.0) / stats.len().max(1) as f64;
    for (i, panel) in stats.iter().enumerate() {
        if let Panel::Stat { title, value } = panel {
            stat(
                &mut s,
                10.0 + stat_w * i as f64,
                30.0,
                stat_w,
                title,
                *value,
            );
        }
    }
    for (i, panel) in charts.iter().enumerate() {
        if let Panel::TimeSeries {
            title,
            unit,
            series,
        } = panel
        {
            let x0 = 10.0 + PANEL_W * (i % COLUMNS) as f64;
            let y0 = 30.0 + STAT_H + PANEL_H * (i / COLUMNS) as f64;
            lines(&mut s, x0, y0, title, unit, series);
        }
    }
    s.push_str("</svg>\n");
    s
}

fn stat(s: &mut String, x0: f64, y0: f64, w: f64, title: &str, value: Option<f64>) {
    let _ = writeln!(
        s,
        r##"<rect x="{}" y="{y0}" width="{}" height="{}" fill="none" stroke="#cccccc"/>"##,
        x0 + 4.0,
        w - 8.0,
        STAT_H - 10.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
        x0 + w / 2.0,
        y0 + 18.0,
        escape(title)
    );
    let shown = value.map_or("no data".to_string(), |v| format_value(v, "short"));
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="28" text-anchor="middle">{shown}</text>"#,
        x0 + w / 2.0,
        y0 + 58.0
    );
}

fn lines(s: &mut String, x0: f64, y0: f64, title: &str, unit: &str, series: &[Series]) {
    let (left, top) = (x0 + 62.0, y0 + 28.0);
    let (plot_w, plot_h) = (PANEL_W - 62.0 - 20.0, PANEL_H - 28.0 - 58.0);
    let points = || series.iter().flat_map(|s| s.points.iter());
    let t_max = points().map(|p| p.0).fold(1.0, f64::max);
    let v_max = nice_ceiling(points().map(|p| p.1).fold(0.0, f64::max) * 1.1);
    let px = |t: f64| left + t / t_max * plot_w;
    let py = |v: f64| top + (1.0 - (v / v_max).min(1.0)) * plot_h;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
        left + plot_w / 2.0,
        y0 + 16.0,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999999"/>"##
    );
    for i in 0..=4 {
        let v = v_max * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            left - 4.0,
            py(v) + 4.0,
            format_value(v, unit)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">0 s … {t_max:.0} s</text>"#,
        left + plot_w / 2.0,
        top + plot_h + 14.0
    );
    for (i, one) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut path = String::new();
        for (t, v) in &one.points {
            let _ = write!(path, "{:.1},{:.1} ", px(*t), py(*v));
        }
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
            path.trim_end()
        );
        let last = one
            .points
            .last()
            .map_or("no data".to_string(), |p| format_value(p.1, unit));
        let column = (i % 3) as f64 * (plot_w / 3.0);
        let row = (i / 3) as f64 * 14.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" fill="{colour}">{} {last}</text>"#,
            left + column,
            top + plot_h + 30.0 + row,
            escape(&one.legend)
        );
    }
}

/// `v` in the panel's unit, short: 12 ms, 3.4 req/s, 1.0 GiB.
fn format_value(v: f64, unit: &str) -> String {
    match unit {
        "s" if v == 0.0 => "0".to_string(),
        "s" if v < 1e-3 => format!("{:.0} µs", v * 1e6),
        "s" if v < 1.0 => format!("{:.0} ms", v * 1e3),
        "s" => format!("{v:.2} s"),
        "reqps" => format!("{v:.2} req/s"),
        "bytes" => format!("{:.1} GiB", v / f64::from(1u32 << 30)),
        _ if v.fract() == 0.0 => format!("{v:.0}"),
        _ => format!("{v:.1}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_in_their_units() {
        assert_eq!(format_value(0.0123, "s"), "12 ms");
        assert_eq!(format_value(0.000_25, "s"), "250 µs");
        assert_eq!(format_value(1.5, "reqps"), "1.50 req/s");
        assert_eq!(format_value(f64::from(1u32 << 30), "bytes"), "1.0 GiB");
        assert_eq!(format_value(3.0, "short"), "3");
    }

    #[test]
    fn every_panel_and_every_series_is_drawn() {
        let panels = [
            Panel::Stat {
                title: "Health".into(),
                value: Some(1.0),
            },
            Panel::TimeSeries {
                title: "Time to first token".into(),
                unit: "s".into(),
                series: vec![
                    Series {
                        legend: "p50".into(),
                        points: vec![(0.0, 0.01), (1.0, 0.02)],
                    },
                    Series {
                        legend: "p99".into(),
                        points: vec![(0.0, 0.03), (1.0, 0.04)],
                    },
                ],
            },
        ];
        let text = svg("a run", &panels);
        assert!(text.contains(">Health<") && text.contains(">Time to first token<"));
        assert_eq!(text.matches("<polyline").count(), 2);
        assert!(text.contains("p99 40 ms"), "{text}");
    }

    #[test]
    fn the_tests_answers_become_panels() {
        let answers = serde_json::json!({"panels": [
            {"title": "Health", "type": "stat", "series": [{"legend": "up", "points": [[0.0, 0.0], [3.0, 1.0]]}]},
            {"title": "TTFT", "type": "timeseries", "unit": "s", "series": [{"legend": "p50", "points": [[1.0, 0.5]]}]},
        ]});
        let panels = panels(&answers);
        assert!(matches!(
            panels[0],
            Panel::Stat {
                value: Some(1.0),
                ..
            }
        ));
        let Panel::TimeSeries { unit, series, .. } = &panels[1] else {
            panic!("a time series");
        };
        assert_eq!(
            (unit.as_str(), series[0].points.as_slice()),
            ("s", &[(1.0, 0.5)][..])
        );
    }
}
