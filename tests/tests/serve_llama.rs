//! `1bit serve` on the cpu route with the real, pinned llama-server and the default model.

use onebit_tests::*;

const QUESTION: &str = "What is the capital of France? Answer in one word.";

fn smollm2() -> Serve {
    smollm2_with(&[])
}

fn smollm2_with(extra: &[&str]) -> Serve {
    let mut args = vec!["--ctx-size", "2048"];
    args.extend_from_slice(extra);
    onebit_tests::serve_smollm2(&args)
}

#[test]
fn a_greedy_chat_answers_paris_under_the_served_name_streamed_and_not() {
    let serve = smollm2();
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 16,
    });
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "answered {answer:?}");
    assert_eq!(v["model"], "SmolLM2-135M-Instruct-Q4_1");

    let mut streamed = body.clone();
    streamed["stream"] = serde_json::json!(true);
    let events = sse(&serve.url("/v1/chat/completions"), &streamed.to_string());
    assert!(events.len() > 3, "several events: {events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert!(text.contains("Paris"), "streamed {text:?}");
}

#[test]
fn eight_concurrent_greedy_chats_on_four_slots_all_answer() {
    let serve = smollm2_with(&["--parallel", "4"]);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 8,
    })
    .to_string();
    let url = serve.url("/v1/chat/completions");
    let started = std::time::Instant::now();
    let replies: Vec<(u16, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8).map(|_| s.spawn(|| post(&url, &body))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!(
        "llama-server --parallel 4: 8 concurrent chats in {:?}",
        started.elapsed()
    );
    for (status, reply) in &replies {
        assert_eq!(*status, 200, "{reply}");
        let v: serde_json::Value = serde_json::from_str(reply).unwrap();
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        assert!(!answer.trim().is_empty(), "an answer: {reply}");
    }
    // llama-server reflects any Origin in CORS headers; serve relays none of them.
    let (status, reply) = raw(
        serve.port,
        b"GET /props HTTP/1.1\r\nHost: localhost\r\nOrigin: https://evil.example\r\nConnection: close\r\n\r\n",
        std::time::Duration::from_secs(10),
    );
    assert_eq!(status, 200, "{reply}");
    let head = reply
        .split("\r\n\r\n")
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(!head.contains("access-control-"), "{head}");
    // llama-server sends no Date; serve, relaying, dates the reply.
    assert!(head.contains("\r\ndate: "), "{head}");
}

#[test]
fn metrics_parse_and_end_with_llama_servers_own_series() {
    let serve = smollm2();
    let (status, text) = get(&serve.url("/metrics"));
    assert_eq!(status, 200, "{text}");
    let samples = parse_prometheus(&text);
    assert_eq!(
        sample(&samples, "onebit_up", &[("device", "cpu")]),
        Some(1.0),
        "{text}"
    );
    assert!(samples[0].name.starts_with("onebit_"), "{text}");
    let last = samples.last().expect("samples");
    assert!(last.name.starts_with("llamacpp:"), "{text}");
    assert!(
        sample(&samples, "llamacpp:prompt_tokens_total", &[]).is_some(),
        "{text}"
    );
}
