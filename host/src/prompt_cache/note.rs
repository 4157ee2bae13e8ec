//! What a reply says of a prefix that came from the disk (`timings.cache`).

use super::*;

/// The reply of a request whose prefix came from the disk: `timings.cache` says so (how many
/// tokens, the restore's time), beside llama-server's `cache_n` and
/// `usage.prompt_tokens_details.cached_tokens`, which count them as reused. A reply that is not a JSON
/// object is returned as it is. Called by the general engine on a whole reply.
pub fn noted_in_reply(reply: Bytes, restored: &Restored) -> Bytes {
    let Ok(mut value) = serde_json::from_slice::<Value>(&reply) else {
        return reply;
    };
    if !note(&mut value, restored) {
        return reply;
    }
    serde_json::to_vec(&value).map(Bytes::from).unwrap_or(reply)
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
