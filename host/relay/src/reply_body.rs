//! What rides on a reply the general engine relays from a backend: the request's exchange
//! (released when the body is dropped: finished, or the client left), and the note on a
//! streamed reply whose prefix came from the disk.

use bytes::Bytes;
use http_body_util::BodyExt;

use crate::exchange::{Exchange, SlotWatch, noted};
use crate::served_name;

/// A prepared request's streamed reply: the event that carries `timings` (the last) is read
/// and, where the prefix came from the disk, says so (`exchange::noted`). Any
/// other reply passes as it is.
pub(super) fn noted_stream(
    body: http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error>,
    watch: Option<SlotWatch>,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error> {
    let Some(watch) = watch else {
        return body;
    };
    served_name::each_event(body, move |event| {
        // Only the last event carries `timings`; the others pass unparsed.
        if event.windows(9).any(|w| w == b"\"timings\"") {
            noted(event, &watch)
        } else {
            event
        }
    })
    .boxed_unsync()
}

/// The backend's reply body, each frame passing through the request's exchange as it
/// arrives (the watchdog's progress) and as hyper takes it (the first byte's line, the
/// stream's clock). The exchange rides on the body, so whatever the request holds is released
/// when the body is dropped: finished, or the client left.
pub(super) fn watched(
    body: hyper::body::Incoming,
    mut exchange: Exchange,
) -> http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error> {
    exchange.reply_head();
    body.map_frame(move |frame| {
        if let Some(data) = frame.data_ref() {
            exchange.arrived(data.len());
            // Handed to hyper, which writes it at once.
            exchange.passed(data.len());
        }
        frame
    })
    .boxed_unsync()
}
