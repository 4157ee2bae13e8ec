//! Load: many concurrent streamed chats through serve to the fake backend, repeated; every
//! event of every stream arrives intact and in order, and serve's memory stays bounded.

use std::time::{Duration, Instant};

use onebit_tests::*;

const CLIENTS: usize = 64;
const EVENTS: u64 = 40;
const ROUNDS: usize = 4;

/// One streamed chat; panics unless its events are exactly 0..EVENTS content chunks, the
/// final chunk, then `[DONE]`.
fn one_stream(url: &str, client: usize) {
    let body = format!(
        r#"{{"stream":true,"messages":[{{"role":"user","content":"client {client} counts"}}]}}"#
    );
    let events = sse(url, &body);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "client {client}"
    );
    let parsed: Vec<serde_json::Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|_| panic!("client {client}: {e:?}")))
        .collect();
    let seqs: Vec<u64> = parsed
        .iter()
        .map(|v| v["fake_seq"].as_u64().expect("fake_seq"))
        .collect();
    // The content chunks, then the final (stop) chunk.
    assert_eq!(
        seqs,
        (0..=EVENTS).collect::<Vec<u64>>(),
        "client {client}: in order, none lost, none duplicated"
    );
    let text: String = parsed
        .iter()
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(
        text.starts_with(&format!("fake reply to: client {client} counts")),
        "client {client}: {text:?}"
    );
}

#[test]
fn sixty_four_concurrent_streams_arrive_whole_and_memory_stays_bounded() {
    let dir = temp_dir("load");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[
            ("FAKE_SSE_EVENTS", &EVENTS.to_string()),
            ("FAKE_SSE_INTERVAL_MS", "5"),
        ],
    );
    serve.ready();
    let url = serve.url("/v1/chat/completions");
    let mut rss = Vec::new();
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let started = Instant::now();
        std::thread::scope(|s| {
            for client in 0..CLIENTS {
                let url = &url;
                s.spawn(move || one_stream(url, client));
            }
        });
        times.push(started.elapsed());
        rss.push(rss_kib(serve.pid()));
    }
    eprintln!(
        "load: {CLIENTS} streams x {EVENTS} events, round times {times:?}, serve VmRSS KiB after each round {rss:?}"
    );
    assert!(rss[0] > 0, "VmRSS is readable");
    // Allocator arenas settle in the first round; later rounds must not keep growing.
    let growth = rss[ROUNDS - 1].saturating_sub(rss[0]);
    assert!(
        growth < 16 * 1024,
        "serve grew {growth} KiB after the first round: {rss:?}"
    );
    assert!(
        times.iter().all(|t| *t < Duration::from_secs(30)),
        "{times:?}"
    );
    assert_eq!(get(&serve.url("/health")).0, 200);
}
