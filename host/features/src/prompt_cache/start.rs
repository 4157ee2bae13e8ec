//! What serve's start settles for the prompt cache: its flags checked, whether the plan can
//! have one (a llama-server backend 0 the chat rule relays to), its directory made, and
//! `--slot-save-path` given to that backend. Called by `prepare`, before anything starts.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use onebit_plugin_api::{Action, Plan};
use sha2::{Digest, Sha256};

use super::Setup;
use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;

/// The backend engine the cache knows how to save and restore.
const LLAMA_SERVER: &str = "llama-server";

/// The flags' own checks, each a one-line usage error (exit 2).
pub fn checked(args: &ServeArgs) -> Result<(), Fatal> {
    if args.no_prompt_cache && args.prompt_cache_dir.is_some() {
        return Err(Fatal::usage(
            "--prompt-cache-dir and --no-prompt-cache ask for opposite things; pass one of them",
        ));
    }
    let gib = args.prompt_cache_gib;
    if !(gib.is_finite() && gib > 0.0 && gib <= 1e6) {
        return Err(Fatal::usage(format!(
            "--prompt-cache-gib {gib}: not a positive number of GiB; pass one such as 8, or --no-prompt-cache to keep no cache"
        )));
    }
    if args.prompt_cache_min_tokens == 0 {
        return Err(Fatal::usage(
            "--prompt-cache-min-tokens 0: a state needs at least one token; pass one such as 1024",
        ));
    }
    if let Some(dir) = &args.prompt_cache_dir {
        if dir.as_os_str().is_empty() {
            return Err(Fatal::usage(
                "--prompt-cache-dir is empty; name a directory (it is made if absent), or pass --no-prompt-cache",
            ));
        }
        if dir.exists() && !dir.is_dir() {
            return Err(Fatal::usage(format!(
                "--prompt-cache-dir {}: that is a file, not a directory; name a directory (it is made if absent)",
                dir.display()
            )));
        }
        if args.precise {
            return Err(Fatal::usage(
                "--prompt-cache-dir with --precise: --precise prefills every prompt whole and restores nothing; remove one of them",
            ));
        }
    }
    Ok(())
}

/// The cache this serve runs, if any: off with `--no-prompt-cache` or `--precise`, and on a
/// plan it cannot serve (said as a usage error when `--prompt-cache-dir` asked for it). Makes
/// the directory (0700) and gives backend 0 `--slot-save-path`. A directory that cannot be
/// made says one line and leaves the cache off; serving goes on.
pub fn setup(args: &ServeArgs, plan: &mut Plan) -> Result<Option<Setup>, Fatal> {
    if args.no_prompt_cache || args.precise || args.env.precise() {
        return Ok(None);
    }
    let asked = args.prompt_cache_dir.is_some();
    if let Some(why) = unfit(args, plan) {
        return if asked {
            Err(Fatal::usage(format!(
                "--prompt-cache-dir: {why}; remove --prompt-cache-dir"
            )))
        } else {
            Ok(None)
        };
    }
    let dir = match &args.prompt_cache_dir {
        Some(dir) => dir.clone(),
        None => match onebit_metrics::state_dir() {
            Some(state) => state.join("prompt-cache").join(model_folder(args.model())),
            None => return Ok(None),
        },
    };
    if let Err(e) = make_dir(&dir) {
        tracing::warn!(
            "1bit serve: prompt cache off: cannot make {} ({e}); serving continues",
            dir.display()
        );
        return Ok(None);
    }
    let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
    // Before the user's own llama-server arguments, which stay last (Lemonade's, as it gave
    // them; a later flag of theirs wins).
    let backend = &mut plan.backends[0];
    let user = &args.backend_args;
    let at = if backend.argv.ends_with(user) {
        backend.argv.len() - user.len()
    } else {
        backend.argv.len()
    };
    backend.argv.splice(
        at..at,
        [
            "--slot-save-path".to_string(),
            dir.to_string_lossy().into_owned(),
        ],
    );
    Ok(Some(Setup {
        dir,
        budget_bytes: (args.prompt_cache_gib * (1u64 << 30) as f64) as u64,
        min_tokens: args.prompt_cache_min_tokens as usize,
        ubatch: flag_value(&backend.argv, &["-ub", "--ubatch-size"]).unwrap_or(512),
        model: args.model().to_path_buf(),
        argv: backend.argv.clone(),
    }))
}

/// The last value of a numeric flag on a command line (`-ub 256`, `--ubatch-size=256`).
pub(super) fn flag_value(argv: &[String], names: &[&str]) -> Option<usize> {
    let mut value = None;
    for (i, arg) in argv.iter().enumerate() {
        for name in names {
            if arg == name {
                value = argv.get(i + 1).and_then(|v| v.parse().ok());
            } else if let Some(v) = arg.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
                value = v.parse().ok();
            }
        }
    }
    value
}

/// Why this serve cannot keep a prompt cache, or None when it can.
fn unfit(args: &ServeArgs, plan: &Plan) -> Option<String> {
    if args.llama_router {
        return Some(
            "router mode (no -m) loads models on demand; the cache needs one model".into(),
        );
    }
    if args.laya {
        return Some(
            "--laya moves conversations between devices; the cache keeps one backend's states"
                .into(),
        );
    }
    let Some(backend) = plan.backends.first() else {
        return Some(format!("the {} route runs no backend", plan.device));
    };
    if backend.engine != LLAMA_SERVER {
        return Some(format!(
            "the {} route runs {}, not llama-server",
            plan.device, backend.engine
        ));
    }
    if plan.serialize_forwards || backend.argv.iter().any(|a| a == "--slot-save-path") {
        return Some(format!(
            "the {} route restores its own states into its slots",
            plan.device
        ));
    }
    let relays_chats = plan.rules.iter().any(|r| {
        r.path == "/v1/chat/completions" && matches!(r.action, Action::Proxy { backend: 0 })
    });
    if !relays_chats {
        return Some(format!(
            "the {} route does not relay chats to its llama-server",
            plan.device
        ));
    }
    None
}

/// The default directory's folder for a model: its file stem and a hash of its path, so two
/// models (or two files of one name) never share states.
fn model_folder(model: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
    let stem = canonical
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let hash = super::identity::hex(&Sha256::digest(canonical.to_string_lossy().as_bytes()));
    PathBuf::from(format!("{stem}-{}", &hash[..12]))
}

/// Make the directory (and its parents); a directory serve made is 0700.
fn make_dir(dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}
