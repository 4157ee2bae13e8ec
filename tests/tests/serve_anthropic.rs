//! Anthropic's Messages API through `1bit serve` on the real llama-server (SmolLM2): streamed
//! and not, under the served name, over plain HTTP and through Anthropic's Python SDK (the
//! version `cargo xtask setup` pins, in the OpenAI SDK's venv); and `/infill`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Command;

use onebit_tests::*;

const ASK: &str = r#"{"model":"any-name","max_tokens":8,"temperature":0,"messages":[{"role":"user","content":"What is the capital of France?"}]"#;

#[test]
fn anthropic_messages_streamed_and_not_carry_the_served_name() {
    let serve = serve_smollm2(&["--ctx-size", "512", "--alias", "smol-messages"]);
    let (status, reply) = post(&serve.url("/v1/messages"), &format!("{ASK}}}"));
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    let whole: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(whole["type"], "message", "{whole}");
    assert_eq!(whole["model"], "smol-messages", "{whole}");
    assert!(
        !whole["content"][0]["text"].as_str().unwrap().is_empty(),
        "{whole}"
    );

    // Streamed: named events; message_start names the model inside its message.
    let mut reply = ureq::post(&serve.url("/v1/messages"))
        .header("content-type", "application/json")
        .send(format!(r#"{ASK},"stream":true}}"#))
        .expect("the streamed request is answered");
    assert_eq!(reply.status().as_u16(), 200);
    let content_type = reply.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let lines: Vec<String> = BufReader::new(reply.body_mut().as_reader())
        .lines()
        .map_while(Result::ok)
        .collect();
    let events: Vec<&str> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{lines:?}");
    assert_eq!(events.last(), Some(&"message_stop"), "{lines:?}");
    assert!(events.contains(&"content_block_delta"), "{lines:?}");
    let start: serde_json::Value = serde_json::from_str(
        lines
            .iter()
            .find_map(|l| {
                l.strip_prefix("data: ")
                    .filter(|d| d.contains("message_start"))
            })
            .unwrap(),
    )
    .unwrap();
    assert_eq!(start["message"]["model"], "smol-messages", "{start}");
    let streamed: String = lines
        .iter()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|v| v["type"] == "content_block_delta")
        .filter_map(|v| v["delta"]["text"].as_str().map(str::to_string))
        .collect();
    // Greedy: the stream says what the whole reply said.
    assert_eq!(streamed, whole["content"][0]["text"].as_str().unwrap());

    let (status, reply) = post(
        &serve.url("/v1/messages/count_tokens"),
        r#"{"model":"any-name","messages":[{"role":"user","content":"What is the capital of France?"}]}"#,
    );
    assert_eq!(status, 200, "{reply}");
    let count: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert!(count["input_tokens"].as_u64().unwrap() > 5, "{count}");
}

#[test]
fn infill_reaches_llama_server() {
    let serve = serve_smollm2(&["--ctx-size", "512"]);
    let (status, reply) = post(
        &serve.url("/infill"),
        r#"{"input_prefix":"def add(a, b):\n    return ","input_suffix":"\n","n_predict":4,"temperature":0}"#,
    );
    // A model whose vocabulary has fill-in-the-middle tokens is filled in; one without them
    // gets llama-server's own 501 naming what is missing. Either is llama-server's answer,
    // never serve's 404.
    let filled: serde_json::Value = serde_json::from_str(&reply).unwrap();
    if status == 501 {
        let message = filled["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("Infill is not supported by this model"),
            "{message}"
        );
        return;
    }
    assert_eq!(status, 200, "{reply}");
    assert!(filled["content"].is_string(), "{filled}");
    assert!(filled["tokens_predicted"].as_u64().unwrap() > 0, "{filled}");
}

/// The venv python that imports both pinned SDKs.
fn sdk_python() -> PathBuf {
    installed(
        "ONEBIT_TEST_OPENAI_PYTHON",
        "venvs/openai-3.51.0/bin/python",
    )
}

const SCRIPT: &str = r#"
import json, sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
ask = [{"role": "user", "content": "What is the capital of France?"}]
out = {"sdk": anthropic.__version__}
# SDK 2.x takes no sampling arguments; llama-server reads temperature from the body.
greedy = {"temperature": 0}
r = c.messages.create(model="any-name", max_tokens=8, messages=ask, extra_body=greedy)
out["model"] = r.model
out["text"] = "".join(b.text for b in r.content if b.type == "text")
out["usage"] = r.usage.output_tokens
with c.messages.stream(model="any-name", max_tokens=8, messages=ask, extra_body=greedy) as s:
    out["stream"] = "".join(s.text_stream)
    final = s.get_final_message()
out["stream_model"] = final.model
out["stream_usage"] = final.usage.output_tokens
out["count"] = c.messages.count_tokens(model="any-name", messages=ask).input_tokens
try:
    c.messages.create(model="any-name", max_tokens=4,
        messages=[{"role": "user", "content": "word " * 2000}])
    out["overflow"] = None
except anthropic.APIStatusError as e:
    out["overflow"] = [type(e).__name__, e.status_code, str(e.message)]
print(json.dumps(out))
"#;

#[test]
fn the_anthropic_sdk_gets_messages_streamed_and_not_token_counts_and_typed_errors() {
    let serve = serve_smollm2(&["--ctx-size", "512", "--alias", "smol"]);
    let out = Command::new(sdk_python())
        .args(["-c", SCRIPT, &serve.url("")])
        .output()
        .expect("the SDK's python runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        serve.output()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["sdk"], "2.16.0");
    assert_eq!(v["model"], "smol", "{v}");
    assert_eq!(v["stream_model"], "smol", "{v}");
    assert!(!v["text"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["usage"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["stream"], v["text"], "greedy: {v}");
    assert!(v["stream_usage"].as_u64().unwrap() > 0, "{v}");
    assert!(v["count"].as_u64().unwrap() > 5, "{v}");
    assert_eq!(v["overflow"][0], "BadRequestError", "{v}");
    assert!(
        v["overflow"][2]
            .as_str()
            .unwrap()
            .contains("exceeds the available context size"),
        "{v}"
    );
}
