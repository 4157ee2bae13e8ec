//! The route's own tests: claim and plan for a loose build and for an installed package, the
//! route option, and the refusals a user can meet. The engine program itself is tested end to
//! end by tests/package.rs, through serve.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    Action, BackendLine, DeviceRoute, ModelFacts, PackageFacts, PackageFile, Plan, PlanRequest,
    Refusal, RouteOption, ServeOptions,
};

use crate::plan::{self, CLAIM_STRENGTH, DEVICE_VAR, ENGINE_FILE};
use crate::{DEVICE_LOST_LINE, ZetaRoute};

/// A folder of the test's own in the temporary directory, empty, holding a stand-in device node
/// `zeta0` and an engine file of `mode`.
fn scratch(name: &str, mode: u32) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("zeta-tests-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("zeta0"), "a stand-in device").unwrap();
    let engine = dir.join(ENGINE_FILE);
    std::fs::write(&engine, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&engine, std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

/// A plan request for a GGUF model, with the route loaded from `route_dir` and the device
/// there, and `options` as `--route-opt KEY=VALUE`.
fn request(route_dir: &Path, options: &[(&str, &str)]) -> PlanRequest {
    PlanRequest {
        options: ServeOptions {
            model: "/models/tiny.gguf".to_string(),
            served_name: "tiny".to_string(),
            device: "zeta".to_string(),
            route_options: options
                .iter()
                .map(|(key, value)| RouteOption {
                    flag: "--route-opt".to_string(),
                    key: key.to_string(),
                    value: value.to_string(),
                })
                .collect(),
            ..Default::default()
        },
        model: ModelFacts {
            path: "/models/tiny.gguf".to_string(),
            files: vec!["/models/tiny.gguf".to_string()],
            bytes: 512 << 20,
            architecture: Some("llama".to_string()),
            ..Default::default()
        },
        env: BTreeMap::from([(
            DEVICE_VAR.to_string(),
            route_dir.join("zeta0").display().to_string(),
        )]),
        ports: vec![41001, 41002, 41003, 41004],
        route_dir: route_dir.display().to_string(),
        ..Default::default()
    }
}

fn plan_of(request: &PlanRequest) -> Plan {
    ZetaRoute.plan(request).expect("the route plans")
}

fn refusal_of(request: &PlanRequest) -> Refusal {
    ZetaRoute.plan(request).expect_err("the route refuses")
}

#[test]
fn a_loose_build_plans_its_engine_beside_it_on_the_first_port() {
    let dir = scratch("loose", 0o755);
    let plan = plan_of(&request(&dir, &[]));
    assert_eq!(plan.device, "zeta");
    assert_eq!(plan.backends.len(), 1);
    let engine = &plan.backends[0];
    assert_eq!(engine.argv[0], dir.join(ENGINE_FILE).display().to_string());
    assert_eq!(engine.port, 41001);
    let flag = |name: &str| {
        let at = engine.argv.iter().position(|a| a == name)?;
        engine.argv.get(at + 1).cloned()
    };
    assert_eq!(flag("--port").as_deref(), Some("41001"));
    assert_eq!(flag("--host").as_deref(), Some("127.0.0.1"));
    assert_eq!(flag("--model").as_deref(), Some("/models/tiny.gguf"));
    assert_eq!(flag("--alias").as_deref(), Some("tiny"));
    assert_eq!(
        flag("--device"),
        Some(dir.join("zeta0").display().to_string())
    );
    assert_eq!(flag("--max-tokens-cap"), None, "no option, no flag");
    assert_eq!(engine.health_path, "/health");
    assert_eq!(engine.metrics_path.as_deref(), Some("/metrics"));
    assert!(!plan.one_hop, "serve stays in the path");
    // Relayed to the engine: its chat paths, as generations with a JSON body.
    let paths: Vec<&str> = plan.rules.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(paths, ["/v1/chat/completions", "/chat/completions"]);
    for rule in &plan.rules {
        assert_eq!(rule.method, "POST");
        assert_eq!(rule.action, Action::Proxy { backend: 0 });
        assert!(rule.inference);
    }
    // The device's own memory is judged, not RAM.
    let memory = plan.memory.expect("a memory need");
    assert_eq!(memory.pool, "device");
    assert_eq!(memory.weights_bytes, 512 << 20);
    let device = memory.device.expect("the device's memory");
    assert_eq!(device.name, "zeta0");
    assert_eq!(device.free_bytes, plan::DEFAULT_FREE_BYTES);
}

#[test]
fn the_route_option_reaches_the_engine_as_its_flag_and_others_are_refused() {
    let dir = scratch("option", 0o755);
    let plan = plan_of(&request(&dir, &[("max_tokens_cap", "7")]));
    let argv = &plan.backends[0].argv;
    assert!(
        argv.windows(2)
            .any(|w| w[0] == "--max-tokens-cap" && w[1] == "7"),
        "{argv:?}"
    );
    let unknown = refusal_of(&request(&dir, &[("tiles", "4")]));
    assert_eq!(unknown.exit_code, Refusal::USAGE);
    assert!(
        unknown.message.contains("tiles") && unknown.message.contains("max_tokens_cap"),
        "names the key and the keys known: {}",
        unknown.message
    );
    assert!(!unknown.message.contains('\n'));
    let zero = refusal_of(&request(&dir, &[("max_tokens_cap", "0")]));
    assert_eq!(zero.exit_code, Refusal::USAGE);
    assert!(zero.message.contains("from 1"), "{}", zero.message);
}

#[test]
fn an_installed_package_runs_the_engine_its_manifest_names() {
    let dir = scratch("package", 0o755);
    let mut request = request(&dir, &[]);
    request.route_dir = "/nowhere".to_string();
    request.package = Some(PackageFacts {
        name: "zeta".to_string(),
        version: "1.0.0".to_string(),
        dir: dir.display().to_string(),
        files: vec![PackageFile {
            path: dir.join(ENGINE_FILE).display().to_string(),
            name: ENGINE_FILE.to_string(),
            version: "1.0.0".to_string(),
            sha256: "0".repeat(64),
        }],
        ..Default::default()
    });
    let plan = plan_of(&request);
    assert_eq!(
        plan.backends[0].argv[0],
        dir.join(ENGINE_FILE).display().to_string()
    );
    assert!(
        plan.notes.iter().any(|n| n.contains("package zeta 1.0.0")),
        "{:?}",
        plan.notes
    );
    // A package without the engine in its manifest: its file lying there is not used.
    request.package.as_mut().unwrap().files.clear();
    let refusal = refusal_of(&request);
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    assert!(
        refusal.message.contains("carries no zeta-engine"),
        "{}",
        refusal.message
    );
}

#[test]
fn an_engine_that_is_not_executable_is_refused_saying_so() {
    let dir = scratch("mode", 0o644);
    let refusal = refusal_of(&request(&dir, &[]));
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    assert!(
        refusal.message.contains("is not executable (mode 644)"),
        "{}",
        refusal.message
    );
    assert_eq!(ZetaRoute.claim(&request(&dir, &[])).strength, 0);
}

#[test]
fn auto_picks_zeta_only_with_its_engine_and_a_device() {
    let dir = scratch("claim", 0o755);
    let claim = ZetaRoute.claim(&request(&dir, &[]));
    assert_eq!(claim.strength, CLAIM_STRENGTH, "{}", claim.reason);
    let mut no_device = request(&dir, &[]);
    no_device.env.insert(
        DEVICE_VAR.to_string(),
        dir.join("zeta9").display().to_string(),
    );
    let claim = ZetaRoute.claim(&no_device);
    assert_eq!(claim.strength, 0);
    assert!(
        claim.reason.contains("no Zeta device at"),
        "{}",
        claim.reason
    );
    let refusal = refusal_of(&no_device);
    assert_eq!(refusal.exit_code, Refusal::ENGINE);
    let mut no_engine = request(&dir, &[]);
    no_engine.route_dir = dir.join("elsewhere").display().to_string();
    assert_eq!(ZetaRoute.claim(&no_engine).strength, 0);
    let mut not_gguf = request(&dir, &[]);
    not_gguf.model.architecture = None;
    not_gguf.model.path = "/models/tiny.safetensors".to_string();
    assert_eq!(ZetaRoute.claim(&not_gguf).strength, 0);
    assert_eq!(refusal_of(&not_gguf).exit_code, Refusal::USAGE);
}

#[test]
fn a_lost_device_stops_serve() {
    let line = |text: &str| BackendLine {
        backend: 0,
        line: text.to_string(),
    };
    let lost = ZetaRoute.on_backend_line(&line(&format!("{DEVICE_LOST_LINE}: /dev/zeta0 is gone")));
    assert!(lost.stop.is_some_and(|why| why.contains("lost its device")));
    assert!(
        ZetaRoute
            .on_backend_line(&line("zeta-engine: model loaded"))
            .stop
            .is_none()
    );
}

#[test]
fn a_full_device_is_judged_with_its_own_free_bytes() {
    let dir = scratch("full", 0o755);
    let mut request = request(&dir, &[]);
    request
        .env
        .insert(plan::FREE_BYTES_VAR.to_string(), "1024".to_string());
    let memory = plan_of(&request).memory.unwrap();
    assert_eq!(memory.device.unwrap().free_bytes, 1024);
    request
        .env
        .insert(plan::FREE_BYTES_VAR.to_string(), "lots".to_string());
    assert_eq!(refusal_of(&request).exit_code, Refusal::USAGE);
}
