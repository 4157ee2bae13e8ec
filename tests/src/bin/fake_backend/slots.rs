//! The one slot: `GET /slots`, and `POST /slots/<id>?action=save|restore|erase` with real files in
//! llama.cpp's sequence-state layout (header and token list, no KV data).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::app::{ErrorKind, State, error, hang};

/// `LLAMA_STATE_SEQ_MAGIC` ('ggsq') and `LLAMA_STATE_SEQ_VERSION`.
const SEQ_MAGIC: u32 = 0x6767_7371;
const SEQ_VERSION: u32 = 4;
/// The marker and version of llama-server's packed token list (`server_tokens`, text only).
const PACKED_MARKER: i32 = -1;
const PACKED_VERSION: i32 = 1;

/// What the slot holds: the tokens of its last prompt and reply, and the last task's counts.
#[derive(Default)]
pub struct Slot {
    pub tokens: Vec<u32>,
    pub id_task: Option<u64>,
    pub n_prompt_tokens: usize,
    pub n_prompt_tokens_cache: usize,
    pub n_prompt_tokens_processed: usize,
}

impl Slot {
    /// Starts a task on a prompt: with `cache_prompt`, the common prefix with what the slot holds
    /// is reused (at least one token is always evaluated again, as in llama-server). Returns the
    /// number of cached tokens.
    pub fn start(&mut self, id_task: u64, prompt: &[u32], cache_prompt: bool) -> usize {
        let common = if cache_prompt {
            self.tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(prompt.len().saturating_sub(1))
        } else {
            0
        };
        self.tokens.clear();
        self.tokens.extend_from_slice(prompt);
        self.id_task = Some(id_task);
        self.n_prompt_tokens = prompt.len();
        self.n_prompt_tokens_cache = common;
        self.n_prompt_tokens_processed = prompt.len() - common;
        common
    }
}

/// `GET /slots` (`?fail_on_no_slot=1` gives 503 while the slot is busy).
pub async fn list(st: &State, query: Option<&str>) -> Response {
    if !st.cfg.slots_endpoint {
        return error(
            ErrorKind::NotSupported,
            "This server does not support slots endpoint. Start it with `--slots`",
        );
    }
    if st.hung.load(Ordering::Acquire) {
        return hang().await;
    }
    let processing = st.processing.load(Ordering::Relaxed) > 0;
    if processing && matches!(query_param(query, "fail_on_no_slot"), Some("1" | "true")) {
        return error(ErrorKind::Unavailable, "no slot available");
    }
    let mut slot_json = json!({
        "id": 0,
        "n_ctx": st.cfg.n_ctx,
        "speculative": false,
        "is_processing": processing,
    });
    let slot = st.slot.lock().unwrap_or_else(|p| p.into_inner());
    if let (Some(id_task), Value::Object(obj)) = (slot.id_task, &mut slot_json) {
        obj.insert("id_task".into(), json!(id_task));
        obj.insert("n_prompt_tokens".into(), json!(slot.n_prompt_tokens));
        obj.insert(
            "n_prompt_tokens_cache".into(),
            json!(slot.n_prompt_tokens_cache),
        );
        obj.insert(
            "n_prompt_tokens_processed".into(),
            json!(slot.n_prompt_tokens_processed),
        );
        obj.insert(
            "next_token".into(),
            json!([{"has_next_token": processing, "has_new_line": false, "n_remain": -1, "n_decoded": 0}]),
        );
    }
    drop(slot);
    // With `FAKE_SLOTS`, one entry a slot: as many processing as there are generations.
    let busy = st.processing.load(Ordering::Relaxed);
    let mut list = vec![slot_json];
    for id in 1..st.total_slots() {
        list.push(json!({
            "id": id,
            "n_ctx": st.cfg.n_ctx,
            "speculative": false,
            "is_processing": id < busy,
        }));
    }
    axum::Json(Value::Array(list)).into_response()
}

/// `POST /slots/<id>?action=...`. The id is taken modulo the one slot, as llama-server does.
pub async fn action(st: &Arc<State>, id: &str, query: Option<&str>, body: &Bytes) -> Response {
    let Some(dir) = &st.cfg.slot_save_path else {
        return error(
            ErrorKind::NotSupported,
            "This server does not support slots action. Start it with `--slot-save-path`",
        );
    };
    if id.parse::<i32>().is_err() {
        return error(ErrorKind::InvalidRequest, "Invalid slot ID");
    }
    let action = query_param(query, "action").unwrap_or("");
    if !matches!(action, "save" | "restore" | "erase") {
        return error(ErrorKind::InvalidRequest, "Invalid action");
    }
    let filename = if action == "erase" {
        String::new()
    } else {
        let name = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v.get("filename").and_then(Value::as_str).map(str::to_owned));
        match name {
            Some(n) if valid_filename(&n) => n,
            _ => return error(ErrorKind::InvalidRequest, "Invalid filename"),
        }
    };
    // The action is a task for the main loop, which a `fake_hang` has wedged.
    if st.hung.load(Ordering::Acquire) {
        return hang().await;
    }
    let started = Instant::now();
    let elapsed_ms = || started.elapsed().as_secs_f64() * 1e3;
    match action {
        "save" => {
            let tokens = st
                .slot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .tokens
                .clone();
            let bytes = encode(&tokens);
            let n_written = bytes.len();
            let path = dir.join(&filename);
            let result = blocking(move || std::fs::write(path, bytes)).await;
            if let Err(e) = result {
                log!("fake-backend: slot save to '{filename}' failed: {e}");
                return error(ErrorKind::Server, &format!("Unable to save slot: {e}"));
            }
            axum::Json(json!({
                "id_slot": 0,
                "filename": filename,
                "n_saved": tokens.len(),
                "n_written": n_written,
                "timings": {"save_ms": elapsed_ms()},
            }))
            .into_response()
        }
        "restore" => {
            let path = dir.join(&filename);
            let restored = match blocking(move || std::fs::read(path)).await {
                Ok(data) => decode(&data, st.cfg.n_ctx).map(|tokens| (tokens, data.len())),
                Err(e) => Err(format!("cannot read '{filename}': {e}")),
            };
            let (tokens, n_read) = match restored {
                Ok(ok) => ok,
                Err(reason) => {
                    log!("fake-backend: slot restore from '{filename}' failed: {reason}");
                    return error(
                        ErrorKind::InvalidRequest,
                        &format!("Unable to restore slot: {reason}"),
                    );
                }
            };
            let n_restored = tokens.len();
            st.slot.lock().unwrap_or_else(|p| p.into_inner()).tokens = tokens;
            axum::Json(json!({
                "id_slot": 0,
                "filename": filename,
                "n_restored": n_restored,
                "n_read": n_read,
                "timings": {"restore_ms": elapsed_ms()},
            }))
            .into_response()
        }
        _ => {
            let mut slot = st.slot.lock().unwrap_or_else(|p| p.into_inner());
            let n_erased = slot.tokens.len();
            slot.tokens.clear();
            drop(slot);
            axum::Json(json!({"id_slot": 0, "n_erased": n_erased})).into_response()
        }
    }
}

/// Runs file I/O on tokio's blocking pool so no runtime worker waits on the disk.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// A plain file name: no separators, no `..`, not empty, not hidden-dot tricks.
fn valid_filename(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && !name.contains("..")
        && !name.contains(['/', '\\', ':', '\0'])
        && name.trim() == name
}

fn query_param<'q>(query: Option<&'q str>, key: &str) -> Option<&'q str> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}

/// llama-server's file: seq header, then the packed token list (marker, version, n, ids, no media).
/// No memory section follows: the fake has no KV cache to write.
fn encode(tokens: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 * (tokens.len() + 7));
    let n = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
    for word in [SEQ_MAGIC, SEQ_VERSION, n + 4] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.extend_from_slice(&PACKED_MARKER.to_le_bytes());
    out.extend_from_slice(&PACKED_VERSION.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    for &t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&0u32.to_le_bytes());
    out
}

/// Reads the token list of a sequence-state file, packed or plain; whatever follows (a real KV
/// section) is not looked at.
fn decode(data: &[u8], n_ctx: u32) -> Result<Vec<u32>, String> {
    let word = |i: usize| -> Option<u32> {
        let b = data.get(4 * i..4 * i + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let invalid = || "No available space in KV cache or invalid slot save file".to_owned();
    let (magic, version) = (word(0).ok_or_else(invalid)?, word(1).ok_or_else(invalid)?);
    if magic != SEQ_MAGIC || version != SEQ_VERSION {
        return Err(format!(
            "unknown (magic, version) for sequence state file: {magic:08x}, {version:08x}"
        ));
    }
    let count = word(2).ok_or_else(invalid)? as usize;
    let words: Vec<i32> = (0..count)
        .map(|i| word(3 + i).map(|w| w as i32))
        .collect::<Option<_>>()
        .ok_or_else(invalid)?;
    let ids: &[i32] = match words.first() {
        Some(&PACKED_MARKER) => {
            let n = words.get(2).copied().ok_or_else(invalid)?;
            if words.get(1) != Some(&PACKED_VERSION) || n < 0 {
                return Err(invalid());
            }
            let n = n as usize;
            let ids = words.get(3..3 + n).ok_or_else(invalid)?;
            if words.get(3 + n).copied().unwrap_or(0) != 0 {
                return Err("slot file carries media, which fake-backend does not restore".into());
            }
            ids
        }
        _ => &words,
    };
    if ids.len() > n_ctx as usize {
        return Err("Restored prompt does not fit in the slot context".into());
    }
    ids.iter()
        .map(|&id| u32::try_from(id).map_err(|_| invalid()))
        .collect()
}

#[cfg(test)]
#[path = "slots_tests.rs"]
mod tests;
