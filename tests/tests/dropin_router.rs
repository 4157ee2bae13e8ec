//! The drop-in with no `-m`: llama-server's router mode, the real llama-server loading the
//! models of `--models-dir` itself, behind serve's guard, key and supervision. The model list
//! is the router's, a chat naming a model loads it and answers, a foreign page is refused as
//! before, and nothing the router started outlives serve.

use std::process::Command;
use std::time::Duration;

use onebit_tests::*;

const MODEL: &str = "SmolLM2-135M-Instruct-Q4_1";

/// `1bit llama-server --models-dir <a folder holding the default model> ARGS`, ready.
fn router(args: &[&str]) -> Serve {
    let dir = temp_dir("dropin-router");
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::os::unix::fs::symlink(
        installed_model(&format!("{MODEL}.gguf")),
        models.join(format!("{MODEL}.gguf")),
    )
    .unwrap();
    let port = free_port();
    let mut command = Command::new(onebit());
    command
        .arg("llama-server")
        .args(["--models-dir", models.to_str().unwrap()])
        .args(["--port", &port.to_string(), "-c", "1024"])
        .args(args)
        .env("ONEBIT_STATE_DIR", dir.join("state"))
        .env("ONEBIT_LLAMA_SERVER", installed_llama_server())
        .env("ONEBIT_HRX_PRESENT", "0");
    let serve = Serve::spawn(command, port);
    assert!(
        serve.wait_health(200, Duration::from_secs(60)),
        "router mode did not become ready:\n{}",
        serve.output()
    );
    serve
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn router_mode_lists_loads_and_answers_behind_serves_guard() {
    let serve = router(&["--models-max", "1"]);
    assert!(
        serve
            .output()
            .contains("1bit serve: router mode (no -m): llama-server loads the models"),
        "{}",
        serve.output()
    );
    // The backend is the real llama-server with no model, given the user's arguments.
    let children = serve.children();
    assert_eq!(children.len(), 1, "{}", serve.output());
    let argv = cmdline(children[0]);
    assert!(
        !argv.split(' ').any(|a| a == "-m") && argv.contains("--models-dir"),
        "{argv}"
    );
    // The list is the router's (its models with their load status), not serve's one model.
    for path in ["/v1/models", "/models"] {
        let (status, body) = get(&serve.url(path));
        assert_eq!(status, 200, "{path}: {body}");
        let list = json(&body);
        let entry = list["data"]
            .as_array()
            .and_then(|d| d.iter().find(|m| m["id"] == MODEL))
            .unwrap_or_else(|| panic!("{path} does not list {MODEL}: {body}"));
        assert!(entry["status"]["value"].is_string(), "{path}: {body}");
        assert_ne!(entry["owned_by"], "1bit", "{path}: {body}");
    }
    // The general engine, which takes a head of more headers than the fast engine reads,
    // answers the same list.
    let pad: String = (0..70).map(|i| format!("X-Pad-{i}: 1\r\n")).collect();
    let request =
        format!("GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{pad}Connection: close\r\n\r\n");
    let (status, reply) = raw(serve.port, request.as_bytes(), Duration::from_secs(10));
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains(r#""source":"models_dir""#), "{reply}");
    // A chat naming the model loads it and answers; the reply names it as the router does.
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "temperature": 0,
        "max_tokens": 8,
    });
    let (status, reply) = post_with_timeout(
        &serve.url("/v1/chat/completions"),
        &body.to_string(),
        Duration::from_secs(90),
    );
    assert_eq!(status, 200, "{reply}\n{}", serve.output());
    let reply = json(&reply);
    let content = reply["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(content.contains("Paris"), "{reply}");
    assert_eq!(reply["model"], MODEL, "serve renames nothing here: {reply}");
    let (_, list) = get(&serve.url("/models"));
    assert!(
        list.contains(r#""value":"loaded""#),
        "the model is loaded now: {list}"
    );
    // The guard stands in front of the router as of any route.
    let body = body.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (status, reply) = raw(serve.port, request.as_bytes(), Duration::from_secs(10));
    assert_eq!(status, 403, "{reply}");
}

/// The key is serve's in router mode too: the router's routes and its model list need it.
#[test]
fn router_mode_takes_serves_key() {
    let serve = router(&["--api-key", "sk-router-7f3a"]);
    let (status, reply) = get(&serve.url("/v1/models"));
    assert_eq!(status, 401, "{reply}");
    let (status, reply) = raw(
        serve.port,
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer sk-router-7f3a\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    );
    assert_eq!(status, 200, "{reply}");
    assert!(
        !cmdline(serve.children()[0]).contains("sk-router-7f3a"),
        "the key never reaches the router"
    );
}

/// The router starts a llama-server of its own for each model it loads; kill -9 of serve
/// leaves neither it nor the router running.
#[test]
fn nothing_the_router_started_outlives_serve() {
    let serve = router(&[]);
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    });
    let (status, reply) = post_with_timeout(
        &serve.url("/v1/chat/completions"),
        &body.to_string(),
        Duration::from_secs(90),
    );
    assert_eq!(status, 200, "{reply}");
    assert!(
        descendants(serve.pid()).len() >= 2,
        "the router and the model's own llama-server: {:?}",
        descendants(serve.pid())
    );
    kill9_leaves_nothing(serve);
}

/// Router mode runs on the cpu route, whose llama-server the router is, with serve in the
/// request path; another route, or `--print-backend`, is refused in one line.
#[test]
fn router_mode_on_another_route_or_printed_is_refused_saying_why() {
    let out = Command::new(onebit())
        .args(["serve", "--llama-router", "--device", "hrx"])
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--device hrx: llama-server's router mode (no -m) runs on the cpu route"),
        "{stderr}"
    );
    // Nor can the router be printed as a one-hop command: it has no model serve could check.
    let out = Command::new(onebit())
        .args(["serve", "--llama-router", "--print-backend"])
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(
        stderr
            .contains("--print-backend: router mode (no -m) needs 1bit serve in the request path"),
        "{stderr}"
    );
}
