//! The fast engine: a client connection is served here first, on the raw socket. A request
//! whose [`RelayPlan`] the fast engine can carry (a backend target, no rewrite of its body,
//! HTTP/1.1, all of it read within 100 ms of its head; `relay::wire` reads the head) goes to
//! its backend and back without hyper, axum or a task hand-off: one read, one write to the
//! backend, one read, one write to the client (`relay`, the fast driver of the reply's phases,
//! `reply_loop`: the served name in a whole reply or each event, comments, the deadline).
//! Anything else (serve's own routes, a refusal, an error to report, a route that must be
//! asked, a request whose body serve must rewrite, a body slower than that) hands the connection, with
//! every byte read so far and the plan when there is one, to the general
//! engine (`relay::general`), which serves it from then on. So every rule and every error
//! reply has one implementation, there; this file only carries what the plan gives it.
//!
//! What it shares with the general engine: the browser guard and the API key (`guard`), the
//! plan (`relay::plan`: the route's rules, the status check, the body checks by kind, the
//! headers that pass), the watchdog ticket of a streamed inference request, a client that
//! leaves closing the backend connection, the header timeout, and a graceful stop between
//! requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use onebit_plugin_api::BodyKind;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::App;
use crate::busy_poll::BusyPollStream;
use crate::exchange::{Exchange, Record};
use crate::plan::{self, Direction, Engine, HandedPlan, RelayPlan, Target};
use crate::request_id::RequestId;
use crate::sse_keepalive;
use crate::wire::{self, Body, Framing, Head, MAX_CONNECTION, MAX_HEAD, MAX_HEADERS};
use onebit_command::error::ApiError;
use onebit_features::guard::{self, Seen};
use onebit_metrics::requests::PathClass;

mod handover;
mod qualify;
mod relay;
mod reply_head;

pub use handover::Prefixed;
use qualify::{Fast, Verdict, qualify};
use reply_head::{ReplyError, ReplyHead, read_reply_head};

/// A body larger than this goes the general way: it takes several reads to arrive anyway.
const MAX_FAST_BODY: usize = 256 * 1024;
/// How long the rest of a fast request's body may take, from its head, before the general
/// path takes the request (and times the body itself).
const BODY_GRACE: Duration = Duration::from_millis(100);
/// What became of one request on the fast engine.
enum Outcome {
    /// Answered; the connection stays open for the next request.
    KeepAlive,
    /// Answered (or the client left, or the reply broke off); close the connection.
    Close,
    /// Not a fast request: the general engine takes the connection, the bytes read so far,
    /// and the request's plan when the fast engine got as far as making it.
    HandOver(Option<HandedPlan>),
    /// The request's head has not all arrived yet.
    HeadDue,
    /// A fast request whose body has not all arrived yet; its plan so far.
    BodyDue(RelayPlan),
}

/// Serve one client connection: fast requests here, until one is not; then hand the
/// connection to `general`.
pub async fn serve_connection<F, Fut>(
    mut client: BusyPollStream,
    app: Arc<App>,
    header_timeout: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
    general: F,
) where
    F: FnOnce(Prefixed, tokio::sync::watch::Receiver<bool>, Option<HandedPlan>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut buf = BytesMut::with_capacity(8 * 1024);
    if !app.settings.fast_engine {
        return general(Prefixed::new(client, buf), stop, None).await;
    }
    let head_due = tokio::time::sleep(header_timeout);
    tokio::pin!(head_due);
    loop {
        // Per request: its head within the header timeout (hyper's rule; an idle kept-alive
        // connection too), its body within the grace after the head.
        head_due
            .as_mut()
            .reset(tokio::time::Instant::now() + header_timeout);
        let mut body_due = None;
        loop {
            match exchange(&app, &mut client, &mut buf).await {
                Outcome::KeepAlive => break,
                Outcome::Close => {
                    let _ = client.shutdown().await;
                    return;
                }
                Outcome::HandOver(decided) => {
                    return general(Prefixed::new(client, buf), stop, decided).await;
                }
                Outcome::HeadDue => {
                    let idle = buf.is_empty();
                    tokio::select! {
                        biased;
                        read = client.read_buf(&mut buf) => match read {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        },
                        // Headers too slow (or an idle connection past the timeout): drop it,
                        // as hyper's header timeout does.
                        () = head_due.as_mut() => return,
                        () = crate::stopped(&mut stop), if idle => return,
                    }
                }
                // Many clients write the body apart from the head; it follows at once. A body
                // that is not all there within the grace is the general engine's to time.
                Outcome::BodyDue(plan) => {
                    let until =
                        *body_due.get_or_insert_with(|| tokio::time::Instant::now() + BODY_GRACE);
                    match tokio::time::timeout_at(until, client.read_buf(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {}
                        Ok(_) => return,
                        Err(_) => {
                            let decided = HandedPlan {
                                plan,
                                body_checked: false,
                            };
                            return general(Prefixed::new(client, buf), stop, Some(decided)).await;
                        }
                    }
                }
            }
        }
    }
}

/// `X-Request-Id: <id>` for a reply's head.
fn append_id(out: &mut Vec<u8>, id: &RequestId) {
    out.extend_from_slice(b"X-Request-Id: ");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// One request: qualify it, then relay it (`relay`).
async fn exchange(app: &Arc<App>, client: &mut BusyPollStream, buf: &mut BytesMut) -> Outcome {
    // serve's added time runs from here (the request in hand) to the reply's head written,
    // less the backend's own time (`metrics::requests`).
    let began = Instant::now();
    let (fast, phases) = match qualify(app, buf, began) {
        Verdict::Fast(fast, phases) => (fast, phases),
        Verdict::HeadDue => return Outcome::HeadDue,
        Verdict::BodyDue(plan) => return Outcome::BodyDue(plan),
        Verdict::HandOver(decided) => return Outcome::HandOver(decided),
    };
    buf.advance(fast.consumed);
    relay::relay(app, client, buf, &fast, phases).await
}

/// Resolves when the client closes its connection (or it fails); bytes it sends meanwhile
/// are read and dropped. Only for a reply after which the connection closes.
async fn left(client: &mut BusyPollStream) {
    let mut scrap = [0u8; 256];
    while let Ok(n) = client.read(&mut scrap).await {
        if n == 0 {
            return;
        }
    }
}

/// `Date: <now>`, formatted once a second.
fn append_date(out: &mut Vec<u8>) {
    // Per thread, not configuration: each runtime worker keeps the last second it formatted,
    // so a reply's head costs no lock and no formatting.
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, String)> = const {
            std::cell::RefCell::new((0, String::new()))
        };
    }
    let now = std::time::SystemTime::now();
    let second = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second || cached.1.is_empty() {
            *cached = (second, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(b"Date: ");
        out.extend_from_slice(cached.1.as_bytes());
        out.extend_from_slice(b"\r\n");
    });
}
