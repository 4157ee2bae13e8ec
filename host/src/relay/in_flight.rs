//! The requests in flight: counted from reading the client's request to the end of its reply,
//! on both engines and the in-process path. Busy polling reads the count (a socket spins only
//! when its request is the only one), `/metrics` shows it, and the drain on SIGTERM waits for
//! it to reach zero, not counting the requests the backend itself abandons when it is told to
//! stop.
//!
//! Those are llama-server's tool calls (`/tools`: a built-in tool or an MCP server's, which can
//! take as long as the tool does): at SIGTERM llama-server ends them at once (its terminating
//! flag) while it lets a generation run. Waiting the drain window for them would only delay the
//! stop that ends them anyway, so when nothing else is in flight the drain ends early and cuts
//! them (llama.cpp's `test_mcp_slow_tool_call_slot_release` asks for a stop within 3 s).

use std::sync::atomic::{AtomicUsize, Ordering};

/// The paths whose requests the backend abandons at its stop (see the module's text).
const ABANDONED_AT_STOP: [&str; 1] = ["/tools"];

/// Whether the backend abandons a request to `path` at its stop.
pub fn abandoned_at_stop(path: &str) -> bool {
    ABANDONED_AT_STOP.contains(&path)
}

/// Requests in flight now.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Of those, the relayed requests the backend abandons at its stop.
static ABANDONED: AtomicUsize = AtomicUsize::new(0);

/// Requests in flight now.
pub fn in_flight() -> usize {
    IN_FLIGHT.load(Ordering::Relaxed)
}

/// Requests in flight now that the drain waits for: every one but those the backend abandons
/// at its stop.
pub fn holding_the_stop() -> usize {
    in_flight().saturating_sub(ABANDONED.load(Ordering::Relaxed))
}

/// One request, counted from reading the client's request until its reply body is finished
/// or dropped.
pub struct InFlight {
    abandoned: bool,
}

impl InFlight {
    pub fn begin() -> Self {
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        InFlight { abandoned: false }
    }

    /// The request is relayed to a backend at `path`: counted among those the backend abandons
    /// at its stop when it is one of them.
    pub fn relayed_to(&mut self, path: &str) {
        if abandoned_at_stop(path) {
            self.abandoned_at_stop();
        }
    }

    /// The request is one the backend abandons at its stop.
    pub fn abandoned_at_stop(&mut self) {
        if !self.abandoned {
            self.abandoned = true;
            ABANDONED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.abandoned {
            ABANDONED.fetch_sub(1, Ordering::Relaxed);
        }
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}
