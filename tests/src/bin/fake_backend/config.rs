//! The command line (llama-server's own flags) and the `FAKE_*` environment, read once at start.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use nix::sys::signal::Signal;

/// llama-server's defaults, kept so a test that omits a flag sees what the real server would do.
const DEFAULT_HOST: &str = "127.0.0.1";
const DEFAULT_PORT: u16 = 8080;
const DEFAULT_MODEL: &str = "models/7B/ggml-model-f16.gguf";
const DEFAULT_N_CTX: u32 = 4096;

/// What the command line asks for.
pub enum Command {
    Serve(Box<Config>),
    Version,
    Help,
}

/// How the process ends when told to (`FAKE_EXIT_AFTER_MS`, the `fake_exit` trigger).
#[derive(Clone, Copy)]
pub struct ExitPlan {
    /// Exit status (`FAKE_EXIT_CODE`, default 1).
    pub code: i32,
    /// Kill the process with this signal instead (`FAKE_EXIT_SIGNAL`).
    pub signal: Option<Signal>,
}

/// Everything the fake backend was told at start. Read-only afterwards.
pub struct Config {
    /// `--host`, as given (printed back in the log lines).
    pub host: String,
    /// `--port`; 0 asks the kernel for a free one.
    pub port: u16,
    /// `-m`/`--model`, as given.
    pub model_path: String,
    /// `FAKE_MODEL_NAME`, else the alphabetically first `--alias`, else the model path.
    pub model_name: String,
    /// `--slot-save-path`; slot actions answer 501 without it.
    pub slot_save_path: Option<PathBuf>,
    /// `GET /slots` is on unless `--no-slots`.
    pub slots_endpoint: bool,
    /// `GET /metrics` is on only with `--metrics`.
    pub metrics: bool,
    /// `-c`/`--ctx-size` when above 0, else 4096: the one slot's context.
    pub n_ctx: u32,
    /// `FAKE_LOAD_MS`: how long every route answers 503 "Loading model".
    pub load: Duration,
    /// `FAKE_RECORD`: the JSON-lines file every request is appended to.
    pub record: Option<PathBuf>,
    /// `FAKE_STDERR_LINES` then the lines of `FAKE_STDERR_LINES_FILE`.
    pub stderr_lines: Vec<String>,
    /// `FAKE_STDERR_AFTER_MS`: delay before those lines.
    pub stderr_after: Duration,
    /// `FAKE_EXIT_AFTER_MS`: exit on its own this long after start.
    pub exit_after: Option<Duration>,
    /// `FAKE_EXIT_CODE` and `FAKE_EXIT_SIGNAL`.
    pub exit: ExitPlan,
    /// `FAKE_IGNORE_SIGTERM`: SIGTERM is logged and otherwise ignored.
    pub ignore_sigterm: bool,
    /// `FAKE_SIGTERM_DEADLOCK`: SIGTERM's handler waits forever on a lock another thread holds.
    pub sigterm_deadlock: bool,
    /// `FAKE_SSE_EVENTS`: content chunks per streamed reply.
    pub sse_events: usize,
    /// `FAKE_SSE_INTERVAL_MS`: pause between two content chunks.
    pub sse_interval: Duration,
    /// `FAKE_SSE_GATE`: a folder; content chunk N (from 1) waits until a file named N is in it,
    /// so a test says when the client got chunk N-1 instead of timing the stream.
    pub sse_gate: Option<PathBuf>,
    /// `FAKE_DS4`: the ds4-server route set (health on `GET /v1/models`, no llama.cpp extras).
    pub ds4: bool,
    /// `FAKE_CLOSE_EVERY`: every Nth reply closes its connection (0: never), as llama-server
    /// closes a kept-alive connection after its 100th request.
    pub close_every: u64,
    /// `FAKE_CLOSE_AFTER_STREAM_MS`: after a streamed reply's last bytes its connection reads
    /// nothing more and is closed this long later, as llama-server closes it at once (None:
    /// connections are kept as usual).
    pub close_after_stream: Option<Duration>,
    /// `FAKE_TOOL_MS`: how long a tool call (`POST /tools`, as llama-server's `--tools`) takes
    /// before its result.
    pub tool_call: Duration,
    /// `FAKE_SLOTS`: generations run at once; the others wait their turn, as llama-server's
    /// deferred tasks (0: no limit).
    pub slots: usize,
    /// `FAKE_FORK_CHILD`: a file; at start the fake forks a child of its own that ignores
    /// SIGTERM (as an engine's helper it starts itself, with no parent-death signal) and writes
    /// its pid there.
    pub fork_child: Option<PathBuf>,
}

/// Parses llama-server's argument list and the environment (`env` looks a variable up).
/// Errors are one line meant for stderr.
pub fn parse(
    args: impl IntoIterator<Item = String>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Command, String> {
    let mut host = DEFAULT_HOST.to_owned();
    let mut port = DEFAULT_PORT;
    let mut model_path = DEFAULT_MODEL.to_owned();
    let mut alias: Option<String> = None;
    let mut slot_save_path = None;
    let mut slots_endpoint = true;
    let mut metrics = false;
    let mut n_ctx = DEFAULT_N_CTX;

    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        // `--flag=value` is accepted for every long flag.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let value = |args: &mut std::iter::Peekable<_>| -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("error: expected value for argument: {flag}"))
        };
        match flag.as_str() {
            "--version" => return Ok(Command::Version),
            "-h" | "--help" | "--usage" => return Ok(Command::Help),
            "-m" | "--model" => model_path = value(&mut args)?,
            "--host" => host = value(&mut args)?,
            "--port" => {
                let v = value(&mut args)?;
                port = v
                    .parse()
                    .map_err(|_| format!("error: invalid argument: --port {v}"))?;
            }
            "-a" | "--alias" => alias = Some(value(&mut args)?),
            "--slot-save-path" => {
                let dir = PathBuf::from(value(&mut args)?);
                if !dir.is_dir() {
                    return Err(format!(
                        "error: --slot-save-path: directory '{}' does not exist; create it first",
                        dir.display()
                    ));
                }
                slot_save_path = Some(dir);
            }
            "--no-slots" => slots_endpoint = false,
            "--slots" => slots_endpoint = true,
            "--metrics" => metrics = true,
            "-c" | "--ctx-size" => {
                let v = value(&mut args)?;
                let n: u32 = v
                    .parse()
                    .map_err(|_| format!("error: invalid argument: --ctx-size {v}"))?;
                n_ctx = if n == 0 { DEFAULT_N_CTX } else { n };
            }
            // Any other flag is accepted and ignored, with its value when one follows.
            _ => {
                if inline.is_none() && args.peek().is_some_and(|next| is_value(next)) {
                    args.next();
                }
            }
        }
    }

    let model_name = match env("FAKE_MODEL_NAME").filter(|s| !s.is_empty()) {
        Some(name) => name,
        // llama-server keeps its aliases in a std::set and reports the first, i.e. the smallest.
        None => match &alias {
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .min()
                .unwrap_or(&model_path)
                .to_owned(),
            None => model_path.clone(),
        },
    };

    let mut stderr_lines: Vec<String> = match env("FAKE_STDERR_LINES") {
        Some(v) => split_lines(&v.replace("\\n", "\n")),
        None => Vec::new(),
    };
    if let Some(path) = env("FAKE_STDERR_LINES_FILE").filter(|s| !s.is_empty()) {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("error: FAKE_STDERR_LINES_FILE={path}: {e}"))?;
        stderr_lines.extend(split_lines(&text));
    }

    let signal = match env("FAKE_EXIT_SIGNAL").filter(|s| !s.is_empty()) {
        Some(name) => Some(parse_signal(&name)?),
        None => None,
    };

    Ok(Command::Serve(Box::new(Config {
        host,
        port,
        model_path,
        model_name,
        slot_save_path,
        slots_endpoint,
        metrics,
        n_ctx,
        load: millis(&env, "FAKE_LOAD_MS")?.unwrap_or_default(),
        record: env("FAKE_RECORD")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from),
        stderr_lines,
        stderr_after: millis(&env, "FAKE_STDERR_AFTER_MS")?.unwrap_or_default(),
        exit_after: millis(&env, "FAKE_EXIT_AFTER_MS")?,
        exit: ExitPlan {
            code: number(&env, "FAKE_EXIT_CODE")?.unwrap_or(1),
            signal,
        },
        ignore_sigterm: flag(&env, "FAKE_IGNORE_SIGTERM")?,
        sigterm_deadlock: flag(&env, "FAKE_SIGTERM_DEADLOCK")?,
        sse_events: number(&env, "FAKE_SSE_EVENTS")?.unwrap_or(8),
        sse_interval: millis(&env, "FAKE_SSE_INTERVAL_MS")?.unwrap_or(Duration::from_millis(5)),
        sse_gate: env("FAKE_SSE_GATE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from),
        ds4: flag(&env, "FAKE_DS4")?,
        close_every: number(&env, "FAKE_CLOSE_EVERY")?.unwrap_or(0),
        close_after_stream: millis(&env, "FAKE_CLOSE_AFTER_STREAM_MS")?,
        tool_call: millis(&env, "FAKE_TOOL_MS")?.unwrap_or(Duration::ZERO),
        slots: number(&env, "FAKE_SLOTS")?.unwrap_or(0),
        fork_child: env("FAKE_FORK_CHILD")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from),
    })))
}

/// A token after an unknown flag is its value unless it is itself a flag; `-1` is a value.
fn is_value(token: &str) -> bool {
    !token.starts_with('-') || token.parse::<f64>().is_ok()
}

/// Lines of a value or file; a final line break does not make an empty last line.
fn split_lines(text: &str) -> Vec<String> {
    let text = text.strip_suffix('\n').unwrap_or(text);
    if text.is_empty() {
        return Vec::new();
    }
    text.split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l).to_owned())
        .collect()
}

/// `KILL`, `SIGKILL`, `kill` or `9`.
fn parse_signal(name: &str) -> Result<Signal, String> {
    if let Ok(n) = name.parse::<i32>() {
        return Signal::try_from(n)
            .map_err(|_| format!("error: FAKE_EXIT_SIGNAL={name}: no such signal"));
    }
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    Signal::from_str(&full).map_err(|_| {
        format!("error: FAKE_EXIT_SIGNAL={name}: no such signal (use a name such as KILL or SEGV)")
    })
}

fn number<T: FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<T>, String> {
    match env(name).filter(|s| !s.trim().is_empty()) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("error: {name}={v}: not a number")),
    }
}

fn millis(env: &impl Fn(&str) -> Option<String>, name: &str) -> Result<Option<Duration>, String> {
    Ok(number::<u64>(env, name)?.map(Duration::from_millis))
}

fn flag(env: &impl Fn(&str) -> Option<String>, name: &str) -> Result<bool, String> {
    match env(name).as_deref().map(str::trim) {
        None | Some("" | "0" | "false" | "no" | "off") => Ok(false),
        Some("1" | "true" | "yes" | "on") => Ok(true),
        Some(v) => Err(format!("error: {name}={v}: use 1 or 0")),
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
