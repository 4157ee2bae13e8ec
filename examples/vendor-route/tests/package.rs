//! The vendor's path after the build, run as a vendor's CI would: the route and its kernels
//! made into a package with `1bit plugins package`, checked whole with `1bit plugins check`,
//! installed into a scratch prefix, and listed by `1bit plugins` with the library it carries.
//!
//! It runs `1bit`: `$ONEBIT_BIN`, else `1bit` on PATH (`cargo xtask test` sets `ONEBIT_BIN`).

// A test drives the CLI as its user does: through processes it starts and waits for.
#![allow(clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `1bit` to run.
fn onebit() -> PathBuf {
    if let Some(bin) = std::env::var_os("ONEBIT_BIN").filter(|b| !b.is_empty()) {
        return PathBuf::from(bin);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("1bit"))
        .find(|p| p.is_file())
        .expect("this test runs 1bit: put it on PATH, or set ONEBIT_BIN to its path")
}

/// `1bit ARGS` with HOME in `home`: its exit status, stdout, and stderr.
fn run(home: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(onebit())
        .args(args)
        .env("HOME", home)
        .env_remove("XDG_CONFIG_HOME")
        .output()
        .expect("1bit runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn text(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

#[test]
fn the_route_and_its_kernels_package_check_install_and_list() {
    // The route library and the kernels build.rs made lie in the same target folder.
    let kernels = PathBuf::from(env!("ACME_KERNELS_BUILT"));
    let built = kernels.parent().expect("the target folder");
    let route = built.join("libonebit_route_acme.so");
    let work = std::env::temp_dir().join(format!("acme-package-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let carry = format!("{}=1.0.3", text(&kernels));
    let dist = work.join("dist");
    let (code, out, err) = run(
        &work,
        &[
            "plugins",
            "package",
            text(&route),
            "--version",
            "1.2.0",
            "--vendor",
            "Acme NPU Inc.",
            "--license",
            "LicenseRef-Acme-Proprietary",
            "--carry",
            &carry,
            "--out",
            text(&dist),
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let archive = PathBuf::from(out.lines().last().expect("the archive's path"));
    assert_eq!(archive, dist.join("acme-1.2.0.tar.gz"));

    let model = work.join("model.gguf");
    let (code, out, err) = run(&work, &["gguf", "stub", text(&model)]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run(
        &work,
        &["plugins", "check", text(&archive), "-m", text(&model)],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("ok   checksums: 2 files match the manifest"),
        "{out}"
    );
    assert!(out.contains("ok   streamed answer:"), "{out}");

    let prefix = work.join("prefix");
    let (code, out, err) = run(
        &work,
        &[
            "plugins",
            "install",
            text(&archive),
            "--prefix",
            text(&prefix),
            "--allow-unsigned",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let plugins = prefix.join("lib/1bit/plugins");
    let (code, out, err) = run(&work, &["plugins", "--plugin-dir", text(&plugins)]);
    assert_eq!(code, 0, "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("acme "))
        .unwrap_or_else(|| panic!("acme is listed: {out}"));
    assert!(line.contains("package 1.2.0 by Acme NPU Inc."), "{line}");
    assert!(out.contains("carries libacme_kernels.so.1 1.0.3"), "{out}");
    std::fs::remove_dir_all(&work).unwrap();
}
