//! The front door: serve's listening socket, each connection handed to the relay's fast
//! engine first and to hyper's HTTP/1 loop (the general engine) when it steps aside.

use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

use crate::App;
use crate::busy_poll::{BusyPollStream, Side};
use crate::front::endpoints;
use crate::plan::HandedPlan;
use crate::{fast, stopped};
use onebit_features::guard;

/// Serve HTTP/1 on `listener` until `shutdown` turns true, then let each connection finish
/// its request in flight. hyper's own connection loop rather than `axum::serve`, because only
/// it bounds the time a client may take to send its headers: a client that trickles them is
/// dropped after `header_timeout`, holding nothing but its socket until then.
pub async fn accept_loop(
    listeners: Vec<tokio::net::TcpListener>,
    app: Arc<App>,
    header_timeout: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let router = endpoints::router(app.clone());
    let mut http = http1::Builder::new();
    // Reply headers in Title-Case, as llama-server (cpp-httplib) writes them and as the fast
    // engine relays them: a client that reads a header's exact case (llama.cpp's own server
    // tests read `Process-Start-Time-Unix` from a dict) sees the same bytes on both engines.
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .title_case_headers(true);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let tcp = tokio::select! {
            accepted = accept_any(&listeners) => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors and the like: say so, and do not spin.
                    tracing::info!("1bit serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            () = stopped(&mut shutdown) => break,
        };
        let _ = tcp.set_nodelay(true);
        let client = BusyPollStream::new(tcp, Side::Client, &app.traffic);
        let (http, router) = (http.clone(), router.clone());
        // The fast engine first; what it does not carry goes to hyper and axum, with the
        // plan it made for the request it handed over.
        let general = move |io, mut stop, decided: Option<HandedPlan>| async move {
            let service = Handed {
                decided: std::sync::Mutex::new(decided),
                router: TowerToHyperService::new(router),
            };
            let connection = http.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => return,
                () = stopped(&mut stop) => {}
            }
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        };
        connections.spawn(fast::serve_connection(
            client,
            app.clone(),
            header_timeout,
            shutdown.clone(),
            general,
        ));
    }
    drop(listeners);
    while connections.join_next().await.is_some() {}
}

/// The general engine's service on a connection the fast engine handed over: the first
/// request hyper reads is the one the fast engine judged, and carries its plan ([`HandedPlan`])
/// and the guard's pass ([`guard::GuardPassed`]) so neither is made again.
struct Handed {
    decided: std::sync::Mutex<Option<HandedPlan>>,
    router: TowerToHyperService<axum::Router>,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Handed {
    type Response = <TowerToHyperService<axum::Router> as hyper::service::Service<
        hyper::Request<hyper::body::Incoming>,
    >>::Response;
    type Error = <TowerToHyperService<axum::Router> as hyper::service::Service<
        hyper::Request<hyper::body::Incoming>,
    >>::Error;
    type Future = <TowerToHyperService<axum::Router> as hyper::service::Service<
        hyper::Request<hyper::body::Incoming>,
    >>::Future;

    fn call(&self, mut request: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        let decided = self
            .decided
            .lock()
            .map(|mut d| d.take())
            .unwrap_or_default();
        if let Some(decided) = decided {
            request.extensions_mut().insert(decided);
            request.extensions_mut().insert(guard::GuardPassed);
        }
        self.router.call(request)
    }
}

/// The next connection on any of the listeners (one per `--host` address).
async fn accept_any(
    listeners: &[tokio::net::TcpListener],
) -> std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)> {
    match listeners {
        [one] => one.accept().await,
        many => {
            let accepts = many.iter().map(|l| Box::pin(l.accept()));
            futures_util::future::select_all(accepts).await.0
        }
    }
}
