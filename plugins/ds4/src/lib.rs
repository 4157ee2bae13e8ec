//! The ds4 device route: a DwarfStar GGUF in DwarfStar's ds4-server, with serve in the request
//! path (ds4-server has no alias flag, so serve gives replies the served name).
#![deny(unsafe_code)]

use std::path::{Path, PathBuf};

use onebit_plugin_api::{
    Action, BackendSpec, DeviceRoute, Plan, PlanRequest, Purpose, Refusal, RouteInfo, Rule,
    export_route,
};

#[derive(Default)]
pub struct Ds4Route;

/// Which ds4-server to run: `--ds4 PATH`, else `$ONEBIT_DS4`, else `ds4-server` on `PATH`.
pub fn server_binary(request: &PlanRequest) -> Result<String, Refusal> {
    let given = request
        .options
        .ds4
        .as_deref()
        .map(|p| (p, "--ds4"))
        .or_else(|| {
            request
                .env
                .get("ONEBIT_DS4")
                .filter(|p| !p.is_empty())
                .map(|p| (p.as_str(), "ONEBIT_DS4"))
        });
    if let Some((path, what)) = given {
        return if is_executable(Path::new(path)) {
            Ok(path.to_string())
        } else {
            Err(Refusal::usage(format!(
                "{what} {path}: not an executable file; pass the path of a ds4-server binary"
            )))
        };
    }
    request
        .env
        .get("PATH")
        .and_then(|path| {
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| Path::new(d).join("ds4-server"))
                .find(|p| is_executable(p))
        })
        .map(|p: PathBuf| p.to_string_lossy().into_owned())
        .ok_or_else(|| Refusal {
            exit_code: 1,
            message: "no ds4-server found: pass --ds4 PATH (or set ONEBIT_DS4), or put ds4-server on PATH".to_string(),
        })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The generation routes ds4-server answers.
const DS4_PATHS: [&str; 4] = [
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
];

/// The request table: the OpenAI generation routes relayed to ds4-server; every other route
/// of llama-server's table, and slot actions, answered 501.
pub fn rules() -> Vec<Rule> {
    let mut rules: Vec<Rule> = DS4_PATHS
        .iter()
        .map(|path| Rule {
            method: "POST".to_string(),
            path: path.to_string(),
            action: Action::Proxy { backend: 0 },
            inference: true,
            ..Default::default()
        })
        .collect();
    let llama_server_only = onebit_plugin_api::llama_server_rules(0)
        .into_iter()
        .filter(|rule| !(rule.method == "POST" && DS4_PATHS.contains(&rule.path.as_str())))
        .map(|rule| (rule.method, rule.path))
        .chain([("POST".to_string(), "/slots/*".to_string())]);
    rules.extend(llama_server_only.map(|(method, path)| {
        let shown = path.trim_end_matches("/*").to_string();
        Rule {
            method,
            path,
            action: Action::Answer {
                status: 501,
                content_type: "application/json".to_string(),
                body: onebit_plugin_api::error_body(
                    501,
                    "not_implemented",
                    &format!("{shown} is not available on --device ds4"),
                ),
            },
            inference: false,
            ..Default::default()
        }
    }));
    rules
}

impl DeviceRoute for Ds4Route {
    fn info(&self) -> RouteInfo {
        RouteInfo {
            name: "ds4".to_string(),
            summary: "DwarfStar's ds4-server (serve in the request path)".to_string(),
        }
    }

    fn plan(&self, request: &PlanRequest) -> Result<Plan, Refusal> {
        let o = &request.options;
        o.checked_route_options("ds4", &[])?;
        llama_server::refuse_h32(request)?;
        if request.purpose == Purpose::PrintBackend {
            // ds4-server cannot be told the served name: serve renames its replies.
            return Err(Refusal::needs_serve("--device ds4"));
        }
        if request.model.is_dir {
            return Err(Refusal::usage(format!(
                "{} is a directory; --device ds4 serves a DwarfStar .gguf file",
                o.model
            )));
        }
        if o.strict_device || o.placement_report {
            return Err(Refusal::usage(
                "--strict-device and --placement-report need --device hrx or auto: ds4-server has no placement report; remove them",
            ));
        }
        let server = server_binary(request)?;
        let port = *request
            .ports
            .first()
            .ok_or_else(|| Refusal::usage("the host reserved no port for the backend"))?;
        let mut argv = vec![
            server,
            "-m".to_string(),
            o.model.clone(),
            "--host".to_string(),
            "127.0.0.1".to_string(),
            "--port".to_string(),
            port.to_string(),
        ];
        if let Some(ctx) = o.ctx_size {
            argv.extend(["-c".to_string(), ctx.to_string()]);
        }
        if o.ssd_streaming {
            argv.push("--ssd-streaming".to_string());
        }
        Ok(Plan {
            device: "ds4".to_string(),
            backends: vec![BackendSpec {
                engine: "ds4-server".to_string(),
                argv,
                env: Default::default(),
                port,
                health_path: "/v1/models".to_string(),
                progress_path: None,
                metrics_path: None,
                ..Default::default()
            }],
            rules: rules(),
            one_hop: false,
            warmups: Vec::new(),
            memory: None,
            notes: Vec::new(),
            // ds4-server has no alias flag.
            rename_in_streams: true,
            ..Default::default()
        })
    }
}

export_route!(Ds4Route);

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::ServeOptions;

    fn request(ssd: bool) -> PlanRequest {
        PlanRequest {
            options: ServeOptions {
                model: "/m/DeepSeek-V4-Flash.gguf".into(),
                ds4: Some("/bin/sh".into()),
                ssd_streaming: ssd,
                ..Default::default()
            },
            ports: vec![40001],
            ..Default::default()
        }
    }

    #[test]
    fn the_plan_runs_ds4_server_with_health_on_v1_models_and_needs_serve() {
        let plan = Ds4Route.plan(&request(false)).unwrap();
        let b = &plan.backends[0];
        assert_eq!(
            b.argv.join(" "),
            "/bin/sh -m /m/DeepSeek-V4-Flash.gguf --host 127.0.0.1 --port 40001"
        );
        assert_eq!(b.health_path, "/v1/models");
        assert_eq!(b.progress_path, None);
        assert!(!plan.one_hop);
        let plan = Ds4Route.plan(&request(true)).unwrap();
        assert!(
            plan.backends[0]
                .argv
                .ends_with(&["--ssd-streaming".to_string()])
        );
        let mut r = request(false);
        r.options.strict_device = true;
        assert_eq!(Ds4Route.plan(&r).unwrap_err().exit_code, 2);
    }

    #[test]
    fn the_binary_is_the_flags_then_onebit_ds4_then_path() {
        let mut r = request(false);
        r.options.ds4 = Some("/nonexistent/ds4-server".into());
        let refusal = server_binary(&r).unwrap_err();
        assert_eq!(refusal.exit_code, 2);
        assert!(refusal.message.starts_with("--ds4 /nonexistent/ds4-server"));
        r.options.ds4 = None;
        r.env.insert("ONEBIT_DS4".into(), "/bin/sh".into());
        assert_eq!(server_binary(&r).unwrap(), "/bin/sh");
        r.env.clear();
        r.env.insert("PATH".into(), "/nonexistent".into());
        assert_eq!(server_binary(&r).unwrap_err().exit_code, 1);
    }

    #[test]
    fn llama_server_only_routes_answer_501_naming_the_path() {
        let rules = rules();
        let tokenize = rules.iter().find(|r| r.path == "/tokenize").unwrap();
        let Action::Answer { status, body, .. } = &tokenize.action else {
            panic!("an answer")
        };
        assert_eq!(*status, 501);
        assert_eq!(
            body,
            r#"{"error":{"code":501,"message":"/tokenize is not available on --device ds4","type":"not_implemented"}}"#
        );
        let chat = rules
            .iter()
            .find(|r| r.path == "/v1/chat/completions")
            .unwrap();
        assert!(chat.inference && matches!(chat.action, Action::Proxy { backend: 0 }));
    }
}
