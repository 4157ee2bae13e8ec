//! `cargo xtask llama-suite`: llama.cpp's own server test suite (the pinned tree's
//! `tools/server/tests`) run twice in one go, against the real llama-server and through the
//! drop-in (`llama-server` as a link to `1bit`), with the per-file table and the tests that pass
//! direct but fail through the drop-in. A measurement, not part of `cargo xtask test`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use crate::{Failure, Workspace, process};

/// The pytest plugin that remaps the presets to the local model and writes each test's outcome.
const PLUGIN: &str = include_str!("../llama_suite/onebit_suite.py");

/// Exact versions for the suite's `requirements.txt` (which pins by `~=`), as a pip constraints
/// file: a pin move that asks for another version fails pip's resolution, said in one line.
const CONSTRAINTS: &str = include_str!("../llama_suite/constraints.txt");

/// pytest-timeout, which bounds each test (the suite itself has no per-test limit).
const PYTEST_TIMEOUT: &str = "pytest-timeout==2.3.1";

/// Where the suite's tests live inside the pinned llama.cpp tree.
const TESTS_IN_TREE: &str = "tools/server/tests";

const USAGE: &str = "usage: cargo xtask llama-suite [--timeout SECONDS] [PYTEST ARGS...]  (default: unit, 120 s a test)";

/// One run of the suite: against the real llama-server, or through the drop-in.
struct Arm {
    name: &'static str,
    server: PathBuf,
}

/// Prepares the suite (tests copied from the pinned tree, its requirements in a venv, the
/// drop-in link), runs both arms one after the other, prints the table and the differential
/// list. Blocks for the whole run (tens of minutes on 2 cores). Exits 0 once both arms ran,
/// whatever they found: the figures are the result.
pub fn run(ws: &Workspace, args: &[String]) -> Result<ExitCode, Failure> {
    let (timeout, mut selection) = parse_args(args)?;
    if selection.is_empty() {
        selection.push("unit".to_string());
    }
    let layout = &ws.layout;
    let real = layout.llama_server();
    let model = layout.model(ws.pins.default_model());
    for needed in [&real, &model] {
        if !needed.is_file() {
            return Err(Failure::new(
                format!("{} is not there", needed.display()),
                "run `cargo xtask setup` first (it builds llama-server and fetches the model)",
            ));
        }
    }
    let work = layout.cache_dir.join("llama-suite");
    let tests = copy_tests(ws, &work)?;
    let python = ensure_venv(&work, &tests)?;
    let onebit = build_onebit(ws)?;
    let link_dir = work.join("drop-in");
    fs::create_dir_all(&link_dir).map_err(|e| io_failure(&link_dir, e))?;
    let link = link_dir.join("llama-server");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&onebit, &link).map_err(|e| io_failure(&link, e))?;
    let results = work.join("results");
    fs::create_dir_all(&results).map_err(|e| io_failure(&results, e))?;

    let arms = [
        Arm {
            name: "direct",
            server: real.clone(),
        },
        Arm {
            name: "drop-in",
            server: link,
        },
    ];
    let mut outcomes = Vec::new();
    for arm in &arms {
        let report = results.join(format!("{}.json", arm.name));
        let log = results.join(format!("{}.log", arm.name));
        let _ = fs::remove_file(&report);
        let log_file = File::create(&log).map_err(|e| io_failure(&log, e))?;
        let port = free_port()?;
        let mut pytest = Command::new(&python);
        pytest
            .current_dir(&tests)
            .args([
                "-m",
                "pytest",
                "-p",
                "onebit_suite",
                "-p",
                "no:cacheprovider",
            ])
            .args(["-m", "not slow", "-o", "addopts=", "-q", "-rN"])
            .arg(format!("--timeout={timeout}"))
            .args(&selection)
            .env("LLAMA_SERVER_BIN_PATH", &arm.server)
            .env("ONEBIT_LLAMA_SERVER", &real)
            .env("ONEBIT_SUITE_MODEL", &model)
            .env("ONEBIT_SUITE_REPORT", &report)
            .env("PORT", port.to_string())
            .env_remove("DEBUG_EXTERNAL")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| io_failure(&log, e))?)
            .stderr(log_file);
        println!(
            "==> {} arm: {} (log: {})",
            arm.name,
            process::describe(&pytest),
            log.display()
        );
        let status = process::status(&mut pytest)?;
        // pytest: 0 all passed, 1 some failed; anything else means the run itself broke.
        if !matches!(status.code(), Some(0 | 1)) {
            return Err(Failure::new(
                format!(
                    "pytest's {} arm stopped ({})",
                    arm.name,
                    process::describe_status(status)
                ),
                format!("read {}", log.display()),
            ));
        }
        println!("{}", last_line(&log));
        outcomes.push(read_report(&report)?);
    }
    let summary = Summary::new(&outcomes[0], &outcomes[1]);
    let text = summary.render();
    print!("{text}");
    let summary_path = results.join("summary.txt");
    fs::write(&summary_path, &text).map_err(|e| io_failure(&summary_path, e))?;
    println!("(also in {})", summary_path.display());
    Ok(ExitCode::SUCCESS)
}

fn parse_args(args: &[String]) -> Result<(u64, Vec<String>), Failure> {
    let mut timeout = 120;
    let mut rest = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--timeout" {
            timeout = args
                .get(i + 1)
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&s| s > 0)
                .ok_or_else(|| Failure::new("--timeout needs a number of seconds", USAGE))?;
            i += 2;
        } else {
            rest.push(args[i].clone());
            i += 1;
        }
    }
    Ok((timeout, rest))
}

/// A fresh copy of the suite's directory (the suite writes `tmp/` beside its tests, and the
/// plugin goes there too), from the pinned tree, or from the pinned sdist when setup has not
/// extracted it. Returns the copy's path.
fn copy_tests(ws: &Workspace, work: &Path) -> Result<PathBuf, Failure> {
    let dest = work.join("tests");
    if dest.exists() {
        fs::remove_dir_all(&dest).map_err(|e| io_failure(&dest, e))?;
    }
    fs::create_dir_all(&dest).map_err(|e| io_failure(&dest, e))?;
    let tree = ws.layout.source_dir().join(TESTS_IN_TREE);
    if tree.join("utils.py").is_file() {
        copy_dir(&tree, &dest)?;
    } else {
        let sdist = ws.layout.downloads_dir().join(&ws.pins.llama_cpp.sdist);
        extract_tests(&sdist, &ws.pins.llama_cpp.source_dir, &dest)?;
    }
    let plugin = dest.join("onebit_suite.py");
    fs::write(&plugin, PLUGIN).map_err(|e| io_failure(&plugin, e))?;
    Ok(dest)
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), Failure> {
    for entry in fs::read_dir(from).map_err(|e| io_failure(from, e))? {
        let entry = entry.map_err(|e| io_failure(from, e))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if src.is_dir() {
            fs::create_dir_all(&dst).map_err(|e| io_failure(&dst, e))?;
            copy_dir(&src, &dst)?;
        } else {
            fs::copy(&src, &dst).map_err(|e| io_failure(&src, e))?;
        }
    }
    Ok(())
}

/// The entries under `<top>/<source_dir>/tools/server/tests/` of the sdist, written into `dest`.
fn extract_tests(sdist: &Path, source_dir: &str, dest: &Path) -> Result<(), Failure> {
    let todo = "run `cargo xtask setup` first (it fetches the pinned llama.cpp)";
    let file = File::open(sdist)
        .map_err(|e| Failure::new(format!("cannot open {}: {e}", sdist.display()), todo))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let unreadable = |e: std::io::Error| {
        Failure::new(
            format!("cannot read {}: {e}", sdist.display()),
            "delete it and rerun `cargo xtask setup`",
        )
    };
    let marker = format!("{source_dir}/{TESTS_IN_TREE}/");
    let mut found = false;
    for entry in archive.entries().map_err(unreadable)? {
        let mut entry = entry.map_err(unreadable)?;
        let path = entry.path().map_err(unreadable)?.into_owned();
        let text = path.to_string_lossy();
        let Some(at) = text.find(&marker) else {
            continue;
        };
        let inner = &text[at + marker.len()..];
        if inner.is_empty() || inner.split('/').any(|part| part == "..") {
            continue;
        }
        let target = dest.join(inner);
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).map_err(|e| io_failure(parent, e))?;
        }
        if entry.header().entry_type().is_file() {
            entry.unpack(&target).map_err(unreadable)?;
            found = true;
        }
    }
    if !found {
        return Err(Failure::new(
            format!("{} holds no {marker}", sdist.display()),
            "the pinned llama.cpp does not ship the server tests where expected: check third_party/pins.json",
        ));
    }
    Ok(())
}

/// `<work>/venv` with the suite's requirements at the constrained versions and pytest-timeout;
/// reinstalled only when those change (a stamp beside it). Returns its python. Blocks on pip.
fn ensure_venv(work: &Path, tests: &Path) -> Result<PathBuf, Failure> {
    let venv = work.join("venv");
    let python = venv.join("bin").join("python");
    let requirements = tests.join("requirements.txt");
    let wanted = format!(
        "{}\n{CONSTRAINTS}\n{PYTEST_TIMEOUT}\n",
        fs::read_to_string(&requirements).map_err(|e| io_failure(&requirements, e))?
    );
    let stamp = venv.join("onebit-suite.stamp");
    if python.is_file() && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(python);
    }
    let todo =
        "check that python3 with venv and pip is installed and PyPI is reachable, then rerun";
    if !python.is_file() {
        process::run(
            Command::new("python3").args(["-m", "venv"]).arg(&venv),
            todo,
        )?;
    }
    let constraints = work.join("constraints.txt");
    fs::write(&constraints, CONSTRAINTS).map_err(|e| io_failure(&constraints, e))?;
    println!(
        "==> installing the suite's requirements into {}",
        venv.display()
    );
    process::run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--quiet",
            ])
            .arg("-r")
            .arg(&requirements)
            .arg("-c")
            .arg(&constraints)
            .arg(PYTEST_TIMEOUT),
        todo,
    )?;
    fs::write(&stamp, wanted).map_err(|e| io_failure(&stamp, e))?;
    Ok(python)
}

/// Builds the `1bit` binary (debug, the workspace's target dir) and returns its path.
fn build_onebit(ws: &Workspace) -> Result<PathBuf, Failure> {
    let mut cargo = process::cargo();
    cargo
        .current_dir(&ws.root)
        .args(["build", "-p", "onebit-host", "--bin", "1bit"]);
    println!("==> {}", process::describe(&cargo));
    process::run(&mut cargo, "fix the build errors above, then rerun")?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| ws.root.join("target"));
    let onebit = target.join("debug").join("1bit");
    std::path::absolute(&onebit).map_err(|e| io_failure(&onebit, e))
}

fn free_port() -> Result<u16, Failure> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Failure::new(format!("cannot get a free port: {e}"), "check loopback"))
}

fn last_line(log: &Path) -> String {
    let mut text = String::new();
    let _ = File::open(log).and_then(|mut f| f.read_to_string(&mut text));
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_string()
}

/// What each test did in one arm: nodeid → "passed" | "failed" | "skipped".
type Outcomes = BTreeMap<String, String>;

fn read_report(path: &Path) -> Result<Outcomes, Failure> {
    let text = fs::read_to_string(path).map_err(|e| {
        Failure::new(
            format!("pytest wrote no report at {}: {e}", path.display()),
            "read the arm's log beside it",
        )
    })?;
    serde_json::from_str(&text).map_err(|e| {
        Failure::new(
            format!("{} is not the plugin's report: {e}", path.display()),
            "rerun; if it persists, check bench/llama_suite/onebit_suite.py",
        )
    })
}

/// The two arms compared: per file, the tests run (not skipped in either arm), how many passed
/// direct and how many of those passed through the drop-in; and the tests that pass direct only.
#[derive(Debug, PartialEq)]
struct Summary {
    /// file → (run, passed direct, passed drop-in of those).
    files: BTreeMap<String, (usize, usize, usize)>,
    /// Passed direct, not through the drop-in (with the drop-in's outcome).
    only_direct: Vec<(String, String)>,
    /// Passed through the drop-in, not direct.
    only_drop_in: Vec<String>,
}

impl Summary {
    fn new(direct: &Outcomes, drop_in: &Outcomes) -> Self {
        let mut files: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
        let mut only_direct = Vec::new();
        let mut only_drop_in = Vec::new();
        let ids: BTreeSet<&String> = direct.keys().chain(drop_in.keys()).collect();
        for id in ids {
            let d = direct.get(id).map_or("not run", String::as_str);
            let p = drop_in.get(id).map_or("not run", String::as_str);
            if d == "skipped" || p == "skipped" {
                continue;
            }
            let file = id.split("::").next().unwrap_or(id).to_string();
            let row = files.entry(file).or_default();
            row.0 += 1;
            if d == "passed" {
                row.1 += 1;
                if p == "passed" {
                    row.2 += 1;
                } else {
                    only_direct.push((id.clone(), p.to_string()));
                }
            } else if p == "passed" {
                only_drop_in.push(id.clone());
            }
        }
        Summary {
            files,
            only_direct,
            only_drop_in,
        }
    }

    fn render(&self) -> String {
        let mut out = String::new();
        let width = self.files.keys().map(String::len).max().unwrap_or(4).max(4);
        out.push_str(&format!(
            "\n{:<width$}  {:>5}  {:>13}  {:>14}\n",
            "file", "run", "passed direct", "passed drop-in"
        ));
        let (mut run, mut direct, mut drop_in) = (0, 0, 0);
        for (file, (r, d, p)) in &self.files {
            out.push_str(&format!("{file:<width$}  {r:>5}  {d:>13}  {p:>14}\n"));
            (run, direct, drop_in) = (run + r, direct + d, drop_in + p);
        }
        out.push_str(&format!(
            "{:<width$}  {run:>5}  {direct:>13}  {drop_in:>14}\n",
            "total"
        ));
        let percent = if direct == 0 {
            0.0
        } else {
            100.0 * drop_in as f64 / direct as f64
        };
        out.push_str(&format!(
            "\nof the {direct} tests that pass direct, {drop_in} pass through the drop-in ({percent:.0} %)\n"
        ));
        if !self.only_direct.is_empty() {
            out.push_str("\npass direct, not through the drop-in:\n");
            for (id, outcome) in &self.only_direct {
                out.push_str(&format!("  {id}  ({outcome})\n"));
            }
        }
        if !self.only_drop_in.is_empty() {
            out.push_str("\npass through the drop-in, not direct:\n");
            for id in &self.only_drop_in {
                out.push_str(&format!("  {id}\n"));
            }
        }
        out
    }
}

fn io_failure(path: &Path, err: std::io::Error) -> Failure {
    Failure::new(
        format!("{}: {err}", path.display()),
        "check free space and permissions, then rerun",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcomes(pairs: &[(&str, &str)]) -> Outcomes {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_summary_counts_per_file_and_lists_the_differences() {
        let direct = outcomes(&[
            ("unit/a.py::t1", "passed"),
            ("unit/a.py::t2", "passed"),
            ("unit/a.py::t3", "failed"),
            ("unit/a.py::t4", "skipped"),
            ("unit/b.py::t1", "passed"),
        ]);
        let drop_in = outcomes(&[
            ("unit/a.py::t1", "passed"),
            ("unit/a.py::t2", "failed"),
            ("unit/a.py::t3", "passed"),
            ("unit/a.py::t4", "skipped"),
            ("unit/b.py::t1", "passed"),
        ]);
        let s = Summary::new(&direct, &drop_in);
        assert_eq!(s.files["unit/a.py"], (3, 2, 1));
        assert_eq!(s.files["unit/b.py"], (1, 1, 1));
        assert_eq!(
            s.only_direct,
            vec![("unit/a.py::t2".to_string(), "failed".to_string())]
        );
        assert_eq!(s.only_drop_in, vec!["unit/a.py::t3".to_string()]);
        assert!(
            s.render()
                .contains("of the 3 tests that pass direct, 2 pass through the drop-in (67 %)")
        );
    }

    #[test]
    fn a_timeout_needs_seconds() {
        assert!(parse_args(&["--timeout".into()]).is_err());
        let (t, rest) = parse_args(&["--timeout".into(), "30".into(), "unit/x.py".into()]).unwrap();
        assert_eq!((t, rest), (30, vec!["unit/x.py".to_string()]));
    }
}
