//! The systemd user unit: the shipped `config/systemd/1bit-serve.service` and the one
//! `cargo xtask install --service` writes pass `systemd-analyze verify` (Debian's `systemd`
//! package, installed with apt when absent); the install writes exactly its two files, a second
//! run updates them in place keeping the user's settings, and `--uninstall-service` removes
//! those two and nothing else.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use onebit_tests::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `systemd-analyze`, installed from Debian's `systemd` package when this machine lacks it.
fn systemd_analyze() -> Command {
    let present = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !present {
        let update = Command::new("apt-get").arg("update").output();
        let install = Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "systemd"])
            .output();
        assert!(
            update.is_ok() && install.as_ref().is_ok_and(|o| o.status.success()),
            "systemd-analyze is missing and `apt-get install systemd` failed: {}",
            install.map(|o| output_text(&o)).unwrap_or_default()
        );
    }
    Command::new("systemd-analyze")
}

/// `systemd-analyze --user verify UNIT` with `home` as the home directory (what `%h`
/// expands to): everything it said, which is nothing for a unit it accepts (it exits 0 even
/// for an unknown key, and says so).
fn verify(unit: &Path, home: &Path) -> (bool, String) {
    let runtime = temp_dir("service-runtime");
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o700)).unwrap();
    let out = systemd_analyze()
        .args(["--user", "verify"])
        .arg(unit)
        .env("HOME", home)
        .env("XDG_RUNTIME_DIR", &runtime)
        .env_remove("XDG_CONFIG_HOME")
        .current_dir(unit.parent().unwrap())
        .output()
        .expect("systemd-analyze runs");
    (out.status.success(), output_text(&out))
}

/// The value of `Key=` in a unit's text.
fn setting<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{key}= missing"))
}

#[test]
fn the_shipped_unit_passes_systemd_analyze_and_gives_serve_time_to_drain() {
    // As shipped, the unit runs ~/.local/bin/1bit: a home where it is.
    let home = temp_dir("service-home");
    let bin = home.join(".local/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let _ = std::fs::remove_file(bin.join("1bit"));
    std::os::unix::fs::symlink(onebit(), bin.join("1bit")).unwrap();
    let unit = root().join("config/systemd/1bit-serve.service");
    let (ok, said) = verify(&unit, &home);
    assert!(ok && said.is_empty(), "systemd-analyze verify: {said}");

    // Without the binary, verify says so: the check above sees the unit's ExecStart.
    let bare = temp_dir("service-home-bare");
    let (_, said) = verify(&unit, &bare);
    assert!(said.contains("not executable"), "{said}");

    let text = std::fs::read_to_string(&unit).unwrap();
    assert_eq!(setting(&text, "Type"), "notify");
    assert_eq!(setting(&text, "KillMode"), "mixed");
    // serve's --drain-s (3 s), each backend's stop grace (30 s) and the connections' last 2 s.
    let stop: f64 = setting(&text, "TimeoutStopSec").parse().unwrap();
    assert!(stop > 3.0 + 30.0 + 2.0, "TimeoutStopSec={stop}");
    let kept: BTreeSet<&str> = setting(&text, "RestartPreventExitStatus")
        .split_whitespace()
        .collect();
    assert_eq!(kept, BTreeSet::from(["2", "3", "5"]));
}

/// `cargo xtask install --debug --prefix PREFIX ARGS…`: its output, after asserting success.
fn xtask_install(prefix: &Path, args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root())
        .args(["run", "-q", "-p", "xtask", "--", "install", "--prefix"])
        .arg(prefix)
        .args(args)
        .output()
        .expect("cargo runs");
    assert!(out.status.success(), "{}", output_text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file and link under `dir`, by its path inside it. An installed route package's store folder
/// (`.1bit-packages/NAME-VERSION-PID-N`, a new one at each install) is named by its package
/// alone (`NAME-VERSION`), so two installs of the same packages give the same tree.
fn tree(dir: &Path) -> BTreeSet<PathBuf> {
    let normal = |path: &Path| -> PathBuf {
        let mut out = PathBuf::new();
        let mut in_store = false;
        for part in path.iter() {
            let part = part.to_string_lossy();
            let name = match part.rsplitn(3, '-').collect::<Vec<_>>().as_slice() {
                [_, _, package] if in_store => (*package).to_string(),
                _ => part.to_string(),
            };
            in_store = part == ".1bit-packages";
            out.push(name);
        }
        out
    };
    let mut out = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                todo.push(path);
            } else {
                out.insert(normal(path.strip_prefix(dir).unwrap()));
            }
        }
    }
    out
}

#[test]
fn install_service_writes_its_two_files_updates_them_in_place_and_uninstall_removes_only_them() {
    let prefix = temp_dir("service-prefix");
    let models = temp_dir("service-model");
    let model = dummy_model(&models, "m.gguf");
    let said = xtask_install(
        &prefix,
        &["--debug", "--service", "--model", model.to_str().unwrap()],
    );
    let units = prefix.join("lib/systemd/user");
    let unit = units.join("1bit-serve.service");
    let env = units.join("1bit-serve.env");
    // It names the two files it wrote, and they are all it wrote there.
    for file in [&unit, &env] {
        assert!(
            said.lines()
                .any(|l| l.trim_start().starts_with(&file.display().to_string())),
            "{} not named:\n{said}",
            file.display()
        );
    }
    assert_eq!(
        tree(&units),
        BTreeSet::from([
            PathBuf::from("1bit-serve.service"),
            PathBuf::from("1bit-serve.env")
        ])
    );
    // The commands that start it, by path since this prefix is not on the manager's path.
    assert!(
        said.contains("  systemctl --user daemon-reload\n"),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "  systemctl --user enable --now {}\n",
            unit.display()
        )),
        "{said}"
    );

    let written = std::fs::read_to_string(&unit).unwrap();
    let one_bit = std::fs::canonicalize(prefix.join("bin/1bit")).unwrap();
    assert!(
        written.contains(&format!(
            "ExecStart={} serve -m ${{ONEBIT_MODEL}} $ONEBIT_SERVE_ARGS\n",
            one_bit.display()
        )),
        "{written}"
    );
    let env_file = std::fs::canonicalize(&env).unwrap();
    assert!(
        written.contains(&format!("EnvironmentFile={}\n", env_file.display())),
        "{written}"
    );
    let settings = std::fs::read_to_string(&env).unwrap();
    let model = std::fs::canonicalize(&model).unwrap();
    assert!(
        settings.contains(&format!("\nONEBIT_MODEL={}\n", model.display())),
        "{settings}"
    );
    let mode = std::fs::metadata(&env).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the environment file may hold a key");
    let (ok, verdict) = verify(&unit, &temp_dir("service-home-installed"));
    assert!(
        ok && verdict.is_empty(),
        "systemd-analyze verify: {verdict}"
    );

    // A second run updates in place: the same files, the unit rewritten, the user's settings
    // kept.
    let installed = tree(&prefix);
    std::fs::write(&unit, "stale").unwrap();
    std::fs::write(&env, format!("{settings}ONEBIT_API_KEY=kept\n")).unwrap();
    xtask_install(&prefix, &["--debug", "--service"]);
    assert_eq!(tree(&prefix), installed);
    assert_eq!(std::fs::read_to_string(&unit).unwrap(), written);
    assert_eq!(
        std::fs::read_to_string(&env).unwrap(),
        format!("{settings}ONEBIT_API_KEY=kept\n")
    );

    // Uninstall removes those two files and nothing else: not the binaries, not a unit it did
    // not write.
    std::fs::write(
        units.join("other.service"),
        "[Service]\nExecStart=/bin/true\n",
    )
    .unwrap();
    let said = xtask_install(&prefix, &["--uninstall-service"]);
    assert!(said.contains(&unit.display().to_string()), "{said}");
    let mut left = installed.clone();
    left.remove(Path::new("lib/systemd/user/1bit-serve.service"));
    left.remove(Path::new("lib/systemd/user/1bit-serve.env"));
    left.insert(PathBuf::from("lib/systemd/user/other.service"));
    assert_eq!(tree(&prefix), left);
}
