//! What `--laya-model` settles before the daemon starts: the GGUF (the path given, or the one
//! in a Laya folder's `gguf/`), the runtime that runs it (`ONEBIT_LAYA_GGML`, else `laya` on
//! `PATH`), the device and its environment, and the bounds on the daemon's answers.

use std::path::{Path, PathBuf};
use std::time::Duration;

use onebit_command::cli::ServeArgs;
use onebit_command::error::Fatal;

/// The family of questions the router's checkpoint answers.
pub const FAMILY: &str = "typed-decisions";
/// The device the daemon runs on unless `ONEBIT_LAYA_DEVICE` names another.
pub const DEFAULT_DEVICE: &str = "hrx";
/// How long the daemon has to say it is ready (`ONEBIT_LAYA_READY_S`).
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How long the daemon has to answer one question (`ONEBIT_LAYA_ANSWER_MS`): the documented
/// decision is 25 ms on HRX0, and about half a second on a CPU.
const ANSWER_WITHIN: Duration = Duration::from_millis(2000);

/// The HSA runtime the HRX backend loads: the variable, the file and where TheRock puts it
/// (the hrx route's own rule, plugins/hrx: the user's variable, else `--hrx-libhsa`, else the
/// first such file under TheRock's folder, four levels down at most).
const LIBHSA_VAR: &str = "IREE_HAL_AMDGPU_LIBHSA_PATH";
const THEROCK_DIR: &str = "/opt/rocm-therock";

/// The daemon as serve will start it.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// The GGUF the daemon loads.
    pub gguf: PathBuf,
    /// The runtime binary, once found (`runtime`).
    pub runtime: Option<PathBuf>,
    pub device: String,
    /// Variables set for the daemon on top of serve's environment.
    pub env: Vec<(String, String)>,
    pub ready_within: Duration,
    pub answer_within: Duration,
}

impl Setup {
    /// `--laya-model PATH` read and checked, before anything starts: the one-line refusal
    /// (exit 2) when it is neither a GGUF nor a folder holding one. Reads the file's first
    /// bytes and the folder's listing.
    pub fn from_args(args: &ServeArgs, given: &str) -> Result<Setup, Fatal> {
        let gguf = gguf_of(Path::new(given)).map_err(|why| {
            Fatal::usage(format!(
                "--laya-model {given}: {why}; pass the Laya GGUF (typed-decisions) or the Laya folder that holds it in gguf/"
            ))
        })?;
        let env = &args.env;
        let device = env
            .laya_device
            .as_deref()
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .unwrap_or(DEFAULT_DEVICE)
            .to_string();
        let secs = |v: Option<&str>| {
            v.and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e6)
        };
        let ready_within = secs(env.laya_ready_s.as_deref())
            .map(Duration::from_secs_f64)
            .unwrap_or(READY_WITHIN);
        let answer_within = secs(env.laya_answer_ms.as_deref())
            .map(|ms| Duration::from_secs_f64(ms / 1000.0))
            .unwrap_or(ANSWER_WITHIN);
        let libhsa = args.hrx_libhsa.clone();
        let env = device_env(
            &device,
            |k| std::env::var_os(k).is_some(),
            libhsa,
            || llama_server::find_libhsa(Path::new(THEROCK_DIR)),
        );
        Ok(Setup {
            gguf,
            runtime: None,
            device,
            env,
            ready_within,
            answer_within,
        })
    }

    /// The runtime: `ONEBIT_LAYA_GGML` when set, else `laya` on `PATH`. The one-line fault
    /// (exit 1, as for a backend that cannot start) when there is none or it is not an
    /// executable file.
    pub fn find_runtime(&mut self, args: &ServeArgs) -> Result<(), Fatal> {
        let named = args
            .env
            .laya_ggml
            .as_deref()
            .filter(|v| !v.trim().is_empty());
        let found = match named {
            Some(path) => {
                let path = PathBuf::from(path);
                if !path.exists() {
                    return Err(Fatal::backend(format!(
                        "laya: ONEBIT_LAYA_GGML {}: no such file; set it to ggmlc's laya runtime (docs/laya.md)",
                        path.display()
                    )));
                }
                if !is_executable(&path) {
                    return Err(Fatal::backend(format!(
                        "laya: ONEBIT_LAYA_GGML {}: not an executable file; set it to ggmlc's laya runtime (docs/laya.md)",
                        path.display()
                    )));
                }
                path
            }
            None => on_path("laya").ok_or_else(|| {
                Fatal::backend(
                    "laya: --laya-model needs ggmlc's laya runtime, and there is no executable laya on PATH; install it or set ONEBIT_LAYA_GGML to it (docs/laya.md)",
                )
            })?,
        };
        self.runtime = Some(found);
        Ok(())
    }

    /// The daemon's arguments after the program: `daemon <gguf> --family typed-decisions
    /// --device <device>`.
    pub fn argv(&self) -> Vec<String> {
        vec![
            "daemon".to_string(),
            self.gguf.to_string_lossy().into_owned(),
            "--family".to_string(),
            FAMILY.to_string(),
            "--device".to_string(),
            self.device.clone(),
        ]
    }
}

/// The GGUF a `--laya-model` path names: the file itself when it is one, or a folder's
/// `gguf/` GGUF (the typed-decisions one when it holds several, then Q8_0, then by name).
/// Err: why not, for the refusal line.
pub fn gguf_of(path: &Path) -> Result<PathBuf, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it ({e})"))?;
    if meta.is_file() {
        return if is_gguf(path) {
            Ok(path.to_path_buf())
        } else {
            Err("not a GGUF file (it does not start with GGUF)".to_string())
        };
    }
    let folder = path.join("gguf");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&folder)
        .map_err(|_| "a folder without a gguf/ subfolder".to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_gguf(p))
        .collect();
    let rank = |p: &PathBuf| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        (
            !name.contains("typed-decisions") && !name.contains("typed_decisions"),
            !name.contains("q8_0"),
            name,
        )
    };
    found.sort_by_key(rank);
    found
        .into_iter()
        .next()
        .ok_or_else(|| "its gguf/ subfolder holds no GGUF file".to_string())
}

/// Whether the file starts with the GGUF magic.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// The daemon's environment for `device`, as `--device hrx` sets up the HSA runtime: on hrx,
/// `IREE_HAL_AMDGPU_LIBHSA_PATH` unless the user set it, from `--hrx-libhsa`, else the file
/// found under TheRock's folder; nothing on another device.
fn device_env(
    device: &str,
    user_has: impl Fn(&str) -> bool,
    flag: Option<String>,
    found: impl FnOnce() -> Option<PathBuf>,
) -> Vec<(String, String)> {
    if device != "hrx" || user_has(LIBHSA_VAR) {
        return Vec::new();
    }
    flag.or_else(|| found().map(|p| p.to_string_lossy().into_owned()))
        .map(|libhsa| vec![(LIBHSA_VAR.to_string(), libhsa)])
        .unwrap_or_default()
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("onebit-laya-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_gguf_or_a_folder_holding_one_and_nothing_else() {
        let dir = temp("gguf-of");
        let file = dir.join("laya.gguf");
        std::fs::write(&file, b"GGUF\x03\0\0\0").unwrap();
        assert_eq!(gguf_of(&file), Ok(file.clone()));
        let text = dir.join("notes.gguf");
        std::fs::write(&text, b"hello").unwrap();
        assert!(gguf_of(&text).unwrap_err().contains("not a GGUF file"));
        assert!(gguf_of(&dir).unwrap_err().contains("without a gguf/"));
        std::fs::create_dir_all(dir.join("gguf")).unwrap();
        assert!(gguf_of(&dir).unwrap_err().contains("holds no GGUF"));
        for name in [
            "a-english-f16.gguf",
            "laya-typed-decisions-f16.gguf",
            "laya-typed-decisions-Q8_0.gguf",
        ] {
            std::fs::write(dir.join("gguf").join(name), b"GGUF").unwrap();
        }
        assert_eq!(
            gguf_of(&dir).unwrap(),
            dir.join("gguf/laya-typed-decisions-Q8_0.gguf")
        );
        assert!(
            gguf_of(&dir.join("nothing"))
                .unwrap_err()
                .contains("cannot read")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn hrx_gets_the_hsa_runtime_as_the_hrx_route_finds_it() {
        let none = |_: &str| false;
        let found = || Some(PathBuf::from("/opt/rocm-therock/lib/libhsa-runtime64.so.1"));
        assert_eq!(
            device_env("hrx", none, Some("/mine/libhsa.so".into()), found),
            [(LIBHSA_VAR.to_string(), "/mine/libhsa.so".to_string())]
        );
        assert_eq!(
            device_env("hrx", none, None, found),
            [(
                LIBHSA_VAR.to_string(),
                "/opt/rocm-therock/lib/libhsa-runtime64.so.1".to_string()
            )]
        );
        assert!(device_env("hrx", |_| true, Some("/x".into()), found).is_empty());
        assert!(device_env("hrx", none, None, || None).is_empty());
        assert!(device_env("cpu", none, Some("/x".into()), found).is_empty());
    }
}
