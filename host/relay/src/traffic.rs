//! [`Traffic`]: what serve's requests share while it runs, held by `App` and passed to what
//! needs it (no global): the requests in flight, counted from reading the client's request to
//! the end of its reply on both engines and the in-process path; whether serve is draining or
//! stopping; and busy polling's budget and its one spinner. Busy polling reads the count (a
//! socket spins only when its request is the only one), `/metrics` shows it, and the drain on
//! SIGTERM waits for it to reach zero, not counting the requests the backend itself abandons
//! when it is told to stop.
//!
//! Those are llama-server's tool calls (`/tools`: a built-in tool or an MCP server's, which can
//! take as long as the tool does): at SIGTERM llama-server ends them at once (its terminating
//! flag) while it lets a generation run. Waiting the drain window for them would only delay the
//! stop that ends them anyway, so when nothing else is in flight the drain ends early and cuts
//! them (llama.cpp's `test_mcp_slow_tool_call_slot_release` asks for a stop within 3 s).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

/// The paths whose requests the backend abandons at its stop (see the module's text).
const ABANDONED_AT_STOP: [&str; 1] = ["/tools"];

/// Whether the backend abandons a request to `path` at its stop.
pub fn abandoned_at_stop(path: &str) -> bool {
    ABANDONED_AT_STOP.contains(&path)
}

/// What serve's requests share while it runs (see the module's text). One per serve, made
/// before the first connection is accepted.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Requests in flight now.
    in_flight: AtomicUsize,
    /// Of those, the relayed requests the backend abandons at its stop.
    abandoned: AtomicUsize,
    /// Set when the drain begins (SIGTERM or SIGINT); `/health` answers 503 `draining` from
    /// then on.
    draining: AtomicBool,
    /// Set once, when serve's drain window ends: every in-process route's sink fails from
    /// then on.
    stopping: AtomicBool,
    /// How long a socket may spin for an answer it is owed (`busy_poll`; zero: never).
    busy_poll: Duration,
    /// Whether a socket spins now: one at a time.
    spinning: AtomicBool,
    /// No socket spins before this time (microseconds on [`SPIN_CLOCK`]; 0: none paused):
    /// the machine was seen oversubscribed (`busy_poll`'s late yield).
    spin_paused_until_us: AtomicU64,
    /// The last pause's length, in microseconds: doubled when the machine is found starved
    /// again soon after it.
    spin_pause_us: AtomicU64,
    /// Times spinning was paused so: `onebit_busy_poll_pauses_total`.
    spin_pauses: AtomicU64,
}

/// The first pause of spinning after a late yield: short, so spinning resumes soon after a
/// brief burst of load.
pub const FIRST_SPIN_PAUSE: Duration = Duration::from_secs(1);
/// The longest: a machine starved for good pays a late yield (a few milliseconds) at most
/// this often.
pub const LONGEST_SPIN_PAUSE: Duration = Duration::from_secs(32);

/// The clock spinning's pause is kept on: microseconds from its first reading.
static SPIN_CLOCK: LazyLock<Instant> = LazyLock::new(Instant::now);

fn spin_clock_us(at: Instant) -> u64 {
    duration_us(at.saturating_duration_since(*SPIN_CLOCK))
}

fn duration_us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl Traffic {
    /// Traffic whose sockets may spin up to `busy_poll` for an answer (`busy_poll`).
    pub fn new(busy_poll: Duration) -> Arc<Traffic> {
        // The pause's clock starts before any instant a spin reads.
        LazyLock::force(&SPIN_CLOCK);
        Arc::new(Traffic {
            busy_poll,
            ..Traffic::default()
        })
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests in flight now that the drain waits for: every one but those the backend
    /// abandons at its stop.
    pub fn holding_the_stop(&self) -> usize {
        self.in_flight()
            .saturating_sub(self.abandoned.load(Ordering::Relaxed))
    }

    /// Whether serve is draining: told to stop, it finishes what it has and takes nothing new.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The drain began.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether the drain window ended: in-process routes' sends fail from then on.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The drain window ended (front's drain, at its end).
    pub fn host_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Busy polling's budget.
    pub fn busy_poll(&self) -> Duration {
        self.busy_poll
    }

    /// Take the one spinner's place, when no other socket holds it and spinning is not
    /// paused.
    pub fn start_spin(&self) -> bool {
        // The clock is read only when a pause was ever taken: a quiet machine's spin reads none.
        let paused = self.spin_paused_until_us.load(Ordering::Relaxed) > 0
            && self.spin_paused(Instant::now());
        !paused && !self.spinning.swap(true, Ordering::Acquire)
    }

    /// Whether spinning is paused at `now`.
    pub fn spin_paused(&self, now: Instant) -> bool {
        spin_clock_us(now) < self.spin_paused_until_us.load(Ordering::Relaxed)
    }

    /// A yield came back late at `now`: no socket spins for a while. The pause doubles (up to
    /// [`LONGEST_SPIN_PAUSE`]) when the machine is found starved again within the last pause's
    /// length after it ended, else it is [`FIRST_SPIN_PAUSE`]; the new pause's end.
    pub fn pause_spinning(&self, now: Instant) -> Instant {
        let at = spin_clock_us(now);
        let last_until = self.spin_paused_until_us.load(Ordering::Relaxed);
        let last = self.spin_pause_us.load(Ordering::Relaxed);
        let first = duration_us(FIRST_SPIN_PAUSE);
        let pause = if last > 0 && at < last_until.saturating_add(last) {
            last.saturating_mul(2).min(duration_us(LONGEST_SPIN_PAUSE))
        } else {
            first
        };
        self.spin_pause_us.store(pause, Ordering::Relaxed);
        self.spin_paused_until_us
            .fetch_max(at.saturating_add(pause), Ordering::Relaxed);
        self.spin_pauses.fetch_add(1, Ordering::Relaxed);
        now + Duration::from_micros(pause)
    }

    /// Times spinning was paused since serve started.
    pub fn spin_pauses(&self) -> u64 {
        self.spin_pauses.load(Ordering::Relaxed)
    }

    /// Give the spinner's place back.
    pub fn end_spin(&self) {
        self.spinning.store(false, Ordering::Release);
    }
}

/// One request, counted from reading the client's request until its reply body is finished
/// or dropped.
pub struct InFlight {
    traffic: Arc<Traffic>,
    abandoned: bool,
}

impl InFlight {
    pub fn begin(traffic: &Arc<Traffic>) -> Self {
        traffic.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            traffic: traffic.clone(),
            abandoned: false,
        }
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
            self.traffic.abandoned.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.abandoned {
            self.traffic.abandoned.fetch_sub(1, Ordering::Relaxed);
        }
        self.traffic.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
