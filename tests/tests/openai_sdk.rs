//! The OpenAI Python SDK (the version `cargo xtask setup` pins) against `1bit serve` on the
//! real llama-server: models, chat streamed and not (with include_usage), completions,
//! embeddings with --embedding, and serve's errors as the SDK's exception types.

use std::path::PathBuf;
use std::process::Command;

use onebit_tests::*;

/// The venv python that imports the pinned SDK.
fn sdk_python() -> PathBuf {
    installed(
        "ONEBIT_TEST_OPENAI_PYTHON",
        "venvs/openai-3.51.0/bin/python",
    )
}

const SCRIPT: &str = r#"
import json, sys, openai
base, mode = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
ask = [{"role": "user", "content": "What is the capital of France?"}]
out = {"sdk": openai.__version__}

def caught(call):
    try:
        call()
        return None
    except openai.APIStatusError as e:
        return [type(e).__name__, e.status_code, str(e.message)]

if mode == "chat":
    out["models"] = [m.id for m in c.models.list()]
    r = c.chat.completions.create(model="any-name", messages=ask, max_tokens=8, temperature=0)
    out["chat"] = r.choices[0].message.content
    out["chat_usage"] = r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model="any-name", messages=ask, max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    out["stream"] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    out["stream_usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
    r = c.completions.create(model="any-name", prompt="The capital of France is", max_tokens=4,
        temperature=0)
    out["completion"] = r.choices[0].text
    out["errors"] = {
        "embeddings": caught(lambda: c.embeddings.create(model="any-name", input="hello")),
        "overflow": caught(lambda: c.chat.completions.create(model="any-name",
            messages=[{"role": "user", "content": "word " * 2000}], max_tokens=4)),
        "missing": caught(lambda: c.models.retrieve("no-such-model")),
    }
else:
    r = c.embeddings.create(model="any-name", input=["hello", "world"])
    out["n"] = len(r.data)
    out["dim"] = len(r.data[0].embedding)
print(json.dumps(out))
"#;

fn run_sdk(serve: &Serve, mode: &str) -> serde_json::Value {
    let out = Command::new(sdk_python())
        .args(["-c", SCRIPT, &serve.url(""), mode])
        .output()
        .expect("the SDK's python runs");
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        serve.output()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_openai_sdk_lists_chats_streams_completes_and_gets_typed_errors() {
    let serve = serve_smollm2(&["--ctx-size", "512", "--alias", "smol"]);
    let v = run_sdk(&serve, "chat");
    assert_eq!(v["sdk"], "3.51.0");
    assert_eq!(v["models"], serde_json::json!(["smol"]));
    assert!(!v["chat"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["chat_usage"].as_u64().unwrap() > 0, "{v}");
    // Greedy: the stream says what the whole reply said.
    assert_eq!(v["stream"], v["chat"], "{v}");
    assert!(
        v["stream_usage"].as_u64().unwrap() > 0,
        "include_usage: {v}"
    );
    assert!(v["completion"].as_str().unwrap().contains("Paris"), "{v}");
    let e = &v["errors"];
    assert_eq!(e["embeddings"][0], "InternalServerError", "{v}");
    assert_eq!(e["embeddings"][1], 501, "{v}");
    assert!(
        e["embeddings"][2]
            .as_str()
            .unwrap()
            .contains("--embed MODEL.gguf"),
        "{v}"
    );
    assert_eq!(e["overflow"][0], "BadRequestError", "{v}");
    assert!(
        e["overflow"][2]
            .as_str()
            .unwrap()
            .contains("exceeds the available context size"),
        "{v}"
    );
    assert_eq!(e["missing"][0], "NotFoundError", "{v}");
}

#[test]
fn the_openai_sdk_gets_embeddings_from_a_model_served_with_embedding() {
    let serve = serve_smollm2(&["--embedding"]);
    let v = run_sdk(&serve, "embed");
    assert_eq!(v["n"], 2, "{v}");
    assert!(v["dim"].as_u64().unwrap() > 0, "{v}");
}
