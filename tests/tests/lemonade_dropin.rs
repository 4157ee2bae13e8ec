//! The drop-in command line: `1bit` run as `llama-server` (a link, as a packager installs it)
//! and as `1bit llama-server`, with the argument list stock Lemonade 11.7 builds.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onebit_tests::*;

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hello there"}]}"#;
const KWARGS: &str = r#"{"preserve_thinking":true}"#;

/// A fresh folder holding `llama-server`, a link to the `1bit` under test.
fn linked_llama_server(name: &str) -> PathBuf {
    let dir = temp_dir(name);
    let link = dir.join("llama-server");
    symlink(onebit(), &link).unwrap();
    link
}

/// Lemonade 11.7's command line for a plain GGUF on `port`.
fn lemonade_argv(model: &Path, port: u16) -> Vec<String> {
    [
        "-m",
        model.to_str().unwrap(),
        "--ctx-size",
        "4096",
        "--port",
        &port.to_string(),
        "--jinja",
        "--metrics",
        "--reasoning-format",
        "auto",
        "--no-ui",
    ]
    .map(String::from)
    .to_vec()
}

/// `program ARGS` with a fresh state folder, the fake backend as the llama-server, no HRX.
fn start(program: &Path, args: &[String], port: u16, env: &[(&str, &str)]) -> Serve {
    let mut command = Command::new(program);
    command
        .args(args)
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("ONEBIT_LLAMA_SERVER", fake_backend())
        .env("ONEBIT_HRX_PRESENT", "0");
    for (k, v) in env {
        command.env(k, v);
    }
    Serve::spawn(command, port)
}

/// The command line of serve's one backend.
fn backend_argv(serve: &Serve) -> Vec<String> {
    let children = serve.children();
    assert_eq!(children.len(), 1, "one backend: {}", serve.output());
    let raw = std::fs::read(format!("/proc/{}/cmdline", children[0])).unwrap();
    raw.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

#[test]
fn lemonades_command_line_serves_and_custom_arguments_reach_llama_server_unchanged() {
    let dir = temp_dir("dropin");
    let model = dummy_model(&dir, "Qwen3-0.6B-Q4_0.gguf");
    let link = linked_llama_server("dropin-link");
    let port = free_port();
    let mut args = lemonade_argv(&model, port);
    let custom = [
        "--temp",
        "0.6",
        "--top-p",
        "0.85",
        "--seed",
        "-1",
        "--chat-template-kwargs",
        KWARGS,
        "-kvu",
        "--spec-type",
        "ngram-simple",
    ];
    args.extend(custom.map(String::from));
    let serve = start(&link, &args, port, &[]);
    serve.ready();
    let (status, body) = post(&serve.url("/v1/chat/completions"), CHAT);
    assert_eq!(status, 200, "{body}");
    assert!(
        serve.output().contains("--device auto chose cpu"),
        "{}",
        serve.output()
    );

    let argv = backend_argv(&serve);
    assert_eq!(Path::new(&argv[0]), fake_backend(), "{argv:?}");
    let mut want = vec!["--reasoning-format", "auto", "--no-ui"];
    want.extend(custom);
    // `--reasoning-format auto --no-ui` and the custom arguments, in Lemonade's order, last.
    assert_eq!(argv[argv.len() - want.len()..], want[..], "{argv:?}");
    // serve's own flags are read by serve: the backend gets its private port and the context.
    assert!(!argv.contains(&port.to_string()), "{argv:?}");
    assert!(argv.windows(2).any(|w| w == ["-c", "4096"]), "{argv:?}");
}

#[test]
fn the_subcommand_maps_the_llamacpp_device_name_to_its_route() {
    let dir = temp_dir("dropin-dev");
    let model = dummy_model(&dir, "m.gguf");
    let port = free_port();
    let mut args = vec!["llama-server".to_string()];
    args.extend(lemonade_argv(&model, port));
    args.extend(["--device", "CPU", "--embeddings"].map(String::from));
    let serve = start(&onebit(), &args, port, &[]);
    serve.ready();
    let out = serve.output();
    assert!(
        out.contains("starting llama-server on the cpu route"),
        "{out}"
    );
    assert!(!out.contains("--device auto chose"), "{out}");
    assert!(backend_argv(&serve).contains(&"--embedding".to_string()));
}

/// Run to its exit and return (status, output).
fn refused(program: &Path, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let port = free_port();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let mut serve = start(program, &args, port, env);
    let status = serve
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("still running: {}", serve.output()));
    (status.code(), serve.output())
}

#[test]
fn an_unknown_device_and_a_download_are_refused_in_one_line() {
    let dir = temp_dir("dropin-refuse");
    let model = dummy_model(&dir, "m.gguf");
    let link = linked_llama_server("dropin-refuse-link");
    let m = model.to_str().unwrap();
    let (code, out) = refused(&link, &["-m", m, "--device", "Vulkan0"], &[]);
    assert_eq!(code, Some(2), "{out}");
    assert_eq!(
        out.trim(),
        "1bit llama-server: --device Vulkan0: this build has no route for the llama.cpp device Vulkan0; use HRX0, CPU or none, or leave --device out to let 1bit choose"
    );
    let (code, out) = refused(
        &link,
        &["-hf", "unsloth/Qwen3-0.6B-GGUF", "--port", "1"],
        &[],
    );
    assert_eq!(code, Some(2), "{out}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.contains("-hf: 1bit downloads nothing"), "{out}");
}

#[test]
fn a_llama_server_on_path_that_is_1bit_itself_is_refused_not_run() {
    let dir = temp_dir("dropin-self");
    let model = dummy_model(&dir, "m.gguf");
    let link = linked_llama_server("dropin-self-link");
    let path = format!("{}:/usr/bin:/bin", link.parent().unwrap().display());
    let empty_cache = temp_dir("dropin-self-cache");
    let mut command = Command::new(&link);
    command
        .args([
            "-m",
            model.to_str().unwrap(),
            "--port",
            &free_port().to_string(),
        ])
        .env_remove("ONEBIT_LLAMA_SERVER")
        .env("PATH", &path)
        .env("ONEBIT_CACHE_DIR", &empty_cache)
        .env("ONEBIT_STATE_DIR", temp_dir("state"))
        .env("ONEBIT_HRX_PRESENT", "0");
    let mut serve = Serve::spawn(command, 0);
    let status = serve
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("still running: {}", serve.output()));
    let out = serve.output();
    assert_eq!(status.code(), Some(2), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("is 1bit itself"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains("set ONEBIT_LLAMA_SERVER or --llama-server"),
        "{line}"
    );
    assert!(!out.contains("starting llama-server"), "{out}");
}

#[test]
fn a_load_that_cannot_fit_exits_3_before_anything_starts() {
    let dir = temp_dir("dropin-fit");
    let model = dir.join("huge-4TiB.gguf");
    gguf::writer::Builder::smollm2_shaped()
        .total_size(4 << 40)
        .write(&model)
        .unwrap();
    let link = linked_llama_server("dropin-fit-link");
    let argv = lemonade_argv(&model, free_port());
    let args: Vec<&str> = argv.iter().map(String::as_str).collect();
    let (code, out) = refused(&link, &args, &[]);
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("huge-4TiB does not fit"), "{out}");
    assert!(!out.contains("starting llama-server"), "{out}");
}

#[test]
fn the_real_llama_server_takes_lemonades_command_line_and_custom_arguments() {
    let server = installed_llama_server();
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let link = linked_llama_server("dropin-real");
    let port = free_port();
    let mut args = lemonade_argv(&model, port);
    args.extend(
        [
            "--device",
            "CPU",
            "--temp",
            "0.6",
            "--top-k",
            "20",
            "--chat-template-kwargs",
            KWARGS,
        ]
        .map(String::from),
    );
    let serve = start(
        &link,
        &args,
        port,
        &[("ONEBIT_LLAMA_SERVER", server.to_str().unwrap())],
    );
    assert!(
        serve.wait_health(200, Duration::from_secs(120)),
        "{}",
        serve.output()
    );
    let body = r#"{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":4}"#;
    let (status, reply) = post(&serve.url("/v1/chat/completions"), body);
    assert_eq!(status, 200, "{reply}");
    let argv = backend_argv(&serve);
    assert!(
        argv.ends_with(&["--chat-template-kwargs".to_string(), KWARGS.to_string()]),
        "{argv:?}"
    );
}

/// llama-server's refusal names its own flag (`--embeddings`); serve's names serve's ways.
fn assert_serves_words(status: u16, body: &str) {
    assert_eq!(status, 501, "{body}");
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("--embedding (the model itself"),
        "{message}"
    );
    assert!(message.contains("--embed MODEL.gguf"), "{message}");
    assert!(!message.contains("--embeddings"), "{message}");
}

#[test]
fn embeddings_from_a_chat_model_are_refused_in_serves_words_and_served_with_embedding() {
    let dir = temp_dir("embed-words");
    let model = dummy_model(&dir, "m.gguf");
    let serve = Serve::with_fake(&model, &[], &[]);
    serve.ready();
    let (status, body) = post(&serve.url("/v1/embeddings"), r#"{"input":"hello"}"#);
    assert_serves_words(status, &body);
    let (status, body) = post(
        &serve.url("/v1/rerank"),
        r#"{"query":"a","documents":["b"]}"#,
    );
    assert_eq!(status, 501, "{body}");
    assert!(body.contains("--rerank MODEL.gguf"), "{body}");
    drop(serve);
    let serve = Serve::with_fake(&model, &["--embedding"], &[]);
    serve.ready();
    let (status, body) = post(&serve.url("/v1/embeddings"), r#"{"input":"hello"}"#);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn the_real_llama_servers_embeddings_refusal_is_answered_in_serves_words() {
    let serve = serve_smollm2(&[]);
    let (status, body) = post(&serve.url("/v1/embeddings"), r#"{"input":"hello"}"#);
    assert_serves_words(status, &body);
}
