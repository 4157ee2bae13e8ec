//! Claude Code's attribution line (`x-anthropic-billing-header: ...`, first in a Messages
//! request's system prompt, different every turn) is not sent to the engine, so the engine's
//! cached prefix reaches past it; `--keep-attribution` sends it. What reaches the backend is
//! recorded by the fake backend (`FAKE_RECORD`); the cache is measured on the real llama-server
//! with the pinned Gemma 3 270M.

use onebit_tests::*;

const LINE_A: &str =
    "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;";

/// serve on the fake backend with `extra` flags; the bodies the backend got, in order, after
/// posting each of `bodies` to `/v1/messages`.
fn recorded(extra: &[&str], bodies: &[String]) -> Vec<String> {
    let dir = temp_dir("attribution");
    let m = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&m, extra, &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    for body in bodies {
        // The fake has no /v1/messages (it answers 404), but records the request first.
        let (status, reply) = post(&serve.url("/v1/messages"), body);
        assert!(status < 500, "{status} {reply}\n{}", serve.output());
    }
    json_lines(&record)
        .into_iter()
        .filter(|l| l["path"] == "/v1/messages")
        .map(|l| l["body"].as_str().unwrap().to_string())
        .collect()
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
