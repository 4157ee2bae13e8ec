//! Tool calls on request: a chat that offers `tools` and carries `fake_delegate=NAME` gets a
//! call of `delegate(expert=NAME, …)` back instead of text, in the form `fake_tool_form=` names
//! (`parsed`, `zaya` or `qwen`), so the tests of `1bit serve --pm` can play a Project Manager.

use serde_json::{Value, json};

use crate::text;

/// The form a tool call is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// llama-server's parsed `message.tool_calls`.
    Parsed,
    /// ZAYA's `<zyphra_tool_call><function=…><parameter=…>` text.
    Zaya,
    /// Qwen's `<tool_call>{"name": …, "arguments": {…}}</tool_call>` text.
    Qwen,
}

/// The assistant message of a tool call, when `body` asks for one: tools are offered, the body
/// carries `fake_delegate=NAME`, and the conversation does not end in a tool result (unless
/// `fake_delegate_always` is there too, which delegates every round). The task is the last
/// user message; a closing tag named in the request's `stop` is left out, as llama-server
/// leaves a stop string out.
pub fn call_for(body: &Value) -> Option<(Value, &'static str)> {
    let offered = body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    let raw = body.to_string();
    let expert = word_after(&raw, "fake_delegate=")?;
    let turns = body.get("messages").and_then(text::chat_turns)?;
    let after_tool = turns.last().is_some_and(|t| t.role == "tool");
    if !offered || (after_tool && !raw.contains("fake_delegate_always")) {
        return None;
    }
    let form = match word_after(&raw, "fake_tool_form=").as_deref() {
        Some("zaya") => Form::Zaya,
        Some("qwen") => Form::Qwen,
        _ => Form::Parsed,
    };
    let task = turns
        .iter()
        .rev()
        .find(|t| t.role == "user")
        .map_or(String::new(), |t| t.text.clone());
    let stops: Vec<&str> = body
        .get("stop")
        .and_then(Value::as_array)
        .map(|s| s.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let closing = |tag: &'static str| if stops.contains(&tag) { "" } else { tag };
    let arguments = json!({"expert": expert, "task": task, "context": "fake context"});
    Some(match form {
        Form::Parsed => (
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "id": "call_fake0", "type": "function",
                "function": {"name": "delegate", "arguments": arguments.to_string()},
            }]}),
            "tool_calls",
        ),
        Form::Zaya => (
            json!({"role": "assistant", "content": format!(
                "<zyphra_tool_call><function=delegate><parameter=expert>{expert}</parameter><parameter=task>{task}</parameter><parameter=context>fake context</parameter></function>{}",
                closing("</zyphra_tool_call>"))}),
            "stop",
        ),
        Form::Qwen => (
            json!({"role": "assistant", "content": format!(
                "<tool_call>\n{{\"name\": \"delegate\", \"arguments\": {arguments}}}\n{}",
                closing("</tool_call>"))}),
            "stop",
        ),
    })
}

/// The word after `key` (up to a space, quote, backslash or the end).
fn word_after(text: &str, key: &str) -> Option<String> {
    let rest = &text[text.find(key)? + key.len()..];
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '"' || c == '\\')
        .unwrap_or(rest.len());
    Some(rest[..end].to_string()).filter(|w| !w.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(extra: Value) -> Value {
        let mut body = json!({"messages": [{"role": "user", "content": "fake_delegate=code fake_tool_form=zaya sum a slice"}],
                              "tools": [{"type": "function"}], "stop": ["</zyphra_tool_call>"]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    }

    #[test]
    fn only_with_tools_and_the_trigger() {
        assert!(call_for(&chat(json!({"tools": []}))).is_none());
        let (m, _) = call_for(&chat(json!({}))).unwrap();
        let content = m["content"].as_str().unwrap();
        assert!(content.starts_with(
            "<zyphra_tool_call><function=delegate><parameter=expert>code</parameter>"
        ));
        assert!(!content.ends_with("</zyphra_tool_call>"), "{content}");
        let after = chat(json!({"messages": [
            {"role": "user", "content": "fake_delegate=code"},
            {"role": "tool", "content": "done"}]}));
        assert!(call_for(&after).is_none());
    }
}
