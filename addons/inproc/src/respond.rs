//! One request answered in process: its body read, its job queued, its text relayed to the reply.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};

use onebit_plugin_api::{ForwardRequest, ReplySink, RouteError};

use crate::chat;
use crate::engine::Engine;
use crate::error::InprocError;
use crate::generate::{Client, Finish, Job, Outcome, Settings};
use crate::metrics::RequestCounters;
use crate::openai::{self, Ask, Kind, Reply};
use crate::plan::SERVED;

/// What the engine thread tells a request's thread.
enum Event {
    Text(String),
    Done(Result<Outcome, InprocError>),
}

/// How often a request's thread asks the sink whether its client left while no text comes.
const GONE_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// A request's end of the engine: text and the outcome go into a channel its thread reads.
/// Unbounded, so a slow client never stalls the other slots' decoding; what it can hold is
/// bounded by the slot's context (one piece per token).
struct RequestClient {
    events: mpsc::Sender<Event>,
    /// Set by the request's thread when the client left: the engine stops at the next token.
    cancelled: Arc<AtomicBool>,
}

impl Client for RequestClient {
    fn text(&mut self, text: &str) -> bool {
        !self.cancelled.load(Ordering::Relaxed)
            && self.events.send(Event::Text(text.to_string())).is_ok()
    }

    fn gone(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn done(self: Box<Self>, outcome: Result<Outcome, InprocError>) {
        let _ = self.events.send(Event::Done(outcome));
    }
}

/// Answer `request` (the route's `respond`): a whole error reply when it cannot run, else its
/// job on the engine thread, its text written to `sink` as it comes. Blocks for the answer.
pub fn respond(
    engine: Option<&Engine>,
    counters: &RequestCounters,
    request: &ForwardRequest,
    sink: &mut dyn ReplySink,
) -> Result<(), RouteError> {
    let Some(kind) = SERVED
        .iter()
        .find(|(path, _)| *path == request.path)
        .map(|(_, kind)| *kind)
    else {
        let message = format!("the inproc route does not serve {}", request.path);
        return openai::send_error(sink, &InprocError::NotServed(message));
    };
    let Some(engine) = engine else {
        let message = "the inproc route has no model loaded".to_string();
        return openai::send_error(sink, &InprocError::NotLoaded(message));
    };
    let (ask, prompt, settings) = match read(engine, kind, &request.body) {
        Ok(read) => read,
        Err(error) => return openai::send_error(sink, &error),
    };
    counters.taken();
    let mut reply = Reply::new(sink, kind, &ask, &engine.served_name);
    // The engine thread runs it on a free slot; with every slot busy it waits in the queue.
    let (events, received) = mpsc::channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        chat: kind == Kind::Chat,
        settings,
        client: Box::new(RequestClient {
            events,
            cancelled: cancelled.clone(),
        }),
    };
    if engine.jobs.send(job).is_err() {
        return reply.fail(InprocError::Engine(
            "the inproc route's engine thread has stopped".to_string(),
        ));
    }
    match relay(&received, &cancelled, &mut reply) {
        Ok(outcome) => {
            counters.ended(&outcome);
            if outcome.finish == Finish::Gone {
                return Err(RouteError::new("the client left; generation stopped"));
            }
            reply.close(&outcome);
            Ok(())
        }
        Err(failure) => reply.fail(failure),
    }
}

/// The request's body read: the ask, its prompt and its settings, or why they are wrong.
fn read(engine: &Engine, kind: Kind, body: &str) -> Result<(Ask, String, Settings), InprocError> {
    let ask: Ask = serde_json::from_str(body)
        .map_err(|e| InprocError::Request(format!("the request is not understood: {e}")))?;
    let prompt = match kind {
        Kind::Completion => ask.prompt()?,
        Kind::Chat => chat_prompt(engine, &ask)?,
    };
    let settings = ask.settings()?;
    Ok((ask, prompt, settings))
}

/// The engine's text written to `reply` as it comes, until the outcome: while the engine sends
/// no text (a prefill), the sink is asked whether the client left (ABI 1.5), so the engine
/// stops before its next prompt batch.
fn relay(
    received: &mpsc::Receiver<Event>,
    cancelled: &AtomicBool,
    reply: &mut Reply<'_>,
) -> Result<Outcome, InprocError> {
    loop {
        match received.recv_timeout(GONE_POLL) {
            Ok(Event::Text(text)) => {
                if !cancelled.load(Ordering::Relaxed) && !reply.piece(&text) {
                    cancelled.store(true, Ordering::Relaxed);
                }
            }
            Ok(Event::Done(outcome)) => return outcome,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if reply.client_gone() {
                    cancelled.store(true, Ordering::Relaxed);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(InprocError::Engine(
                    "the inproc route's engine thread stopped mid-answer".to_string(),
                ));
            }
        }
    }
}

/// The chat prompt: the model's template over the request's messages.
fn chat_prompt(engine: &Engine, ask: &Ask) -> Result<String, InprocError> {
    let messages = ask
        .messages
        .as_deref()
        .filter(|m| !m.is_empty())
        .ok_or_else(|| {
            InprocError::Request("the request has no messages; send {\"messages\": [...]}".into())
        })?;
    chat::render(
        &engine.model.template,
        messages,
        ask.chat_template_kwargs.as_ref(),
        &engine.model.bos,
        &engine.model.eos,
    )
}
