//! Ports for the servers a test starts.
//!
//! A port the kernel hands out for `bind(:0)` comes from its ephemeral range, the same range it
//! takes the source port of every outgoing connection from. Between the moment a test learns
//! such a port and the moment serve binds it, a connection made by another test of the same
//! process (a load test makes hundreds) can take it as its source port, and serve's bind then
//! fails with "Address already in use". So the ports handed out here lie below the ephemeral
//! range, where the kernel never picks one on its own; each is checked free by binding it, and
//! none is handed out twice by one process.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// Where the kernel's ephemeral range starts when /proc does not say.
const EPHEMERAL_START: u16 = 32768;
/// The lowest port handed out: above the well-known ports most services sit on.
const LOWEST: u16 = 20000;

/// A loopback port that is free now, outside the kernel's ephemeral range, and not handed out
/// before by this process.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let (low, high) = candidate_range();
    let span = u32::from(high - low) + 1;
    let mut state = seed();
    for _ in 0..2000 {
        state = next_random(state);
        let port = low + (state % u64::from(span)) as u16;
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if handed_out.contains(&port) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        handed_out.insert(port);
        return port;
    }
    panic!("no free loopback port in {low}-{high} after 2000 tries: are other servers using them?");
}

/// The ports below the ephemeral range (or above it, when it starts too low to leave room).
fn candidate_range() -> (u16, u16) {
    let (start, end) = ephemeral_range().unwrap_or((EPHEMERAL_START, 60999));
    if start > LOWEST + 1000 {
        (LOWEST, start - 1)
    } else {
        (end.saturating_add(1).max(LOWEST), u16::MAX)
    }
}

fn ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut fields = text.split_whitespace().map(str::parse::<u16>);
    Some((fields.next()?.ok()?, fields.next()?.ok()?))
}

/// Different in every process and every call, so that test processes running side by side
/// do not walk the same sequence.
fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    (nanos ^ (u64::from(std::process::id()) << 32)) | 1
}

/// xorshift64: enough to spread the tries over the range.
fn next_random(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_lie_outside_the_ephemeral_range_and_are_not_repeated() {
        let (start, end) = ephemeral_range().unwrap_or((EPHEMERAL_START, 60999));
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        for port in &ports {
            assert!(
                !(start..=end).contains(port),
                "{port} lies in the ephemeral range {start}-{end}"
            );
        }
        let distinct: BTreeSet<&u16> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
    }
}
