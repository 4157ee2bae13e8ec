//! One request's life, phase by phase, and [`Exchange`]: the one value that lives exactly as
//! long as the request and carries everything released with it.
//!
//! The phases, in order, the same on every engine (the fast engine, the general engine, and
//! the in-process path it leads to):
//!
//! 1. **accept and guard**: the browser guard and the API key (`onebit_features::guard`),
//!    before the request is planned; then [`Exchange::begin`]: the request is in flight.
//! 2. **plan**: [`RelayPlan::for_head`], completed by [`RelayPlan::with_body`] and, with the
//!    whole body, [`RelayPlan::placed`] (`--laya`'s device, `--precise`, the attribution line).
//! 3. **admit**: [`Exchange::admit`], the gates a planned request must pass (the limit on
//!    generations in flight, `--max-generations`). A new gate is written here, once.
//! 4. **prepare the slot**: [`Exchange::prepare`] (the persistent prompt cache restores a
//!    saved prefix into the slot the request is pinned to; released with the exchange).
//! 5. **send**: [`Exchange::sending`] (the watchdog's ticket, from before the request is sent);
//!    for `--pm`'s target, [`tool_loop`] answers instead.
//! 6. **reply head**: [`Exchange::reply_head`] (the progress the head is),
//!    [`Exchange::answered`] (counted), then [`Exchange::head_written`] (serve's added time).
//! 7. **each chunk**: [`Exchange::arrived`] from the backend (the watchdog's progress),
//!    [`Exchange::passed`] to the client (the route's first-byte line, the stream's clock);
//!    a prepared request's reply [`noted`] where its prefix came from the disk.
//! 8. **end and log**: dropping the exchange (the reply finished, or the client left)
//!    releases all it holds: the in-flight count, the generation, the ticket, the slot; and
//!    its [`Record`] (counted at the head by [`Exchange::answered`]) says the request's
//!    duration and its line. The general engine's outer layer (`front::endpoints`) keeps a
//!    `Record` of its own for every answer it writes (serve's own routes and refusals too):
//!    the count, the duration and the line are written here once, for every engine.
//!
//! What happens while the reply flows (phases 6 and 7: the served name, comments in
//! silences, the clocks) and the timers and cancellation that end a request (the generation
//! deadline, a client that leaves, serve stopping, the watchdog's verdict) are the reply's
//! phases, one for every engine and every source: `reply_loop`'s.
//!
//! The engines do the I/O and call these; they name none of the features behind them.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::App;
use crate::deadline::Deadline;
use crate::plan::{Engine, RelayPlan, Target};
use crate::request_id::RequestId;
use crate::traffic::InFlight;
use onebit_command::error::ApiError;
use onebit_metrics::requests::{PathClass, StreamClock};
use onebit_supervision::backends::watchdog::Ticket;

/// One request, from its plan's making to its reply's end.
pub struct Exchange {
    app: Arc<App>,
    began: Instant,
    path: PathClass,
    engine: Engine,
    in_flight: InFlight,
    /// Holds one of `--max-generations`' places.
    generation: bool,
    ticket: Option<Ticket>,
    first_byte: Option<FirstByte>,
    clock: Option<StreamClock>,
    slot: Option<Release>,
    /// `--max-generation-s`' deadline, from admission (`reply_loop`).
    deadline: Option<Deadline>,
    /// Phase 8's record, when the engine keeps it here (the fast engine's).
    record: Option<Record>,
}

impl Exchange {
    /// Phase 1: the request is in hand and in flight (the drain waits for it). `began` is when
    /// it was in hand: serve's added time and the stream's clock run from it.
    pub fn begin(app: &Arc<App>, engine: Engine, path: PathClass, began: Instant) -> Exchange {
        Exchange {
            app: app.clone(),
            began,
            path,
            engine,
            in_flight: InFlight::begin(&app.traffic),
            generation: false,
            ticket: None,
            first_byte: None,
            clock: None,
            slot: None,
            deadline: None,
            record: None,
        }
    }

    /// Keep phase 8's record here: the request's id and, when its line is on, its method and
    /// path (the fast engine's requests; the general engine's are its outer layer's).
    pub fn record(&mut self, id: RequestId, logged: Option<Box<(String, String)>>) {
        self.record = Some(Record::new(&self.app, self.began, self.path, id, logged));
    }

    /// Phase 6: the answer's head goes out with `status`: counted once (`onebit_requests_total`).
    pub fn answered(&mut self, status: u16) {
        let engine = self.engine;
        if let Some(record) = &mut self.record {
            record.answered(status, engine);
        }
    }

    /// Phase 3: the gates (an in-process target is carried by the in-process path from here:
    /// its label in the request series). A generation (a rule the route marks as inference) takes one of
    /// `--max-generations`' places, or is refused (503, retry) when all are taken. Quick and
    /// non-blocking, on the connection's task.
    pub fn admit(&mut self, plan: &RelayPlan) -> Result<(), ApiError> {
        if plan.generation && !self.generation {
            if let Some(limit) = self.app.settings.max_generations {
                let taken = self.app.generations.fetch_add(1, Ordering::AcqRel);
                if taken >= limit {
                    self.app.generations.fetch_sub(1, Ordering::AcqRel);
                    return Err(ApiError::Saturated { limit });
                }
            } else {
                self.app.generations.fetch_add(1, Ordering::AcqRel);
            }
            self.generation = true;
            // A generation's deadline runs from its admission (`reply_loop`).
            self.deadline = self
                .app
                .settings
                .max_generation
                .map(|after| Deadline::new(after, &self.app.metrics.counters));
        }
        // A streamed generation's events are timed from the request in hand.
        if plan.target == Target::InProcess {
            self.engine = Engine::InProcess;
        }
        if plan.generation && plan.streamed && self.clock.is_none() {
            self.clock = Some(StreamClock::new(self.began, self.path, self.engine));
        }
        Ok(())
    }

    /// The generation's deadline, when it has one: every loop that waits for its reply waits
    /// on it too (`reply_loop`).
    pub fn deadline(&self) -> Option<Deadline> {
        self.deadline.clone()
    }

    /// Phase 4: the persistent prompt cache prepares the request's slot, when the plan uses
    /// the cache: the body pinned to the slot holding a restored prefix, or the body as it
    /// was. The slot is released (its state saved) when the exchange ends.
    pub async fn prepare(
        &mut self,
        plan: &RelayPlan,
        (method, path): (&str, &str),
        body: bytes::Bytes,
    ) -> bytes::Bytes {
        match self.app.prompt_cache.clone() {
            Some(cache) if plan.prompt_cache => {
                // The preparation calls the backend (template, tokenize, restore): a backend
                // that hangs in it is the watchdog's from the start, as one that hangs in its
                // reply is.
                self.watch(plan, method, path, 0, body.len());
                self.prepared(cache, path, body).await
            }
            _ => body,
        }
    }

    /// The body pinned to the slot holding a restored prefix (released with the exchange), or
    /// the body as it was.
    async fn prepared(
        &mut self,
        cache: Arc<onebit_features::prompt_cache::PromptCache>,
        path: &str,
        body: bytes::Bytes,
    ) -> bytes::Bytes {
        match cache.prepare(path, &body).await {
            Some((pinned, prepared)) => {
                self.slot = Some(Release(Some((cache, prepared))));
                pinned
            }
            None => body,
        }
    }

    /// What the prompt cache notes in the reply of a prepared request, if it was prepared
    /// (phase 7: [`noted`]).
    pub fn slot_watch(&self) -> Option<SlotWatch> {
        self.slot.as_ref().and_then(Release::watch)
    }

    /// Phase 5: the request goes to `backend` (the backend abandons it at its stop when its
    /// path is one of those), watched by the watchdog from here when the plan is watched: a
    /// wait for the reply's head counts against it. A ticket already taken (the slot's
    /// preparation is watched too) is kept.
    pub fn sending(
        &mut self,
        plan: &RelayPlan,
        method: &str,
        path: &str,
        backend: usize,
        body_len: usize,
    ) {
        self.in_flight.relayed_to(path);
        if let Some(record) = &mut self.record {
            record.backend = Some(backend);
        }
        self.watch(plan, method, path, backend, body_len);
    }

    /// Watched by the watchdog from now (before the slot's preparation, say), when the plan is
    /// watched and serve runs a watchdog.
    pub fn watch(
        &mut self,
        plan: &RelayPlan,
        method: &str,
        path: &str,
        backend: usize,
        body_len: usize,
    ) {
        if self.ticket.is_none()
            && plan.watched
            && let Some(dog) = self.app.watchdog.get()
        {
            self.ticket = Some(dog.track(method, path, plan.streamed, backend, body_len));
        }
    }

    /// The route's line for a forwarded reply's first byte (and its forward turn, released
    /// then).
    pub fn on_first_byte(&mut self, first_byte: Option<FirstByte>) {
        self.first_byte = first_byte;
    }

    /// Phase 6: the reply's head arrived from the backend: progress for the watchdog.
    pub fn reply_head(&self) {
        self.arrived(0);
    }

    /// The reply's head is on its way to the client, the backend having taken `backend_time`
    /// of the time since the request was in hand: serve's added time (the rest) is recorded
    /// and returned.
    pub fn head_written(&mut self, backend_time: Duration) -> Duration {
        let added = self.began.elapsed().saturating_sub(backend_time);
        self.app.requests.added(self.path, self.engine, added);
        if let Some(record) = &mut self.record {
            record.added = added;
        }
        added
    }

    /// Phase 7, as the backend sends it: `len` bytes of the reply arrived (progress for the
    /// watchdog).
    pub fn arrived(&self, len: usize) {
        if let Some(ticket) = &self.ticket {
            ticket.progress(len);
        }
    }

    /// Phase 7, as the client gets it: `len` bytes of the reply passed on (written, or handed
    /// to hyper, which writes at once): the route's first-byte line, the stream's clock.
    pub fn passed(&mut self, len: usize) {
        if let Some(first) = self.first_byte.take() {
            first.arrived();
        }
        if let Some(record) = &mut self.record {
            record.bytes += len as u64;
        }
        if len > 0
            && let Some(clock) = &mut self.clock
        {
            clock.wrote(&self.app.requests);
        }
    }
}

impl Drop for Exchange {
    /// Phase 8: whatever the request holds is released, in the order it was taken last first.
    fn drop(&mut self) {
        let record = self.record.take();
        self.slot = None;
        self.first_byte = None;
        self.ticket = None;
        if self.generation {
            self.app.generations.fetch_sub(1, Ordering::AcqRel);
        }
        let _ = &self.in_flight;
        // Last: the request's duration covers the releases, and its line follows them.
        drop(record);
    }
}

/// What the prompt cache notes in a prepared request's reply.
pub type SlotWatch = onebit_features::prompt_cache::ReplyWatch;

/// Phase 7 for a prepared request: the reply's event (or whole JSON) that carries `timings`
/// says where its prefix came from the disk (`prompt_cache::noted_in_reply`).
pub fn noted(bytes: bytes::Bytes, watch: &SlotWatch) -> bytes::Bytes {
    onebit_features::prompt_cache::noted_in_reply(bytes, watch)
}

/// Phase 5 for a plan whose target is `--pm`'s tool loop: the loop answers the chat on
/// `backend` (after `--precise`, so its rounds carry `cache_prompt` false too). Only a plan
/// made with the Project Manager targets it.
pub async fn tool_loop(app: &App, backend: usize, body: bytes::Bytes) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let (Some(pm), Some(port)) = (&app.pm, app.settings.ports.get(backend).copied()) else {
        return ApiError::BadGateway(format!(
            "the route named backend {backend}, which it did not start"
        ))
        .into_response();
    };
    pm.answer(&app.client, port, body).await
}

/// A prepared request's slot, released with the exchange (the reply finished, or the client
/// left): the prompt cache then saves the slot's state.
struct Release(
    Option<(
        Arc<onebit_features::prompt_cache::PromptCache>,
        onebit_features::prompt_cache::Prepared,
    )>,
);

impl Release {
    fn watch(&self) -> Option<SlotWatch> {
        self.0.as_ref().map(|(_, p)| p.watch())
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        if let Some((cache, prepared)) = self.0.take() {
            cache.released(prepared);
        }
    }
}

/// What happens when a route-forwarded reply's first byte arrives: the route's line is said,
/// and the forward turn (if held) is released.
pub struct FirstByte {
    pub asked_at: Instant,
    pub line: Option<String>,
    /// The route's forward turn, held until the first byte (`Plan::serialize_forwards`).
    pub _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The request's span: the line is said when hyper polls the body, outside it.
    pub span: tracing::Span,
}

impl FirstByte {
    fn arrived(self) {
        if let Some(line) = self.line {
            let ms = format!("{:.1}", self.asked_at.elapsed().as_secs_f64() * 1000.0);
            self.span
                .in_scope(|| tracing::info!("{}", line.replace("{first_byte_ms}", &ms)));
        }
    }
}

/// Phase 8's record of one answer, written once for every engine: counted in
/// `onebit_requests_total` when its head goes out ([`Record::answered`]); when it ends
/// (finished, or the client left) its duration (`onebit_request_duration_seconds`) and, with
/// `ONEBIT_LOG=debug`, its line. A record never answered says nothing.
pub struct Record {
    app: Arc<App>,
    began: Instant,
    path: PathClass,
    engine: Engine,
    id: RequestId,
    /// The method and path for the line, kept only when the line is on.
    logged: Option<Box<(String, String)>>,
    status: Option<u16>,
    /// Bytes of the reply's body passed to the client.
    pub bytes: u64,
    /// The backend a relayed request went to.
    pub backend: Option<usize>,
    /// serve's added time (phase 6).
    pub added: Duration,
}

impl Record {
    pub fn new(
        app: &Arc<App>,
        began: Instant,
        path: PathClass,
        id: RequestId,
        logged: Option<Box<(String, String)>>,
    ) -> Record {
        Record {
            app: app.clone(),
            began,
            path,
            engine: Engine::General,
            id,
            logged,
            status: None,
            bytes: 0,
            backend: None,
            added: Duration::ZERO,
        }
    }

    /// The method and path to keep for the request's line, only when that line is on.
    pub fn logged(method: &str, path: &str) -> Option<Box<(String, String)>> {
        tracing::enabled!(target: onebit_command::log::REQUEST, tracing::Level::DEBUG)
            .then(|| Box::new((method.to_string(), path.to_string())))
    }

    /// The answer's head goes out with `status`, carried by `engine`: counted, once.
    pub fn answered(&mut self, status: u16, engine: Engine) {
        if self.status.is_none() {
            self.app.requests.count(self.path, status, engine);
        }
        self.status = Some(status);
        self.engine = engine;
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let Some(status) = self.status else {
            return;
        };
        self.app
            .requests
            .lasted(self.path, self.engine, self.began.elapsed());
        if let Some(seen) = &self.logged {
            let backend = self.backend.map(|b| b.to_string());
            tracing::debug!(
                target: onebit_command::log::REQUEST,
                method = %seen.0,
                path = %seen.1,
                status,
                engine = self.engine.as_str(),
                backend = backend.as_deref().unwrap_or("none"),
                added_us = self.added.as_micros() as u64,
                bytes = self.bytes,
                request_id = %self.id,
                "1bit serve: request"
            );
        }
    }
}
