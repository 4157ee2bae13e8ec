//! The drop-in command line: `1bit llama-server ARGS…`, and `1bit` run under the name
//! `llama-server`, take llama-server's own arguments (as Lemonade's llamacpp backend builds them)
//! and become `1bit serve`; the arguments serve does not read pass to the real llama-server.

use std::path::Path;

use onebit_plugin_api::{Action, Plan};

use crate::error::Fatal;

mod flags;
use flags::{DEVICES, DOWNLOADS, NO_VALUE, WITH_VALUE};

/// The name a packager links to `1bit` so that a program which runs llama-server runs serve.
pub const LLAMA_SERVER: &str = "llama-server";

/// llama-server's default port, kept in drop-in mode (serve's own default is 8000).
const LLAMA_SERVER_PORT: &str = "8080";

/// `AIP_MODE`'s value that turns on Google's Vertex AI prediction protocol in llama-server.
pub const AIP_PREDICTION: &str = "PREDICTION";

/// The route of Google's AIP mode that serve relays to its llama-server (`AIP_PREDICT_ROUTE`,
/// `/predict` by default), when `AIP_MODE=PREDICTION`. Called by `prepare`; reads `env`.
pub fn aip_predict_route(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    if env("AIP_MODE").as_deref() != Some(AIP_PREDICTION) {
        return None;
    }
    let route = env("AIP_PREDICT_ROUTE")
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "/predict".to_string());
    Some(if route.starts_with('/') {
        route
    } else {
        format!("/{route}")
    })
}

/// Whether `argv0` (the name the process was started under) is `llama-server`. Called once by
/// `main` before parsing.
pub fn invoked_as_llama_server(argv0: &str) -> bool {
    Path::new(argv0)
        .file_name()
        .is_some_and(|name| name == LLAMA_SERVER)
}

/// Turn llama-server's arguments into `1bit serve`'s (without the word `serve`): the flags
/// serve reads become its own, the rest follow `--` and reach the real llama-server unchanged.
/// Called by `main` on the main thread; does not block. Err is the one line to print (exit 2).
pub fn translate(args: &[String]) -> Result<Vec<String>, String> {
    translate_in(args, &|name| std::env::var(name).ok())
}

/// [`translate`] with the environment it reads (`LLAMA_API_KEY`, Google's `AIP_MODE` and
/// `AIP_HTTP_PORT`) given as a lookup, for tests.
pub fn translate_in(
    args: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>, String> {
    let mut serve: Vec<String> = Vec::new();
    let mut metrics = false;
    let mut key = false;
    let mut pass: Vec<String> = Vec::new();
    let mut draft: Option<String> = None;
    let mut spec_type: Option<String> = None;
    let mut port = false;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let (flag, inline) = flag_and_inline_value(arg);
        let mut value = |what: &str| -> Result<String, String> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            let v = args.get(i).cloned().ok_or_else(|| {
                format!(
                    "{flag} needs a value ({what}); llama-server's own flag, e.g. {flag} {}",
                    example(flag)
                )
            })?;
            i += 1;
            Ok(v)
        };
        let mut own = |name: &str, v: String| {
            serve.push(name.to_string());
            serve.push(v);
        };
        match flag {
            "-m" | "--model" => own("-m", value("the .gguf file")?),
            "-c" | "--ctx-size" => own("--ctx-size", value("tokens")?),
            "--port" => {
                port = true;
                own("--port", value("a port")?)
            }
            "--host" => own("--host", value("an address")?),
            // The user's security policy is serve's: the key is checked by serve (and never
            // reaches the backend), the CORS flags are the guard's allowance.
            "--api-key" => {
                key = true;
                own("--api-key", value("a key, or keys separated by commas")?)
            }
            "--api-key-file" => {
                key = true;
                own("--api-key-file", value("a file of keys, one a line")?)
            }
            "--cors-origins" => own("--cors-origins", value("origins, or * or localhost")?),
            "--cors-methods" => own("--cors-methods", value("methods")?),
            "--cors-headers" => own("--cors-headers", value("headers")?),
            "--cors-credentials" => serve.push("--cors-credentials".to_string()),
            "--no-cors-credentials" => serve.push("--no-cors-credentials".to_string()),
            "-a" | "--alias" => own("--alias", value("a name, or names separated by commas")?),
            "--tags" => own("--tags", value("tags separated by commas")?),
            "-np" | "--parallel" => {
                let n = value("slots")?;
                // -1 is llama-server's "auto", which is also serve's default.
                if n.trim() != "-1" {
                    own("--parallel", n);
                }
            }
            "-dev" | "--device" => own("--device", route_of(&value("a device name")?)?),
            "-mm" | "--mmproj" => own("--mmproj", value("the projector .gguf")?),
            // serve probes the workers and counts their memory before llama-server gets them.
            "--rpc" => own("--rpc", value("workers, HOST:PORT[,HOST:PORT...]")?),
            "-md" | "--model-draft" | "--spec-draft-model" => {
                draft = Some(value("the drafter .gguf")?)
            }
            "--spec-type" => spec_type = Some(value("a speculative type")?),
            "--embedding" | "--embeddings" => serve.push("--embedding".to_string()),
            "--rerank" | "--reranking" => serve.push("--reranking".to_string()),
            // serve's llama-server routes always pass these; without --metrics, serve's own
            // /metrics answers 501 as llama-server's would.
            "--metrics" => metrics = true,
            "--jinja" => {}
            "--version" => return Ok(vec!["--version".to_string()]),
            f if DOWNLOADS.contains(&f) => {
                return Err(format!(
                    "{f}: 1bit downloads nothing; download the GGUF yourself and pass -m FILE.gguf"
                ));
            }
            _ => pass_through(args, &mut i, flag, inline.is_some(), &mut pass),
        }
    }
    // A drafter becomes serve's own flag when the speculative type says which kind it is, so
    // the memory check counts it; any other drafter passes as it came.
    match (draft, spec_type) {
        (Some(file), Some(kind)) if kind == "draft-mtp" => {
            serve.extend(["--mtp".to_string(), file])
        }
        (Some(file), Some(kind)) if kind == "draft-dflash" => {
            serve.extend(["--dflash".to_string(), file])
        }
        (draft, kind) => {
            if let Some(file) = draft {
                pass.extend(["--model-draft".to_string(), file]);
            }
            if let Some(kind) = kind {
                pass.extend(["--spec-type".to_string(), kind]);
            }
        }
    }
    if !serve.iter().any(|a| a == "-m") {
        return Ok(router(args, env));
    }
    Ok(serve_policy(serve, pass, key, port, metrics, env))
}

/// Serve's own flags in router mode, as in [`translate_in`]: its address, its key and the
/// user's CORS policy.
const ROUTER_OWN: &[&str] = &[
    "--port",
    "--host",
    "--api-key",
    "--api-key-file",
    "--cors-origins",
    "--cors-methods",
    "--cors-headers",
];

/// llama-server's router mode (a command line with no `-m`): serve keeps its address, its
/// key and the CORS policy, and every other argument reaches the real llama-server as it came,
/// since there the model flags (`-c`, `-np`, `-dev`, drafting) are the defaults of the models
/// the router loads, not of one serve checks.
fn router(args: &[String], env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut serve = vec!["--llama-router".to_string()];
    let mut pass = Vec::new();
    let (mut key, mut port, mut metrics) = (false, false, false);
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let (flag, inline) = flag_and_inline_value(arg);
        key |= flag.starts_with("--api-key");
        port |= flag == "--port";
        metrics |= flag == "--metrics";
        if ROUTER_OWN.contains(&flag) {
            serve.push(flag.to_string());
            match inline {
                Some(v) => serve.push(v),
                None => {
                    // A missing value is serve's own flag's error, said by clap.
                    if let Some(v) = args.get(i) {
                        serve.push(v.clone());
                        i += 1;
                    }
                }
            }
            continue;
        }
        if matches!(flag, "--cors-credentials" | "--no-cors-credentials") {
            serve.push(flag.to_string());
            continue;
        }
        pass_through(args, &mut i, flag, inline.is_some(), &mut pass);
    }
    serve_policy(serve, pass, key, port, metrics, env)
}

/// The settings both modes share: `LLAMA_API_KEY` as serve's key, the port (Google's AIP mode
/// or llama-server's default), serve's `/metrics` off without `--metrics`, and what follows
/// `--` for the real llama-server.
fn serve_policy(
    mut serve: Vec<String>,
    pass: Vec<String>,
    key: bool,
    port: bool,
    metrics: bool,
    env: &dyn Fn(&str) -> Option<String>,
) -> Vec<String> {
    if !key && let Some(k) = env("LLAMA_API_KEY").filter(|k| !k.trim().is_empty()) {
        serve.extend(["--api-key".to_string(), k]);
    }
    // Google's AIP mode: AIP_HTTP_PORT is the port serve listens on (llama-server lets it
    // override --port); the backend gets its own private port instead (backends::supervisor).
    if env("AIP_MODE").as_deref() == Some(AIP_PREDICTION) {
        let aip_port = env("AIP_HTTP_PORT").unwrap_or_else(|| LLAMA_SERVER_PORT.to_string());
        if let Some(at) = serve.iter().position(|a| a == "--port") {
            serve.drain(at..at + 2);
        }
        serve.extend(["--port".to_string(), aip_port]);
    } else if !port {
        serve.extend(["--port".to_string(), LLAMA_SERVER_PORT.to_string()]);
    }
    if !metrics {
        serve.push("--no-metrics".to_string());
    }
    // llama-server with built-in tools or MCP servers and no --cors-origins allows the
    // localhost origins (a web UI on another local port calls its tools); so does serve's guard.
    let tools = pass.iter().any(|a| {
        let (flag, _) = flag_and_inline_value(a);
        TOOL_FLAGS.contains(&flag)
    });
    if tools && !serve.iter().any(|a| a == "--cors-origins") {
        serve.extend(["--cors-origins".to_string(), "localhost".to_string()]);
    }
    if !pass.is_empty() {
        serve.push("--".to_string());
        serve.extend(pass);
    }
    serve
}

/// The llama-server flags that turn on built-in tools or MCP servers, under which llama-server's
/// CORS origins default to `localhost`.
const TOOL_FLAGS: &[&str] = &["--tools", "--mcp-servers-config", "--mcp-servers-json"];

/// `--flag=value` as (`--flag`, the value); any other token as itself, with no value.
pub fn flag_and_inline_value(arg: &str) -> (&str, Option<String>) {
    match arg.split_once('=') {
        Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
        _ => (arg, None),
    }
}

/// `args[*i - 1]` (read as `flag`, its value inline or not) for the real llama-server, with the
/// token after it when that is the flag's value; `*i` moves past what was taken.
fn pass_through(args: &[String], i: &mut usize, flag: &str, inline: bool, pass: &mut Vec<String>) {
    let arg = &args[*i - 1];
    pass.push(arg.clone());
    let takes_value = !inline
        && arg.starts_with('-')
        && !NO_VALUE.contains(&flag)
        && (WITH_VALUE.contains(&flag) || args.get(*i).is_some_and(|next| looks_like_value(next)));
    if takes_value && let Some(next) = args.get(*i) {
        pass.push(next.clone());
        *i += 1;
    }
}

/// A token after a flag of unknown arity is its value unless it is itself a flag; `-1` is a
/// value.
fn looks_like_value(token: &str) -> bool {
    !token.starts_with('-') || token.parse::<f64>().is_ok()
}

fn example(flag: &str) -> &'static str {
    match flag {
        "-m" | "--model" => "model.gguf",
        "--port" => "8080",
        "-dev" | "--device" => "HRX0",
        _ => "VALUE",
    }
}

/// The route for a llama.cpp device name (or a comma list naming one route).
fn route_of(devices: &str) -> Result<String, String> {
    let mut route: Option<&str> = None;
    for name in devices.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let Some((_, r)) = DEVICES.iter().find(|(d, _)| *d == name) else {
            return Err(format!(
                "--device {devices}: this build has no route for the llama.cpp device {name}; use HRX0, CPU or none, or leave --device out to let 1bit choose"
            ));
        };
        if route.is_some_and(|seen| seen != *r) {
            return Err(format!(
                "--device {devices}: these devices are served by different routes; name one (HRX0, CPU or none)"
            ));
        }
        route = Some(r);
    }
    route
        .map(str::to_string)
        .ok_or_else(|| format!("--device {devices}: name a device (HRX0, CPU or none)"))
}

/// Append the arguments given after `--` to the llama-server backend's argv, so they reach the
/// real llama-server unchanged; refused on a route whose backend is not llama-server. Called by
/// serve's `prepare` once the route has planned; does not block.
pub fn pass_to_backend(plan: &mut Plan, args: &[String]) -> Result<(), Fatal> {
    if args.is_empty() {
        return Ok(());
    }
    match plan.backends.first_mut() {
        Some(backend) if backend.engine == LLAMA_SERVER => {
            backend.argv.extend(args.iter().cloned());
            Ok(())
        }
        _ => Err(Fatal::usage(format!(
            "{}: arguments for llama-server, but the {} route runs no llama-server; remove them or use --device hrx or cpu",
            args.join(" "),
            plan.device
        ))),
    }
}

/// Make serve's `--ctx-size` the context llama-server will use: a `-c`/`--ctx-size` among the
/// arguments after `--` comes later on llama-server's command line than serve's own and wins
/// there, so the memory check must size that one. Adopted when serve has none; Err (exit 2)
/// when it is not a number of tokens, or when serve's own says another. Called by `serve::run`
/// before anything is planned.
pub fn adopt_backend_ctx(ctx_size: &mut Option<u64>, passed: &[String]) -> Result<(), Fatal> {
    let mut found: Option<(&str, String)> = None;
    let mut i = 0;
    while i < passed.len() {
        let (flag, inline) = flag_and_inline_value(&passed[i]);
        i += 1;
        if matches!(flag, "-c" | "--ctx-size") {
            let value = inline.or_else(|| {
                i += 1;
                passed.get(i - 1).cloned()
            });
            let value = value.ok_or_else(|| {
                Fatal::usage(format!(
                    "{flag} after --: no value; give llama-server's context in tokens, e.g. {flag} 8192"
                ))
            })?;
            found = Some((flag, value));
        }
    }
    let Some((flag, text)) = found else {
        return Ok(());
    };
    let Ok(n) = text.trim().parse::<u64>() else {
        return Err(Fatal::usage(format!(
            "{flag} {text} after --: not a number of tokens; give one such as 8192 (0: the model's own)"
        )));
    };
    match *ctx_size {
        Some(own) if own != n => Err(Fatal::usage(format!(
            "--ctx-size {own} and {flag} {n} after -- disagree, and llama-server would take {n}; give the context once (--ctx-size {n})"
        ))),
        _ => {
            *ctx_size = Some(n);
            Ok(())
        }
    }
}

/// The role routes llama-server serves only when started with one of its flags, and serve's
/// own ways to get each: (paths, llama-server's flags, what serve answers instead of
/// llama-server's "Start it with `--embeddings`").
const ROLE_ROUTES: [(&[&str], &[&str], &str); 2] = [
    (
        &["/v1/embeddings", "/embeddings"],
        &["--embedding", "--embeddings"],
        "this server does not serve embeddings: start 1bit serve with --embedding (the model itself is an embedding model) or --embed MODEL.gguf (an embedding model beside it)",
    ),
    (
        &["/v1/rerank", "/rerank", "/v1/reranking", "/reranking"],
        &["--reranking", "--rerank"],
        "this server does not rerank: start 1bit serve with --reranking (the model itself is a reranking model) or --rerank MODEL.gguf (a reranking model beside it)",
    ),
];

/// Make the plan's rules say what its llama-server backend was started with: a role route the
/// backend would refuse naming llama-server's own flag is answered 501 in serve's words
/// (`--embedding`, `--embed FILE`), and slot actions reach a backend the user gave
/// `--slot-save-path` (in `passed`, the arguments after `--`; a route's own slot directory stays
/// the route's), and Google's AIP predict route (`predict`, from [`aip_predict_route`]) reaches
/// it. Called by serve's `prepare` once the plan is final; does not block.
pub fn align_rules(plan: &mut Plan, passed: &[String], predict: Option<&str>) {
    let Some(backend) = plan.backends.first().filter(|b| b.engine == LLAMA_SERVER) else {
        return;
    };
    if let Some(path) = predict
        && !plan.rules.iter().any(|r| r.path == path)
    {
        // Google's AIP mode: its predict route runs llama-server's own routes inside.
        plan.rules.push(onebit_plugin_api::Rule {
            method: "POST".to_string(),
            path: path.to_string(),
            action: Action::Proxy { backend: 0 },
            inference: false,
            body: onebit_plugin_api::BodyKind::Json,
            reply: onebit_plugin_api::ReplyShape::default(),
        });
    }
    let has = |flags: &[&str]| backend.argv.iter().any(|a| flags.contains(&a.as_str()));
    let answers: Vec<(&[&str], &str)> = ROLE_ROUTES
        .iter()
        .filter(|(_, flags, _)| !has(flags))
        .map(|(paths, _, message)| (*paths, *message))
        .collect();
    let slots = passed
        .iter()
        .any(|a| a == "--slot-save-path" || a.starts_with("--slot-save-path="));
    for rule in &mut plan.rules {
        let to_backend = rule.action == (Action::Proxy { backend: 0 });
        let refused = answers
            .iter()
            .find(|(paths, _)| to_backend && paths.contains(&rule.path.as_str()));
        if let Some((_, message)) = refused {
            rule.action = Action::Answer {
                status: 501,
                content_type: "application/json".to_string(),
                body: onebit_plugin_api::error_body(501, "not_supported_error", message),
            };
        } else if slots && rule.path == "/slots/*" && matches!(rule.action, Action::Answer { .. }) {
            rule.action = Action::Proxy { backend: 0 };
        }
    }
}

/// The real llama-server `cargo xtask install` put beside this `1bit`
/// (`<prefix>/lib/1bit/llama-server/llama-server`, apart from the `llama-server` link in
/// `<prefix>/bin`), unless `ONEBIT_LLAMA_SERVER` names another. Called by serve's `prepare`
/// when no `--llama-server` was given; reads the file system.
pub fn installed_beside() -> Option<String> {
    if std::env::var_os("ONEBIT_LLAMA_SERVER").is_some_and(|v| !v.is_empty()) {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let path = exe
        .parent()?
        .parent()?
        .join("lib/1bit/llama-server")
        .join(LLAMA_SERVER);
    use std::os::unix::fs::PermissionsExt;
    let meta = path.metadata().ok()?;
    (meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .then(|| path.to_string_lossy().into_owned())
}

/// Refuse a plan whose backend program is this very `1bit` (a `llama-server` on PATH that is
/// the drop-in link to serve): it would start itself again and again. Called by serve's
/// `prepare`; reads the file system.
pub fn refuse_self(plan: &Plan) -> Result<(), Fatal> {
    let Some(me) = std::env::current_exe()
        .ok()
        .and_then(|p| p.canonicalize().ok())
    else {
        return Ok(());
    };
    for backend in &plan.backends {
        let Some(program) = backend.argv.first() else {
            continue;
        };
        if Path::new(program).canonicalize().is_ok_and(|p| p == me) {
            return Err(Fatal::usage(format!(
                "the llama-server found ({program}) is 1bit itself, not llama.cpp's server; set ONEBIT_LLAMA_SERVER or --llama-server to the real llama-server (cargo xtask setup builds it)"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "llama_server_cli_tests.rs"]
mod tests;
