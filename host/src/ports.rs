//! The backends' loopback ports: chosen where no outgoing connection can be handed one, probed
//! free by binding them, and held until the backends are about to start.
//!
//! Why not port 0: the kernel picks a bound port 0 from the ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`), the range it also draws every outgoing
//! connection's source port from. serve lets go of a reserved port just before its backend
//! binds it, and in that window any `connect()` on the machine may be given the port as its
//! source: the backend then fails with "Address already in use" (a test's client took the cpu
//! backend's port in CI). So serve picks from the ports the kernel never hands out by itself:
//!
//! - above the ephemeral range first (61000-65535 with Linux's default 32768-60999): no
//!   outgoing connection can get one, and services rarely listen there;
//! - else (a range that reaches 65535) below it, from 10000 up, leaving the crowded
//!   conventional ports (3000, 5432, 8080, ...) to the programs that expect them;
//! - never Lemonade's 8001-9000 (it scans them for its own servers), a port the machine keeps
//!   out of the ephemeral range for a program that binds it (`ip_local_reserved_ports`), or
//!   serve's own `--port` (bound after the reservation).
//!
//! The search starts at a random place among those ports, so serves starting together (a fleet,
//! a test suite) do not probe the same ports in the same order, and it probes at most
//! [`MAX_PROBES`] of them. A machine that leaves none (an ephemeral range of 1024-65535) gets
//! the kernel's pick, as before, and the retry at the start covers the window
//! (`serve/start.rs`).

use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener as StdListener;
use std::ops::RangeInclusive;
use std::path::Path;

use onebit_command::error::Fatal;

/// Ports Lemonade scans for its own servers; backends never take one.
pub const LEMONADE_PORTS: RangeInclusive<u16> = 8001..=9000;
/// Linux's default ephemeral range, when `/proc` cannot be read.
const DEFAULT_EPHEMERAL: RangeInclusive<u16> = 32768..=60999;
/// The lowest port taken below the ephemeral range (the conventional ports are left alone).
const LOWEST_BELOW: u16 = 10000;
/// Fewer allowed ports above the ephemeral range than this, and those below it are used too.
const ENOUGH_ABOVE: usize = 256;
/// At most this many ports are tried (bound) per reservation: each is one `bind`, and a
/// machine where this many in a row are taken is better served by the kernel's pick.
const MAX_PROBES: usize = 512;

/// The listening sockets that hold the reserved ports until the backends are about to start;
/// dropping it (or [`HeldPorts::release`]) lets go.
#[derive(Default)]
pub struct HeldPorts(std::sync::Mutex<Vec<StdListener>>);

impl HeldPorts {
    /// Let go of the reserved ports: called right before the backends start, so the window in
    /// which another program could bind one is the time a spawn takes (and no outgoing
    /// connection can be given one, see the module's doc).
    pub fn release(self) {
        drop(self);
    }
}

/// Reserve `n` free loopback ports for backends (see the module's doc for which), held in
/// `into` until it lets go. `serve_port` is serve's own `--port`, never given. Called by
/// `prepare` on the main thread, and by serve's start when a backend is started again; blocks
/// only on `bind` calls and two small `/proc` reads.
pub fn reserve(into: &HeldPorts, n: usize, serve_port: u16) -> Result<Vec<u16>, Fatal> {
    let allowed = Allowed::of_this_machine(serve_port);
    let mut held = Vec::new();
    let mut ports = Vec::new();
    for port in allowed.search(random()).take(MAX_PROBES) {
        if ports.len() == n {
            break;
        }
        // A port already in use (or held by this serve) fails to bind and is passed over.
        if let Ok(listener) = StdListener::bind(("127.0.0.1", port)) {
            ports.push(port);
            held.push(listener);
        }
    }
    if ports.len() < n {
        if !allowed.ports.is_empty() {
            tracing::debug!(
                "1bit serve: {} port(s) outside the ephemeral range found free in {MAX_PROBES} tries; the kernel picks the rest",
                ports.len()
            );
        }
        kernel_picks(&mut ports, &mut held, n, serve_port)?;
    }
    into.0
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(held);
    Ok(ports)
}

/// The old way, for a machine with no port outside its ephemeral range: the kernel picks each
/// (bind to port 0), Lemonade's and serve's own passed over.
fn kernel_picks(
    ports: &mut Vec<u16>,
    held: &mut Vec<StdListener>,
    n: usize,
    serve_port: u16,
) -> Result<(), Fatal> {
    for _ in 0..(n * 8) {
        if ports.len() == n {
            return Ok(());
        }
        let listener = StdListener::bind("127.0.0.1:0")
            .map_err(|e| Fatal::backend(format!("cannot reserve a loopback port: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| Fatal::backend(format!("cannot reserve a loopback port: {e}")))?
            .port();
        if !LEMONADE_PORTS.contains(&port) && port != serve_port {
            ports.push(port);
            held.push(listener);
        }
    }
    if ports.len() < n {
        return Err(Fatal::backend(
            "cannot reserve loopback ports outside 8001-9000",
        ));
    }
    Ok(())
}

/// A random number from the process's hasher keys (std seeds them from the OS per process).
fn random() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish()
}

/// The ports a backend may be given on this machine, in order (the search starts anywhere).
struct Allowed {
    ports: Vec<u16>,
}

impl Allowed {
    fn of_this_machine(serve_port: u16) -> Allowed {
        let proc_sys = Path::new("/proc/sys/net/ipv4");
        let read = |name: &str| std::fs::read_to_string(proc_sys.join(name)).unwrap_or_default();
        let ephemeral = parse_range(&read("ip_local_port_range")).unwrap_or(DEFAULT_EPHEMERAL);
        let reserved = parse_reserved(&read("ip_local_reserved_ports"));
        Allowed::given(ephemeral, &reserved, serve_port)
    }

    /// Above the ephemeral range, and below it from [`LOWEST_BELOW`] when above holds too few;
    /// never Lemonade's, a reserved one or serve's own.
    fn given(
        ephemeral: RangeInclusive<u16>,
        reserved: &[RangeInclusive<u16>],
        serve_port: u16,
    ) -> Allowed {
        let fits = |p: &u16| {
            !LEMONADE_PORTS.contains(p)
                && *p != serve_port
                && !reserved.iter().any(|r| r.contains(p))
        };
        let above = ephemeral.end().saturating_add(1).max(LOWEST_BELOW);
        let mut ports: Vec<u16> = if *ephemeral.end() == u16::MAX {
            Vec::new()
        } else {
            (above..=u16::MAX).filter(fits).collect()
        };
        if ports.len() < ENOUGH_ABOVE && *ephemeral.start() > LOWEST_BELOW {
            ports.extend((LOWEST_BELOW..*ephemeral.start()).filter(fits));
        }
        Allowed { ports }
    }

    /// Every allowed port once, from a place `seed` picks, wrapping around.
    fn search(&self, seed: u64) -> impl Iterator<Item = u16> + '_ {
        let start = match self.ports.len() {
            0 => 0,
            len => (seed % len as u64) as usize,
        };
        self.ports[start..]
            .iter()
            .chain(&self.ports[..start])
            .copied()
    }
}

/// `ip_local_port_range`'s two numbers ("32768\t60999").
fn parse_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut numbers = text.split_whitespace().map(str::parse::<u16>);
    match (numbers.next()?, numbers.next()?) {
        (Ok(lo), Ok(hi)) if lo <= hi => Some(lo..=hi),
        _ => None,
    }
}

/// `ip_local_reserved_ports`: a comma list of ports and ranges ("8080,9000-9010"), often empty.
fn parse_reserved(text: &str) -> Vec<RangeInclusive<u16>> {
    text.trim()
        .split(',')
        .filter_map(|part| {
            let part = part.trim();
            match part.split_once('-') {
                Some((lo, hi)) => Some(lo.trim().parse().ok()?..=hi.trim().parse().ok()?),
                None => part.parse().ok().map(|p| p..=p),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_stay_taken_until_released() {
        let held = HeldPorts::default();
        let ports = reserve(&held, 2, 8000).unwrap();
        for &port in &ports {
            assert!(!LEMONADE_PORTS.contains(&port));
            assert!(
                StdListener::bind(("127.0.0.1", port)).is_err(),
                "port {port} was free before the release"
            );
        }
        held.release();
        for &port in &ports {
            assert!(
                StdListener::bind(("127.0.0.1", port)).is_ok(),
                "port {port} is free after the release"
            );
        }
    }

    #[test]
    fn ports_are_outside_the_machines_ephemeral_range() {
        let ephemeral = parse_range(
            &std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap(),
        )
        .unwrap();
        let held = HeldPorts::default();
        for port in reserve(&held, 4, 8000).unwrap() {
            assert!(
                !ephemeral.contains(&port),
                "port {port} is in the ephemeral range {ephemeral:?}, where a connect() may take it"
            );
        }
    }

    #[test]
    fn the_range_above_is_preferred_and_lemonades_reserved_and_serves_are_skipped() {
        let allowed = Allowed::given(32768..=60999, &[61000..=61009], 61010);
        assert_eq!(allowed.ports.first(), Some(&61011));
        assert_eq!(allowed.ports.last(), Some(&65535));
        assert_eq!(allowed.ports.len(), 65535 - 61011 + 1);
        // A range reaching the top leaves the ports below it, from 10000, never Lemonade's.
        let allowed = Allowed::given(20000..=65535, &[], 8000);
        assert_eq!(allowed.ports.first(), Some(&10000));
        assert_eq!(allowed.ports.last(), Some(&19999));
        let allowed = Allowed::given(1024..=65535, &[], 8000);
        assert!(allowed.ports.is_empty());
        let allowed = Allowed::given(1024..=8500, &[], 8000);
        assert!(allowed.ports.iter().all(|p| !LEMONADE_PORTS.contains(p)));
        assert_eq!(allowed.ports.first(), Some(&10000));
    }

    #[test]
    fn the_search_visits_each_port_once_from_anywhere() {
        let allowed = Allowed {
            ports: vec![1, 2, 3, 4],
        };
        assert_eq!(allowed.search(6).collect::<Vec<_>>(), vec![3, 4, 1, 2]);
    }

    #[test]
    fn proc_files_are_read() {
        assert_eq!(parse_range("32768\t60999\n"), Some(32768..=60999));
        assert_eq!(parse_range(""), None);
        assert_eq!(
            parse_reserved("8080,9000-9010\n"),
            vec![8080..=8080, 9000..=9010]
        );
        assert!(parse_reserved("\n").is_empty());
    }
}
