//! `FAKE_CLOSE_AFTER_STREAM_MS`: llama-server's close of a connection after every streamed
//! reply (cpp-httplib closes it without `Connection: close`), with the FIN held back so that a
//! request a client writes on that connection meanwhile meets the close every time.
//!
//! `axum::serve` owns its connections, so in this mode the fake runs its own accept loop: each
//! connection is served by hyper's HTTP/1 server over [`Deaf`], whose reads stop once the
//! connection's stream has ended ([`StreamEnd`], marked by [`mark_end`] as the body's last frame
//! is taken). The connection's task then lets hyper write the body's end, waits the chosen time,
//! drops hyper's side and sends the FIN on a second descriptor of the same socket, reading (and
//! discarding) until the peer closes too, so the peer sees a clean close, not a reset (a reset
//! would say the request was never read, and a client may send it again).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, header};
use axum::response::Response;
use futures_util::StreamExt as _;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// How long the closed connection waits for the peer's own close before it is dropped anyway.
const PEER_CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// Whether a connection's streamed reply has ended; shared by the connection's task, its
/// [`Deaf`] reads and (as a request extension) the dispatcher that marks the end.
#[derive(Default)]
pub struct StreamEnd {
    ended: AtomicBool,
    notify: Notify,
}

impl StreamEnd {
    /// The stream's last frame was taken: read nothing more on this connection. Called on the
    /// connection's task as hyper polls the body; does not block.
    fn mark(&self) {
        self.ended.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    async fn ended(&self) {
        // `notify_one` keeps a permit for a mark made before this waits.
        while !self.has_ended() {
            self.notify.notified().await;
        }
    }
}

/// `response` with its end marked on `end` if it is a stream (`text/event-stream`); any other
/// response as it is. Called by the dispatcher for every response in this mode.
pub fn mark_end(response: Response, end: Arc<StreamEnd>) -> Response {
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streamed {
        return response;
    }
    let (parts, body) = response.into_parts();
    let marker = futures_util::stream::poll_fn(move |_| {
        end.mark();
        Poll::Ready(None)
    });
    Response::from_parts(
        parts,
        Body::from_stream(body.into_data_stream().chain(marker)),
    )
}

/// Serves `app` on `listener` until the process ends, closing each connection `after` its
/// first streamed reply. Called once by `main` instead of `axum::serve`.
pub async fn serve(listener: TcpListener, app: Router, after: Duration) {
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                // As axum::serve does: a full descriptor table passes, so wait, then go on.
                log!("fake-backend: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Small SSE writes must leave at once, not wait for Nagle.
        let _ = tcp.set_nodelay(true);
        tokio::spawn(connection(tcp, app.clone(), after));
    }
}

/// One connection: served until it ends, or closed `after` its stream ended.
async fn connection(tcp: TcpStream, app: Router, after: Duration) {
    let (tcp, second) = match second_descriptor(tcp) {
        Ok(pair) => pair,
        Err(e) => {
            log!("fake-backend: cannot duplicate a connection's socket: {e}");
            return;
        }
    };
    let end = Arc::new(StreamEnd::default());
    let io = TokioIo::new(Deaf {
        tcp,
        end: Arc::clone(&end),
    });
    let handle = Arc::clone(&end);
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        req.extensions_mut().insert(Arc::clone(&handle));
        let mut app = app.clone();
        tower_service::Service::call(&mut app, req.map(Body::new))
    });
    let mut conn =
        Box::pin(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
    let closing = async {
        end.ended().await;
        tokio::time::sleep(after).await;
    };
    tokio::select! {
        _ = conn.as_mut() => return,
        () = closing => {}
    }
    drop(conn);
    close_cleanly(second).await;
}

/// The connection as tokio's stream, and a second descriptor of its socket to close it with
/// once hyper's is dropped.
fn second_descriptor(tcp: TcpStream) -> io::Result<(TcpStream, std::net::TcpStream)> {
    let std = tcp.into_std()?;
    let second = std.try_clone()?;
    Ok((TcpStream::from_std(std)?, second))
}

/// Send the FIN, then read and discard until the peer closes (or a while passes), so that the
/// request it wrote is read before the socket closes: a socket closed with unread bytes
/// sends a reset instead of llama-server's clean close.
async fn close_cleanly(second: std::net::TcpStream) {
    let Ok(mut tcp) = TcpStream::from_std(second) else {
        return;
    };
    let _ = tcp.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 4096];
        while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
    };
    let _ = tokio::time::timeout(PEER_CLOSE_LIMIT, drain).await;
}

/// The connection's socket as hyper sees it: once its stream has ended, reads never complete,
/// as llama-server reads nothing more on a connection it is about to close.
struct Deaf {
    tcp: TcpStream,
    end: Arc<StreamEnd>,
}

impl AsyncRead for Deaf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.end.has_ended() {
            // No waker is kept: the connection's task drops this connection at its deadline.
            return Poll::Pending;
        }
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Deaf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
