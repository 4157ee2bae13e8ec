//! serve's temporary folder (`1bit-serve-PID` in the temporary directory): its name, and the
//! removal of the folders left by a serve that died (a `kill -9` gives serve no time to remove
//! its own; the next serve that starts does, and only when the owner's PID is gone).

use std::path::{Path, PathBuf};

const PREFIX: &str = "1bit-serve-";

/// This serve's folder in `tmp`. Created by `serve.rs` before the backends start and removed by
/// it at exit.
pub fn for_this_serve(tmp: &Path) -> PathBuf {
    tmp.join(format!("{PREFIX}{}", std::process::id()))
}

/// Remove each `1bit-serve-PID` folder in `tmp` whose PID no process has (looked up in
/// `proc`); returns those removed. Blocks on the file system; called once at start, before this
/// serve's own folder exists.
pub fn remove_stale(tmp: &Path, proc: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        if pid == std::process::id()
            || proc.join(pid.to_string()).exists()
            || !entry.file_type().is_ok_and(|t| t.is_dir())
        {
            continue;
        }
        if std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_folders_of_gone_pids_are_removed() {
        let root = std::env::temp_dir().join(format!("onebit-run-dir-test-{}", std::process::id()));
        let (tmp, proc) = (root.join("tmp"), root.join("proc"));
        let _ = std::fs::remove_dir_all(&root);
        for d in [
            "1bit-serve-11",
            "1bit-serve-12/slots",
            "1bit-serve-x",
            "other-13",
        ] {
            std::fs::create_dir_all(tmp.join(d)).unwrap();
        }
        std::fs::write(tmp.join("1bit-serve-14"), "a file, not ours").unwrap();
        std::fs::create_dir_all(proc.join("11")).unwrap();
        let removed = remove_stale(&tmp, &proc);
        assert_eq!(removed, vec![tmp.join("1bit-serve-12")]);
        for kept in ["1bit-serve-11", "1bit-serve-x", "other-13", "1bit-serve-14"] {
            assert!(tmp.join(kept).exists(), "{kept} was kept");
        }
        let _ = std::fs::remove_dir_all(&root);
    }
}
