//! serve gives its heap's freed pages back after work (host/supervision/src/heap_trim.rs): a request, and
//! within the trimmer's interval a trim, which `ONEBIT_LOG=debug` shows. What a trim gives
//! back is plugin-api's unit test (heap.rs); what it does to a long run is the soak's
//! (docs/performance.md).

use std::time::Duration;

use onebit_tests::*;

#[test]
fn a_request_is_followed_by_a_trim_of_the_heap() {
    let dir = temp_dir("heap-trim");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[("ONEBIT_LOG", "debug")]);
    serve.ready();
    let (status, _) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(status, 200);
    // The trimmer looks every 5 s; a trim is due at the first look after the request.
    assert!(
        wait_until(Duration::from_secs(12), || serve
            .output()
            .contains("heap trimmed: RssAnon ")),
        "no trim within 12 s of a request; serve said:\n{}",
        serve.output()
    );
}
