//! One reply's phases, decided once for every engine and every source of a reply.
//!
//! A reply reaches the client from a backend's socket (the fast engine's raw reads, the general
//! engine's hyper body), from an in-process route's sink, from `--pm`'s tool loop or from a
//! route's own answer. Whatever produces it, what happens to it while it flows is decided
//! here, in [`ReplyPhases`], without I/O: the engine that carries the reply (its driver) feeds
//! it what happened and does what it answers ([`Say`]). The drivers: the fast engine's
//! (`fast::relay`, on the raw socket, no allocation per chunk) and the general engine's
//! ([`general`]: a hyper body). A driver waits on three things only: the source's next bytes,
//! the client, and one wake-up time the phases give it ([`ReplyPhases::wake_at`]).
//!
//! | phase | fed by the driver | what the phases do |
//! |---|---|---|
//! | the head is due | [`wake_at`](ReplyPhases::wake_at) passes: [`woke`](ReplyPhases::woke) | a streamed generation silent for `--sse-keepalive-s` gets serve's own event-stream head and a comment ([`Say::Early`]): the early stream; the deadline ends it ([`Say::Refuse`] 504, or the early stream's last event) |
//! | the head | [`head`](ReplyPhases::head) | the reply's shape: passed as it comes, renamed event by event (the served name; the prompt cache's note), or collected whole to be named ([`Say::Whole`] at its end); after an early head a refusal is kept for one error event |
//! | each chunk | [`arrived`](ReplyPhases::arrived), [`payload`](ReplyPhases::payload) | the watchdog's progress, the first-token and inter-token clocks and the route's first-byte line (`Exchange`), the rewrite, where the events stand |
//! | a silence | [`woke`](ReplyPhases::woke) | a `: keep-alive` comment, only between events |
//! | the deadline (`--max-generation-s`) | [`woke`](ReplyPhases::woke) | 504 before the reply, one last error event between events, else the reply cut; counted |
//! | the end | [`end`](ReplyPhases::end), [`broke`](ReplyPhases::broke) | the last bytes, the whole reply, or the cut |
//! | the client leaves, serve stops, the watchdog restarts the backend | the driver drops the phases | the source is dropped with them (the backend connection closed: the engine stops; an in-process route's next `send` fails), then the request's `Exchange`: released, its record written once |
//!
//! A new feature that acts while a reply flows is written here: a timer is one more instant
//! in `wake_at` and one more case in `woke`; a rewrite is one more step in `payload`. No
//! driver changes.

pub mod general;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use onebit_command::error::ApiError;
use onebit_metrics::Counters;
use onebit_plugin_api::ReplyShape;
use tokio::time::Instant;

use crate::deadline::Deadline;
use crate::exchange::{Exchange, SlotWatch, noted};
use crate::plan::RelayPlan;
use crate::served_name::{self, SseEvents};
use crate::sse_keepalive::SseEdge;

/// Bytes of a refusal kept for its error event, after serve began the stream (Lemonade keeps
/// as much).
pub const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// What every reply's phases read, fixed for the run: built once with the settings
/// (`App::replies`).
#[derive(Debug)]
pub struct ReplySettings {
    /// The name the client asked for and is answered with (`--served-name`).
    pub served_name: String,
    /// The route, as errors name it.
    pub device: String,
    /// `--sse-keepalive-s` (None: off).
    pub keepalive: Option<Duration>,
    /// Where keep-alive comments and deadlines are counted.
    pub counters: Counters,
}

impl ReplySettings {
    pub fn new(settings: &crate::settings::Settings, counters: &Counters) -> ReplySettings {
        ReplySettings {
            served_name: settings.served_name.clone(),
            device: settings.device.clone(),
            keepalive: settings.sse_keepalive,
            counters: counters.clone(),
        }
    }
}

/// What the driver does next with the client's reply.
#[derive(Debug)]
pub enum Say {
    /// Nothing now.
    Nothing,
    /// The source's head goes to the client now (its body follows).
    Head,
    /// serve's own head, 200 `text/event-stream`, then a `: keep-alive` comment (counted):
    /// the early stream begins.
    Early,
    /// Send the bytes just fed, as they are.
    Pass,
    /// Send these bytes instead of those just fed (rewritten).
    Send(Bytes),
    /// Send a `: keep-alive` comment (counted).
    Comment,
    /// The head now, with this whole body and its length: the reply is over.
    Whole(Bytes),
    /// Send these last bytes (often none), then end the reply whole.
    End(Bytes),
    /// Send this last event, then end the reply whole.
    Last(Vec<u8>),
    /// End the reply without its last chunk: the client must not read it as finished.
    Cut,
    /// Nothing reached the client yet: answer this error instead.
    Refuse(ApiError),
}

/// Where the reply stands.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// The source's head is due; nothing sent yet.
    HeadDue,
    /// serve's own event-stream head is out; the source's head is due.
    EarlyHeadDue,
    /// The source's body passes (rewritten where the plan says).
    Passing,
    /// A whole reply being collected, to be named before the client sees any of it.
    Collecting,
    /// After serve's own head, the source refused with this status: its body is kept for
    /// the error event.
    Refused(u16),
    /// The reply is over.
    Over,
}

/// What a request's plan asks of its reply's phases.
#[derive(Clone, Copy, Debug)]
struct Asks {
    /// A streamed generation: its silences get comments (`--sse-keepalive-s`).
    silences: bool,
    /// A whole JSON reply is named before it goes out.
    name_whole: bool,
    /// Each event is named.
    rename_events: bool,
    /// Where the reply names its model.
    shape: ReplyShape,
}

/// One reply's phases (the table above). Made when the request is admitted; holds the
/// request's [`Exchange`] from when its source hands it over, so dropping the phases ends the
/// request.
pub struct ReplyPhases {
    phase: Phase,
    /// serve sent its own head (the early stream).
    early: bool,
    exchange: Option<Exchange>,
    /// The client's reply is an event stream: where its events stand (comments, the last event).
    edge: Option<SseEdge>,
    /// Each event rewritten (the served name, the prompt cache's note).
    events: Option<SseEvents>,
    /// The body kept: a whole reply to name, a refusal for its error event.
    kept: Vec<u8>,
    /// `--sse-keepalive-s`, for a streamed generation.
    keepalive: Option<Duration>,
    /// When the silence is next looked at, and when the last byte came.
    silence_check: Option<Instant>,
    last_byte: Instant,
    deadline: Option<Deadline>,
    /// What the plan asks of a generation's reply.
    name_whole: bool,
    rename_events: bool,
    shape: ReplyShape,
    /// The served name, the route's name, the counters.
    settings: Arc<ReplySettings>,
}

impl ReplyPhases {
    /// The phases of the reply to a request with `plan`, whose exchange set `deadline` at
    /// admission.
    pub fn new(
        settings: &Arc<ReplySettings>,
        plan: &RelayPlan,
        deadline: Option<Deadline>,
    ) -> ReplyPhases {
        let asks = Asks {
            silences: plan.generation && plan.streamed,
            name_whole: plan.name_reply,
            rename_events: plan.rename_stream,
            shape: plan.reply,
        };
        ReplyPhases::asked(settings, asks, deadline)
    }

    fn asked(settings: &Arc<ReplySettings>, asks: Asks, deadline: Option<Deadline>) -> ReplyPhases {
        let keepalive = settings.keepalive.filter(|_| asks.silences);
        let now = Instant::now();
        ReplyPhases {
            phase: Phase::HeadDue,
            early: false,
            exchange: None,
            edge: None,
            events: None,
            kept: Vec::new(),
            keepalive,
            silence_check: keepalive.map(|every| now + every),
            last_byte: now,
            deadline,
            name_whole: asks.name_whole,
            rename_events: asks.rename_events,
            shape: asks.shape,
            settings: settings.clone(),
        }
    }

    /// The request's exchange, handed over by the source with its head (or at once): the
    /// chunks pass through it, and it is released with the phases.
    pub fn holds(&mut self, exchange: Exchange) {
        self.exchange = Some(exchange);
    }

    /// The exchange, for the driver's own counting (its head's status, serve's added time).
    pub fn exchange(&mut self) -> Option<&mut Exchange> {
        self.exchange.as_mut()
    }

    /// Whether serve began the reply itself (the early stream): the connection closes after it.
    pub fn early(&self) -> bool {
        self.early
    }

    /// Whether the bytes the client gets may differ in length from the source's: the
    /// driver frames them in chunks (the general engine drops the source's length).
    pub fn rewrites(&self) -> bool {
        self.events.is_some()
    }

    /// When the driver must call [`woke`](Self::woke) next, if ever: the deadline, or the
    /// next look at a silence. Moves only when the phases are fed or woken.
    pub fn wake_at(&self) -> Option<Instant> {
        if self.phase == Phase::Over {
            return None;
        }
        let deadline = self.deadline.as_ref().map(Deadline::at);
        let silence = self.silence_check.filter(|_| self.silences_matter());
        match (deadline, silence) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn silences_matter(&self) -> bool {
        match self.phase {
            Phase::HeadDue | Phase::EarlyHeadDue => true,
            Phase::Passing => self.edge.is_some(),
            Phase::Collecting | Phase::Refused(_) | Phase::Over => false,
        }
    }

    /// The wake-up time came: the deadline, or a silence.
    pub fn woke(&mut self) -> Say {
        let now = Instant::now();
        if let Some(deadline) = &self.deadline
            && now >= deadline.at()
        {
            return self.past_deadline();
        }
        let (Some(every), Some(check)) = (self.keepalive, self.silence_check) else {
            return Say::Nothing;
        };
        if now < check {
            return Say::Nothing;
        }
        let due = self.last_byte + every;
        if now < due {
            // Bytes came since: look again when this silence would be long enough.
            self.silence_check = Some(due);
            return Say::Nothing;
        }
        self.last_byte = now;
        self.silence_check = Some(now + every);
        self.silence()
    }

    /// A silence of `--sse-keepalive-s`.
    fn silence(&mut self) -> Say {
        match self.phase {
            Phase::HeadDue => {
                self.phase = Phase::EarlyHeadDue;
                self.early = true;
                self.settings.counters.keepalive_sent();
                Say::Early
            }
            Phase::EarlyHeadDue => self.comment(),
            Phase::Passing if self.edge.as_ref().is_some_and(SseEdge::at_boundary) => {
                self.comment()
            }
            _ => Say::Nothing,
        }
    }

    fn comment(&self) -> Say {
        self.settings.counters.keepalive_sent();
        Say::Comment
    }

    /// The source's head: its status, and its Content-Type.
    pub fn head(&mut self, status: u16, content_type: &[u8]) -> Say {
        if let Some(exchange) = &self.exchange {
            exchange.reply_head();
        }
        let event_stream = content_type.starts_with(b"text/event-stream");
        let json = content_type.starts_with(b"application/json");
        let watch = self.exchange.as_ref().and_then(Exchange::slot_watch);
        match self.phase {
            Phase::EarlyHeadDue if status == 200 => {
                self.phase = Phase::Passing;
                self.edge = Some(SseEdge::default());
                self.events = self.event_rewrite(watch);
                Say::Nothing
            }
            Phase::EarlyHeadDue => {
                self.phase = Phase::Refused(status);
                Say::Nothing
            }
            Phase::HeadDue if self.name_whole && json => {
                self.phase = Phase::Collecting;
                Say::Nothing
            }
            Phase::HeadDue => {
                self.phase = Phase::Passing;
                if event_stream {
                    self.edge = Some(SseEdge::default());
                    self.events = self.event_rewrite(watch);
                }
                Say::Head
            }
            _ => Say::Nothing,
        }
    }

    /// The rewrite each event of a stream gets: the served name (when the engine cannot be
    /// told it) and the prompt cache's note on the event that carries `timings`.
    fn event_rewrite(&self, watch: Option<SlotWatch>) -> Option<SseEvents> {
        if !self.rename_events && watch.is_none() {
            return None;
        }
        let rename = self
            .rename_events
            .then(|| served_name::renamer(self.settings.served_name.clone(), self.shape));
        Some(SseEvents::new(move |event: Bytes| {
            let event = match &rename {
                Some(rename) => rename(event),
                None => event,
            };
            match &watch {
                // Only the last event carries `timings`; the others pass unparsed.
                Some(watch) if event.windows(9).any(|w| w == b"\"timings\"") => noted(event, watch),
                _ => event,
            }
        }))
    }

    /// `len` bytes of the source's body arrived (the watchdog's progress).
    pub fn arrived(&mut self, len: usize) {
        if let Some(exchange) = &self.exchange {
            exchange.arrived(len);
        }
        if self.keepalive.is_some() {
            self.last_byte = Instant::now();
        }
    }

    /// Bytes of the source's body (its transfer coding, if any, undone).
    pub fn payload(&mut self, bytes: &[u8]) -> Say {
        match self.phase {
            Phase::Passing => match &mut self.events {
                Some(events) => {
                    let out = events.feed(bytes);
                    if out.is_empty() {
                        return Say::Nothing;
                    }
                    self.passing(&out);
                    Say::Send(out)
                }
                None if bytes.is_empty() => Say::Nothing,
                None => {
                    self.passing(bytes);
                    Say::Pass
                }
            },
            Phase::Collecting => {
                self.kept.extend_from_slice(bytes);
                Say::Nothing
            }
            Phase::Refused(_) => {
                let room = ERROR_BODY_LIMIT.saturating_sub(self.kept.len());
                self.kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
                Say::Nothing
            }
            Phase::HeadDue | Phase::EarlyHeadDue | Phase::Over => Say::Nothing,
        }
    }

    /// `bytes` go to the client: where the events stand, the clocks.
    fn passing(&mut self, bytes: &[u8]) {
        if let Some(edge) = &mut self.edge {
            edge.feed(bytes);
        }
        if let Some(exchange) = &mut self.exchange {
            exchange.passed(bytes.len());
        }
    }

    /// The source's body ended whole.
    pub fn end(&mut self) -> Say {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::Passing => {
                let rest = self
                    .events
                    .as_mut()
                    .map(SseEvents::rest)
                    .unwrap_or_default();
                if !rest.is_empty() {
                    self.passing(&rest);
                }
                Say::End(rest)
            }
            Phase::Collecting => {
                let kept = Bytes::from(std::mem::take(&mut self.kept));
                let named = served_name::in_reply(kept, &self.settings.served_name);
                let named = match self.exchange.as_ref().and_then(Exchange::slot_watch) {
                    Some(watch) => noted(named, &watch),
                    None => named,
                };
                self.passing(&named);
                Say::Whole(named)
            }
            Phase::Refused(status) => Say::Last(error_event(status, &self.kept)),
            due @ (Phase::EarlyHeadDue | Phase::HeadDue) => {
                self.phase = due;
                self.broke("it closed before its head")
            }
            Phase::Over => Say::Nothing,
        }
    }

    /// The source failed: its connection broke (`why`), before its head or inside its body.
    /// A stream of events is cut; a refusal still says what it kept.
    pub fn broke(&mut self, why: &str) -> Say {
        match std::mem::replace(&mut self.phase, Phase::Over) {
            Phase::HeadDue => Say::Refuse(ApiError::no_answer(&self.settings.device, why)),
            Phase::EarlyHeadDue => {
                let line = format!(
                    "the {} backend did not answer ({why})",
                    self.settings.device
                );
                Say::Last(error_event(502, line.as_bytes()))
            }
            Phase::Collecting => Say::Refuse(ApiError::BadGateway(format!(
                "the {} backend broke off its reply ({why})",
                self.settings.device
            ))),
            Phase::Passing => Say::Cut,
            Phase::Refused(status) => Say::Last(error_event(status, &self.kept)),
            Phase::Over => Say::Nothing,
        }
    }

    /// The generation's deadline passed: counted, and the reply ended in the shape its
    /// progress allows.
    fn past_deadline(&mut self) -> Say {
        let Some(deadline) = self.deadline.take() else {
            return Say::Nothing;
        };
        let phase = std::mem::replace(&mut self.phase, Phase::Over);
        if phase == Phase::Over {
            return Say::Nothing;
        }
        deadline.ended();
        match phase {
            Phase::HeadDue | Phase::Collecting => Say::Refuse(deadline.error()),
            Phase::Passing if self.edge.as_ref().is_some_and(SseEdge::at_boundary) => {
                Say::Last(error_event(504, deadline.body().as_bytes()))
            }
            Phase::Passing => Say::Cut,
            Phase::EarlyHeadDue | Phase::Refused(_) => {
                Say::Last(error_event(504, deadline.body().as_bytes()))
            }
            Phase::Over => Say::Nothing,
        }
    }

    /// The reply is over (or was never to be relayed): whatever the phases say from now on
    /// is nothing.
    pub fn over(&self) -> bool {
        self.phase == Phase::Over
    }
}

/// The one event a stream serve already answered 200 ends with when its source then refuses
/// it with `status` (Lemonade sends the same): `data: {"error":…}` with the source's own error
/// object when it sent one; no `[DONE]`.
pub fn error_event(status: u16, body: &[u8]) -> Vec<u8> {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let error = match parsed.as_ref().and_then(|v| v.get("error")) {
        Some(e) if e.is_object() => e.clone(),
        _ => serde_json::json!({
            "message": String::from_utf8_lossy(body).trim(),
            "type": "backend_error",
            "code": status,
        }),
    };
    format!("data: {}\n\n", serde_json::json!({ "error": error })).into_bytes()
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
