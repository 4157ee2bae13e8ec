//! The programs a plan runs (each backend's `argv[0]`), checked before serve starts them: for
//! a package, a file it carries (recorded executable) or an absolute path on the system the
//! vendor names; in every case a file that exists and is executable.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use onebit_plugin_api::{PackageFacts, Plan};

use super::Report;

/// Report one line per program; whether every program can be started.
pub fn check(plan: &Plan, package: Option<&PackageFacts>, report: &mut Report) -> bool {
    let mut all_good = true;
    for (i, backend) in plan.backends.iter().enumerate() {
        let name = format!("program {i}");
        let Some(program) = backend.argv.first() else {
            report.fail(
                &name,
                format!("backend {i} ({}) has an empty argv", backend.engine),
            );
            all_good = false;
            continue;
        };
        match judge(program, package) {
            Ok(what) => report.ok(&name, format!("{program}: {what}")),
            Err(why) => {
                let line = format!("{program}: {why}");
                // A loose route that names a program on PATH (llama-server, say) is the
                // user's to install: said, not failed.
                if package.is_none() && !Path::new(program).is_absolute() {
                    report.skip(&name, line);
                } else {
                    report.fail(&name, line);
                    all_good = false;
                }
            }
        }
    }
    all_good
}

/// What the program is, or why it cannot be started.
fn judge(program: &str, package: Option<&PackageFacts>) -> Result<String, String> {
    let path = Path::new(program);
    if !path.is_absolute() {
        return Err(
            "not an absolute path; run a file the package carries (its path in `request.package.files`) or name the system program's absolute path"
                .to_string(),
        );
    }
    let carried = package.and_then(|p| {
        p.files
            .iter()
            .find(|f| Path::new(&f.path) == path)
            .map(|f| (p, f))
    });
    let inside = package.is_some_and(|p| path.starts_with(&p.dir));
    if inside && carried.is_none() {
        return Err(format!(
            "inside the package but not one of its carried files; carry it with `1bit plugins package --carry {}=VERSION`",
            path.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        ));
    }
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        _ => e.to_string(),
    })?;
    if !meta.is_file() {
        return Err("not a file".to_string());
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(
            "not executable; give it its executable bit before `1bit plugins package` records it (chmod +x)"
                .to_string(),
        );
    }
    Ok(match carried {
        Some((p, f)) => format!(
            "carried by package {} {} ({} {}), executable",
            p.name, p.version, f.name, f.version
        ),
        None => "a system program, executable".to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::PackageFile;

    #[test]
    fn a_program_must_be_carried_or_absolute_and_executable() {
        let dir = std::env::temp_dir().join(format!("onebit-programs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let engine = dir.join("zeta-engine");
        std::fs::write(&engine, "#!/bin/sh\n").unwrap();
        let stray = dir.join("stray");
        std::fs::write(&stray, "#!/bin/sh\n").unwrap();
        let package = PackageFacts {
            name: "zeta".into(),
            version: "1.0.0".into(),
            dir: dir.to_string_lossy().into_owned(),
            files: vec![PackageFile {
                path: engine.to_string_lossy().into_owned(),
                name: "zeta-engine".into(),
                version: "2.0".into(),
                sha256: String::new(),
            }],
            ..PackageFacts::default()
        };
        let set = |mode| {
            std::fs::set_permissions(&engine, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set(0o644);
        let why = judge(engine.to_str().unwrap(), Some(&package)).unwrap_err();
        assert!(why.starts_with("not executable"), "{why}");
        set(0o755);
        let what = judge(engine.to_str().unwrap(), Some(&package)).unwrap();
        assert!(what.contains("carried by package zeta 1.0.0"), "{what}");
        let why = judge(stray.to_str().unwrap(), Some(&package)).unwrap_err();
        assert!(why.contains("not one of its carried files"), "{why}");
        let why = judge("zeta-engine", Some(&package)).unwrap_err();
        assert!(why.contains("not an absolute path"), "{why}");
        let why = judge("/nonexistent/zeta-engine", Some(&package)).unwrap_err();
        assert_eq!(why, "no such file");
        assert_eq!(
            judge("/bin/sh", Some(&package)).unwrap(),
            "a system program, executable"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
