//! The early stream: a streamed inference reply that serve begins itself, 200 and
//! `text/event-stream`, because its backend has been silent for `--sse-keepalive-s` before its
//! head. What such a reply says next is decided here, once, without I/O: both engines feed
//! [`EarlyStream`] what happened (a silence, the backend's head, its event bytes, its end or
//! break) and do what it answers ([`Say`]). The fast engine frames what it sends as chunks;
//! the general engine hands it to hyper as frames.
//!
//! The rules: a comment at the start and after every silence while the head is due; then, on
//! a 200, the backend's events as they come, with a comment in a silence only at an event
//! boundary; on any other status its body kept (up to [`ERROR_BODY_LIMIT`]) and said as one
//! error event at its end; a backend that does not answer at all is one 502 error event. A
//! 200 body that breaks off ends the reply without its last chunk, so no client reads a cut
//! stream as finished.

use crate::sse_keepalive::{Framing, SseEdge};
use onebit_metrics::Counters;

/// Bytes of a non-200 reply kept for its error event (Lemonade keeps as much).
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// The one event a stream already answered 200 ends with when its backend then refuses it
/// with `status` (Lemonade sends the same): `data: {"error":…}` with the backend's own error
/// object when it sent one; no `[DONE]`.
pub fn error_event(status: u16, body: &[u8]) -> Vec<u8> {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let error = match parsed.as_ref().and_then(|v| v.get("error")) {
        Some(e) if e.is_object() => e.clone(),
        _ => serde_json::json!({
            "message": String::from_utf8_lossy(body).trim(),
            "type": "backend_error",
            "code": status,
        }),
    };
    format!("data: {}\n\n", serde_json::json!({ "error": error })).into_bytes()
}

/// What the engine does next with the client's reply.
#[derive(Debug, PartialEq, Eq)]
pub enum Say {
    /// Nothing now.
    Nothing,
    /// Send the bytes just fed, as they are.
    Pass,
    /// Send a `: keep-alive` comment (already counted).
    Comment,
    /// Send this last event, then end the reply whole.
    Last(Vec<u8>),
    /// End the reply whole.
    End,
    /// End the reply without its last chunk: the stream was cut.
    Cut,
}

/// Where the reply stands.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// The backend's head is still due.
    Waiting,
    /// The backend answered 200: its events pass.
    Relaying,
    /// The backend answered this other status: its body is kept for the error event.
    Refused(u16),
    /// The reply is over.
    Over,
}

/// One early stream's state. Made when its first silence ends the wait for the head.
#[derive(Debug)]
pub struct EarlyStream {
    phase: Phase,
    /// Where the events relayed so far stand (the bytes fed are the events themselves).
    edge: SseEdge,
    kept: Vec<u8>,
    /// The route's name, for the line of a backend that does not answer.
    device: String,
}

impl EarlyStream {
    /// The stream begun: the engine sends its reply head, then a comment (counted here).
    pub fn begin(device: &str, sent: &Counters) -> (Self, Say) {
        let stream = EarlyStream {
            phase: Phase::Waiting,
            edge: SseEdge::new(Framing::Payload, sent),
            kept: Vec::new(),
            device: device.to_string(),
        };
        stream.edge.count_comment();
        (stream, Say::Comment)
    }

    /// Another silence of `--sse-keepalive-s`.
    pub fn silence(&mut self) -> Say {
        let comment = match self.phase {
            Phase::Waiting => true,
            Phase::Relaying => self.edge.at_boundary(),
            Phase::Refused(_) | Phase::Over => false,
        };
        if comment {
            self.edge.count_comment();
            Say::Comment
        } else {
            Say::Nothing
        }
    }

    /// The backend's head arrived with this status.
    pub fn head(&mut self, status: u16) {
        if self.phase == Phase::Waiting {
            self.phase = if status == 200 {
                Phase::Relaying
            } else {
                Phase::Refused(status)
            };
        }
    }

    /// The backend gave no head: the connection failed, or closed, before one (`why`).
    pub fn no_head(&mut self, why: &str) -> Say {
        if self.phase != Phase::Waiting {
            return self.broke();
        }
        self.phase = Phase::Over;
        let line = format!("the {} backend did not answer ({why})", self.device);
        Say::Last(error_event(502, line.as_bytes()))
    }

    /// Event bytes of the backend's body (its chunked coding, if any, undone).
    pub fn payload(&mut self, bytes: &[u8]) -> Say {
        match self.phase {
            Phase::Relaying => {
                self.edge.feed(bytes);
                if bytes.is_empty() {
                    Say::Nothing
                } else {
                    Say::Pass
                }
            }
            Phase::Refused(_) => {
                let room = ERROR_BODY_LIMIT.saturating_sub(self.kept.len());
                self.kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
                Say::Nothing
            }
            Phase::Waiting | Phase::Over => Say::Nothing,
        }
    }

    /// The backend's body ended whole.
    pub fn end(&mut self) -> Say {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::Relaying => Say::End,
            Phase::Refused(status) => Say::Last(error_event(status, &self.kept)),
            Phase::Waiting => {
                self.phase = Phase::Waiting;
                self.no_head("it closed before its head")
            }
            Phase::Over => Say::Nothing,
        }
    }

    /// The request was ended on serve's side (the generation's deadline, `ending`): `event`
    /// is its last event when the stream stands between events (or has passed none yet), else
    /// the stream is cut.
    pub fn ended(&mut self, event: Vec<u8>) -> Say {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::Relaying if !self.edge.at_boundary() => Say::Cut,
            Phase::Over => Say::Nothing,
            Phase::Relaying | Phase::Waiting | Phase::Refused(_) => Say::Last(event),
        }
    }

    /// The backend's body broke off (a read error, a close mid-body, chunked coding that
    /// breaks). A refusal still says what it kept; a stream of events is cut.
    pub fn broke(&mut self) -> Say {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::Relaying => Say::Cut,
            Phase::Refused(status) => Say::Last(error_event(status, &self.kept)),
            Phase::Waiting => {
                self.phase = Phase::Waiting;
                self.no_head("its connection broke")
            }
            Phase::Over => Say::Nothing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            &crate::sse_keepalive::COMMENT_CHUNK[..1],
            format!("{:x}", crate::sse_keepalive::COMMENT.len()).as_bytes()
        );
    }

    #[test]
    fn comments_go_while_the_head_is_due_then_only_between_events() {
        let (mut s, first) = EarlyStream::begin("cpu", &Counters::default());
        assert_eq!(first, Say::Comment);
        assert_eq!(s.silence(), Say::Comment, "the head is still due");
        s.head(200);
        assert_eq!(s.payload(b"data: {\"a\""), Say::Pass);
        assert_eq!(s.silence(), Say::Nothing, "inside an event");
        assert_eq!(s.payload(b":1}\n\n"), Say::Pass);
        assert_eq!(s.silence(), Say::Comment, "at a boundary");
        assert_eq!(s.payload(b""), Say::Nothing);
        assert_eq!(s.end(), Say::End);
        assert_eq!(s.silence(), Say::Nothing, "over");
        assert_eq!(s.end(), Say::Nothing, "ended once");
    }

    #[test]
    fn a_refusal_is_one_error_event_with_the_backends_error_even_when_its_body_breaks() {
        let body = br#"{"error":{"code":400,"message":"too long","type":"invalid_request_error"}}"#;
        let (mut s, _) = EarlyStream::begin("cpu", &Counters::default());
        s.head(400);
        assert_eq!(s.payload(&body[..20]), Say::Nothing, "kept, not passed");
        assert_eq!(s.silence(), Say::Nothing, "no comment inside a refusal");
        assert_eq!(s.payload(&body[20..]), Say::Nothing);
        assert_eq!(
            s.end(),
            Say::Last(error_event(400, body)),
            "the backend's own error object"
        );

        let (mut s, _) = EarlyStream::begin("cpu", &Counters::default());
        s.head(503);
        s.payload(b"busy");
        let Say::Last(event) = s.broke() else {
            panic!("a broken refusal still says its error")
        };
        let event = String::from_utf8(event).unwrap();
        assert!(event.contains("\"message\":\"busy\""), "{event}");
        assert!(event.contains("\"code\":503"), "{event}");
    }

    #[test]
    fn a_refusal_keeps_at_most_its_limit() {
        let (mut s, _) = EarlyStream::begin("cpu", &Counters::default());
        s.head(500);
        s.payload(&vec![b'x'; ERROR_BODY_LIMIT - 10]);
        s.payload(&[b'z'; 100]);
        let Say::Last(event) = s.end() else {
            panic!("an error event")
        };
        let text = String::from_utf8(event).unwrap();
        assert_eq!(text.matches('z').count(), 10, "cut at the limit");
    }

    #[test]
    fn a_backend_that_never_answers_is_a_502_event_naming_the_route() {
        let (mut s, _) = EarlyStream::begin("hrx", &Counters::default());
        let Say::Last(event) = s.no_head("connection reset") else {
            panic!("an error event")
        };
        let text = String::from_utf8(event).unwrap();
        assert!(
            text.contains("the hrx backend did not answer (connection reset)"),
            "{text}"
        );
        assert!(text.contains("\"code\":502"), "{text}");
        assert_eq!(s.end(), Say::Nothing, "over");

        let (mut s, _) = EarlyStream::begin("cpu", &Counters::default());
        assert!(matches!(s.end(), Say::Last(_)), "closed before a head");
    }

    #[test]
    fn a_stream_that_breaks_off_is_cut_not_ended() {
        let (mut s, _) = EarlyStream::begin("cpu", &Counters::default());
        s.head(200);
        s.payload(b"data: x\n\n");
        assert_eq!(s.broke(), Say::Cut);
        assert_eq!(s.no_head("late"), Say::Nothing, "over: said once");
    }
}
