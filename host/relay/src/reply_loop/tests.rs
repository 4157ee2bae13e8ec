use super::*;
use crate::deadline::Deadline;

/// Settings whose keep-alive silence is `every` (zero: every wake-up is a silence).
fn settings(every: Option<Duration>) -> Arc<ReplySettings> {
    Arc::new(ReplySettings {
        served_name: "served".into(),
        device: "cpu".into(),
        keepalive: every,
        counters: Counters::default(),
    })
}

/// The phases of a streamed generation with keep-alive comments at every wake-up.
fn streamed() -> ReplyPhases {
    let asks = Asks {
        silences: true,
        name_whole: false,
        rename_events: false,
        shape: ReplyShape::OpenAi,
    };
    ReplyPhases::asked(&settings(Some(Duration::ZERO)), asks, None)
}

/// The phases of a whole reply the phases name, under `deadline`.
fn whole(deadline: Option<Deadline>) -> ReplyPhases {
    let asks = Asks {
        silences: false,
        name_whole: true,
        rename_events: false,
        shape: ReplyShape::OpenAi,
    };
    ReplyPhases::asked(&settings(Some(Duration::ZERO)), asks, deadline)
}

fn passed(deadline_after: Duration) -> Deadline {
    Deadline::new(deadline_after, &Counters::default())
}

fn text(event: Vec<u8>) -> String {
    String::from_utf8(event).unwrap()
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
    let event = text(error_event(502, b"no answer"));
    assert!(event.starts_with("data: {\"error\":{"), "{event}");
    assert!(event.contains("\"type\":\"backend_error\""), "{event}");
}

#[test]
fn a_silent_head_begins_the_early_stream_then_comments_go_only_between_events() {
    let mut s = streamed();
    assert!(
        s.wake_at().is_some(),
        "a streamed generation wakes for silences"
    );
    assert!(matches!(s.woke(), Say::Early), "serve's own head");
    assert!(s.early());
    assert!(matches!(s.woke(), Say::Comment), "the head is still due");
    assert!(
        matches!(s.head(200, b"text/event-stream"), Say::Nothing),
        "sent already"
    );
    assert!(matches!(s.payload(b"data: {\"a\""), Say::Pass));
    assert!(matches!(s.woke(), Say::Nothing), "inside an event");
    assert!(matches!(s.payload(b":1}\n\n"), Say::Pass));
    assert!(matches!(s.woke(), Say::Comment), "at a boundary");
    assert!(matches!(s.payload(b""), Say::Nothing));
    assert!(matches!(s.end(), Say::End(rest) if rest.is_empty()));
    assert!(s.over());
    assert!(s.wake_at().is_none(), "nothing to wake for once over");
    assert!(matches!(s.end(), Say::Nothing), "ended once");
}

#[test]
fn a_stream_whose_head_came_in_time_passes_with_comments_in_its_silences() {
    let mut s = streamed();
    assert!(matches!(s.head(200, b"text/event-stream"), Say::Head));
    assert!(!s.early());
    assert!(matches!(s.woke(), Say::Comment), "no event begun yet");
    assert!(matches!(s.payload(b"data: 1\n"), Say::Pass));
    assert!(matches!(s.woke(), Say::Nothing), "inside an event");
}

#[test]
fn a_refusal_is_one_error_event_with_the_backends_error_even_when_its_body_breaks() {
    let body = br#"{"error":{"code":400,"message":"too long","type":"invalid_request_error"}}"#;
    let mut s = streamed();
    let _ = s.woke();
    s.head(400, b"application/json");
    assert!(
        matches!(s.payload(&body[..20]), Say::Nothing),
        "kept, not passed"
    );
    assert!(
        matches!(s.woke(), Say::Nothing),
        "no comment inside a refusal"
    );
    assert!(matches!(s.payload(&body[20..]), Say::Nothing));
    assert!(
        matches!(s.end(), Say::Last(event) if event == error_event(400, body)),
        "the backend's own error object"
    );

    let mut s = streamed();
    let _ = s.woke();
    s.head(503, b"text/plain");
    s.payload(b"busy");
    let Say::Last(event) = s.broke("reset") else {
        panic!("a broken refusal still says its error")
    };
    let event = text(event);
    assert!(event.contains("\"message\":\"busy\""), "{event}");
    assert!(event.contains("\"code\":503"), "{event}");
}

#[test]
fn a_refusal_keeps_at_most_its_limit() {
    let mut s = streamed();
    let _ = s.woke();
    s.head(500, b"text/plain");
    s.payload(&vec![b'x'; ERROR_BODY_LIMIT - 10]);
    s.payload(&[b'z'; 100]);
    let Say::Last(event) = s.end() else {
        panic!("an error event")
    };
    assert_eq!(text(event).matches('z').count(), 10, "cut at the limit");
}

#[test]
fn a_backend_that_never_answers_is_a_502_refusal_or_event_naming_the_route() {
    let mut s = streamed();
    let Say::Refuse(error) = s.broke("connection refused") else {
        panic!("nothing sent yet: an error reply")
    };
    assert_eq!(error.status().as_u16(), 502);

    let mut s = streamed();
    let _ = s.woke();
    let Say::Last(event) = s.broke("connection reset") else {
        panic!("an error event")
    };
    let event = text(event);
    assert!(
        event.contains("the cpu backend did not answer (connection reset)"),
        "{event}"
    );
    assert!(event.contains("\"code\":502"), "{event}");
    assert!(matches!(s.end(), Say::Nothing), "over");

    let mut s = streamed();
    let _ = s.woke();
    assert!(matches!(s.end(), Say::Last(_)), "closed before a head");
}

#[test]
fn a_stream_that_breaks_off_is_cut_not_ended() {
    let mut s = streamed();
    s.head(200, b"text/event-stream");
    s.payload(b"data: x\n\n");
    assert!(matches!(s.broke("reset"), Say::Cut));
    assert!(matches!(s.broke("late"), Say::Nothing), "over: said once");
}

#[test]
fn a_whole_reply_is_collected_and_named_once_it_ends() {
    let mut s = whole(None);
    assert!(
        s.wake_at().is_none(),
        "no silences, no deadline: nothing to wake for"
    );
    assert!(
        matches!(s.head(200, b"application/json"), Say::Nothing),
        "held"
    );
    assert!(matches!(s.payload(br#"{"model":"backend-"#), Say::Nothing));
    assert!(matches!(s.payload(br#"name","x":1}"#), Say::Nothing));
    let Say::Whole(named) = s.end() else {
        panic!("the whole reply")
    };
    let named: serde_json::Value = serde_json::from_slice(&named).unwrap();
    assert_eq!(named["model"], "served");
    assert_eq!(named["x"], 1);

    let mut s = whole(None);
    s.head(200, b"application/json");
    s.payload(b"{\"model\"");
    assert!(
        matches!(s.broke("reset"), Say::Refuse(e) if e.status().as_u16() == 502),
        "a whole reply broken off is a 502: nothing was sent"
    );

    let mut s = whole(None);
    assert!(
        matches!(s.head(400, b"text/plain"), Say::Head),
        "only JSON is named: anything else passes"
    );
}

#[test]
fn each_event_of_a_renamed_stream_is_named_and_a_partial_one_waits() {
    let asks = Asks {
        silences: true,
        name_whole: false,
        rename_events: true,
        shape: ReplyShape::OpenAi,
    };
    let mut s = ReplyPhases::asked(&settings(None), asks, None);
    assert!(matches!(s.head(200, b"text/event-stream"), Say::Head));
    assert!(
        s.rewrites(),
        "the lengths change: the driver frames in chunks"
    );
    assert!(
        matches!(s.payload(b"data: {\"model\":\"m\""), Say::Nothing),
        "a partial line waits"
    );
    let Say::Send(out) = s.payload(b"}\n\ndata: [DONE]") else {
        panic!("the named event")
    };
    assert_eq!(&out[..], b"data: {\"model\":\"served\"}\n\n");
    assert!(matches!(s.end(), Say::End(rest) if &rest[..] == b"data: [DONE]"));
}

#[test]
fn the_deadline_ends_the_reply_in_the_shape_its_progress_allows() {
    // Before any byte: 504.
    let mut s = whole(Some(passed(Duration::ZERO)));
    assert!(s.wake_at().is_some());
    let Say::Refuse(error) = s.woke() else {
        panic!("a 504")
    };
    assert_eq!(error.status().as_u16(), 504);
    assert!(s.over());
    assert!(s.wake_at().is_none(), "ended once");

    // A whole reply being collected: still nothing sent, so 504.
    let mut s = whole(Some(passed(Duration::ZERO)));
    s.head(200, b"application/json");
    s.payload(b"{");
    assert!(matches!(s.woke(), Say::Refuse(e) if e.status().as_u16() == 504));

    // A stream between events: one last error event naming the limit.
    let asks = Asks {
        silences: true,
        name_whole: false,
        rename_events: false,
        shape: ReplyShape::OpenAi,
    };
    let mut s = ReplyPhases::asked(&settings(None), asks, Some(passed(Duration::ZERO)));
    s.head(200, b"text/event-stream");
    s.payload(b"data: 1\n\n");
    let Say::Last(event) = s.woke() else {
        panic!("the last event")
    };
    let event = text(event);
    assert!(event.contains("--max-generation-s"), "{event}");
    assert!(
        event.contains("\"code\":504") || event.contains("504"),
        "{event}"
    );

    // Inside an event: cut, never half an event and an error.
    let mut s = ReplyPhases::asked(&settings(None), asks, Some(passed(Duration::ZERO)));
    s.head(200, b"text/event-stream");
    s.payload(b"data: 1");
    assert!(matches!(s.woke(), Say::Cut));

    // The early stream: its last event.
    let mut s = ReplyPhases::asked(
        &settings(Some(Duration::ZERO)),
        asks,
        Some(passed(Duration::from_secs(3600))),
    );
    assert!(matches!(s.woke(), Say::Early));
    s.deadline = Some(passed(Duration::ZERO));
    assert!(matches!(s.woke(), Say::Last(_)));
}

#[test]
fn a_deadline_not_yet_due_changes_nothing() {
    let mut s = whole(Some(passed(Duration::from_secs(3600))));
    assert!(matches!(s.woke(), Say::Nothing), "not due");
    s.head(200, b"application/json");
    s.payload(b"{}");
    assert!(matches!(s.end(), Say::Whole(_)));
    assert!(
        s.wake_at().is_none(),
        "over: the deadline no longer matters"
    );
}
