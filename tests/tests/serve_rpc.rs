//! `1bit serve --rpc`: every worker asked before anything starts, the memory counted where
//! llama.cpp puts the layers, and the workers watched while serve runs (real workers, the real
//! llama-server and SmolLM2 on loopback; the two-namespace test is in serve_rpc_netns.rs).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::rpc_worker::RpcWorker;
use onebit_tests::*;

fn refused(model: &Path, extra: &[&str]) -> (Option<i32>, String, Duration, PathBuf) {
    let dir = temp_dir("rpc-refused");
    let record = dir.join("record.jsonl");
    let fake = fake_backend();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        fake.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let began = Instant::now();
    let mut serve = Serve::start(&args, &[("FAKE_RECORD", record.to_str().unwrap())]);
    let exit = serve
        .wait_exit(Duration::from_secs(20))
        .expect("serve exits");
    (exit.code(), serve.output(), began.elapsed(), record)
}

fn smol_shaped(dir: &Path, name: &str, total: u64) -> PathBuf {
    let path = dir.join(name);
    gguf::writer::Builder::smollm2_shaped()
        .total_size(total)
        .write(&path)
        .unwrap();
    path
}

#[test]
fn a_worker_that_is_not_there_is_named_and_nothing_starts() {
    let dir = temp_dir("rpc-missing");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let port = free_port();
    let missing = format!("127.0.0.1:{port}");
    let worker = RpcWorker::start(&["--threads", "1"], None);
    let list = format!("{},{missing}", worker.endpoint);
    let (code, out, took, record) = refused(&model, &["--rpc", &list]);
    assert_eq!(code, Some(3), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {out}");
    assert!(
        lines[0].starts_with(&format!(
            "1bit serve: RPC worker {missing} does not answer ("
        )),
        "{out}"
    );
    assert!(
        lines[0].ends_with("start it (1bit rpc-worker) or drop it from --rpc; nothing was started"),
        "{out}"
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(!record.exists(), "the backend never started");
}

#[test]
fn a_worker_that_accepts_but_never_answers_is_refused_within_a_second() {
    let dir = temp_dir("rpc-silent");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    let (code, out, took, record) = refused(&model, &["--rpc", &endpoint]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.contains(&format!(
            "RPC worker {endpoint} accepted the connection but did not answer within 1 s"
        )),
        "{out}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert!(!record.exists());
}

#[test]
fn a_malformed_rpc_entry_is_bad_usage() {
    let dir = temp_dir("rpc-usage");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let (code, out, _, _) = refused(&model, &["--rpc", "10.0.0.1"]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.starts_with("1bit serve: --rpc 10.0.0.1: not HOST:PORT;"),
        "{out}"
    );
}

#[test]
fn a_model_too_big_for_the_worker_is_refused_naming_it_before_anything_starts() {
    // A worker offers the machine's RAM; a 4 TiB header-only model lands almost wholly on it
    // (only the input layer stays here), so it is the worker that cannot hold it.
    let dir = temp_dir("rpc-big");
    let model = smol_shaped(&dir, "huge.gguf", 4 << 40);
    let worker = RpcWorker::start(&["--threads", "1"], None);
    let (code, out, _, record) = refused(&model, &["--rpc", &worker.endpoint]);
    assert_eq!(code, Some(3), "{out}");
    let line = out.lines().next().unwrap_or_default();
    assert!(
        line.starts_with(&format!(
            "1bit serve: huge does not fit on {0}: RPC worker {0} needs 40",
            worker.endpoint
        )),
        "{out}"
    );
    assert!(
        line.contains("(layers 0-29 of 30 and the output layer: weights 4096.00 + KV"),
        "{line}"
    );
    assert!(
        line.ends_with(
            "add RPC workers or free memory there, lower --ctx-size, or pass --no-mem-check"
        ),
        "{line}"
    );
    assert!(
        !line.contains("this machine needs"),
        "the local part fits: {line}"
    );
    assert!(!record.exists());

    // --mem-check says the same on stdout and exits 3.
    let (code, out, _, _) = refused(&model, &["--rpc", &worker.endpoint, "--mem-check"]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.starts_with(&format!("huge does not fit on {}", worker.endpoint)),
        "{out}"
    );
}

#[test]
fn a_worker_offering_little_is_named_when_its_share_does_not_fit() {
    // An 8 GiB header-only model over a worker offering the machine's RAM and one capped at
    // 1 GiB (--mem 1): llama.cpp gives the small one only the output layer, a 31st of the
    // weights, which with its compute buffer and the margin is still more than 1 GiB.
    let dir = temp_dir("rpc-small");
    let model = smol_shaped(&dir, "eight.gguf", 8 << 30);
    let big = RpcWorker::start(&["--threads", "1"], None);
    let small = RpcWorker::start(&["--threads", "1", "--mem", "1"], None);
    let list = format!("{},{}", big.endpoint, small.endpoint);
    let (code, out, _, record) = refused(&model, &["--rpc", &list]);
    assert_eq!(code, Some(3), "{out}");
    assert!(
        out.starts_with(&format!(
            "1bit serve: eight does not fit on {0}: RPC worker {0} needs 0.7",
            small.endpoint
        )),
        "{out}"
    );
    assert!(
        out.contains(
            "(the output layer: weights 0.26 + KV 0.00 + compute 0.50) of 1.00 GiB it offers"
        ),
        "{out}"
    );
    assert!(!out.contains(&format!("on {}", big.endpoint)), "{out}");
    assert!(!record.exists());
}

#[test]
fn a_model_that_fits_across_two_workers_says_where_each_part_goes() {
    let dir = temp_dir("rpc-fits");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let a = RpcWorker::start(&["--threads", "1"], None);
    let b = RpcWorker::start(&["--threads", "1"], None);
    let list = format!("{},{}", a.endpoint, b.endpoint);
    let (code, out, _, _) = refused(&model, &["--rpc", &list, "--mem-check"]);
    assert_eq!(code, Some(0), "{out}");
    // Equal workers: llama.cpp gives the first layers 0-15, the second 16-29 and the output.
    assert!(
        out.starts_with("small: fits across this machine and 2 RPC workers: this machine needs"),
        "{out}"
    );
    assert!(
        out.contains(&format!("RPC worker {} needs 0.", a.endpoint)),
        "{out}"
    );
    assert!(out.contains("(layers 0-15 of 30: weights"), "{out}");
    assert!(
        out.contains("(layers 16-29 of 30 and the output layer: weights"),
        "{out}"
    );
}

fn smollm2_over(workers: &[&RpcWorker], extra: &[&str]) -> Serve {
    let list = workers
        .iter()
        .map(|w| w.endpoint.clone())
        .collect::<Vec<_>>()
        .join(",");
    let mut args = vec!["--ctx-size", "1024", "--rpc", &list];
    args.extend_from_slice(extra);
    serve_smollm2(&args)
}

/// How long serve may take to end once a worker it was given is gone (docs/rpc.md): it sees
/// the worker's connection reset at once here (loopback), waits 2 s for the backend's own
/// failure, then kills the backend; the rest is a loaded machine's slack.
const ENDS_WITHIN: Duration = Duration::from_secs(10);

/// Serve's exit once `worker` was lost at `lost`: status 1 within [`ENDS_WITHIN`], with one
/// line naming the worker; the line.
fn ends_naming(serve: &mut Serve, worker: &RpcWorker, lost: Instant) -> String {
    let exit = serve.wait_exit(ENDS_WITHIN + Duration::from_secs(20));
    let took = lost.elapsed();
    assert_eq!(
        exit.and_then(|e| e.code()),
        Some(1),
        "serve did not end {took:?} after its worker was lost:\n{}",
        serve.output()
    );
    assert!(
        took < ENDS_WITHIN,
        "{took:?} after the worker was lost:\n{}",
        serve.output()
    );
    let out = serve.output();
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("1bit serve: RPC worker {} ", worker.endpoint)))
        .unwrap_or_else(|| panic!("no line naming the worker:\n{out}"))
        .to_string();
    assert!(
        line.contains("cannot go on without the layers it held"),
        "{line}"
    );
    line
}

#[test]
fn a_worker_lost_while_idle_is_said_on_health_and_ends_serve_with_its_line() {
    let a = RpcWorker::start(&["--threads", "1"], None);
    let mut serve = smollm2_over(&[&a], &[]);
    let (_, metrics) = get(&serve.url("/metrics"));
    let samples = parse_prometheus(&metrics);
    assert_eq!(
        sample(&samples, "onebit_rpc_worker_up", &[("worker", &a.endpoint)]),
        Some(1.0),
        "{metrics}"
    );
    let offered = sample(
        &samples,
        "onebit_rpc_worker_offered_bytes",
        &[("worker", &a.endpoint)],
    )
    .unwrap();
    assert!(offered > 1e9, "{offered}");

    // Killed while idle: /health says which worker at once, before any request; then, since
    // an idle llama-server would notice only at a request that /health turns away, serve
    // ends it and exits 1 naming the worker (before: serve stayed up answering 503 for good).
    let backend = serve.children()[0];
    let server = a.server_pid().unwrap();
    let lost = Instant::now();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    let mut said = String::new();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let (status, body) = get(&serve.url("/health"));
            said = body;
            status == 503
        }),
        "{}",
        serve.output()
    );
    assert!(
        said.contains(&format!("RPC worker {}", a.endpoint)),
        "{said}"
    );
    let line = ends_naming(&mut serve, &a, lost);
    assert!(
        line.ends_with("killing the cpu backend and exiting"),
        "{line}"
    );
    assert!(
        wait_until(Duration::from_secs(2), || !alive(backend)),
        "the backend outlived serve"
    );
    eprintln!("{line}");
}

/// The worker goes before a streamed request reaches llama-server (the starved run of issue
/// 53: the request was still on its way in serve when the worker was killed): serve answers
/// it 503 (or has ended already) and ends serve with the worker's line; before, the request
/// was turned away, never reached the engine to fail there, and serve stayed up.
#[test]
fn a_worker_lost_before_a_request_reaches_the_engine_ends_serve_with_its_line() {
    let a = RpcWorker::start(&["--threads", "1"], None);
    let mut serve = smollm2_over(&[&a], &[]);
    let server = a.server_pid().unwrap();
    let lost = Instant::now();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    assert!(
        serve.wait_health(503, Duration::from_secs(5)),
        "{}",
        serve.output()
    );
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
        "temperature": 0,
        "max_tokens": 64,
        "stream": true,
    })
    .to_string();
    let (status, reply) = post_with_timeout(
        &serve.url("/v1/chat/completions"),
        &body,
        Duration::from_secs(20),
    );
    assert!(
        !reply.contains("[DONE]") && status != 200,
        "{status}: {reply}"
    );
    let line = ends_naming(&mut serve, &a, lost);
    eprintln!("{line}");
}

#[test]
fn a_worker_lost_mid_stream_ends_serve_with_a_line_naming_it() {
    let a = RpcWorker::start(&["--threads", "1"], None);
    let mut serve = smollm2_over(&[&a], &[]);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from one to two hundred in words."}],
        "temperature": 0,
        "max_tokens": 400,
        "stream": true,
    })
    .to_string();
    let (mut stream, _) = onebit_tests::rpc_worker::stream_started(serve.port, &body);
    let server = a.server_pid().unwrap();
    let lost = Instant::now();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stream, &mut rest);
    assert!(
        !rest.contains("[DONE]"),
        "the stream was cut, not finished: {rest}"
    );
    let line = ends_naming(&mut serve, &a, lost);
    // The engine failed on its own (its line is said), not ended by serve's wait.
    assert!(
        !line.contains("would notice only at its next request"),
        "{line}"
    );
    eprintln!("{line}");
}

/// The port a backend listens on, from its command line (`--port N`).
fn backend_port(pid: u32) -> u16 {
    let argv = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = argv
        .split(|b| *b == 0)
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    words
        .iter()
        .position(|w| w == "--port")
        .and_then(|i| words.get(i + 1)?.parse().ok())
        .unwrap_or_else(|| panic!("no --port in the backend's argv: {words:?}"))
}

/// The worker goes while a request waits in llama-server's queue, not yet begun (issue 53.3):
/// `--parallel 1`, its one slot decoding a long stream, a second streamed request deferred
/// behind it (llama-server's own `requests_deferred` says so). Both streams are cut and serve
/// ends with the worker's line, as for a request being decoded.
#[test]
fn a_worker_lost_while_a_request_is_queued_in_the_engine_ends_serve_with_its_line() {
    let a = RpcWorker::start(&["--threads", "1"], None);
    let mut serve = smollm2_over(&[&a], &["--parallel", "1"]);
    let engine = format!("http://127.0.0.1:{}", backend_port(serve.children()[0]));
    let long = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from one to two hundred in words."}],
        "temperature": 0,
        "max_tokens": 1000,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    let (mut busy, _) = onebit_tests::rpc_worker::stream_started(serve.port, &long);
    let queued = {
        let url = serve.url("/v1/chat/completions");
        let body = long.clone();
        std::thread::spawn(move || post_with_timeout(&url, &body, Duration::from_secs(60)))
    };
    let mut metrics = String::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            metrics = get(&format!("{engine}/metrics")).1;
            metrics
                .lines()
                .any(|l| l.starts_with("llamacpp:requests_deferred ") && !l.ends_with(" 0"))
        }),
        "the second request never waited in llama-server's queue:\n{metrics}"
    );
    let server = a.server_pid().unwrap();
    let lost = Instant::now();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(server as i32), Signal::SIGKILL);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut busy, &mut rest);
    assert!(!rest.contains("[DONE]"), "the busy stream was cut: {rest}");
    let line = ends_naming(&mut serve, &a, lost);
    let (status, reply) = queued.join().unwrap();
    assert!(
        !reply.contains("[DONE]"),
        "the queued request was cut, not answered: {status}: {reply}"
    );
    eprintln!("{line}");
}

#[test]
fn rpc_on_a_route_that_does_not_run_llama_cpp_is_bad_usage() {
    let dir = temp_dir("rpc-ds4");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let fake = fake_backend();
    let mut serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "ds4",
            "--ds4",
            fake.to_str().unwrap(),
            "--rpc",
            "127.0.0.1:1",
        ],
        &[],
    );
    let exit = serve.wait_exit(Duration::from_secs(10)).expect("refused");
    assert_eq!(exit.code(), Some(2), "{}", serve.output());
    assert_eq!(
        serve.output().trim(),
        "1bit serve: --rpc: the ds4 route does not run llama.cpp's RPC workers; use --device cpu or --device hrx"
    );
}

#[test]
fn serve_counts_each_layer_where_llama_server_then_puts_it() {
    // Two workers, one offering the machine's memory and one capped at 8 GiB (so the split is
    // uneven): serve's check says which layers each holds, and
    // llama-server's own debug log (verbosity 5) says where it put them.
    let a = RpcWorker::start(&["--threads", "1"], None);
    let b = RpcWorker::start(&["--threads", "1", "--mem", "8"], None);
    let list = format!("{},{}", a.endpoint, b.endpoint);
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let server = installed_llama_server();
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--llama-server",
            server.to_str().unwrap(),
            "--ctx-size",
            "1024",
            "--rpc",
            &list,
        ],
        &[("LLAMA_ARG_LOG_VERBOSITY", "5")],
    );
    assert!(
        serve.wait_health(200, Duration::from_secs(120)),
        "{}",
        serve.output()
    );
    let out = serve.output();
    // "load_tensors: layer  24 assigned to device RPC1, is_swa = 0"
    let mut placed: [Vec<usize>; 2] = [Vec::new(), Vec::new()];
    for line in out.lines() {
        let Some(rest) = line.split("load_tensors: layer").nth(1) else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let layer: usize = words.next().unwrap().parse().unwrap();
        let device = words.nth(3).unwrap().trim_end_matches(',');
        let k = match device {
            "RPC0" => 0,
            "RPC1" => 1,
            other => panic!("layer {layer} on {other}: {line}"),
        };
        if !placed[k].contains(&layer) {
            placed[k].push(layer);
        }
    }
    assert_eq!(placed[0].len() + placed[1].len(), 31, "{out}");
    for (k, worker) in [&a, &b].iter().enumerate() {
        let layers = &placed[k];
        let blocks: Vec<usize> = layers.iter().copied().filter(|l| *l < 30).collect();
        let mut text = format!("layers {}-{} of 30", blocks[0], blocks[blocks.len() - 1]);
        if layers.contains(&30) {
            text.push_str(" and the output layer");
        }
        let said = format!("RPC worker {} needs ", worker.endpoint);
        let part = out
            .split(&said)
            .nth(1)
            .unwrap_or_else(|| panic!("{said} in {out}"));
        assert!(
            part.contains(&format!("({text}: weights")),
            "llama-server put {text} on {}: {out}",
            worker.endpoint
        );
    }
    assert!(
        !placed[1].is_empty() && placed[1].len() < placed[0].len(),
        "{placed:?}"
    );
}

#[test]
fn the_drop_in_command_line_probes_its_rpc_workers_too() {
    let dir = temp_dir("rpc-dropin");
    let model = smol_shaped(&dir, "small.gguf", 100 << 20);
    let missing = format!("127.0.0.1:{}", free_port());
    let mut child = std::process::Command::new(onebit())
        .args(["llama-server", "-m", model.to_str().unwrap()])
        .args(["--port", &free_port().to_string(), "--rpc", &missing])
        .env("ONEBIT_LLAMA_SERVER", fake_backend())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Bounded: without the probe it would serve on and never exit.
    if !wait_until(Duration::from_secs(10), || {
        child.try_wait().ok().flatten().is_some()
    }) {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains(&format!("RPC worker {missing} does not answer")),
        "{err}"
    );
}
