//! The hrx plan's argv and environment for each placement setting, the claim, the warm-ups and
//! the placement lines, all without a GPU.

use super::*;
use onebit_plugin_api::ServeOptions;

fn request(env: &[(&str, &str)]) -> PlanRequest {
    PlanRequest {
        options: ServeOptions {
            model: "/m/Qwen3-4B-Q4_K_M.gguf".into(),
            served_name: "Qwen3-4B-1bit".into(),
            llama_server: Some("/bin/sh".into()),
            ..Default::default()
        },
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ports: vec![8001],
        ..Default::default()
    }
}

fn env_of(plan: &Plan) -> Vec<(String, String)> {
    plan.backends[0]
        .env
        .iter()
        .filter(|(k, _)| k.starts_with("GGML_HRX_"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn has(argv: &[String], window: &[&str]) -> bool {
    argv.windows(window.len()).any(|w| w == window)
}

#[test]
fn the_default_plan_is_llama_server_on_hrx0_with_strict_placement_and_the_models_context() {
    let plan = HrxRoute::default().plan(&request(&[])).unwrap();
    let argv = &plan.backends[0].argv;
    assert_eq!(argv[0], "/bin/sh");
    for w in [
        &["-m", "/m/Qwen3-4B-Q4_K_M.gguf"][..],
        &["--host", "127.0.0.1", "--port", "8001"],
        &["--device", "HRX0"],
        &["-ngl", "99"],
        &["--alias", "Qwen3-4B-1bit"],
        &["--cache-reuse", "256"],
        &["--jinja"],
        &["--metrics"],
    ] {
        assert!(has(argv, w), "{w:?} in {argv:?}");
    }
    assert!(!argv.iter().any(|a| a == "-c" || a == "-lv"), "{argv:?}");
    assert_eq!(
        env_of(&plan),
        pairs(&[("GGML_HRX_REPORT", "1"), ("GGML_HRX_STRICT", "1")])
    );
    assert!(plan.one_hop);
    assert_eq!(plan.device, "hrx");
    let mut r = request(&[]);
    r.options.ctx_size = Some(8192);
    let plan = HrxRoute::default().plan(&r).unwrap();
    assert!(has(&plan.backends[0].argv, &["-c", "8192"]));
}

#[test]
fn each_placement_setting_gives_its_environment_and_verbosity() {
    let plan_with = |f: &dyn Fn(&mut PlanRequest), env: &[(&str, &str)]| {
        let mut r = request(env);
        f(&mut r);
        HrxRoute::default().plan(&r).unwrap()
    };
    let off = plan_with(&|r| r.options.no_strict_device = true, &[]);
    assert_eq!(env_of(&off), pairs(&[("GGML_HRX_REPORT", "1")]));
    let off = plan_with(&|_| {}, &[("ONEBIT_STRICT_DEVICE", "0")]);
    assert_eq!(env_of(&off), pairs(&[("GGML_HRX_REPORT", "1")]));

    let report = plan_with(&|r| r.options.placement_report = true, &[]);
    assert_eq!(
        env_of(&report),
        pairs(&[("GGML_HRX_REPORT", "2"), ("GGML_HRX_STRICT", "1")])
    );
    assert!(has(&report.backends[0].argv, &["-lv", "4"]));

    for strict in [
        plan_with(&|r| r.options.strict_device = true, &[]),
        plan_with(&|_| {}, &[("ONEBIT_STRICT_DEVICE", "1")]),
    ] {
        assert_eq!(
            env_of(&strict),
            pairs(&[("GGML_HRX_REPORT", "2"), ("GGML_HRX_STRICT", "1")])
        );
        assert!(has(&strict.backends[0].argv, &["-lv", "4"]));
    }

    let both_off = plan_with(
        &|r| {
            r.options.no_strict_device = true;
            r.options.placement_report = true;
        },
        &[],
    );
    assert_eq!(env_of(&both_off), pairs(&[("GGML_HRX_REPORT", "2")]));
}

#[test]
fn a_ggml_hrx_variable_the_user_set_wins_and_is_left_out_of_the_plan() {
    let plan = HrxRoute::default()
        .plan(&request(&[("GGML_HRX_STRICT", "0")]))
        .unwrap();
    assert_eq!(env_of(&plan), pairs(&[("GGML_HRX_REPORT", "1")]));
    let mut r = request(&[
        ("GGML_HRX_REPORT", "0"),
        ("IREE_HAL_AMDGPU_LIBHSA_PATH", "/x"),
    ]);
    r.options.hrx_libhsa = Some("/y/libhsa-runtime64.so.1".into());
    let plan = HrxRoute::default().plan(&r).unwrap();
    assert_eq!(env_of(&plan), pairs(&[("GGML_HRX_STRICT", "1")]));
    assert!(
        !plan.backends[0]
            .env
            .contains_key("IREE_HAL_AMDGPU_LIBHSA_PATH")
    );
}

#[test]
fn libhsa_is_the_flags_else_the_first_under_therock() {
    let mut r = request(&[]);
    r.options.hrx_libhsa = Some("/y/libhsa-runtime64.so.1".into());
    let plan = HrxRoute::default().plan(&r).unwrap();
    assert_eq!(
        plan.backends[0].env["IREE_HAL_AMDGPU_LIBHSA_PATH"],
        "/y/libhsa-runtime64.so.1"
    );

    let root = std::env::temp_dir().join(format!("onebit-therock-{}", std::process::id()));
    for dir in ["a/lib", "b/lib/llvm"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        std::fs::write(root.join(dir).join(LIBHSA), b"").unwrap();
    }
    std::fs::write(root.join("b").join("libhsa-runtime64.so"), b"").unwrap();
    assert_eq!(find_libhsa(&root), Some(root.join("a/lib").join(LIBHSA)));
    assert_eq!(find_libhsa(&root.join("nonexistent")), None);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn chat_plans_carry_the_two_warmups_unless_turned_off() {
    let plan = HrxRoute::default().plan(&request(&[])).unwrap();
    let w = &plan.warmups;
    assert_eq!(w.len(), 2);
    assert_eq!(w[0].path, "/v1/chat/completions");
    let content = w[0].body["messages"][0]["content"].as_str().unwrap();
    assert_eq!(content.split(' ').count(), 360);
    assert_eq!(w[0].body["max_tokens"], 8);
    assert_eq!(w[0].body["temperature"], 0);
    assert_eq!(w[0].body["cache_prompt"], false);
    assert_eq!(w[1].path, "/completion");
    assert_eq!(w[1].body["prompt"], " a".repeat(16));
    assert_eq!(w[1].body["n_predict"], 0);
    let plan = HrxRoute::default()
        .plan(&request(&[("ONEBIT_NO_WARMUP", "1")]))
        .unwrap();
    assert!(plan.warmups.is_empty());
}

#[test]
fn auto_claims_a_gguf_only_where_hrx_is_present_and_the_plan_works_anywhere() {
    let route = HrxRoute::default();
    assert_eq!(route.claim(&request(&[(PRESENT_ENV, "1")])).strength, 50);
    assert_eq!(route.claim(&request(&[(PRESENT_ENV, "0")])).strength, 0);
    let mut dir = request(&[(PRESENT_ENV, "1")]);
    dir.model.is_dir = true;
    assert_eq!(route.claim(&dir).strength, 0);
    assert!(route.plan(&request(&[(PRESENT_ENV, "0")])).is_ok());
    assert!(!llama_server::amdgpu_card(Path::new("/nonexistent")));
}

#[test]
fn an_architecture_llama_cpp_does_not_build_is_refused() {
    let mut r = request(&[]);
    r.model.architecture = Some("zamba2".into());
    let refusal = HrxRoute::default().plan(&r).unwrap_err();
    assert_eq!(refusal.exit_code, 2);
    assert!(refusal.message.contains("Lemonade's llamacpp backend"));
    let mut r = request(&[]);
    r.options.ssd_streaming = true;
    assert_eq!(HrxRoute::default().plan(&r).unwrap_err().exit_code, 2);
}

#[test]
fn report_lines_become_summaries_and_strict_refusals() {
    let line = |route: &HrxRoute, text: &str| {
        route.on_backend_line(&BackendLine {
            backend: 0,
            line: text.to_string(),
        })
    };
    let clean = "placement_observer: placement: 512 nodes, 0 off HRX, 1 graph splits";
    let dirty = "placement_observer: placement: 512 nodes, 34 off HRX (MUL_MAT x 30, GET_ROWS x 4), 7 graph splits";

    let route = HrxRoute::default();
    let mut r = request(&[]);
    r.options.placement_report = true;
    route.plan(&r).unwrap();
    assert_eq!(
        line(&route, clean).say,
        ["HRX placement: all 512 nodes on HRX, 1 graph splits"]
    );
    let v = line(&route, dirty);
    assert_eq!(
        v.say,
        [
            "HRX placement: 34 of 512 nodes off HRX (GET_ROWS x 4, MUL_MAT x 30), 7 graph splits, worst of 2 graphs"
        ]
    );
    assert_eq!(v.stop, None);
    assert_eq!(
        line(&route, "srv  update_slots: all slots are idle"),
        LineVerdict::default()
    );

    let route = HrxRoute::default();
    let mut r = request(&[]);
    r.options.strict_device = true;
    route.plan(&r).unwrap();
    assert_eq!(line(&route, clean).stop, None);
    let v = line(&route, dirty);
    assert!(v.stop.is_some());
    assert!(v.say.last().unwrap().ends_with(placement::OPT_OUT), "{v:?}");

    let abort = r#".../ggml-hrx.cpp:447: placement_observer: GGML_HRX_STRICT=1: "kq-0" is MUL_MAT f32 ne=[2,2,12,1] and is not placed on HRX; 12 of 152 nodes off HRX (MUL_MAT x 8, SOFT_MAX x 4), 9 splits"#;
    let v = line(&HrxRoute::default(), abort);
    assert!(v.stop.is_some());
    assert!(v.say[0].starts_with(r#"HRX strict placement refused the model: "kq-0" is MUL_MAT"#));
}

#[test]
fn rpc_workers_come_before_hrx0_in_llama_cpps_own_device_list() {
    let mut r = request(&[]);
    r.options.args = ["--rpc", "10.0.0.2:50052,10.0.0.3:50052"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let plan = HrxRoute::default().plan(&r).unwrap();
    let argv = &plan.backends[0].argv;
    assert!(
        has(
            argv,
            &["--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-ngl", "99"]
        ),
        "{argv:?}"
    );
    // No --device list: llama.cpp then lists the workers first and HRX0 after them.
    assert!(!argv.iter().any(|a| a == "--device"), "{argv:?}");
    assert!(
        plan.notes.iter().any(|n| n.contains("2 RPC workers")),
        "{:?}",
        plan.notes
    );
    // An RPC abort line stops serve, as a lost GPU does.
    let verdict = HrxRoute::default().on_backend_line(&BackendLine {
        backend: 0,
        line: "ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response".into(),
    });
    assert!(verdict.stop.unwrap().contains("lost an RPC worker"));
}
