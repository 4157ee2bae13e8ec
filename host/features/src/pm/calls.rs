//! Reading the PM's tool calls out of a chat reply's message, in the three forms models write
//! them: llama-server's parsed `tool_calls`, ZAYA's `<zyphra_tool_call>` text and Qwen's
//! `<tool_call>{…}</tool_call>` text.

use serde_json::{Map, Value};

/// One call the PM made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The id llama-server gave it, if any (the loop names unnamed calls itself).
    pub id: Option<String>,
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// The calls of tools named in `known` found in `message`: the parsed `tool_calls` when there
/// are any, else the ZAYA text form, else the Qwen one. Calls of other names are dropped (a
/// model that invents a tool gets no result for it, and its text is the answer). Pure; called
/// by the tool loop on the request's task.
pub fn tool_calls(message: &Value, known: &[&str]) -> Vec<ToolCall> {
    let keep = |c: &ToolCall| known.contains(&c.name.as_str());
    if let Some(list) = message.get("tool_calls").and_then(Value::as_array) {
        let parsed: Vec<ToolCall> = list.iter().filter_map(parsed_call).filter(keep).collect();
        if !parsed.is_empty() {
            return parsed;
        }
    }
    let text = content_text(message.get("content").unwrap_or(&Value::Null));
    let zaya: Vec<ToolCall> = zaya_calls(&text).into_iter().filter(keep).collect();
    if !zaya.is_empty() {
        return zaya;
    }
    qwen_calls(&text).into_iter().filter(keep).collect()
}

/// The text of a message's `content`: a string, or the `text` parts of an array.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

fn parsed_call(call: &Value) -> Option<ToolCall> {
    let function = call.get("function")?;
    Some(ToolCall {
        id: call.get("id").and_then(Value::as_str).map(str::to_string),
        name: function.get("name")?.as_str()?.to_string(),
        arguments: arguments(function.get("arguments").unwrap_or(&Value::Null)),
    })
}

/// Arguments as an object: OpenAI sends a JSON string, some templates an object; a string
/// that is not JSON is taken as the task itself.
fn arguments(value: &Value) -> Map<String, Value> {
    match value {
        Value::Object(o) => o.clone(),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(o)) => o,
            _ if !s.trim().is_empty() => {
                Map::from_iter([("task".to_string(), Value::String(s.clone()))])
            }
            _ => Map::new(),
        },
        _ => Map::new(),
    }
}

/// ZAYA: `<function=NAME><parameter=KEY>VALUE</parameter>…</function>`, inside
/// `<zyphra_tool_call>`. Closing tags may be missing: the round's stop sequence ends the turn
/// at `</zyphra_tool_call>`, and llama-server leaves the stop text out.
fn zaya_calls(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("<function=") {
        let after = &rest[start + "<function=".len()..];
        let Some(close) = after.find('>') else { break };
        let name = after[..close].trim().to_string();
        let body_all = &after[close + 1..];
        let end = body_all.find("</function>").unwrap_or(body_all.len());
        let body = &body_all[..end];
        let mut args = Map::new();
        let mut params = body;
        while let Some(p) = params.find("<parameter=") {
            let after_p = &params[p + "<parameter=".len()..];
            let Some(close_p) = after_p.find('>') else {
                break;
            };
            let key = after_p[..close_p].trim().to_string();
            let value_all = &after_p[close_p + 1..];
            let value_end = [
                value_all.find("</parameter>"),
                value_all.find("<parameter="),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(value_all.len());
            args.insert(
                key,
                Value::String(value_all[..value_end].trim().to_string()),
            );
            params = &value_all[value_end..];
        }
        if !name.is_empty() {
            calls.push(ToolCall {
                id: None,
                name,
                arguments: args,
            });
        }
        rest = &body_all[end..];
    }
    calls
}

/// Qwen (and Hermes-style templates): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
/// the closing tag may be missing, for the same reason as ZAYA's.
fn qwen_calls(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("<tool_call>") {
        rest = &rest[start + "<tool_call>".len()..];
        let Some(brace) = rest.find('{') else { break };
        let mut objects = serde_json::Deserializer::from_str(&rest[brace..]).into_iter::<Value>();
        let Some(Ok(Value::Object(o))) = objects.next() else {
            continue;
        };
        rest = &rest[brace + objects.byte_offset()..];
        let Some(name) = o.get("name").and_then(Value::as_str) else {
            continue;
        };
        let args = o
            .get("arguments")
            .or_else(|| o.get("parameters"))
            .unwrap_or(&Value::Null);
        calls.push(ToolCall {
            id: None,
            name: name.to_string(),
            arguments: arguments(args),
        });
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KNOWN: &[&str] = &["experts", "delegate"];

    fn delegate(call: &ToolCall) -> (String, String, String) {
        let get = |k: &str| {
            call.arguments
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        assert_eq!(call.name, "delegate");
        (get("expert"), get("task"), get("context"))
    }

    #[test]
    fn parsed_tool_calls_with_string_or_object_arguments() {
        let m = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "delegate",
              "arguments": "{\"expert\":\"code\",\"task\":\"sum a slice\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "experts", "arguments": {}}},
            {"id": "c3", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}
        ]});
        let calls = tool_calls(&m, KNOWN);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].id.as_deref(), Some("c1"));
        assert_eq!(delegate(&calls[0]).0, "code");
        assert_eq!(calls[1].name, "experts");
    }

    #[test]
    fn zaya_text_form_with_and_without_closing_tags() {
        let m = json!({"content": "Let me ask.<zyphra_tool_call><function=delegate><parameter=expert>code</parameter><parameter=task>\nWrite fizzbuzz\n</parameter><parameter=context>in Rust</parameter></function></zyphra_tool_call>"});
        let calls = tool_calls(&m, KNOWN);
        assert_eq!(calls.len(), 1);
        assert_eq!(
            delegate(&calls[0]),
            ("code".into(), "Write fizzbuzz".into(), "in Rust".into())
        );
        let cut = json!({"content": "<zyphra_tool_call><function=delegate><parameter=expert>reasoning<parameter=task>prove it"});
        assert_eq!(
            delegate(&tool_calls(&cut, KNOWN)[0]),
            ("reasoning".into(), "prove it".into(), String::new())
        );
    }

    #[test]
    fn qwen_text_form_with_and_without_closing_tag() {
        let m = json!({"content": "<tool_call>\n{\"name\": \"delegate\", \"arguments\": {\"expert\": \"agentic\", \"task\": \"plan {it}\"}}\n</tool_call>"});
        let calls = tool_calls(&m, KNOWN);
        assert_eq!(
            delegate(&calls[0]),
            ("agentic".into(), "plan {it}".into(), String::new())
        );
        let cut = json!({"content": [{"type": "text", "text": "<tool_call>{\"name\": \"experts\", \"arguments\": {}}"}]});
        assert_eq!(tool_calls(&cut, KNOWN)[0].name, "experts");
    }

    #[test]
    fn plain_answers_and_unknown_tools_are_no_calls() {
        for m in [
            json!({"content": "Hello! How can I help?"}),
            json!({"content": "<tool_call>{\"name\": \"shell\", \"arguments\": {}}</tool_call>"}),
            json!({"content": "<tool_call>not json</tool_call>"}),
            json!({"content": null, "tool_calls": []}),
        ] {
            assert!(tool_calls(&m, KNOWN).is_empty(), "{m}");
        }
    }
}
