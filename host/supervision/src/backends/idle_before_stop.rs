//! At a stop, after serve cut the requests still in flight: wait until each backend has closed
//! its end of the connections serve closed, so the backend is idle when it is told to stop.
//!
//! llama-server notices a client that left only when it next looks (between tokens, or its
//! poll of the socket); told to stop before that, it waits 30 s on the task it was serving
//! (measured: 1 stop in 10 to 16 with a stream cut a moment before SIGTERM). Closed at
//! serve's end, not yet at the backend's, is the kernel's FIN_WAIT state of serve's socket,
//! which the socket keeps after serve dropped it; so the wait needs nothing of the backend.

use std::path::Path;
use std::time::Duration;

use super::tcp_table;

/// How often the kernel's table is read while waiting.
const POLL: Duration = Duration::from_millis(5);

/// Connections to a port in `backend_ports` that serve closed and the backend has not.
pub fn not_let_go(proc_root: &Path, backend_ports: &[u16]) -> usize {
    tcp_table::closed_here_not_there(proc_root, backend_ports)
}

/// Wait until no connection to the backends is left half closed, or `deadline`. Returns how
/// many were still half closed then. Runs on the runtime; each look reads /proc briefly.
pub async fn until_let_go(backend_ports: &[u16], deadline: tokio::time::Instant) -> usize {
    let proc_root = Path::new("/proc");
    until_none(|| not_let_go(proc_root, backend_ports), deadline).await
}

/// Look every [`POLL`] until `look` says none twice in a row, or `deadline`; what it said
/// last. The kernel writes its table in pieces, and a row that moves while it is read can be
/// missed (seen in the suite, sockets opening and closing beside it), so one "none" is not
/// taken at its word.
async fn until_none(mut look: impl FnMut() -> usize, deadline: tokio::time::Instant) -> usize {
    let mut nothing_seen = false;
    loop {
        let left = look();
        if (left == 0 && nothing_seen) || tokio::time::Instant::now() >= deadline {
            return left;
        }
        nothing_seen = left == 0;
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[tokio::test]
    async fn one_read_of_none_between_two_of_some_does_not_end_the_wait() {
        // A row missed once (the 0 between two 1s), then really none.
        let mut said = [1, 0, 1, 0, 0].into_iter();
        let mut looks = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let left = until_none(
            || {
                looks += 1;
                said.next().unwrap_or(0)
            },
            deadline,
        )
        .await;
        assert_eq!((left, looks), (0, 5));
    }

    #[test]
    fn a_connection_closed_here_counts_until_the_peer_closes_its_end() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        let proc_root = Path::new("/proc");
        // A read of the table can miss a row that moves meanwhile (other tests open and
        // close sockets beside this one), so each state is waited for, briefly.
        let becomes = |want: usize| {
            let began = std::time::Instant::now();
            loop {
                let seen = not_let_go(proc_root, &[port]);
                if seen == want || began.elapsed() > Duration::from_secs(2) {
                    return seen;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        assert_eq!(becomes(0), 0, "both ends open");
        drop(client);
        assert_eq!(becomes(1), 1, "closed here only");
        let mut rest = Vec::new();
        let _ = accepted.read_to_end(&mut rest);
        drop(accepted);
        assert_eq!(becomes(0), 0, "closed at both ends");
    }
}
