//! `1bit serve --pm` on the fake backend playing the Project Manager (it calls `delegate` in
//! llama-server's parsed form, ZAYA's text form or Qwen's, on request) and a fake Lemonade that
//! records the expert asked for: the delegation, the reply, streaming, failures, the round cap,
//! the cut, other routes untouched, and the refusals (docs/pm.md).

use std::path::{Path, PathBuf};

use onebit_tests::*;
use serde_json::{Value, json};

const EXPERT_ANSWER: &str = "EXPERT: fn sum(v: &[i32]) -> i32";
const CODE_ID: &str = "Qwen2.5-Coder-7B-Instruct-1bit";

/// serve --pm on the fake backend, recording what reached the backend in `record`.
fn serve_pm(dir: &Path, lemonade: &str, extra: &[&str]) -> (Serve, PathBuf) {
    let model = dummy_model(dir, "zaya1-8b-Q4_K_M.gguf");
    let record = dir.join("backend.jsonl");
    let mut args = vec!["--alias", "ZAYA1-8B-PM", "--pm", "--lemonade-url", lemonade];
    args.extend_from_slice(extra);
    let serve = Serve::with_fake(&model, &args, &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    (serve, record)
}

fn chat(serve: &Serve, text: &str) -> (u16, String, Value) {
    let body = json!({"messages": [{"role": "user", "content": text}]}).to_string();
    let (status, pm, reply) =
        post_with_header(&serve.url("/v1/chat/completions"), &body, "x-1bit-pm");
    (
        status,
        pm,
        serde_json::from_str(&reply).unwrap_or(Value::Null),
    )
}

fn content(reply: &Value) -> &str {
    reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
}

/// The chat requests the backend received, in order.
fn rounds(record: &Path) -> Vec<Value> {
    json_lines(record)
        .into_iter()
        .filter(|r| r["path"] == "/v1/chat/completions")
        .map(|r| serde_json::from_str(r["body"].as_str().unwrap()).unwrap())
        .collect()
}

/// The tool message the PM's last round carried.
fn last_tool_result(record: &Path) -> String {
    let rounds = rounds(record);
    let last = rounds.last().expect("a round");
    last["messages"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|m| m["role"] == "tool")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string()
}

#[test]
fn a_delegation_in_each_form_reaches_the_code_expert_and_its_answer_the_client() {
    let dir = temp_dir("pm-forms");
    let lemonade = FakeLemonade::start(LemonadeAnswer::Text(EXPERT_ANSWER.into()));
    let (serve, record) = serve_pm(&dir, &lemonade.url(), &[]);
    assert!(
        serve
            .output()
            .contains("1bit serve: pm: 4 experts (code, code-heavy, reasoning, agentic)"),
        "{}",
        serve.output()
    );
    for (i, form) in ["parsed", "zaya", "qwen"].into_iter().enumerate() {
        let before = rounds(&record).len();
        let (status, header, reply) = chat(
            &serve,
            &format!(
                "fake_delegate=code fake_tool_form={form} Write a Rust function that sums a slice."
            ),
        );
        assert_eq!(status, 200, "{form}: {reply}");
        assert_eq!(header, "2 rounds, 1 delegations", "{form}");
        assert_eq!(reply["model"], "ZAYA1-8B-PM");
        assert_eq!(
            content(&reply),
            format!("fake reply to: {EXPERT_ANSWER}"),
            "{form}"
        );
        assert_eq!(reply["pm"]["rounds"], 2);
        let d = &reply["pm"]["delegations"][0];
        assert_eq!(
            (d["expert"].as_str(), d["id"].as_str(), d["ok"].as_bool()),
            (Some("code"), Some(CODE_ID), Some(true))
        );
        assert!(d["ms"].is_u64());
        assert!(reply["choices"][0]["message"].get("tool_calls").is_none());

        let asked = lemonade.received();
        assert_eq!(asked.len(), i + 1, "{form}: one delegation");
        let (path, body) = &asked[i];
        assert_eq!(path, "/api/v1/chat/completions");
        assert_eq!(body["model"], CODE_ID);
        assert_eq!(body["max_tokens"], 4096);
        assert_eq!(body["stream"], false);
        let brief = body["messages"][1]["content"].as_str().unwrap();
        assert!(
            brief.contains("sums a slice") && brief.contains("Context:\nfake context"),
            "{brief}"
        );

        let pm_rounds = rounds(&record);
        assert_eq!(pm_rounds.len() - before, 2, "{form}");
        let first = &pm_rounds[before];
        assert_eq!(first["messages"][0]["role"], "system");
        assert!(
            first["messages"][0]["content"]
                .as_str()
                .unwrap()
                .starts_with("You are the Project Manager")
        );
        assert_eq!(first["tools"][1]["function"]["name"], "delegate");
        assert_eq!(first["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(first["temperature"], 0.0);
        assert_eq!(first["stream"], false);
        let second = &pm_rounds[before + 1];
        let turn = &second["messages"].as_array().unwrap()[2];
        assert_eq!(turn["tool_calls"][0]["function"]["name"], "delegate");
        assert_eq!(last_tool_result(&record), EXPERT_ANSWER);
    }
    assert!(
        serve.wait_output(
            &format!("1bit serve: pm: delegate code -> {CODE_ID} (task "),
            std::time::Duration::from_secs(5)
        ),
        "{}",
        serve.output()
    );
    assert!(
        serve.output().contains(" ms ok, 32 bytes"),
        "{}",
        serve.output()
    );

    // A general question: answered by the PM alone, no delegation.
    let (status, header, reply) = chat(&serve, "Hello there, how are you?");
    assert_eq!((status, header.as_str()), (200, "1 rounds, 0 delegations"));
    assert_eq!(content(&reply), "fake reply to: Hello there, how are you?");
    assert_eq!(reply["pm"]["delegations"], json!([]));
    assert_eq!(lemonade.received().len(), 3);

    // An expert that is not in the file: the PM is told so, nothing reaches Lemonade.
    let (status, _, reply) = chat(&serve, "fake_delegate=poet a sonnet");
    assert_eq!(status, 200);
    assert_eq!(
        reply["pm"]["delegations"][0],
        json!({"expert": "poet", "id": "", "ms": 0, "ok": false})
    );
    assert!(last_tool_result(&record).starts_with(
        "delegation failed: there is no expert 'poet'. The experts are: code, code-heavy"
    ));
    assert_eq!(lemonade.received().len(), 3);
}

#[test]
fn streamed_the_final_answer_arrives_as_chunks() {
    let dir = temp_dir("pm-stream");
    let lemonade = FakeLemonade::start(LemonadeAnswer::Text(EXPERT_ANSWER.into()));
    let (serve, _) = serve_pm(&dir, &lemonade.url(), &[]);
    let body = json!({"stream": true, "messages": [{"role": "user", "content": "fake_delegate=code sum a slice"}]});
    let events = sse(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.len() >= 3, "{events:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk" && c["model"] == "ZAYA1-8B-PM")
    );
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, format!("fake reply to: {EXPERT_ANSWER}"));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["pm"]["delegations"][0]["ok"], true);
    assert_eq!(lemonade.received().len(), 1);
    // A streamed chat is the PM's, never the fast engine's; the general engine counted it.
    let chats = |engine| requests_total(&serve, &[("engine", engine), ("path_class", "chat")]);
    assert_eq!((chats("general"), chats("fast")), (1, 0));
}

#[test]
fn an_expert_that_fails_or_a_lemonade_that_is_down_leaves_the_pm_to_answer() {
    let dir = temp_dir("pm-fail");
    let lemonade = FakeLemonade::start(LemonadeAnswer::Status(500, "the expert fell over".into()));
    let (serve, record) = serve_pm(&dir, &lemonade.url(), &[]);
    let (status, _, reply) = chat(&serve, "fake_delegate=reasoning prove it");
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["pm"]["delegations"][0]["ok"], false);
    assert_eq!(reply["pm"]["delegations"][0]["id"], "Qwen3.8-27B-1bit");
    assert_eq!(
        last_tool_result(&record),
        "delegation to Qwen3.8-27B-1bit failed: Lemonade answered HTTP 500 (the expert fell over). Tell the user the expert was not available and answer yourself."
    );
    assert_eq!(lemonade.received()[0].1["max_tokens"], 8192);

    lemonade.set(LemonadeAnswer::Empty);
    let (status, _, reply) = chat(&serve, "fake_delegate=code sum");
    assert_eq!(
        (status, reply["pm"]["delegations"][0]["ok"].as_bool()),
        (200, Some(false))
    );
    assert!(last_tool_result(&record).contains("failed: the expert returned an empty answer."));
    assert!(
        serve
            .output()
            .contains("ms failed: the expert returned an empty answer"),
        "{}",
        serve.output()
    );

    // A backend error in a PM round is relayed as the backend gave it.
    let (status, header, reply) = chat(&serve, "fake_status=503 hello");
    assert_eq!((status, header.as_str()), (503, ""));
    assert_eq!(reply["error"]["message"], "fake_status=503 requested");

    // Lemonade gone: nothing listens on its port.
    drop(lemonade);
    let down = free_port();
    let dir = temp_dir("pm-down");
    let (serve, record) = serve_pm(&dir, &format!("http://127.0.0.1:{down}"), &[]);
    let (status, header, reply) = chat(&serve, "fake_delegate=code sum a slice");
    assert_eq!(
        (status, header.as_str()),
        (200, "2 rounds, 1 delegations"),
        "{reply}"
    );
    assert_eq!(reply["pm"]["delegations"][0]["ok"], false);
    assert_eq!(
        content(&reply),
        "fake reply to: delegation to Qwen2.5-Coder-7B-Instruct-"
    );
    let result = last_tool_result(&record);
    assert!(
        result.starts_with(&format!(
            "delegation to {CODE_ID} failed: Lemonade at http://127.0.0.1:{down} did not answer"
        )),
        "{result}"
    );
}

#[test]
fn the_round_cap_the_cut_precise_and_other_routes() {
    let dir = temp_dir("pm-cap");
    let experts = dir.join("experts.json");
    std::fs::write(
        &experts,
        json!({"pm": {"max_rounds": 3, "max_result_bytes": 11},
               "experts": [{"expert": "code", "id": "tiny-coder", "max_tokens": 0}]})
        .to_string(),
    )
    .unwrap();
    let lemonade = FakeLemonade::start(LemonadeAnswer::Text("ab€€€€€€".into()));
    let (serve, record) = serve_pm(
        &dir,
        &lemonade.url(),
        &["--pm-experts", experts.to_str().unwrap(), "--precise"],
    );

    // The PM delegates whenever it is offered tools: rounds 1 and 2 delegate, round 3 has no
    // tools and must answer.
    let (status, header, reply) = chat(&serve, "fake_delegate=code fake_delegate_always loop");
    assert_eq!(
        (status, header.as_str()),
        (200, "3 rounds, 2 delegations"),
        "{reply}"
    );
    let r = rounds(&record);
    assert_eq!(r.len(), 3);
    assert!(r[0].get("tools").is_some() && r[1].get("tools").is_some());
    assert!(
        r[2].get("tools").is_none(),
        "the last round offers no tools"
    );
    assert!(
        r.iter().all(|round| round["cache_prompt"] == false),
        "--precise reaches every round"
    );
    let asked = lemonade.received();
    assert_eq!(asked[0].1["model"], "tiny-coder");
    assert!(
        asked[0].1.get("max_tokens").is_none(),
        "max_tokens 0 leaves it to Lemonade"
    );
    // "ab" + three 3-byte euro signs = 11 bytes; the fourth would split.
    assert_eq!(
        last_tool_result(&record),
        "ab€€€\n[the expert's answer was cut at 11 bytes]"
    );
    assert!(
        serve.output().contains("ms ok, 11 bytes (cut)"),
        "{}",
        serve.output()
    );

    // Other routes are relayed as without --pm.
    let before = r.len();
    let (status, header, body) = post_with_header(
        &serve.url("/v1/completions"),
        r#"{"prompt": "fake_delegate=code hello"}"#,
        "x-1bit-pm",
    );
    assert_eq!((status, header.as_str()), (200, ""));
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["choices"][0]["text"],
        "fake reply to: fake_delegate=code hello"
    );
    let last = json_lines(&record).pop().unwrap();
    assert_eq!(last["path"], "/v1/completions");
    assert!(!last["body"].as_str().unwrap().contains("tools"));
    assert_eq!(rounds(&record).len(), before);
}

/// `1bit serve ARGS` that must refuse to start: (exit status, what it printed). A serve that
/// starts anyway is killed after 10 s and reported as status -1.
fn refused(args: &[&str]) -> (i32, String) {
    let dir = temp_dir("pm-refused");
    let model = dummy_model(&dir, "zaya.gguf");
    let fake = fake_backend();
    let mut all = vec![
        "-m",
        model.to_str().unwrap(),
        "--llama-server",
        fake.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let mut serve = Serve::start(&all, &[]);
    let code = serve
        .wait_exit(std::time::Duration::from_secs(10))
        .and_then(|s| s.code())
        .unwrap_or(-1);
    (code, serve.output())
}

#[test]
fn refusals_are_one_line() {
    let dir = temp_dir("pm-bad-file");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"experts": [{"expert": "code"}]}"#).unwrap();
    let bad = bad.to_str().unwrap();
    for (args, says) in [
        (
            vec!["--device", "cpu", "--pm", "--laya"],
            "1bit serve: --pm does not combine with --laya",
        ),
        (
            vec!["--device", "cpu", "--pm", "--embedding"],
            "1bit serve: --pm does not combine with --embedding/--reranking",
        ),
        (
            vec!["--device", "hybrid", "--pm"],
            "1bit serve: --pm cannot be used with --device hybrid",
        ),
        (
            vec!["--device", "cpu", "--pm", "--pm-experts", bad],
            "experts[0].id is missing or empty: every expert needs \"expert\" and \"id\"",
        ),
        (
            vec!["--device", "cpu", "--pm", "--lemonade-url", "https://x:1"],
            "1bit serve: --lemonade-url https://x:1: not a plain http://HOST:PORT",
        ),
        (
            vec!["--device", "cpu", "--pm-experts", bad],
            "1bit serve: --pm-experts only applies with --pm",
        ),
    ] {
        let (code, stderr) = refused(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
}

/// The real llama-server takes the PM's rounds (tools, stops, `chat_template_kwargs`). The
/// pinned SmolLM2 does not call tools (docs/pm.md), so it answers alone in one round.
#[test]
fn the_real_llama_server_takes_the_pm_rounds() {
    let lemonade = FakeLemonade::start(LemonadeAnswer::Text(EXPERT_ANSWER.into()));
    let serve = serve_smollm2(&["--pm", "--lemonade-url", &lemonade.url()]);
    let body = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16});
    let (status, header, reply) = post_with_header(
        &serve.url("/v1/chat/completions"),
        &body.to_string(),
        "x-1bit-pm",
    );
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    assert_eq!(header, "1 rounds, 0 delegations");
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["model"], "SmolLM2-135M-Instruct-Q4_1");
    assert!(!content(&reply).is_empty(), "{reply}");
    assert_eq!(reply["pm"]["rounds"], 1);
}

/// `--max-generation-s`: the tool loop's rounds are bounded as a relayed chat is: a loop still
/// running at the deadline is a 504, its round's backend connection dropped.
#[test]
fn the_generation_deadline_ends_the_tool_loop() {
    let dir = temp_dir("pm-deadline");
    let lemonade = FakeLemonade::start(LemonadeAnswer::Text(EXPERT_ANSWER.into()));
    let (serve, _) = serve_pm(&dir, &lemonade.url(), &["--max-generation-s", "1"]);
    let backend = BackendLoad::of(&serve);
    let began = std::time::Instant::now();
    let (status, _, reply) = chat(&serve, "fake_slow_ms=30000 hello");
    assert_eq!(status, 504, "{reply}");
    assert!(
        began.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert!(
        reply["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-generation-s")),
        "{reply}"
    );
    assert!(
        backend.stops_within(std::time::Duration::from_secs(3)),
        "the round went on generating after the deadline"
    );
    assert_eq!(generation_deadlines(&serve), Some(1.0));
}
