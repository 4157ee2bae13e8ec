//! Claude Code's attribution line, dropped from an Anthropic Messages request before the engine
//! sees it (`--keep-attribution` keeps it; docs/serve.md, "Claude Code's attribution line").
//!
//! Claude Code puts a text block first in its system prompt, `x-anthropic-billing-header:
//! cc_version=2.1.197.0df; cc_entrypoint=cli; cch=a5145;`, whose version suffix and `cch=` hash
//! are derived from the request, so it changes from turn to turn. An engine that reuses a cached
//! prompt by its prefix (llama-server) then finds nothing in common past the first tokens and
//! prefills the whole prompt again on every turn. The line means nothing to a local model.
//!
//! The body is edited in place: only the `system` member's bytes change (the block removed, or
//! the line cut from the front of a string), every other byte goes as it came, so the engine
//! renders the rest of the request (tools, their schemas' key order) exactly as it would have.

use bytes::Bytes;

/// How the line begins.
pub const MARKER: &str = "x-anthropic-billing-header:";

/// Whether a body may hold the line: a cheap look for its first bytes, which [`RelayPlan`]
/// makes from the body before deciding which engine carries the request (a body without them
/// needs no rewrite and may go fast).
///
/// [`RelayPlan`]: crate::plan::RelayPlan
pub fn may_hold(body: &[u8]) -> bool {
    let marker = MARKER.as_bytes();
    let mut from = 0;
    while let Some(at) = body
        .get(from..)
        .and_then(|b| b.iter().position(|&c| c == b'x'))
    {
        let at = from + at;
        if body[at..].starts_with(marker) {
            return true;
        }
        from = at + 1;
    }
    false
}

/// The body without the attribution line when its `system` begins with it: a leading text
/// block that is the line is removed (a block that begins with it keeps the rest of its text);
/// a string that begins with it keeps what follows the line. `system` goes altogether when
/// nothing is left. Any other body (no such line first, not a JSON object) is returned as it
/// came. Called by the general engine on the connection's task for a plan that says so.
pub fn without_attribution(body: Bytes) -> Bytes {
    match edited(&body) {
        Some(edited) => Bytes::from(edited),
        None => body,
    }
}

/// The edited body, or None when there is nothing to drop.
fn edited(body: &[u8]) -> Option<Vec<u8>> {
    let member = system_member(body)?;
    let value = &body[member.value.clone()];
    let replacement: Option<Vec<u8>> = match value.first()? {
        b'"' => {
            let text: String = serde_json::from_slice(value).ok()?;
            let rest = after_line(&text)?;
            (!rest.is_empty()).then(|| serde_json::to_vec(rest).unwrap_or_default())
        }
        b'[' => {
            let first = first_element(body, member.value.start)?;
            let block: serde_json::Value = serde_json::from_slice(&body[first.clone()]).ok()?;
            if block.get("type").and_then(|t| t.as_str()) != Some("text") {
                return None;
            }
            let text = block.get("text")?.as_str()?;
            let rest = after_line(text)?.to_string();
            let mut out = Vec::with_capacity(value.len());
            out.extend_from_slice(&body[member.value.start..first.start]);
            if rest.trim().is_empty() {
                // The block goes, with the comma and space before the next one.
                let next = next_element(body, first.end);
                match next {
                    Some(next) => out.extend_from_slice(&body[next..member.value.end]),
                    None => out = Vec::new(),
                }
            } else {
                let mut block = block;
                block["text"] = serde_json::Value::String(rest);
                out.extend_from_slice(&serde_json::to_vec(&block).ok()?);
                out.extend_from_slice(&body[first.end..member.value.end]);
            }
            (!out.is_empty()).then_some(out)
        }
        _ => return None,
    };
    let mut out = Vec::with_capacity(body.len());
    match replacement {
        Some(value) => {
            out.extend_from_slice(&body[..member.value.start]);
            out.extend_from_slice(&value);
            out.extend_from_slice(&body[member.value.end..]);
        }
        None => {
            // Nothing is left: the member goes, with one comma.
            out.extend_from_slice(&body[..member.cut.start]);
            out.extend_from_slice(&body[member.cut.end..]);
        }
    }
    Some(out)
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

/// Where the top-level `system` member is: its value, and the bytes that go when the member
/// goes (the key, the value and one comma, before or after it).
struct Member {
    value: std::ops::Range<usize>,
    cut: std::ops::Range<usize>,
}

/// The top-level `system` member of a JSON object's text (the last one, as a JSON parser
/// keeps), or None.
fn system_member(body: &[u8]) -> Option<Member> {
    let mut i = skip_ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
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
        let key: String = serde_json::from_slice(&body[key_start..key_end]).ok()?;
        i = skip_ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(body, i + 1);
        let value_end = skip_value(body, value_start)?;
        if key == "system" {
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

/// The first element of the array that opens at `open`, or None when it is empty.
fn first_element(body: &[u8], open: usize) -> Option<std::ops::Range<usize>> {
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

    fn dropped(body: &str) -> String {
        String::from_utf8(without_attribution(Bytes::from(body.to_string())).to_vec()).unwrap()
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
        // A block that only begins with the line keeps the rest of its text.
        let body = json!({"system": [{"type": "text", "text": format!("{LINE}\nBe brief.")}], "messages": []});
        let out: Value = serde_json::from_str(&dropped(&body.to_string())).unwrap();
        assert_eq!(
            out["system"],
            json!([{"type": "text", "text": "Be brief."}])
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
    fn anything_else_goes_as_it_came() {
        for body in [
            // The line, but not first.
            json!({"system": [{"type": "text", "text": "You are"}, {"type": "text", "text": LINE}]}).to_string(),
            json!({"system": format!("You are\n{LINE}")}).to_string(),
            // Not a text block, or no system.
            json!({"system": [{"type": "image", "text": LINE}]}).to_string(),
            json!({"messages": [{"role": "user", "content": LINE}]}).to_string(),
            json!({"system": []}).to_string(),
            "[1]".to_string(),
            "not json".to_string(),
        ] {
            assert_eq!(dropped(&body), body);
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
    }
}
