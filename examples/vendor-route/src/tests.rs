//! The route's own tests, against the kernels library build.rs built (its path comes from
//! build.rs as `ACME_KERNELS_BUILT`): claim and plan, then start and respond through a sink of
//! the test's own, whole and streamed, with a client that leaves.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    Action, DeviceRoute, ForwardRequest, HealthProbe, ModelFacts, PackageFacts, PackageFile, Plan,
    PlanRequest, Refusal, ReplySink, RouteOption, ServeOptions, SinkError, Started,
};
use serde_json::Value;

use crate::AcmeRoute;
use crate::kernels::{KERNELS_FILE, Kernels};
use crate::plan::State;

/// The kernels library build.rs built.
fn built_kernels() -> PathBuf {
    PathBuf::from(env!("ACME_KERNELS_BUILT"))
}

/// A folder of the test's own under the target folder, empty.
fn scratch(name: &str) -> PathBuf {
    let dir = built_kernels()
        .parent()
        .unwrap()
        .join("acme-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A plan request for a GGUF model, with the route loaded from `route_dir`.
fn request(route_dir: &Path) -> PlanRequest {
    PlanRequest {
        options: ServeOptions {
            model: "/models/tiny.gguf".to_string(),
            served_name: "tiny".to_string(),
            device: "acme".to_string(),
            ..Default::default()
        },
        model: ModelFacts {
            path: "/models/tiny.gguf".to_string(),
            files: vec!["/models/tiny.gguf".to_string()],
            bytes: 512 << 20,
            architecture: Some("llama".to_string()),
            ..Default::default()
        },
        route_dir: route_dir.display().to_string(),
        ..Default::default()
    }
}

/// A route started on the plan for a model in the build folder, with route options `options`.
fn started(options: &[(&str, &str)]) -> AcmeRoute {
    let mut request = request(built_kernels().parent().unwrap());
    request.options.route_options = options
        .iter()
        .map(|(key, value)| RouteOption {
            flag: "--route-opt".to_string(),
            key: key.to_string(),
            value: value.to_string(),
        })
        .collect();
    let route = AcmeRoute::default();
    let plan = route.plan(&request).expect("the route plans");
    route
        .start(&Started {
            plan,
            pids: Vec::new(),
        })
        .expect("the kernels load");
    route
}

/// What a reply did to the test's sink.
#[derive(Default)]
struct TestSink {
    /// Every head sent.
    heads: Vec<(u16, String)>,
    /// The body's bytes.
    body: Vec<u8>,
    /// Sends accepted.
    sends: usize,
    /// Refuse every send after this many accepted (the client leaves).
    leave_after: Option<usize>,
    /// Sends attempted after the first refusal, that one included.
    sends_after_gone: usize,
    /// `end` was called.
    ended: bool,
}

impl TestSink {
    fn gone(&self) -> bool {
        self.leave_after.is_some_and(|n| self.sends >= n)
    }
    fn text(&self) -> String {
        String::from_utf8(self.body.clone()).unwrap()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("the body is JSON")
    }
}

impl ReplySink for TestSink {
    fn send_head(&mut self, status: u16, content_type: &str) -> Result<(), SinkError> {
        self.heads.push((status, content_type.to_string()));
        Ok(())
    }
    fn send(&mut self, bytes: &[u8]) -> Result<(), SinkError> {
        if self.gone() {
            self.sends_after_gone += 1;
            return Err(SinkError {
                message: "the client is gone".to_string(),
            });
        }
        self.sends += 1;
        self.body.extend_from_slice(bytes);
        Ok(())
    }
    fn end(&mut self) {
        self.ended = true;
    }
    fn client_gone(&self) -> bool {
        self.gone()
    }
}

/// `POST /v1/chat/completions` with `body`.
fn chat(body: Value) -> ForwardRequest {
    ForwardRequest {
        method: "POST".to_string(),
        path: "/v1/chat/completions".to_string(),
        query: String::new(),
        body: body.to_string(),
    }
}

/// A chat request whose last user message is `prompt`.
fn ask(prompt: &str, stream: bool, max_tokens: Option<u32>) -> ForwardRequest {
    let mut body = serde_json::json!({
        "model": "whatever",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "an earlier question"},
            {"role": "assistant", "content": "an earlier answer"},
            {"role": "user", "content": prompt},
        ],
        "stream": stream,
    });
    if let Some(n) = max_tokens {
        body["max_tokens"] = n.into();
    }
    chat(body)
}

/// The value of a Prometheus series in `text`.
fn series(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

#[test]
fn the_kernels_generate_the_prompts_words_in_reverse() {
    let kernels = Kernels::load(&built_kernels()).unwrap();
    let prompt = c"  héllo big\tworld\n";
    let tokens: Vec<_> = (0..4).map(|s| kernels.token(prompt, s).unwrap()).collect();
    assert_eq!(
        tokens,
        [
            Some("world".to_string()),
            Some(" big".to_string()),
            Some(" héllo".to_string()),
            None
        ]
    );
    assert_eq!(kernels.token(c"   ", 0).unwrap(), None);
    assert_eq!(kernels.device_total_bytes(), 4 << 30);
}

#[test]
fn a_gguf_is_claimed_at_95_when_the_kernels_are_in_place() {
    let route = AcmeRoute::default();
    let claim = route.claim(&request(built_kernels().parent().unwrap()));
    assert_eq!(claim.strength, 95, "{claim:?}");
    assert!(claim.reason.contains(KERNELS_FILE), "{}", claim.reason);

    // Named .gguf, its header unread: still a GGUF.
    let mut unread = request(built_kernels().parent().unwrap());
    unread.model.architecture = None;
    assert_eq!(route.claim(&unread).strength, 95);

    let empty = scratch("claim-empty");
    let claim = route.claim(&request(&empty));
    assert_eq!(claim.strength, 0);
    assert!(claim.reason.contains("not installed"), "{}", claim.reason);

    let mut not_gguf = request(built_kernels().parent().unwrap());
    not_gguf.model.architecture = None;
    not_gguf.model.path = "/models/npu-model".to_string();
    not_gguf.model.is_dir = true;
    let claim = route.claim(&not_gguf);
    assert_eq!(claim.strength, 0);
    assert!(claim.reason.contains("not a GGUF"), "{}", claim.reason);
}

#[test]
fn a_package_gives_its_checked_kernels_and_nothing_unlisted() {
    let dir = scratch("package");
    let listed = dir.join(KERNELS_FILE);
    std::fs::copy(built_kernels(), &listed).unwrap();
    let mut with_kernels = request(&dir);
    with_kernels.package = Some(PackageFacts {
        name: "acme".to_string(),
        version: "1.2.0".to_string(),
        dir: dir.display().to_string(),
        files: vec![PackageFile {
            path: listed.display().to_string(),
            name: KERNELS_FILE.to_string(),
            version: "1.0.3".to_string(),
            sha256: String::new(),
        }],
        ..Default::default()
    });
    let route = AcmeRoute::default();
    assert_eq!(route.claim(&with_kernels).strength, 95);
    let plan = route.plan(&with_kernels).unwrap();
    assert_eq!(plan.route_state["kernels"], listed.display().to_string());

    // The same file beside the route, but not in the manifest: not trusted.
    let mut unlisted = with_kernels.clone();
    unlisted.package.as_mut().unwrap().files.clear();
    assert_eq!(route.claim(&unlisted).strength, 0);
    let refusal = route.plan(&unlisted).unwrap_err();
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    assert!(refusal.message.contains("--carry"), "{}", refusal.message);
}

#[test]
fn the_plan_refuses_in_one_line_without_its_kernels() {
    let empty = scratch("plan-empty");
    let refusal = AcmeRoute::default().plan(&request(&empty)).unwrap_err();
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    assert!(!refusal.message.contains('\n'));
    assert!(
        refusal
            .message
            .contains(&empty.join(KERNELS_FILE).display().to_string()),
        "{}",
        refusal.message
    );
    assert!(refusal.message.contains("cargo build --release"));

    let mut old_host = request(&empty);
    old_host.route_dir.clear();
    let refusal = AcmeRoute::default().plan(&old_host).unwrap_err();
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    assert!(refusal.message.contains("1.8"), "{}", refusal.message);
}

/// The plan for the built kernels, with `env` in the request.
fn plan_with(env: &[(&str, &str)], options: &[(&str, &str)]) -> Result<Plan, Refusal> {
    let mut request = request(built_kernels().parent().unwrap());
    request.env = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect::<BTreeMap<_, _>>();
    request.options.route_options = options
        .iter()
        .map(|(key, value)| RouteOption {
            flag: "--route-opt".to_string(),
            key: key.to_string(),
            value: value.to_string(),
        })
        .collect();
    request.options.ctx_size = Some(2048);
    AcmeRoute::default().plan(&request)
}

#[test]
fn the_plan_answers_chats_in_process_on_the_devices_memory() {
    let plan = plan_with(&[], &[]).unwrap();
    assert_eq!(plan.device, "acme");
    assert!(plan.backends.is_empty());
    assert!(!plan.one_hop);
    assert_eq!(plan.rules.len(), 1);
    let rule = &plan.rules[0];
    assert_eq!(
        (rule.method.as_str(), rule.path.as_str()),
        ("POST", "/v1/chat/completions")
    );
    assert_eq!(rule.action, Action::InProcess);
    assert!(rule.inference);
    let memory = plan.memory.clone().unwrap();
    assert_eq!(memory.weights_bytes, 512 << 20);
    assert_eq!(memory.pool, "device");
    assert_eq!(memory.ctx_source, "ctx 2048 (--ctx-size)");
    let device = memory.device.unwrap();
    assert_eq!(
        (device.name.as_str(), device.total_bytes, device.free_bytes),
        ("acme0", 4 << 30, 3 << 30)
    );
    let state: State = serde_json::from_value(plan.route_state.clone()).unwrap();
    assert_eq!(
        state,
        State {
            kernels: built_kernels().display().to_string(),
            served_name: "tiny".to_string(),
            max_tokens_cap: 1024,
        }
    );

    let full = plan_with(
        &[("ACME_DEVICE_FREE_BYTES", "1000")],
        &[("max_tokens_cap", "7")],
    )
    .unwrap();
    assert_eq!(full.memory.unwrap().device.unwrap().free_bytes, 1000);
    assert_eq!(full.route_state["max_tokens_cap"], 7);
}

#[test]
fn the_plan_refuses_bad_options_and_settings() {
    let unknown = plan_with(&[], &[("tiles", "4")]).unwrap_err();
    assert_eq!(unknown.exit_code, Refusal::USAGE);
    assert!(
        unknown.message.contains("max_tokens_cap"),
        "{}",
        unknown.message
    );
    let zero = plan_with(&[], &[("max_tokens_cap", "0")]).unwrap_err();
    assert_eq!(zero.exit_code, Refusal::USAGE);
    let free = plan_with(&[("ACME_DEVICE_FREE_BYTES", "lots")], &[]).unwrap_err();
    assert_eq!(free.exit_code, Refusal::USAGE);
    assert!(
        free.message.contains("ACME_DEVICE_FREE_BYTES=lots"),
        "{}",
        free.message
    );
}

#[test]
fn start_refuses_kernels_of_another_version_naming_both() {
    let dir = scratch("other-version");
    let other = dir.join(KERNELS_FILE);
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/acme_kernels.c");
    // A test's own compiler run, as build.rs's; no process of serve's.
    #[allow(clippy::disallowed_methods)]
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-DACME_KERNELS_VERSION=\"2.0.0\"", "-o"])
        .arg(&other)
        .arg(&source)
        .status()
        .unwrap();
    assert!(status.success());
    let route = AcmeRoute::default();
    let plan = route.plan(&request(&dir)).unwrap();
    let error = route
        .start(&Started {
            plan,
            pids: Vec::new(),
        })
        .unwrap_err();
    let message = error.message;
    assert!(!message.contains('\n'));
    for part in [other.display().to_string(), "2.0.0".into(), "1.0.3".into()] {
        assert!(message.contains(&part), "{part} not in {message}");
    }
    let health = route.health(&HealthProbe::default());
    assert!(!health.ok);
    assert!(health.reason.contains("2.0.0"), "{}", health.reason);
}

#[test]
fn health_follows_the_kernels() {
    let route = AcmeRoute::default();
    assert!(!route.health(&HealthProbe::default()).ok);
    let route = started(&[]);
    assert!(route.health(&HealthProbe::default()).ok);
}

#[test]
fn a_whole_reply_is_a_chat_completion() {
    let route = started(&[]);
    let mut sink = TestSink::default();
    route
        .respond(&ask("the quick brown fox", false, None), &mut sink)
        .unwrap();
    assert_eq!(sink.heads, [(200, "application/json".to_string())]);
    assert!(sink.ended);
    let reply = sink.json();
    assert!(reply["id"].as_str().unwrap().starts_with("chatcmpl-acme-"));
    assert_eq!(reply["object"], "chat.completion");
    assert!(reply["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(reply["model"], "tiny");
    let choice = &reply["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "fox brown quick the");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(
        reply["usage"],
        serde_json::json!({"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8})
    );
    let metrics = route.metrics();
    assert_eq!(series(&metrics, "acme_generations_total"), 1);
    assert_eq!(series(&metrics, "acme_tokens_total"), 4);
    for line in [
        "# TYPE acme_generations_total counter",
        "# TYPE acme_tokens_total counter",
        "# HELP acme_tokens_total ",
    ] {
        assert!(metrics.contains(line), "{line} not in {metrics}");
    }
}

#[test]
fn max_tokens_and_the_cap_end_a_reply_with_length() {
    let route = started(&[("max_tokens_cap", "3")]);
    let mut sink = TestSink::default();
    route
        .respond(&ask("one two three four five", false, Some(2)), &mut sink)
        .unwrap();
    let reply = sink.json();
    assert_eq!(reply["choices"][0]["message"]["content"], "five four");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    assert_eq!(reply["usage"]["completion_tokens"], 2);

    let mut sink = TestSink::default();
    route
        .respond(&ask("one two three four five", false, Some(100)), &mut sink)
        .unwrap();
    let reply = sink.json();
    assert_eq!(reply["choices"][0]["message"]["content"], "five four three");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");

    // Exactly as long as the limit: the kernels had nothing more, so stop.
    let mut sink = TestSink::default();
    route
        .respond(&ask("a b c", false, None), &mut sink)
        .unwrap();
    assert_eq!(sink.json()["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_streamed_reply_is_sse_chunks_ending_in_done() {
    let route = started(&[]);
    let mut sink = TestSink::default();
    route
        .respond(&ask("hello big world", true, None), &mut sink)
        .unwrap();
    assert_eq!(sink.heads, [(200, "text/event-stream".to_string())]);
    assert!(sink.ended);
    let text = sink.text();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<&str> = text.strip_suffix("\n\n").unwrap().split("\n\n").collect();
    // The role, three tokens, the finish, [DONE].
    assert_eq!(events.len(), 6, "{text}");
    assert_eq!(sink.sends, 6);
    let chunks: Vec<Value> = events[..5]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], "tiny");
        assert_eq!(chunk["id"], id);
        assert_eq!(chunk["choices"][0]["index"], 0);
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks[1..4]
        .iter()
        .map(|c| {
            assert!(c["choices"][0]["finish_reason"].is_null());
            c["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(content, "world big hello");
    assert_eq!(chunks[4]["choices"][0]["delta"], serde_json::json!({}));
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "stop");
}

#[test]
fn a_refused_send_stops_generation_and_is_no_error() {
    let route = started(&[]);
    let prompt = (0..200)
        .map(|n| format!("w{n}"))
        .collect::<Vec<_>>()
        .join(" ");
    // The role event and two tokens reach the client; then it leaves.
    let mut sink = TestSink {
        leave_after: Some(3),
        ..Default::default()
    };
    route.respond(&ask(&prompt, true, None), &mut sink).unwrap();
    assert_eq!(sink.sends, 3);
    assert!(
        sink.sends_after_gone <= 1,
        "{} sends after",
        sink.sends_after_gone
    );
    assert!(!sink.text().contains("[DONE]"));
    // Generation stopped: at most the token whose send was refused is made beyond those sent.
    let tokens = series(&route.metrics(), "acme_tokens_total");
    assert!(
        tokens <= 3,
        "{tokens} tokens generated for a client that left"
    );
}

#[test]
fn a_client_gone_before_a_whole_reply_stops_it_between_tokens() {
    let route = started(&[]);
    let mut sink = TestSink {
        leave_after: Some(0),
        ..Default::default()
    };
    route
        .respond(&ask("one two three", false, None), &mut sink)
        .unwrap();
    assert!(sink.heads.is_empty());
    assert_eq!(sink.sends_after_gone, 0);
    assert_eq!(series(&route.metrics(), "acme_tokens_total"), 0);
}

#[test]
fn a_bad_request_is_a_400_in_openais_error_shape() {
    let route = started(&[]);
    for body in [
        serde_json::json!({"messages": 42, "prompt": 42, "max_tokens": "x"}),
        serde_json::json!({"prompt": "no messages"}),
        serde_json::json!({"messages": [{"role": "system", "content": "no user"}]}),
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ] {
        let mut sink = TestSink::default();
        route.respond(&chat(body.clone()), &mut sink).unwrap();
        assert_eq!(
            sink.heads,
            [(400, "application/json".to_string())],
            "{body}"
        );
        let error = &sink.json()["error"];
        assert_eq!(error["code"], 400);
        assert_eq!(error["type"], "invalid_request_error");
        assert!(!error["message"].as_str().unwrap().contains('\n'));
    }
    let mut sink = TestSink::default();
    let not_json = ForwardRequest {
        body: "{not json".to_string(),
        ..chat(Value::Null)
    };
    route.respond(&not_json, &mut sink).unwrap();
    assert_eq!(sink.heads[0].0, 400);
    assert_eq!(series(&route.metrics(), "acme_generations_total"), 0);
}

#[test]
fn respond_before_start_is_an_error() {
    let mut sink = TestSink::default();
    let error = AcmeRoute::default()
        .respond(&ask("hi", false, None), &mut sink)
        .unwrap_err();
    assert!(error.message.contains("not loaded"), "{}", error.message);
    assert!(sink.heads.is_empty());
}

#[test]
fn parts_content_is_read_as_its_text() {
    let route = started(&[]);
    let mut sink = TestSink::default();
    let body = serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "red green"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "blue"},
    ]}]});
    route.respond(&chat(body), &mut sink).unwrap();
    assert_eq!(
        sink.json()["choices"][0]["message"]["content"],
        "blue green red"
    );
}
