//! What the route-package tests share: `1bit` run with a home of the test's own (the trust
//! store, the user's route folder), the example vendor route packaged, a package's listing line,
//! and the changes a tampering user makes.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Serve, fake_backend, onebit, output_text, temp_dir, vendor_route};

/// A package test's scratch: its folder, a home in it (the trust store, the user's route
/// folder), and a header-only llama GGUF to serve.
pub struct Scratch {
    pub work: PathBuf,
    pub home: PathBuf,
    pub model: PathBuf,
}

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let work = temp_dir(name);
        let home = work.join("home");
        std::fs::create_dir_all(&home).unwrap();
        let model = work.join("model.gguf");
        let (code, text) = run(&home, &["gguf", "stub", s(&model), "--arch", "llama"]);
        assert_eq!(code, 0, "{text}");
        Scratch { work, home, model }
    }
}

/// `1bit serve -m MODEL --device DEVICE --plugin-dir DIR` with HOME in `home` (the trust
/// store) and the fake backend as the cpu route's llama-server.
pub fn serve(home: &Path, model: &Path, dir: &Path, device: &str) -> Serve {
    Serve::start(
        &[
            "-m",
            s(model),
            "--device",
            device,
            "--plugin-dir",
            s(dir),
            "--llama-server",
            s(&fake_backend()),
        ],
        &[("HOME", s(home)), ("ONEBIT_TRUST_DIR", "")],
    )
}

/// `1bit ARGS` with HOME (the trust store, the user's route folder) in `home`: exit code
/// and everything it printed.
pub fn run(home: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(onebit())
        .args(args)
        .env("HOME", home)
        .env_remove("XDG_CONFIG_HOME")
        .env_remove("ONEBIT_TRUST_DIR")
        .env_remove("ONEBIT_PLUGIN_PATH")
        .output()
        .expect("1bit runs");
    (out.status.code().unwrap_or(-1), output_text(&out))
}

/// A path as `&str`, for argv.
pub fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `1bit plugins package` of the built example vendor route (acme) at `version`, signed with
/// `key` when given, with `extra` flags: the archive's path (the command's last line).
pub fn package_acme(
    home: &Path,
    out: &Path,
    version: &str,
    key: Option<&Path>,
    extra: &[&str],
) -> PathBuf {
    let built = vendor_route::built();
    let route = built.join("libonebit_route_acme.so");
    let kernels = format!("{}=1.0.3", s(&built.join("libacme_kernels.so.1")));
    let mut args = vec![
        "plugins",
        "package",
        s(&route),
        "--version",
        version,
        "--vendor",
        "Acme NPU Inc.",
        "--license",
        "LicenseRef-Acme-Proprietary",
        "--carry",
        &kernels,
        "--out",
        s(out),
    ];
    if let Some(key) = key {
        args.extend(["--sign", s(key)]);
    }
    args.extend(extra);
    let (code, text) = run(home, &args);
    assert_eq!(code, 0, "{text}");
    PathBuf::from(text.lines().last().expect("the archive's path").trim())
}

/// `1bit plugins keygen DIR/NAME`: the secret key's path (`.pub` beside it).
pub fn keygen(home: &Path, dir: &Path, name: &str) -> PathBuf {
    let (code, text) = run(
        home,
        &["plugins", "keygen", s(&dir.join(name)), "--comment", name],
    );
    assert_eq!(code, 0, "{text}");
    dir.join(format!("{name}.key"))
}

/// One line of `1bit plugins` for the route folder `dir`, for route `name`.
pub fn listed(home: &Path, dir: &Path, name: &str) -> Option<String> {
    let (code, text) = run(home, &["plugins", "--plugin-dir", s(dir)]);
    assert_eq!(code, 0, "{text}");
    text.lines()
        .find(|l| l.starts_with(&format!("{name:<8} {}", dir.display())))
        .map(str::to_string)
}

/// Copy the files of the package folder `from` into `to` (made), modes kept.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

/// Change one byte in the middle of `file`, written as a new file of the same mode renamed over
/// it (a serve that mapped the old one keeps its pages).
pub fn flip_a_byte(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    let fresh = file.with_extension("flipped");
    std::fs::write(&fresh, &bytes).unwrap();
    let mode = std::fs::metadata(file).unwrap().permissions();
    std::fs::set_permissions(&fresh, mode).unwrap();
    std::fs::rename(&fresh, file).unwrap();
}

/// A CPU feature name this machine's `/proc/cpuinfo` does not list (one of newer CPUs').
pub fn a_cpu_feature_this_machine_lacks() -> &'static str {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags") || l.starts_with("Features"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.split_whitespace().collect())
        .unwrap_or_default();
    [
        "avx10_2",
        "amx_fp8",
        "amx_complex",
        "avx512_fp16",
        "sme2",
        "zz_never_a_feature",
    ]
    .into_iter()
    .find(|f| !flags.contains(f))
    .expect("one of them is missing")
}
