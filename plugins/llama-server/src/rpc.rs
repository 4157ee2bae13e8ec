//! `--rpc HOST:PORT[,…]` on the llama-server routes: llama.cpp's RPC workers hold layers, and
//! the lines llama-server prints when it loses one.

use onebit_plugin_api::PlanRequest;

/// The workers named by `--rpc` (repeatable, each comma-separated), in order, from serve's
/// command line (`options.args`: the ABI carries no field for it). The host checks each entry
/// and asks each worker before planning, so they are taken as given here.
pub fn workers(request: &PlanRequest) -> Vec<String> {
    let args = &request.options.args;
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        // What follows `--` goes to llama-server as it is, not to serve.
        if args[i] == "--" {
            break;
        }
        let value = if args[i] == "--rpc" {
            i += 1;
            args.get(i).map(String::as_str)
        } else {
            args[i].strip_prefix("--rpc=")
        };
        if let Some(v) = value {
            out.extend(
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string),
            );
        }
        i += 1;
    }
    out
}

/// Put the workers on `argv`: `--rpc LIST`, every layer offered to the devices (`-ngl all`
/// instead of the cpu route's `-ngl 0`: llama.cpp counts RPC workers as GPUs, so `-ngl 0`
/// would keep every layer here), and no `--device` list that would leave them out (llama.cpp
/// then puts the workers first and the local GPU after them, splitting by free memory).
/// Returns a note for serve to print, or None without workers.
pub fn apply(request: &PlanRequest, argv: &mut Vec<String>) -> Option<String> {
    let workers = workers(request);
    if workers.is_empty() {
        return None;
    }
    let mut i = 0;
    while i + 1 < argv.len() {
        match argv[i].as_str() {
            "-ngl" if argv[i + 1] == "0" => argv[i + 1] = "all".to_string(),
            "--device" | "-dev" => {
                argv.drain(i..i + 2);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    // Before any flag that names devices, so the workers are registered first.
    let at = argv.iter().position(|a| a == "-ngl").unwrap_or(argv.len());
    argv.splice(at..at, ["--rpc".to_string(), workers.join(",")]);
    Some(format!(
        "layers split across {} RPC worker{} ({}) by their free memory, as llama.cpp splits them (docs/rpc.md)",
        workers.len(),
        if workers.len() == 1 { "" } else { "s" },
        workers.join(", ")
    ))
}

/// Why a llama-server line means it lost an RPC worker, or None. When a worker's connection
/// fails mid-run llama.cpp aborts with `Remote RPC server crashed or returned malformed
/// response` (`RPC_STATUS_ASSERT`, ggml-rpc.cpp), which names no worker; at load it aborts
/// with `Failed to connect to HOST:PORT` or `RPC handshake failed for HOST:PORT`. Called on
/// the stderr reader thread for every line: substring checks only.
pub fn lost_worker(line: &str) -> Option<String> {
    const MARKS: [&str; 3] = [
        "Remote RPC server crashed or returned malformed response",
        "Failed to connect to ",
        "RPC handshake failed for ",
    ];
    MARKS.iter().any(|m| line.contains(m)).then(|| {
        format!(
            "llama-server lost an RPC worker (its line: {}); it cannot go on without the layers there",
            line.trim()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::ServeOptions;

    fn request(args: &[&str]) -> PlanRequest {
        PlanRequest {
            options: ServeOptions {
                args: args.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn workers_come_from_every_rpc_flag_in_order() {
        let r = request(&[
            "-m",
            "x.gguf",
            "--rpc",
            "a:1,b:2",
            "--rpc=c:3",
            "--port",
            "9",
        ]);
        assert_eq!(workers(&r), ["a:1", "b:2", "c:3"]);
        assert!(workers(&request(&["-m", "x.gguf"])).is_empty());
    }

    #[test]
    fn the_cpu_argv_offers_every_layer_to_the_workers() {
        let base = |extra: &[&str]| -> Vec<String> {
            ["llama-server", "-m", "x", "--port", "1"]
                .iter()
                .chain(extra)
                .map(|s| s.to_string())
                .collect()
        };
        let mut argv = base(&["-ngl", "0", "-c", "4096"]);
        assert_eq!(apply(&request(&[]), &mut argv), None);
        assert_eq!(argv, base(&["-ngl", "0", "-c", "4096"]));

        let note = apply(
            &request(&["--rpc", "10.0.0.2:50052,10.0.0.3:50052"]),
            &mut argv,
        );
        assert!(note.unwrap().contains("2 RPC workers"));
        assert_eq!(
            argv,
            base(&[
                "--rpc",
                "10.0.0.2:50052,10.0.0.3:50052",
                "-ngl",
                "all",
                "-c",
                "4096"
            ])
        );

        // hrx: the device list goes, so llama.cpp lists the workers and then HRX0.
        let mut argv = base(&["--device", "HRX0", "-ngl", "99"]);
        apply(&request(&["--rpc=h:1"]), &mut argv);
        assert_eq!(argv, base(&["--rpc", "h:1", "-ngl", "99"]));
    }

    #[test]
    fn the_rpc_abort_line_stops_serve() {
        let line = "/x/ggml-rpc.cpp:574: Remote RPC server crashed or returned malformed response";
        assert!(lost_worker(line).unwrap().contains("lost an RPC worker"));
        assert!(lost_worker("Failed to connect to 10.0.0.2:50052").is_some());
        assert_eq!(lost_worker("srv  update_slots: all slots are idle"), None);
    }
}
