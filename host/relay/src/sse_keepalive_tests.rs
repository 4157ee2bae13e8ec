use super::*;

#[test]
fn a_comment_may_go_only_between_events_and_between_chunks() {
    let mut edge = SseEdge::new(Framing::Payload, &Counters::default());
    assert!(edge.at_boundary(), "before any event");
    edge.feed(b"data: {\"a\":1}\n");
    assert!(!edge.at_boundary(), "inside an event");
    edge.feed(b"\n");
    assert!(edge.at_boundary());
    edge.feed(b"data: x\r\n\r\n");
    assert!(edge.at_boundary());

    let mut chunked = SseEdge::new(Framing::Chunked, &Counters::default());
    assert!(chunked.at_boundary());
    // One event split over two chunks, then fed in odd pieces.
    let raw = b"8\r\ndata: ab\r\n3\r\nc\n\n\r\n";
    chunked.feed(&raw[..5]);
    assert!(!chunked.at_boundary(), "inside a chunk");
    chunked.feed(&raw[5..15]);
    assert!(!chunked.at_boundary(), "between chunks, inside an event");
    chunked.feed(&raw[15..raw.len() - 1]);
    assert!(!chunked.at_boundary(), "the chunk's CRLF is not all there");
    chunked.feed(&raw[raw.len() - 1..]);
    assert!(chunked.at_boundary());
    assert_eq!(chunked.comment(), COMMENT_CHUNK);
    chunked.feed(b"0\r\n\r\n");
    assert!(!chunked.at_boundary(), "after the last chunk");
}
