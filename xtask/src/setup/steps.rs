//! Setup's lines: one a step. A long step (a build, a download) runs with its output (the
//! compilers', pip's, cargo's) in a log file under `<cache>/logs/`; on a terminal its line shows
//! how far it is and for how long, rewritten in place; elsewhere (CI, a pipe) a plain line comes
//! every [`PERIOD`]. A step that fails says which it was, the last lines of its log, the log's
//! path and what to do.

use std::fs::File;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Failure, process};

/// How often a running step says where it is when the output is not a terminal.
pub const PERIOD: Duration = Duration::from_secs(30);
/// How often the line on a terminal is rewritten.
const REDRAW: Duration = Duration::from_secs(1);
/// How often the log is read for progress.
const POLL: Duration = Duration::from_millis(200);

/// What a step's log says about its progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gauge {
    /// cmake's Makefiles (`[ 35%] Building ...`) or Ninja (`[123/456] ...`): a percentage.
    Percent,
    /// cargo: the crates compiled so far (`   Compiling name v1.0`).
    Crates,
    /// Nothing to read: the time alone.
    Time,
}

/// A long step: its title, its log, what to do when it fails, and how many log lines a
/// failure shows.
pub struct Step<'a> {
    pub title: &'a str,
    /// How long it takes, said when it starts (`about 6 minutes on 2 cores the first time`);
    /// empty for nothing.
    pub about: &'a str,
    pub log: PathBuf,
    pub todo: &'a str,
    pub gauge: Gauge,
    pub tail: usize,
}

impl<'a> Step<'a> {
    /// A short step (a download, a pip install): its elapsed time shown, the log's last 10
    /// lines on failure.
    pub fn short(title: &'a str, log: PathBuf, todo: &'a str) -> Step<'a> {
        Step {
            title,
            about: "",
            log,
            todo,
            gauge: Gauge::Time,
            tail: 10,
        }
    }

    /// Runs `command` with its stdout and stderr in the step's log (made anew), showing its
    /// progress until it exits; the one line `<title>: done in <time>` when it exits 0 (a
    /// build's names its log, and off a terminal a build's start is a line too), else the
    /// failure (the last lines of the log, its path, what to do). Blocks until it exits.
    pub fn run(&self, command: &mut Command) -> Result<(), Failure> {
        let cannot_log = |err: std::io::Error| {
            Failure::new(
                format!("cannot write the log {}: {err}", self.log.display()),
                "check free space and permissions of the cache dir",
            )
        };
        if let Some(dir) = self.log.parent() {
            std::fs::create_dir_all(dir).map_err(cannot_log)?;
        }
        let log = File::create(&self.log).map_err(cannot_log)?;
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(cannot_log)?)
            .stderr(log);
        let started = Instant::now();
        let mut child = command.spawn().map_err(|err| {
            Failure::new(
                format!(
                    "{}: cannot start `{}`: {err}",
                    self.title,
                    process::describe(command)
                ),
                "check that it is installed and on PATH",
            )
        })?;
        let terminal = std::io::stdout().is_terminal();
        let mut ticker = Ticker::new(self.title, terminal);
        let mut reader = Progress::new(self.gauge);
        let mut read_from = File::open(&self.log).map_err(cannot_log)?;
        // A build is announced with its log, so a reader can follow it there.
        let build = self.gauge != Gauge::Time;
        if build && !terminal {
            let about = if self.about.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.about)
            };
            println!(
                "{}: started{about}; log: {}",
                self.title,
                self.log.display()
            );
        }
        let status = loop {
            let exited = child.try_wait().map_err(|err| {
                Failure::new(
                    format!("cannot wait for `{}`: {err}", process::describe(command)),
                    self.todo,
                )
            })?;
            let mut new = Vec::new();
            let _ = read_from.read_to_end(&mut new);
            reader.feed(&new);
            if let Some(status) = exited {
                break status;
            }
            // Until the log says how far it is, the line says how long it takes.
            let shown = reader
                .shown()
                .or_else(|| (!self.about.is_empty()).then(|| self.about.to_owned()));
            if let Some(line) = ticker.tick(started.elapsed(), shown.as_deref()) {
                print!("{line}");
                let _ = std::io::stdout().flush();
            }
            std::thread::sleep(POLL);
        };
        let elapsed = started.elapsed();
        if status.success() {
            let line = if build {
                ticker.done(elapsed, &format!("log: {}", self.log.display()))
            } else {
                ticker.done_with(&format!("done in {}", clock(elapsed)))
            };
            println!("{line}");
            return Ok(());
        }
        println!(
            "{}",
            ticker.done_with(&format!("failed after {}", clock(elapsed)))
        );
        let _ = read_from.seek(SeekFrom::Start(0));
        let mut text = String::new();
        let _ = read_from.read_to_string(&mut text);
        Err(failed(
            self.title,
            &process::describe_status(status),
            &tail(&text, self.tail),
            &self.log,
            self.todo,
        ))
    }
}

/// The failure of a step: which, how its program ended, the last lines of its log, the log,
/// what to do. Lines after the first are indented under it.
pub fn failed(title: &str, how: &str, last: &[&str], log: &Path, todo: &str) -> Failure {
    let mut text = format!("{title} failed ({how})");
    if last.is_empty() {
        text.push_str("; its log is empty");
    } else {
        text.push_str("; the last lines of its log:");
        for line in last {
            text.push_str("\n    | ");
            text.push_str(line);
        }
    }
    text.push_str(&format!("\n  log: {}\n  what to do: {todo}", log.display()));
    Failure(text)
}

/// The last `n` lines of a log that say something (a terminal's redrawn lines, after their
/// last carriage return).
pub fn tail(text: &str, n: usize) -> Vec<&str> {
    let lines: Vec<&str> = text
        .lines()
        .map(|line| line.rsplit('\r').next().unwrap_or(line).trim_end())
        .filter(|line| !line.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

/// A duration as a person reads a build's: `45s`, `2m05s`, `1h02m`.
pub fn clock(elapsed: Duration) -> String {
    let s = elapsed.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// What the log has said so far about how far the step is.
struct Progress {
    gauge: Gauge,
    /// The end of the log not yet read as a whole line.
    partial: String,
    percent: Option<u32>,
    crates: usize,
}

impl Progress {
    fn new(gauge: Gauge) -> Self {
        Progress {
            gauge,
            partial: String::new(),
            percent: None,
            crates: 0,
        }
    }

    /// Reads what the log got since the last call.
    fn feed(&mut self, new: &[u8]) {
        if self.gauge == Gauge::Time || new.is_empty() {
            return;
        }
        self.partial.push_str(&String::from_utf8_lossy(new));
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        let whole: String = self.partial.drain(..=end).collect();
        for line in whole.lines() {
            match self.gauge {
                Gauge::Percent => self.percent = percent_of(line).or(self.percent),
                Gauge::Crates => {
                    if line.trim_start().starts_with("Compiling ") {
                        self.crates += 1;
                    }
                }
                Gauge::Time => {}
            }
        }
    }

    /// The progress as the step's line shows it, when there is any.
    fn shown(&self) -> Option<String> {
        match self.gauge {
            Gauge::Percent => self.percent.map(|p| format!("{p}%")),
            Gauge::Crates if self.crates > 0 => Some(format!("{} crates compiled", self.crates)),
            _ => None,
        }
    }
}

/// The percentage a build tool's line starts with: cmake's Makefiles `[ 35%]`, Ninja's
/// `[123/456]`; None for any other line.
pub fn percent_of(line: &str) -> Option<u32> {
    let inside = line.trim_start().strip_prefix('[')?;
    let (inside, _) = inside.split_once(']')?;
    if let Some(number) = inside.strip_suffix('%') {
        return number.trim().parse().ok().filter(|p| *p <= 100);
    }
    let (done, total) = inside.split_once('/')?;
    let (done, total): (u64, u64) = (done.trim().parse().ok()?, total.trim().parse().ok()?);
    (total > 0 && done <= total).then(|| (done * 100 / total) as u32)
}

/// When and what a running step prints: on a terminal, its line rewritten in place at most
/// every second; elsewhere a plain line every [`PERIOD`].
pub struct Ticker<'a> {
    title: &'a str,
    terminal: bool,
    /// The elapsed time of the last line printed.
    last: Option<Duration>,
}

impl<'a> Ticker<'a> {
    pub fn new(title: &'a str, terminal: bool) -> Self {
        Ticker {
            title,
            terminal,
            last: None,
        }
    }

    /// The text to print now, `elapsed` into the step, if any: on a terminal a carriage
    /// return, the line cleared and rewritten (no newline); elsewhere a whole line.
    pub fn tick(&mut self, elapsed: Duration, progress: Option<&str>) -> Option<String> {
        let every = if self.terminal { REDRAW } else { PERIOD };
        let due = match self.last {
            None if self.terminal => true,
            None => elapsed >= every,
            Some(last) => elapsed >= last + every,
        };
        if !due {
            return None;
        }
        self.last = Some(elapsed);
        let progress = progress.map_or(String::new(), |p| format!("{p}, "));
        Some(if self.terminal {
            format!("\r\x1b[2K{}: {progress}{}", self.title, clock(elapsed))
        } else {
            format!("{}: {progress}{} so far\n", self.title, clock(elapsed))
        })
    }

    /// The step's last line, `<title>: done in <time>; <note>` (after the line in place).
    pub fn done(&self, elapsed: Duration, note: &str) -> String {
        self.done_with(&format!("done in {}; {note}", clock(elapsed)))
    }

    /// The step's last line with these words.
    pub fn done_with(&self, words: &str) -> String {
        let clear = if self.terminal && self.last.is_some() {
            "\r\x1b[2K"
        } else {
            ""
        };
        format!("{clear}{}: {words}", self.title)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmake_and_ninja_lines_say_how_far_the_build_is() {
        assert_eq!(
            percent_of("[ 35%] Building CXX object src/llama.cpp.o"),
            Some(35)
        );
        assert_eq!(
            percent_of("[100%] Linking CXX executable ../../bin/llama-server"),
            Some(100)
        );
        assert_eq!(percent_of("[  0%] Generating build details"), Some(0));
        assert_eq!(percent_of("[123/456] Building C object ggml.c.o"), Some(26));
        for other in [
            "make[2]: Entering directory",
            "-- Configuring done",
            "[ab%] x",
            "[5/0] x",
            "[101%] x",
            "",
        ] {
            assert_eq!(percent_of(other), None, "{other}");
        }
    }

    #[test]
    fn the_log_is_read_in_whole_lines_as_it_grows() {
        let mut p = Progress::new(Gauge::Percent);
        p.feed(b"-- Configuring done\n[ 1");
        assert_eq!(p.shown(), None, "half a line is not read");
        p.feed(b"2%] Building C object a.o\nwarning: x\n");
        assert_eq!(p.shown().as_deref(), Some("12%"));
        p.feed(b"In file included from y.h:\n");
        assert_eq!(
            p.shown().as_deref(),
            Some("12%"),
            "a line without one keeps it"
        );
        let mut c = Progress::new(Gauge::Crates);
        c.feed(b"   Compiling serde v1.0\n   Compiling tokio v1.0\nwarning: unused\n");
        assert_eq!(c.shown().as_deref(), Some("2 crates compiled"));
        let mut t = Progress::new(Gauge::Time);
        t.feed(b"[ 50%] x\n");
        assert_eq!(t.shown(), None);
    }

    #[test]
    fn on_a_terminal_the_line_is_rewritten_in_place_every_second() {
        let mut t = Ticker::new("building llama.cpp", true);
        let s = Duration::from_secs;
        assert_eq!(
            t.tick(s(0), None).as_deref(),
            Some("\r\x1b[2Kbuilding llama.cpp: 0s")
        );
        assert_eq!(t.tick(Duration::from_millis(400), Some("1%")), None);
        assert_eq!(
            t.tick(s(135), Some("35%")).as_deref(),
            Some("\r\x1b[2Kbuilding llama.cpp: 35%, 2m15s")
        );
        assert_eq!(
            t.done(s(331), "log: /c/logs/b.log"),
            "\r\x1b[2Kbuilding llama.cpp: done in 5m31s; log: /c/logs/b.log"
        );
    }

    #[test]
    fn elsewhere_a_plain_line_comes_every_period() {
        let mut t = Ticker::new("building llama.cpp", false);
        let s = Duration::from_secs;
        assert_eq!(t.tick(s(1), Some("3%")), None);
        assert_eq!(t.tick(s(29), Some("9%")), None);
        assert_eq!(
            t.tick(s(30), Some("10%")).as_deref(),
            Some("building llama.cpp: 10%, 30s so far\n")
        );
        assert_eq!(t.tick(s(59), Some("19%")), None);
        assert_eq!(
            t.tick(s(61), None).as_deref(),
            Some("building llama.cpp: 1m01s so far\n")
        );
        // Over a 6-minute build: a dozen lines, none in place.
        let mut t = Ticker::new("b", false);
        let lines = (0..360 * 5)
            .filter_map(|i| t.tick(Duration::from_millis(i * 200), Some("x")))
            .inspect(|l| assert!(!l.contains('\r')))
            .count();
        assert_eq!(lines, 11);
        assert_eq!(t.done(s(360), "log: l"), "b: done in 6m00s; log: l");
    }

    #[test]
    fn a_failure_names_the_step_its_last_lines_the_log_and_what_to_do() {
        let log = "[ 90%] Building C object a.o\r\n\
                   a.c:1:1: error: unknown type name 'x'\n\n\
                   make[2]: *** [a.o] Error 1\n\
                   \rprogress\rgmake: *** [all] Error 2\n";
        let last = tail(log, 3);
        assert_eq!(
            last,
            [
                "a.c:1:1: error: unknown type name 'x'",
                "make[2]: *** [a.o] Error 1",
                "gmake: *** [all] Error 2"
            ]
        );
        let f = failed(
            "building llama.cpp",
            "exit status 2",
            &last,
            Path::new("/c/logs/llama-cpp-build.log"),
            "fix the cause, then rerun `cargo xtask setup` (the build resumes)",
        );
        assert_eq!(
            f.0,
            "building llama.cpp failed (exit status 2); the last lines of its log:\n    \
             | a.c:1:1: error: unknown type name 'x'\n    | make[2]: *** [a.o] Error 1\n    \
             | gmake: *** [all] Error 2\n  log: /c/logs/llama-cpp-build.log\n  \
             what to do: fix the cause, then rerun `cargo xtask setup` (the build resumes)"
        );
        assert!(tail("", 20).is_empty());
        assert!(
            failed("t", "exit status 1", &[], Path::new("l"), "x")
                .0
                .contains("its log is empty")
        );
    }

    #[test]
    fn durations_read_as_a_build_clock() {
        let s = Duration::from_secs;
        assert_eq!(clock(s(0)), "0s");
        assert_eq!(clock(s(59)), "59s");
        assert_eq!(clock(s(60)), "1m00s");
        assert_eq!(clock(s(331)), "5m31s");
        assert_eq!(clock(s(3720)), "1h02m");
    }
}
