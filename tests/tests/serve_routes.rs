//! Every route the pinned llama-server answers reaches it through `1bit serve`, or serve
//! answers it itself as the specification says: the route list is read from the pinned
//! llama.cpp source (`tools/server/server.cpp`), so a route a new pin adds cannot be missed
//! silently. Bodies go by their kind (a multipart upload is relayed as it came, not refused as
//! "not JSON"), and the inference routes (Anthropic's Messages, `/infill`) are watched.

use std::path::PathBuf;
use std::time::Duration;

use onebit_plugin_api::{BodyKind, llama_server_rules};
use onebit_tests::*;

/// The routes serve answers itself (the specification: `/health`, `/v1/models`, `/metrics`;
/// `/models` is llama-server's other name for the list; slot save and restore are 501).
const SERVE_OWN: [(&str, &str); 6] = [
    ("GET", "/health"),
    ("GET", "/v1/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("POST", "/slots/:id_slot"),
];

/// serve's own 404 says this; llama-server's says "File Not Found".
const SERVE_404: &str = "is not served here";

/// The pinned llama-server's `server.cpp`, or None (the test says it is skipped) when the
/// source tree is not there.
fn pinned_server_cpp() -> Option<PathBuf> {
    let Some(tree) = pinned_llama_cpp_source() else {
        eprintln!(
            "skipped: the pinned llama.cpp source is not there (run `cargo xtask setup`, or set ONEBIT_TEST_LLAMA_CPP_SOURCE to the tree)"
        );
        return None;
    };
    Some(tree.join("tools/server/server.cpp"))
}

/// The (method, path) pairs `server.cpp` registers (`ctx_http.post("/path", ...)`, `get`,
/// `del`, `put`), in order, each once. Routes it registers under a flag (router mode,
/// `--tools`, the MCP proxy) are in the list too; Google's AIP routes, named by the
/// environment at run time, are not.
fn pinned_routes(server_cpp: &std::path::Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(server_cpp)
        .unwrap_or_else(|e| panic!("{}: {e}", server_cpp.display()));
    let mut routes: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let Some(call) = line.trim_start().strip_prefix("ctx_http.") else {
            continue;
        };
        let Some((verb, rest)) = call.split_once('(') else {
            continue;
        };
        let method = match verb.trim() {
            "get" => "GET",
            "post" => "POST",
            "del" => "DELETE",
            "put" => "PUT",
            "patch" => "PATCH",
            _ => continue,
        };
        let Some(path) = rest
            .trim_start()
            .strip_prefix('"')
            .and_then(|p| p.split('"').next())
        else {
            continue;
        };
        let route = (method.to_string(), path.to_string());
        if !routes.contains(&route) {
            routes.push(route);
        }
    }
    // A source that registers its routes some other way must fail here, not pass empty.
    assert!(
        routes.len() >= 30 && routes.iter().any(|(_, p)| p == "/v1/chat/completions"),
        "{}: found only {routes:?}; has llama-server changed how it registers its routes?",
        server_cpp.display()
    );
    routes
}

/// A concrete path for a registered one (`/slots/:id_slot` → `/slots/0?action=save`).
fn concrete(path: &str) -> String {
    let filled: Vec<&str> = path
        .split('/')
        .map(|segment| {
            if segment.starts_with(':') {
                "0"
            } else {
                segment
            }
        })
        .collect();
    let filled = filled.join("/");
    if path.starts_with("/slots/") {
        format!("{filled}?action=save")
    } else {
        filled
    }
}

/// The body kind the llama-server routes' table gives a route (None: not in the table).
fn kind_of(method: &str, path: &str) -> Option<BodyKind> {
    llama_server_rules(0)
        .into_iter()
        .find(|r| r.method == method && r.path == path)
        .map(|r| r.body.for_method(method))
}

const BOUNDARY: &str = "onebitBoundary7MA4YWxk";

/// A multipart upload: a `model` field and a `file` of bytes that are neither UTF-8 nor JSON.
fn upload() -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n\
             --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
             Content-Type: audio/wav\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(b"RIFF\x24\x00\x00\x00WAVEfmt \xff\xfe\x00\x01");
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    body
}

/// One JSON body every JSON route of llama-server can take without generating much.
const ANY_JSON: &str = r#"{"messages":[{"role":"user","content":"hi"}],"prompt":"hi","input_prefix":"def f(","input_suffix":"):","content":"hi","input":"hi","max_tokens":1,"n_predict":1}"#;

/// Send the route's request (a body of its kind) with `X-Route-Walk: <n>`; (status, body).
fn send(serve: &Serve, n: usize, method: &str, path: &str) -> (u16, String) {
    let url = serve.url(&concrete(path));
    let walk = n.to_string();
    let form = format!("multipart/form-data; boundary={BOUNDARY}");
    let mut headers = vec![("x-route-walk", walk.as_str())];
    let body: Option<Vec<u8>> = match kind_of(method, path) {
        Some(BodyKind::None) => None,
        None if method == "GET" || method == "DELETE" => None,
        Some(BodyKind::Multipart) => {
            headers.push(("content-type", form.as_str()));
            Some(upload())
        }
        // `/lora-adapters` takes a JSON array.
        Some(BodyKind::Raw) => {
            headers.push(("content-type", "application/json"));
            Some(b"[]".to_vec())
        }
        _ => {
            headers.push(("content-type", "application/json"));
            Some(ANY_JSON.as_bytes().to_vec())
        }
    };
    request(method, &url, &headers, body.as_deref())
}

#[test]
fn every_route_the_pinned_llama_server_registers_is_relayed_or_answered_by_serve() {
    let Some(server_cpp) = pinned_server_cpp() else {
        return;
    };
    let routes = pinned_routes(&server_cpp);
    let dir = temp_dir("routes-walk");
    let model = dummy_model(&dir, "m.gguf");
    let side = dummy_model(&dir, "side.gguf");
    let record = dir.join("record.jsonl");
    // With embedding and reranking models beside it, so the role routes are relayed (to their
    // backends) rather than answered 501 as on a chat model alone; every backend records.
    let side = side.to_str().unwrap();
    let serve = Serve::with_fake(
        &model,
        &["--embed", side, "--rerank", side],
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    serve.ready();

    let mut missed = Vec::new();
    let mut sent = Vec::new();
    for (n, (method, path)) in routes.iter().enumerate() {
        let (status, body) = send(&serve, n, method, path);
        if SERVE_OWN.contains(&(method.as_str(), path.as_str())) {
            if status == 404 || status == 0 {
                missed.push(format!(
                    "{method} {path}: serve's own route answered {status} {body}"
                ));
            }
            continue;
        }
        sent.push((n, method, path, status, body));
    }
    let recorded = json_lines(&record);
    for (n, method, path, status, body) in sent {
        let reached = recorded
            .iter()
            .find(|r| r["headers"]["x-route-walk"].as_str() == Some(n.to_string().as_str()));
        match reached {
            Some(r) => {
                let target = concrete(path);
                let (want_path, want_query) = target.split_once('?').unwrap_or((&target, ""));
                assert_eq!(
                    (
                        r["method"].as_str(),
                        r["path"].as_str(),
                        r["query"].as_str()
                    ),
                    (Some(method.as_str()), Some(want_path), Some(want_query)),
                    "{r}"
                );
            }
            None => missed.push(format!(
                "{method} {path}: not relayed (serve answered {status} {body})"
            )),
        }
    }
    assert!(
        missed.is_empty(),
        "routes of the pinned llama-server that do not reach it through serve; add them to \
         onebit_plugin_api::llama_server_rules (plugin-api/src/types.rs) or, when serve answers \
         them itself by the specification, to SERVE_OWN:\n{}",
        missed.join("\n")
    );
}

#[test]
fn a_multipart_upload_reaches_the_backend_as_it_was_sent() {
    let dir = temp_dir("routes-upload");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let form = format!("multipart/form-data; boundary={BOUNDARY}");
    let body = upload();
    let (status, reply) = request(
        "POST",
        &serve.url("/v1/audio/transcriptions"),
        &[("content-type", &form)],
        Some(&body),
    );
    // The fake has no transcriptions: its own 404, not serve's refusal of a body that is not
    // JSON.
    assert_eq!(status, 404, "{reply}");
    assert!(reply.contains("File Not Found"), "{reply}");
    let reached = json_lines(&record)
        .into_iter()
        .find(|r| r["path"] == "/v1/audio/transcriptions")
        .expect("the upload reached the backend");
    assert_eq!(reached["headers"]["content-type"], form.as_str());
    assert_eq!(
        reached["headers"]["content-length"],
        body.len().to_string().as_str()
    );
    assert_eq!(
        reached["body"].as_str().unwrap(),
        String::from_utf8_lossy(&body),
        "the bytes as sent"
    );

    // The same route with JSON, or with no Content-Type, is refused in one line saying what
    // to send; nothing more reaches the backend.
    for content_type in [Some("application/json"), None] {
        let headers: Vec<(&str, &str)> = content_type
            .map(|ct| ("content-type", ct))
            .into_iter()
            .collect();
        let (status, reply) = request(
            "POST",
            &serve.url("/audio/transcriptions"),
            &headers,
            Some(br#"{"file":"x"}"#),
        );
        assert_eq!(status, 400, "{reply}");
        let error: serde_json::Value = serde_json::from_str(&reply).unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("send the file as multipart/form-data"),
            "{message}"
        );
    }
    assert!(
        !json_lines(&record)
            .iter()
            .any(|r| r["path"] == "/audio/transcriptions")
    );

    // A JSON route still refuses an upload.
    let (status, reply) = request(
        "POST",
        &serve.url("/v1/chat/completions"),
        &[("content-type", &form)],
        Some(&body),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("not JSON"), "{reply}");
}

#[test]
fn a_route_that_takes_no_body_is_relayed_without_one() {
    let dir = temp_dir("routes-nobody");
    let model = dummy_model(&dir, "m.gguf");
    let record = dir.join("record.jsonl");
    let serve = Serve::with_fake(&model, &[], &[("FAKE_RECORD", record.to_str().unwrap())]);
    serve.ready();
    let (status, reply) = request("DELETE", &serve.url("/v1/stream?conv_id=c1"), &[], None);
    assert_eq!(status, 404, "the fake's own 404: {reply}");
    assert!(reply.contains("File Not Found"), "{reply}");
    let reached = json_lines(&record)
        .into_iter()
        .find(|r| r["path"] == "/v1/stream")
        .expect("the DELETE reached the backend");
    assert_eq!(
        (reached["method"].as_str(), reached["query"].as_str()),
        (Some("DELETE"), Some("conv_id=c1"))
    );
    assert_eq!(reached["body"], "");
}

/// The watchdog fires on a hung request to `path`: serve says so and exits 1.
fn watched_when_hung(path: &str, body: &str) {
    let dir = temp_dir("routes-watched");
    let model = dummy_model(&dir, "m.gguf");
    let mut serve = Serve::with_fake(&model, &["--watchdog", "2"], &[]);
    serve.ready();
    let url = serve.url(path);
    let body = body.to_string();
    std::thread::spawn(move || post_with_timeout(&url, &body, Duration::from_secs(30)));
    let exit = serve
        .wait_exit(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("the watchdog did not fire on {path}: {}", serve.output()));
    let out = serve.output();
    assert_eq!(exit.code(), Some(1), "{out}");
    assert!(
        out.contains(&format!("1bit serve: watchdog: POST {path} ")),
        "{out}"
    );
}

#[test]
fn anthropic_messages_streamed_and_not_and_infill_are_watched() {
    watched_when_hung(
        "/v1/messages",
        r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"fake_hang"}]}"#,
    );
    watched_when_hung(
        "/v1/messages",
        r#"{"model":"m","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"fake_hang"}]}"#,
    );
    watched_when_hung(
        "/infill",
        r#"{"input_prefix":"def f(","input_suffix":"fake_hang","n_predict":4}"#,
    );
}

#[test]
fn models_is_serves_own_list_as_v1_models_is() {
    let dir = temp_dir("routes-models");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--alias", "walker"], &[]);
    serve.ready();
    let (status, own) = get(&serve.url("/models"));
    assert_eq!(status, 200, "{own}");
    assert_eq!(own, get(&serve.url("/v1/models")).1);
    let list: serde_json::Value = serde_json::from_str(&own).unwrap();
    assert_eq!(list["data"][0]["id"], "walker");
    assert_eq!(list["data"][0]["owned_by"], "1bit");
}

#[test]
fn every_route_of_the_pinned_list_gets_the_real_llama_servers_answer_not_serves_404() {
    let Some(server_cpp) = pinned_server_cpp() else {
        return;
    };
    let routes = pinned_routes(&server_cpp);
    let serve = serve_smollm2(&[]);
    let mut missed = Vec::new();
    for (n, (method, path)) in routes.iter().enumerate() {
        let (status, body) = send(&serve, n, method, path);
        if status == 0 || (status == 404 && body.contains(SERVE_404)) {
            missed.push(format!("{method} {path}: {status} {body}"));
        }
    }
    assert!(
        missed.is_empty(),
        "through serve, routes of the pinned llama-server get serve's 404 (or nothing):\n{}",
        missed.join("\n")
    );
    // The upload reached llama-server, which says what it lacks (no audio model), not serve's
    // "not JSON".
    let form = format!("multipart/form-data; boundary={BOUNDARY}");
    let (status, reply) = request(
        "POST",
        &serve.url("/v1/audio/transcriptions"),
        &[("content-type", &form)],
        Some(&upload()),
    );
    assert!(status >= 400, "{status} {reply}");
    assert!(
        reply.contains("does not support audio input"),
        "{status} {reply}"
    );
}
