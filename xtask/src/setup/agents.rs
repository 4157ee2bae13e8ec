//! The coding agents the agents test drives through serve (Claude Code, the Codex CLI): their
//! pinned npm packages installed with npm into `<cache>/<npm.install_dir>` (Node.js and npm
//! from Debian's packages when the machine has none), each checked against its pinned version
//! and the integrity npm recorded for its tarball.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::steps::{Gauge, Step};
use crate::Failure;
use crate::cache::Layout;
use crate::pins::Npm;

/// The folder the packages are installed in.
pub fn dir(layout: &Layout, npm: &Npm) -> PathBuf {
    layout.cache_dir.join(&npm.install_dir)
}

/// Installs the pinned packages unless they are there (a small read then); returns their
/// folder. Blocks on npm (and on apt-get, for Node.js).
pub fn ensure(layout: &Layout, npm: &Npm) -> Result<PathBuf, Failure> {
    let dir = dir(layout, npm);
    let todo = "check that Node.js with npm is installed (apt-get install nodejs npm) and the npm registry is reachable, then rerun `cargo xtask setup`";
    if unmet(&dir, npm).is_none() {
        return Ok(dir);
    }
    if !runs("npm") {
        super::apt_install(layout, "nodejs npm", "Node.js for the coding agents", todo)?;
    }
    super::create_dir_all(&dir)?;
    // A package.json of exact versions: npm installs those and nothing newer.
    let deps: serde_json::Map<String, serde_json::Value> = npm
        .packages
        .iter()
        .map(|p| (p.name.clone(), p.version.clone().into()))
        .collect();
    let manifest = serde_json::json!({"private": true, "dependencies": deps});
    super::write_atomically(
        &dir.join("package.json"),
        &serde_json::to_vec_pretty(&manifest).expect("the manifest serializes"),
    )?;
    let mut install = Command::new("npm");
    install.arg("install").arg("--prefix").arg(&dir).args([
        "--no-audit",
        "--no-fund",
        "--save-exact",
    ]);
    let names: Vec<String> = npm
        .packages
        .iter()
        .map(|p| format!("{}@{}", p.name, p.version))
        .collect();
    Step {
        title: &format!("installing {} with npm", names.join(", ")),
        about: "",
        log: layout.logs_dir().join("npm-agents.log"),
        todo,
        gauge: Gauge::Time,
        tail: 15,
    }
    .run(&mut install)?;
    match unmet(&dir, npm) {
        None => Ok(dir),
        Some(why) => Err(Failure::new(
            format!(
                "npm installed the coding agents into {}, but {why}",
                dir.display()
            ),
            "the registry served something other than what was pinned: do not use it; check the npm entry of third_party/pins.json",
        )),
    }
}

/// The pinned packages and their programs, in words, for setup's last lines.
pub fn versions(npm: &Npm) -> String {
    let names: Vec<String> = npm
        .packages
        .iter()
        .map(|p| format!("{} {}", p.bin, p.version))
        .collect();
    format!("coding agents {} (npm)", names.join(", "))
}

/// Why the folder does not hold the pinned packages (None when it does): a package missing,
/// at another version or with another tarball than pinned, or its program missing.
fn unmet(dir: &Path, npm: &Npm) -> Option<String> {
    let lock = dir.join("node_modules").join(".package-lock.json");
    let Some(lock) = std::fs::read(&lock)
        .ok()
        .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
    else {
        return Some("it has no node_modules/.package-lock.json".to_owned());
    };
    npm.packages.iter().find_map(|pin| {
        let entry = &lock["packages"][format!("node_modules/{}", pin.name)];
        let (version, integrity) = (entry["version"].as_str(), entry["integrity"].as_str());
        if version != Some(pin.version.as_str()) {
            return Some(format!(
                "{} is at {version:?}, not {}",
                pin.name, pin.version
            ));
        }
        if integrity != Some(pin.integrity.as_str()) {
            return Some(format!(
                "{}'s tarball has integrity {integrity:?}, not the pinned one",
                pin.name
            ));
        }
        let program = dir.join("node_modules").join(".bin").join(&pin.bin);
        (!program.exists()).then(|| format!("{} is missing", program.display()))
    })
}

/// Whether `program --version` runs.
fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pins::NpmPackage;

    #[test]
    fn the_lock_file_must_name_each_pinned_version_and_tarball() {
        let dir = std::env::temp_dir().join(format!("onebit-agents-{}", std::process::id()));
        let modules = dir.join("node_modules");
        std::fs::create_dir_all(modules.join(".bin")).unwrap();
        let npm = Npm {
            install_dir: "agents".into(),
            packages: vec![NpmPackage {
                name: "@a/cli".into(),
                version: "1.2.3".into(),
                integrity: "sha512-x".into(),
                bin: "a".into(),
            }],
        };
        assert!(unmet(&dir, &npm).unwrap().contains("no node_modules"));
        let lock = |version: &str, integrity: &str| {
            let text = serde_json::json!({"packages": {"node_modules/@a/cli": {"version": version, "integrity": integrity}}});
            std::fs::write(modules.join(".package-lock.json"), text.to_string()).unwrap();
        };
        lock("1.2.4", "sha512-x");
        assert!(unmet(&dir, &npm).unwrap().contains("not 1.2.3"));
        lock("1.2.3", "sha512-y");
        assert!(unmet(&dir, &npm).unwrap().contains("integrity"));
        lock("1.2.3", "sha512-x");
        assert!(unmet(&dir, &npm).unwrap().contains("is missing"));
        std::fs::write(modules.join(".bin").join("a"), "").unwrap();
        assert_eq!(unmet(&dir, &npm), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
