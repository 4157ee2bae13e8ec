//! A request right after a stream: llama-server closes its connection after every streamed
//! reply without saying so, and a request sent on that connection before its FIN arrives meets
//! a close serve cannot answer but with a 502. The fake holds that FIN back
//! (`FAKE_CLOSE_AFTER_STREAM_MS`), so a pool that kept the connection fails every time; on both
//! relay engines the request must get its reply.

use std::time::{Duration, Instant};

use onebit_tests::*;

/// How long the fake keeps a connection open, reading nothing, after its stream ended: far
/// longer than serve takes to relay the next request, so a kept connection is always met.
const CLOSE_AFTER_MS: u64 = 500;

fn a_request_right_after_a_stream_is_answered(chunked_body: bool) {
    let engine = if chunked_body { "general" } else { "fast" };
    let dir = temp_dir("stream-close");
    let model = dummy_model(&dir, "m.gguf");
    let after = CLOSE_AFTER_MS.to_string();
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_CLOSE_AFTER_STREAM_MS", &after),
            ("FAKE_SSE_INTERVAL_MS", "0"),
        ],
    );
    serve.ready();
    let limit = Duration::from_secs(30);

    let stream = r#"{"stream":true,"messages":[{"role":"user","content":"one"}]}"#;
    let stream = raw_json_post(serve.port, "/v1/chat/completions", stream, chunked_body);
    let (status, streamed) = raw(serve.port, &stream, limit);
    let ended = Instant::now();
    assert_eq!(
        status, 200,
        "the stream, on the {engine} engine: {streamed}"
    );
    assert!(streamed.contains("data: [DONE]"), "{streamed}");
    // The stream's backend connection goes back to a pool (if it does) as its last bytes are
    // relayed; a moment's pause makes sure the next request finds it there.
    std::thread::sleep(Duration::from_millis(20));

    let sent_within = ended.elapsed();
    let whole = raw_json_post(
        serve.port,
        "/tokenize",
        r#"{"content":"hello world"}"#,
        chunked_body,
    );
    let (status, whole) = raw(serve.port, &whole, limit);
    let answered_within = ended.elapsed();
    assert!(
        sent_within < Duration::from_millis(CLOSE_AFTER_MS),
        "the request left {sent_within:?} after the stream: outside the fake's window, so it \
         tested nothing"
    );
    assert_eq!(
        status,
        200,
        "the request right after a stream, on the {engine} engine, answered {answered_within:?} \
         after it: {whole}\nserve's output:\n{}",
        serve.output()
    );
    assert!(whole.contains(r#""tokens":["#), "{whole}");

    let carried = |e| {
        let count = |class| requests_total(&serve, &[("path_class", class), ("engine", e)]);
        (count("chat"), count("other"))
    };
    let (on_it, on_the_other) = if chunked_body {
        (carried("general"), carried("fast"))
    } else {
        (carried("fast"), carried("general"))
    };
    assert_eq!(
        (on_it, on_the_other),
        ((1, 1), (0, 0)),
        "the stream and the request should both have gone to the {engine} engine"
    );
}

#[test]
fn a_request_right_after_a_stream_is_answered_on_the_fast_engine() {
    a_request_right_after_a_stream_is_answered(false);
}

#[test]
fn a_request_right_after_a_stream_is_answered_on_the_general_engine() {
    a_request_right_after_a_stream_is_answered(true);
}
