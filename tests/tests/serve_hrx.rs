//! The hrx route with no GPU: its plan through `--print-backend`, and serve on the fake backend
//! playing an HRX llama-server (placement report and strict-abort lines, warm-ups).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use onebit_tests::*;

const SECS: fn(u64) -> Duration = Duration::from_secs;
const CLEAN: &str = "/src/ggml-hrx/ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 0 off HRX, 1 graph splits";
const DIRTY: &str = "/src/ggml-hrx/ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 34 off HRX (MUL_MAT x 30, GET_ROWS x 4), 7 graph splits";
const LESS_DIRTY: &str = "/src/ggml-hrx/ggml-hrx.cpp:431: placement_observer: placement: 512 nodes, 3 off HRX (MUL_MAT x 3), 2 graph splits";
const ABORT: &str = r#"/src/ggml-hrx/ggml-hrx.cpp:447: placement_observer: GGML_HRX_STRICT=1: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits"#;

/// `1bit serve ARGS` with `env` added and every `GGML_HRX_*` of the test's own environment
/// removed: (exit code, stdout, stderr).
fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(onebit());
    command.arg("serve").args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("GGML_HRX_") || k.starts_with("ONEBIT_") {
            command.env_remove(k);
        }
    }
    command.envs(env.iter().copied());
    let out = command.output().expect("1bit runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn print_args<'a>(model: &'a Path, device: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        device,
        "--alias",
        "Qwen3-4B-1bit",
        "--port",
        "8001",
        "--print-backend",
    ];
    args.extend_from_slice(extra);
    args
}

fn fake() -> String {
    fake_backend().to_str().unwrap().to_string()
}

#[test]
fn print_backend_prints_the_hrx_plan_with_its_env_and_warmups() {
    let dir = temp_dir("print-hrx");
    let model = dummy_model(&dir, "Qwen3-4B-Q4_K_M.gguf");
    let fake = fake();
    let mut args = print_args(&model, "hrx", &["--llama-server", &fake]);
    let (code, stdout, stderr) = run(&args, &[("ONEBIT_HRX_PRESENT", "0")]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["device"], "hrx");
    assert_eq!(v["port"], 8001);
    let argv: Vec<&str> = v["argv"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(argv[0], fake);
    for w in [
        &["--port", "8001"][..],
        &["--device", "HRX0"],
        &["-ngl", "99"],
        &["--alias", "Qwen3-4B-1bit"],
        &["--cache-reuse", "256"],
    ] {
        assert!(argv.windows(w.len()).any(|x| x == w), "{w:?}: {argv:?}");
    }
    assert_eq!(v["env"]["GGML_HRX_STRICT"], "1");
    assert_eq!(v["env"]["GGML_HRX_REPORT"], "1");
    assert_eq!(v["warmups"].as_array().unwrap().len(), 2);
    assert_eq!(v["warmups"][1]["path"], "/completion");
    assert_eq!(v["warmup"], v["warmups"][0]);

    // A variable the caller set is not listed, and ONEBIT_NO_WARMUP drops the warm-ups.
    let (code, stdout, _) = run(
        &args,
        &[("GGML_HRX_STRICT", "0"), ("ONEBIT_NO_WARMUP", "1")],
    );
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(v["env"].get("GGML_HRX_STRICT").is_none(), "{v}");
    assert_eq!(v["warmups"], serde_json::json!([]));
    assert!(v["warmup"].is_null());

    // --print-backend-env: only the environment, NAME=VALUE, what the caller did not set.
    args.retain(|a| *a != "--print-backend");
    args.push("--print-backend-env");
    let (code, stdout, stderr) = run(&args, &[("GGML_HRX_REPORT", "0")]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "GGML_HRX_STRICT=1\n");
    args.push("--placement-report");
    let (_, stdout, _) = run(&args, &[]);
    assert_eq!(stdout, "GGML_HRX_REPORT=2\nGGML_HRX_STRICT=1\n");
    args.push("--no-strict-device");
    let (_, stdout, _) = run(&args, &[]);
    assert_eq!(stdout, "GGML_HRX_REPORT=2\n");
    let (_, stdout, _) = run(&args[..args.len() - 2], &[("ONEBIT_STRICT_DEVICE", "0")]);
    assert_eq!(stdout, "GGML_HRX_REPORT=1\n");
}

#[test]
fn strict_device_and_no_strict_device_do_not_combine() {
    let dir = temp_dir("strict-combine");
    let model = dummy_model(&dir, "m.gguf");
    let (code, _, stderr) = run(
        &print_args(&model, "hrx", &["--strict-device", "--no-strict-device"]),
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[test]
fn print_backend_exits_5_where_serve_must_stay_in_the_request_path() {
    let dir = temp_dir("print-5");
    let model = dummy_model(&dir, "m.gguf");
    let fake = fake();
    let cases: [(&str, &[&str]); 9] = [
        ("npu", &[]),
        ("hybrid", &[]),
        ("ds4", &[]),
        ("cpu", &["--pm"]),
        ("cpu", &["--laya"]),
        ("cpu", &["--embed", "e.gguf"]),
        ("cpu", &["--rerank", "r.gguf"]),
        ("hrx", &["--pm"]),
        ("auto", &["--laya-model", "/l"]),
    ];
    for (device, extra) in cases {
        let mut args = print_args(&model, device, extra);
        args.extend(["--llama-server", &fake]);
        let (code, stdout, stderr) = run(&args, &[]);
        assert_eq!(code, 5, "{device} {extra:?}: {stderr}");
        assert!(stdout.is_empty());
        assert!(
            stderr.contains("needs 1bit serve in the request path"),
            "{stderr}"
        );
    }
    let npu_dir = dir.join("npu-model");
    std::fs::create_dir_all(&npu_dir).unwrap();
    let (code, _, stderr) = run(&print_args(&npu_dir, "auto", &[]), &[]);
    assert_eq!(code, 5, "{stderr}");
    assert!(stderr.contains("model directory"), "{stderr}");
}

#[test]
fn auto_picks_hrx_only_where_hrx_is_present() {
    let dir = temp_dir("auto");
    let model = dummy_model(&dir, "m.gguf");
    let fake = fake();
    let args = print_args(&model, "auto", &["--llama-server", &fake]);
    let device = |present: &str| {
        let (code, stdout, stderr) = run(&args, &[("ONEBIT_HRX_PRESENT", present)]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        (v["device"].as_str().unwrap().to_string(), stderr)
    };
    let (chosen, stderr) = device("1");
    assert_eq!(chosen, "hrx");
    assert!(stderr.contains("--device auto chose hrx"), "{stderr}");
    assert_eq!(device("0").0, "cpu");
}

#[test]
fn a_gguf_of_an_architecture_llama_cpp_does_not_build_is_refused_on_hrx_and_cpu() {
    let dir = temp_dir("arch");
    let fake = fake();
    let zamba = dir.join("zamba2.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "zamba2")
        .write(&zamba)
        .unwrap();
    for device in ["hrx", "cpu"] {
        let (code, _, stderr) = run(&print_args(&zamba, device, &["--llama-server", &fake]), &[]);
        assert_eq!(code, 2, "{stderr}");
        assert!(
            stderr.contains("architecture zamba2 is not in ")
                && stderr.contains("Lemonade's llamacpp backend"),
            "{stderr}"
        );
    }
    let qwen = dir.join("qwen3.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "qwen3")
        // Enough of the model's shape for the memory check to estimate it.
        .kv("qwen3.block_count", 2u32)
        .kv("qwen3.context_length", 4096u32)
        .kv("qwen3.embedding_length", 64u32)
        .kv("qwen3.attention.head_count", 4u32)
        .write(&qwen)
        .unwrap();
    let (code, _, stderr) = run(&print_args(&qwen, "hrx", &["--llama-server", &fake]), &[]);
    assert_eq!(code, 0, "{stderr}");
}

#[test]
fn removed_devices_flags_and_the_h32_format_are_refused_at_once_with_their_reason() {
    let dir = temp_dir("removed");
    let model = dummy_model(&dir, "m.gguf");
    let m = model.to_str().unwrap();
    let h32 = dir.join("h32.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "qwen3")
        .kv("onebit.hadamard_q4_0", true)
        .write(&h32)
        .unwrap();
    let h = h32.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--device", "vulkan"],
            "--device vulkan was removed: it ran upstream llama.cpp's release on Vulkan0",
        ),
        (
            vec!["--device", "rocm"],
            "--device rocm was removed: it ran the ROCmFPX tree's ROCm build on ROCm0",
        ),
        (
            vec!["--device", "zinc"],
            "--device zinc was removed: ZINC (zolotukhin/zinc)",
        ),
        (
            vec!["--device", "mlx"],
            "--device mlx was removed: lemon-mlx-engine's server",
        ),
        (
            vec!["--lean"],
            "--lean was removed: ROCmFPX's ROCmFP4 / ROCmI4 formats",
        ),
        (
            vec!["--prefill-device", "hrx"],
            "--prefill-device was removed: Vulkan decode with the prompt prefilled on HRX0",
        ),
        (
            vec!["--prefill-min-tokens", "512"],
            "--prefill-min-tokens was removed: Vulkan decode",
        ),
        (
            vec!["--adaptive"],
            "--adaptive was removed: Vulkan for the first requests with ROCm",
        ),
        (
            vec!["--adaptive-at", "4"],
            "--adaptive-at was removed: Vulkan for the first requests",
        ),
        (
            vec!["--long-model", "x.gguf"],
            "--long-model was removed: long conversations to a Hadamard-rotated Q4_0",
        ),
        (
            vec!["--long-from", "8192"],
            "--long-from was removed: long conversations",
        ),
        (
            vec!["--zinc", "/z"],
            "--zinc was removed with --device zinc: ZINC",
        ),
        (
            vec!["--mlx-server", "/x"],
            "--mlx-server was removed with --device mlx: lemon-mlx-engine's server",
        ),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["-m", m];
        args.extend(extra.iter().copied());
        let (code, _, stderr) = run(&args, &[]);
        assert_eq!(code, 2, "{extra:?}: {stderr}");
        let ours: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("1bit serve:"))
            .collect();
        assert_eq!(ours.len(), 1, "{extra:?}: {stderr}");
        assert!(ours[0].contains(expected), "{extra:?}: {stderr}");
    }
    for device in ["hrx", "cpu", "auto", "ds4"] {
        let (code, _, stderr) = run(&["-m", h, "--device", device], &[]);
        assert_eq!(code, 2, "{device}: {stderr}");
        assert!(
            stderr.contains("stamped onebit.hadamard_q4_0")
                && stderr.contains("dropped that format"),
            "{device}: {stderr}"
        );
    }
}

/// serve on the fake backend as an HRX llama-server, printing `lines` on stderr.
fn serve_hrx(dir: &Path, extra: &[&str], lines: &[&str], env: &[(&str, &str)]) -> Serve {
    let model = dummy_model(dir, "m.gguf");
    let fake = fake();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "hrx",
        "--llama-server",
        &fake,
    ];
    args.extend_from_slice(extra);
    let joined = lines.join("\n");
    let mut env = env.to_vec();
    env.push(("FAKE_STDERR_LINES", &joined));
    Serve::start(&args, &env)
}

#[test]
fn placement_report_summaries_are_said_when_a_graph_is_worse_than_every_before() {
    let dir = temp_dir("hrx-report");
    let serve = serve_hrx(
        &dir,
        &["--placement-report"],
        &[CLEAN, LESS_DIRTY, CLEAN, DIRTY, LESS_DIRTY],
        &[("ONEBIT_NO_WARMUP", "1")],
    );
    serve.ready();
    assert!(
        serve.wait_output("worst of 4 graphs", SECS(5)),
        "{}",
        serve.output()
    );
    let out = serve.output();
    let summaries: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("1bit serve: HRX placement"))
        .collect();
    assert_eq!(
        summaries,
        [
            "1bit serve: HRX placement: all 512 nodes on HRX, 1 graph splits",
            "1bit serve: HRX placement: 3 of 512 nodes off HRX (MUL_MAT x 3), 2 graph splits, worst of 2 graphs",
            "1bit serve: HRX placement: 34 of 512 nodes off HRX (GET_ROWS x 4, MUL_MAT x 30), 7 graph splits, worst of 4 graphs",
        ],
        "{out}"
    );
    // The backend's own lines pass through unchanged.
    assert!(out.contains(DIRTY));
}

#[test]
fn the_strict_abort_ends_serve_with_its_own_line_naming_the_node_and_the_opt_out() {
    let dir = temp_dir("hrx-abort");
    let mut serve = serve_hrx(&dir, &[], &[ABORT], &[("FAKE_LOAD_MS", "5000")]);
    let status = serve.wait_exit(SECS(20)).expect("serve exits");
    assert_eq!(status.code(), Some(1), "{}", serve.output());
    let out = serve.output();
    assert!(
        out.contains(r#"1bit serve: HRX strict placement refused the model: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits. Pass --no-strict-device (or set ONEBIT_STRICT_DEVICE=0) to run those nodes on the CPU instead"#),
        "{out}"
    );
}

#[test]
fn strict_device_refuses_a_report_with_nodes_off_hrx() {
    let dir = temp_dir("hrx-strict");
    let mut serve = serve_hrx(
        &dir,
        &["--strict-device"],
        &[CLEAN, DIRTY],
        &[("FAKE_LOAD_MS", "5000")],
    );
    let status = serve.wait_exit(SECS(20)).expect("serve exits");
    assert_eq!(status.code(), Some(1), "{}", serve.output());
    let out = serve.output();
    assert!(
        out.contains("1bit serve: HRX strict placement refused the model: 34 of 512 nodes off HRX (GET_ROWS x 4, MUL_MAT x 30), 7 graph splits. Pass --no-strict-device"),
        "{out}"
    );
}

#[test]
fn the_warmups_arrive_in_order_before_ready() {
    let dir = temp_dir("hrx-warmup");
    let record = dir.join("record.jsonl");
    let serve = serve_hrx(
        &dir,
        &[],
        &[],
        &[
            ("FAKE_RECORD", record.to_str().unwrap()),
            ("FAKE_LOAD_MS", "300"),
        ],
    );
    serve.ready();
    let posts: Vec<serde_json::Value> = json_lines(&record)
        .into_iter()
        .filter(|l| l["method"] == "POST")
        .collect();
    assert_eq!(posts.len(), 2, "{posts:?}");
    assert_eq!(posts[0]["path"], "/v1/chat/completions");
    let chat: serde_json::Value = serde_json::from_str(posts[0]["body"].as_str().unwrap()).unwrap();
    assert_eq!(chat["max_tokens"], 8);
    assert_eq!(chat["cache_prompt"], false);
    assert_eq!(posts[1]["path"], "/completion");
    let completion: serde_json::Value =
        serde_json::from_str(posts[1]["body"].as_str().unwrap()).unwrap();
    assert_eq!(completion["n_predict"], 0);
}

/// serve on the ds4 route, the fake standing in for ds4-server (`FAKE_DS4`), with `extra`
/// flags and `env` besides; not yet ready.
fn serve_ds4(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Serve {
    let dir = temp_dir(name);
    let model = dummy_model(&dir, "DeepSeek-V4-Flash.gguf");
    let fake = fake();
    let mut args = vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "ds4",
        "--ds4",
        &fake,
    ];
    args.extend_from_slice(extra);
    let mut env = env.to_vec();
    env.push(("FAKE_DS4", "1"));
    Serve::start(&args, &env)
}

#[test]
fn ds4_serves_through_the_fake_with_health_on_v1_models_501s_and_the_served_name() {
    let serve = serve_ds4(
        "ds4",
        &["--alias", "flash", "--ssd-streaming"],
        &[
            ("FAKE_LOAD_MS", "300"),
            ("FAKE_MODEL_NAME", "/models/ds4-internal-name"),
        ],
    );
    serve.ready();
    let out = serve.output();
    let start = out
        .lines()
        .find(|l| l.contains("starting ds4-server on the ds4 route"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(start.ends_with("--ssd-streaming"), "{start}");
    let (status, body) = post(
        &serve.url("/v1/chat/completions"),
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model"], "flash");
    let events = sse(
        &serve.url("/v1/chat/completions"),
        r#"{"stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
    );
    let named: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .map(|v| v["model"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(named.len() > 2, "{events:?}");
    assert!(
        named.iter().all(|m| m == "flash"),
        "every streamed event: {named:?}"
    );
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    // Both rewrites (the whole reply's name, each event's) are the reply's phases': both
    // chats rode the fast engine, no hand-over.
    let chats = |engine| requests_total(&serve, &[("path_class", "chat"), ("engine", engine)]);
    assert_eq!((chats("fast"), chats("general")), (2, 0));
    for (get_it, path) in [
        (false, "/tokenize"),
        (false, "/apply-template"),
        (true, "/slots"),
        (true, "/props"),
    ] {
        let (status, body) = if get_it {
            get(&serve.url(path))
        } else {
            post(&serve.url(path), "{}")
        };
        assert_eq!(status, 501, "{path}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {
                "message": format!("{path} is not available on --device ds4"),
                "type": "not_implemented",
                "code": 501
            }})
        );
    }
}

/// ds4-server's refusal of a streamed request is one JSON object, not an event stream: it
/// reaches the client whole (the served name is written into events only), with no keep-alive
/// comment in it.
#[test]
fn ds4s_json_refusal_of_a_streamed_request_reaches_the_client_whole() {
    let serve = serve_ds4("ds4-refusal", &[], &[]);
    serve.ready();
    // More words than the fake's 4,096-token context: it refuses with llama.cpp's 400.
    let prompt = "word ".repeat(5000);
    let body = serde_json::json!({
        "stream": true,
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string();
    let (status, reply) = post(&serve.url("/v1/chat/completions"), &body);
    assert_eq!(status, 400, "{reply}");
    let v: serde_json::Value = serde_json::from_str(&reply)
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {reply:?}"));
    assert_eq!(v["error"]["type"], "exceed_context_size_error", "{reply}");
}

#[test]
fn recipes_are_applied_replaced_disabled_and_a_malformed_file_is_refused() {
    let dir = temp_dir("recipes");
    let fake = fake();
    let model = dir.join("qwen3.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "qwen3")
        // Enough of the model's shape for the memory check to estimate it.
        .kv("qwen3.block_count", 2u32)
        .kv("qwen3.context_length", 4096u32)
        .kv("qwen3.embedding_length", 64u32)
        .kv("qwen3.attention.head_count", 4u32)
        .write(&model)
        .unwrap();
    let file = dir.join("tuned.json");
    std::fs::write(
        &file,
        r#"{"recipes":[{"id":"qwen3-hrx","match":{"device":["hrx","cpu"],"architecture":["qwen3"],"moe":false},
            "args":["--cache-reuse","512","-ub","1024","-ngl","0"],"env":{"GGML_HRX_EXTRA":"1"},
            "why":"test","measured":"by the test","source":"tests/serve_hrx.rs"}]}"#,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let argv_of = |stdout: &str| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        v["argv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let (code, stdout, stderr) = run(
        &print_args(&model, "hrx", &["--llama-server", &fake, "--recipes", f]),
        &[],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(
            "1bit serve: recipe qwen3-hrx: --cache-reuse 512, -ub 1024, GGML_HRX_EXTRA=1"
        ),
        "{stderr}"
    );
    let argv = argv_of(&stdout).join(" ");
    assert!(argv.contains("--cache-reuse 512 -ub 1024"), "{argv}");
    assert!(
        !argv.contains("--cache-reuse 256") && !argv.contains("-ngl 0"),
        "{argv}"
    );

    // On cpu serve's -ngl 0 and -c stay; the built-in set (empty) adds nothing; --no-recipes
    // turns them off.
    let (_, stdout, stderr) = run(
        &print_args(&model, "cpu", &["--llama-server", &fake, "--recipes", f]),
        &[],
    );
    assert!(stderr.contains("recipe qwen3-hrx: --cache-reuse 512, -ub 1024, GGML_HRX_EXTRA=1"));
    let argv = argv_of(&stdout).join(" ");
    assert!(
        argv.contains("-ngl 0 -c 4096 --cache-reuse 512 -ub 1024"),
        "{argv}"
    );
    assert!(!argv.contains("-ub 256"), "the recipe's -ub wins: {argv}");
    for extra in [&[][..], &["--no-recipes"]] {
        let mut args = print_args(&model, "hrx", &["--llama-server", &fake]);
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = run(&args, &[]);
        assert_eq!(code, 0, "{stderr}");
        assert!(!stderr.contains("recipe"), "{stderr}");
        assert!(argv_of(&stdout).join(" ").contains("--cache-reuse 256"));
    }

    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"recipes":[{"id":"bad","match":{"archtecture":["qwen3"]},"args":["-ub","1"],"measured":"m"}]}"#,
    )
    .unwrap();
    let (code, _, stderr) = run(
        &print_args(
            &model,
            "hrx",
            &["--llama-server", &fake, "--recipes", bad.to_str().unwrap()],
        ),
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{}: recipe bad: unknown match key \"archtecture\"",
            bad.display()
        )),
        "{stderr}"
    );
}
