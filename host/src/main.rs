//! `1bit`: serve one local model behind an OpenAI-compatible API.
//!
//! `unsafe` is denied in this crate; the one exception is the pre-exec hook that makes a
//! backend die with serve (`backends::supervisor::die_with_serve`), which has no safe equivalent.
//!
//! The source is in rooms, each a folder with its own `//!` paragraph. A room imports only the
//! rooms below it: `serve` > `front` > `relay` > `pm`, `laya` > `metrics` > `backends` > `guard`,
//! `admission`, `settings`, `model`, `routes` > `error`, `cli` (docs/architecture.md).
#![deny(unsafe_code)]

mod admission;
mod backends;
mod cli;
mod error;
mod front;
mod guard;
mod laya;
mod metrics;
mod model;
mod pm;
mod relay;
mod routes;
mod serve;
mod settings;

use clap::Parser;

fn main() {
    let cli = cli::Cli::parse();
    let code = match cli.command {
        cli::Command::Serve(args) => serve::run(*args),
        cli::Command::Plugins(args) => {
            let dirs = routes::search_dirs(&args.plugin_dir);
            let found = routes::discover(&dirs);
            print!(
                "{}",
                routes::listing(&found, &routes::other_libraries(&dirs))
            );
            error::exit::OK
        }
    };
    std::process::exit(code);
}
