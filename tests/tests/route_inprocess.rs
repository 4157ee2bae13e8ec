//! Routes that answer in process (ABI 1.2's `respond`): the reply streams through a bounded
//! sink (a slow client slows the route, serve's memory stays flat), a client that leaves makes
//! the route's next send fail, a panic in the route is one line and a 500 (or a cut-off
//! stream), and the relay's checks, the served name, health and metrics apply as for a relay.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use onebit_tests::*;

/// The in-process fixture route, built once per run against this plugin-api.
fn fixture() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        route_fixture::Fixture::current(
            "inproc",
            "tests/fixtures/inproc-route/src/lib.rs",
            onebit_plugin_api::ABI_VERSION,
        )
        .build()
    })
}

fn serve_inproc(model_name: &str, env: &[(&str, &str)]) -> Serve {
    serve_inproc_with(model_name, &[], env)
}

fn serve_inproc_with(model_name: &str, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let dir = temp_dir("inproc");
    let model = dummy_model(&dir, model_name);
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "inproc",
        "--plugin-dir",
        fixture().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Serve::start(&args, env)
}

/// One of the fixture's own series from serve's /metrics.
fn fixture_metric(serve: &Serve, name: &str) -> u64 {
    let (_, text) = get(&serve.url("/metrics"));
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} is not in /metrics:\n{text}"))
}

/// A chat request on a fresh connection, the reply left to the caller to read.
fn open_stream(serve: &Serve, body: &str) -> TcpStream {
    let mut tcp = TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        tcp,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    tcp
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[test]
fn an_in_process_reply_streams_named_and_checked_as_a_relayed_one() {
    let serve = serve_inproc("smol.gguf", &[]);
    serve.ready();
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        reply["model"], "smol",
        "the served name, as on the relay: {body}"
    );
    assert_eq!(reply["choices"][0]["message"]["content"], "in process");

    let events = sse(
        &serve.url("/v1/chat/completions"),
        r#"{"stream":true,"events":5,"event_bytes":3}"#,
    );
    assert_eq!(events.len(), 6, "{events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]");

    // The relay's checks come first: bad JSON and a foreign Host never reach the route.
    let (status, body) = post(&serve.url("/v1/chat/completions"), "{not json");
    assert_eq!(status, 400, "{body}");
    let (status, _) = raw(
        serve.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        Duration::from_secs(5),
    );
    assert_eq!(status, 403);
    let limited = serve_inproc("small-limit.gguf", &[("ONEBIT_MAX_BODY_BYTES", "64")]);
    limited.ready();
    let (status, _) = post(
        &limited.url("/v1/chat/completions"),
        &format!(r#"{{"pad":"{}"}}"#, "x".repeat(100)),
    );
    assert_eq!(status, 413);
    assert_eq!(
        fixture_metric(&serve, "fixture_responds_total"),
        2,
        "only the two good requests reached the route; the route's metrics are in /metrics"
    );
}

#[test]
fn the_routes_health_feeds_serves_health() {
    let serve = serve_inproc("unhealthy.gguf", &[]);
    assert!(
        wait_until(Duration::from_secs(10), || {
            let (status, body) = get(&serve.url("/health"));
            status == 503 && body.contains("the fixture was asked to be unhealthy")
        }),
        "{}",
        serve.output()
    );
}

#[test]
fn a_slow_client_slows_the_route_and_serve_memory_stays_flat() {
    let serve = serve_inproc("slow.gguf", &[]);
    serve.ready();
    // Warm up: one whole stream, so the blocking thread and buffers exist before "idle".
    let warm = sse(
        &serve.url("/v1/chat/completions"),
        r#"{"stream":true,"events":200,"event_bytes":1000}"#,
    );
    assert_eq!(warm.len(), 201);
    std::thread::sleep(Duration::from_millis(200));
    let idle = rss_kib(serve.pid());
    let before = fixture_metric(&serve, "fixture_events_total");

    // A 50 MB stream, read at 100 KB/s for three seconds.
    let mut tcp = open_stream(
        &serve,
        r#"{"stream":true,"events":50000,"event_bytes":1000}"#,
    );
    let mut peak = idle;
    let mut read = 0usize;
    let mut buf = vec![0u8; 10_000];
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let n = tcp.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        read += n;
        peak = peak.max(rss_kib(serve.pid()));
        std::thread::sleep(Duration::from_millis(100));
    }
    // Let the stall settle (the route blocked in send, every buffer full), then see where the
    // bytes the route sent are: read by the client, in the kernel's two socket queues, or in
    // serve.
    std::thread::sleep(Duration::from_millis(300));
    let sent = fixture_metric(&serve, "fixture_events_total") - before;
    let client_port = tcp.local_addr().unwrap().port();
    let (in_kernel, kernel_max) = socket_queues(serve.port, client_port);
    drop(tcp);
    // Each event as the fixture writes it (`data: {"model":"fixture-model","n":N,"p":"x..."}`),
    // one send, so one chunk on the wire: its length in hex, CRLF, the event, CRLF.
    let sent_bytes: usize = (0..sent)
        .map(|n| {
            let event = format!("data: {{\"model\":\"fixture-model\",\"n\":{n},\"p\":\"\"}}\n\n")
                .len()
                + 1000;
            format!("{event:x}").len() + 2 + event + 2
        })
        .sum();
    let in_serve = sent_bytes.saturating_sub(read + in_kernel);
    eprintln!(
        "idle RSS {idle} KiB, peak {peak} KiB while reading {read} bytes; the route sent {sent} events ({sent_bytes} bytes): {in_kernel} bytes in the sockets' queues, at most {in_serve} in serve"
    );
    assert!(
        peak.saturating_sub(idle) < 5 * 1024,
        "serve's RSS rose {} KiB above idle ({idle} KiB)",
        peak - idle
    );
    // What the route could send is what the client read, plus the kernel's socket queues
    // (at most tcp_wmem's and tcp_rmem's maxima), plus serve's sink: serve itself holds at most
    // SINK_BUFFER_BYTES (counted as the wire's bytes, the chunked framing included; the reply's
    // head, in `read`, makes serve's share if anything understated by its few bytes).
    assert!(
        in_kernel <= kernel_max,
        "{in_kernel} bytes in the socket queues, above tcp_wmem's and tcp_rmem's maxima ({kernel_max})"
    );
    assert!(
        in_serve <= onebit_plugin_api::SINK_BUFFER_BYTES,
        "the route sent {sent_bytes} bytes to a client that read {read}, with {in_kernel} in the sockets' queues: serve held {in_serve}, above its {} bytes",
        onebit_plugin_api::SINK_BUFFER_BYTES
    );
}

/// The bytes queued in the kernel for one loopback connection (serve's socket's send queue and
/// the client's receive queue, from /proc/net/tcp), and the most those can be: the maxima of
/// tcp_wmem and tcp_rmem.
fn socket_queues(serve_port: u16, client_port: u16) -> (usize, usize) {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let port =
        |address: &str| u16::from_str_radix(address.rsplit(':').next().unwrap(), 16).unwrap();
    let mut queued = 0;
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, remote) = (port(fields[1]), port(fields[2]));
        let (tx, rx) = fields[4].split_once(':').unwrap();
        let hex = |q: &str| usize::from_str_radix(q, 16).unwrap();
        if local == serve_port && remote == client_port {
            queued += hex(tx);
        } else if local == client_port && remote == serve_port {
            queued += hex(rx);
        }
    }
    let max = |file: &str| -> usize {
        std::fs::read_to_string(file)
            .unwrap()
            .split_whitespace()
            .nth(2)
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        queued,
        max("/proc/sys/net/ipv4/tcp_wmem") + max("/proc/sys/net/ipv4/tcp_rmem"),
    )
}

#[test]
fn a_client_that_leaves_during_a_long_prefill_stops_it_before_the_next_send() {
    let serve = serve_inproc("prefill.gguf", &[]);
    serve.ready();
    // A 20 s "prefill" in which the route sends nothing and asks its sink's client_gone every
    // 10 ms: before its head (as the inproc add-on, whose head comes with its first text),
    // then after it.
    for (n, head_first) in [(1, false), (2, true)] {
        let mut tcp = open_stream(
            &serve,
            &format!(
                r#"{{"stream":true,"events":5,"prefill_ms":20000,"head_before_prefill":{head_first}}}"#
            ),
        );
        if head_first {
            let mut buf = vec![0u8; 4096];
            let mut seen = Vec::new();
            while !String::from_utf8_lossy(&seen).contains("\r\n\r\n") {
                let got = tcp.read(&mut buf).unwrap();
                assert!(got > 0, "the reply ended before its head");
                seen.extend_from_slice(&buf[..got]);
            }
            assert_eq!(status_of(&String::from_utf8_lossy(&seen)), 200);
        }
        std::thread::sleep(Duration::from_millis(300));
        let closed_at = now_ns();
        drop(tcp);
        assert!(
            wait_until(Duration::from_secs(5), || fixture_metric(
                &serve,
                "fixture_prefills_stopped_total"
            ) == n),
            "head first {head_first}: the route computed on after its client left:\n{}",
            serve.output()
        );
        eprintln!(
            "head first {head_first}: the prefill stopped {:.1} ms after the client closed",
            fixture_metric(&serve, "fixture_stopped_at_ns").saturating_sub(closed_at) as f64 / 1e6
        );
    }
    assert_eq!(
        fixture_metric(&serve, "fixture_sends_refused_total"),
        0,
        "it stopped before any send"
    );
    assert_eq!(fixture_metric(&serve, "fixture_events_total"), 0);
    assert!(
        !serve.output().contains("failed to answer"),
        "a client leaving is not a failure:\n{}",
        serve.output()
    );
}

#[test]
fn a_client_that_leaves_makes_the_routes_next_send_fail() {
    let serve = serve_inproc("leave.gguf", &[]);
    serve.ready();
    let mut tcp = open_stream(
        &serve,
        r#"{"stream":true,"events":100000,"event_bytes":100,"pace_ms":5}"#,
    );
    let mut buf = vec![0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("\"n\":3") {
        let n = tcp.read(&mut buf).unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    assert_eq!(fixture_metric(&serve, "fixture_sends_refused_total"), 0);
    let closed_at = now_ns();
    drop(tcp);
    assert!(
        wait_until(Duration::from_secs(5), || fixture_metric(
            &serve,
            "fixture_sends_refused_total"
        ) == 1),
        "the route never saw the client leave:\n{}",
        serve.output()
    );
    let stopped = fixture_metric(&serve, "fixture_stopped_at_ns");
    eprintln!(
        "the route stopped {:.1} ms after the client closed",
        stopped.saturating_sub(closed_at) as f64 / 1e6
    );
    assert!(
        !serve.output().contains("failed to answer"),
        "a client leaving is not a failure:\n{}",
        serve.output()
    );
}

#[test]
fn a_panic_in_respond_is_a_500_or_a_cut_stream_in_one_line_and_serve_goes_on() {
    let serve = serve_inproc("panics.gguf", &[("RUST_BACKTRACE", "1")]);
    serve.ready();
    let (status, body) = post(&serve.url("/v1/chat/completions"), r#"{"panic":"before"}"#);
    assert_eq!(status, 500, "{body}");
    assert!(
        body.contains("the fixture was asked to panic before its head"),
        "{body}"
    );

    let mut tcp = open_stream(&serve, r#"{"panic":"after","stream":true,"events":5000}"#);
    let mut reply = Vec::new();
    let _ = tcp.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let status = status_of(&reply);
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("\"n\":0"), "{reply}");
    assert!(
        !reply.contains("[DONE]") && !reply.ends_with("0\r\n\r\n"),
        "the stream is cut off, not ended: {reply}"
    );

    // serve goes on.
    let (status, _) = post(&serve.url("/v1/chat/completions"), r#"{"messages":[]}"#);
    assert_eq!(status, 200);
    let out = serve.output();
    let said: Vec<&str> = out.lines().filter(|l| l.contains("panic")).collect();
    assert_eq!(said.len(), 2, "one line per panic, nothing else:\n{out}");
    for line in said {
        assert!(
            line.starts_with("1bit serve: the inproc route failed to answer POST /v1/chat/completions: the route panicked in respond: "),
            "{out}"
        );
    }
    assert!(
        !out.contains("stack backtrace") && !out.contains("panicked at"),
        "{out}"
    );
}

#[test]
fn print_backend_names_what_the_plan_says_needs_serve_and_exits_5() {
    let dir = temp_dir("inproc-print");
    let model = dummy_model(&dir, "m.gguf");
    let out = std::process::Command::new(onebit())
        .args(["serve", "-m"])
        .arg(&model)
        .args([
            "--device",
            "inproc",
            "--port",
            "8001",
            "--print-backend",
            "--plugin-dir",
        ])
        .arg(fixture())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert_eq!(
        stderr,
        "1bit serve: --print-backend: the inproc route (it answers in process) needs 1bit serve in the request path; run 1bit serve itself\n"
    );
}

/// The X-Request-Id of a reply read whole by [`raw`].
fn reply_id(reply: &str) -> String {
    reply
        .lines()
        .take_while(|l| !l.is_empty())
        .find_map(|l| {
            l.split_once(':')
                .filter(|(name, _)| name.eq_ignore_ascii_case("x-request-id"))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}

#[test]
fn an_in_process_answer_has_its_id_its_request_line_and_its_stream_timed() {
    let serve = serve_inproc("observed.gguf", &[("ONEBIT_LOG", "debug")]);
    serve.ready();
    let body = r#"{"stream":true,"events":5,"event_bytes":3}"#;
    let request = |id: &[u8]| {
        let mut request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\nX-Request-Id: ".to_vec();
        request.extend_from_slice(id);
        request.extend_from_slice(
            format!("\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes(),
        );
        raw(serve.port, &request, Duration::from_secs(10))
    };
    let (status, reply) = request(b"inproc-1");
    assert_eq!(status, 200, "{reply}");
    assert!(reply.contains("[DONE]"), "{reply}");
    assert_eq!(
        reply_id(&reply),
        "inproc-1",
        "the client's id comes back:\n{reply}"
    );
    let (status, reply) = request(b"bad\tid");
    assert_eq!(status, 200, "{reply}");
    let made = reply_id(&reply);
    assert!(
        made.len() == 16 && made.bytes().all(|b| b.is_ascii_hexdigit()),
        "a control character is replaced, not {made:?}"
    );
    let line_of = |id: &str| {
        let output = serve.output();
        output
            .lines()
            .filter(|l| {
                l.starts_with("1bit serve: request ") && l.ends_with(&format!(" request_id={id}"))
            })
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert!(wait_until(Duration::from_secs(5), || line_of(&made).len() == 1));
    let lines = line_of("inproc-1");
    assert_eq!(lines.len(), 1, "{}", serve.output());
    assert!(
        lines[0].starts_with("1bit serve: request method=POST path=/v1/chat/completions status=200 engine=in_process "),
        "{}",
        lines[0]
    );
    // Both streams timed: a first token each, and the events between.
    let (_, scraped) = get(&serve.url("/metrics"));
    let samples = parse_prometheus(&scraped);
    let labels = [("path_class", "chat"), ("engine", "in_process")];
    assert_eq!(
        sample(
            &samples,
            "onebit_time_to_first_token_seconds_count",
            &labels
        ),
        Some(2.0),
        "{scraped}"
    );
    let events = sample(&samples, "onebit_inter_token_seconds_count", &labels).unwrap_or(0.0);
    assert!(
        events >= 8.0,
        "five events and [DONE] a stream: {events}\n{scraped}"
    );
    assert_eq!(
        sample(&samples, "onebit_request_duration_seconds_count", &labels),
        Some(2.0),
        "{scraped}"
    );
}

/// `--max-generation-s`: an in-process generation past its deadline is ended as a relayed one
/// is (a stream under way: one last error event; a reply not begun: 504), and the route is
/// told to stop (its next send fails; its `client_gone` is true).
#[test]
fn the_generation_deadline_tells_an_in_process_route_to_stop() {
    let serve = serve_inproc_with("deadline.gguf", &["--max-generation-s", "1"], &[]);
    serve.ready();
    // A stream under way: 100,000 events 5 ms apart.
    let began = Instant::now();
    let mut tcp = open_stream(
        &serve,
        r#"{"stream":true,"events":100000,"event_bytes":100,"pace_ms":5}"#,
    );
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(status_of(&reply), 200, "{reply}");
    let last = reply
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("data: "))
        .unwrap_or_default();
    assert!(
        last.contains(r#""code":504"#) && last.contains("--max-generation-s"),
        "the stream's last event should be the deadline's: {last}"
    );
    assert!(
        wait_until(Duration::from_secs(5), || fixture_metric(
            &serve,
            "fixture_sends_refused_total"
        ) == 1),
        "the route was never told to stop:\n{}",
        serve.output()
    );
    // A reply not begun: a 20 s prefill before the head.
    let mut tcp = open_stream(
        &serve,
        r#"{"stream":true,"events":5,"prefill_ms":20000,"head_before_prefill":false}"#,
    );
    let mut reply = String::new();
    let _ = tcp.read_to_string(&mut reply);
    assert_eq!(status_of(&reply), 504, "{reply}");
    assert!(
        wait_until(Duration::from_secs(5), || fixture_metric(
            &serve,
            "fixture_prefills_stopped_total"
        ) == 1),
        "the route's prefill went on past the deadline:\n{}",
        serve.output()
    );
    assert_eq!(generation_deadlines(&serve), Some(2.0));
}
