//! `respond`: one chat completion answered in process, whole or streamed, with the tokens the
//! kernels generate.
//!
//! # Cancellation
//!
//! The host's [`ReplySink`] tells the route when to stop, and the route stops at once:
//!
//! - a `send` (or `send_head`) that fails means the client left, or serve is stopping and its
//!   drain window ended ([`onebit_plugin_api::HOST_STOPPING`]): the route generates nothing
//!   more, sends nothing more, and returns `Ok(())`. A client that left is no failure of the
//!   route, so it is not reported as one;
//! - between tokens, before each one is generated, the route asks [`ReplySink::client_gone`]
//!   (ABI 1.5), which is true in the same cases without sending anything: a whole reply sends
//!   nothing until its last token, so this is how it learns that nobody waits for it;
//! - an error of the kernels is an error (`Err`): a 500 before the head, a cut stream after it.
//!
//! A send blocks while the client reads slowly (the host holds a bounded buffer), which paces
//! generation to the client. No lock is held across a sink call, so a panic there (which the
//! host contains) poisons nothing that later requests need.

use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use onebit_plugin_api::{ForwardRequest, ReplySink, RouteError, SinkError, error_body};
use serde_json::json;

use crate::chat::{self, Completion, DONE, Finish};
use crate::kernels::Kernels;
use crate::{Counters, Loaded};

/// Why a reply ended before its end.
enum Stop {
    /// The sink refused, or said the client is gone: not an error.
    Gone,
    /// The route failed: an error for the host.
    Failed(RouteError),
}

impl From<SinkError> for Stop {
    fn from(_: SinkError) -> Stop {
        Stop::Gone
    }
}

/// Answer `request` through `sink` with the kernels `loaded` holds (None before a successful
/// `start`: an error). Returns `Ok(())` when the reply was sent or the client left (see the
/// module's notes on cancellation); an error only when the route itself failed.
pub(crate) fn respond(
    loaded: Option<&Loaded>,
    counters: &Counters,
    request: &ForwardRequest,
    sink: &mut dyn ReplySink,
) -> Result<(), RouteError> {
    match answer(loaded, counters, request, sink) {
        Ok(()) | Err(Stop::Gone) => Ok(()),
        Err(Stop::Failed(e)) => Err(e),
    }
}

/// [`respond`], with the client's leaving as [`Stop::Gone`].
fn answer(
    loaded: Option<&Loaded>,
    counters: &Counters,
    request: &ForwardRequest,
    sink: &mut dyn ReplySink,
) -> Result<(), Stop> {
    let loaded = loaded.ok_or_else(|| {
        Stop::Failed(RouteError::new(
            "the Acme kernels are not loaded (the route's start did not run or failed)",
        ))
    })?;
    let ask = match chat::parse(&request.body) {
        Ok(ask) => ask,
        Err(message) => return refuse(sink, &message),
    };
    let prompt = match CString::new(ask.prompt.as_str()) {
        Ok(prompt) => prompt,
        Err(_) => return refuse(sink, "the user message contains a NUL character; remove it"),
    };
    let cap = loaded.state.max_tokens_cap;
    let number = counters.generations.fetch_add(1, Ordering::Relaxed) + 1;
    let completion = Completion {
        id: format!("chatcmpl-acme-{number}"),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: loaded.state.served_name.clone(),
    };
    let mut generation = Generation {
        kernels: &loaded.kernels,
        prompt,
        limit: ask.max_tokens.map_or(cap, |n| n.min(cap)),
        step: 0,
        counters,
    };
    if ask.stream {
        streamed(sink, &mut generation, &completion)
    } else {
        whole(
            sink,
            &mut generation,
            &completion,
            chat::prompt_tokens(&ask.prompt),
        )
    }
}

/// A 400 with OpenAI's error body saying `message`.
fn refuse(sink: &mut dyn ReplySink, message: &str) -> Result<(), Stop> {
    sink.send_head(400, "application/json")?;
    sink.send(error_body(400, "invalid_request_error", message).as_bytes())?;
    sink.end();
    Ok(())
}

/// The whole reply: every token first (asking between tokens whether the client is still
/// there), then one 200 `application/json` `chat.completion`.
fn whole(
    sink: &mut dyn ReplySink,
    generation: &mut Generation<'_>,
    completion: &Completion,
    prompt_tokens: u64,
) -> Result<(), Stop> {
    let mut content = String::new();
    loop {
        if sink.client_gone() {
            return Err(Stop::Gone);
        }
        match generation.next()? {
            Some(token) => content.push_str(&token),
            None => break,
        }
    }
    let finish = generation.finish()?;
    let body = chat::whole(
        completion,
        &content,
        finish,
        prompt_tokens,
        u64::from(generation.step),
    );
    sink.send_head(200, "application/json")?;
    sink.send(body.as_bytes())?;
    sink.end();
    Ok(())
}

/// The streamed reply: a 200 `text/event-stream` of `chat.completion.chunk` events, the first
/// with the role, one per token, a last with the finish reason and an empty delta, then
/// `data: [DONE]`.
fn streamed(
    sink: &mut dyn ReplySink,
    generation: &mut Generation<'_>,
    completion: &Completion,
) -> Result<(), Stop> {
    sink.send_head(200, "text/event-stream")?;
    let role = chat::chunk(
        completion,
        json!({"role": "assistant", "content": ""}),
        None,
    );
    sink.send(role.as_bytes())?;
    loop {
        if sink.client_gone() {
            return Err(Stop::Gone);
        }
        let Some(token) = generation.next()? else {
            break;
        };
        sink.send(chat::chunk(completion, json!({"content": token}), None).as_bytes())?;
    }
    let finish = generation.finish()?;
    sink.send(chat::chunk(completion, json!({}), Some(finish)).as_bytes())?;
    sink.send(DONE)?;
    sink.end();
    Ok(())
}

/// One reply's generation: the kernels asked for one token at a time, up to the limit.
struct Generation<'a> {
    /// The loaded kernels.
    kernels: &'a Kernels,
    /// The prompt, as the kernels take it.
    prompt: CString,
    /// The most tokens this reply may have.
    limit: u32,
    /// The tokens generated so far.
    step: u32,
    /// Where generated tokens are counted.
    counters: &'a Counters,
}

impl Generation<'_> {
    /// The next token, or None when the reply is complete or at its limit.
    fn next(&mut self) -> Result<Option<String>, Stop> {
        if self.step >= self.limit {
            return Ok(None);
        }
        let token = self.token(self.step)?;
        if token.is_some() {
            self.step += 1;
            self.counters.tokens.fetch_add(1, Ordering::Relaxed);
        }
        Ok(token)
    }

    /// Why the reply ended, once [`Generation::next`] said None: `length` when the limit cut
    /// a reply the kernels would have gone on with, else `stop`.
    fn finish(&self) -> Result<Finish, Stop> {
        if self.step < self.limit || self.token(self.step)?.is_none() {
            Ok(Finish::Stop)
        } else {
            Ok(Finish::Length)
        }
    }

    /// Token `step` from the kernels.
    fn token(&self, step: u32) -> Result<Option<String>, Stop> {
        self.kernels
            .token(&self.prompt, step)
            .map_err(|e| Stop::Failed(RouteError::new(e)))
    }
}
