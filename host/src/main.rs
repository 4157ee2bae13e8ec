//! `1bit`: serve one local model behind an OpenAI-compatible API.
//!
//! `unsafe` is denied in this crate; the one exception is the pre-exec hook that makes a
//! backend die with serve (`supervisor::die_with_serve`), which has no safe equivalent.
#![deny(unsafe_code)]

mod admission;
mod busy_poll;
mod cli;
mod error;
mod fast_path;
mod guard;
mod metrics;
mod model;
mod proxy;
mod route_calls;
mod routes;
mod rpc;
mod serve;
mod supervisor;
mod watchdog;

use clap::Parser;

fn main() {
    let cli = cli::Cli::parse();
    let code = match cli.command {
        cli::Command::Serve(args) => serve::run(*args),
        cli::Command::Plugins(args) => {
            let found = routes::discover(&routes::search_dirs(&args.plugin_dir));
            print!("{}", routes::listing(&found));
            error::exit::OK
        }
        cli::Command::RpcWorker(args) => rpc::worker::run(args),
    };
    std::process::exit(code);
}
