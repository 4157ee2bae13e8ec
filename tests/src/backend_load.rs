//! What a test asks the fake backend behind a serve directly: how many generations it is
//! running (llama-server's `llamacpp:requests_processing`). serve's health probes and pooled
//! connections do not count, only a generation the backend is working on; so "the backend
//! stopped generating" is this count back at 0.

use std::time::Duration;

use crate::{Serve, get, wait_until};

/// The fake backend serve started first, asked on its own port.
pub struct BackendLoad {
    port: u16,
}

impl BackendLoad {
    /// The backend of `serve`'s first child, its port read from its argv (`--port`).
    pub fn of(serve: &Serve) -> BackendLoad {
        let child = serve.children()[0];
        let cmdline = std::fs::read_to_string(format!("/proc/{child}/cmdline")).unwrap();
        let args: Vec<&str> = cmdline.split('\0').collect();
        let i = args
            .iter()
            .position(|a| *a == "--port")
            .expect("the backend's --port");
        BackendLoad {
            port: args[i + 1].parse().expect("a port"),
        }
    }

    /// The generations the backend is running now (-1 when it did not say).
    pub fn generating(&self) -> f64 {
        let (_, text) = get(&format!("http://127.0.0.1:{}/metrics", self.port));
        text.lines()
            .find_map(|l| l.strip_prefix("llamacpp:requests_processing "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(-1.0)
    }

    /// Whether the backend was generating something within `limit`.
    pub fn starts_within(&self, limit: Duration) -> bool {
        wait_until(limit, || self.generating() >= 1.0)
    }

    /// Whether the backend stopped generating (its connection closed) within `limit`.
    pub fn stops_within(&self, limit: Duration) -> bool {
        wait_until(limit, || self.generating() == 0.0)
    }
}
