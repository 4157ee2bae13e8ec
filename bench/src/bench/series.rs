//! `cargo xtask bench hop --repeat N [--baseline PATH]`: the hop measured N times over, each
//! run with servers of its own, and each figure as the series gives it: the median over the
//! runs, and against a `--baseline` build the paired difference run by run, its mean with an
//! interval, and a verdict (better, unchanged, worse). Exit 1 when a figure is worse. The
//! intervals of the eight figures (p50, p90, p95, p99 of both modes) hold together at 95 %,
//! so two copies of one build fail a series one time in twenty at most.
//!
//! Why a series: on the 2-core VM one run's p99 moves by ±20 µs between two copies of the same
//! build (docs/performance.md), so neither a claim about the tail nor a 2 µs claim about the
//! p50 can rest on one run. Within a run both builds are measured in alternating blocks, so
//! what the machine does meanwhile falls on both; across runs the servers are new, so where
//! the kernel placed them is sampled too, and the two builds trade places every second run.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::json;

use super::measures::Hop;
use super::report::Report;
use super::{
    Binaries, Options, build, gate_verdict, percentile, proxied, scratch_dir, write_result,
};
use crate::{Failure, Prepare, Workspace};

/// The quantiles a series reports: the table's p50 and p99, and the two where a tail begins.
const QUANTILES: [(f64, &str); 4] = [(0.5, "p50"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99")];
const MODES: [&str; 2] = ["keep-alive", "new conn"];
/// Arms as `Hop` numbers them.
const SERVE: usize = 1;
const NGINX: usize = 2;
const BASELINE: usize = 3;

/// One run's latency quantiles (µs): `[mode][arm][quantile]`, the baseline's NaN without one.
type RunQuantiles = [[[f64; QUANTILES.len()]; 4]; MODES.len()];

/// One run's difference at every percentile from 1 to 99, this build minus the baseline, per
/// mode (µs). Four figures show four points of a difference; the curve shows its shape (a
/// change that is better up to p90 and worse beyond shows as a crossing). Written to the
/// series' JSON, not judged: 99 more verdicts would each need a wider interval.
type RunCurve = [[f64; 99]; MODES.len()];

/// Runs the series, prints each run's line and the summary, writes `results/hop_series.json`.
pub(super) fn run(
    ws: &Workspace,
    prep: &dyn Prepare,
    options: &Options,
) -> Result<ExitCode, Failure> {
    prep.setup(ws)?;
    let bins = build(ws, false)?;
    let scratch = scratch_dir("onebit-bench")?;
    let (runs, curves) = measure(ws, &bins, options, &scratch)?;
    let _ = std::fs::remove_dir_all(&scratch);
    let summary = Summary::of(&runs);
    println!();
    for line in summary.lines(options.baseline.as_deref()) {
        println!("{line}");
    }
    let mut json = summary.json(&runs, options.baseline.as_deref());
    if !curves.is_empty() {
        json["difference_curve_us"] = curve_json(&curves);
    }
    write_result(
        &ws.root.join("results/hop_series.json"),
        &serde_json::to_string_pretty(&json).unwrap_or_default(),
    )?;
    Ok(if summary.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The series' runs: each run's quantiles, and with a baseline each run's curve.
fn measure(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
) -> Result<(Vec<RunQuantiles>, Vec<RunCurve>), Failure> {
    let mut runs = Vec::with_capacity(options.repeat);
    let mut curves = Vec::with_capacity(options.repeat);
    for i in 1..=options.repeat {
        // Each run executes fresh copies of the builds (see `fresh_copy`), about 50 MB a
        // build, removed after the run however it ended (the servers' logs stay in `scratch`,
        // where a failure's line points).
        let copies = scratch.join(format!("run-{i}"));
        let measured = measure_once(ws, bins, options, scratch, &copies, i);
        let _ = std::fs::remove_dir_all(&copies);
        let (quantiles, curve) = measured?;
        runs.push(quantiles);
        curves.extend(curve);
    }
    Ok((runs, curves))
}

/// Run `i` of the series, on fresh copies of the builds in `copies`: its quantiles booked to
/// the builds, and with a baseline its curve. Prints the run's line.
fn measure_once(
    ws: &Workspace,
    bins: &Binaries,
    options: &Options,
    scratch: &Path,
    copies: &Path,
    i: usize,
) -> Result<(RunQuantiles, Option<RunCurve>), Failure> {
    let mut fresh_bins = bins.clone();
    fresh_bins.onebit = fresh_copy(&bins.onebit, &copies.join("this"))?;
    let mut fresh_options = options.clone();
    if let Some(baseline) = &options.baseline {
        fresh_options.baseline = Some(fresh_copy(baseline, &copies.join("baseline"))?);
    }
    // Every second run the two builds trade places (see `traded`).
    let trade = options.baseline.is_some() && i.is_multiple_of(2);
    let (bins, options) = if trade {
        traded(&fresh_bins, &fresh_options)
    } else {
        (fresh_bins, fresh_options)
    };
    let mut report = Report::new(options.quick);
    proxied(ws, &bins, &options, scratch, &mut report)?;
    let Some(hop) = report.hop.as_ref() else {
        return Err(Failure::new(
            "the hop was not measured",
            "run `cargo xtask bench hop --repeat N`",
        ));
    };
    let mut quantiles = run_quantiles(hop);
    if trade {
        trade_back(&mut quantiles);
    }
    let curve = options.baseline.is_some().then(|| run_curve(hop, trade));
    println!(
        "run {i} of {}{}: {}",
        options.repeat,
        if trade {
            " (the builds traded places)"
        } else {
            ""
        },
        run_line(&quantiles)
    );
    Ok((quantiles, curve))
}

/// A copy of the build `onebit` and the route libraries beside it (`libonebit_route_*.so`,
/// which serve loads from its own folder) in `dir`: the copy's path. A file's pages stay
/// where they were first read into the page cache, and where the machine's memory holds a
/// build's code has effects of its own: in three A/A series of thirty runs, the workspace's
/// `1bit` against one copy of it came out 1.5-3.9 µs slower at the keep-alive p95 (and 0.7
/// after the caches were dropped). Fresh copies every run make that placement one more thing
/// that varies from run to run, which the interval then covers. A baseline that is a script
/// is copied as it is (what it runs is not).
fn fresh_copy(onebit: &Path, dir: &Path) -> Result<PathBuf, Failure> {
    let copy_failed = |what: &Path, e: std::io::Error| {
        Failure::new(
            format!("cannot copy {} to {}: {e}", what.display(), dir.display()),
            "check the space left in the temporary folder",
        )
    };
    std::fs::create_dir_all(dir).map_err(|e| copy_failed(onebit, e))?;
    let name = onebit.file_name().unwrap_or_else(|| "1bit".as_ref());
    let copy = dir.join(name);
    std::fs::copy(onebit, &copy).map_err(|e| copy_failed(onebit, e))?;
    let beside = onebit.parent().unwrap_or_else(|| Path::new("."));
    for entry in std::fs::read_dir(beside).map_err(|e| copy_failed(beside, e))? {
        let path = entry.map_err(|e| copy_failed(beside, e))?.path();
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if file.starts_with("libonebit_route_") && file.ends_with(".so") {
            std::fs::copy(&path, dir.join(file)).map_err(|e| copy_failed(&path, e))?;
        }
    }
    Ok(copy)
}

/// The binaries and options of a run in which this build runs in the baseline's place and the
/// baseline in the serve arm's. A place has effects of its own: the serve arm's servers start
/// first, the baseline's last, and in twenty runs of one build in both places (an A/A series)
/// the serve arm's p90 came out 3.4 µs lower; traded every second run, a place's effect falls
/// on both builds alike.
fn traded(bins: &Binaries, options: &Options) -> (Binaries, Options) {
    let mut traded_bins = bins.clone();
    let mut traded_options = options.clone();
    if let Some(baseline) = &options.baseline {
        traded_bins.onebit = baseline.clone();
        traded_options.baseline = Some(bins.onebit.clone());
    }
    (traded_bins, traded_options)
}

/// A traded run's quantiles booked to the builds that made them: this build's to the serve
/// arm, the baseline's to the baseline arm.
fn trade_back<PerArm>(run: &mut [[PerArm; 4]; MODES.len()]) {
    for mode in run {
        mode.swap(SERVE, BASELINE);
    }
}

fn run_quantiles(hop: &Hop) -> RunQuantiles {
    [&hop.keep_alive, &hop.new_connection]
        .map(|arms| std::array::from_fn(|arm| QUANTILES.map(|(q, _)| percentile(&arms[arm], q))))
}

/// This build minus the baseline at percentiles 1 to 99, per mode; a traded run's
/// percentiles are booked back to their builds first (`trade_back`).
fn run_curve(hop: &Hop, traded: bool) -> RunCurve {
    let mut percentiles = [&hop.keep_alive, &hop.new_connection].map(|arms| {
        std::array::from_fn(|arm| -> [f64; 99] {
            std::array::from_fn(|i| percentile(&arms[arm], (i + 1) as f64 / 100.0))
        })
    });
    if traded {
        trade_back(&mut percentiles);
    }
    percentiles.map(|arms| std::array::from_fn(|i| arms[SERVE][i] - arms[BASELINE][i]))
}

/// The runs' curves as the JSON gives them: per mode, the mean and the median over the runs
/// at each percentile (`p` lists them).
fn curve_json(curves: &[RunCurve]) -> serde_json::Value {
    let mut modes = serde_json::Map::new();
    for (m, mode) in MODES.iter().enumerate() {
        let at = |i: usize| -> Vec<f64> { curves.iter().map(|c| c[m][i]).collect() };
        let mean: Vec<f64> = (0..99)
            .map(|i| at(i).iter().sum::<f64>() / curves.len() as f64)
            .collect();
        let median: Vec<f64> = (0..99).map(|i| median(&at(i))).collect();
        modes.insert((*mode).into(), json!({ "mean": mean, "median": median }));
    }
    modes.insert("p".into(), json!((1..=99).collect::<Vec<u32>>()));
    serde_json::Value::Object(modes)
}

/// What serve adds to the direct arm at p50 and p99, per mode (and the baseline's).
fn run_line(run: &RunQuantiles) -> String {
    let mut parts = Vec::new();
    for (mode, arms) in MODES.iter().zip(run) {
        let added = |arm: usize, q: usize| arms[arm][q] - arms[0][q];
        let mut part = format!(
            "{mode} added p50 {:+.1} p99 {:+.1} µs",
            added(SERVE, 0),
            added(SERVE, 3)
        );
        if !arms[BASELINE][0].is_nan() {
            part += &format!(
                " (baseline {:+.1} / {:+.1})",
                added(BASELINE, 0),
                added(BASELINE, 3)
            );
        }
        parts.push(part);
    }
    parts.join("; ")
}

/// A figure's verdict against the baseline, from the interval of the mean difference.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Verdict {
    Better,
    Unchanged,
    Worse,
}

impl Verdict {
    fn word(self) -> &'static str {
        match self {
            Verdict::Better => "better",
            Verdict::Unchanged => "unchanged",
            Verdict::Worse => "WORSE",
        }
    }
}

/// This build minus the baseline at one figure, over the runs (µs).
#[derive(Debug)]
struct Difference {
    mean: f64,
    /// Half the width of the mean's interval (Student's t over the runs, the figures'
    /// intervals holding together at 95 %: `t_joint`).
    half_interval: f64,
    median: f64,
    min: f64,
    max: f64,
    verdict: Verdict,
}

impl Difference {
    /// From the runs' paired differences (at least two).
    fn of(diffs: &[f64]) -> Difference {
        let n = diffs.len() as f64;
        let mean = diffs.iter().sum::<f64>() / n;
        let variance = diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0);
        let half_interval = t_joint(diffs.len() - 1) * (variance / n).sqrt();
        let verdict = if mean + half_interval < 0.0 {
            Verdict::Better
        } else if mean - half_interval > 0.0 {
            Verdict::Worse
        } else {
            Verdict::Unchanged
        };
        Difference {
            mean,
            half_interval,
            median: median(diffs),
            min: diffs.iter().copied().fold(f64::INFINITY, f64::min),
            max: diffs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            verdict,
        }
    }
}

/// Student's t for the figures' intervals with `df` degrees of freedom: two-sided at
/// 1 - 0.05/8 each (Bonferroni), so that the eight intervals hold together at 95 % and two
/// copies of one build are called better or worse somewhere in one series of 20 at most, not
/// in one of five as eight separate 95 % intervals would. Computed from the t distribution's
/// CDF; the 95 % column of a textbook table is 12.706, 4.303, ... for comparison.
fn t_joint(df: usize) -> f64 {
    const TABLE: [f64; 29] = [
        101.856, 12.590, 6.895, 5.261, 4.526, 4.115, 3.855, 3.677, 3.547, 3.448, 3.370, 3.308,
        3.256, 3.214, 3.177, 3.146, 3.119, 3.095, 3.074, 3.055, 3.038, 3.023, 3.009, 2.997, 2.986,
        2.975, 2.966, 2.957, 2.949,
    ];
    TABLE[df.clamp(1, TABLE.len()) - 1]
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// One figure (a mode and a quantile) over the series.
struct Figure {
    name: String,
    /// The median over the runs of what serve, nginx and the baseline add to direct (µs).
    serve: f64,
    nginx: f64,
    baseline: Option<f64>,
    /// This build minus the baseline, where there is one.
    difference: Option<Difference>,
}

struct Summary {
    runs: usize,
    figures: Vec<Figure>,
}

impl Summary {
    fn of(runs: &[RunQuantiles]) -> Summary {
        let mut figures = Vec::new();
        for (m, mode) in MODES.iter().enumerate() {
            for (q, (_, quantile)) in QUANTILES.iter().enumerate() {
                let added = |arm: usize| -> Vec<f64> {
                    runs.iter().map(|r| r[m][arm][q] - r[m][0][q]).collect()
                };
                let has_baseline = runs.iter().all(|r| !r[m][BASELINE][q].is_nan());
                let diffs: Vec<f64> = runs
                    .iter()
                    .map(|r| r[m][SERVE][q] - r[m][BASELINE][q])
                    .collect();
                figures.push(Figure {
                    name: format!("{mode} {quantile}"),
                    serve: median(&added(SERVE)),
                    nginx: median(&added(NGINX)),
                    baseline: has_baseline.then(|| median(&added(BASELINE))),
                    difference: (has_baseline && runs.len() >= 2).then(|| Difference::of(&diffs)),
                });
            }
        }
        Summary {
            runs: runs.len(),
            figures,
        }
    }

    /// Against a baseline: no figure worse. Alone: the CI rule on the series' keep-alive p50s.
    fn passed(&self) -> bool {
        if self.figures.iter().any(|f| f.difference.is_some()) {
            return self.figures.iter().all(|f| {
                f.difference
                    .as_ref()
                    .is_none_or(|d| d.verdict != Verdict::Worse)
            });
        }
        let p50 = &self.figures[0];
        !matches!(gate_verdict(p50.serve, p50.nginx), super::Gate::Failed(_))
    }

    fn lines(&self, baseline: Option<&Path>) -> Vec<String> {
        let mut lines = vec![format!(
            "hop series: {} runs; µs added to llama-server direct, the median over the runs",
            self.runs
        )];
        let with_baseline = self.figures.iter().any(|f| f.difference.is_some());
        if let (true, Some(path)) = (with_baseline, baseline) {
            lines.push(format!("baseline: {}", path.display()));
            lines.push(format!(
                "{:<16} {:>8} {:>8} {:>9}  {:<50} verdict",
                "figure",
                "serve",
                "nginx",
                "baseline",
                "this − baseline (mean ± interval; median; range)"
            ));
        } else {
            lines.push(format!("{:<16} {:>8} {:>8}", "figure", "serve", "nginx"));
        }
        for f in &self.figures {
            let mut line = format!("{:<16} {:>+8.1} {:>+8.1}", f.name, f.serve, f.nginx);
            if let (Some(b), Some(d)) = (f.baseline, &f.difference) {
                let spread = format!(
                    "{:+.1} ± {:.1}; {:+.1}; {:+.1} to {:+.1}",
                    d.mean, d.half_interval, d.median, d.min, d.max
                );
                line += &format!(" {b:>+9.1}  {spread:<50} {}", d.verdict.word());
            }
            lines.push(line);
        }
        if with_baseline {
            let worse: Vec<String> = self
                .figures
                .iter()
                .filter_map(|f| {
                    let d = f.difference.as_ref()?;
                    (d.verdict == Verdict::Worse)
                        .then(|| format!("{} ({:+.1} ± {:.1} µs)", f.name, d.mean, d.half_interval))
                })
                .collect();
            lines.push(if worse.is_empty() {
                "series verdict: every figure unchanged or better than the baseline's".into()
            } else {
                format!(
                    "series verdict: WORSE than the baseline at {}",
                    worse.join(", ")
                )
            });
        } else {
            lines.push(format!(
                "CI rule on the series (keep-alive: serve's added p50 ≤ 2 × nginx's): {}",
                if self.passed() { "passed" } else { "FAILED" }
            ));
        }
        lines
    }

    fn json(&self, runs: &[RunQuantiles], baseline: Option<&Path>) -> serde_json::Value {
        let figures: Vec<_> = self
            .figures
            .iter()
            .map(|f| {
                json!({
                    "figure": f.name,
                    "serve_added_us": f.serve,
                    "nginx_added_us": f.nginx,
                    "baseline_added_us": f.baseline,
                    "difference_us": f.difference.as_ref().map(|d| json!({
                        "mean": d.mean,
                        "half_interval_95": d.half_interval,
                        "median": d.median,
                        "min": d.min,
                        "max": d.max,
                        "verdict": d.verdict.word().to_lowercase(),
                    })),
                })
            })
            .collect();
        let arm_names = ["direct", "serve", "nginx", "baseline"];
        let per_run: Vec<_> = runs
            .iter()
            .map(|r| {
                let mut modes = serde_json::Map::new();
                for (mode, arms) in MODES.iter().zip(r) {
                    let mut by_arm = serde_json::Map::new();
                    for (name, quantiles) in arm_names.iter().zip(arms) {
                        if quantiles.iter().all(|v| v.is_finite()) {
                            by_arm.insert((*name).into(), json!(quantiles));
                        }
                    }
                    modes.insert((*mode).into(), by_arm.into());
                }
                serde_json::Value::Object(modes)
            })
            .collect();
        json!({
            "runs": self.runs,
            "baseline": baseline.map(|p| p.display().to_string()),
            "quantiles": QUANTILES.map(|(_, name)| name),
            "figures": figures,
            "per_run_us": per_run,
            "passed": self.passed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_difference_is_better_or_worse_only_when_its_interval_says_so() {
        let d = Difference::of(&[-10.0, -11.0, -10.5, -11.5]);
        assert_eq!(d.verdict, Verdict::Better, "{d:?}");
        let d = Difference::of(&[3.0, 4.0, 3.5, 5.0]);
        assert_eq!(d.verdict, Verdict::Worse, "{d:?}");
        // A mean of +0.25 with runs from -5 to +5: the series cannot tell.
        let d = Difference::of(&[-5.0, 5.0, -3.0, 4.0]);
        assert_eq!(d.verdict, Verdict::Unchanged, "{d:?}");
        // Two runs 1 and 3: mean 2, standard error 1, t with one degree of freedom at
        // 1 - 0.05/16 one-sided: 101.856.
        let d = Difference::of(&[1.0, 3.0]);
        assert_eq!((d.mean, d.median, d.min, d.max), (2.0, 2.0, 1.0, 3.0));
        assert!((d.half_interval - 101.856).abs() < 1e-9, "{d:?}");
        assert_eq!(d.verdict, Verdict::Unchanged);
    }

    /// Runs whose latencies are direct 100, serve 140 + the run's number, nginx 170, and a
    /// baseline 140 except at one figure, where it is `baseline_p99` in every run.
    fn runs(n: usize, baseline_p99: Option<f64>) -> Vec<RunQuantiles> {
        (0..n)
            .map(|i| {
                let mut run: RunQuantiles = [[[0.0; 4]; 4]; 2];
                for mode in &mut run {
                    mode[0] = [100.0; 4];
                    mode[SERVE] = [140.0 + i as f64; 4];
                    mode[NGINX] = [170.0; 4];
                    mode[BASELINE] = match baseline_p99 {
                        Some(p99) => [140.0 + i as f64, 140.0 + i as f64, 140.0 + i as f64, p99],
                        None => [f64::NAN; 4],
                    };
                }
                // The baseline differs from this build at keep-alive p50 by ±1 µs, run by run.
                if baseline_p99.is_some() {
                    run[0][BASELINE][0] = run[0][SERVE][0] + if i % 2 == 0 { 1.0 } else { -1.0 };
                }
                run
            })
            .collect()
    }

    #[test]
    fn a_figure_worse_than_the_baseline_fails_the_series_and_is_named() {
        // The baseline's p99 is 150 while this build's runs are 140 to 144: better.
        let better = Summary::of(&runs(5, Some(150.0)));
        assert!(better.passed());
        let lines = better.lines(Some(Path::new("/b/1bit")));
        assert_eq!(
            lines.last().unwrap(),
            "series verdict: every figure unchanged or better than the baseline's"
        );
        let p99 = better
            .figures
            .iter()
            .find(|f| f.name == "keep-alive p99")
            .unwrap();
        assert_eq!(
            (p99.serve, p99.nginx, p99.baseline),
            (42.0, 70.0, Some(50.0))
        );
        assert_eq!(p99.difference.as_ref().unwrap().verdict, Verdict::Better);
        let p50 = better
            .figures
            .iter()
            .find(|f| f.name == "keep-alive p50")
            .unwrap();
        assert_eq!(p50.difference.as_ref().unwrap().verdict, Verdict::Unchanged);

        // A baseline at 130: this build is 10 to 14 µs worse at p99, in both modes.
        let worse = Summary::of(&runs(5, Some(130.0)));
        assert!(!worse.passed());
        let last = worse.lines(None).pop().unwrap();
        assert!(
            last.starts_with("series verdict: WORSE than the baseline at keep-alive p99 (+12.0 ± ")
                && last.contains(", new conn p99 (+12.0 ± "),
            "{last}"
        );
    }

    #[test]
    fn the_builds_trade_places_and_their_figures_come_back_to_them() {
        let bins = Binaries {
            onebit: "/this/1bit".into(),
            llama_server: "/llama-server".into(),
            fake: "/fake".into(),
        };
        let options = Options {
            parts: Default::default(),
            quick: false,
            baseline: Some("/parent/1bit".into()),
            repeat: 4,
            hog: false,
        };
        let (bins, options) = traded(&bins, &options);
        assert_eq!(bins.onebit, Path::new("/parent/1bit"));
        assert_eq!(options.baseline.as_deref(), Some(Path::new("/this/1bit")));
        assert_eq!(bins.llama_server, Path::new("/llama-server"));
        // In a traded run the serve arm measured the parent: its figures go back to it.
        let mut run: RunQuantiles = [[[0.0; 4]; 4]; 2];
        for mode in &mut run {
            mode[SERVE] = [200.0; 4];
            mode[BASELINE] = [100.0; 4];
        }
        trade_back(&mut run);
        assert!(
            run.iter()
                .all(|m| m[SERVE] == [100.0; 4] && m[BASELINE] == [200.0; 4])
        );
    }

    #[test]
    fn the_curve_follows_the_builds_through_a_trade_and_averages_the_runs() {
        // 100 requests per arm: this build took 200 + i µs at its i-th fastest, the baseline
        // 100 + 2i, so this build is 100 - i µs slower at the i-th percentile.
        let latencies = |base: f64, step: f64| (1..=100).map(|i| base + step * i as f64).collect();
        let mut hop = Hop::default();
        for arms in [&mut hop.keep_alive, &mut hop.new_connection] {
            arms[SERVE] = latencies(200.0, 1.0);
            arms[BASELINE] = latencies(100.0, 2.0);
        }
        let plain = run_curve(&hop, false);
        assert_eq!((plain[0][0], plain[0][49], plain[1][98]), (99.0, 50.0, 1.0));
        // Traded, the serve arm ran the baseline: the same latencies say the opposite.
        let traded = run_curve(&hop, true);
        assert_eq!((traded[0][0], traded[1][98]), (-99.0, -1.0));
        let json = curve_json(&[plain, plain, traded]);
        let p1 = &json["keep-alive"];
        assert_eq!(p1["mean"][0].as_f64(), Some((99.0 + 99.0 - 99.0) / 3.0));
        assert_eq!(p1["median"][0].as_f64(), Some(99.0));
        assert_eq!(json["p"][98], 99);
        assert_eq!(json["new conn"]["mean"].as_array().map(Vec::len), Some(99));
    }

    #[test]
    fn a_run_gets_fresh_copies_of_the_build_and_its_routes_and_nothing_else() {
        let root = std::env::temp_dir().join(format!("fresh-copy-test-{}", std::process::id()));
        let build = root.join("release");
        std::fs::create_dir_all(&build).unwrap();
        for (file, text) in [
            ("1bit", "the binary"),
            ("libonebit_route_cpu.so", "a route"),
            ("libonebit_route_cpu.d", "cargo's dep-info"),
            ("libother.so", "not a route"),
        ] {
            std::fs::write(build.join(file), text).unwrap();
        }
        let copy = fresh_copy(&build.join("1bit"), &root.join("run-1/this")).unwrap();
        assert_eq!(copy, root.join("run-1/this/1bit"));
        let mut copied: Vec<String> = std::fs::read_dir(root.join("run-1/this"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        copied.sort();
        assert_eq!(copied, ["1bit", "libonebit_route_cpu.so"]);
        assert_eq!(std::fs::read_to_string(&copy).unwrap(), "the binary");
        // A copy is a file of its own, not a link to the build's.
        use std::os::unix::fs::MetadataExt;
        assert_ne!(
            std::fs::metadata(&copy).unwrap().ino(),
            std::fs::metadata(build.join("1bit")).unwrap().ino()
        );
        let missing = fresh_copy(&build.join("gone"), &root.join("run-2/this"));
        assert!(missing.is_err_and(|f| f.to_string().contains("cannot copy")));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn without_a_baseline_the_series_is_judged_by_the_ci_rule() {
        let alone = Summary::of(&runs(3, None));
        assert!(
            alone
                .figures
                .iter()
                .all(|f| f.difference.is_none() && f.baseline.is_none())
        );
        // serve adds 41 (the median of 40, 41, 42), nginx 70: passed.
        assert_eq!(
            (alone.figures[0].serve, alone.figures[0].nginx),
            (41.0, 70.0)
        );
        assert!(alone.passed());
        assert!(alone.lines(None).last().unwrap().ends_with("passed"));
        let mut slow = runs(3, None);
        for run in &mut slow {
            run[0][SERVE][0] = 300.0;
        }
        assert!(!Summary::of(&slow).passed());
    }
}
