//! `--api-key`: every route but /health needs `Authorization: Bearer KEY`, on both relay
//! engines; the key never reaches the backend or serve's output; a non-loopback bind without a
//! key says so in one line.

use std::time::Duration;

use onebit_tests::*;

const KEY: &str = "sk-serve-test-7f3a";
const TOKENIZE: &str = r#"{"content":"hello world"}"#;
const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}]}"#;

/// One request with `Connection: close` and an optional Authorization value: (status, reply).
fn call(serve: &Serve, method: &str, path: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    let auth = auth
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    raw(serve.port, request.as_bytes(), Duration::from_secs(10))
}

fn body_of(reply: &str) -> serde_json::Value {
    let body = &reply[reply.find("\r\n\r\n").map_or(0, |i| i + 4)..];
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

#[test]
fn every_route_but_health_needs_the_key_on_both_engines() {
    let dir = temp_dir("key");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(
        &model,
        &["--api-key", KEY],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();
    let bearer = format!("Bearer {KEY}");

    // /health answers without a key (load balancers and Lemonade ask it so).
    assert_eq!(call(&serve, "GET", "/health", None, "").0, 200);
    // Everything else: 401, OpenAI-shaped, without a key or with another one.
    for (method, path, body) in [
        ("POST", "/tokenize", TOKENIZE),
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", ""),
        ("GET", "/metrics", ""),
        ("GET", "/v1/nothing", ""),
    ] {
        for auth in [None, Some("Bearer sk-wrong"), Some(KEY)] {
            let (status, reply) = call(&serve, method, path, auth, body);
            assert_eq!(status, 401, "{method} {path} with {auth:?}: {reply}");
            let v = body_of(&reply);
            assert_eq!(v["error"]["type"], "authentication_error", "{reply}");
            assert_eq!(v["error"]["code"], 401, "{reply}");
        }
    }
    // With the key: a plain request and a whole chat (the fast engine's), serve's own routes
    // (the general engine's, handed over with the fast engine's judgement).
    let (status, reply) = call(&serve, "POST", "/tokenize", Some(&bearer), TOKENIZE);
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = call(&serve, "POST", "/v1/chat/completions", Some(&bearer), CHAT);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(call(&serve, "GET", "/v1/models", Some(&bearer), "").0, 200);
    let (status, metrics) = call(&serve, "GET", "/metrics", Some(&bearer), "");
    assert_eq!(status, 200, "{metrics}");
    assert_eq!(
        requests_total_in(
            &metrics,
            &[
                ("path_class", "other"),
                ("status_class", "2xx"),
                ("engine", "fast")
            ]
        ),
        1
    );
    assert_eq!(
        requests_total_in(
            &metrics,
            &[
                ("path_class", "chat"),
                ("status_class", "2xx"),
                ("engine", "fast")
            ]
        ),
        1
    );
    // The key reached neither the backend nor serve's output.
    let seen = json_lines(&record);
    let relayed: Vec<_> = seen
        .iter()
        .filter(|l| l["path"] == "/tokenize" || l["path"] == "/v1/chat/completions")
        .collect();
    assert_eq!(relayed.len(), 2, "{seen:?}");
    for l in relayed {
        assert!(l["headers"].get("authorization").is_none(), "{l}");
    }
    assert!(!std::fs::read_to_string(&record).unwrap().contains(KEY));
    assert!(!serve.output().contains(KEY), "{}", serve.output());
}

#[test]
fn the_key_comes_from_the_environment_or_a_file() {
    let dir = temp_dir("key-sources");
    let model = dummy_model(&dir, "m.gguf");
    let key_file = dir.join("key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let from_env = Serve::with_fake(&model, &[], &[("ONEBIT_API_KEY", KEY)]);
    let from_file = Serve::with_fake(&model, &["--api-key-file", key_file.to_str().unwrap()], &[]);
    for serve in [&from_env, &from_file] {
        serve.ready();
        assert_eq!(call(serve, "POST", "/tokenize", None, TOKENIZE).0, 401);
        let bearer = format!("Bearer {KEY}");
        assert_eq!(
            call(serve, "POST", "/tokenize", Some(&bearer), TOKENIZE).0,
            200
        );
    }
    // An empty key file is refused before anything starts.
    std::fs::write(&key_file, "\n").unwrap();
    let mut empty = Serve::with_fake(&model, &["--api-key-file", key_file.to_str().unwrap()], &[]);
    let status = empty
        .wait_exit(Duration::from_secs(10))
        .expect("serve exits");
    assert_eq!(status.code(), Some(2), "{}", empty.output());
    assert!(
        empty.output().contains("the API key is empty"),
        "{}",
        empty.output()
    );
}

#[test]
fn a_bind_beyond_loopback_without_a_key_says_who_can_reach_it() {
    let dir = temp_dir("key-warn");
    let model = dummy_model(&dir, "m.gguf");
    let open = Serve::with_fake(&model, &["--host", "0.0.0.0"], &[]);
    open.ready();
    let warnings = open
        .output()
        .lines()
        .filter(|l| l.contains("no --api-key"))
        .count();
    assert_eq!(warnings, 1, "{}", open.output());
    assert!(
        open.output().contains("anyone who can reach this port"),
        "{}",
        open.output()
    );
    drop(open);
    let keyed = Serve::with_fake(&model, &["--host", "0.0.0.0", "--api-key", KEY], &[]);
    keyed.ready();
    assert!(
        !keyed.output().contains("no --api-key"),
        "{}",
        keyed.output()
    );
    let loopback = Serve::with_fake(&model, &[], &[]);
    loopback.ready();
    assert!(
        !loopback.output().contains("no --api-key"),
        "{}",
        loopback.output()
    );
}

/// The OpenAI Python SDK, given serve's key as its `api_key`, is served (whole and streamed);
/// given another, it raises its own `AuthenticationError` from serve's 401.
#[test]
fn the_openai_sdk_with_the_key_is_served_and_without_it_is_refused() {
    let python = installed(
        "ONEBIT_TEST_OPENAI_PYTHON",
        "venvs/openai-3.51.0/bin/python",
    );
    let dir = temp_dir("key-sdk");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--api-key", KEY], &[]);
    serve.ready();
    const SCRIPT: &str = r#"
import sys, openai
base = "http://127.0.0.1:%s/v1" % sys.argv[1]
client = openai.OpenAI(base_url=base, api_key=sys.argv[2], max_retries=0)
hi = [{"role": "user", "content": "hi"}]
print("whole", client.chat.completions.create(model="m", messages=hi).model)
events = list(client.chat.completions.create(model="m", messages=hi, stream=True))
print("streamed", len(events) > 0)
try:
    openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0).models.list()
    print("wrong key accepted")
except openai.AuthenticationError as e:
    print("refused", e.status_code)
"#;
    let out = std::process::Command::new(python)
        .args(["-c", SCRIPT, &serve.port.to_string(), KEY])
        .output()
        .expect("python runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text, "whole m\nstreamed True\nrefused 401\n");
}
