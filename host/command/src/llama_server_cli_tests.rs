use super::*;

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

#[test]
fn lemonade_11_7s_command_line_becomes_serves() {
    let serve = translate(&words(
        "-m /m/a.gguf --ctx-size 4096 --port 8003 --jinja --metrics --reasoning-format auto --no-ui",
    ))
    .unwrap();
    assert_eq!(
        serve,
        words("-m /m/a.gguf --ctx-size 4096 --port 8003 -- --reasoning-format auto --no-ui")
    );
}

/// `-a` and `--tags` are serve's: its `/v1/models` lists them (llama-server's fields).
#[test]
fn aliases_and_tags_are_serves() {
    let serve = translate(&words(
        "-m a.gguf -a tinyllama-2,fim,code --tags chat,small",
    ))
    .unwrap();
    assert_eq!(
        serve,
        words("-m a.gguf --alias tinyllama-2,fim,code --tags chat,small --port 8080 --no-metrics")
    );
}

#[test]
fn custom_arguments_pass_unchanged_with_their_values() {
    let mut args = words("-m a.gguf --temp 0.6 --top-p 0.85 --seed -1 -kvu --chat-template-kwargs");
    args.push(r#"{"preserve_thinking":true}"#.to_string());
    args.extend(words(
        "--no-mmproj-offload --cache-type-k=q8_0 --flash-attn on",
    ));
    let serve = translate(&args).unwrap();
    let dash = serve.iter().position(|a| a == "--").unwrap();
    let mut want = words("--temp 0.6 --top-p 0.85 --seed -1 -kvu --chat-template-kwargs");
    want.push(r#"{"preserve_thinking":true}"#.to_string());
    want.extend(words(
        "--no-mmproj-offload --cache-type-k=q8_0 --flash-attn on",
    ));
    assert_eq!(serve[dash + 1..], want[..]);
    assert_eq!(
        serve[..dash],
        words("-m a.gguf --port 8080 --no-metrics")[..]
    );
}

#[test]
fn devices_map_to_routes_and_an_unknown_one_is_refused() {
    assert!(
        translate(&words("-m a --device HRX0"))
            .unwrap()
            .contains(&"hrx".to_string())
    );
    assert!(
        translate(&words("-m a -dev CPU"))
            .unwrap()
            .contains(&"cpu".to_string())
    );
    assert!(
        translate(&words("-m a --device none"))
            .unwrap()
            .contains(&"cpu".to_string())
    );
    let err = translate(&words("-m a --device Vulkan0")).unwrap_err();
    assert!(
        err.contains("no route for the llama.cpp device Vulkan0"),
        "{err}"
    );
    assert!(!err.contains('\n'));
}

#[test]
fn roles_projector_and_drafters_become_serves_flags() {
    let serve = translate(&words("-m a --embeddings --mmproj p.gguf")).unwrap();
    assert_eq!(
        serve,
        words("-m a --embedding --mmproj p.gguf --port 8080 --no-metrics")
    );
    let serve = translate(&words("-m a --reranking")).unwrap();
    assert!(serve.contains(&"--reranking".to_string()));
    let serve = translate(&words("-m a --model-draft d.gguf --spec-type draft-dflash")).unwrap();
    assert_eq!(
        serve,
        words("-m a --dflash d.gguf --port 8080 --no-metrics")
    );
    let serve = translate(&words("-m a --spec-type draft-mtp -md h.gguf")).unwrap();
    assert_eq!(serve, words("-m a --mtp h.gguf --port 8080 --no-metrics"));
    let serve = translate(&words("-m a --model-draft d.gguf")).unwrap();
    assert_eq!(
        serve,
        words("-m a --port 8080 --no-metrics -- --model-draft d.gguf")
    );
}

#[test]
fn downloads_are_refused_in_one_line() {
    let err = translate(&words("-hf unsloth/Qwen3-0.6B-GGUF --port 1")).unwrap_err();
    assert!(err.starts_with("-hf: 1bit downloads nothing"), "{err}");
}

#[test]
fn the_name_llama_server_is_recognised_from_any_directory() {
    assert!(invoked_as_llama_server("/usr/local/bin/llama-server"));
    assert!(invoked_as_llama_server("llama-server"));
    assert!(!invoked_as_llama_server("/usr/bin/1bit"));
}

/// No `-m`: llama-server's router mode. serve keeps its address, key and CORS policy; the
/// model flags, which there are the defaults of the models the router loads, reach the real
/// llama-server as they came (`-c` and `-np` are not serve's), `--metrics` included.
#[test]
fn a_command_line_without_a_model_runs_llama_servers_router_mode() {
    let none = |_: &str| None;
    let serve = translate_in(
        &words(
            "--models-dir /m --models-max 2 -c 512 -np 2 --jinja --metrics --port 8003 --host 127.0.0.1 --api-key k --cors-origins=* --cors-credentials --no-models-autoload",
        ),
        &none,
    )
    .unwrap();
    assert_eq!(
        serve,
        words(
            "--llama-router --port 8003 --host 127.0.0.1 --api-key k --cors-origins * --cors-credentials -- --models-dir /m --models-max 2 -c 512 -np 2 --jinja --metrics --no-models-autoload"
        )
    );
    // The port is llama-server's default, /metrics is 501 without --metrics, and the key in
    // the environment is serve's, as with a model.
    let key = |name: &str| (name == "LLAMA_API_KEY").then(|| "secret".to_string());
    let serve = translate_in(&words("--models-dir /m"), &key).unwrap();
    assert_eq!(
        serve,
        words("--llama-router --api-key secret --port 8080 --no-metrics -- --models-dir /m")
    );
    // Built-in tools or MCP servers and no --cors-origins: the localhost origins are allowed,
    // as llama-server allows them then; an explicit policy stands.
    for tools in ["--tools all", "--tools=all", "--mcp-servers-json {}"] {
        let serve = translate_in(&words(&format!("--models-dir /m {tools}")), &none).unwrap();
        assert_eq!(
            serve,
            words(&format!(
                "--llama-router --port 8080 --no-metrics --cors-origins localhost -- --models-dir /m {tools}"
            )),
            "{tools}"
        );
    }
    let serve = translate_in(&words("--tools all --cors-origins *"), &none).unwrap();
    assert_eq!(
        serve,
        words("--llama-router --cors-origins * --port 8080 --no-metrics -- --tools all")
    );
    // Nothing at all is router mode too, over llama.cpp's own model cache.
    assert_eq!(
        translate_in(&[], &none).unwrap(),
        words("--llama-router --port 8080 --no-metrics")
    );
}

#[test]
fn rpc_workers_become_serves_own_flag_so_they_are_probed_and_counted() {
    let serve = translate(&words(
        "-m a.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052 -ngl 99",
    ))
    .unwrap();
    assert_eq!(
        serve,
        words("-m a.gguf --rpc 10.0.0.2:50052,10.0.0.3:50052 --port 8080 --no-metrics -- -ngl 99")
    );
    assert!(
        translate(&words("-m a.gguf --rpc=h:1"))
            .unwrap()
            .contains(&"--rpc".to_string())
    );
}

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn the_users_key_and_cors_flags_become_serves_and_never_reach_the_backend() {
    let serve = translate_in(
        &words("-m a --api-key k1,k2 --cors-origins https://app.example --no-cors-credentials --metrics"),
        &no_env,
    )
    .unwrap();
    assert_eq!(
        serve,
        words(
            "-m a --api-key k1,k2 --cors-origins https://app.example --no-cors-credentials --port 8080"
        )
    );
    let serve = translate_in(&words("-m a --api-key-file keys.txt --metrics"), &no_env).unwrap();
    assert_eq!(serve, words("-m a --api-key-file keys.txt --port 8080"));
    // llama-server's LLAMA_API_KEY is the key when no flag names one.
    let env = |name: &str| (name == "LLAMA_API_KEY").then(|| "sk-env".to_string());
    let serve = translate_in(&words("-m a --metrics"), &env).unwrap();
    assert_eq!(serve, words("-m a --api-key sk-env --port 8080"));
    let serve = translate_in(&words("-m a --api-key mine --metrics"), &env).unwrap();
    assert_eq!(serve, words("-m a --api-key mine --port 8080"));
}

#[test]
fn without_metrics_the_drop_ins_metrics_answer_as_llama_servers() {
    let serve = translate_in(&words("-m a"), &no_env).unwrap();
    assert!(serve.contains(&"--no-metrics".to_string()), "{serve:?}");
    let serve = translate_in(&words("-m a --metrics"), &no_env).unwrap();
    assert!(!serve.contains(&"--no-metrics".to_string()), "{serve:?}");
}

#[test]
fn aip_mode_takes_serves_port_and_names_the_predict_route() {
    let env = |name: &str| match name {
        "AIP_MODE" => Some("PREDICTION".to_string()),
        "AIP_HTTP_PORT" => Some("9123".to_string()),
        _ => None,
    };
    let serve = translate_in(&words("-m a --port 8081 --metrics"), &env).unwrap();
    assert_eq!(serve, words("-m a --port 9123"));
    assert_eq!(aip_predict_route(&env).as_deref(), Some("/predict"));
    let custom = |name: &str| match name {
        "AIP_MODE" => Some("PREDICTION".to_string()),
        "AIP_PREDICT_ROUTE" => Some("v2/score".to_string()),
        _ => None,
    };
    assert_eq!(aip_predict_route(&custom).as_deref(), Some("/v2/score"));
    let serve = translate_in(&words("-m a --metrics"), &custom).unwrap();
    assert_eq!(serve, words("-m a --port 8080"));
    assert_eq!(aip_predict_route(&no_env), None);
}

#[test]
fn a_host_list_stays_one_flag_for_serve_to_bind_each() {
    let serve = translate_in(&words("-m a --host 127.0.0.1,::1 --metrics"), &no_env).unwrap();
    assert_eq!(serve, words("-m a --host 127.0.0.1,::1 --port 8080"));
}

/// The last `-c`/`--ctx-size` after `--` is llama-server's context, and serve's own.
#[test]
fn a_context_after_the_separator_becomes_serves() {
    let mut ctx = None;
    adopt_backend_ctx(&mut ctx, &words("--temp 0.6 -c 1024 --ctx-size=2048")).unwrap();
    assert_eq!(ctx, Some(2048));
    let mut ctx = None;
    adopt_backend_ctx(&mut ctx, &words("--temp 0.6")).unwrap();
    assert_eq!(ctx, None, "nothing passed, nothing adopted");
    let mut ctx = Some(512);
    adopt_backend_ctx(&mut ctx, &words("-c 512")).unwrap();
    assert_eq!(ctx, Some(512));
    let refused = adopt_backend_ctx(&mut Some(512), &words("-c 1024")).unwrap_err();
    assert_eq!(refused.code, crate::error::exit::USAGE);
    let not_a_number = adopt_backend_ctx(&mut None, &words("--ctx-size=lots")).unwrap_err();
    assert_eq!(
        not_a_number.message,
        "--ctx-size lots after --: not a number of tokens; give one such as 8192 (0: the model's own)"
    );
    let no_value = adopt_backend_ctx(&mut None, &words("-c")).unwrap_err();
    assert_eq!(
        no_value.message,
        "-c after --: no value; give llama-server's context in tokens, e.g. -c 8192"
    );
}
