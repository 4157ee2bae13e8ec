//! The relay's connections to the backends: the fast engine's own pool of idle keep-alive
//! sockets, and the general engine's pooled hyper client. Both busy-poll (`busy_poll`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::Uri;
use hyper::body::{Body as _, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{HttpConnector, capture_connection};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::busy_poll::{BusyPollStream, Side};
use crate::traffic::Traffic;

/// Idle backend connections kept for reuse, all backends together.
const MAX_IDLE: usize = 128;

/// How long a backend connection may sit idle and still be reused (`backends::health`).
pub use onebit_supervision::backends::health::IDLE_LIMIT;

/// Idle keep-alive connections to the backends, the most recently used last.
pub struct BackendPool {
    idle: Mutex<Vec<Idle>>,
    limit: Duration,
    /// What the connections' busy polling reads.
    traffic: Arc<Traffic>,
}

struct Idle {
    port: u16,
    conn: BusyPollStream,
    since: Instant,
}

impl BackendPool {
    /// A pool that reuses a connection idle for less than [`IDLE_LIMIT`].
    pub fn new(traffic: &Arc<Traffic>) -> Self {
        BackendPool::with_idle_limit(IDLE_LIMIT, traffic)
    }

    /// A pool that reuses a connection idle for less than `limit`.
    pub fn with_idle_limit(limit: Duration, traffic: &Arc<Traffic>) -> Self {
        BackendPool {
            idle: Mutex::new(Vec::new()),
            limit,
            traffic: traffic.clone(),
        }
    }

    /// An idle connection to `port` that the backend has not closed and that has been idle for
    /// less than the limit, else a new one; whether it was reused. Each idle connection is asked (one non-blocking `MSG_PEEK`) whether the
    /// backend closed it before a request goes on it: a close seen then costs nothing, while
    /// one seen after the request is sent may mean the backend took the request, which must
    /// not be sent twice. Called by the fast engine on the connection's task.
    pub async fn checkout(&self, port: u16) -> std::io::Result<(BusyPollStream, bool)> {
        loop {
            let found = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                idle.iter()
                    .rposition(|i| i.port == port)
                    .map(|i| idle.remove(i))
            };
            match found {
                Some(idle) if idle.since.elapsed() < self.limit && idle.conn.is_idle_open() => {
                    return Ok((idle.conn, true));
                }
                Some(_) => continue,
                None => break,
            }
        }
        Ok((self.connect(port).await?, false))
    }

    /// A new connection to `port`, never a pooled one (the fast engine's one retry takes it).
    pub async fn connect(&self, port: u16) -> std::io::Result<BusyPollStream> {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
        tcp.set_nodelay(true)?;
        Ok(BusyPollStream::new(tcp, Side::Backend, &self.traffic))
    }

    /// Keep a connection whose reply ended cleanly for the next request to `port`.
    pub fn checkin(&self, port: u16, conn: BusyPollStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() >= MAX_IDLE {
            idle.remove(0);
        }
        idle.push(Idle {
            port,
            conn,
            since: Instant::now(),
        });
    }
}

/// The general engine's pooled client toward the backends.
pub type BackendClient = Client<BackendConnector, Full<Bytes>>;

/// The general engine's client toward the backends: its sockets busy-poll for replies. Built
/// once by `serve`, on the runtime.
pub fn backend_client(traffic: &Arc<Traffic>) -> BackendClient {
    onebit_supervision::backends::health::pooled_client(|http| BackendConnector {
        http,
        traffic: traffic.clone(),
    })
}

/// Send a relayed request on the general engine's client and wait for its reply's head. After a
/// reply of unknown length (chunked: a stream) the connection is not pooled, as the fast
/// engine's `ReplyHead::keeps_connection` rules: llama-server (its cpp-httplib) closes the
/// connection after every stream without `Connection: close`, and a request hyper's pool put on
/// it before that FIN arrived would meet a close after it was written, which hyper does not
/// retry (it cannot know the backend did not take it) and serve answers with a 502. Called by
/// `general` on the request's task; the pool's own connections never block it.
pub fn send(
    client: &BackendClient,
    mut request: hyper::Request<Full<Bytes>>,
) -> impl Future<Output = Result<hyper::Response<Incoming>, hyper_util::client::legacy::Error>>
+ Send
+ 'static {
    let connection = capture_connection(&mut request);
    let pending = client.request(request);
    async move {
        let reply = pending.await?;
        if reply.body().size_hint().exact().is_none()
            && let Some(connected) = connection.connection_metadata().as_ref()
        {
            // The pool neither takes it back nor hands it out; hyper closes it once the body
            // has ended.
            connected.poison();
        }
        Ok(reply)
    }
}

/// hyper-util's TCP connector, handing out [`BusyPollStream`]s (`busy_poll`).
#[derive(Clone)]
pub struct BackendConnector {
    http: HttpConnector,
    traffic: Arc<Traffic>,
}

type ConnectError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Uri> for BackendConnector {
    type Response = TokioIo<BusyPollStream>;
    type Error = ConnectError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, ConnectError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), ConnectError>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        let traffic = self.traffic.clone();
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            Ok(TokioIo::new(BusyPollStream::new(
                tcp,
                Side::Backend,
                &traffic,
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_idle_past_the_limit_is_not_reused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        // The backend keeps every connection open.
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                open.push(s);
            }
        });
        let pool = BackendPool::with_idle_limit(
            Duration::from_millis(200),
            &Traffic::new(crate::busy_poll::DEFAULT_BUDGET),
        );
        let (conn, reused) = pool.checkout(port).await.unwrap();
        assert!(!reused);
        pool.checkin(port, conn);
        let (conn, reused) = pool.checkout(port).await.unwrap();
        assert!(reused, "idle for less than the limit");
        pool.checkin(port, conn);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (_, reused) = pool.checkout(port).await.unwrap();
        assert!(!reused, "idle past the limit: a new connection");
        held.abort();
    }
}

#[cfg(test)]
mod send_tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt as _;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// A backend that keeps every connection open and answers each GET whole
    /// (`Content-Length`), or chunked for a path with `stream` in it; it counts connections.
    async fn backend() -> (u16, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = tcp.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        head.extend_from_slice(&buf[..n]);
                        if !head.ends_with(b"\r\n\r\n") {
                            continue;
                        }
                        let reply: &[u8] = if head.windows(6).any(|w| w == b"stream") {
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
                        } else {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
                        };
                        head.clear();
                        if tcp.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (port, accepted)
    }

    async fn get(client: &BackendClient, port: u16, path: &str) {
        let request = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let reply = send(client, request).await.unwrap();
        let body = reply.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"hi");
        // hyper hands a connection back to its pool on a task of its own.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    #[tokio::test]
    async fn a_chunked_replys_connection_is_not_reused_and_a_whole_ones_is() {
        let client = backend_client(&crate::traffic::Traffic::new(
            crate::busy_poll::DEFAULT_BUDGET,
        ));
        let (port, accepted) = backend().await;
        get(&client, port, "/whole").await;
        get(&client, port, "/whole").await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "a whole reply's is reused"
        );
        get(&client, port, "/stream").await;
        get(&client, port, "/stream").await;
        get(&client, port, "/whole").await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            3,
            "each chunked reply's connection is left, the next request takes a new one"
        );
    }
}
