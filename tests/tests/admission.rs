//! Will it fit? The memory check before any backend starts, and the estimate against what the
//! real llama-server allocates.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use onebit_plugin_api::loader;
use onebit_plugin_api::{ModelFacts, PlanOutcome, PlanRequest, ServeOptions};
use onebit_tests::*;

/// A valid llama-architecture header (SmolLM2's shape), then a hole up to 4 TiB.
fn sparse_4tib(dir: &Path) -> PathBuf {
    let path = dir.join("huge-4TiB.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(4 << 40)
        .write(&path)
        .unwrap();
    path
}

fn serve_args<'a>(model: &'a Path, fake: &'a Path) -> Vec<&'a str> {
    vec![
        "-m",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--llama-server",
        fake.to_str().unwrap(),
    ]
}

#[test]
fn a_4tib_model_is_refused_with_exit_3_in_milliseconds_before_any_backend_starts() {
    let dir = temp_dir("4tib");
    let model = sparse_4tib(&dir);
    let record = dir.join("record.jsonl");
    let fake = fake_backend();
    let began = Instant::now();
    let mut serve = Serve::start(
        &serve_args(&model, &fake),
        &[("FAKE_RECORD", record.to_str().unwrap())],
    );
    let exit = serve.wait_exit(Duration::from_secs(10)).expect("refused");
    let took = began.elapsed();
    assert_eq!(exit.code(), Some(3), "{}", serve.output());
    let out = serve.output();
    let line = out
        .lines()
        .find(|l| l.starts_with("1bit serve: huge-4TiB does not fit: need 40"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("(huge-4TiB.gguf: weights 4096.00 + KV/state 0.09 + compute 0.50)"),
        "{line}"
    );
    assert!(
        line.ends_with("; free memory, lower --ctx-size, or pass --no-mem-check"),
        "{line}"
    );
    assert!(!out.contains("starting llama-server"), "{out}");
    assert!(!record.exists(), "the fake backend was started");
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[test]
fn mem_check_prints_the_estimate_and_exits_0_or_3() {
    let dir = temp_dir("memcheck");
    let huge = sparse_4tib(&dir);
    let small = dummy_small_gguf(&dir);
    let fake = fake_backend();
    for (model, code, word) in [
        (&small, 0, ": fits: need "),
        (&huge, 3, " does not fit: need "),
    ] {
        let out = Command::new(onebit())
            .arg("serve")
            .args(serve_args(model, &fake))
            .arg("--mem-check")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(code), "{stdout}");
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        assert!(stdout.contains(word), "{stdout}");
        assert!(
            stdout.contains("free ") && stdout.contains("MemAvailable"),
            "{stdout}"
        );
    }
    let printed = Command::new(onebit())
        .arg("serve")
        .args(serve_args(&huge, &fake))
        .args(["--print-backend", "--port", "8001"])
        .output()
        .unwrap();
    assert_eq!(
        printed.status.code(),
        Some(3),
        "--print-backend checks memory too"
    );
    assert!(printed.stdout.is_empty());
}

/// `1bit serve ... --mem-check EXTRA` on the cpu route with the fake: its exit status and what
/// it wrote.
fn mem_check(model: &Path, fake: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(onebit())
        .arg("serve")
        .args(serve_args(model, fake))
        .arg("--mem-check")
        .args(extra)
        .output()
        .unwrap();
    (out.status.code(), output_text(&out))
}

/// A context given to llama-server after `--` is the one llama-server allocates (it comes
/// later on its command line than serve's), so it is the one the memory check sizes; serve's
/// own `--ctx-size` that says another is refused before anything is read.
#[test]
fn a_context_passed_to_llama_server_is_the_one_checked() {
    let dir = temp_dir("memcheck-passed-ctx");
    let small = dummy_small_gguf(&dir);
    let fake = fake_backend();
    let check = |extra: &[&str]| mem_check(&small, &fake, extra);
    // 1 Gi tokens of a 2-layer, 64-wide model's f16 cache: 512 GiB, more than any machine here.
    let huge = "1073741824";
    let inline = format!("--ctx-size={huge}");
    for passed in [vec!["-c", huge], vec![inline.as_str()]] {
        let mut extra = vec!["--"];
        extra.extend(passed);
        let (code, said) = check(&extra);
        assert_eq!(code, Some(3), "{said}");
        assert!(said.contains(&format!(" at ctx {huge} ")), "{said}");
    }
    let (code, said) = check(&["--ctx-size", "4096", "--", "-c", huge]);
    assert_eq!(code, Some(2), "{said}");
    assert_eq!(
        said.trim(),
        format!(
            "1bit serve: --ctx-size 4096 and -c {huge} after -- disagree, and llama-server would take {huge}; give the context once (--ctx-size {huge})"
        )
    );
    let (code, said) = check(&["--", "-c", "lots"]);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("-c lots after --: not a number of tokens"),
        "{said}"
    );
    let (code, said) = check(&["--ctx-size", "2048", "--", "-c", "2048"]);
    assert_eq!(code, Some(0), "the same context twice is one: {said}");
}

/// A quantized cache passed to llama-server after `--` is the cache the check counts: SmolLM2's
/// 90 MiB of f16 K and V at 4096 cells become 34/64 of that with q8_0.
#[test]
fn a_cache_type_passed_to_llama_server_is_counted() {
    let dir = temp_dir("memcheck-passed-kv");
    let model = dir.join("smollm2-shaped.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .write(&model)
        .unwrap();
    let fake = fake_backend();
    let kv_of = |extra: &[&str]| {
        let (code, said) = mem_check(&model, &fake, extra);
        assert_eq!(code, Some(0), "{said}");
        let kv = said
            .split("KV/state ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{said}"));
        kv.to_string()
    };
    assert_eq!(kv_of(&[]), "0.09");
    assert_eq!(
        kv_of(&["--", "-ctk", "q8_0", "--cache-type-v=q8_0"]),
        "0.05"
    );
    assert_eq!(kv_of(&["--", "--temp", "0.6"]), "0.09");
}

#[test]
fn hrx_judges_the_models_own_context_when_none_is_given() {
    let dir = temp_dir("memcheck-hrx");
    let small = dummy_small_gguf(&dir);
    let fake = fake_backend();
    let out = Command::new(onebit())
        .args(["serve", "-m", small.to_str().unwrap(), "--device", "hrx"])
        .args(["--llama-server", fake.to_str().unwrap(), "--mem-check"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(" at the model's own ctx 4096 (no --ctx-size), free "),
        "{stdout}"
    );
}

/// A small header-only llama model: fits anywhere.
fn dummy_small_gguf(dir: &Path) -> PathBuf {
    let path = dir.join("small.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "llama")
        .kv("llama.block_count", 2u32)
        .kv("llama.context_length", 4096u32)
        .kv("llama.embedding_length", 64u32)
        .kv("llama.attention.head_count", 4u32)
        .write(&path)
        .unwrap();
    path
}

#[test]
fn no_mem_check_and_onebit_mem_check_0_skip_the_check() {
    let dir = temp_dir("skip");
    let model = sparse_4tib(&dir);
    let fake = fake_backend();
    let mut args = serve_args(&model, &fake);
    args.push("--no-mem-check");
    let serve = Serve::start(&args, &[]);
    serve.ready();
    drop(serve);
    let serve = Serve::start(&serve_args(&model, &fake), &[("ONEBIT_MEM_CHECK", "0")]);
    // A 4 TiB model is refused (exit 3) unless the check is skipped, so `ready` is the test;
    // a skipped check also says nothing of fitting.
    serve.ready();
    let output = serve.output();
    assert!(
        !output.contains("fits: need") && !output.contains("does not fit"),
        "{output}"
    );
}

/// The cpu route's plan for `model` at `ctx`, through the real route library.
fn cpu_plan(model: &Path, ctx: u64, server: &Path) -> onebit_plugin_api::Plan {
    let route =
        loader::load(&bin_dir().join("libonebit_route_cpu.so")).expect("the cpu route loads");
    let request = PlanRequest {
        options: ServeOptions {
            model: model.to_string_lossy().into_owned(),
            served_name: "m".into(),
            ctx_size: Some(ctx),
            llama_server: Some(server.to_string_lossy().into_owned()),
            ..Default::default()
        },
        model: ModelFacts {
            path: model.to_string_lossy().into_owned(),
            files: vec![model.to_string_lossy().into_owned()],
            bytes: std::fs::metadata(model).unwrap().len(),
            ..Default::default()
        },
        env: std::env::vars().collect(),
        ports: vec![free_port()],
        ..Default::default()
    };
    match route.plan(&request).unwrap() {
        PlanOutcome::Plan(plan) => plan,
        PlanOutcome::Refused(r) => panic!("refused: {}", r.message),
    }
}

/// Run the plan's llama-server with `-lv 4` until it has allocated its caches, and add up the
/// `KV buffer size = X MiB` lines (and `RS buffer size` for recurrent state).
fn llama_server_kv_mib(argv: &[String]) -> f64 {
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .args(["-lv", "4"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut total = 0.0;
    let reader = BufReader::new(child.stderr.take().unwrap());
    for line in reader.lines().map_while(Result::ok) {
        if line.contains("KV buffer size") || line.contains("RS buffer size") {
            let mib = line
                .split('=')
                .nth(1)
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap();
            total += mib;
        }
        if line.contains("compute buffer size") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    total
}

#[test]
fn the_estimate_is_within_1_percent_of_llama_servers_own_kv_for_two_architectures() {
    let server = installed_llama_server();
    let smol = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let gemma = installed_model("gemma-3-270m-Q4_K_M.gguf");
    for model in [&smol, &gemma] {
        for ctx in [1024u64, 4096] {
            let plan = cpu_plan(model, ctx, &server);
            let estimate =
                plan.memory.expect("a GGUF gets an estimate").kv_bytes as f64 / (1 << 20) as f64;
            let actual = llama_server_kv_mib(&plan.backends[0].argv);
            assert!(actual > 0.0, "llama-server printed its KV size");
            let error = (estimate - actual).abs() / actual;
            println!(
                "{} ctx {ctx}: estimate {estimate:.2} MiB, llama-server {actual:.2} MiB",
                model.display()
            );
            assert!(
                error <= 0.01,
                "{}: ctx {ctx}: estimate {estimate} MiB vs llama-server {actual} MiB",
                model.display()
            );
        }
    }
}

/// A header-only GGUF of the kind the original's tests and route authors' rigs use: a
/// `general.architecture` key and nothing to estimate memory from.
fn arch_only_gguf(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    gguf::writer::Builder::new()
        .kv("general.architecture", "llama")
        .write(&path)
        .unwrap();
    path
}

#[test]
fn a_model_whose_memory_cannot_be_estimated_is_served_after_one_warning_line() {
    let dir = temp_dir("unknown-need");
    let model = arch_only_gguf(&dir, "arch-only.gguf");
    let fake = fake_backend();
    let serve = Serve::start(&serve_args(&model, &fake), &[]);
    serve.ready();
    let out = serve.output();
    let warnings: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("cannot estimate its memory"))
        .collect();
    assert_eq!(warnings.len(), 1, "{out}");
    let line = warnings[0];
    assert!(
        line.starts_with("1bit serve: warning: arch-only: cannot estimate its memory (")
            && line.contains("key 'llama.block_count' is missing")
            && line.contains("so the memory check is skipped"),
        "{line}"
    );
    drop(serve);
    let mut args = serve_args(&model, &fake);
    args.push("--no-mem-check");
    for (args, env) in [
        (args.clone(), vec![]),
        (serve_args(&model, &fake), vec![("ONEBIT_MEM_CHECK", "0")]),
    ] {
        let serve = Serve::start(&args, &env);
        serve.ready();
        assert!(
            !serve.output().contains("cannot estimate"),
            "the check is skipped entirely: {}",
            serve.output()
        );
    }
}

#[test]
fn mem_check_and_print_backend_plans_work_on_a_header_only_gguf() {
    let dir = temp_dir("unknown-plans");
    let model = arch_only_gguf(&dir, "arch-only.gguf");
    let head = arch_only_gguf(&dir, "head.gguf");
    let proj = dir.join("mmproj.gguf");
    gguf::writer::Builder::new()
        .kv("general.architecture", "clip")
        .write(&proj)
        .unwrap();
    let fake = fake_backend();
    let run = |device: &str, extra: &[&str]| {
        let out = Command::new(onebit())
            .args(["serve", "-m", model.to_str().unwrap(), "--device", device])
            .args(["--llama-server", fake.to_str().unwrap()])
            .args(extra)
            .env("ONEBIT_HRX_PRESENT", "1")
            .env_remove("ONEBIT_MEM_CHECK")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = run("cpu", &["--mem-check"]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.starts_with("arch-only: cannot estimate its memory (")
            && stdout.contains("the memory check is skipped"),
        "{stdout}"
    );
    let head_s = head.to_str().unwrap();
    let proj_s = proj.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["--parallel", "1"], "-np 1"),
        (&["--parallel", "4"], "-np 4"),
        (
            &["--mtp", head_s],
            &format!("--spec-type draft-mtp -md {head_s}"),
        ),
        (&["--mmproj", proj_s], &format!("--mmproj {proj_s} -b 4096")),
        (&[], "--alias arch-only"),
    ];
    for device in ["cpu", "hrx"] {
        for (extra, expected) in &cases {
            let mut args = vec!["--print-backend", "--port", "8001"];
            args.extend_from_slice(extra);
            let (code, stdout, stderr) = run(device, &args);
            assert_eq!(code, Some(0), "{device} {extra:?}: {stdout}{stderr}");
            let plan: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            let argv = plan["argv"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(" ");
            assert!(argv.contains(expected), "{device} {extra:?}: {argv}");
            assert!(stderr.contains("cannot estimate its memory"), "{stderr}");
            args.push("--no-mem-check");
            let (code, _, stderr) = run(device, &args);
            assert_eq!(code, Some(0), "{stderr}");
            assert!(!stderr.contains("cannot estimate"), "{stderr}");
        }
    }
}
