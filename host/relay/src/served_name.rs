//! The served-name rewrite: a reply or a stream names the model as serve serves it (`--alias`,
//! `served_name`), not as the backend loaded it, in the shape the route's rule says
//! (OpenAI's `model`, Anthropic's `message.model` of its `message_start`). The one renamer of
//! every reply, whatever carries it: the reply's phases (`reply_loop`) call it.

use bytes::Bytes;
use onebit_plugin_api::ReplyShape;

/// The rewrite of one event's JSON that names `served` where `shape` names the model
/// (OpenAI's: every event's `model`; Anthropic's: `message.model` of its `message_start`).
pub fn renamer(served: String, shape: ReplyShape) -> impl Fn(Bytes) -> Bytes + Send + 'static {
    move |body: Bytes| match shape {
        ReplyShape::OpenAi => in_reply(body, &served),
        ReplyShape::Anthropic => with_message_model_name(body, &served),
    }
}

/// The event splitter: each complete `data: {...}` line's JSON goes through `rewrite`
/// (complete lines go out as they arrive, a partial line waits for the rest, and whatever is
/// still waiting when the stream ends goes out as it came, [`SseEvents::rest`]). The one
/// splitter of the reply's phases (`reply_loop`): the served name and the prompt cache's note.
pub struct SseEvents {
    rewrite: Box<dyn FnMut(Bytes) -> Bytes + Send>,
    partial: Vec<u8>,
}

impl SseEvents {
    pub fn new(rewrite: impl FnMut(Bytes) -> Bytes + Send + 'static) -> SseEvents {
        SseEvents {
            rewrite: Box::new(rewrite),
            partial: Vec::new(),
        }
    }

    /// What is still held back when the stream ends, as it came.
    pub fn rest(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.partial))
    }

    /// The complete lines of what came so far, each event rewritten.
    pub fn feed(&mut self, data: &[u8]) -> Bytes {
        self.partial.extend_from_slice(data);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Bytes::new();
        };
        let rest = self.partial.split_off(end + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        let mut out = Vec::with_capacity(complete.len() + 16);
        for line in complete.split_inclusive(|b| *b == b'\n') {
            match line.strip_prefix(b"data: ") {
                Some(json) if json.starts_with(b"{") => {
                    let body = json.strip_suffix(b"\n").unwrap_or(json);
                    let body = body.strip_suffix(b"\r").unwrap_or(body);
                    let body = Bytes::copy_from_slice(body);
                    let renamed = (self.rewrite)(body);
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(&renamed);
                    out.push(b'\n');
                }
                _ => out.extend_from_slice(line),
            }
        }
        Bytes::from(out)
    }
}

/// A whole JSON reply with `served` in its `model` field (OpenAI's shape, and Anthropic's
/// whole message); anything else as it came.
pub fn in_reply(bytes: Bytes, served: &str) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return bytes;
    };
    match value.get_mut("model") {
        Some(serde_json::Value::String(model)) if model != served => {
            *model = served.to_string();
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(bytes)
        }
        _ => bytes,
    }
}

/// Put `served` in the `message.model` of an Anthropic `message_start` event; any other event
/// (no other names the model) is left as it came.
fn with_message_model_name(bytes: Bytes, served: &str) -> Bytes {
    // Most events are deltas: only one that says it starts a message is parsed.
    if !bytes
        .windows(b"message_start".len())
        .any(|w| w == b"message_start")
    {
        return bytes;
    }
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return bytes;
    };
    if value.get("type").and_then(|t| t.as_str()) != Some("message_start") {
        return bytes;
    }
    match value.pointer_mut("/message/model") {
        Some(serde_json::Value::String(model)) if model != served => {
            *model = served.to_string();
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(bytes)
        }
        _ => bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitter(rewrite: impl FnMut(Bytes) -> Bytes + Send + 'static) -> SseEvents {
        SseEvents::new(rewrite)
    }

    /// A body whose last line has no newline (a JSON refusal where events were expected)
    /// reaches its end whole, after the events before it.
    #[test]
    fn what_the_splitter_holds_back_goes_out_when_the_body_ends() {
        let mut r = splitter(renamer("smol".into(), ReplyShape::OpenAi));
        let out = r.feed(b"data: {\"model\":\"ds4\"}\n\n{\"error\":{\"code\":400}}");
        assert_eq!(&out[..], b"data: {\"model\":\"smol\"}\n\n");
        assert_eq!(&r.rest()[..], b"{\"error\":{\"code\":400}}");
        assert!(r.rest().is_empty(), "said once");
    }

    #[test]
    fn the_reply_model_becomes_the_served_name_and_other_bytes_pass() {
        let out = in_reply(Bytes::from_static(br#"{"model":"x.gguf","n":1}"#), "smol");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "smol");
        assert_eq!(v["n"], 1);
        let same = Bytes::from_static(br#"{"model":"smol"}"#);
        assert_eq!(in_reply(same.clone(), "smol"), same);
        let text = Bytes::from_static(b"not json");
        assert_eq!(in_reply(text.clone(), "smol"), text);
    }

    #[test]
    fn streamed_events_get_the_served_name_even_when_split_across_frames() {
        let mut r = splitter(renamer("smol".into(), ReplyShape::OpenAi));
        let first = r.feed(b"data: {\"model\":\"ds4\",\"n\":1}\n\ndata: {\"mo");
        assert_eq!(&first[..], b"data: {\"model\":\"smol\",\"n\":1}\n\n");
        let second = r.feed(b"del\":\"ds4\"}\n\ndata: [DONE]\n\n");
        assert_eq!(
            &second[..],
            b"data: {\"model\":\"smol\"}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn an_anthropic_stream_gets_the_served_name_in_its_message_start() {
        let mut r = splitter(renamer("smol".into(), ReplyShape::Anthropic));
        let start = r.feed(
            b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"model\":\"x.gguf\",\"role\":\"assistant\"}}\n\n",
        );
        let text = String::from_utf8(start.to_vec()).unwrap();
        assert!(text.starts_with("event: message_start\ndata: "), "{text}");
        let data: serde_json::Value =
            serde_json::from_str(text.lines().nth(1).unwrap().strip_prefix("data: ").unwrap())
                .unwrap();
        assert_eq!(data["message"]["model"], "smol");
        // A delta naming no model, or one whose `model` is its own field, passes as it came.
        let delta = b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"model\"},\"model\":\"x\"}\n\n";
        assert_eq!(&r.feed(delta)[..], &delta[..]);
    }
}
