//! Claude Code's attribution line, dropped from a request before the engine sees it
//! (`--keep-attribution` keeps it; docs/serve.md, "Claude Code's attribution line").
//!
//! Claude Code puts a text block first in its system prompt, `x-anthropic-billing-header:
//! cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;`, whose version suffix and `cch=` hash
//! are derived from the request, so it changes from turn to turn. An engine that reuses a cached
//! prompt by its prefix (llama-server) then finds nothing in common past the first tokens and
//! prefills the whole prompt again on every turn. The line means nothing to a local model.
//!
//! It reaches serve in three shapes, one per API ([`Place`]): first in a Messages request's
//! `system` (Claude Code itself); first in a chat completion's first message when that is the
//! system's (a gateway that converted the Messages request: Lemonade joins the `system` blocks
//! with a line break into one system message); first in a Responses request's `instructions`.
//!
//! The body is edited in place: only the bytes of the text that began with the line change
//! (the line cut from its front; the block, the message or the member that held nothing else
//! removed, with one comma), every other byte goes as it came, so the engine renders the rest
//! of the request (tools, their schemas' key order) exactly as it would have.

use std::ops::Range;

use bytes::Bytes;
use onebit_plugin_api::ReplyShape;

/// How the line begins.
pub const MARKER: &str = "x-anthropic-billing-header:";

/// Where in a request's body the line would be, by the API the request speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Anthropic's Messages: the start of `system`, a string or its first text block.
    System,
    /// A chat completion: the start of the first message's content (a string, or its first
    /// part when that is text), when that message is the system's (`system` or `developer`:
    /// OpenAI's newer name, which llama-server's templates render as the system's). A system
    /// message after the first, or any other message, is the user's own text.
    FirstSystemMessage,
    /// OpenAI's Responses: the start of `instructions`, a string.
    Instructions,
}

impl Place {
    /// Where the line would be in a request to `path` (no query) whose rule replies in
    /// `reply`'s shape: Anthropic's Messages, a chat completion, a Responses request; None for
    /// any other (a completion's prompt, say, is the client's own text). Called by
    /// [`RelayPlan`] for the head, on the connection's task.
    ///
    /// [`RelayPlan`]: crate::plan::RelayPlan
    pub fn of(path: &str, reply: ReplyShape) -> Option<Place> {
        if reply == ReplyShape::Anthropic {
            return Some(Place::System);
        }
        match path {
            "/v1/chat/completions" | "/chat/completions" => Some(Place::FirstSystemMessage),
            "/v1/responses" | "/responses" => Some(Place::Instructions),
            _ => None,
        }
    }
}

/// Whether a body may hold the line: a cheap look for its first bytes, which [`RelayPlan`]
/// makes from the body before deciding which engine carries the request (a body without them
/// needs no rewrite and may go fast). std's substring search (vectorised for a short needle)
/// reads a 128 KiB chat in about 9 µs, a ninth of a byte-by-byte look for its first letter.
///
/// [`RelayPlan`]: crate::plan::RelayPlan
pub fn may_hold(body: &[u8]) -> bool {
    match std::str::from_utf8(body) {
        Ok(text) => text.contains(MARKER),
        // Not UTF-8 (a JSON body is: `check_body`): the slow way, which never happens.
        Err(_) => String::from_utf8_lossy(body).contains(MARKER),
    }
}

/// Whether a request whose line would be at `place` (None: nowhere, by its path) goes
/// without it: not when the user keeps it (`--keep-attribution`), nor when its body cannot
/// hold it ([`may_hold`]). Called by [`RelayPlan`] with the body, before the engine is chosen
/// (a request that keeps its body as it came may go fast).
///
/// [`RelayPlan`]: crate::plan::RelayPlan
pub fn to_drop(place: Option<Place>, keep: bool, body: &[u8]) -> bool {
    place.is_some() && !keep && may_hold(body)
}

/// The body without the attribution line when the text at `place` begins with it. A string
/// keeps what follows the line; a leading text block or part that is the line alone is
/// removed (one that begins with it keeps the rest of its text). When nothing is left, what
/// held the text goes: `system` or `instructions` altogether, the first message altogether (as
/// a converting gateway sends no system message when there was no system text). Any other body
/// (no such line there, not a JSON object) is returned as it came. Called by the general
/// engine on the connection's task for a plan that says so.
pub fn without_attribution(body: Bytes, place: Place) -> Bytes {
    let Some(Splice { range, with }) = cut(&body, place) else {
        return body;
    };
    let mut out = Vec::with_capacity(body.len());
    out.extend_from_slice(&body[..range.start]);
    out.extend_from_slice(&with);
    out.extend_from_slice(&body[range.end..]);
    Bytes::from(out)
}

/// One edit of the body: the bytes of `range` become `with`.
struct Splice {
    range: Range<usize>,
    with: Vec<u8>,
}

impl Splice {
    fn removing(range: Range<usize>) -> Splice {
        Splice {
            range,
            with: Vec::new(),
        }
    }
}

/// What cutting the line does to a text: an edit, or nothing left of it.
enum Cut {
    Edit(Splice),
    Emptied,
}

/// The edit that drops the line at `place`, or None when there is nothing to drop.
fn cut(body: &[u8], place: Place) -> Option<Splice> {
    let root = skip_ws(body, 0);
    let (text, holder) = match place {
        Place::System => {
            let system = member(body, root, "system")?;
            (system.value, system.cut)
        }
        Place::Instructions => {
            let instructions = member(body, root, "instructions")?;
            if body.get(instructions.value.start) != Some(&b'"') {
                return None;
            }
            (instructions.value, instructions.cut)
        }
        Place::FirstSystemMessage => {
            let messages = member(body, root, "messages")?;
            if body.get(messages.value.start) != Some(&b'[') {
                return None;
            }
            let first = first_element(body, messages.value.start)?;
            let role = member(body, first.start, "role")?;
            if !matches!(
                string_at(body, role.value)?.as_str(),
                "system" | "developer"
            ) {
                return None;
            }
            let content = member(body, first.start, "content")?;
            // The message goes with the comma and space before the next one.
            let holder = match next_element(body, first.end) {
                Some(next) => first.start..next,
                None => first,
            };
            (content.value, holder)
        }
    };
    match cut_text(body, text)? {
        Cut::Edit(splice) => Some(splice),
        Cut::Emptied => Some(Splice::removing(holder)),
    }
}

/// The line cut from a text that is `value`: a string, or a list whose first element is a
/// text block (`{"type":"text","text":...}`, Anthropic's and OpenAI's parts alike).
fn cut_text(body: &[u8], value: Range<usize>) -> Option<Cut> {
    match body.get(value.start)? {
        b'"' => cut_string(body, value, str::is_empty),
        b'[' => {
            let first = first_element(body, value.start)?;
            let kind = member(body, first.start, "type")?;
            if string_at(body, kind.value)? != "text" {
                return None;
            }
            let text = member(body, first.start, "text")?;
            if body.get(text.value.start) != Some(&b'"') {
                return None;
            }
            match cut_string(body, text.value, |rest| rest.trim().is_empty())? {
                // The block goes, with the comma and space before the next one.
                Cut::Emptied => match next_element(body, first.end) {
                    Some(next) => Some(Cut::Edit(Splice::removing(first.start..next))),
                    None => Some(Cut::Emptied),
                },
                edit => Some(edit),
            }
        }
        _ => None,
    }
}

/// The line cut from the JSON string `value` (its rest, written back as a JSON string), or
/// `Emptied` when what is left is `empty`.
fn cut_string(body: &[u8], value: Range<usize>, empty: fn(&str) -> bool) -> Option<Cut> {
    // Most strings are not the line: say so before decoding one.
    if !body.get(value.start + 1..)?.starts_with(MARKER.as_bytes()) {
        return None;
    }
    let text = string_at(body, value.clone())?;
    let rest = after_line(&text)?;
    if empty(rest) {
        return Some(Cut::Emptied);
    }
    Some(Cut::Edit(Splice {
        range: value,
        with: serde_json::to_vec(rest).ok()?,
    }))
}

/// The JSON string at `value`, decoded, or None when it is no string.
fn string_at(body: &[u8], value: Range<usize>) -> Option<String> {
    serde_json::from_slice(&body[value]).ok()
}

/// What follows the attribution line at the start of `text` (one line break after it belongs
/// to it), or None when `text` does not begin with the line. The line is the marker and one or
/// more `key=value;` items (the last `;` may be missing at the end of the line).
fn after_line(text: &str) -> Option<&str> {
    let mut rest = text.strip_prefix(MARKER)?;
    let mut items = 0;
    loop {
        let t = rest.trim_start_matches([' ', '\t']);
        let key = t
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(t.len());
        let Some(after_key) = t[key..].strip_prefix('=').filter(|_| key > 0) else {
            break;
        };
        let end = after_key.find([';', '\n']).unwrap_or(after_key.len());
        rest = match after_key[end..].strip_prefix(';') {
            Some(after) => after,
            None => &after_key[end..],
        };
        items += 1;
    }
    if items == 0 {
        return None;
    }
    let rest = rest.trim_start_matches([' ', '\t']);
    Some(
        rest.strip_prefix("\r\n")
            .or_else(|| rest.strip_prefix('\n'))
            .unwrap_or(rest),
    )
}

/// Where an object's member is: its value, and the bytes that go when the member goes (the
/// key, the value and one comma, before or after it).
struct Member {
    value: Range<usize>,
    cut: Range<usize>,
}

/// The member `name` of the JSON object that opens at `open` (the last one, as a JSON parser
/// keeps), or None (no such member, or no object there).
fn member(body: &[u8], open: usize, name: &str) -> Option<Member> {
    if body.get(open) != Some(&b'{') {
        return None;
    }
    let mut i = open + 1;
    let mut found = None;
    // The end of the previous member (after its value), for the comma before this one.
    let mut previous_end: Option<usize> = None;
    loop {
        i = skip_ws(body, i);
        match body.get(i)? {
            b'}' => return found,
            b',' => {
                i += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_start = i;
        let key_end = skip_value(body, i)?;
        i = skip_ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(body, i + 1);
        let value_end = skip_value(body, value_start)?;
        if is_key(body, key_start..key_end, name) {
            let after = skip_ws(body, value_end);
            let cut = if body.get(after) == Some(&b',') {
                // Not the last member: it goes with the comma after it and the space before
                // the next key.
                key_start..skip_ws(body, after + 1)
            } else if let Some(previous_end) = previous_end {
                // The last one: with the comma before it.
                previous_end..value_end
            } else {
                key_start..value_end
            };
            found = Some(Member {
                value: value_start..value_end,
                cut,
            });
        }
        previous_end = Some(value_end);
        i = value_end;
    }
}

/// Whether the JSON string at `key` is `name` (decoded only when it holds an escape).
fn is_key(body: &[u8], key: Range<usize>, name: &str) -> bool {
    let raw = &body[key.start + 1..key.end - 1];
    if raw.contains(&b'\\') {
        string_at(body, key).is_some_and(|k| k == name)
    } else {
        raw == name.as_bytes()
    }
}

/// The first element of the array that opens at `open`, or None when it is empty.
fn first_element(body: &[u8], open: usize) -> Option<Range<usize>> {
    let start = skip_ws(body, open + 1);
    if body.get(start)? == &b']' {
        return None;
    }
    Some(start..skip_value(body, start)?)
}

/// Where the element after the one that ends at `end` begins, or None when it was the last.
fn next_element(body: &[u8], end: usize) -> Option<usize> {
    let i = skip_ws(body, end);
    (body.get(i) == Some(&b',')).then(|| skip_ws(body, i + 1))
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while body.get(i).is_some_and(|b| b" \t\r\n".contains(b)) {
        i += 1;
    }
    i
}

/// The end of the JSON value that begins at `i` (in a body already checked to be JSON).
fn skip_value(body: &[u8], i: usize) -> Option<usize> {
    match body.get(i)? {
        b'"' => {
            let mut j = i + 1;
            loop {
                match body.get(j)? {
                    b'\\' => j += 2,
                    b'"' => return Some(j + 1),
                    _ => j += 1,
                }
            }
        }
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match body.get(j)? {
                    b'"' => {
                        j = skip_value(body, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while body.get(j).is_some_and(|b| !b",}] \t\r\n".contains(b)) {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const LINE: &str =
        "x-anthropic-billing-header: cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;";

    fn dropped_at(place: Place, body: &str) -> String {
        let out = without_attribution(Bytes::from(body.to_string()), place);
        String::from_utf8(out.to_vec()).unwrap()
    }

    fn dropped(body: &str) -> String {
        dropped_at(Place::System, body)
    }

    #[test]
    fn the_place_is_the_apis() {
        let (openai, anthropic) = (ReplyShape::OpenAi, ReplyShape::Anthropic);
        assert_eq!(Place::of("/v1/messages", anthropic), Some(Place::System));
        for path in ["/v1/chat/completions", "/chat/completions"] {
            assert_eq!(Place::of(path, openai), Some(Place::FirstSystemMessage));
        }
        for path in ["/v1/responses", "/responses"] {
            assert_eq!(Place::of(path, openai), Some(Place::Instructions));
        }
        // A completion's prompt, an embedding's input: the client's own text.
        for path in [
            "/v1/completions",
            "/completion",
            "/v1/embeddings",
            "/infill",
        ] {
            assert_eq!(Place::of(path, openai), None);
        }
    }

    #[test]
    fn keep_attribution_and_a_body_without_the_marker_keep_the_body() {
        let body = json!({"messages": [{"role": "system", "content": LINE}]}).to_string();
        let chat = Some(Place::FirstSystemMessage);
        assert!(to_drop(chat, false, body.as_bytes()));
        // --keep-attribution.
        assert!(!to_drop(chat, true, body.as_bytes()));
        // No place for it by the path, or no marker in the body (the fast engine's).
        assert!(!to_drop(None, false, body.as_bytes()));
        let plain = json!({"messages": [{"role": "system", "content": "You are brief."}]});
        assert!(!to_drop(chat, false, plain.to_string().as_bytes()));
        // Bytes that are not UTF-8 are looked through too.
        assert!(may_hold(&[b"\xff ".as_slice(), LINE.as_bytes()].concat()));
        assert!(!may_hold(b"\xff x-anthropic"));
    }

    #[test]
    fn the_line_is_read_to_its_last_item() {
        assert_eq!(after_line(LINE), Some(""));
        assert_eq!(after_line(&format!("{LINE}\nYou are")), Some("You are"));
        assert_eq!(
            after_line(&format!("{LINE}You are Claude")),
            Some("You are Claude")
        );
        assert_eq!(
            after_line("x-anthropic-billing-header: cc_version=1; cc_entrypoint=sdk-cli"),
            Some("")
        );
        assert_eq!(after_line("x-anthropic-billing-header: nothing"), None);
        assert_eq!(after_line("You are x-anthropic-billing-header: a=1;"), None);
    }

    #[test]
    fn a_leading_block_that_is_the_line_goes_and_the_other_bytes_stay() {
        let body = format!(
            r#"{{"model":"m","max_tokens":9,"system": [{{"type":"text","text":"{LINE}"}}, {{"type":"text","text":"You are Claude Code.","cache_control":{{"type":"ephemeral"}}}}],"tools":[{{"name":"t","input_schema":{{"z":1,"a":2}}}}],"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let out = dropped(&body);
        assert_eq!(
            out,
            r#"{"model":"m","max_tokens":9,"system": [{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"t","input_schema":{"z":1,"a":2}}],"messages":[{"role":"user","content":"hi"}]}"#
        );
        // A block that only begins with the line keeps the rest of its text, in place: the
        // block's other members keep their bytes and their order.
        let body = format!(
            r#"{{"system": [{{"text":"{LINE}\nBe brief.","type":"text","cache_control":{{"type":"ephemeral"}}}}], "messages": []}}"#
        );
        assert_eq!(
            dropped(&body),
            r#"{"system": [{"text":"Be brief.","type":"text","cache_control":{"type":"ephemeral"}}], "messages": []}"#
        );
        // The line alone: system goes.
        let body = json!({"messages": [], "system": [{"type": "text", "text": LINE}]});
        let out: Value = serde_json::from_str(&dropped(&body.to_string())).unwrap();
        assert_eq!(out, json!({"messages": []}));
    }

    #[test]
    fn a_string_loses_the_line_and_keeps_the_rest() {
        let body = json!({"system": format!("{LINE}\nYou are Claude Code."), "messages": []});
        let out: Value = serde_json::from_str(&dropped(&body.to_string())).unwrap();
        assert_eq!(
            out,
            json!({"system": "You are Claude Code.", "messages": []})
        );
        let body = format!(r#"{{"system":"{LINE}", "messages":[]}}"#);
        assert_eq!(dropped(&body), r#"{"messages":[]}"#);
        let body = format!(r#"{{"messages":[] ,"system":"{LINE}" }}"#);
        assert_eq!(dropped(&body), r#"{"messages":[] }"#);
    }

    #[test]
    fn a_chat_completions_first_system_message_loses_the_line() {
        let chat = |body: &str| dropped_at(Place::FirstSystemMessage, body);
        // As Lemonade sends a converted Messages request: the system blocks joined by a line
        // break into one string, its keys in its JSON library's order.
        let body = format!(
            r#"{{"max_completion_tokens":32000,"messages":[{{"content":"{LINE}\nYou are Claude Code.","role":"system"}},{{"content":"hi","role":"user"}}],"model":"m","stream":true,"tools":[{{"function":{{"name":"Bash","parameters":{{"z":1,"a":2}}}},"type":"function"}}]}}"#
        );
        assert_eq!(
            chat(&body),
            r#"{"max_completion_tokens":32000,"messages":[{"content":"You are Claude Code.","role":"system"},{"content":"hi","role":"user"}],"model":"m","stream":true,"tools":[{"function":{"name":"Bash","parameters":{"z":1,"a":2}},"type":"function"}]}"#
        );
        // An array of parts: a first part that is the line goes; one that begins with it
        // keeps the rest; OpenAI's `developer` is the system's too.
        let body = format!(
            r#"{{"messages": [{{"role": "system", "content": [{{"type": "text", "text": "{LINE}"}}, {{"type": "text", "text": "You are brief."}}]}}, {{"role": "user", "content": "hi"}}]}}"#
        );
        assert_eq!(
            chat(&body),
            r#"{"messages": [{"role": "system", "content": [{"type": "text", "text": "You are brief."}]}, {"role": "user", "content": "hi"}]}"#
        );
        let body = format!(
            r#"{{"messages":[{{"role":"developer","content":[{{"type":"text","text":"{LINE}\nBe brief."}}]}}]}}"#
        );
        assert_eq!(
            chat(&body),
            r#"{"messages":[{"role":"developer","content":[{"type":"text","text":"Be brief."}]}]}"#
        );
    }

    #[test]
    fn a_system_message_that_was_the_line_alone_goes() {
        let chat = |body: &str| dropped_at(Place::FirstSystemMessage, body);
        // What a converting gateway sends when there was no system text: no system message.
        let body = format!(
            r#"{{"messages": [{{"role":"system","content":"{LINE}"}}, {{"role":"user","content":"hi"}}], "stream":false}}"#
        );
        assert_eq!(
            chat(&body),
            r#"{"messages": [{"role":"user","content":"hi"}], "stream":false}"#
        );
        let body = format!(
            r#"{{"messages":[{{"role":"system","content":[{{"type":"text","text":"{LINE}\n"}}]}},{{"role":"user","content":"hi"}}]}}"#
        );
        assert_eq!(
            chat(&body),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#
        );
        // The only message.
        let body = format!(r#"{{"messages":[{{"role":"system","content":"{LINE}"}}]}}"#);
        assert_eq!(chat(&body), r#"{"messages":[]}"#);
    }

    #[test]
    fn a_responses_requests_instructions_lose_the_line() {
        let responses = |body: &str| dropped_at(Place::Instructions, body);
        let body = format!(
            r#"{{"model":"m","instructions":"{LINE}\nYou are Codex.","input":[{{"role":"user","content":"hi"}}],"stream":true}}"#
        );
        assert_eq!(
            responses(&body),
            r#"{"model":"m","instructions":"You are Codex.","input":[{"role":"user","content":"hi"}],"stream":true}"#
        );
        // The line alone: instructions go.
        let body = format!(r#"{{"model":"m","input":"hi","instructions":"{LINE}"}}"#);
        assert_eq!(responses(&body), r#"{"model":"m","input":"hi"}"#);
    }

    #[test]
    fn a_mention_anywhere_else_goes_as_it_came() {
        let user = json!({"role": "user", "content": LINE});
        for (place, body) in [
            // Messages: the line, but not first; not a text block; no system.
            (
                Place::System,
                json!({"system": [{"type": "text", "text": "You are"}, {"type": "text", "text": LINE}]}),
            ),
            (Place::System, json!({"system": format!("You are\n{LINE}")})),
            (
                Place::System,
                json!({"system": [{"type": "image", "text": LINE}]}),
            ),
            (Place::System, json!({"messages": [user]})),
            (Place::System, json!({"system": []})),
            // A chat: in a user message, first or not; in a system message after the first;
            // not at the start of the first; not a text part first.
            (Place::FirstSystemMessage, json!({"messages": [user]})),
            (
                Place::FirstSystemMessage,
                json!({"messages": [{"role": "system", "content": "You are brief."}, user]}),
            ),
            (
                Place::FirstSystemMessage,
                json!({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": LINE}]}),
            ),
            (
                Place::FirstSystemMessage,
                json!({"messages": [{"role": "system", "content": format!("Quote: {LINE}")}]}),
            ),
            (
                Place::FirstSystemMessage,
                json!({"messages": [{"role": "system", "content": [{"type": "image_url", "text": LINE}]}]}),
            ),
            // A top-level `system` is not a chat's.
            (
                Place::FirstSystemMessage,
                json!({"system": LINE, "messages": []}),
            ),
            // Responses: in the input, or not first in the instructions.
            (
                Place::Instructions,
                json!({"input": LINE, "instructions": "You are Codex."}),
            ),
            (
                Place::Instructions,
                json!({"instructions": format!("You are\n{LINE}")}),
            ),
            (Place::Instructions, json!({"input": [user]})),
        ] {
            let body = body.to_string();
            assert_eq!(dropped_at(place, &body), body, "{place:?}");
        }
        for place in [
            Place::System,
            Place::FirstSystemMessage,
            Place::Instructions,
        ] {
            for body in ["[1]", "not json", r#"{"messages":{}}"#, "{}"] {
                assert_eq!(dropped_at(place, body), body);
            }
        }
    }

    #[test]
    fn strings_with_escapes_and_nesting_are_skipped_whole() {
        let body = format!(
            r#"{{"a":"br\"ace}}]","b":[{{"c":"]"}}],"n":-1.5e3,"t":true,"system":[{{"text":"{LINE}","type":"text"}},{{"type":"text","text":"x\"y"}}]}}"#
        );
        assert_eq!(
            dropped(&body),
            r#"{"a":"br\"ace}]","b":[{"c":"]"}],"n":-1.5e3,"t":true,"system":[{"type":"text","text":"x\"y"}]}"#
        );
        // A key written with an escape is the same key.
        let body = format!(r#"{{"m\u0065ssages":[{{"r\u006fle":"system","content":"{LINE}"}}]}}"#);
        assert_eq!(
            dropped_at(Place::FirstSystemMessage, &body),
            r#"{"m\u0065ssages":[]}"#
        );
    }
}
