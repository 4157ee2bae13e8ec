//! What the relay reads from a prepared request's reply (where llama-server began its
//! prefill) and what it says in it of a prefix that came from the disk (`timings.cache`).

use super::*;

/// A prepared request's reply, as the relay passes it: the count of prompt tokens llama-server
/// reused is read from it (its `timings.cache_n`, for the save to judge what is exact), and a
/// prefix restored from the disk is noted in it.
#[derive(Clone, Debug)]
pub struct ReplyWatch {
    pub(super) restored: Option<Restored>,
    pub(super) reused: Arc<AtomicUsize>,
}

/// A whole reply, or the event of a stream that carries `timings` (its last): `cache_n` read,
/// and where the prefix came from the disk, `timings.cache` says so (how many tokens, the
/// restore's time), beside llama-server's `cache_n` and
/// `usage.prompt_tokens_details.cached_tokens`, which count them as reused. A reply that is
/// not a JSON object is returned as it is.
pub fn noted_in_reply(reply: Bytes, watch: &ReplyWatch) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<Value>(&reply) else {
        return reply;
    };
    if let Some(reused) = value["timings"]["cache_n"].as_u64() {
        watch.reused.store(reused as usize, Ordering::Relaxed);
    }
    match &watch.restored {
        Some(restored) if note(&mut value, restored) => {
            serde_json::to_vec(&value).map(Bytes::from).unwrap_or(reply)
        }
        _ => reply,
    }
}

/// Put the disk cache's note into one reply object (a whole reply, or a stream's event that
/// carries `timings`); false when it has no `timings`.
pub(super) fn note(value: &mut Value, restored: &Restored) -> bool {
    let Some(timings) = value.get_mut("timings").and_then(Value::as_object_mut) else {
        return false;
    };
    timings.insert(
        "cache".to_string(),
        serde_json::json!({
            "source": "disk",
            "n": restored.n_tokens,
            "restore_ms": (restored.restore_ms * 1000.0).round() / 1000.0,
        }),
    );
    true
}
