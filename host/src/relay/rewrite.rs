//! The rewrites the general engine makes to what it relays: `--precise` in the request body,
//! the served name in a whole JSON reply and in each streamed event.

use bytes::Bytes;

/// Rewrites the `model` field of each SSE `data:` event to the served name, event by event:
/// complete lines go out as they arrive, a partial line waits for the rest of it.
pub struct SseRenamer {
    served: String,
    partial: Vec<u8>,
}

impl SseRenamer {
    pub fn new(served: String) -> Self {
        SseRenamer {
            served,
            partial: Vec::new(),
        }
    }

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
                    let renamed = with_model_name(Bytes::copy_from_slice(body), &self.served);
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

/// The request body with `cache_prompt` false, so the backend reuses no cached prefix.
pub fn without_prompt_cache(body: Bytes) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    match value.as_object_mut() {
        Some(object) => {
            object.insert("cache_prompt".to_string(), serde_json::Value::Bool(false));
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(body)
        }
        None => body,
    }
}

/// Put `served` in a JSON object reply's `model` field; anything else is left as it came.
pub fn with_model_name(bytes: Bytes, served: &str) -> Bytes {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reply_model_becomes_the_served_name_and_other_bytes_pass() {
        let out = with_model_name(Bytes::from_static(br#"{"model":"x.gguf","n":1}"#), "smol");
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["model"], "smol");
        assert_eq!(v["n"], 1);
        let same = Bytes::from_static(br#"{"model":"smol"}"#);
        assert_eq!(with_model_name(same.clone(), "smol"), same);
        let text = Bytes::from_static(b"not json");
        assert_eq!(with_model_name(text.clone(), "smol"), text);
    }

    #[test]
    fn streamed_events_get_the_served_name_even_when_split_across_frames() {
        let mut r = SseRenamer::new("smol".into());
        let first = r.feed(b"data: {\"model\":\"ds4\",\"n\":1}\n\ndata: {\"mo");
        assert_eq!(&first[..], b"data: {\"model\":\"smol\",\"n\":1}\n\n");
        let second = r.feed(b"del\":\"ds4\"}\n\ndata: [DONE]\n\n");
        assert_eq!(
            &second[..],
            b"data: {\"model\":\"smol\"}\n\ndata: [DONE]\n\n"
        );
    }
}
