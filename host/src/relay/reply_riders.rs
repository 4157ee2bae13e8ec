//! What rides on a reply the general engine relays from a backend: the request's watchdog
//! ticket, its in-flight count, the first byte's line, the stream's clock, and the prompt
//! cache's slot, each released when the body is dropped (finished, or the client left); and
//! the note on a streamed reply whose prefix came from the disk.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;

use crate::backends::watchdog::Ticket;
use crate::metrics::requests::{PathClass, StreamClock};
use crate::relay::App;
use crate::relay::in_flight::InFlight;
use crate::relay::plan::{Engine, RelayPlan};
use crate::relay::served_name;

/// A prepared request's slot, released when the reply body that carries it is dropped
/// (finished, or the client left): the prompt cache then saves the slot's state.
pub(super) struct Release(
    pub(super)  Option<(
        Arc<crate::prompt_cache::PromptCache>,
        crate::prompt_cache::Prepared,
    )>,
);

impl Release {
    pub(super) fn watch(&self) -> Option<crate::prompt_cache::ReplyWatch> {
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

/// A prepared request's streamed reply: the event that carries `timings` (the last) is read
/// and, where the prefix came from the disk, says so (`prompt_cache::noted_in_reply`). Any
/// other reply passes as it is.
pub(super) fn noted_stream(
    body: http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error>,
    watch: Option<crate::prompt_cache::ReplyWatch>,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error> {
    let Some(watch) = watch else {
        return body;
    };
    served_name::each_event(body, move |event| {
        // Only the last event carries `timings`; the others pass unparsed.
        if event.windows(9).any(|w| w == b"\"timings\"") {
            crate::prompt_cache::noted_in_reply(event, &watch)
        } else {
            event
        }
    })
    .boxed_unsync()
}

/// What happens when a route-forwarded reply's first byte arrives: the route's line is said,
/// and the forward turn (if held) is released.
pub(super) struct FirstByte {
    pub(super) asked_at: std::time::Instant,
    pub(super) line: Option<String>,
    pub(super) _turn: Option<tokio::sync::OwnedMutexGuard<()>>,
    /// The request's span: the line is said when hyper polls the body, outside it.
    pub(super) span: tracing::Span,
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

/// A streamed inference reply's clock and the series it records into.
pub(super) struct Streamed {
    app: Arc<App>,
    clock: StreamClock,
}

impl Streamed {
    pub(super) fn new(
        app: &Arc<App>,
        plan: &RelayPlan,
        began: Instant,
        path: PathClass,
    ) -> Option<Self> {
        (plan.inference && plan.streamed).then(|| Streamed {
            app: app.clone(),
            clock: StreamClock::new(began, path, Engine::General),
        })
    }
}

/// The backend's reply body, stamping the request's watchdog ticket with every frame (the
/// reply's head counts as progress too). The ticket and the in-flight count ride on the body,
/// so the request stops being watched and counted when the body is dropped: finished, or the
/// client left.
pub(super) fn watched(
    body: hyper::body::Incoming,
    ticket: Option<Ticket>,
    first_byte: Option<FirstByte>,
    in_flight: InFlight,
    mut streamed: Option<Streamed>,
    release: Option<Release>,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error> {
    if let Some(ticket) = &ticket {
        ticket.progress(0);
    }
    let mut first_byte = first_byte;
    body.map_frame(move |frame| {
        let _counted = &in_flight;
        let _released_with_the_body = &release;
        if let Some(data) = frame.data_ref() {
            if let Some(ticket) = &ticket {
                ticket.progress(data.len());
            }
            if let Some(first) = first_byte.take() {
                first.arrived();
            }
            // Handed to hyper, which writes it at once: the stream's event is out.
            if let Some(Streamed { app, clock }) = &mut streamed
                && !data.is_empty()
            {
                clock.wrote(&app.requests);
            }
        }
        frame
    })
    .boxed_unsync()
}
