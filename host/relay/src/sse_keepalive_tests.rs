use super::*;

#[test]
fn a_comment_may_go_only_between_events() {
    let mut edge = SseEdge::default();
    assert!(edge.at_boundary(), "before any event");
    edge.feed(b"data: {\"a\":1}\n");
    assert!(!edge.at_boundary(), "inside an event");
    edge.feed(b"\n");
    assert!(edge.at_boundary());
    edge.feed(b"data: x\r\n\r\n");
    assert!(edge.at_boundary());
    edge.feed(b"d");
    edge.feed(b"");
    assert!(!edge.at_boundary(), "one byte of the next event");
}

#[test]
fn the_comment_chunk_is_the_comment_in_one_chunk() {
    let chunk = format!("{:x}\r\n", COMMENT.len()).into_bytes();
    assert_eq!(&COMMENT_CHUNK[..chunk.len()], &chunk[..]);
    assert_eq!(
        &COMMENT_CHUNK[chunk.len()..COMMENT_CHUNK.len() - 2],
        COMMENT
    );
}
