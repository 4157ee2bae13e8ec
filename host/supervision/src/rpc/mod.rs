//! llama.cpp's RPC workers: `1bit rpc-worker`, the probe that asks a worker what it offers,
//! the layer split serve counts memory by, and watching the workers while serve runs.

pub mod probe;
pub mod relay;
pub mod split;
pub mod traffic;
pub mod watch;
pub mod worker;

use onebit_plugin_api::Plan;

use onebit_command::cli::ServeArgs;
use onebit_command::error::{Fatal, exit};

/// `--rpc`, before anything starts: each entry checked (exit 2), the route's backend taking
/// the workers (exit 2 for a route that does not run llama.cpp's RPC), and each worker asked
/// what it offers within a second (exit 3 naming the first that does not answer). The offers
/// are kept for /health and /metrics. Empty without `--rpc`. Blocks serve's main thread for up
/// to a second per worker.
pub fn before_start(args: &ServeArgs, plan: &Plan) -> Result<Vec<probe::Offer>, Fatal> {
    if args.rpc.is_empty() {
        return Ok(Vec::new());
    }
    for entry in &args.rpc {
        probe::parse_endpoint(entry).map_err(Fatal::usage)?;
    }
    if !plan
        .backends
        .iter()
        .any(|b| b.argv.iter().any(|a| a == "--rpc"))
    {
        return Err(Fatal::usage(format!(
            "--rpc: the {} route does not run llama.cpp's RPC workers; use --device cpu or --device hrx",
            plan.device
        )));
    }
    let offers = probe::ask_all(&args.rpc).map_err(|e| Fatal {
        code: exit::NO_FIT,
        message: format!(
            "{e}; start it (1bit rpc-worker) or drop it from --rpc; nothing was started"
        ),
    })?;
    Ok(offers)
}
