//! A fleet of serves behind the pinned gateway (SMG, `cargo xtask setup` installs it;
//! docs/fleet.md), each worker a host of its own: a network namespace with its own address on
//! a private /24 made for the test, on port 8000 like every other worker, torn down after.
//! Through the gateway, as `cargo xtask fleet` configures it (cache-aware, health checks on
//! serve's `/health` every second, retries): chats, streams and Anthropic messages on the real
//! llama-server, and what the gateway learns of each worker (a generic OpenAI-compatible
//! worker with its slots and context, its load as llama-server has it), and the fleet's one
//! prompt cache (a conversation moved to another worker by a restart is restored from the
//! folder the workers share, and answers as a cold serve does); on the fake backend, a
//! rolling restart of every worker under steady load with the gateway's retries off, so that
//! only the drain can keep the count of failures at zero; and a worker killed outright mid-load:
//! what fails was in flight on it, nothing of it is left, its next start removes its run
//! folder. Skipped, with one line, where namespaces cannot be made. One fleet at a time.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use onebit_tests::netns::Namespace;
use onebit_tests::*;
use serde_json::{Value, json};

/// Every worker listens here, on its own address.
const PORT: u16 = 8000;
/// The drain a fleet's workers get (`cargo xtask fleet`'s): the notice outlasts the gateway's
/// health check (every second, one failure marks a worker down).
const DRAIN: [&str; 4] = ["--drain-notice-s", "3", "--drain-s", "10"];

static ONE_FLEET_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The pinned gateway's command, as `cargo xtask setup` installed it.
fn smg() -> PathBuf {
    let path = std::env::var_os("ONEBIT_TEST_SMG")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("ONEBIT_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/onebit")
                });
            cache.join("venvs/smg-1.13.0/bin/smg")
        });
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask setup`",
        path.display()
    );
    path
}

/// One worker: its namespace, and the serve in it (None while stopped).
struct Worker {
    ns: Namespace,
    args: Vec<String>,
    env: Vec<(String, String)>,
    serve: Option<Serve>,
}

impl Worker {
    fn url(&self, path: &str) -> String {
        format!("http://{}:{PORT}{path}", self.ns.address)
    }

    fn base(&self) -> String {
        self.url("")
    }

    fn start(&mut self) {
        let mut command = self.ns.command(&onebit());
        command
            .arg("serve")
            .args(&self.args)
            .args(["--host", &self.ns.address, "--port", &PORT.to_string()])
            .env("ONEBIT_STATE_DIR", temp_dir("fleet-state"));
        for (name, value) in &self.env {
            command.env(name, value);
        }
        let serve = Serve::spawn(command, PORT);
        let url = self.url("/health");
        assert!(
            wait_until(Duration::from_secs(120), || get(&url).0 == 200),
            "worker {} did not become ready:\n{}",
            self.ns.address,
            serve.output()
        );
        self.serve = Some(serve);
    }

    fn serve(&mut self) -> &mut Serve {
        self.serve.as_mut().expect("the worker runs")
    }
}

/// The gateway, in this namespace, on loopback; killed when dropped.
struct Gateway {
    child: Child,
    port: u16,
    metrics_port: u16,
    log: PathBuf,
}

impl Gateway {
    fn start(workers: &[Worker], extra: &[&str]) -> Gateway {
        let (port, metrics_port) = (free_port(), free_port());
        let log = temp_dir("fleet-gateway").join("smg.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(smg());
        command
            .args(["launch", "--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--worker-urls")
            .args(workers.iter().map(Worker::base))
            .args([
                "--policy",
                "cache_aware",
                "--health-check-endpoint",
                "/health",
                "--health-check-interval-secs",
                "1",
                "--health-failure-threshold",
                "1",
                "--health-success-threshold",
                "1",
                "--load-monitor-interval",
                "1",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &metrics_port.to_string(),
                "--shutdown-grace-period-secs",
                "2",
                "--log-level",
                "warn",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        let gateway = Gateway {
            child: command.spawn().expect("smg starts"),
            port,
            metrics_port,
            log,
        };
        assert!(
            wait_until(Duration::from_secs(60), || gateway.healthy()
                == workers.len()),
            "the gateway did not take every worker: {}",
            gateway.log()
        );
        gateway
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The workers it routes to now.
    fn healthy(&self) -> usize {
        let (_, body) = get(&self.url("/readiness"));
        serde_json::from_str::<Value>(&body).unwrap_or_default()["healthy_workers"]
            .as_u64()
            .unwrap_or(0) as usize
    }

    /// Its record of the worker at `base`.
    fn worker(&self, base: &str) -> Value {
        let (_, body) = get(&self.url("/workers"));
        let all: Value = serde_json::from_str(&body).unwrap_or_default();
        all["workers"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["url"] == base).cloned())
            .unwrap_or_default()
    }

    /// `smg_worker_requests_total` of the worker at `base`.
    fn requests_to(&self, base: &str) -> u64 {
        let (_, text) = get(&format!("http://127.0.0.1:{}/metrics", self.metrics_port));
        text.lines()
            .find(|l| {
                l.starts_with("smg_worker_requests_total{") && l.contains(&format!("\"{base}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<f64>().ok())
            .map_or(0, |n| n as u64)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` workers, each in a namespace of its own (`tag` keeps fleets of one run apart); Err says
/// why namespaces cannot be made here.
fn workers(tag: u32, n: u32, args: &[&str], env: &[(&str, &str)]) -> Result<Vec<Worker>, String> {
    // A /24 of 10.78.0.0/16 each, apart per run, so a run that died without cleaning up does
    // not collide.
    let base = (std::process::id() % 24) * 10 + tag * 3;
    (0..n)
        .map(|i| {
            let ns = Namespace::make(
                "fleet",
                &format!("f{tag}{i}"),
                &format!("10.78.{}", base + i),
            )?;
            Ok(Worker {
                ns,
                args: args.iter().map(|s| s.to_string()).collect(),
                env: env
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                serve: None,
            })
        })
        .collect()
}

/// `n` workers of `args` (not started yet), or None (said) where namespaces cannot be made.
fn fleet(tag: u32, n: u32, args: &[&str], env: &[(&str, &str)]) -> Option<Vec<Worker>> {
    match workers(tag, n, args, env) {
        Ok(workers) => Some(workers),
        Err(e) => {
            eprintln!(
                "skipped: network namespaces cannot be made here ({e}); run as root with iproute2"
            );
            None
        }
    }
}

/// The fake backend's fleet: `n` workers (not started yet), or None (said) where namespaces
/// cannot be made.
fn fake_fleet(tag: u32, n: u32, extra: &[&str], env: &[(&str, &str)]) -> Option<Vec<Worker>> {
    let model = dummy_model(&temp_dir("fleet-model"), "m.gguf");
    let fake = fake_backend();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        fake.to_str().unwrap(),
        "--alias",
        "fleet",
    ];
    args.extend_from_slice(extra);
    fleet(tag, n, &args, env)
}

/// One request of the load: its id, when it started and ended, and whether it was answered
/// whole (`why` when not).
struct Outcome {
    id: String,
    started: Instant,
    ended: Instant,
    why: Option<String>,
}

/// Clients posting chats through the gateway without pause, every other one streamed, each
/// with an id of its own in its text; stopped by `stop`.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<Outcome>>>,
}

impl Load {
    fn start(url: String, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..clients)
            .map(|client| {
                let (url, stop) = (url.clone(), stop.clone());
                std::thread::spawn(move || {
                    let agent: ureq::Agent = ureq::Agent::config_builder()
                        .http_status_as_error(false)
                        .timeout_global(Some(Duration::from_secs(30)))
                        .build()
                        .into();
                    let mut outcomes = Vec::new();
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let id = format!("req-{client}-{n}");
                        let streamed = n % 2 == 0;
                        let body = json!({
                            "model": "fleet",
                            "stream": streamed,
                            "messages": [{"role": "user", "content": format!("{id} asks about topic {}", n % 3)}],
                        });
                        let started = Instant::now();
                        let why = match agent.post(&url).send_json(&body) {
                            Ok(mut reply) => {
                                let status = reply.status().as_u16();
                                let text = reply.body_mut().read_to_string().unwrap_or_default();
                                // SMG ends a stream its worker cut with an error event and
                                // `[DONE]`: whole is the last chunk's finish and no error.
                                let whole = if streamed {
                                    text.contains("\"finish_reason\":\"stop\"")
                                        && text.contains("data: [DONE]")
                                        && !text.contains("\"error\"")
                                } else {
                                    text.contains("fake reply to")
                                };
                                (status != 200 || !whole).then(|| format!("{status}: {text}"))
                            }
                            Err(e) => Some(e.to_string()),
                        };
                        outcomes.push(Outcome {
                            id,
                            started,
                            ended: Instant::now(),
                            why,
                        });
                    }
                    outcomes
                })
            })
            .collect();
        Load { stop, threads }
    }

    fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    }
}

fn failures(outcomes: &[Outcome]) -> Vec<&Outcome> {
    outcomes.iter().filter(|o| o.why.is_some()).collect()
}

#[test]
fn chats_streams_and_messages_reach_real_workers_through_the_gateway_which_reads_their_slots() {
    let _one = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let server = installed_llama_server();
    let args = [
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        server.to_str().unwrap(),
        "--ctx-size",
        "1024",
        "--alias",
        "fleet",
    ];
    let Some(mut workers) = fleet(0, 2, &args, &[]) else {
        return;
    };
    workers.iter_mut().for_each(Worker::start);
    let gateway = Gateway::start(&workers, &[]);
    let ask = |extra: Value| {
        let mut body = json!({
            "model": "fleet",
            "temperature": 0,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body.to_string()
    };

    // A chat through the gateway is the chat a worker gives directly.
    let direct = post(&workers[0].url("/v1/chat/completions"), &ask(json!({})));
    assert_eq!(direct.0, 200, "{}", direct.1);
    let want =
        serde_json::from_str::<Value>(&direct.1).unwrap()["choices"][0]["message"]["content"]
            .clone();
    assert!(!want.as_str().unwrap().is_empty(), "{want}");
    let (status, reply) = post(&gateway.url("/v1/chat/completions"), &ask(json!({})));
    assert_eq!(status, 200, "{reply}\n{}", gateway.log());
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["choices"][0]["message"]["content"], want, "{reply}");

    let (status, stream) = post(
        &gateway.url("/v1/chat/completions"),
        &ask(json!({"stream": true})),
    );
    assert_eq!(status, 200, "{stream}");
    let text: String = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(text, want.as_str().unwrap(), "{stream}");
    assert!(stream.trim_end().ends_with("data: [DONE]"), "{stream}");

    // Anthropic's Messages API, whole and streamed.
    let (status, message) = post(&gateway.url("/v1/messages"), &ask(json!({})));
    assert_eq!(status, 200, "{message}");
    let message: Value = serde_json::from_str(&message).unwrap();
    assert_eq!(message["type"], "message", "{message}");
    assert_eq!(message["content"][0]["text"], want, "{message}");
    let (status, events) = post(&gateway.url("/v1/messages"), &ask(json!({"stream": true})));
    assert_eq!(status, 200, "{events}");
    let names: Vec<&str> = events
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"), "{events}");
    assert_eq!(names.last(), Some(&"message_stop"), "{events}");

    // The gateway registered each worker as what it is, with the slots and context
    // llama-server has, and polls its load.
    for worker in &workers {
        let info: Value = serde_json::from_str(&get(&worker.url("/get_server_info")).1).unwrap();
        let seen = gateway.worker(&worker.base());
        assert_eq!(seen["runtime_type"], "generic", "{seen}");
        let labels = &seen["labels"];
        assert_eq!(
            labels["max_running_requests"],
            info["max_running_requests"].to_string(),
            "{seen}"
        );
        assert_eq!(labels["context_length"], "1024", "{seen}");
        assert_eq!(labels["model_path"], model.to_str().unwrap(), "{seen}");
        assert!(
            wait_until(
                Duration::from_secs(5),
                || gateway.worker(&worker.base())["engine_load"]["loads"][0]["max_running_requests"]
                    == info["max_running_requests"]
            ),
            "{}",
            gateway.worker(&worker.base())
        );
    }
}

#[test]
fn the_gateway_sees_a_workers_queue_as_llama_server_has_it() {
    let _one = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let env = [
        ("FAKE_SLOTS", "1"),
        ("FAKE_SSE_EVENTS", "30"),
        ("FAKE_SSE_INTERVAL_MS", "100"),
    ];
    let Some(mut workers) = fake_fleet(1, 2, &[], &env) else {
        return;
    };
    workers.iter_mut().for_each(Worker::start);
    let gateway = Gateway::start(&workers, &[]);
    // Three streams on the first worker's one slot, sent to it directly: one runs, two wait.
    let url = workers[0].url("/v1/chat/completions");
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let url = url.clone();
            std::thread::spawn(move || {
                post(
                    &url,
                    &format!(
                        r#"{{"stream":true,"messages":[{{"role":"user","content":"q{i}"}}]}}"#
                    ),
                )
            })
        })
        .collect();
    let load = |w: &Worker| {
        let l = &gateway.worker(&w.base())["engine_load"]["loads"][0];
        (
            l["num_running_reqs"].as_u64(),
            l["num_waiting_reqs"].as_u64(),
        )
    };
    assert!(
        wait_until(Duration::from_secs(5), || load(&workers[0])
            == (Some(1), Some(2))),
        "{:?}\n{}",
        load(&workers[0]),
        gateway.worker(&workers[0].base())
    );
    assert_eq!(load(&workers[1]), (Some(0), Some(0)));
    let (status, metrics) = get(&format!(
        "http://127.0.0.1:{}/metrics",
        gateway.metrics_port
    ));
    assert_eq!(status, 200);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("smg_engine_waiting_requests{")
                && l.contains(&workers[0].base())
                && l.ends_with(" 2")),
        "{metrics}"
    );
    for s in streams {
        assert_eq!(s.join().unwrap().0, 200);
    }
}

#[test]
fn a_rolling_restart_of_every_worker_under_load_loses_no_request() {
    let _one = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let env = [("FAKE_SSE_EVENTS", "8"), ("FAKE_SSE_INTERVAL_MS", "50")];
    let Some(mut workers) = fake_fleet(2, 3, &DRAIN, &env) else {
        return;
    };
    workers.iter_mut().for_each(Worker::start);
    // The gateway's retries off: a request that met a stopping worker would fail at the client.
    let gateway = Gateway::start(&workers, &["--disable-retries"]);
    let load = Load::start(gateway.url("/v1/chat/completions"), 6);
    std::thread::sleep(Duration::from_secs(2));
    let began = Instant::now();
    for worker in &mut workers {
        let signalled = Instant::now();
        worker.serve().signal(Signal::SIGTERM);
        let status = worker
            .serve()
            .wait_exit(Duration::from_secs(12))
            .expect("the worker stops");
        assert_eq!(status.code(), Some(0), "{}", worker.serve().output());
        let stopped_in = signalled.elapsed();
        worker.start();
        let base = worker.base();
        assert!(
            wait_until(
                Duration::from_secs(15),
                || gateway.worker(&base)["is_healthy"] == true
            ),
            "the gateway did not take worker {base} back: {}",
            gateway.log()
        );
        eprintln!(
            "worker {base}: stopped {:.1} s after SIGTERM, back in the gateway's rotation {:.1} s after",
            stopped_in.as_secs_f64(),
            signalled.elapsed().as_secs_f64()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    let restarts = began.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let outcomes = load.finish();
    let failed = failures(&outcomes);
    let per_worker: Vec<u64> = workers
        .iter()
        .map(|w| gateway.requests_to(&w.base()))
        .collect();
    eprintln!(
        "rolling restart of {} workers in {:.1} s under load: {} requests answered, {} failed; the gateway sent {per_worker:?}",
        workers.len(),
        restarts.as_secs_f64(),
        outcomes.len() - failed.len(),
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} requests failed, the first: {:?}",
        failed.len(),
        outcomes.len(),
        failed[0].why
    );
    assert!(
        outcomes.len() > 100,
        "the load was not steady: {}",
        outcomes.len()
    );
    assert!(per_worker.iter().all(|&n| n > 0), "{per_worker:?}");
}

#[test]
fn a_worker_killed_outright_costs_at_most_its_requests_in_flight_and_leaves_nothing() {
    let _one = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let records = temp_dir("fleet-kill");
    let record = records.join("worker-1.jsonl");
    let env = [("FAKE_SSE_EVENTS", "10"), ("FAKE_SSE_INTERVAL_MS", "60")];
    let Some(mut workers) = fake_fleet(3, 3, &DRAIN, &env) else {
        return;
    };
    // Worker 1's backend records every request it receives.
    workers[1]
        .env
        .push(("FAKE_RECORD".into(), record.display().to_string()));
    workers.iter_mut().for_each(Worker::start);
    let gateway = Gateway::start(&workers, &[]);
    let load = Load::start(gateway.url("/v1/chat/completions"), 6);
    let killed = workers[1].base();
    assert!(
        wait_until(Duration::from_secs(10), || gateway.requests_to(&killed)
            >= 10),
        "the gateway sends worker {killed} nothing: {}",
        gateway.log()
    );
    let (pid, backends) = {
        let serve = workers[1].serve();
        (serve.pid(), serve.children())
    };
    assert!(!backends.is_empty());
    let kill_at = Instant::now();
    workers[1].serve().signal(Signal::SIGKILL);
    std::thread::sleep(Duration::from_secs(4));
    let outcomes = load.finish();

    // What failed was in flight on the killed worker when it died: its backend had the
    // request, and the client was still waiting for it.
    let received: HashSet<String> = BufReader::new(std::fs::File::open(&record).unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
        .filter_map(|r| {
            let body: Value = serde_json::from_str(r["body"].as_str()?).ok()?;
            let text = body["messages"][0]["content"].as_str()?;
            text.split_whitespace().next().map(String::from)
        })
        .collect();
    let in_flight: HashSet<&str> = outcomes
        .iter()
        .filter(|o| o.started < kill_at && o.ended > kill_at && received.contains(&o.id))
        .map(|o| o.id.as_str())
        .collect();
    let failed = failures(&outcomes);
    eprintln!(
        "SIGKILL of worker {killed} under load: {} requests answered, {} failed, {} were in flight on it",
        outcomes.len() - failed.len(),
        failed.len(),
        in_flight.len()
    );
    for f in &failed {
        assert!(
            in_flight.contains(f.id.as_str()),
            "{} failed but was not in flight on the killed worker: {:?}",
            f.id,
            f.why
        );
    }
    let after = outcomes
        .iter()
        .filter(|o| o.started > kill_at + Duration::from_secs(1))
        .count();
    assert!(after > 20, "the others did not take the load: {after}");

    // Nothing of it is left, and its next start removes the run folder it left.
    assert!(
        wait_until(Duration::from_secs(3), || !alive(pid)
            && backends.iter().all(|b| !alive(*b))),
        "left alive: serve {pid} {}, backends {backends:?}",
        alive(pid)
    );
    let run_dir = std::env::temp_dir().join(format!("1bit-serve-{pid}"));
    assert!(run_dir.exists(), "{}", run_dir.display());
    workers[1].serve = None;
    workers[1].start();
    let out = workers[1].serve().output();
    assert!(
        out.contains(&format!(
            "removed {}, left by a serve that is gone",
            run_dir.display()
        )),
        "{out}"
    );
    assert!(!run_dir.exists());
}

/// The fleet's one prompt cache through the gateway: two workers on the real llama-server
/// given one folder (the same disk, as NFS would give two machines). A conversation's first
/// turn is served and saved by one worker; that worker is stopped (a rolling restart), so the
/// gateway sends the second turn to the other, which restores the first turn's prefix from
/// the folder: `cached_tokens` covers it, and the reply is a cold serve's, token for token.
#[test]
fn a_conversation_moved_to_another_worker_is_restored_from_the_fleets_folder() {
    use onebit_tests::prompt_cache_chats::{MIN_TOKENS, UBATCH, first_turn, next_turn, text};
    let _one = ONE_FLEET_AT_A_TIME
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let server = installed_llama_server();
    let folder = temp_dir("fleet-prompt-cache");
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        server.to_str().unwrap(),
        "--ctx-size",
        "2048",
        "--alias",
        "fleet",
        "--prompt-cache-dir",
        folder.to_str().unwrap(),
        "--prompt-cache-min-tokens",
        MIN_TOKENS,
    ];
    args.extend_from_slice(&DRAIN);
    let Some(mut workers) = fleet(4, 2, &args, &[]) else {
        return;
    };
    workers.iter_mut().for_each(Worker::start);
    let gateway = Gateway::start(&workers, &[]);
    let chat = |messages: &Value| {
        let body =
            json!({"model": "fleet", "messages": messages, "temperature": 0, "max_tokens": 24});
        let (status, reply) = post(&gateway.url("/v1/chat/completions"), &body.to_string());
        assert_eq!(status, 200, "{reply}\n{}", gateway.log());
        serde_json::from_str::<Value>(&reply).unwrap()
    };
    let first = first_turn("ships");
    let reply1 = chat(&first);
    let p1 = reply1["usage"]["prompt_tokens"].as_u64().unwrap();
    let saved = || {
        std::fs::read_dir(&folder)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
                    .count()
            })
            .unwrap_or(0)
    };
    assert!(
        wait_until(Duration::from_secs(30), || saved() == 1),
        "turn one saved: {:?}",
        std::fs::read_dir(&folder).map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
    );
    let served: Vec<usize> = (0..2)
        .filter(|&i| gateway.requests_to(&workers[i].base()) > 0)
        .collect();
    assert_eq!(served.len(), 1, "one worker served turn one: {served:?}");
    let (a, b) = (served[0], 1 - served[0]);
    workers[a].serve().signal(Signal::SIGTERM);
    assert!(
        workers[a]
            .serve()
            .wait_exit(Duration::from_secs(15))
            .is_some(),
        "worker A stops"
    );
    assert!(
        wait_until(Duration::from_secs(15), || gateway.healthy() == 1),
        "the gateway took worker A out: {}",
        gateway.log()
    );

    let second = next_turn(&first, &reply1, "And item 8?");
    let warm = chat(&second);
    let restored = p1 / UBATCH * UBATCH;
    assert_eq!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(restored),
        "{warm}"
    );
    let said = format!("prompt cache: restored {restored} of the prompt's tokens");
    assert!(
        workers[b].serve().output().contains(&said),
        "worker B restored it: {}",
        workers[b].serve().output()
    );
    let cold = serve_cpu(&model, &["--ctx-size", "2048", "--no-prompt-cache"]);
    let (status, cold_reply) = post(
        &cold.url("/v1/chat/completions"),
        &json!({"messages": second, "temperature": 0, "max_tokens": 24}).to_string(),
    );
    assert_eq!(status, 200, "{cold_reply}");
    assert_eq!(
        text(&warm),
        text(&serde_json::from_str(&cold_reply).unwrap()),
        "turn two on worker B, token for token"
    );
    let _ = std::fs::remove_dir_all(&folder);
}
