//! The relay: how a request reaches its backend and the reply comes back.
//!
//! Two engines carry requests. The fast engine (`fast`) serves every client connection first,
//! on the raw socket; what it does not carry it hands, with the bytes read so far, to the
//! general engine (`general`: hyper and axum). Both read and write through `busy_poll`.

pub mod app;
pub mod busy_poll;
pub mod fast;
pub mod general;
pub mod headers;
pub mod pool;

pub use app::App;

/// Resolves once serve is told to stop (or the sender is gone).
pub async fn stopped(shutdown: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
