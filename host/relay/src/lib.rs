//! The relay: how a request reaches its backend and the reply comes back. The accept loop
//! and serve's own routes are [`front`]'s; what every request reads, fixed before the first,
//! is [`settings`]'s; one request's phases are [`exchange`]'s.
//!
//! Each request gets one decision, a [`plan::RelayPlan`]: where it goes, what is rewritten,
//! whether the watchdog tracks it, which engine carries it. Two engines carry requests. The
//! fast engine (`fast`) serves every client connection first, on the raw socket, and carries
//! the plans that need no rewrite; it hands every other request, with its plan and the bytes
//! read so far, to the general engine (`general`: hyper and axum), which carries the rest
//! (the body's rewrites, the route's `forward`, `in_process`). Both drive one reply loop
//! (`reply_loop`): what happens to a reply while it flows (the served name, comments in
//! silences, the early stream, the `deadline`) is decided there once. Which headers pass and the
//! backend's request head are `plan`'s one function each; the backend connections are
//! `pool`'s; both engines read and write through `busy_poll`.

#![forbid(unsafe_code)]

pub mod app;
pub mod attribution;
pub mod busy_poll;
pub mod deadline;
pub mod exchange;
pub mod fast;
pub mod front;
pub mod general;
pub mod in_process;
pub mod plan;
pub mod pool;
pub mod reply_loop;
pub mod request_id;
pub mod served_name;
pub mod settings;
pub mod sse_keepalive;
pub mod traffic;
pub mod wire;

pub use app::App;

/// Resolves once serve is told to stop (or the sender is gone).
pub async fn stopped(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
