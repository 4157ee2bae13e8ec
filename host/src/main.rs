//! `1bit`: serve one local model behind an OpenAI-compatible API.
//!
//! `unsafe` is denied in this crate. Every process serve starts is started by
//! `onebit_process` (the one spawner: parent-death signal, own process group, one
//! stop sequence), whose pre-exec hook is the only unsafe code it needs.
//!
//! The host is six crates, each a folder of `host/` whose dependencies Cargo enforces (bottom
//! up): `onebit-command` (the command line, the model's facts, the lines, the errors) <
//! `onebit-supervision` (the backends' lives, the memory check, RPC workers) < `onebit-metrics`
//! < `onebit-features` (guard, prompt cache, pm, laya) < `onebit-relay` (the accept loop and
//! the request pipeline) < this binary, which wires them: `serve`, `prepare` (the plan made
//! before anything starts), `routes` (finding and loading route files), `packages`,
//! `plugin_check`, `gguf_tool`, `notify` (docs/architecture.md).
#![forbid(unsafe_code)]

mod gguf_tool;
mod notify;
mod packages;
mod plugin_check;
mod ports;
mod prepare;
mod routes;
mod serve;

use onebit_command::{cli, error, llama_server_cli, log};
use onebit_supervision::rpc;

use clap::Parser;

fn main() {
    // Before any thread starts (the heap crate says why).
    onebit_heap::tune();
    let code = run();
    // The one place serve exits, with the code each command decided after stopping what it
    // started; threads still parked on a blocking read or mid-compute in a route's library are
    // not waited for, and no `atexit` handler runs under them (onebit_process::exit says why).
    onebit_process::exit(code);
}

/// The command `argv` names, run: its exit code.
fn run() -> i32 {
    let argv: Vec<String> = std::env::args().collect();
    let cli = if argv
        .first()
        .is_some_and(|a| llama_server_cli::invoked_as_llama_server(a))
    {
        cli::Command::LlamaServer {
            args: argv[1..].to_vec(),
        }
    } else {
        let cli = cli::Cli::parse();
        // Before the subscriber is set up, the error that stopped it is written directly.
        if let Err(line) = log::init(&cli.log) {
            return usage_line(&line);
        }
        cli.command
    };
    match cli {
        cli::Command::Serve(mut args) => {
            args.command_line = argv.iter().skip(2).cloned().collect();
            serve::run(*args)
        }
        cli::Command::LlamaServer { args } => drop_in(&args),
        cli::Command::Plugins(cli::PluginArgs {
            action: Some(action),
            ..
        }) => packages::run(action),
        cli::Command::Plugins(args) => {
            let mut asked = args.plugin_dir.clone();
            asked.extend(args.prefix.as_ref().map(|p| p.join(routes::PREFIX_PLUGINS)));
            let dirs = routes::search_dirs(&asked);
            let found = routes::discover(&dirs);
            print!(
                "{}",
                routes::listing(&found, &routes::other_libraries(&dirs))
            );
            error::exit::OK
        }
        cli::Command::RpcWorker(args) => rpc::worker::run(args),
        cli::Command::Gguf { action } => gguf_tool::run(action),
    }
}

/// A line said before the subscriber is set up (it could not be): written directly, exit 2.
fn usage_line(line: &str) -> i32 {
    let first = line
        .lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("error: ");
    eprintln!("1bit: {first}");
    error::exit::USAGE
}

/// `1bit llama-server ARGS…`: llama-server's arguments, translated, then `1bit serve`.
fn drop_in(args: &[String]) -> i32 {
    // llama-server's command line has no words for serve's lines: the environment says.
    let log = match cli::LogFromEnv::try_parse_from(["1bit"]) {
        Ok(from_env) => from_env.log,
        Err(e) => return usage_line(&e.to_string()),
    };
    if let Err(line) = log::init(&log) {
        return usage_line(&line);
    }
    let translated = match llama_server_cli::translate(args) {
        Ok(t) => t,
        Err(line) => {
            tracing::info!("1bit llama-server: {line}");
            return error::exit::USAGE;
        }
    };
    if translated == ["--version"] {
        // The answer to --version (Lemonade reads it), not a log line: always written.
        eprintln!(
            "version: 1bit {} (llama-server drop-in)",
            env!("CARGO_PKG_VERSION")
        );
        return error::exit::OK;
    }
    let words = ["1bit", "serve"].into_iter().map(String::from);
    match cli::Cli::try_parse_from(words.chain(translated.iter().cloned())) {
        Ok(cli::Cli {
            command: cli::Command::Serve(mut serve_args),
            ..
        }) => {
            serve_args.command_line = translated;
            serve_args.under_lemonade = true;
            serve::run(*serve_args)
        }
        Ok(_) => error::exit::USAGE,
        Err(e) => {
            let text = e.to_string();
            let first = text
                .lines()
                .next()
                .unwrap_or("")
                .trim_start_matches("error: ");
            tracing::info!("1bit llama-server: {first}");
            error::exit::USAGE
        }
    }
}
