//! The model split across two machines, made on this one: two RPC workers, each in a network
//! namespace of its own with its own address (a veth link to this namespace), SmolLM2 served
//! across them by the real llama-server. Skipped, with one line, where namespaces cannot be
//! made (not root, no `ip`).

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::netns::Namespace;
use onebit_tests::rpc_worker::{RpcWorker, stream_started};
use onebit_tests::*;

const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
];

fn greedy(serve: &Serve, prompt: &str) -> String {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 40,
    });
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body.to_string());
    assert_eq!(status, 200, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn smollm2_split_across_two_namespaced_workers_answers_as_the_local_cpu_route() {
    let began = Instant::now();
    // Subnets of their own per run, so a run that died without cleaning up does not collide.
    let net = 2 + (std::process::id() % 120) * 2;
    let made = Namespace::make("rpc", "a", &format!("10.77.{net}")).and_then(|a| {
        Ok((
            a,
            Namespace::make("rpc", "b", &format!("10.77.{}", net + 1))?,
        ))
    });
    let (ns_a, ns_b) = match made {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!(
                "skipped: network namespaces cannot be made here ({e}); run as root with iproute2"
            );
            return;
        }
    };
    let a = RpcWorker::start(
        &["--host", &ns_a.address, "--threads", "1"],
        Some(&ns_a.name),
    );
    // b offers 2 GiB through its --mem relay, so llama.cpp gives it the last layers only.
    let b = RpcWorker::start(
        &["--host", &ns_b.address, "--threads", "1", "--mem", "2"],
        Some(&ns_b.name),
    );
    assert!(
        a.endpoint.starts_with(&format!("{}:", ns_a.address)),
        "{}",
        a.announcement
    );
    let list = format!("{},{}", a.endpoint, b.endpoint);

    // A worker missing at start: refused before llama-server starts.
    let missing = format!("{}:{}", ns_b.address, 1);
    let mut refused = Serve::start(
        &[
            "-m",
            installed_model("SmolLM2-135M-Instruct-Q4_1.gguf")
                .to_str()
                .unwrap(),
            "--device",
            "cpu",
            "--llama-server",
            installed_llama_server().to_str().unwrap(),
            "--rpc",
            &format!("{},{missing}", a.endpoint),
        ],
        &[],
    );
    let exit = refused.wait_exit(Duration::from_secs(10)).expect("refused");
    assert_eq!(exit.code(), Some(3), "{}", refused.output());
    assert!(
        refused
            .output()
            .starts_with(&format!("1bit serve: RPC worker {missing} does not answer")),
        "{}",
        refused.output()
    );
    assert!(
        !refused.output().contains("starting llama-server"),
        "{}",
        refused.output()
    );

    // The same three greedy answers, local and split over the two workers.
    let local = serve_smollm2(&["--ctx-size", "1024"]);
    let expected: Vec<String> = PROMPTS.iter().map(|p| greedy(&local, p)).collect();
    drop(local);
    let mut split = serve_smollm2(&["--ctx-size", "1024", "--rpc", &list]);
    assert!(
        split
            .output()
            .contains("fits across this machine and 2 RPC workers"),
        "{}",
        split.output()
    );
    for (prompt, want) in PROMPTS.iter().zip(&expected) {
        assert_eq!(&greedy(&split, prompt), want, "{prompt}");
    }

    // The second worker killed mid-stream: serve ends with its line, exit 1.
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from one to two hundred in words."}],
        "temperature": 0,
        "max_tokens": 400,
        "stream": true,
    })
    .to_string();
    let (mut stream, _) = stream_started(split.port, &body);
    let server = b.server_pid().expect("worker b's ggml-rpc-server");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stream, &mut rest);
    assert!(!rest.contains("[DONE]"), "the stream was cut: {rest}");
    let exit = split
        .wait_exit(Duration::from_secs(30))
        .expect("serve exits");
    assert_eq!(exit.code(), Some(1), "{}", split.output());
    let out = split.output();
    assert!(
        out.lines().any(
            |l| l.starts_with(&format!("1bit serve: RPC worker {} ", b.endpoint))
                && l.contains("cannot go on without the layers it held")
        ),
        "{out}"
    );
    assert!(
        !out.lines()
            .any(|l| l.starts_with(&format!("1bit serve: RPC worker {} ", a.endpoint))),
        "the worker still up is not named: {out}"
    );
    assert!(
        began.elapsed() < Duration::from_secs(180),
        "{:?}",
        began.elapsed()
    );
}
