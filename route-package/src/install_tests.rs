//! Install and remove: each refusal leaves the installed version as it was.

use super::*;
use crate::check::tests::sample_package;
use crate::keys::SecretKey;
use crate::testing::scratch;

/// A probe that reads the route "library" the samples write (`route VERSION`) as route acme.
fn acme_probe(path: &Path) -> Result<(String, String), String> {
    std::fs::read_to_string(path)
        .map(|_| ("acme".to_string(), "1.8.0".to_string()))
        .map_err(|e| e.to_string())
}

fn installer<'a>(root: &Path, trust: &'a TrustStore, probe: &'a ProbeRoute) -> Install<'a> {
    Install {
        plugins_dir: root.join("prefix/lib/1bit/plugins"),
        trust,
        allow_unsigned: false,
        new_signer: false,
        machine: crate::platform::Machine::this(),
        host_abi: semver::Version::new(1, 8, 0),
        probe_route: probe,
    }
}

fn installed_route(install: &Install) -> String {
    std::fs::read_to_string(install.plugins_dir.join("acme/libonebit_route_acme.so")).unwrap()
}

#[test]
fn a_signed_package_installs_a_newer_one_replaces_it_and_remove_takes_it_out() {
    let root = scratch("install");
    let key = SecretKey::generate().unwrap();
    let (_, public) = key.write_pair(&root.join("acme"), "Acme").unwrap();
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    trust.trust(&public).unwrap();
    let install = installer(&root, &trust, &acme_probe);

    let v1 = sample_package(&root.join("v1"), "1.2.0");
    key.sign_package(&v1, &std::fs::read(v1.join(crate::MANIFEST_FILE)).unwrap())
        .unwrap();
    let done = install.run(&archive::pack(&v1).unwrap()).unwrap();
    assert_eq!(done.replaced, None);
    assert_eq!(installed_route(&install), "route 1.2.0");

    let v2 = sample_package(&root.join("v2"), "1.3.0");
    key.sign_package(&v2, &std::fs::read(v2.join(crate::MANIFEST_FILE)).unwrap())
        .unwrap();
    let done = install.run(&v2).unwrap();
    assert_eq!(done.replaced.as_deref(), Some("1.2.0"));
    assert_eq!(installed_route(&install), "route 1.3.0");
    let store: Vec<_> = std::fs::read_dir(install.plugins_dir.join(STORE))
        .unwrap()
        .collect();
    assert_eq!(store.len(), 1, "the old version's files are gone");

    let why = install.run(&v1).unwrap_err().to_string();
    assert!(why.contains("older than the installed 1.3.0"), "{why}");

    assert_eq!(remove(&install.plugins_dir, "acme").unwrap(), "1.3.0");
    assert!(installed(&install.plugins_dir).is_empty());
    let why = remove(&install.plugins_dir, "acme")
        .unwrap_err()
        .to_string();
    assert!(why.contains("no package acme is installed"), "{why}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn every_refusal_leaves_the_installed_version_serving_and_nothing_half_written() {
    let root = scratch("refusals");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    let mut install = installer(&root, &trust, &acme_probe);
    install.allow_unsigned = true;
    install
        .run(&sample_package(&root.join("v1"), "1.2.0"))
        .unwrap();

    let bad_sha = sample_package(&root.join("sha"), "1.3.0");
    std::fs::write(bad_sha.join("libacme_kernels.so.1"), "kernelz").unwrap();
    let truncated = {
        let whole =
            std::fs::read(archive::pack(&sample_package(&root.join("cut"), "1.3.0")).unwrap())
                .unwrap();
        let path = root.join("cut.tar.gz");
        std::fs::write(&path, &whole[..whole.len() / 2]).unwrap();
        path
    };
    let missing = sample_package(&root.join("missing"), "1.3.0");
    std::fs::remove_file(missing.join("libacme_kernels.so.1")).unwrap();
    let newer_abi = sample_package(&root.join("abi"), "1.3.0");
    let manifest_path = newer_abi.join(crate::MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest_path)
        .unwrap()
        .replace("\"1.8.0\"", "\"1.9.0\"");
    std::fs::write(&manifest_path, text).unwrap();
    let renamed = sample_package(&root.join("renamed"), "1.3.0");

    let cases: Vec<(&Path, &str)> = vec![
        (&bad_sha, "sha256 does not match its manifest"),
        (&truncated, "not a whole package archive"),
        (
            &missing,
            "names libacme_kernels.so.1, which is not in the package",
        ),
        (
            &newer_abi,
            "built against route ABI 1.9.0, but this 1bit has ABI 1.8.0",
        ),
    ];
    for (source, says) in cases {
        let why = install.run(source).unwrap_err().to_string();
        assert!(why.contains(says), "{}: {why}", source.display());
        assert_eq!(installed_route(&install), "route 1.2.0");
    }
    let other_name = |_: &Path| Ok(("acne".to_string(), "1.8.0".to_string()));
    let mut renaming = installer(&root, &trust, &other_name);
    renaming.allow_unsigned = true;
    let why = renaming.run(&renamed).unwrap_err().to_string();
    assert!(why.contains("calls itself acne, not acme"), "{why}");
    assert_eq!(installed_route(&install), "route 1.2.0");

    let store: Vec<_> = std::fs::read_dir(install.plugins_dir.join(STORE))
        .unwrap()
        .collect();
    assert_eq!(store.len(), 1, "no staging left behind: {store:?}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn unsigned_and_untrusted_packages_need_allow_unsigned() {
    let root = scratch("trust");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    let mut install = installer(&root, &trust, &acme_probe);
    let unsigned = sample_package(&root.join("unsigned"), "1.2.0");
    let why = install.run(&unsigned).unwrap_err().to_string();
    assert!(
        why.contains("is not signed") && why.contains("--allow-unsigned"),
        "{why}"
    );

    let stranger = SecretKey::generate().unwrap();
    stranger
        .sign_package(
            &unsigned,
            &std::fs::read(unsigned.join(crate::MANIFEST_FILE)).unwrap(),
        )
        .unwrap();
    let why = install.run(&unsigned).unwrap_err().to_string();
    assert!(why.contains("which you do not trust"), "{why}");
    assert!(installed(&install.plugins_dir).is_empty());

    install.allow_unsigned = true;
    install.run(&unsigned).unwrap();
    assert_eq!(installed_route(&install), "route 1.2.0");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_install_killed_half_way_leaves_leftovers_the_next_install_removes() {
    let root = scratch("killed");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    let mut install = installer(&root, &trust, &acme_probe);
    install.allow_unsigned = true;
    install
        .run(&sample_package(&root.join("v1"), "1.2.0"))
        .unwrap();
    // What a kill between unpacking and the link's rename leaves: a staging folder and a
    // temporary link, named with a process id that no longer runs.
    // No process has an id of pid_max or above.
    let dead: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let store = install.plugins_dir.join(STORE);
    std::fs::create_dir_all(store.join(format!("incoming-{dead}-0/acme-1.3.0"))).unwrap();
    std::os::unix::fs::symlink(
        "nowhere",
        install.plugins_dir.join(format!(".1bit-link-{dead}-0")),
    )
    .unwrap();
    assert_eq!(
        installed_route(&install),
        "route 1.2.0",
        "the old version still serves"
    );
    install
        .run(&sample_package(&root.join("v2"), "1.3.0"))
        .unwrap();
    let left: Vec<_> = std::fs::read_dir(&store).unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(
        !install
            .plugins_dir
            .join(format!(".1bit-link-{dead}-0"))
            .exists()
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// `sample_package` at `version`, signed by `key`.
fn signed_sample(root: &Path, version: &str, key: &SecretKey) -> PathBuf {
    let dir = sample_package(root, version);
    key.sign_package(
        &dir,
        &std::fs::read(dir.join(crate::MANIFEST_FILE)).unwrap(),
    )
    .unwrap();
    dir
}

/// Judge the installed package `acme` as serve does at a start.
fn judged(install: &Install, trust: &TrustStore) -> Result<crate::owners::Trusted, String> {
    let link = install.plugins_dir.join("acme");
    let checked = check(&link.canonicalize().unwrap()).map_err(|e| e.to_string())?;
    crate::owners::judge(&checked, &install.plugins_dir, Some(trust)).map_err(|e| e.to_string())
}

#[test]
fn a_route_name_belongs_to_the_key_that_installed_it_and_trust_is_judged_at_every_start() {
    use crate::owners::Trusted;
    let root = scratch("owners");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    let (vendor, other) = (
        SecretKey::generate().unwrap(),
        SecretKey::generate().unwrap(),
    );
    for (key, name) in [(&vendor, "vendor"), (&other, "other")] {
        let (_, public) = key.write_pair(&root.join(name), name).unwrap();
        trust.trust(&public).unwrap();
    }
    let mut install = installer(&root, &trust, &acme_probe);
    install
        .run(&signed_sample(&root.join("v1"), "1.2.0", &vendor))
        .unwrap();
    let vendor_fp = vendor.public("").fingerprint();
    assert_eq!(
        judged(&install, &trust),
        Ok(Trusted::SignedBy(vendor_fp.clone()))
    );

    // An upgrade signed by another key, even a trusted one, is refused; --new-signer allows it.
    let by_other = signed_sample(&root.join("v2"), "1.3.0", &other);
    let why = install.run(&by_other).unwrap_err().to_string();
    assert!(
        why.contains("but route acme belongs to key ")
            && why.contains(&vendor_fp)
            && why.contains("--new-signer"),
        "{why}"
    );
    assert_eq!(installed_route(&install), "route 1.2.0");
    // A package swapped in by hand under the owned name is refused at the start too.
    let hand = install.plugins_dir.join("acme-by-hand");
    std::fs::create_dir_all(&hand).unwrap();
    for entry in std::fs::read_dir(&by_other).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, hand.join(path.file_name().unwrap())).unwrap();
    }
    let why = crate::owners::judge(&check(&hand).unwrap(), &install.plugins_dir, Some(&trust))
        .unwrap_err()
        .to_string();
    assert!(why.contains("but route acme belongs to key"), "{why}");
    std::fs::remove_dir_all(&hand).unwrap();
    install.new_signer = true;
    install.run(&by_other).unwrap();
    assert_eq!(
        judged(&install, &trust),
        Ok(Trusted::SignedBy(other.public("").fingerprint()))
    );

    // Distrust: the installed package stops loading at the next start, in one line.
    trust
        .distrust(&other.public("").fingerprint())
        .expect("the key was trusted");
    let why = judged(&install, &trust).unwrap_err();
    assert!(
        why.contains("which is not trusted now") && why.contains("`1bit plugins trust"),
        "{why}"
    );
    let why = trust
        .distrust("ed25519:0000000000000000")
        .unwrap_err()
        .to_string();
    assert!(why.contains("is not trusted in"), "{why}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn an_unsigned_package_loads_only_as_installed_with_allow_unsigned() {
    use crate::owners::Trusted;
    let root = scratch("allowed");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    let mut install = installer(&root, &trust, &acme_probe);
    install.allow_unsigned = true;
    install
        .run(&sample_package(&root.join("v1"), "1.2.0"))
        .unwrap();
    assert_eq!(judged(&install, &trust), Ok(Trusted::AllowedUnsigned));
    // Another unsigned package copied by hand over the installed one is not what was allowed.
    let installed_dir = install.plugins_dir.join("acme").canonicalize().unwrap();
    let manifest = installed_dir.join(crate::MANIFEST_FILE);
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace("Acme's NPU", "Acme's NPU, changed")).unwrap();
    let why = judged(&install, &trust).unwrap_err();
    assert!(
        why.contains("is not signed, and was not installed with --allow-unsigned"),
        "{why}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_package_for_a_cpu_this_machine_lacks_is_refused_before_its_library_opens() {
    let root = scratch("platform");
    let trust = TrustStore {
        dir: root.join("trusted"),
    };
    use std::sync::atomic::{AtomicBool, Ordering};
    static OPENED: AtomicBool = AtomicBool::new(false);
    let probe = |p: &Path| {
        OPENED.store(true, Ordering::Relaxed);
        acme_probe(p)
    };
    let mut install = installer(&root, &trust, &probe);
    install.allow_unsigned = true;
    install.machine.cpu_features.clear();
    let dir = sample_package(&root.join("v1"), "1.2.0");
    let manifest_path = dir.join(crate::MANIFEST_FILE);
    let mut manifest = crate::Manifest::parse(&std::fs::read(&manifest_path).unwrap()).unwrap();
    manifest.platform.as_mut().unwrap().cpu_features = vec!["avx512f".into()];
    std::fs::write(&manifest_path, manifest.to_bytes()).unwrap();
    let why = install.run(&dir).unwrap_err().to_string();
    assert!(
        why.contains("cannot run here: it needs the CPU feature avx512f, which this CPU lacks"),
        "{why}"
    );
    assert!(
        !OPENED.load(Ordering::Relaxed),
        "the route library was never opened"
    );
    assert!(installed(&install.plugins_dir).is_empty());
    std::fs::remove_dir_all(&root).unwrap();
}
