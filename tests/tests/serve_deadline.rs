//! `--max-generation-s SECS`: a generation still running SECS seconds after its admission is
//! ended on every path serve carries it by: a whole reply not yet begun gets 504, a stream
//! under way one last error event (no `[DONE]`), and the backend's connection is dropped, so
//! the backend stops generating; each end is counted in `onebit_generation_deadlines_total`.
//! A request that is not a generation is never bounded. Fake backend throughout.

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;
/// Long enough that a generation the deadline did not end would outlive the test's patience.
const EVENTS: &str = "2000";
const EVENT_MS: &str = "20";

/// serve with the fake backend, `--max-generation-s deadline_s` and `--sse-keepalive-s
/// keepalive_s`, its stream 2000 events 20 ms apart (40 s).
fn serve_with_deadline(deadline_s: u64, keepalive_s: u64) -> Serve {
    let dir = temp_dir("deadline");
    let model = dummy_model(&dir, "m.gguf");
    let (deadline, keepalive) = (deadline_s.to_string(), keepalive_s.to_string());
    let serve = Serve::with_fake(
        &model,
        &[
            "--max-generation-s",
            &deadline,
            "--sse-keepalive-s",
            &keepalive,
        ],
        &[
            ("FAKE_SSE_EVENTS", EVENTS),
            ("FAKE_SSE_INTERVAL_MS", EVENT_MS),
        ],
    );
    serve.ready();
    serve
}

/// The engine a request with a whole body (`Content-Length`) or a chunked one goes to.
fn engine(chunked_body: bool) -> &'static str {
    if chunked_body { "general" } else { "fast" }
}

/// A streamed chat posted raw (whole body: the fast engine; chunked: the general one), read to
/// its end: (status, the whole reply, how long it took).
fn streamed_chat(serve: &Serve, content: &str, chunked_body: bool) -> (u16, String, Duration) {
    let body = format!(r#"{{"stream":true,"messages":[{{"role":"user","content":"{content}"}}]}}"#);
    let request = raw_json_post(serve.port, "/v1/chat/completions", &body, chunked_body);
    let began = Instant::now();
    let (status, reply) = raw(serve.port, &request, SECS(30));
    (status, reply, began.elapsed())
}

/// The last `data:` payload of a raw event-stream reply.
fn last_event(reply: &str) -> serde_json::Value {
    let last = reply
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or_else(|| panic!("no event in {reply}"));
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"))
}

/// The stream's end as the deadline makes it: its last event the 504 error, no `[DONE]`; the
/// backend stopped; counted once; carried by `engine`.
fn ended_by_the_deadline(serve: &Serve, backend: &BackendLoad, reply: &str, engine: &str) {
    let last = last_event(reply);
    assert_eq!(
        last["error"]["code"], 504,
        "the stream's last event should be the deadline's error: {reply}"
    );
    assert!(
        last["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--max-generation-s")),
        "{last}"
    );
    assert!(!reply.contains("[DONE]"), "{reply}");
    assert!(
        backend.stops_within(SECS(3)),
        "the backend went on generating after the deadline"
    );
    assert_eq!(generation_deadlines(serve), Some(1.0));
    assert_eq!(
        requests_total(serve, &[("engine", engine), ("path_class", "chat")]),
        1,
        "the request should have been carried by the {engine} engine"
    );
}

fn a_stream_under_way_ends_with_one_error_event(chunked_body: bool) {
    let serve = serve_with_deadline(1, 15);
    let backend = BackendLoad::of(&serve);
    let (status, reply, took) = streamed_chat(&serve, "long", chunked_body);
    assert_eq!(status, 200, "{reply}");
    assert!(
        took < SECS(5),
        "a 40 s stream under a 1 s deadline took {took:?}"
    );
    let content = reply.matches(r#""content":"#).count();
    assert!(content >= 5, "the stream was under way first: {reply}");
    ended_by_the_deadline(&serve, &backend, &reply, engine(chunked_body));
}

#[test]
fn a_stream_under_way_on_the_fast_engine_ends_with_one_error_event() {
    a_stream_under_way_ends_with_one_error_event(false);
}

#[test]
fn a_stream_under_way_on_the_general_engine_ends_with_one_error_event() {
    a_stream_under_way_ends_with_one_error_event(true);
}

/// A stream whose backend is silent past the deadline (a long prefill), keep-alive off: no
/// reply has begun, so it is a 504.
fn a_reply_not_begun_is_504(chunked_body: bool) {
    let serve = serve_with_deadline(1, 0);
    let backend = BackendLoad::of(&serve);
    let (status, reply, took) = streamed_chat(&serve, "fake_slow_ms=30000", chunked_body);
    assert_eq!(status, 504, "{reply}");
    assert!(took < SECS(5), "took {took:?}");
    assert!(reply.contains("--max-generation-s"), "{reply}");
    assert!(
        backend.stops_within(SECS(3)),
        "the backend went on with its prefill after the deadline"
    );
    assert_eq!(generation_deadlines(&serve), Some(1.0));
    assert_eq!(
        requests_total(
            &serve,
            &[("engine", engine(chunked_body)), ("status_class", "5xx")]
        ),
        1,
        "{}",
        get(&serve.url("/metrics")).1
    );
}

#[test]
fn a_stream_not_begun_on_the_fast_engine_is_504() {
    a_reply_not_begun_is_504(false);
}

#[test]
fn a_stream_not_begun_on_the_general_engine_is_504() {
    a_reply_not_begun_is_504(true);
}

#[test]
fn a_whole_reply_not_begun_is_504() {
    // The README's chat: not streamed, its reply named as serve serves the model.
    let serve = serve_with_deadline(1, 15);
    let backend = BackendLoad::of(&serve);
    let began = Instant::now();
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"fake_slow_ms=30000"}]}"#,
    );
    assert_eq!(status, 504, "{body}");
    assert!(began.elapsed() < SECS(5), "took {:?}", began.elapsed());
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error", "{body}");
    assert!(
        backend.stops_within(SECS(3)),
        "the backend went on generating after the deadline"
    );
    assert_eq!(generation_deadlines(&serve), Some(1.0));
}

/// A long prefill that keep-alive comments began a stream for (the early stream): the
/// deadline is its last event.
fn an_early_stream_ends_with_one_error_event(chunked_body: bool) {
    let serve = serve_with_deadline(3, 1);
    let backend = BackendLoad::of(&serve);
    let (status, reply, took) = streamed_chat(&serve, "fake_slow_ms=30000", chunked_body);
    assert_eq!(status, 200, "{reply}");
    assert!(took < SECS(7), "took {took:?}");
    assert!(reply.contains(": keep-alive"), "{reply}");
    ended_by_the_deadline(&serve, &backend, &reply, engine(chunked_body));
}

#[test]
fn an_early_stream_on_the_fast_engine_ends_with_one_error_event() {
    an_early_stream_ends_with_one_error_event(false);
}

#[test]
fn an_early_stream_on_the_general_engine_ends_with_one_error_event() {
    an_early_stream_ends_with_one_error_event(true);
}

#[test]
fn a_request_that_is_not_a_generation_is_never_bounded() {
    let serve = serve_with_deadline(1, 15);
    for chunked_body in [false, true] {
        let request = raw_json_post(
            serve.port,
            "/tokenize",
            r#"{"content":"fake_slow_ms=2500"}"#,
            chunked_body,
        );
        let (status, reply) = raw(serve.port, &request, SECS(30));
        assert_eq!(
            status,
            200,
            "on the {} engine: {reply}",
            engine(chunked_body)
        );
        assert!(reply.contains(r#""tokens":["#), "{reply}");
    }
    // A stream within its deadline ends as it would without one.
    let (status, reply, _) = {
        let dir = temp_dir("deadline-short");
        let model = dummy_model(&dir, "m.gguf");
        let short = Serve::with_fake(&model, &["--max-generation-s", "30"], &[]);
        short.ready();
        streamed_chat(&short, "short", false)
    };
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("data: [DONE]"), "{reply}");
    assert_eq!(generation_deadlines(&serve), Some(0.0));
}

/// A client that leaves while serve keeps its stream alive over a long prefill: the backend
/// is released at once, not at the next keep-alive comment.
fn a_client_that_leaves_an_early_stream_releases_the_backend_at_once(chunked_body: bool) {
    let dir = temp_dir("early-leave");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &["--sse-keepalive-s", "3"], &[]);
    serve.ready();
    let backend = BackendLoad::of(&serve);
    let body = r#"{"stream":true,"messages":[{"role":"user","content":"fake_slow_ms=60000"}]}"#;
    let request = raw_json_post(serve.port, "/v1/chat/completions", body, chunked_body);
    {
        let mut tcp = std::net::TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
        tcp.write_all(&request).unwrap();
        let mut reader = BufReader::new(tcp.try_clone().unwrap());
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 && !line.starts_with(": keep-alive") {
            line.clear();
        }
        assert!(line.starts_with(": keep-alive"), "the early stream began");
        assert!(backend.generating() >= 1.0, "the prefill is running");
    }
    // The next comment is 3 s away: the backend must be released well before it.
    assert!(
        backend.stops_within(Duration::from_millis(1500)),
        "the backend's prefill went on after the client left, on the {} engine",
        engine(chunked_body)
    );
}

#[test]
fn a_client_that_leaves_an_early_stream_on_the_fast_engine_releases_the_backend_at_once() {
    a_client_that_leaves_an_early_stream_releases_the_backend_at_once(false);
}

#[test]
fn a_client_that_leaves_an_early_stream_on_the_general_engine_releases_the_backend_at_once() {
    a_client_that_leaves_an_early_stream_releases_the_backend_at_once(true);
}

/// The README's chat (not streamed, its reply named as serve serves the model) is carried by
/// the fast engine, which bounds it as it does a stream: a 504 at the deadline.
#[test]
fn the_readme_chat_is_named_on_the_fast_engine_and_bounded_there() {
    let serve = serve_with_deadline(1, 15);
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"What is the capital of France?"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model"], "m", "the served name: {body}");
    let backend = BackendLoad::of(&serve);
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"fake_slow_ms=30000"}]}"#,
    );
    assert_eq!(status, 504, "{body}");
    assert!(backend.stops_within(SECS(3)));
    assert_eq!(
        requests_total(&serve, &[("engine", "fast"), ("path_class", "chat")]),
        2,
        "both chats should have been carried by the fast engine"
    );
    assert_eq!(generation_deadlines(&serve), Some(1.0));
}
