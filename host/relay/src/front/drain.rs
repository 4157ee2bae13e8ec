//! The stop that finishes what it started: on SIGTERM `/health` answers 503 `draining` at once;
//! serve goes on answering for the notice (`--drain-notice-s`, 0 by default), so a gateway's
//! health check takes it out of its rotation before a connect is refused; then it stops
//! accepting, lets the requests in flight finish for what is left of the drain window
//! (`--drain-s`, counted from the signal), and at the window's end cuts what is still
//! in flight itself (every connection closed, every in-process route's sink failing with
//! `onebit_plugin_api::HOST_STOPPING`), so the backends it then stops are idle (llama-server sees its clients
//! leave and cancels their tasks) and exit at once. A stream cut so is never ended with a
//! `[DONE]` it did not get.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::traffic::Traffic;

/// What a drain cut.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Cut {
    /// Nothing: every request finished in the window (or none was in flight).
    Nothing,
    /// Requests the backend was serving: it must see them leave before it is told to stop
    /// (`backends::idle_before_stop`), or it may wait on them.
    Served,
    /// Only requests the backend ends itself at its stop (llama-server's tool calls): it is
    /// told to stop at once.
    Abandoned,
}

/// serve's listener task and the switch that stops it. Owned by `serve_plan`, used from
/// `supervise` on the runtime.
pub struct Drain {
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
    window: Duration,
    /// How long serve goes on accepting once `/health` says draining (within the window).
    notice: Duration,
    before_cut: Vec<Box<dyn Fn() + Send + Sync>>,
    /// The requests in flight, and where the drain and the stop are said.
    traffic: Arc<Traffic>,
}

impl Drain {
    pub fn new(
        shutdown: watch::Sender<bool>,
        server: JoinHandle<()>,
        window: Duration,
        notice: Duration,
        traffic: &Arc<Traffic>,
    ) -> Self {
        Drain {
            shutdown,
            server: Some(server),
            window,
            notice: notice.min(window),
            before_cut: Vec::new(),
            traffic: traffic.clone(),
        }
    }

    /// Run `f` just before a cut, while the requests it cuts still run (the prompt cache stops
    /// saving there: what is cut is not worth the stop's time).
    pub fn before_cut(&mut self, f: impl Fn() + Send + Sync + 'static) {
        self.before_cut.push(Box::new(f));
    }

    /// Say draining on `/health`; go on answering for the notice; stop accepting, then wait
    /// until every connection has finished its request in flight, or the window ends and what
    /// is left is cut. What the backend abandons at its own stop
    /// (llama-server's tool calls, `traffic`) is not waited for: once only such
    /// requests are left they are cut at once. Returns when the backends may be stopped, with
    /// what was cut.
    pub async fn run(&mut self, what: &str) -> Cut {
        self.traffic.start_draining();
        let window_ends = tokio::time::Instant::now() + self.window;
        if !self.notice.is_zero() && self.server.is_some() {
            tracing::info!(
                "1bit serve: {what}: /health answers 503 (draining); still answering for {:.1} s so a gateway stops sending here first",
                self.notice.as_secs_f64()
            );
            tokio::time::sleep(self.notice).await;
        }
        let _ = self.shutdown.send(true);
        let Some(server) = self.server.as_mut() else {
            return Cut::Nothing;
        };
        let busy = self.traffic.in_flight();
        let left = window_ends.saturating_duration_since(tokio::time::Instant::now());
        if busy > 0 && !left.is_zero() {
            tracing::info!(
                "1bit serve: {what}: no new connections; letting {busy} request(s) in flight finish for up to {:.1} s",
                left.as_secs_f64()
            );
        }
        let traffic = self.traffic.clone();
        let only_abandoned_left = async {
            while traffic.in_flight() == 0 || traffic.holding_the_stop() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        let cut = tokio::select! {
            _ = server => {
                self.server = None;
                return Cut::Nothing;
            }
            _ = tokio::time::sleep_until(window_ends) => {
                let left = self.traffic.in_flight();
                tracing::info!(
                    "1bit serve: {what}: the drain window ended with {left} request(s) in flight; cutting them"
                );
                if self.traffic.holding_the_stop() > 0 {
                    Cut::Served
                } else {
                    Cut::Abandoned
                }
            }
            _ = only_abandoned_left => {
                let left = self.traffic.in_flight();
                tracing::info!(
                    "1bit serve: {what}: only {left} tool call(s) left in flight, which the backend ends at its stop; cutting them"
                );
                Cut::Abandoned
            }
        };
        self.cut();
        self.server = None;
        cut
    }

    /// Cut every request still in flight: in-process routes' sinks fail from now on, and the
    /// listener task is aborted, which drops every connection task with it (their sockets
    /// close, the client sees its reply end early, each relayed request's backend connection
    /// closes). Does not wait.
    fn cut(&mut self) {
        self.before_cut.iter().for_each(|f| f());
        self.traffic.host_stopping();
        if let Some(server) = &self.server {
            server.abort();
        }
    }

    /// After the backends stopped: stop accepting (if not yet) and give the connections a last
    /// moment to close.
    pub async fn finish(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(server) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
        }
    }
}
