//! The guard's rules as a pure function of the bind and raw header bytes: no I/O, std only,
//! so the fuzz target (`host/fuzz/`) compiles this file on its own.

use std::net::{IpAddr, Ipv6Addr};

/// What the guard knows of the server: only whether it is bound to loopback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guard {
    /// `--host` is a loopback address or `localhost`: the Host header must name loopback.
    pub loopback_bind: bool,
}

impl Guard {
    /// The guard for `--host HOST` (or a comma list of addresses, each bound): loopback when
    /// every one is 127.0.0.0/8, ::1 or `localhost`.
    pub fn for_bind(hosts: &str) -> Guard {
        let loopback = |host: &str| {
            let host = host.trim().trim_start_matches('[').trim_end_matches(']');
            match host.parse::<IpAddr>() {
                Ok(ip) => ip.is_loopback(),
                Err(_) => is_loopback_name(host),
            }
        };
        Guard {
            loopback_bind: hosts.split(',').all(loopback),
        }
    }
}

/// Why the guard refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// More than one Host header (RFC 9112 3.2: a 400), however many and whatever they say.
    SeveralHosts(usize),
    /// The Host header (as sent, lossily decoded; empty when missing) does not name loopback.
    ForeignHost(String),
    /// The Origin of a request that writes is neither loopback nor this server.
    CrossSite(String),
}

/// The request as the guard sees it: raw header bytes, so the fuzz target can feed anything.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seen<'a> {
    /// The method; GET, HEAD and OPTIONS are "safe" and skip the Origin rule.
    pub method: &'a [u8],
    /// Every Host header value, however many (more than one is refused).
    pub hosts: &'a [&'a [u8]],
    /// The request target's authority, for an absolute-form target: it must name the same host
    /// as the Host header (and stands for it when there is none).
    pub authority: Option<&'a [u8]>,
    /// Every Origin header value.
    pub origins: &'a [&'a [u8]],
}

/// Decide one request. Pure: no I/O, no allocation except for a refusal's text.
pub fn check(guard: Guard, seen: &Seen<'_>) -> Result<(), Refusal> {
    if seen.hosts.len() > 1 {
        return Err(Refusal::SeveralHosts(seen.hosts.len()));
    }
    // Every form of the host the request names must agree, or the check could be steered by
    // the one it does not look at.
    let host = seen.hosts.first().copied().or(seen.authority);
    let one_host = match (seen.hosts.first(), seen.authority) {
        (Some(header), Some(authority)) => header.eq_ignore_ascii_case(authority),
        _ => true,
    };
    if guard.loopback_bind {
        let named = one_host && host.and_then(as_str).is_some_and(is_loopback_host);
        if !named {
            return Err(Refusal::ForeignHost(lossy(host.unwrap_or(b""))));
        }
    }
    if matches!(seen.method, b"GET" | b"HEAD" | b"OPTIONS") {
        return Ok(());
    }
    for origin in seen.origins {
        let allowed = as_str(origin)
            .and_then(origin_authority)
            .is_some_and(|authority| {
                is_loopback_host(authority)
                    || (one_host
                        && host.is_some_and(|h| h.eq_ignore_ascii_case(authority.as_bytes())))
            });
        if !allowed {
            return Err(Refusal::CrossSite(lossy(origin)));
        }
    }
    Ok(())
}

/// The fuzz target's input format, also replayed on stable by the host's tests: byte 0 picks
/// the bind (bit 0) and the method (bits 1-2: GET, POST, DELETE, OPTIONS); the rest is lines,
/// `H<value>` a Host header, `O<value>` an Origin header (at most 8 of each), `A<value>` the
/// target's authority.
#[allow(dead_code)] // the fuzz target and the corpus test call it
pub fn fuzz_one(data: &[u8]) -> Result<(), Refusal> {
    let Some((&flags, rest)) = data.split_first() else {
        return Ok(());
    };
    let guard = Guard {
        loopback_bind: flags & 1 == 1,
    };
    let method: &[u8] = match (flags >> 1) & 3 {
        0 => b"GET",
        1 => b"POST",
        2 => b"DELETE",
        _ => b"OPTIONS",
    };
    let mut hosts: [&[u8]; 8] = [b""; 8];
    let mut origins: [&[u8]; 8] = [b""; 8];
    let (mut nh, mut no) = (0, 0);
    let mut authority = None;
    for line in rest.split(|&b| b == b'\n') {
        match line.split_first() {
            Some((b'H', value)) if nh < 8 => {
                hosts[nh] = value;
                nh += 1;
            }
            Some((b'O', value)) if no < 8 => {
                origins[no] = value;
                no += 1;
            }
            Some((b'A', value)) => authority = Some(value),
            _ => {}
        }
    }
    let verdict = check(
        guard,
        &Seen {
            method,
            hosts: &hosts[..nh],
            authority,
            origins: &origins[..no],
        },
    );
    // The invariants a refusal must never break, checked where the fuzzer can see them.
    if verdict.is_ok() {
        assert!(nh <= 1, "accepted {nh} Host headers");
    }
    if guard.loopback_bind && verdict.is_ok() {
        for named in hosts[..nh].iter().chain(authority.iter()) {
            let host = std::str::from_utf8(named).expect("an accepted Host is UTF-8");
            assert!(is_loopback_host(host), "accepted a foreign Host {host:?}");
        }
    }
    if verdict.is_ok() && !matches!(method, b"GET" | b"HEAD" | b"OPTIONS") {
        for origin in &origins[..no] {
            let text = std::str::from_utf8(origin).expect("an accepted Origin is UTF-8");
            assert!(
                origin_authority(text).is_some(),
                "accepted a write with Origin {text:?}"
            );
        }
    }
    if let Err(Refusal::ForeignHost(t) | Refusal::CrossSite(t)) = &verdict {
        assert!(
            t.chars().count() <= 200,
            "a refusal quotes at most 200 characters"
        );
    }
    verdict
}

fn as_str(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

fn lossy(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    // A refusal quotes what it saw; a hostile header must not make the reply large.
    text.chars().take(200).collect()
}

/// The authority of an `http://` or `https://` origin with nothing after it; `null`, other
/// schemes, user info, paths and an empty host give None.
fn origin_authority(origin: &str) -> Option<&str> {
    let (scheme, rest) = origin.split_once("://")?;
    if !(scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")) {
        return None;
    }
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return None;
    }
    Some(rest)
}

/// Whether an Origin value is a loopback origin (`http(s)://` + a loopback name, any port).
pub fn is_loopback_origin(origin: &str) -> bool {
    origin_authority(origin).is_some_and(is_loopback_host)
}

/// Whether a Host value (`name`, `name:port`, `[v6]`, `[v6]:port`, or a bare `::1`) names
/// loopback.
pub fn is_loopback_host(host: &str) -> bool {
    if let Some(rest) = host.strip_prefix('[') {
        let Some((inside, after)) = rest.split_once(']') else {
            return false;
        };
        let port_ok = after.is_empty() || after.strip_prefix(':').is_some_and(is_port);
        return port_ok && is_loopback_v6(inside);
    }
    if host.matches(':').count() > 1 {
        // A bare IPv6 address has no room for a port.
        return is_loopback_v6(host);
    }
    let name = match host.split_once(':') {
        Some((name, port)) if is_port(port) => name,
        Some(_) => return false,
        None => host,
    };
    is_loopback_name(name) || is_loopback_v4(name)
}

fn is_port(port: &str) -> bool {
    !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit())
}

/// `localhost` or a `*.localhost` name of plain DNS labels, in any case.
fn is_loopback_name(name: &str) -> bool {
    const SUFFIX: &str = ".localhost";
    if name.eq_ignore_ascii_case("localhost") {
        return true;
    }
    let n = name.len();
    if n <= SUFFIX.len() || !name.is_char_boundary(n - SUFFIX.len()) {
        return false;
    }
    let (labels, suffix) = name.split_at(n - SUFFIX.len());
    suffix.eq_ignore_ascii_case(SUFFIX)
        && labels.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// `127.a.b.c`: four dotted groups of one to three digits, each at most 255.
fn is_loopback_v4(name: &str) -> bool {
    let mut groups = 0;
    for (i, group) in name.split('.').enumerate() {
        let ok = (1..=3).contains(&group.len())
            && group.bytes().all(|b| b.is_ascii_digit())
            && group.parse::<u16>().is_ok_and(|v| v <= 255);
        if !ok || (i == 0 && group != "127") {
            return false;
        }
        groups += 1;
    }
    groups == 4
}

fn is_loopback_v6(text: &str) -> bool {
    text.parse::<Ipv6Addr>()
        .is_ok_and(|ip| ip == Ipv6Addr::LOCALHOST)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOP: Guard = Guard {
        loopback_bind: true,
    };
    const LAN: Guard = Guard {
        loopback_bind: false,
    };

    fn run(guard: Guard, method: &str, host: Option<&str>, origin: Option<&str>) -> bool {
        let hosts: Vec<&[u8]> = host.iter().map(|h| h.as_bytes()).collect();
        let origins: Vec<&[u8]> = origin.iter().map(|o| o.as_bytes()).collect();
        check(
            guard,
            &Seen {
                method: method.as_bytes(),
                hosts: &hosts,
                authority: None,
                origins: &origins,
            },
        )
        .is_ok()
    }

    #[test]
    fn loopback_names() {
        for yes in [
            "localhost",
            "LOCALHOST:8000",
            "app.localhost:8000",
            "a.b-c.Localhost",
            "127.0.0.1",
            "127.255.0.9:1",
            "[::1]",
            "[::1]:8000",
            "::1",
            "[0:0:0:0:0:0:0:1]:80",
            "0000:0000:0000:0000:0000:0000:0000:0001",
        ] {
            assert!(is_loopback_host(yes), "{yes}");
        }
        for no in [
            "",
            ":8000",
            "127.0.0.1.example",
            "evil.localhost.example",
            "localhost.",
            ".localhost",
            "a..localhost",
            "127.0.0.256",
            "127.0.0",
            "127.0.0.1.1",
            "127.0.0.01a",
            "0x7f.0.0.1",
            "128.0.0.1",
            "10.0.0.1",
            "[::2]",
            "[::1",
            "[::1]8000",
            "localhost:",
            "localhost:80a",
            "localhost:123456",
            "example.com",
            "::ffff:127.0.0.1",
            "localhost\u{0}",
        ] {
            assert!(!is_loopback_host(no), "{no}");
        }
    }

    #[test]
    fn the_host_rule_holds_on_loopback_binds_only() {
        assert!(run(LOOP, "GET", Some("localhost:8000"), None));
        assert!(!run(LOOP, "GET", Some("evil.example:8000"), None));
        assert!(!run(LOOP, "GET", None, None), "a missing Host is refused");
        assert!(run(LAN, "GET", Some("evil.example:8000"), None));
        assert!(run(LAN, "POST", None, None));
        // More than one Host header is refused on any bind, even all loopback (RFC 9112 3.2),
        // however many come: four loopback names cannot hide a fifth, foreign one.
        let five: [&[u8]; 5] = [b"localhost"; 5];
        let mut hosts = five;
        hosts[4] = b"evil.example";
        for guard in [LOOP, LAN] {
            for n in 2..=5 {
                let seen = Seen {
                    method: b"GET",
                    hosts: &hosts[..n],
                    authority: None,
                    origins: &[],
                };
                assert_eq!(check(guard, &seen), Err(Refusal::SeveralHosts(n)));
            }
        }
        // A target's authority must name the Host's host.
        let seen = Seen {
            method: b"GET",
            hosts: &[b"localhost"],
            authority: Some(b"evil.example"),
            origins: &[],
        };
        assert!(check(LOOP, &seen).is_err(), "a foreign authority");
        let seen = Seen {
            authority: Some(b"localhost:8000"),
            hosts: &[],
            ..seen
        };
        assert!(
            check(LOOP, &seen).is_ok(),
            "the authority stands for a missing Host"
        );
    }

    #[test]
    fn the_origin_rule_holds_for_writes() {
        let evil = Some("https://evil.example");
        assert!(!run(LOOP, "POST", Some("localhost:8000"), evil));
        assert!(!run(LAN, "DELETE", Some("box.lan:8000"), evil));
        assert!(run(LOOP, "GET", Some("localhost:8000"), evil));
        assert!(run(LOOP, "OPTIONS", Some("localhost:8000"), evil));
        assert!(!run(LOOP, "POST", Some("localhost:8000"), Some("null")));
        assert!(run(
            LOOP,
            "POST",
            Some("127.0.0.1:8000"),
            Some("http://localhost:3000")
        ));
        assert!(run(
            LAN,
            "POST",
            Some("box.lan:8000"),
            Some("http://box.lan:8000")
        ));
        assert!(!run(
            LAN,
            "POST",
            Some("box.lan:8000"),
            Some("http://box.lan:8001")
        ));
        assert!(!run(LAN, "POST", None, Some("http://box.lan:8000")));
        assert!(!run(
            LOOP,
            "POST",
            Some("localhost"),
            Some("file://localhost")
        ));
        assert!(!run(
            LOOP,
            "POST",
            Some("localhost"),
            Some("http://localhost/path")
        ));
    }

    #[test]
    fn the_bind_decides_loopback() {
        for yes in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "[::1]",
            "localhost",
            "127.0.0.1,::1",
        ] {
            assert!(Guard::for_bind(yes).loopback_bind, "{yes}");
        }
        // A list is loopback only when every address in it is.
        for no in [
            "0.0.0.0",
            "::",
            "192.168.1.10",
            "box.lan",
            "127.0.0.1,0.0.0.0",
        ] {
            assert!(!Guard::for_bind(no).loopback_bind, "{no}");
        }
    }
}
