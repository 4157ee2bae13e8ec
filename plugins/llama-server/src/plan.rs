//! The one plan builder of the llama-server routes: cpu, hrx and hybrid's decoder describe where
//! their llama-server runs ([`Main`]), and [`build`] makes the backend, its environment, the
//! memory facts, the notes and the side servers the same way for all three. "A variable the user
//! set wins over the plan's" is decided by [`crate::user_set`] and applied once, by
//! [`Env::resolve`].

use std::collections::BTreeMap;

use onebit_plugin_api::{BackendSpec, PlanRequest, Refusal, Rule, SideModel};

use crate::{Memory, options, rag, recipes, user_set};

/// What a plan puts in a backend's environment, before the user's own is considered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Env {
    /// The plan's own values (the route's, the options', the recipes'): each is dropped where
    /// the user set the variable.
    pub plain: BTreeMap<String, String>,
    /// Values built from the user's own (`GGML_HRX_DISABLE_DISPATCH` with `qwen.attention`
    /// appended, say): set in any case, and listed by `--print-backend`.
    pub combined: BTreeMap<String, String>,
}

impl Env {
    /// The backend's `(env, env_combined)`: the plain values the user did not set, and the
    /// combined ones. Where the rule is applied, for every llama-server backend of every route.
    pub fn resolve(
        self,
        request: &PlanRequest,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let mut env = self.plain;
        env.retain(|k, _| !user_set(request, k) && !self.combined.contains_key(k));
        (env, self.combined)
    }
}

/// Where a route's main llama-server runs and what the route adds of its own.
#[derive(Clone, Debug, Default)]
pub struct Main {
    /// The route's name: for the architecture list, recipes, side servers and lines.
    pub route: String,
    /// The device arguments: `-ngl 0` on the CPU, `--device HRX0 -ngl 99` on HRX.
    pub device_argv: Vec<String>,
    /// `-c`, when the route gives one (None: the model's own).
    pub ctx: Option<u64>,
    /// How the memory line names the context.
    pub ctx_source: String,
    /// The memory the backend allocates from (`ram`, `gtt`).
    pub pool: String,
    /// The route's own variables (placement, the HSA runtime).
    pub env: BTreeMap<String, String>,
    /// Arguments after the device's and `-c`, before the options' (hybrid's one saved slot).
    pub fixed_argv: Vec<String>,
    /// Arguments after the options' (`-lv 4` for a placement report).
    pub after_options: Vec<String>,
    /// Flag groups added after the recipes unless the argv has the flag already, so a recipe's
    /// own value wins (`--cache-reuse 256`).
    pub defaults: Vec<Vec<String>>,
    /// The model's options (`--parallel`, drafting, `--mmproj`, roles), the architecture list,
    /// recipes and side servers apply. False for hybrid's decoder, whose argv is fixed and whose
    /// route refuses those options itself.
    pub full: bool,
    /// The side servers run under the main backend's environment (every hrx backend under the
    /// same placement rules).
    pub side_env: bool,
}

/// A built llama-server plan: the route adds its device name, warm-ups and the like.
#[derive(Clone, Debug, Default)]
pub struct Built {
    /// The main backend first, then the side servers.
    pub backends: Vec<BackendSpec>,
    /// The side servers' routes, then the llama-server request table.
    pub rules: Vec<Rule>,
    pub side_models: Vec<SideModel>,
    pub memory: Memory,
    pub notes: Vec<String>,
}

/// Build the llama-server plan `main` describes. Called by each llama-server route's `plan`, on
/// the host's planning thread; reads the model's header (and the drafter's, the side models'),
/// never tensor data.
pub fn build(request: &PlanRequest, main: Main) -> Result<Built, Refusal> {
    if main.full {
        crate::refuse_foreign_flags(request, &main.route)?;
        crate::check_architecture(request, &main.route)?;
    }
    let server = crate::server_binary(request)?;
    let port = *request
        .ports
        .first()
        .ok_or_else(|| Refusal::usage("the host reserved no port for the backend"))?;
    let asked = if main.full {
        options::model_args(request, &main.route, main.ctx)?
    } else {
        options::ModelArgs::default()
    };
    let drafter = asked.drafter;
    let extra = (asked.extra_weights_bytes, asked.extra_kv_bytes);

    let mut argv = crate::base_argv(&server, request, port);
    argv.extend(main.device_argv);
    if let Some(ctx) = main.ctx {
        argv.extend(["-c".to_string(), ctx.to_string()]);
    }
    argv.extend(main.fixed_argv);
    argv.extend(asked.argv);
    argv.extend(main.after_options);

    let mut env = Env {
        plain: main.env,
        combined: BTreeMap::new(),
    };
    env.plain.extend(asked.env);
    env.combined.extend(asked.env_combined);
    let mut notes = asked.notes;
    if main.full {
        // `--rpc`: the workers, and every layer offered to the devices (docs/rpc.md).
        notes.extend(crate::rpc::apply(request, &mut argv));
        notes.extend(recipes::apply(
            request,
            &main.route,
            drafter,
            &mut argv,
            &mut env.plain,
        )?);
    }
    for group in main.defaults {
        if group.first().is_some_and(|flag| !has_flag(&argv, flag)) {
            argv.extend(group);
        }
    }
    // Sized for the command line as it stands: a windowed model's cache holds its window
    // and one micro-batch.
    let n_ubatch = flag_value(&argv, "-ub").and_then(|v| v.parse().ok());
    let mut memory = crate::memory_need(request, main.ctx, main.ctx_source, &main.pool, n_ubatch);
    memory.add(extra.0, extra.1);
    let (env, env_combined) = env.resolve(request);
    let mut backend = crate::backend(argv, port);
    backend.env = env;
    backend.env_combined = env_combined;

    let side = if main.full {
        rag::side_servers(request, &main.route, &server, 1)?
    } else {
        rag::SideServers::default()
    };
    memory.add(side.weights_bytes, side.kv_bytes);
    let mut backends = vec![backend];
    for mut b in side.backends {
        if main.side_env {
            b.env = backends[0].env.clone();
            b.env_combined = backends[0].env_combined.clone();
        }
        backends.push(b);
    }
    let mut rules = side.rules;
    rules.extend(crate::rules());
    Ok(Built {
        backends,
        rules,
        side_models: side.models,
        memory,
        notes,
    })
}

/// llama-server's router mode (a drop-in command line with no model, `options.model` empty):
/// the real llama-server with no `-m` on the backend's port, `device_argv` for the models it
/// loads, every route relayed to it (its own `/v1/models` and `/models` list the models it can
/// load), and no progress or metrics source, since those need a model named. The host adds the
/// user's arguments after `--`. Called by the cpu route's `plan`.
pub fn router(request: &PlanRequest, device_argv: &[&str]) -> Result<Built, Refusal> {
    let server = crate::server_binary(request)?;
    let port = *request
        .ports
        .first()
        .ok_or_else(|| Refusal::usage("the host reserved no port for the backend"))?;
    let mut argv: Vec<String> = [server.as_str(), "--host", "127.0.0.1", "--port"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    argv.push(port.to_string());
    argv.extend(device_argv.iter().map(|s| s.to_string()));
    let mut backend = crate::backend(argv, port);
    backend.progress_path = None;
    backend.metrics_path = None;
    let get = |path: &str| Rule {
        method: "GET".to_string(),
        path: path.to_string(),
        body: onebit_plugin_api::BodyKind::None,
        ..Default::default()
    };
    let mut rules = vec![get("/v1/models"), get("/models")];
    rules.extend(onebit_plugin_api::llama_server_rules(0));
    Ok(Built {
        backends: vec![backend],
        rules,
        ..Default::default()
    })
}

/// Flags llama-server reads as one (`-ub 256` and `--ubatch-size=256`).
const SAME_FLAGS: &[&[&str]] = &[&["-ub", "--ubatch-size"], &["-b", "--batch-size"]];

/// Whether `argv` sets `flag`, under any of its names, as `--name value` or `--name=value`.
fn has_flag(argv: &[String], flag: &str) -> bool {
    let names = names_of(flag);
    argv.iter().any(|arg| {
        names.iter().any(|name| {
            arg == name
                || arg
                    .strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('='))
        })
    })
}

/// The value `argv` gives `flag` last (llama-server takes the last), under any of its names.
fn flag_value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    let names = names_of(flag);
    let mut value = None;
    for (i, arg) in argv.iter().enumerate() {
        for name in &names {
            if arg == name {
                value = argv.get(i + 1).map(String::as_str);
            } else if let Some(v) = arg.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
                value = Some(v);
            }
        }
    }
    value
}

/// `flag` and the other names llama-server reads as it.
fn names_of(flag: &str) -> Vec<&str> {
    SAME_FLAGS
        .iter()
        .find(|names| names.contains(&flag))
        .map_or_else(|| vec![flag], |names| names.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(env: &[(&str, &str)]) -> PlanRequest {
        let mut r = PlanRequest::default();
        r.options.model = "/m/q.gguf".into();
        r.options.served_name = "q".into();
        r.options.llama_server = Some("/bin/sh".into());
        r.ports = vec![40001, 40002, 40003];
        r.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        r
    }

    fn hrx_main() -> Main {
        Main {
            route: "hrx".into(),
            device_argv: ["--device", "HRX0", "-ngl", "99"].map(String::from).into(),
            ctx_source: "the model's own ctx (no --ctx-size)".into(),
            pool: "gtt".into(),
            env: [
                ("GGML_HRX_STRICT", "1"),
                ("GGML_HRX_REPORT", "1"),
                (
                    "IREE_HAL_AMDGPU_LIBHSA_PATH",
                    "/opt/x/libhsa-runtime64.so.1",
                ),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            full: true,
            side_env: true,
            ..Default::default()
        }
    }

    /// A default is added only where nothing set its flag, under whichever of its names.
    #[test]
    fn a_default_flag_is_not_added_beside_the_same_flag_under_another_name() {
        let argv = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        assert!(has_flag(&argv(&["-ub", "512"]), "-ub"));
        assert!(has_flag(&argv(&["--ubatch-size", "512"]), "-ub"));
        assert!(has_flag(&argv(&["--ubatch-size=512"]), "-ub"));
        assert!(has_flag(&argv(&["-b", "4096"]), "--batch-size"));
        assert!(!has_flag(&argv(&["-b", "4096"]), "-ub"));
        assert!(!has_flag(&argv(&["--ubatch-sizes", "1"]), "-ub"));
        assert!(has_flag(&argv(&["--cache-reuse", "512"]), "--cache-reuse"));
        let both = argv(&["-ub", "256", "--ubatch-size=1024"]);
        assert_eq!(flag_value(&both, "-ub"), Some("1024"));
        assert_eq!(
            flag_value(&argv(&["-ub", "256"]), "--ubatch-size"),
            Some("256")
        );
        assert_eq!(flag_value(&argv(&["-b", "256"]), "-ub"), None);

        let mut main = hrx_main();
        main.defaults = vec![vec!["-ub".into(), "256".into()]];
        let mmproj =
            std::env::temp_dir().join(format!("onebit-plan-ub-{}.gguf", std::process::id()));
        std::fs::write(&mmproj, b"x").unwrap();
        let mut r = request(&[]);
        r.options.mmproj = Some(mmproj.to_string_lossy().into_owned());
        let built = build(&r, main).unwrap();
        let argv = &built.backends[0].argv;
        assert_eq!(
            argv.iter().filter(|a| *a == "-ub").count(),
            1,
            "--mmproj sets -ub itself: {argv:?}"
        );
        let _ = std::fs::remove_file(&mmproj);
    }

    /// The rule, end to end through the builder: every variable the plan would set and the user
    /// already set is left to the user's value (route, options and recipe variables alike, main
    /// and side backends alike), and one built from the user's own value is kept, combined.
    #[test]
    fn the_users_environment_variable_wins_over_every_plan_value() {
        let dir = std::env::temp_dir().join(format!("onebit-plan-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let recipes = dir.join("recipes.json");
        std::fs::write(
            &recipes,
            r#"{"recipes":[{"id":"e","match":{"device":["hrx"]},"env":{"RECIPE_VAR":"r","RECIPE_OTHER":"o"},"why":"w","measured":"m","source":"s"}]}"#,
        )
        .unwrap();
        let embed = dir.join("e.gguf");
        std::fs::write(&embed, b"x").unwrap();
        let user = [
            ("GGML_HRX_STRICT", "0"),
            ("IREE_HAL_AMDGPU_LIBHSA_PATH", "/mine/libhsa.so"),
            ("RECIPE_VAR", "mine"),
            ("GGML_HRX_DISABLE_DISPATCH", "decode_split"),
        ];
        let mut r = request(&user);
        r.options.recipes = Some(recipes.to_string_lossy().into_owned());
        r.options.parallel = Some(2);
        r.options.embed = Some(embed.to_string_lossy().into_owned());
        let built = build(&r, hrx_main()).unwrap();
        assert_eq!(
            built.backends.len(),
            2,
            "the main backend and the embedding server"
        );
        for b in &built.backends {
            for (k, _) in user {
                assert!(
                    !b.env.contains_key(k),
                    "{k} overrode the user's: {:?}",
                    b.env
                );
            }
            assert_eq!(b.env.get("GGML_HRX_REPORT").map(String::as_str), Some("1"));
            assert_eq!(b.env.get("RECIPE_OTHER").map(String::as_str), Some("o"));
            assert_eq!(
                b.env_combined
                    .get("GGML_HRX_DISABLE_DISPATCH")
                    .map(String::as_str),
                Some("decode_split,qwen.attention"),
                "built from the user's own value"
            );
        }
        assert!(
            built.notes.iter().any(|n| n == "recipe e: RECIPE_OTHER=o"),
            "a recipe line names only what it set: {:?}",
            built.notes
        );
        // Without the user's values, the plan's own are there.
        let mut r = request(&[]);
        r.options.recipes = Some(recipes.to_string_lossy().into_owned());
        r.options.parallel = Some(2);
        let built = build(&r, hrx_main()).unwrap();
        let env = &built.backends[0].env;
        assert_eq!(env.get("GGML_HRX_STRICT").map(String::as_str), Some("1"));
        assert_eq!(env.get("RECIPE_VAR").map(String::as_str), Some("r"));
        assert_eq!(
            env.get("GGML_HRX_DISABLE_DISPATCH").map(String::as_str),
            Some("qwen.attention")
        );
        assert!(built.backends[0].env_combined.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn resolve_drops_what_the_user_set_and_keeps_combined_values() {
        let r = request(&[("A", ""), ("C", "user")]);
        let env = Env {
            plain: [("A", "1"), ("B", "2")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            combined: [("C".to_string(), "user,more".to_string())].into(),
        };
        let (plain, combined) = env.resolve(&r);
        assert_eq!(plain, [("B".to_string(), "2".to_string())].into());
        assert_eq!(
            combined,
            [("C".to_string(), "user,more".to_string())].into()
        );
    }
}
