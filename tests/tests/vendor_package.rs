//! The vendor's path, end to end, with the example route (examples/vendor-route): build its
//! closed kernels and its route, package, sign, trust, install into a prefix, serve with
//! `--device auto` (the package wins); then what a user meets when something is wrong: a
//! changed byte in a carried library, an unsigned package, a truncated archive, a wrong
//! checksum, a newer ABI; and remove.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use onebit_tests::route_packages::{copy_dir, flip_a_byte, listed, package_acme, run, s, serve};
use onebit_tests::{onebit, output_text, post, temp_dir};

fn package(home: &Path, out: &Path, version: &str, key: Option<&Path>) -> PathBuf {
    package_acme(home, out, version, key, &[])
}

#[test]
fn a_vendor_route_is_packaged_signed_installed_served_checked_and_removed() {
    let work = temp_dir("vendor-package");
    let home = work.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let dist = work.join("dist");
    let prefix = work.join("prefix");
    let plugins = prefix.join("lib/1bit/plugins");
    let model = work.join("model.gguf");
    let (code, text) = run(&home, &["gguf", "stub", s(&model), "--arch", "llama"]);
    assert_eq!(code, 0, "{text}");

    // The vendor: a key, a signed package. The user: trusts the key, installs.
    let (code, text) = run(
        &home,
        &[
            "plugins",
            "keygen",
            s(&work.join("acme")),
            "--comment",
            "Acme NPU Inc.",
        ],
    );
    assert_eq!(code, 0, "{text}");
    let key = work.join("acme.key");
    let v120 = package(&home, &dist, "1.2.0", Some(&key));
    assert_eq!(v120, dist.join("acme-1.2.0.tar.gz"));
    let (code, text) = run(
        &home,
        &["plugins", "install", s(&v120), "--prefix", s(&prefix)],
    );
    assert_eq!(code, 1, "an untrusted signer is refused: {text}");
    assert!(text.contains("which you do not trust"), "{text}");
    assert!(
        listed(&home, &plugins, "acme").is_none(),
        "nothing installed"
    );
    let (code, text) = run(&home, &["plugins", "trust", s(&work.join("acme.pub"))]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = run(
        &home,
        &["plugins", "install", s(&v120), "--prefix", s(&prefix)],
    );
    assert_eq!(code, 0, "{text}");
    let line = listed(&home, &plugins, "acme").expect("acme is listed");
    assert!(line.contains("package 1.2.0 by Acme NPU Inc."), "{line}");
    assert!(line.contains("signed by ed25519:"), "{line}");
    let (_, text) = run(&home, &["plugins", "--plugin-dir", s(&plugins)]);
    assert!(
        text.contains("carries libacme_kernels.so.1 1.0.3"),
        "{text}"
    );
    assert!(
        !text.contains("libacme_kernels.so.1  not loaded"),
        "a carried library is no failure: {text}"
    );

    // Bad packages: one line each, nothing installed, 1.2.0 still there.
    let unsigned = package(&home, &work.join("unsigned"), "1.3.0", None);
    let truncated = work.join("truncated.tar.gz");
    let whole = std::fs::read(&unsigned).unwrap();
    std::fs::write(&truncated, &whole[..whole.len() * 2 / 3]).unwrap();
    let wrong_sum = work.join("unsigned/acme-1.3.0");
    let changed = work.join("changed");
    copy_dir(&wrong_sum, &changed);
    flip_a_byte(&changed.join("libacme_kernels.so.1"));
    let newer_abi = work.join("newer-abi");
    copy_dir(&wrong_sum, &newer_abi);
    let manifest = newer_abi.join("1bit-package.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("\"abi\": \"1.8.0\"", "\"abi\": \"1.99.0\""),
    )
    .unwrap();
    for (source, allow, says) in [
        (
            &unsigned,
            false,
            "is not signed; install only what you trust",
        ),
        (&truncated, true, "not a whole package archive"),
        (
            &changed,
            true,
            "libacme_kernels.so.1's sha256 does not match its manifest",
        ),
        (
            &newer_abi,
            true,
            "built against route ABI 1.99.0, but this 1bit has ABI 1.8.0",
        ),
    ] {
        let mut args = vec!["plugins", "install", s(source), "--prefix", s(&prefix)];
        if allow {
            args.push("--allow-unsigned");
        }
        let (code, text) = run(&home, &args);
        assert_eq!(code, 1, "{}: {text}", source.display());
        assert!(text.contains(says), "{}: {text}", source.display());
        assert_eq!(text.trim().lines().count(), 1, "one line: {text}");
        let line = listed(&home, &plugins, "acme").expect("acme is still listed");
        assert!(line.contains("package 1.2.0"), "{line}");
    }

    // Served: --device auto chooses the package, which answers with its kernels.
    let mut served = serve(&home, &model, &plugins, "auto");
    served.ready();
    assert!(
        served.output().contains("--device auto chose acme"),
        "{}",
        served.output()
    );
    let body = r#"{"messages":[{"role":"user","content":"alpha beta gamma"}],"temperature":0}"#;
    let (status, reply) = post(&served.url("/v1/chat/completions"), body);
    assert_eq!(status, 200, "{reply}");
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "gamma beta alpha"
    );
    served.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(served.wait_exit(Duration::from_secs(10)).is_some());

    // The memory check judges the route's own device pool (its NPU's memory, as it reads it).
    let judged = |free: &str| {
        Command::new(onebit())
            .args(["serve", "-m", s(&model), "--device", "acme", "--mem-check"])
            .args(["--plugin-dir", s(&plugins)])
            .env("HOME", &home)
            .env("ACME_DEVICE_FREE_BYTES", free)
            .output()
            .unwrap()
    };
    let full = judged("1000");
    assert_eq!(full.status.code(), Some(3), "{}", output_text(&full));
    assert!(
        output_text(&full).contains("does not fit")
            && output_text(&full).contains("(acme0 0.0 of 4.0 GiB free)"),
        "{}",
        output_text(&full)
    );
    let roomy = judged("3221225472");
    assert_eq!(roomy.status.code(), Some(0), "{}", output_text(&roomy));
    assert!(
        output_text(&roomy).contains("fits: need"),
        "{}",
        output_text(&roomy)
    );

    // A byte of the installed kernels changes: the package claims nothing, auto falls back
    // to the public route with one line, and --device acme refuses with that line.
    let installed_kernels = plugins.join("acme/libacme_kernels.so.1");
    flip_a_byte(&installed_kernels);
    let mut fallback = serve(&home, &model, &plugins, "auto");
    fallback.ready();
    let out = fallback.output();
    assert!(out.contains("--device auto chose cpu"), "{out}");
    let skipped = out
        .lines()
        .find(|l| l.contains("skipping a route: package acme 1.2.0"))
        .unwrap_or_else(|| panic!("the skip is said: {out}"));
    assert!(
        skipped.contains("libacme_kernels.so.1's sha256 does not match its manifest"),
        "{skipped}"
    );
    fallback.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(fallback.wait_exit(Duration::from_secs(10)).is_some());
    let mut refused = serve(&home, &model, &plugins, "acme");
    let status = refused
        .wait_exit(Duration::from_secs(10))
        .expect("serve exits");
    assert_eq!(status.code(), Some(1), "{}", refused.output());
    assert!(
        refused
            .output()
            .contains("--device acme: package acme 1.2.0"),
        "{}",
        refused.output()
    );

    // A newer version replaces it (and so mends it); remove takes it out.
    let v130 = package(&home, &work.join("v130"), "1.3.0", Some(&key));
    let (code, text) = run(
        &home,
        &["plugins", "install", s(&v130), "--prefix", s(&prefix)],
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("replacing 1.2.0"), "{text}");
    assert!(
        listed(&home, &plugins, "acme")
            .unwrap()
            .contains("package 1.3.0")
    );
    let (code, text) = run(
        &home,
        &["plugins", "remove", "acme", "--prefix", s(&prefix)],
    );
    assert_eq!(code, 0, "{text}");
    assert!(
        listed(&home, &plugins, "acme").is_none(),
        "gone from `1bit plugins`"
    );
    let (code, text) = run(
        &home,
        &["plugins", "remove", "acme", "--prefix", s(&prefix)],
    );
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("no package acme is installed"), "{text}");
    std::fs::remove_dir_all(&work).unwrap();
}
