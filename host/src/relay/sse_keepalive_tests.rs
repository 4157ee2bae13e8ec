use super::*;

#[test]
fn a_comment_may_go_only_between_events_and_between_chunks() {
    let mut edge = SseEdge::new(Framing::Payload);
    assert!(edge.at_boundary(), "before any event");
    edge.feed(b"data: {\"a\":1}\n");
    assert!(!edge.at_boundary(), "inside an event");
    edge.feed(b"\n");
    assert!(edge.at_boundary());
    edge.feed(b"data: x\r\n\r\n");
    assert!(edge.at_boundary());

    let mut chunked = SseEdge::new(Framing::Chunked);
    assert!(chunked.at_boundary());
    // One event split over two chunks, then fed in odd pieces.
    let raw = b"8\r\ndata: ab\r\n3\r\nc\n\n\r\n";
    let mut payload = Vec::new();
    chunked.feed_payload(&raw[..5], &mut payload);
    assert!(!chunked.at_boundary(), "inside a chunk");
    chunked.feed_payload(&raw[5..15], &mut payload);
    assert!(!chunked.at_boundary(), "between chunks, inside an event");
    chunked.feed_payload(&raw[15..raw.len() - 1], &mut payload);
    assert!(!chunked.at_boundary(), "the chunk's CRLF is not all there");
    chunked.feed_payload(&raw[raw.len() - 1..], &mut payload);
    assert!(chunked.at_boundary());
    assert_eq!(payload, b"data: abc\n\n");
    assert_eq!(chunked.comment(), COMMENT_CHUNK);
    chunked.feed(b"0\r\n\r\n");
    assert!(!chunked.at_boundary(), "after the last chunk");
}

#[test]
fn a_refusal_after_the_stream_began_is_one_error_event() {
    let event = error_event(
        400,
        br#"{"error":{"code":400,"message":"too long","type":"invalid_request_error"}}"#,
    );
    assert_eq!(
        event,
        b"data: {\"error\":{\"code\":400,\"message\":\"too long\",\"type\":\"invalid_request_error\"}}\n\n"
    );
    let event = String::from_utf8(error_event(502, b"no answer")).unwrap();
    assert!(event.starts_with("data: {\"error\":{"), "{event}");
    assert!(event.contains("\"type\":\"backend_error\""), "{event}");
    assert_eq!(
        &COMMENT_CHUNK[..1],
        format!("{:x}", COMMENT.len()).as_bytes()
    );
}
