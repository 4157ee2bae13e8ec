//! `1bit plugins check FILE`: the conformance check a vendor runs on a route library or a
//! route package before shipping it: a package checked as `install` checks it (`package`),
//! the route loaded as serve would, then info, claim and plan on a model; for a route that
//! answers in process: start, health, a whole and a streamed answer, a slow reader, a client
//! that leaves, bad input, a panic contained, metrics; for a route that runs child processes:
//! serve itself with the fake backend standing in for each (`through_serve`). One line per
//! check. A check that reached nothing beyond the plan (it refused the model) exits 2 saying
//! to pass `-m MODEL`. `--route-opt KEY=VALUE` reaches the plan as `1bit serve --route-opt`
//! passes it.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use onebit_plugin_api::loader::{self, LoadedRoute, RespondError};
use onebit_plugin_api::{
    Action, ForwardRequest, HealthProbe, PlanOutcome, PlanRequest, Purpose, Refusal, ReplySink,
    RouteOption, ServeOptions, SinkError, Started,
};

use crate::prepare;
use onebit_command::cli::ServeArgs;
use onebit_command::{error, model};

mod package;
mod programs;
mod through_serve;

/// How long one answer may take before the check calls it hung.
const ANSWER_LIMIT: Duration = Duration::from_secs(120);
/// The slow reader's pause per send.
const SLOW_SEND: Duration = Duration::from_millis(30);

/// What the check was asked besides the file and the model.
pub struct Asked<'a> {
    /// `--route-opt KEY=VALUE`, as given.
    pub route_opt: &'a [String],
    /// `--real-backends`: the plan's own programs instead of the fake backend.
    pub real_backends: bool,
    /// `--ready-s`: how long serve has to say ready.
    pub ready: Duration,
}

/// The request body every answer check sends: shaped for both OpenAI paths (a completion
/// reads `prompt`, a chat `messages`), small and greedy.
fn body(stream: bool, extra: &[(&str, serde_json::Value)]) -> String {
    let mut body = serde_json::json!({
        "prompt": "Hello",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        // The test fixture route streams this many events.
        "events": 8,
    });
    for (key, value) in extra {
        body[*key] = value.clone();
    }
    body.to_string()
}

/// The check's report: one line per check, counting failures.
#[derive(Default)]
pub(crate) struct Report {
    failed: usize,
}

impl Report {
    pub(crate) fn ok(&mut self, check: &str, detail: impl AsRef<str>) {
        println!("ok   {check}: {}", detail.as_ref());
    }
    pub(crate) fn fail(&mut self, check: &str, detail: impl AsRef<str>) {
        self.failed += 1;
        println!("FAIL {check}: {}", detail.as_ref());
    }
    pub(crate) fn skip(&mut self, check: &str, detail: impl AsRef<str>) {
        println!("skip {check}: {}", detail.as_ref());
    }
}

/// Run every check on `file`, with `model` (else a fixture file that is not a GGUF) for claim
/// and plan, and `route_opt` (`--route-opt KEY=VALUE`, as given) in the plan request. Called by
/// main on its thread; blocks while the route answers (a model load, a few short generations).
/// Returns serve's exit status: 0 when every check passed (a plan that answers nothing in
/// process is checked as far as its plan), 1 when one failed, 2 when the plan refused the
/// model, so that nothing beyond it was checked, or when an option is not KEY=VALUE.
pub fn run(file: &Path, model_path: Option<&Path>, asked_for: &Asked) -> i32 {
    let route_opt = asked_for.route_opt;
    // Parsed by serve's own parser, so a value without `=` gets serve's refusal.
    let asked = ServeArgs {
        route_opt: route_opt.to_vec(),
        ..ServeArgs::default()
    };
    let options = match prepare::route_options(&asked) {
        Ok(options) => options,
        Err(fatal) => return usage(&fatal),
    };
    let mut report = Report::default();
    let Some(opened) = open(file, &mut report) else {
        return if report.failed > 0 {
            finish(&report)
        } else {
            error::exit::BACKEND
        };
    };
    let route = &opened.route;
    report.ok(
        "load",
        format!("{} (ABI {})", route.file.display(), route.abi_version),
    );
    if route.info.name.is_empty() {
        report.fail("info", "the route gives no name");
    } else {
        report.ok(
            "info",
            format!("{}: {}", route.info.name, route.info.summary),
        );
    }
    let fixture;
    let model_path = match model_path {
        Some(path) => path.to_path_buf(),
        None => {
            fixture = fixture_model();
            fixture.clone()
        }
    };
    if let Err(fatal) = prepare::route_can_take(route, &options) {
        return usage(&fatal);
    }
    let request = match plan_request(route, &model_path, options) {
        Ok(request) => request,
        Err(line) => {
            report.fail("model", line);
            return error::exit::BACKEND;
        }
    };
    match route.claim(&request) {
        Ok(claim) => report.ok(
            "claim",
            format!("strength {} ({})", claim.strength, claim.reason),
        ),
        Err(e) => report.fail("claim", e),
    }
    let plan = match route.plan(&request) {
        Ok(PlanOutcome::Plan(plan)) => plan,
        Ok(PlanOutcome::Refused(refusal)) => {
            let with_options = !route_opt.is_empty();
            return refused(&mut report, &refusal, &model_path, route, with_options);
        }
        Err(e) => {
            report.fail("plan", e);
            return finish(&report);
        }
    };
    report.ok(
        "plan",
        format!(
            "device {}, {} backends, {} rules",
            plan.device,
            plan.backends.len(),
            plan.rules.len()
        ),
    );
    let in_process = plan.rules.iter().find(|r| r.action == Action::InProcess);
    let Some(rule) = in_process else {
        return through_serve(&opened, &model_path, &plan, asked_for, report);
    };
    if !route.can_respond() {
        report.fail(
            "respond",
            "the plan asks for in-process answers but the route was built before ABI 1.2",
        );
        return finish(&report);
    }
    let path = rule.path.replace('*', "x");
    let started = Started {
        plan: plan.clone(),
        pids: Vec::new(),
    };
    if let Err(e) = route.start(&started) {
        report.fail("start", e);
        return finish(&report);
    }
    report.ok("start", "started");
    match route.health(&HealthProbe::default()) {
        Ok(h) if h.ok => report.ok("health", "healthy"),
        Ok(h) => report.fail("health", format!("unhealthy after start: {}", h.reason)),
        Err(e) => report.fail("health", e),
    }
    answers(route, &path, &mut report);
    match route.metrics() {
        Ok(text) => report.ok("metrics", format!("{} lines", text.lines().count())),
        Err(e) => report.fail("metrics", e),
    }
    finish(&report)
}

/// A plan that runs child processes: its programs checked, then serve run with the route.
fn through_serve(
    opened: &package::Opened,
    model_path: &Path,
    plan: &onebit_plugin_api::Plan,
    asked_for: &Asked,
    mut report: Report,
) -> i32 {
    let programs_ok = programs::check(plan, opened.route.package.as_ref(), &mut report);
    if asked_for.real_backends && !programs_ok {
        report.skip("serve", "a program the plan runs cannot be started (above)");
        return finish(&report);
    }
    let subject = through_serve::Subject {
        route: &opened.route,
        plugin_dir: &opened.plugin_dir,
        model: model_path,
        route_opt: asked_for.route_opt,
        plan,
        real_backends: asked_for.real_backends,
        ready: asked_for.ready,
        trust_dir: opened.trust_dir(),
    };
    through_serve::check(&subject, &mut report);
    finish(&report)
}

/// A package is checked as install checks it, and its route loaded as serve loads it; a
/// route file is loaded as serve loads one. None when that failed (reported).
fn open(file: &Path, report: &mut Report) -> Option<package::Opened> {
    if package::is_package(file) {
        return package::open(file, report);
    }
    match loader::load(file) {
        Ok(route) => Some(package::Opened::loose(
            route,
            file.parent().unwrap_or(Path::new(".")).to_path_buf(),
        )),
        Err(e) => {
            report.fail("load", e.to_string());
            None
        }
    }
}

/// A usage error before any check: one line on stderr, as serve says it, exit 2.
fn usage(fatal: &error::Fatal) -> i32 {
    eprintln!("1bit plugins check: {}", fatal.message);
    error::exit::USAGE
}

/// A plan that refused: a pass when the refusal is one line, but nothing beyond it was
/// checked, which the last line says (exit 2) unless a check already failed.
fn refused(
    report: &mut Report,
    refusal: &Refusal,
    model_path: &Path,
    route: &LoadedRoute,
    with_options: bool,
) -> i32 {
    if refusal.message.trim().is_empty() || refusal.message.contains('\n') {
        report.fail("plan", "refused without one line saying why");
        return finish(report);
    }
    report.ok(
        "plan",
        format!(
            "refused {} (exit {}): {}",
            model_path.display(),
            refusal.exit_status(),
            refusal.message
        ),
    );
    report.skip("answers", "the plan refused this model");
    if report.failed > 0 {
        return finish(report);
    }
    let options = if with_options {
        ", and --route-opt only with options it takes"
    } else {
        ""
    };
    println!(
        "nothing beyond plan was checked: pass -m MODEL with a model the {} route serves{options}",
        route.info.name
    );
    error::exit::USAGE
}

fn finish(report: &Report) -> i32 {
    if report.failed == 0 {
        error::exit::OK
    } else {
        println!("{} checks failed", report.failed);
        error::exit::BACKEND
    }
}

/// A file that exists and is not a GGUF, for routes checked without `-m`.
fn fixture_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("1bit-plugins-check-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("fixture.gguf");
    let _ = std::fs::write(&path, b"not a gguf: a fixture model for 1bit plugins check");
    path
}

/// The plan request serve would build for `model` with only `--device NAME` and the route
/// options.
fn plan_request(
    route: &LoadedRoute,
    model_path: &Path,
    route_options: Vec<RouteOption>,
) -> Result<PlanRequest, String> {
    let facts = model::facts(model_path).map_err(|e| e.to_string())?;
    Ok(PlanRequest {
        purpose: Purpose::Serve,
        options: ServeOptions {
            model: model_path.to_string_lossy().into_owned(),
            served_name: model::served_name(model_path, None),
            host: "127.0.0.1".to_string(),
            port: 8000,
            device: route.info.name.clone(),
            route_options,
            ..Default::default()
        },
        model: facts,
        env: std::env::vars().collect(),
        ports: vec![0; 4],
        run_dir: std::env::temp_dir().to_string_lossy().into_owned(),
        ..PlanRequest::default()
    })
}

/// What a check's sink saw.
#[derive(Default, Debug)]
struct Seen {
    heads: Vec<(u16, String)>,
    body: Vec<u8>,
    sends: usize,
    /// Sends after the sink started refusing (the client had left).
    sends_after_gone: usize,
    ended: bool,
}

/// A sink as the host's behaves: optionally slow, optionally refusing after `leave_after`
/// body sends (a client that left).
struct CheckSink {
    seen: Seen,
    slow: bool,
    leave_after: Option<usize>,
}

impl ReplySink for CheckSink {
    fn send_head(&mut self, status: u16, content_type: &str) -> Result<(), SinkError> {
        self.seen.heads.push((status, content_type.to_string()));
        Ok(())
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), SinkError> {
        if self.leave_after.is_some_and(|n| self.seen.sends >= n) {
            self.seen.sends_after_gone += 1;
            return Err(SinkError {
                message: "the client is gone".to_string(),
            });
        }
        if self.slow {
            std::thread::sleep(SLOW_SEND);
        }
        self.seen.sends += 1;
        self.seen.body.extend_from_slice(bytes);
        Ok(())
    }

    fn end(&mut self) {
        self.seen.ended = true;
    }

    fn client_gone(&self) -> bool {
        self.leave_after.is_some_and(|n| self.seen.sends >= n)
    }
}

/// Whether an answer check asks the route's export layer to panic
/// ([`onebit_plugin_api::CHECK_PANIC_MESSAGE`]).
#[derive(Clone, Copy)]
enum Panic {
    No,
    Asked,
}

/// A check's time, in milliseconds.
fn in_ms(took: Duration) -> String {
    format!("{:.1} ms", took.as_secs_f64() * 1000.0)
}

/// The heads a sink saw, in words.
fn heads_in_words(heads: &[(u16, String)]) -> String {
    if heads.is_empty() {
        return "no head".to_string();
    }
    heads
        .iter()
        .map(|(status, ct)| format!("{status} {ct}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Call `respond` on a thread of its own, bounded by [`ANSWER_LIMIT`].
fn answer(
    route: &LoadedRoute,
    path: &str,
    body: String,
    slow: bool,
    leave_after: Option<usize>,
    panic: Panic,
) -> Result<(Result<(), RespondError>, Seen, Duration), String> {
    let (tx, rx) = mpsc::channel();
    let route = route.clone();
    let request = ForwardRequest {
        method: "POST".to_string(),
        path: path.to_string(),
        query: String::new(),
        body,
    };
    let began = Instant::now();
    std::thread::spawn(move || {
        let mut sink = CheckSink {
            seen: Seen::default(),
            slow,
            leave_after,
        };
        let result = match panic {
            Panic::No => route.respond(&request, &mut sink),
            Panic::Asked => route.respond_asked_to_panic(&request, &mut sink),
        };
        let _ = tx.send((result, sink.seen));
    });
    let (result, seen) = rx
        .recv_timeout(ANSWER_LIMIT)
        .map_err(|_| format!("no answer within {} s", ANSWER_LIMIT.as_secs()))?;
    Ok((result, seen, began.elapsed()))
}

/// The answer checks, on the plan's first in-process path.
fn answers(route: &LoadedRoute, path: &str, report: &mut Report) {
    whole_answer(route, path, report);
    streamed_answers(route, path, report);
    client_leaves(route, path, report);
    bad_input(route, path, report);
    panic_contained(route, path, report);
}

/// A whole answer: one 200 application/json head and a JSON body.
fn whole_answer(route: &LoadedRoute, path: &str, report: &mut Report) {
    match answer(route, path, body(false, &[]), false, None, Panic::No) {
        Ok((Ok(()), seen, took)) => match seen.heads.as_slice() {
            [(200, ct)] if ct.starts_with("application/json") && !seen.body.is_empty() => {
                match serde_json::from_slice::<serde_json::Value>(&seen.body) {
                    Ok(_) => report.ok(
                        "whole answer",
                        format!(
                            "POST {path}: 200, {} bytes of JSON in {}",
                            seen.body.len(),
                            in_ms(took)
                        ),
                    ),
                    Err(e) => report.fail("whole answer", format!("the body is not JSON: {e}")),
                }
            }
            heads => report.fail(
                "whole answer",
                format!(
                    "expected one 200 application/json head and a body, got {} and {} bytes",
                    heads_in_words(heads),
                    seen.body.len()
                ),
            ),
        },
        Ok((Err(e), _, _)) => report.fail("whole answer", e.to_string()),
        Err(e) => report.fail("whole answer", e),
    }
}

/// A streamed answer, and a slow reader: each send blocks a while, as the host's does when its
/// buffer is full; the route must wait, not fail or skip.
fn streamed_answers(route: &LoadedRoute, path: &str, report: &mut Report) {
    let streamed = |slow: bool| answer(route, path, body(true, &[]), slow, None, Panic::No);
    type Answered = Result<(Result<(), RespondError>, Seen, Duration), String>;
    let check_stream = |name: &str, outcome: Answered, report: &mut Report| match outcome {
        Ok((Ok(()), seen, took)) => {
            let seen: Seen = seen;
            let text = String::from_utf8_lossy(&seen.body);
            let sse = seen
                .heads
                .first()
                .is_some_and(|(s, ct)| *s == 200 && ct.starts_with("text/event-stream"));
            if sse && text.trim_end().ends_with("data: [DONE]") {
                report.ok(
                    name,
                    format!(
                        "{} sends ending in data: [DONE] in {}",
                        seen.sends,
                        in_ms(took)
                    ),
                );
            } else {
                report.fail(
                    name,
                    format!(
                        "expected a 200 text/event-stream ending in data: [DONE], got {} ending \"{}\"",
                        heads_in_words(&seen.heads),
                        text.chars().rev().take(40).collect::<String>().chars().rev().collect::<String>().escape_debug()
                    ),
                );
            }
        }
        Ok((Err(e), _, _)) => report.fail(name, e.to_string()),
        Err(e) => report.fail(name, e),
    };
    check_stream("streamed answer", streamed(false), report);
    check_stream("slow reader", streamed(true), report);
}

/// A client that leaves after the first send: the route must stop sending and return.
fn client_leaves(route: &LoadedRoute, path: &str, report: &mut Report) {
    match answer(route, path, body(true, &[]), false, Some(1), Panic::No) {
        Ok((_, seen, took)) if seen.sends_after_gone <= 1 => report.ok(
            "client leaves",
            format!("stopped after the first refused send, in {}", in_ms(took)),
        ),
        Ok((_, seen, _)) => report.fail(
            "client leaves",
            format!(
                "the route sent {} more times after the sink refused",
                seen.sends_after_gone - 1
            ),
        ),
        Err(e) => report.fail("client leaves", e),
    }
}

/// Bad input: the route answers it (an error reply or an error), it does not crash.
fn bad_input(route: &LoadedRoute, path: &str, report: &mut Report) {
    match answer(
        route,
        path,
        r#"{"messages":42,"prompt":42,"max_tokens":"x"}"#.to_string(),
        false,
        None,
        Panic::No,
    ) {
        Ok((Ok(()), seen, _)) => report.ok(
            "bad input",
            format!("answered {}", heads_in_words(&seen.heads)),
        ),
        Ok((Err(RespondError::Failed(e)), _, _)) => {
            report.ok("bad input", format!("an error: {e}"))
        }
        Ok((Err(e), _, _)) => report.fail("bad input", e.to_string()),
        Err(e) => report.fail("bad input", e),
    }
}

/// A panic, asked of the route's export layer (ABI 1.5): it panics at the route's first sink
/// call, inside the route's `respond`; the boundary must catch it and the route must answer
/// again afterwards.
fn panic_contained(route: &LoadedRoute, path: &str, report: &mut Report) {
    if !route.can_be_asked_to_panic() {
        report.skip(
            "panic contained",
            format!(
                "the route was built against route ABI {}; rebuild it against onebit-plugin-api 1.5 or later for this check",
                route.abi_version
            ),
        );
        return;
    }
    match answer(route, path, body(false, &[]), false, None, Panic::Asked) {
        Ok((Err(RespondError::Failed(e)), _, _))
            if e.contains(onebit_plugin_api::CHECK_PANIC_MESSAGE) =>
        {
            match answer(route, path, body(false, &[]), false, None, Panic::No) {
                Ok((Ok(()), seen, _)) if seen.heads.first().is_some_and(|h| h.0 == 200) => {
                    report.ok("panic contained", format!("{e}; the next answer was a 200"))
                }
                Ok((outcome, seen, _)) => report.fail(
                    "panic contained",
                    format!(
                        "after the panic the route answered {}{}",
                        heads_in_words(&seen.heads),
                        outcome
                            .err()
                            .map(|e| format!(" and {e}"))
                            .unwrap_or_default()
                    ),
                ),
                Err(e) => report.fail("panic contained", format!("after the panic: {e}")),
            }
        }
        Ok((Err(e), _, _)) => report.fail(
            "panic contained",
            format!("asked to panic, the route failed otherwise: {e}"),
        ),
        Ok((Ok(()), _, _)) => report.fail(
            "panic contained",
            "asked to panic, the route answered as usual",
        ),
        Err(e) => report.fail("panic contained", e),
    }
}
