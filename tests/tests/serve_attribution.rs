//! Claude Code's attribution line (`x-anthropic-billing-header: ...`, first in the system
//! prompt, different every turn) is not sent to the engine, so the engine's cached prefix
//! reaches past it; `--keep-attribution` sends it. It is dropped where each API puts a system
//! prompt: a Messages request's `system`, a chat completion's first system message (where
//! stock Lemonade puts it when it converts Claude Code's Messages request), a Responses
//! request's `instructions`; under `1bit serve` and under the drop-in's argv alike. What
//! reaches the backend is recorded by the fake backend (`FAKE_RECORD`); the cache is measured
//! on the real llama-server with the pinned Gemma 3 270M and SmolLM2.

use std::process::Command;

use onebit_tests::*;

const LINE_A: &str =
    "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;";

/// How serve runs on the fake backend.
#[derive(Clone, Copy)]
enum Started<'a> {
    /// `1bit serve -m M --device cpu` and these flags.
    Serve(&'a [&'a str]),
    /// `1bit llama-server` with stock Lemonade 11.7's argument list for a plain GGUF.
    Lemonade,
}

/// serve on the fake backend, started as `how`; the bodies the backend got at `path`, in
/// order, after posting each of `bodies` there.
fn recorded_at(how: Started, path: &str, bodies: &[String]) -> Vec<String> {
    let dir = temp_dir("attribution");
    let m = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = match how {
        Started::Serve(extra) => {
            Serve::with_fake(&m, extra, &[("FAKE_RECORD", record.to_str().unwrap())])
        }
        Started::Lemonade => {
            let port = free_port();
            let mut command = Command::new(onebit());
            command
                .arg("llama-server")
                .args(["-m", m.to_str().unwrap(), "--ctx-size", "4096"])
                .args(["--port", &port.to_string(), "--jinja", "--metrics"])
                .args(["--reasoning-format", "auto", "--no-ui"])
                .env("ONEBIT_STATE_DIR", temp_dir("state"))
                .env("ONEBIT_LLAMA_SERVER", fake_backend())
                .env("ONEBIT_HRX_PRESENT", "0")
                .env("FAKE_RECORD", &record);
            Serve::spawn(command, port)
        }
    };
    serve.ready();
    for body in bodies {
        // The fake has no /v1/messages (it answers 404), but records the request first.
        let (status, reply) = post(&serve.url(path), body);
        assert!(status < 500, "{status} {reply}\n{}", serve.output());
    }
    json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == path)
        .map(|l| l["body"].as_str().unwrap().to_string())
        .collect()
}

/// serve on the fake backend with `extra` flags; the bodies the backend got, in order, after
/// posting each of `bodies` to `/v1/messages`.
fn recorded(extra: &[&str], bodies: &[String]) -> Vec<String> {
    recorded_at(Started::Serve(extra), "/v1/messages", bodies)
}

/// A Claude Code request: the attribution block, then its system prompt, tools whose schema's
/// keys are not in order, a message; `stream` as asked.
fn claude_code_body(stream: bool) -> (String, String) {
    let rest = r#"{"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude.","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"Bash","input_schema":{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"number"}}}}],"messages":[{"role":"user","content":"hi"}],"max_tokens":32000,"stream":"#;
    let with =
        format!(r#"{{"model":"m","system":[{{"type":"text","text":"{LINE_A}"}}, {rest}{stream}}}"#);
    let without = format!(r#"{{"model":"m","system":[{rest}{stream}}}"#);
    (with, without)
}

#[test]
fn the_attribution_block_does_not_reach_the_engine_and_every_other_byte_does() {
    let (streamed, streamed_without) = claude_code_body(true);
    let (whole, whole_without) = claude_code_body(false);
    // The string form: the line, then the rest of the prompt.
    let string = format!(
        r#"{{"model":"m","system":"{LINE_A}\nYou are Claude Code.","messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let string_without = r#"{"model":"m","system":"You are Claude Code.","messages":[{"role":"user","content":"hi"}]}"#;
    // A first block that is not the line, and the line in a message: untouched.
    let other = format!(
        r#"{{"model":"m","system":[{{"type":"text","text":"You are brief."}},{{"type":"text","text":"{LINE_A}"}}],"messages":[{{"role":"user","content":"{LINE_A}"}}]}}"#
    );
    let bodies = [
        streamed.clone(),
        whole.clone(),
        string.clone(),
        other.clone(),
    ];
    let got = recorded(&[], &bodies);
    assert_eq!(got.len(), 4, "{got:?}");
    // Streamed (the fast engine's kind of request) and not: the block and the comma after it
    // are gone, every other byte is as sent.
    assert_eq!(got[0], streamed_without);
    assert_eq!(got[1], whole_without);
    assert_eq!(got[2], string_without);
    assert_eq!(got[3], other);
    let v: serde_json::Value = serde_json::from_str(&got[0]).unwrap();
    assert_eq!(v["system"].as_array().unwrap().len(), 1, "{v}");

    // --keep-attribution: every body reaches the engine as sent.
    let kept = recorded(&["--keep-attribution"], &bodies);
    assert_eq!(kept, bodies);
}

/// A body as a client sends it, and as the engine should get it, the line dropped.
struct Pair {
    sent: String,
    wanted: String,
}

fn pair(sent: String, wanted: &str) -> Pair {
    Pair {
        sent,
        wanted: wanted.to_string(),
    }
}

/// A body the engine should get as it was sent.
fn untouched(sent: String) -> Pair {
    let wanted = sent.clone();
    Pair { sent, wanted }
}

/// Posts each body of `pairs` to `path` through serve started as `how`, and checks that the
/// engine got each as wanted or, when the line is `kept`, as sent.
fn assert_reaching(how: Started, path: &str, pairs: &[Pair], kept: bool) {
    let sent: Vec<String> = pairs.iter().map(|p| p.sent.clone()).collect();
    let wanted: Vec<&String> = pairs
        .iter()
        .map(|p| if kept { &p.sent } else { &p.wanted })
        .collect();
    assert_eq!(
        recorded_at(how, path, &sent).iter().collect::<Vec<_>>(),
        wanted
    );
}

/// Claude Code's request as stock Lemonade 11.7 converts it to a chat completion: the
/// `system` blocks joined with a line break into one system message, the keys in its JSON
/// library's (sorted) order; `stream` as asked. Wanted: the body Lemonade sends when Claude
/// Code leaves the line out (`CLAUDE_CODE_ATTRIBUTION_HEADER=0`).
fn lemonade_chat(stream: bool) -> Pair {
    let body = |system: &str| {
        format!(
            r#"{{"max_completion_tokens":32000,"messages":[{{"content":"{system}You are Claude Code, Anthropic's official CLI for Claude.","role":"system"}},{{"content":"hi","role":"user"}}],"model":"m","stream":{stream},"tools":[{{"function":{{"description":"","name":"Bash","parameters":{{"properties":{{"a":{{"type":"number"}},"z":{{"type":"string"}}}},"type":"object"}}}},"type":"function"}}]}}"#
        )
    };
    pair(body(&format!("{LINE_A}\\n")), &body(""))
}

/// Chat completions: the line first in the first system message (a string, a first part),
/// alone, and elsewhere.
fn chats() -> Vec<Pair> {
    vec![
        lemonade_chat(true),
        lemonade_chat(false),
        // An array of parts (the OpenAI SDK's order of keys): a first part that is the line
        // goes.
        pair(
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":[{{"type":"text","text":"{LINE_A}"}},{{"type":"text","text":"You are brief."}}]}},{{"role":"user","content":"hi"}}]}}"#
            ),
            r#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"You are brief."}]},{"role":"user","content":"hi"}]}"#,
        ),
        // The line alone: no system message, as Lemonade sends none without system text.
        pair(
            format!(
                r#"{{"messages":[{{"content":"{LINE_A}","role":"system"}},{{"content":"hi","role":"user"}}],"model":"m","stream":false}}"#
            ),
            r#"{"messages":[{"content":"hi","role":"user"}],"model":"m","stream":false}"#,
        ),
        // The line in a user message, and in a system message after the first: the user's.
        untouched(format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"You are brief."}},{{"role":"user","content":"{LINE_A}"}},{{"role":"system","content":"{LINE_A}"}}]}}"#
        )),
    ]
}

/// Responses requests: the line first in `instructions`, and in the input.
fn responses() -> Vec<Pair> {
    vec![
        pair(
            format!(
                r#"{{"model":"m","instructions":"{LINE_A}\nYou are Codex.","input":[{{"role":"user","content":"hi"}}],"stream":true}}"#
            ),
            r#"{"model":"m","instructions":"You are Codex.","input":[{"role":"user","content":"hi"}],"stream":true}"#,
        ),
        untouched(format!(
            r#"{{"model":"m","instructions":"You are Codex.","input":"{LINE_A}"}}"#
        )),
    ]
}

#[test]
fn a_chats_first_system_message_and_responses_instructions_reach_the_engine_without_the_line() {
    // Each as the client would have sent it without the line: every other byte as sent.
    let serve = Started::Serve(&[]);
    assert_reaching(serve, "/v1/chat/completions", &chats(), false);
    assert_reaching(serve, "/v1/responses", &responses(), false);
    // --keep-attribution: every body reaches the engine as sent.
    let keep = Started::Serve(&["--keep-attribution"]);
    assert_reaching(keep, "/v1/chat/completions", &chats(), true);
    assert_reaching(keep, "/v1/responses", &responses(), true);
}

#[test]
fn under_lemonades_argv_the_drop_in_drops_the_line_too() {
    // Stock Lemonade runs `llama-server` (1bit) with llama-server's arguments and converts
    // Claude Code's Messages request to a chat completion first.
    let lemonade = Started::Lemonade;
    assert_reaching(lemonade, "/v1/chat/completions", &chats(), false);
    assert_reaching(lemonade, "/v1/responses", &responses(), false);
    // And Claude Code's own Messages request, had it reached serve unconverted.
    let (streamed, streamed_without) = claude_code_body(true);
    assert_reaching(
        lemonade,
        "/v1/messages",
        &[pair(streamed, &streamed_without)],
        false,
    );
}

/// `/v1/messages` of `system` (the attribution line first, then a long prompt) to `serve`,
/// whole and greedy: (prompt tokens, of them read from the engine's cache).
fn ask(serve: &Serve, line: &str, prompt: &str) -> (u64, u64) {
    let body = serde_json::json!({
        "model": "any",
        "max_tokens": 4,
        "temperature": 0,
        "system": [
            {"type": "text", "text": line},
            {"type": "text", "text": prompt},
        ],
        "messages": [{"role": "user", "content": "Which rule mentions the lighthouse?"}],
    })
    .to_string();
    let (status, reply) = post(&serve.url("/v1/messages"), &body);
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(v["type"], "message", "{v}");
    let usage = &v["usage"];
    let cached = usage["cache_read_input_tokens"].as_u64().unwrap();
    (usage["input_tokens"].as_u64().unwrap() + cached, cached)
}

/// A system prompt of about 1,800 Gemma tokens.
fn long_prompt() -> String {
    let things = [
        "lighthouse",
        "harbour",
        "compass",
        "lantern",
        "anchor",
        "tide",
        "gull",
        "rope",
    ];
    (0..85)
        .map(|i| {
            format!(
                "Rule {i}: keep the {} dry and log it at {} o'clock.",
                things[i % things.len()],
                i % 24
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn a_new_attribution_line_keeps_the_engines_cached_prefix() {
    let _turn = one_at_a_time();
    let gemma = installed_model("gemma-3-270m-Q4_K_M.gguf");
    let prompt = long_prompt();
    // Another turn: Claude Code derives the version's suffix and `cch=` from the request.
    let line_b =
        "x-anthropic-billing-header: cc_version=2.1.197.3be; cc_entrypoint=cli; cch=7c0d2;";
    let flags = ["--ctx-size", "4096", "--parallel", "1"];

    let serve = serve_cpu(&gemma, &flags);
    let (first, _) = ask(&serve, LINE_A, &prompt);
    assert!(first > 1500, "a long prompt: {first} tokens");
    let (second, cached) = ask(&serve, line_b, &prompt);
    eprintln!("through serve: {second} prompt tokens, {cached} read from the cache");
    assert_eq!(second, first, "the same prompt once the line is dropped");
    assert!(
        cached + 2 >= second,
        "the second turn prefills only what is new: {cached} of {second} cached"
    );
    drop(serve);

    // --keep-attribution stands for llama-server alone: the line reaches it, and the prompt
    // is prefilled again from the line on.
    let mut flags = flags.to_vec();
    flags.push("--keep-attribution");
    let serve = serve_cpu(&gemma, &flags);
    let (first, _) = ask(&serve, LINE_A, &prompt);
    let (second, cached) = ask(&serve, line_b, &prompt);
    eprintln!("--keep-attribution: {second} prompt tokens (first {first}), {cached} cached");
    assert!(
        cached < 50,
        "the line ends the cached prefix: {cached} of {second} cached"
    );
    // The pinned llama-server itself writes a five-character `cch=` as `fffff` (llama.cpp PR
    // #21793), so a turn whose line differs only there is cached even with the line kept; the
    // version's suffix, which Claude Code derives from the request too, is not rewritten.
    let line_c =
        "x-anthropic-billing-header: cc_version=2.1.197.3be; cc_entrypoint=cli; cch=91e4f;";
    let (third, cached) = ask(&serve, line_c, &prompt);
    eprintln!("--keep-attribution, only cch= changed: {cached} of {third} cached");
    assert!(cached + 2 >= third, "{cached} of {third} cached");
}

/// A chat completion shaped as stock Lemonade sends Claude Code's turn (one system message:
/// `line`, a line break, `prompt`) to `serve`, whole and greedy: (prompt tokens, of them read
/// from the engine's cache).
fn ask_chat(serve: &Serve, line: &str, prompt: &str) -> (u64, u64) {
    let body = serde_json::json!({
        "model": "any",
        "max_completion_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": format!("{line}\n{prompt}")},
            {"role": "user", "content": "Which rule mentions the lighthouse?"},
        ],
    })
    .to_string();
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let usage = &v["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {v}"));
    (usage["prompt_tokens"].as_u64().unwrap(), cached)
}

#[test]
fn a_new_attribution_line_in_a_chats_system_message_keeps_the_engines_cached_prefix() {
    let _turn = one_at_a_time();
    let serve = serve_smollm2(&["--ctx-size", "4096", "--parallel", "1"]);
    let prompt = long_prompt();
    // Another turn: another version suffix and `cch=`.
    let line_b =
        "x-anthropic-billing-header: cc_version=2.1.197.3be; cc_entrypoint=cli; cch=7c0d2;";
    let (first, _) = ask_chat(&serve, LINE_A, &prompt);
    assert!(first > 1500, "a long prompt: {first} tokens");
    let (second, cached) = ask_chat(&serve, line_b, &prompt);
    eprintln!("a chat through serve: {second} prompt tokens, {cached} read from the cache");
    assert_eq!(second, first, "the same prompt once the line is dropped");
    assert!(
        cached + 2 >= second,
        "the second turn prefills only what is new: {cached} of {second} cached"
    );
}
