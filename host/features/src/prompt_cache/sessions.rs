//! Agent sessions keep their prefixes: two coding agents at work on one serve (Claude Code's
//! Messages, the Codex CLI's Responses) share most of a long prompt, and llama-server, left
//! to itself, gives one session's next turn the slot another session just used (the most
//! similar prompt it holds), prefilling again all that the two do not share, turn after turn
//! (docs/serve.md, Agent sessions). So when a request's session is not the one the backend
//! served last, serve first has llama-server put what its idle slots hold into its own
//! prompt cache in RAM, and empty them (a one-token task, which its `--cache-idle-slots`
//! default answers so; the task's slot emptied after it); the request then finds no slot to
//! take over and takes its session's own state back from that cache. A session's first
//! request, where the API lets serve name the slot (Responses), goes to an empty slot, so it
//! does not take another session's state from the cache: it is prefilled whole.
//!
//! Called by the relay plan (`RelayPlan::placed`) on the request's task, before forwarding.

use bytes::Bytes;
use serde_json::Value;

use super::{CALL_TIMEOUT, PromptCache};

/// How many sessions serve remembers having seen (the oldest is forgotten first): a session
/// forgotten counts as new again, and its next request is only prefilled whole.
const REMEMBERED: usize = 256;

/// The API a request speaks, which says where its session is and whether serve can name its
/// slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// Anthropic's Messages: the session is Claude Code's `metadata.user_id` (its device and
    /// session ids); llama-server's conversion keeps no `id_slot`, so the slot is its own choice.
    Messages,
    /// OpenAI's Responses: the session is `prompt_cache_key` (the Codex CLI sends its
    /// conversation's id); `id_slot` reaches llama-server.
    Responses,
}

/// What serve remembers of the sessions it relayed.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    /// The session of the last request sent on.
    last: Option<String>,
    /// The sessions seen, oldest first.
    seen: std::collections::VecDeque<String>,
}

/// Whether a body may name a session: a quick look for the member's name, before any parse.
/// Called by the relay plan for every Messages and Responses body.
pub fn may_name_one(api: Api, body: &[u8]) -> bool {
    let needle: &[u8] = match api {
        Api::Messages => b"\"user_id\"",
        Api::Responses => b"\"prompt_cache_key\"",
    };
    body.windows(needle.len()).any(|w| w == needle)
}

/// The session a body names, if any.
fn session_of(api: Api, body: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let key = match api {
        Api::Messages => value["metadata"]["user_id"].as_str()?,
        Api::Responses => value["prompt_cache_key"].as_str()?,
    };
    (!key.is_empty() && value.get("id_slot").is_none()).then(|| key.to_string())
}

impl PromptCache {
    /// Before a Messages or Responses request is sent on: when its session is not the one
    /// the backend served last, llama-server's idle slots are put in its prompt cache and
    /// emptied, and a session's first Responses request is pinned to an empty slot (its
    /// body with `id_slot` first; every other byte as it came). A body naming no session, or
    /// a cache not open, goes as it came. Awaits the backend (a one-token task).
    pub async fn keep_session(&self, api: Api, body: Bytes) -> Bytes {
        let Some(session) = session_of(api, &body) else {
            return body;
        };
        let slots = self.slots.lock().map(|s| s.len()).unwrap_or(0);
        if slots == 0 {
            return body;
        }
        let (switched, new) = {
            let Ok(mut sessions) = self.sessions.lock() else {
                return body;
            };
            let switched = sessions.last.as_ref().is_some_and(|last| *last != session);
            let new = !sessions.seen.contains(&session);
            if new {
                if sessions.seen.len() == REMEMBERED {
                    sessions.seen.pop_front();
                }
                sessions.seen.push_back(session.clone());
            }
            sessions.last = Some(session);
            (switched, new)
        };
        let spare = slots - 1;
        if switched {
            self.idle_slots_to_ram(spare).await;
        }
        if !(new && api == Api::Responses) {
            return body;
        }
        // The first empty idle slot but the one the one-token task used (that one is emptied
        // too, but is the most recently used).
        let Ok(now) = self.get_json("/slots").await else {
            return body;
        };
        let empty = now.as_array().into_iter().flatten().find_map(|s| {
            let id = s["id"].as_u64()? as usize;
            let idle = !s["is_processing"].as_bool().unwrap_or(true);
            let holds = s["n_prompt_tokens"].as_u64().unwrap_or(0);
            (idle && holds == 0 && (id != spare || slots == 1)).then_some(id)
        });
        match empty {
            Some(slot) => pinned(body, slot),
            None => body,
        }
    }

    /// llama-server's idle slots put in its prompt cache in RAM and emptied: a task of one
    /// token on slot `spare` (llama-server saves a slot it gives a dissimilar prompt, and,
    /// with its default `--cache-idle-slots`, every other idle slot as a task starts, then
    /// empties them), then that slot emptied, so the KV holds nothing the next request's
    /// prefill could be laid out beside. A refusal leaves the slots as they were.
    async fn idle_slots_to_ram(&self, spare: usize) {
        let task = serde_json::json!({
            "prompt": "\n", "n_predict": 0, "id_slot": spare, "cache_prompt": false,
        });
        if self
            .post_json("/completion", Bytes::from(task.to_string()), CALL_TIMEOUT)
            .await
            .is_ok()
        {
            let _ = self
                .post_json(
                    &format!("/slots/{spare}?action=erase"),
                    Bytes::new(),
                    CALL_TIMEOUT,
                )
                .await;
            if let Ok(mut slots) = self.slots.lock() {
                for s in slots.iter_mut().filter(|s| s.busy == 0) {
                    s.tokens.clear();
                }
            }
        }
    }
}

/// The body with `"id_slot": slot` as its first member; every other byte as it came.
fn pinned(body: Bytes, slot: usize) -> Bytes {
    let text = &body[..];
    let Some(open) = text.iter().position(|b| !b.is_ascii_whitespace()) else {
        return body;
    };
    if text[open] != b'{' {
        return body;
    }
    let rest = &text[open + 1..];
    let empty = rest
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + 16);
    out.extend_from_slice(&text[..=open]);
    out.extend_from_slice(format!("\"id_slot\":{slot}").as_bytes());
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_claude_codes_user_id_or_a_responses_cache_key() {
        let claude = br#"{"model":"m","metadata":{"user_id":"{\"session_id\":\"s1\"}"}}"#;
        assert!(may_name_one(Api::Messages, claude));
        assert_eq!(
            session_of(Api::Messages, claude).as_deref(),
            Some(r#"{"session_id":"s1"}"#)
        );
        let codex = br#"{"input":[],"prompt_cache_key":"c1"}"#;
        assert!(may_name_one(Api::Responses, codex));
        assert_eq!(session_of(Api::Responses, codex).as_deref(), Some("c1"));
        assert!(!may_name_one(Api::Responses, claude));
        // A client that names its slot itself keeps it.
        assert_eq!(
            session_of(Api::Responses, br#"{"prompt_cache_key":"c1","id_slot":2}"#),
            None
        );
        assert_eq!(
            session_of(Api::Responses, br#"{"prompt_cache_key":""}"#),
            None
        );
    }

    #[test]
    fn pinning_adds_the_slot_first_and_keeps_every_other_byte() {
        let body = Bytes::from_static(br#"  {"b":1, "a" : [2]}"#);
        assert_eq!(&pinned(body, 3)[..], br#"  {"id_slot":3,"b":1, "a" : [2]}"#);
        assert_eq!(
            &pinned(Bytes::from_static(b"{ }"), 0)[..],
            b"{\"id_slot\":0 }"
        );
        assert_eq!(&pinned(Bytes::from_static(b"[1]"), 0)[..], b"[1]");
    }
}
