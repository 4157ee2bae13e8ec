//! Retrieval beside the chat model: `--embed MODEL.gguf` and `--rerank MODEL.gguf`, each its own
//! llama-server that takes a whole input in one batch, routed by path.

use std::path::Path;

use onebit_plugin_api::{Action, BackendSpec, PlanRequest, Refusal, Rule, SideModel};

use crate::memory;

/// The side servers of a plan.
#[derive(Debug, Default)]
pub struct SideServers {
    pub backends: Vec<BackendSpec>,
    /// Rules that send the side routes to their servers; they go before the route's own.
    pub rules: Vec<Rule>,
    pub models: Vec<SideModel>,
    /// Their files and caches, for the memory check.
    pub weights_bytes: u64,
    pub kv_bytes: u64,
}

/// The side servers for `route` (`cpu`: 4 slots and 8192 tokens; `hrx`: one slot and 2048, as
/// HRX runs one sequence per batch), on `ports[first_index..]`, as backends `first_index..`.
pub fn side_servers(
    request: &PlanRequest,
    route: &str,
    server: &str,
    first_index: usize,
) -> Result<SideServers, Refusal> {
    let o = &request.options;
    let mut out = SideServers::default();
    let wanted = [
        (o.embed.as_deref(), "--embed", "embedding", "--embedding"),
        (o.rerank.as_deref(), "--rerank", "rerank", "--reranking"),
    ];
    for (path, flag, role, engine_flag) in wanted {
        let Some(path) = path else { continue };
        let index = first_index + out.backends.len();
        let port = *request.ports.get(index).ok_or_else(|| {
            Refusal::usage(format!("{flag}: the host reserved no port for its server"))
        })?;
        let bytes = std::fs::metadata(path).map(|m| m.len()).map_err(|e| {
            Refusal::usage(format!("{flag} {path}: {e}; pass an existing .gguf file"))
        })?;
        let id = Path::new(path)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| role.to_string());
        let (ctx, slots, device): (u64, u32, &[&str]) = if route == "hrx" {
            (2048, 1, &["--device", "HRX0", "-ngl", "99"])
        } else {
            (8192, 4, &["-ngl", "0"])
        };
        let n = ctx.to_string();
        let mut argv: Vec<String> = [
            server,
            "-m",
            path,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--metrics",
            "--alias",
            &id,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        argv.extend(device.iter().map(|s| s.to_string()));
        argv.extend(
            [
                engine_flag,
                "-c",
                &n,
                "-b",
                &n,
                "-ub",
                &n,
                "-np",
                &slots.to_string(),
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        let header = gguf::read_header_lean(Path::new(path)).ok();
        if role == "embedding" && !has_pooling(header.as_ref()) {
            argv.extend(["--pooling", "mean"].map(String::from));
        }
        out.weights_bytes += bytes;
        if let Some(h) = &header {
            let mut settings = memory::KvSettings::new(ctx);
            settings.n_parallel = slots;
            settings.unified = false;
            out.kv_bytes += memory::kv_estimate(h, &settings)
                .map(|e| e.total_bytes())
                .unwrap_or(0);
        }
        let mut backend = crate::backend(argv, port);
        backend.engine = format!("llama-server ({role})");
        out.backends.push(backend);
        out.models.push(SideModel {
            id,
            role: role.to_string(),
            backend: index,
        });
        let paths: &[&str] = if role == "embedding" {
            &["/v1/embeddings", "/embeddings"]
        } else {
            &["/v1/rerank", "/rerank", "/v1/reranking", "/reranking"]
        };
        for path in paths {
            out.rules.push(Rule {
                method: "POST".to_string(),
                path: path.to_string(),
                action: Action::Proxy { backend: index },
                inference: false,
                ..Default::default()
            });
        }
    }
    Ok(out)
}

/// Whether the model names its own pooling (an embedding model does; a chat model does not).
pub fn has_pooling(header: Option<&gguf::Header>) -> bool {
    header.is_some_and(|h| {
        h.arch_key("pooling_type")
            .is_some_and(|k| h.get(&k).is_some())
    })
}
