//! `cargo xtask bench mem-check`: the whole-process time of `1bit serve --mem-check` on the default model and on
//! a sparse 4 TiB GGUF, against `1bit --version` (process start alone) in the same run, so the
//! check's own work is the difference of medians.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::{Failure, Workspace};

const RUNS: usize = 40;
const WARMUP_RUNS: usize = 5;

/// What `measure` found: process start alone, and each case's medians (ms).
pub struct MemCheck {
    #[allow(dead_code)] // in results/mem-check.json; the table shows the differences
    pub start_median_ms: f64,
    /// (case, median, p90, median minus process start)
    pub cases: Vec<(&'static str, f64, f64, f64)>,
}

/// Times `1bit serve --mem-check` on the default model and on a sparse 4 TiB GGUF, printing a
/// small table and writing `results/mem-check.json`. Needs the release build of `onebit`.
pub fn measure(ws: &Workspace, onebit: &Path) -> Result<MemCheck, Failure> {
    let model = ws.layout.model(ws.pins.default_model());
    let scratch = super::scratch_dir("onebit-bench-mem")?;
    let huge = sparse_4tib(&scratch)?;

    let start_only = time_runs(onebit, &["--version"], None)?;
    let cases = [
        ("SmolLM2-135M (fits, exit 0)", &model, 0),
        ("sparse 4 TiB GGUF (refused, exit 3)", &huge, 3),
    ];
    println!(
        "1bit serve --mem-check, whole process, {RUNS} runs each (after {WARMUP_RUNS} warm-ups)"
    );
    println!(
        "{:<38} {:>10} {:>10} {:>14}",
        "case", "median ms", "p90 ms", "own work ms"
    );
    println!(
        "{:<38} {:>10.2} {:>10.2} {:>14}",
        "1bit --version (process start)",
        median(&start_only),
        p90(&start_only),
        "-"
    );
    let mut results = Vec::new();
    let mut found = Vec::new();
    for (name, path, code) in cases {
        let args = [
            "serve",
            "-m",
            path.to_str().unwrap_or_default(),
            "--device",
            "cpu",
            "--mem-check",
        ];
        let times = time_runs(onebit, &args, Some(code))?;
        let own = median(&times) - median(&start_only);
        println!(
            "{name:<38} {:>10.2} {:>10.2} {:>14.2}",
            median(&times),
            p90(&times),
            own
        );
        found.push((name, median(&times), p90(&times), own));
        results.push(serde_json::json!({
            "case": name, "median_ms": median(&times), "p90_ms": p90(&times), "own_work_ms": own,
        }));
    }
    let out_dir = ws.root.join("results");
    let _ = std::fs::create_dir_all(&out_dir);
    let report = serde_json::json!({
        "benchmark": "mem-check",
        "runs": RUNS,
        "process_start_median_ms": median(&start_only),
        "cases": results,
    });
    super::write_result(
        &out_dir.join("mem-check.json"),
        &serde_json::to_string_pretty(&report).unwrap_or_default(),
    )?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(MemCheck {
        start_median_ms: median(&start_only),
        cases: found,
    })
}

/// A valid llama-architecture header, then a hole up to 4 TiB (no disk used).
fn sparse_4tib(dir: &Path) -> Result<PathBuf, Failure> {
    let path = dir.join("huge-4TiB.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(4 << 40)
        .write(&path)
        .map_err(|e| {
            Failure::new(
                format!("cannot write {}: {e}", path.display()),
                "check /tmp",
            )
        })?;
    Ok(path)
}

/// Milliseconds per whole-process run, after warm-ups; checks the exit status when given.
fn time_runs(program: &Path, args: &[&str], expect: Option<i32>) -> Result<Vec<f64>, Failure> {
    let mut times = Vec::with_capacity(RUNS);
    for i in 0..WARMUP_RUNS + RUNS {
        let began = Instant::now();
        let status = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| {
                Failure::new(format!("cannot run {}: {e}", program.display()), "build it")
            })?;
        let ms = began.elapsed().as_secs_f64() * 1000.0;
        if let Some(code) = expect
            && status.code() != Some(code)
        {
            return Err(Failure::new(
                format!(
                    "{} {} exited {status}, expected {code}",
                    program.display(),
                    args.join(" ")
                ),
                "run it by hand to see why",
            ));
        }
        if i >= WARMUP_RUNS {
            times.push(ms);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn median(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

fn p90(sorted: &[f64]) -> f64 {
    sorted[(sorted.len() * 9 / 10).min(sorted.len() - 1)]
}
