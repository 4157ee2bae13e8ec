//! Trust that holds at every start, and packages that say where they run (issue 51): with the
//! example vendor route, each refusal serve makes when it loads a package, in one line, while
//! `--device auto` falls back to the public cpu route: a package copied in by hand from an
//! untrusted or missing signer, a distrusted key, an upgrade signed by another key, a package
//! for a CPU feature this machine lacks; what `--allow-unsigned` records; and a loose route file
//! that shadows an installed package, said.

use std::path::Path;
use std::time::Duration;

use onebit_tests::route_packages::{
    Scratch, a_cpu_feature_this_machine_lacks, copy_dir, keygen, listed, package_acme, run, s,
    serve,
};
use onebit_tests::{Serve, vendor_route};

/// `--device acme` refuses with exit 1 and one line holding `says`; `--device auto` falls back
/// to cpu, saying the same line as it skips the package.
fn refused_at_start(home: &Path, model: &Path, dir: &Path, says: &str) {
    let mut refused = serve(home, model, dir, "acme");
    let status = refused
        .wait_exit(Duration::from_secs(20))
        .expect("serve exits");
    let out = refused.output();
    assert_eq!(status.code(), Some(1), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("--device acme: package acme"))
        .unwrap_or_else(|| panic!("the refusal is said: {out}"));
    assert!(line.contains(says), "{line}");
    assert!(
        !out.contains("skipping a route: package acme"),
        "the refusal is said once, not twice: {out}"
    );
    let mut fallback = serve(home, model, dir, "auto");
    fallback.ready();
    let out = fallback.output();
    assert!(out.contains("--device auto chose cpu"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("skipping a route: package acme") && l.contains(says)),
        "{out}"
    );
    fallback.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(fallback.wait_exit(Duration::from_secs(20)).is_some());
}

/// `--device acme` starts and is ready.
fn serves_acme(home: &Path, model: &Path, dir: &Path) {
    let mut served = serve(home, model, dir, "acme");
    served.ready();
    served.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(served.wait_exit(Duration::from_secs(20)).is_some());
}

#[test]
fn a_package_loads_only_while_a_key_the_user_trusts_now_signed_it() {
    let Scratch { work, home, model } = Scratch::new("package-trust");
    let prefix = work.join("prefix");
    let plugins = prefix.join("lib/1bit/plugins");
    let vendor = keygen(&home, &work, "acme");
    let other = keygen(&home, &work, "other");
    for key in ["acme.pub", "other.pub"] {
        let (code, text) = run(&home, &["plugins", "trust", s(&work.join(key))]);
        assert_eq!(code, 0, "{text}");
    }
    let v120 = package_acme(&home, &work.join("v120"), "1.2.0", Some(&vendor), &[]);
    let install = |archive: &Path, extra: &[&str]| {
        let mut args = vec!["plugins", "install", s(archive), "--prefix", s(&prefix)];
        args.extend(extra);
        run(&home, &args)
    };
    let (code, text) = install(&v120, &[]);
    assert_eq!(code, 0, "{text}");
    serves_acme(&home, &model, &plugins);

    // An upgrade signed by another key, trusted or not, is refused: the name is acme's key's.
    let by_other = package_acme(&home, &work.join("v130"), "1.3.0", Some(&other), &[]);
    let (code, text) = install(&by_other, &[]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("but route acme belongs to key") && text.contains("--new-signer"),
        "{text}"
    );
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(
        listed(&home, &plugins, "acme")
            .unwrap()
            .contains("package 1.2.0")
    );

    // The same package copied in by hand: one whose signer is not trusted, one unsigned.
    let stranger = keygen(&home, &work, "stranger");
    let untrusted = package_acme(&home, &work.join("stranger"), "1.2.0", Some(&stranger), &[]);
    let unsigned = package_acme(&home, &work.join("unsigned"), "1.2.0", None, &[]);
    for (archive, says) in [
        (&untrusted, "which is not trusted now"),
        (
            &unsigned,
            "is not signed, and was not installed with --allow-unsigned",
        ),
    ] {
        let by_hand = work.join("by-hand");
        let _ = std::fs::remove_dir_all(&by_hand);
        copy_dir(
            &archive.with_extension("").with_extension(""),
            &by_hand.join("acme"),
        );
        refused_at_start(&home, &model, &by_hand, says);
    }

    // Distrust: the installed package stops at the next start; trust again, it loads.
    let (code, text) = run(&home, &["plugins", "distrust", s(&work.join("acme.pub"))]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("distrusted key ed25519:"), "{text}");
    refused_at_start(&home, &model, &plugins, "which is not trusted now");
    let (code, text) = run(&home, &["plugins", "trust", s(&work.join("acme.pub"))]);
    assert_eq!(code, 0, "{text}");
    serves_acme(&home, &model, &plugins);

    // --new-signer hands the name to the other key.
    let (code, text) = install(&by_other, &["--new-signer"]);
    assert_eq!(code, 0, "{text}");
    serves_acme(&home, &model, &plugins);
    std::fs::remove_dir_all(&work).unwrap();
}

#[test]
fn allowed_unsigned_packages_load_as_recorded_and_a_loose_file_that_shadows_one_is_said() {
    let Scratch { work, home, model } = Scratch::new("package-allowed");
    let prefix = work.join("prefix");
    let plugins = prefix.join("lib/1bit/plugins");
    let unsigned = package_acme(&home, &work.join("unsigned"), "1.2.0", None, &[]);
    let (code, text) = run(
        &home,
        &[
            "plugins",
            "install",
            s(&unsigned),
            "--prefix",
            s(&prefix),
            "--allow-unsigned",
        ],
    );
    assert_eq!(code, 0, "{text}");
    let line = listed(&home, &plugins, "acme").expect("listed");
    assert!(
        line.contains("unsigned (installed with --allow-unsigned)") && line.contains("loaded"),
        "{line}"
    );
    serves_acme(&home, &model, &plugins);
    // `1bit plugins --prefix DIR` lists what was installed there.
    let (code, text) = run(&home, &["plugins", "--prefix", s(&prefix)]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(&format!("acme     {}", plugins.join("acme").display())),
        "{text}"
    );

    // A loose acme route file in a folder searched first: serve uses it and says so.
    let loose = work.join("loose");
    std::fs::create_dir_all(&loose).unwrap();
    let built = vendor_route::built();
    for file in ["libonebit_route_acme.so", "libacme_kernels.so.1"] {
        std::fs::copy(built.join(file), loose.join(file)).unwrap();
    }
    let mut served = Serve::start(
        &[
            "-m",
            s(&model),
            "--device",
            "acme",
            "--plugin-dir",
            s(&loose),
            "--plugin-dir",
            s(&plugins),
        ],
        &[("HOME", s(&home)), ("ONEBIT_TRUST_DIR", "")],
    );
    served.ready();
    let out = served.output();
    let said = out
        .lines()
        .find(|l| l.contains("shadowed: route acme"))
        .unwrap_or_else(|| panic!("the shadowing is said: {out}"));
    assert!(
        said.contains(&format!(
            "is the route file {}",
            loose.join("libonebit_route_acme.so").display()
        )) && said.contains("not the package acme 1.2.0")
            && said.contains("comes first in the search order"),
        "{said}"
    );
    served.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(served.wait_exit(Duration::from_secs(20)).is_some());
    std::fs::remove_dir_all(&work).unwrap();
}

#[test]
fn a_package_for_a_cpu_feature_this_machine_lacks_is_refused_at_install_and_at_start() {
    let Scratch { work, home, model } = Scratch::new("package-platform");
    let lacking = a_cpu_feature_this_machine_lacks();
    let archive = package_acme(
        &home,
        &work.join("dist"),
        "1.2.0",
        None,
        &["--cpu-features", &format!("sse2,{lacking}")],
    );
    let manifest = std::fs::read_to_string(work.join("dist/acme-1.2.0/1bit-package.json")).unwrap();
    assert!(
        manifest.contains("\"arch\": \"x86_64\"") || manifest.contains("\"arch\": \"aarch64\""),
        "{manifest}"
    );
    let says = format!("cannot run here: it needs the CPU feature {lacking}, which this CPU lacks");
    let (code, text) = run(
        &home,
        &[
            "plugins",
            "install",
            s(&archive),
            "--prefix",
            s(&work.join("prefix")),
            "--allow-unsigned",
        ],
    );
    assert_eq!(code, 1, "{text}");
    assert!(text.contains(&says), "{text}");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    // Placed by hand (so install never judged it): refused at start, before it is opened.
    let by_hand = work.join("by-hand");
    copy_dir(&work.join("dist/acme-1.2.0"), &by_hand.join("acme"));
    refused_at_start(&home, &model, &by_hand, &says);
    std::fs::remove_dir_all(&work).unwrap();
}
