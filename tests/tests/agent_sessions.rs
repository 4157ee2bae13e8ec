//! Recorded sessions of the pinned coding agents (tests/data/agents/, `onebit_tests::agent_sessions`),
//! replayed through serve with the real llama-server: two sessions interleaved turn by turn
//! keep their prefixes (docs/serve.md, Agent sessions). `record_agent_sessions` (ignored)
//! records them again when the pins move.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use onebit_tests::agent_sessions::{self, Recorded, ScriptedModel, Step};
use onebit_tests::*;
use serde_json::{Value, json};

const SERVED: &str = "local";

/// The pinned version of an npm package (third_party/pins.json).
fn pinned(name: &str) -> String {
    let pins: Value = serde_json::from_str(
        &std::fs::read_to_string(route_fixture::root().join("third_party/pins.json")).unwrap(),
    )
    .unwrap();
    pins["npm"]["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["version"].as_str())
        .unwrap()
        .to_string()
}

fn agent_program(name: &str) -> std::path::PathBuf {
    installed("ONEBIT_TEST_AGENTS_DIR", "agents")
        .join("node_modules/.bin")
        .join(name)
}

/// The two sessions each agent is recorded in: a task and the steps the scripted model takes.
fn scripts(dir: &Path, codex: bool) -> Vec<(&'static str, &'static str, Vec<Step>)> {
    let read = |file: &str| -> (String, Value) {
        if codex {
            (format!("cat {file}"), Value::Null)
        } else {
            ("Read".into(), json!({"file_path": dir.join(file)}))
        }
    };
    let call = |said: &str, (tool, input): (String, Value)| Step::Call {
        said: said.into(),
        tool,
        input,
    };
    let grep = if codex {
        ("grep -n due todo.md".to_string(), Value::Null)
    } else {
        (
            "Grep".to_string(),
            json!({"pattern": "due", "path": dir, "output_mode": "content"}),
        )
    };
    vec![
        (
            "a",
            "Read notes.txt and todo.md, then tell me what is due first.",
            vec![
                call("I'll read the notes first.", read("notes.txt")),
                call("Now the to-do list.", read("todo.md")),
                call("Let me check the due dates.", grep),
                Step::Answer("The flaky relay test is due first, on Friday.".into()),
            ],
        ),
        (
            "b",
            "What does main.py print? Check the code and the notes.",
            vec![
                call("Let me look at main.py.", read("main.py")),
                call("And the notes, for context.", read("notes.txt")),
                Step::Answer("It prints 5: add(2, 3).".into()),
            ],
        ),
    ]
}

/// The API key the agents are given (the scripted model takes any).
const KEY: &str = "any";

/// A tmux server of its own (on its own socket, `tmux -S`), killed with all it runs when
/// dropped, its socket removed.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs (apt-get install tmux)")
    }

    /// The screen of the session's pane, as text.
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "agent"]).stdout)
            .lines()
            .map(str::trim_end)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn alive(&self) -> bool {
        self.run(&["has-session", "-t", "agent"]).status.success()
    }

    /// Types `text` (literally) and presses Enter.
    fn enter(&self, text: &str) {
        self.run(&["send-keys", "-t", "agent", "-l", text]);
        std::thread::sleep(Duration::from_millis(500));
        self.run(&["send-keys", "-t", "agent", "Enter"]);
    }

    /// Waits at most `limit` for `done`; whether it came.
    fn wait(&self, limit: Duration, mut done: impl FnMut(&Tmux) -> bool) -> bool {
        let started = Instant::now();
        while started.elapsed() < limit {
            if done(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        done(self)
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Runs Claude Code interactively, its terminal UI in a detached tmux session (a pty of
/// 200x50), in `work` with `home` as its HOME: types `task`, waits (at most `limit`) until the
/// scripted model has been asked for its last step, the answer, and quits with `/exit`. The
/// first-run dialogs (theme, onboarding, the API key, trusting the folder) are answered in
/// `home/.claude.json` beforehand; Read and Grep in the folder need no permission. Returns
/// (success, the last screen).
fn claude_interactive(
    program: &Path,
    work: &Path,
    home: &Path,
    model: &ScriptedModel,
    task: &str,
    limit: Duration,
) -> (bool, String) {
    let config = json!({
        "hasCompletedOnboarding": true,
        "lastOnboardingVersion": pinned("@anthropic-ai/claude-code"),
        "theme": "dark",
        "numStartups": 1,
        "customApiKeyResponses": {"approved": [&KEY[KEY.len().saturating_sub(20)..]], "rejected": []},
        "projects": {work.to_str().unwrap(): {
            "hasTrustDialogAccepted": true,
            "hasCompletedProjectOnboarding": true,
            "allowedTools": [],
        }},
    });
    std::fs::write(home.join(".claude.json"), config.to_string()).unwrap();
    let tmux = Tmux {
        socket: home.with_extension("tmux"),
    };
    let env = [
        ("HOME", home.to_str().unwrap().to_string()),
        ("ANTHROPIC_BASE_URL", model.url()),
        ("ANTHROPIC_API_KEY", KEY.into()),
        ("ANTHROPIC_MODEL", SERVED.into()),
        ("ANTHROPIC_SMALL_FAST_MODEL", SERVED.into()),
        ("DISABLE_TELEMETRY", "1".into()),
        ("DISABLE_AUTOUPDATER", "1".into()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".into()),
    ];
    let mut start = Command::new("tmux");
    start
        .arg("-S")
        .arg(&tmux.socket)
        .args(["new-session", "-d", "-s", "agent"])
        .args(["-x", "200", "-y", "50", "-c"])
        .arg(work);
    for (name, value) in &env {
        start.arg("-e").arg(format!("{name}={value}"));
    }
    // The server's environment is the session's, less what would tell Claude Code it runs
    // inside another one.
    for name in ["CLAUDECODE", "CLAUDE_CODE_ENTRYPOINT", "TMUX", "TMUX_PANE"] {
        start.env_remove(name);
    }
    let started = start
        .arg(format!("exec '{}'", program.display()))
        .output()
        .expect("tmux runs (apt-get install tmux)");
    if !started.status.success() {
        return (false, onebit_tests::output_text(&started));
    }
    let ready = tmux.wait(Duration::from_secs(60), |t| {
        t.screen().contains("? for shortcuts")
    });
    if !ready {
        return (false, format!("no prompt after 60 s:\n{}", tmux.screen()));
    }
    tmux.enter(task);
    let answered = tmux.wait(limit, |t| model.answered() || !t.alive());
    // The answer drawn, and what Claude Code sends after a turn, before it is asked to quit.
    let shown = tmux.wait(Duration::from_secs(20), |t| {
        t.screen().contains("for shortcuts")
    });
    std::thread::sleep(Duration::from_secs(3));
    let screen = tmux.screen();
    if !answered || !shown {
        return (
            false,
            format!("the answer was not asked for within {limit:?}:\n{screen}"),
        );
    }
    tmux.enter("/exit");
    let quit = tmux.wait(Duration::from_secs(20), |t| !t.alive());
    (quit, screen)
}

/// Records each agent's two sessions against the scripted model and writes them to
/// tests/data/agents/ (run when the pins move; it needs `cargo xtask setup`'s agents, and
/// tmux: Claude Code runs interactively, in its terminal UI).
#[test]
#[ignore = "re-records tests/data/agents/ with the pinned agents"]
fn record_agent_sessions() {
    let root = std::env::temp_dir().join("onebit-agent-sessions");
    let _ = std::fs::remove_dir_all(&root);
    for (agent, package, program) in [
        ("claude-code", "@anthropic-ai/claude-code", "claude"),
        ("codex", "@openai/codex", "codex"),
    ] {
        let version = pinned(package);
        let codex = agent == "codex";
        let mut all: Vec<Recorded> = Vec::new();
        for (session, task, steps) in scripts(&root.join(agent).join("project"), codex) {
            let dir = root.join(agent);
            let work = dir.join("project");
            agent_sessions::project(&work);
            let home = dir.join(format!("home-{session}"));
            std::fs::create_dir_all(&home).unwrap();
            let model = ScriptedModel::start(steps);
            let (ok, said) = if codex {
                let mut command = Command::new(agent_program(program));
                command.current_dir(&work).env("HOME", &home);
                let codex_home = home.join("codex");
                std::fs::create_dir_all(&codex_home).unwrap();
                std::fs::write(
                    codex_home.join("config.toml"),
                    format!(
                        "model = \"{SERVED}\"\nmodel_provider = \"local\"\n\n[model_providers.local]\n\
                         name = \"1bit serve\"\nbase_url = \"{}/v1\"\nwire_api = \"responses\"\n\
                         env_key = \"OPENAI_API_KEY\"\n",
                        model.url()
                    ),
                )
                .unwrap();
                command
                    .args([
                        "exec",
                        "--skip-git-repo-check",
                        "--sandbox",
                        "read-only",
                        task,
                    ])
                    .env("CODEX_HOME", &codex_home)
                    .env("OPENAI_API_KEY", KEY);
                agent_sessions::run_bounded(command, Duration::from_secs(180))
            } else {
                claude_interactive(
                    &agent_program(program),
                    &work,
                    &home,
                    &model,
                    task,
                    Duration::from_secs(180),
                )
            };
            let seen = model.take();
            eprintln!(
                "{agent} {session}: ok {ok}, {} requests\n{said}",
                seen.len()
            );
            assert!(ok, "{agent} session {session} failed:\n{said}");
            // The agent's loop alone (the requests that offer tools): Claude Code's side
            // requests (the session's title) are another prompt, which a replay would take
            // for a turn of the session.
            let seen: Vec<_> = seen
                .into_iter()
                .filter(|(method, path, _, body)| {
                    let value: Value = serde_json::from_str(body).unwrap_or(Value::Null);
                    let side = !agent_sessions::offers_tools(&value);
                    if side {
                        eprintln!(
                            "{agent} {session}: left out {method} {path}, max_tokens {}, {} messages: {:.200}",
                            value["max_tokens"],
                            value["messages"].as_array().map_or(0, Vec::len),
                            value["system"].to_string()
                        );
                    }
                    !side
                })
                .collect();
            all.extend(agent_sessions::recorded(agent, &version, session, seen));
        }
        let file = format!("{agent}-{version}.jsonl");
        agent_sessions::save(&file, &all);
        let back = agent_sessions::load(&file);
        assert_eq!(back.len(), all.len());
        for (a, b) in all.iter().zip(&back) {
            assert_eq!(
                a.body, b.body,
                "{file}: turn {} read back otherwise",
                a.turn
            );
        }
    }
}

/// Tokens a replayed reply generates: enough to compare replies, few enough that prefills
/// dominate the test's time.
const REPLY_TOKENS: usize = 8;
/// The bound: a later turn prefills at most this many times the tokens new in it.
const BOUND: f64 = 1.2;
/// A first prefill of an agent's ~3,000-4,600-token prompt on two busy cores.
const REPLY_LIMIT: Duration = Duration::from_secs(600);

/// A recorded pair of sessions interleaved turn by turn (a's first, then b's first, a's
/// second, ...), as two agents working at once on one serve send them.
fn interleaved(file: &str) -> Vec<Recorded> {
    let all = agent_sessions::load(file);
    let (a, b): (Vec<Recorded>, Vec<Recorded>) = all.into_iter().partition(|r| r.session == "a");
    let mut out = Vec::new();
    for turn in 0..a.len().max(b.len()) {
        out.extend(a.get(turn).cloned());
        out.extend(b.get(turn).cloned());
    }
    out
}

/// serve at its defaults (the cpu route's llama-server, serve's prompt cache on) on SmolLM2,
/// with the context two sessions' prompts fit in together.
fn serve_for_sessions() -> Serve {
    serve_smollm2(&["--ctx-size", "16384"])
}

/// Replays two recorded sessions interleaved through one serve and checks every later turn
/// of both: it prefills at most [`BOUND`] times the tokens that are new in it (the prompt's
/// tokens past the session's previous prompt: a lower bound on those past their longest
/// common prefix), the rest read from llama-server's slots or cache. Then each session's
/// last turn is asked of a cold serve, when `cold_replies`: the greedy reply is the same, byte
/// for byte.
fn two_sessions_keep_their_prefixes(file: &str, cold_replies: bool) {
    let _turn = one_at_a_time();
    let requests = interleaved(file);
    let serve = serve_for_sessions();
    let mut last: std::collections::HashMap<String, (usize, Recorded, String)> =
        std::collections::HashMap::new();
    let mut over = Vec::new();
    for r in &requests {
        let got = agent_sessions::replay(serve.port, r, REPLY_TOKENS, REPLY_LIMIT);
        assert_eq!(
            got.status,
            200,
            "{} {}: {got:?}\n{}",
            r.session,
            r.turn,
            serve.output()
        );
        assert!(
            got.prompt_tokens > 0,
            "{} {}: no usage in the reply: {got:?}",
            r.session,
            r.turn
        );
        let line = match last.get(&r.session) {
            Some((previous, _, _)) => {
                let new = got.prompt_tokens.saturating_sub(*previous).max(1);
                let ratio = got.prefilled() as f64 / new as f64;
                if ratio > BOUND {
                    over.push(format!(
                        "session {} turn {}: prefilled {} of {} prompt tokens, {new} new ({ratio:.2}x)",
                        r.session, r.turn, got.prefilled(), got.prompt_tokens
                    ));
                }
                format!("{new} new, {ratio:.2}x")
            }
            None => "first".to_string(),
        };
        eprintln!(
            "{} session {} turn {}: prompt {}, cached {}, prefilled {} ({line}); first token {:.1} s; {:?}",
            r.agent,
            r.session,
            r.turn,
            got.prompt_tokens,
            got.cached_tokens,
            got.prefilled(),
            got.ttft.as_secs_f64(),
            got.generated
        );
        last.insert(
            r.session.clone(),
            (got.prompt_tokens, r.clone(), got.generated),
        );
    }
    assert!(
        over.is_empty(),
        "later turns prefilled more than {BOUND}x their new tokens:\n{}\n{}",
        over.join("\n"),
        serve.output()
    );
    drop(serve);
    if !cold_replies {
        return;
    }
    let mut sessions: Vec<_> = last.into_iter().collect();
    sessions.sort_by(|a, b| a.0.cmp(&b.0));
    for (session, (_, request, warm)) in sessions {
        let cold = serve_for_sessions();
        let got = agent_sessions::replay(cold.port, &request, REPLY_TOKENS, REPLY_LIMIT);
        assert_eq!(
            got.cached_tokens, 0,
            "the cold serve reused a prefix: {got:?}"
        );
        assert_eq!(
            got.generated, warm,
            "session {session} turn {}: the reply interleaved is not a cold serve's",
            request.turn
        );
    }
}

/// The replies are not compared with a cold serve's: session a's last turn (its fourth, the
/// third reused prefix in a row) was seen to answer otherwise than a cold serve under greedy
/// decoding ("I'll check the current session." against "I'll check the due dates."), as a
/// prefix llama-server reuses was decoded in other runs of its micro-batch than a cold
/// prefill decodes it in (docs/serve.md, "What is exact").
#[test]
fn two_claude_code_sessions_keep_their_prefixes_on_one_serve() {
    two_sessions_keep_their_prefixes("claude-code-2.1.197.jsonl", false);
}

#[test]
fn two_codex_sessions_keep_their_prefixes_on_one_serve() {
    two_sessions_keep_their_prefixes("codex-0.171.0.jsonl", true);
}
