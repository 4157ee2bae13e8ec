//! Busy polling: a socket that has just sent a message and waits for the answer keeps asking
//! for it for a few microseconds before the runtime puts the thread to sleep.
//!
//! On a small or virtual machine a thread that sleeps in `epoll_wait` and is woken by the next
//! packet pays 20-30 µs of wake-up, and a relayed request meets waits that a direct request does
//! not: serve waiting for its backend's reply, and serve waiting for the client's next request
//! on a kept-alive connection (or the first one on a new connection). Linux offers the remedy
//! for network cards (`SO_BUSY_POLL`) but not for loopback, so serve does it itself: it asks
//! the socket (a non-blocking read into the reader's buffer, so the answer is taken in the call
//! that finds it; a `MSG_PEEK` where there is no buffer, as in hyper's flush) and yields the
//! CPU (`sched_yield`) in turn, a backend's socket yielding first (a request sent a moment
//! ago is never answered yet; a client's next request often is). The yield matters: the
//! thread that owes the answer was often just woken onto this very CPU (the kernel places a
//! wakee near its waker), and a bare spin would keep it from running; measured on the 2-core
//! VM, a bare spin made the backend's reply 20 µs later, the yielding one 25 µs sooner.
//!
//! Within strict limits:
//! - once per message sent: after this socket wrote (hyper flushes a whole message, and the
//!   spin runs there, or at the next read), and on a client's new connection; a socket that
//!   just read keeps reading without spinning, so an idle pooled connection never spins, and a
//!   streamed reply whose events are milliseconds apart spins once per request, not per event;
//! - only when no other request is being relayed: a client's socket spins when no request is
//!   in flight at all, a backend socket when its own request is the only one, so a spin never
//!   delays another request's bytes on the one runtime thread;
//! - only on relayed requests' sockets: serve's own calls to a backend (health, metrics, the
//!   route's host services) use streams that never spin (`BusyPollStream::plain`);
//! - one spinner at a time, for at most the budget (`ONEBIT_BUSY_POLL_US`, 50 µs by default;
//!   0 turns it off), then the socket waits as usual;
//! - never on a starved machine: a yield that comes back late ([`LATE_YIELD`]) gave the CPU to
//!   another runnable thread for its whole slice (a CPU hog, a build, the model's own
//!   threads), a wait of milliseconds where the spin was to save microseconds; the spin ends
//!   there and no socket spins for a second, twice as long each time the machine is found
//!   starved again soon after a pause, up to half a minute (`Traffic::pause_spinning`;
//!   `onebit_busy_poll_pauses_total` counts the pauses). Beside a hog at the same priority on
//!   every core a tenth of yields came back 3-7 ms late here, where sleeping in `epoll_wait`
//!   is woken within tens of microseconds (a wakee runs before a hog whose slice is spent).
//!
//! The figures this buys and what it costs are in docs/performance.md. On a virtual machine
//! whose host is overcommitted a spinning vCPU competes with the VM's other vCPUs for the
//! host's time, unseen by the guest's yields; there `ONEBIT_BUSY_POLL_US=0` is the safer
//! setting.

use std::io::{self, Read};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::client::legacy::connect::{Connected, Connection};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::traffic::Traffic;

/// The budget when `ONEBIT_BUSY_POLL_US` is unset.
pub const DEFAULT_BUDGET: Duration = Duration::from_micros(50);

/// A yield that takes this long gave the CPU away for another thread's slice (a yield on a
/// CPU with nothing else to run returns within microseconds; one that lets the backend answer
/// within tens).
pub const LATE_YIELD: Duration = Duration::from_micros(500);

/// The spin budget from `ONEBIT_BUSY_POLL_US`'s text (clap reads it): whole microseconds, at
/// most 10 ms; unset or not a whole number: the default (as serve's other numeric variables).
pub fn parse_budget(value: Option<&str>) -> Duration {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_BUDGET, |us| Duration::from_micros(us.min(10_000)))
}

/// Which end of the hop a socket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// A client's connection to serve: after serve answers, the client's next request is due.
    Client,
    /// serve's connection to a backend: after serve sends a request, the reply is due.
    Backend,
}

/// A TCP stream that busy-polls for an answer it is owed (see the module's text).
pub struct BusyPollStream {
    tcp: TcpStream,
    side: Side,
    /// The count in flight, the budget and the one spinner.
    traffic: Arc<Traffic>,
    /// This socket sent a message since bytes last came in, and has not spun for its answer
    /// yet: it may spin once.
    may_spin_once: bool,
    /// A spin saw bytes waiting that the runtime does not know of yet: read them directly.
    bytes_waiting: bool,
    /// The error a spin's peek took from the socket (a reset): the kernel reports it once, so
    /// the next read returns it rather than the bare end of stream that follows.
    peeked_error: Option<io::Error>,
}

impl BusyPollStream {
    pub fn new(tcp: TcpStream, side: Side, traffic: &Arc<Traffic>) -> Self {
        BusyPollStream {
            tcp,
            side,
            traffic: traffic.clone(),
            // A client that has just connected owes serve its first request.
            may_spin_once: side == Side::Client,
            bytes_waiting: false,
            peeked_error: None,
        }
    }

    /// Whether an idle pooled connection is still open: nothing to read, no end of stream.
    pub fn is_idle_open(&self) -> bool {
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        matches!(
            socket2::SockRef::from(&self.tcp).peek(&mut byte),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        )
    }

    /// Take this socket's one spin if it may spin now (once per message sent, within the
    /// limits above): when its spin ends, a backend's socket having yielded once. The spinner
    /// gives the spinner's place back when it is done.
    fn begin_spin(&mut self) -> Option<Instant> {
        if !std::mem::take(&mut self.may_spin_once) {
            return None;
        }
        let budget = self.traffic.busy_poll();
        let own = usize::from(self.side == Side::Backend);
        if budget.is_zero() || self.traffic.in_flight() > own || !self.traffic.start_spin() {
            return None;
        }
        let spin_ends = Instant::now() + budget;
        // A backend has not answered a request sent a moment ago: it runs first, so the
        // first ask can find its answer (a client's next request is often there already).
        if self.side == Side::Backend && !yield_in_time(&self.traffic) {
            self.traffic.end_spin();
            return None;
        }
        Some(spin_ends)
    }

    /// Spin until bytes are waiting or the budget is spent; true when they are. For a caller
    /// with no buffer to read into (a flush).
    fn spin(&mut self) -> bool {
        let Some(spin_ends) = self.begin_spin() else {
            return false;
        };
        let socket = socket2::SockRef::from(&self.tcp);
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        let waiting = loop {
            match socket.peek(&mut byte) {
                // Bytes, or the end of the stream: either way a read answers now.
                Ok(_) => break true,
                Err(e) if would_block(&e) => {}
                Err(e) => {
                    self.peeked_error = Some(e);
                    break true;
                }
            }
            if !yield_until(&self.traffic, spin_ends) {
                break false;
            }
        };
        self.traffic.end_spin();
        self.bytes_waiting = waiting;
        waiting
    }

    /// Spin by reading into `buf` until the answer comes or the budget is spent: the answer
    /// read (bytes, the end of the stream or an error), or None with `buf` untouched.
    fn spin_reading(&mut self, buf: &mut ReadBuf<'_>) -> Option<io::Result<()>> {
        let spin_ends = self.begin_spin()?;
        let socket = socket2::SockRef::from(&self.tcp);
        let mut reader: &socket2::Socket = &socket;
        let read = loop {
            match reader.read(buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    break Some(Ok(()));
                }
                Err(e) if would_block(&e) => {}
                Err(e) => break Some(Err(e)),
            }
            if !yield_until(&self.traffic, spin_ends) {
                break None;
            }
        };
        self.traffic.end_spin();
        read
    }

    /// Read what a spin found, past the runtime's readiness (which says "not yet" until its
    /// next `epoll_wait`); None when there was nothing after all.
    fn read_waiting(&mut self, buf: &mut ReadBuf<'_>) -> Option<io::Result<()>> {
        self.bytes_waiting = false;
        if let Some(e) = self.peeked_error.take() {
            return Some(Err(e));
        }
        let socket = socket2::SockRef::from(&self.tcp);
        let mut reader: &socket2::Socket = &socket;
        match reader.read(buf.initialize_unfilled()) {
            Ok(n) => {
                buf.advance(n);
                Some(Ok(()))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// A non-blocking socket call that found nothing yet.
fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Between two asks of a spin: false once the spin's end has passed or a yield came back
/// late, else true, having yielded the CPU. Not a bare spin: the thread that owes the answer
/// was often just woken onto this CPU (the kernel places a wakee near its waker), and must run
/// here first.
fn yield_until(traffic: &Traffic, spin_ends: Instant) -> bool {
    Instant::now() < spin_ends && yield_in_time(traffic)
}

/// Yield the CPU; false when the yield came back late ([`LATE_YIELD`]): the machine is
/// oversubscribed, and spinning pauses (`Traffic::pause_spinning`).
fn yield_in_time(traffic: &Traffic) -> bool {
    let asked = Instant::now();
    std::thread::yield_now();
    let back = Instant::now();
    if back.duration_since(asked) < LATE_YIELD {
        return true;
    }
    traffic.pause_spinning(back);
    false
}

impl AsyncRead for BusyPollStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.bytes_waiting
            && let Some(read) = this.read_waiting(buf)
        {
            this.may_spin_once = false;
            return Poll::Ready(read);
        }
        // An answer owed is asked for by reads into `buf` (the spin takes this socket's one
        // chance to spin, whether it may spin now or not), so the call that finds it takes it.
        if let Some(read) = this.spin_reading(buf) {
            return Poll::Ready(read);
        }
        // Nothing yet, or no spin: the runtime's read, which registers its interest so the
        // waker fires when bytes come.
        Pin::new(&mut this.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for BusyPollStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.tcp).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            this.may_spin_once = true;
        }
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.tcp).poll_write_vectored(cx, bufs);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            this.may_spin_once = true;
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    /// hyper flushes once it has handed over a whole message (or as much as it has): the
    /// answer is owed from here, and a spin here catches it even when hyper polled the read
    /// before it wrote (its client connection does), waking the task to read it.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.tcp).poll_flush(cx);
        if flushed.is_ready() && this.spin() {
            cx.waker().wake_by_ref();
        }
        flushed
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

impl Connection for BusyPollStream {
    fn connected(&self) -> Connected {
        self.tcp.connected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_whole_microseconds_capped_at_10_ms() {
        assert_eq!(parse_budget(None), DEFAULT_BUDGET);
        assert_eq!(parse_budget(Some("0")), Duration::ZERO);
        assert_eq!(parse_budget(Some(" 120 ")), Duration::from_micros(120));
        assert_eq!(parse_budget(Some("99999999")), Duration::from_millis(10));
        assert_eq!(parse_budget(Some("-1")), DEFAULT_BUDGET);
        assert_eq!(parse_budget(Some("fast")), DEFAULT_BUDGET);
    }

    /// While spinning is paused no socket takes the spinner's place; once the pause has
    /// passed one does again. Starved again soon after a pause, the next is twice as long, up
    /// to the longest; starved again long after, it is the first's length again.
    #[test]
    fn a_pause_holds_every_spin_and_doubles_while_the_machine_stays_starved() {
        use crate::traffic::{FIRST_SPIN_PAUSE, LONGEST_SPIN_PAUSE};
        let traffic = Traffic::new(DEFAULT_BUDGET);
        let t0 = Instant::now();
        let ends = traffic.pause_spinning(t0);
        assert_eq!(ends - t0, FIRST_SPIN_PAUSE);
        assert!(!traffic.start_spin(), "spun while paused");
        assert!(traffic.spin_paused(ends - Duration::from_millis(1)));
        assert!(!traffic.spin_paused(ends));
        assert_eq!(traffic.spin_pauses(), 1);
        // Starved again just after the pause: twice as long, and so on up to the longest.
        let mut at = ends;
        let mut pause = FIRST_SPIN_PAUSE;
        for _ in 0..8 {
            let next = traffic.pause_spinning(at + Duration::from_millis(10));
            pause = (pause * 2).min(LONGEST_SPIN_PAUSE);
            assert_eq!(next - (at + Duration::from_millis(10)), pause);
            at = next;
        }
        assert_eq!(pause, LONGEST_SPIN_PAUSE);
        // Quiet for longer than the last pause: back to the first.
        let later = at + LONGEST_SPIN_PAUSE + Duration::from_secs(1);
        assert_eq!(traffic.pause_spinning(later) - later, FIRST_SPIN_PAUSE);
        let fresh = Traffic::new(DEFAULT_BUDGET);
        assert!(fresh.start_spin(), "spinning held with no pause");
    }

    /// Pin the calling thread to `cpu`.
    fn pin_to(cpu: usize) {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).unwrap();
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
    }

    /// With a busy thread on the same CPU, yields come back late now and then (the busy thread
    /// ran its slice): the first late one pauses spinning for every socket.
    #[test]
    fn a_yield_that_gives_the_cpu_away_pauses_spinning() {
        let cpu = nix::sched::sched_getcpu().unwrap();
        pin_to(cpu);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let hog = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                pin_to(cpu);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let traffic = Traffic::new(DEFAULT_BUDGET);
        let began = Instant::now();
        let mut late = false;
        while !late && began.elapsed() < Duration::from_secs(10) {
            late = !yield_in_time(&traffic);
            // As a socket does between messages: the next yield comes after a wait.
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        hog.join().unwrap();
        assert!(late, "no yield came back late beside a busy thread in 10 s");
        assert!(traffic.spin_paused(Instant::now()));
        assert!(!traffic.start_spin());
        assert_eq!(traffic.spin_pauses(), 1);
    }

    /// A client socket spins once for the request it is owed, reads it past the runtime's
    /// readiness, and does not spin again until it has written.
    #[tokio::test(flavor = "current_thread")]
    async fn a_socket_reads_the_bytes_its_spin_found() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut peer = std::net::TcpStream::connect(addr).unwrap();
        let (tcp, _) = listener.accept().await.unwrap();
        let traffic = Traffic::new(DEFAULT_BUDGET);
        let mut stream = BusyPollStream::new(tcp, Side::Client, &traffic);
        std::io::Write::write_all(&mut peer, b"ping").unwrap();
        let mut buf = [0u8; 16];
        let n = stream.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"ping");
        assert!(!stream.may_spin_once, "the answer came: no spin is owed");
        stream.write_all(b"pong").await.unwrap();
        assert!(
            stream.may_spin_once,
            "a message went out: its answer is owed"
        );
        let mut back = [0u8; 4];
        std::io::Read::read_exact(&mut peer, &mut back).unwrap();
        assert_eq!(&back, b"pong");
        drop(peer);
        let n = stream.read(&mut buf).await.unwrap();
        assert_eq!(n, 0, "the end of the stream is read, spin or not");
    }
}
