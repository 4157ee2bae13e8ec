//! `1bit serve --pm`: the served model as Project Manager. A chat runs as a tool loop: the PM's
//! rounds go to the backend with two tools (`experts()`, `delegate(expert, task, context)`),
//! a delegation is a chat request to Lemonade for the expert's model (`lemonade`), and the
//! PM's final answer goes back to the client (docs/pm.md).

mod calls;
mod experts;
mod lemonade;
pub mod start;

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Map, Value, json};

pub use experts::Experts;
pub use lemonade::{DEFAULT_URL, LemonadeUrl};

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::Connect;

use calls::{ToolCall, content_text, tool_calls};
use lemonade::Delegation;
use onebit_command::error::{ApiError, error_chain};
use onebit_supervision::backends::health::ProbeClient;

/// The only path the PM answers; every other route forwards unchanged.
pub const CHAT_PATH: &str = "/v1/chat/completions";

/// The tools the PM is offered.
const TOOL_NAMES: [&str; 2] = ["experts", "delegate"];

/// The PM's own instructions, ahead of the experts list (`pm.system_prompt` replaces them).
const BUILT_IN_PROMPT: &str = "You are the Project Manager of the 1bit engine. You run on the user's own machine and lead a team of expert models. For each request, decide whether to answer it yourself or to hand it to an expert.
- Answer yourself: conversation, short factual questions, opinions, summaries of what is in the chat, anything an expert would not do better.
- Delegate with delegate(expert, task, context) when the request fits an expert's domain below. Write the task as a complete, self-contained brief: the expert sees only your task and context, never the chat. Put the user's exact requirements, code and constraints in it.
- Call experts() if you need the list again.
- Only one expert runs at a time and loading one takes time: delegate once, with a complete brief.
- When the tool result arrives, relay the expert's answer to the user in full (code included), checked and with your own short framing. If the result says the delegation failed, say so in one sentence and answer as well as you can yourself.
Never pretend an expert answered when it did not.";

/// What `--pm` needs at run time: the checked experts file, Lemonade's address and the served
/// name. Built once at start (`Pm::new`), shared read-only by every request.
#[derive(Debug)]
pub struct Pm {
    experts: Experts,
    lemonade: LemonadeUrl,
    served_name: String,
    /// serve's client for Lemonade: not a relayed request, so it never busy-polls.
    lemonade_client: ProbeClient,
    system_prompt: String,
    tools: Value,
}

/// The PM's answer as the loop ends: the final message and what it took.
struct Outcome {
    reply: Value,
    message: Value,
    finish: String,
    rounds: u32,
    delegations: Vec<Delegation>,
}

impl Pm {
    /// The PM for `experts`, delegating to `lemonade`. Called once by serve's start.
    pub fn new(
        experts: Experts,
        lemonade: LemonadeUrl,
        served_name: String,
        lemonade_client: ProbeClient,
    ) -> Pm {
        let system_prompt = format!(
            "{}\n\nYour experts:\n{}",
            experts.system_prompt.as_deref().unwrap_or(BUILT_IN_PROMPT),
            experts.listing()
        );
        let names = experts.names();
        let tools = json!([
            {"type": "function", "function": {
                "name": "experts",
                "description": "List the experts you can delegate to, with when to use each.",
                "parameters": {"type": "object", "properties": {}}}},
            {"type": "function", "function": {
                "name": "delegate",
                "description": format!("Hand a task to one expert model and get its full answer back as the tool result. Experts: {names}."),
                "parameters": {"type": "object", "properties": {
                    "expert": {"type": "string", "description": format!("one of: {names}")},
                    "task": {"type": "string", "description": "a complete, self-contained brief of what to do"},
                    "context": {"type": "string", "description": "code, data or constraints the expert needs (optional)"}},
                  "required": ["expert", "task"]}}}
        ]);
        Pm {
            experts,
            lemonade,
            served_name,
            lemonade_client,
            system_prompt,
            tools,
        }
    }

    /// The start line's summary: how many experts, which Lemonade.
    pub fn summary(&self) -> String {
        format!(
            "pm: {} experts ({}), delegating to {}{}, at most {} rounds",
            self.experts.experts.len(),
            self.experts.names(),
            self.lemonade.as_str(),
            self.experts.chat_path,
            self.experts.max_rounds
        )
    }

    /// Whether the PM answers this request (a chat); anything else is relayed as without --pm.
    /// Called by the relay's plan (`relay::plan`) per request; never blocks. The method is
    /// matched as the route's rules match it (any case).
    pub fn takes(method: &str, path: &str) -> bool {
        method.eq_ignore_ascii_case("POST") && path == CHAT_PATH
    }

    /// Answer one chat through the tool loop, the PM's rounds on the backend at `port` with
    /// `client` (the general engine's; any pooled hyper client toward loopback). Called by the
    /// general engine for a plan whose target is `Target::ToolLoop`, on the request's task; it
    /// waits for every round and delegation (dropping the future, as a client that leaves
    /// does, stops the loop).
    pub async fn answer<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        port: u16,
        body: Bytes,
    ) -> Response
    where
        C: Connect + Clone + Send + Sync + 'static,
    {
        let request: Value = match serde_json::from_slice(&body) {
            Ok(Value::Object(o)) => Value::Object(o),
            Ok(_) => return ApiError::BadJson("expected an object".into()).into_response(),
            Err(e) => return ApiError::BadJson(e.to_string()).into_response(),
        };
        let Some(messages) = request
            .get("messages")
            .and_then(Value::as_array)
            .filter(|m| !m.is_empty())
        else {
            return ApiError::BadJson("\"messages\" must be a non-empty array".into())
                .into_response();
        };
        let messages = self.with_prompt(messages);
        let outcome = match self.run(client, port, &request, messages).await {
            Ok(outcome) => outcome,
            Err(response) => return response,
        };
        let pm = json!({
            "rounds": outcome.rounds,
            "delegations": outcome.delegations.iter().map(|d| json!({
                "expert": d.expert, "id": d.id, "ms": d.ms, "ok": d.ok,
            })).collect::<Vec<_>>(),
        });
        let summary = format!(
            "{} rounds, {} delegations",
            outcome.rounds,
            outcome.delegations.len()
        );
        let streamed = request.get("stream").and_then(Value::as_bool) == Some(true);
        let mut response = if streamed {
            self.as_events(&outcome, pm)
        } else {
            let mut reply = outcome.reply.clone();
            reply["model"] = json!(self.served_name);
            reply["choices"] = json!([{
                "index": 0, "message": outcome.message, "finish_reason": outcome.finish,
            }]);
            reply["pm"] = pm;
            let mut r = (StatusCode::OK, reply.to_string()).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        };
        if let Ok(v) = HeaderValue::from_str(&summary) {
            response.headers_mut().insert("x-1bit-pm", v);
        }
        response
    }

    /// The PM's prompt first; a system message of the client's follows it in the same message
    /// (chat templates take one system message, at the start).
    fn with_prompt(&self, messages: &[Value]) -> Vec<Value> {
        let mut out = Vec::with_capacity(messages.len() + 1);
        let mut rest = messages;
        let mut prompt = self.system_prompt.clone();
        if let Some(first) = messages.first()
            && first.get("role").and_then(Value::as_str) == Some("system")
        {
            prompt.push_str("\n\n");
            prompt.push_str(&content_text(first.get("content").unwrap_or(&Value::Null)));
            rest = &messages[1..];
        }
        out.push(json!({"role": "system", "content": prompt}));
        out.extend(rest.iter().cloned());
        out
    }

    /// The rounds: each one non-streamed chat on the backend; a round without a tool call (or
    /// the last, which offers none) is the answer. A backend error is relayed as it came.
    async fn run<C>(
        &self,
        client: &Client<C, Full<Bytes>>,
        port: u16,
        request: &Value,
        mut messages: Vec<Value>,
    ) -> Result<Outcome, Response>
    where
        C: Connect + Clone + Send + Sync + 'static,
    {
        let mut delegations = Vec::new();
        let max = self.experts.max_rounds;
        for round in 1..=max {
            let last = round == max;
            let body = self.round_body(request, &messages, last);
            let reply = backend_chat(client, port, body).await?;
            let message = reply
                .pointer("/choices/0/message")
                .cloned()
                .ok_or_else(|| {
                    ApiError::BadGateway("the backend's reply had no choices[0].message".into())
                        .into_response()
                })?;
            let mut finish = reply
                .pointer("/choices/0/finish_reason")
                .and_then(Value::as_str)
                .unwrap_or("stop")
                .to_string();
            let calls = if last {
                Vec::new()
            } else {
                tool_calls(&message, &TOOL_NAMES)
            };
            if calls.is_empty() {
                if finish == "tool_calls" {
                    finish = "stop".to_string();
                }
                let message = final_message(message, &messages);
                return Ok(Outcome {
                    reply,
                    message,
                    finish,
                    rounds: round,
                    delegations,
                });
            }
            self.take_turn(round, &calls, &mut messages, &mut delegations)
                .await;
        }
        unreachable!("the last round offers no tools, so it always answers")
    }

    /// A round's request: the client's body with the conversation so far, not streamed, greedy
    /// unless the client set a temperature, thinking off unless the client or `pm.thinking`
    /// turns it on, and the tools (with stops at the end of a call) unless it is the last.
    fn round_body(&self, request: &Value, messages: &[Value], last: bool) -> Value {
        let mut body = request.clone();
        let o = body.as_object_mut().expect("checked to be an object");
        o.insert("messages".into(), Value::Array(messages.to_vec()));
        o.insert("stream".into(), json!(false));
        o.remove("stream_options");
        o.entry("temperature").or_insert(json!(0.0));
        let kwargs = o.entry("chat_template_kwargs").or_insert_with(|| json!({}));
        if let Some(kwargs) = kwargs.as_object_mut() {
            kwargs
                .entry("enable_thinking")
                .or_insert(json!(self.experts.thinking));
        }
        if last {
            o.remove("tools");
            o.remove("tool_choice");
        } else {
            o.insert("tools".into(), self.tools.clone());
            o.insert(
                "stop".into(),
                json!(["</zyphra_tool_call>", "</tool_call>"]),
            );
        }
        body
    }

    /// The PM's calls as its turn (OpenAI form, so the chat template renders them), then one
    /// tool message per call with its result.
    async fn take_turn(
        &self,
        round: u32,
        calls: &[ToolCall],
        messages: &mut Vec<Value>,
        delegations: &mut Vec<Delegation>,
    ) {
        let ids: Vec<String> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| c.id.clone().unwrap_or_else(|| format!("call_{round}_{i}")))
            .collect();
        let listed: Vec<Value> = calls
            .iter()
            .zip(&ids)
            .map(|(c, id)| {
                json!({"id": id, "type": "function", "function": {
                    "name": c.name,
                    "arguments": Value::Object(c.arguments.clone()).to_string(),
                }})
            })
            .collect();
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": listed}));
        for (call, id) in calls.iter().zip(&ids) {
            let result = if call.name == "experts" {
                self.experts.listing()
            } else {
                let (result, record) = lemonade::delegate(
                    &self.experts,
                    &self.lemonade,
                    &self.lemonade_client,
                    &call.arguments,
                )
                .await;
                delegations.push(record);
                result
            };
            messages.push(json!({
                "role": "tool", "tool_call_id": id, "name": call.name, "content": result,
            }));
        }
    }

    /// The final answer as the SSE chunks a streamed chat would have carried: the role, the
    /// reasoning and the content in pieces, the finish (with the `pm` object), `[DONE]`.
    fn as_events(&self, outcome: &Outcome, pm: Value) -> Response {
        let id = outcome
            .reply
            .get("id")
            .cloned()
            .unwrap_or_else(|| json!("chatcmpl-pm"));
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut out = String::new();
        let mut push = |delta: Value, finish: Value, extra: Option<(&str, Value)>| {
            let mut chunk = json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            });
            if let Some((k, v)) = extra {
                chunk[k] = v;
            }
            out.push_str("data: ");
            out.push_str(&chunk.to_string());
            out.push_str("\n\n");
        };
        push(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            None,
        );
        let reasoning = outcome
            .message
            .get("reasoning_content")
            .and_then(Value::as_str)
            .unwrap_or("");
        for piece in pieces(reasoning) {
            push(json!({"reasoning_content": piece}), Value::Null, None);
        }
        let content = content_text(outcome.message.get("content").unwrap_or(&Value::Null));
        for piece in pieces(&content) {
            push(json!({"content": piece}), Value::Null, None);
        }
        push(json!({}), json!(outcome.finish), Some(("pm", pm)));
        out.push_str("data: [DONE]\n\n");
        let mut r = (StatusCode::OK, out).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    }
}

/// The answer's message as the client gets it: no tool calls; and when the PM wrote nothing
/// after a tool result, that result (the expert's answer is still the answer).
fn final_message(message: Value, conversation: &[Value]) -> Value {
    let mut message = match message {
        Value::Object(o) => o,
        _ => Map::new(),
    };
    message.remove("tool_calls");
    message.insert("role".into(), json!("assistant"));
    let empty = content_text(message.get("content").unwrap_or(&Value::Null))
        .trim()
        .is_empty();
    if let Some(last) = conversation.last()
        && empty
        && last.get("role").and_then(Value::as_str) == Some("tool")
    {
        message.insert(
            "content".into(),
            last.get("content").cloned().unwrap_or_default(),
        );
    }
    Value::Object(message)
}

/// Text in pieces of about 48 bytes, split after a space where there is one, never inside a
/// character.
fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = rest.len().min(48);
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        if end < rest.len()
            && let Some(space) = rest[..end].rfind(' ').filter(|s| *s > 0)
        {
            end = space + 1;
        }
        out.push(&rest[..end]);
        rest = &rest[end..];
    }
    out
}

/// One round on the backend: its JSON reply, or the response to give the client (the
/// backend's own error as it came, or 502 when it did not answer).
async fn backend_chat<C>(
    client: &Client<C, Full<Bytes>>,
    port: u16,
    body: Value,
) -> Result<Value, Response>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let request = hyper::Request::post(format!("http://127.0.0.1:{port}{CHAT_PATH}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| ApiError::BadGateway(e.to_string()).into_response())?;
    let reply = client
        .request(request)
        .await
        .map_err(|e| ApiError::no_answer("PM", &error_chain(&e)).into_response())?;
    let status = reply.status();
    let content_type = reply.headers().get(header::CONTENT_TYPE).cloned();
    let bytes = reply
        .into_body()
        .collect()
        .await
        .map_err(|e| {
            ApiError::BadGateway(format!("the PM's backend broke off its reply ({e})"))
                .into_response()
        })?
        .to_bytes();
    if !status.is_success() {
        let mut r = (status, bytes).into_response();
        if let Some(ct) = content_type {
            r.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        return Err(r);
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::BadGateway(format!(
            "the PM's backend answered with a body that is not JSON ({e})"
        ))
        .into_response()
    })
}

/// A response body from text, for tests of the SSE shape.
#[cfg(test)]
async fn text_of(r: Response) -> String {
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pm(max_rounds: u32) -> Pm {
        let mut experts = Experts::load(None).unwrap();
        experts.max_rounds = max_rounds;
        Pm::new(
            experts,
            LemonadeUrl::parse(DEFAULT_URL).unwrap(),
            "served".into(),
            onebit_supervision::backends::health::probe_client(),
        )
    }

    #[test]
    fn the_prompt_goes_first_and_the_clients_system_message_after_it() {
        let pm = pm(4);
        let m = pm.with_prompt(&[
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "hi"}),
        ]);
        assert_eq!(m.len(), 2);
        let system = m[0]["content"].as_str().unwrap();
        assert!(system.starts_with("You are the Project Manager"));
        assert!(system.contains("- code (Qwen2.5-Coder-7B-Instruct-1bit): programming."));
        assert!(system.ends_with("\n\nBe brief."));
        let m = pm.with_prompt(&[json!({"role": "user", "content": "hi"})]);
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["content"], "hi");
    }

    #[test]
    fn rounds_are_greedy_without_thinking_and_the_last_offers_no_tools() {
        let pm = pm(2);
        let request =
            json!({"messages": [], "stream": true, "tools": [{"x": 1}], "tool_choice": "auto"});
        let first = pm.round_body(&request, &[], false);
        assert_eq!(first["stream"], false);
        assert_eq!(first["temperature"], 0.0);
        assert_eq!(first["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(first["tools"][1]["function"]["name"], "delegate");
        let last = pm.round_body(&request, &[], true);
        assert!(last.get("tools").is_none() && last.get("tool_choice").is_none());
        let own = json!({"messages": [], "temperature": 0.7, "chat_template_kwargs": {"enable_thinking": true}});
        let body = pm.round_body(&own, &[], false);
        assert_eq!(body["temperature"], 0.7);
        assert_eq!(body["chat_template_kwargs"]["enable_thinking"], true);
    }

    #[test]
    fn pieces_keep_every_byte_and_every_character_whole() {
        let text = "ünïcödé wörds ".repeat(20);
        let p = pieces(&text);
        assert!(p.len() > 3);
        assert_eq!(p.concat(), text);
        assert!(pieces("").is_empty());
    }

    #[tokio::test]
    async fn the_stream_is_role_pieces_finish_done() {
        let pm = pm(4);
        let outcome = Outcome {
            reply: json!({"id": "chatcmpl-1"}),
            message: json!({"role": "assistant", "content": "The answer.", "reasoning_content": "Thought."}),
            finish: "stop".into(),
            rounds: 2,
            delegations: Vec::new(),
        };
        let text = text_of(pm.as_events(&outcome, json!({"rounds": 2}))).await;
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 5, "{text}");
        let chunk = |i: usize| -> Value { serde_json::from_str(&events[i][6..]).unwrap() };
        assert_eq!(chunk(0)["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            chunk(1)["choices"][0]["delta"]["reasoning_content"],
            "Thought."
        );
        assert_eq!(chunk(2)["choices"][0]["delta"]["content"], "The answer.");
        assert_eq!(chunk(3)["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunk(3)["model"], "served");
        assert_eq!(events[4], "data: [DONE]");
    }
}
