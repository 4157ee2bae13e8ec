//! The processes a test looks at, from /proc: a process's children and descendants, whether
//! it is alive, its command line and run folder, that `kill -9` of serve leaves none, and the
//! connections to a port.

use std::path::PathBuf;
use std::time::Duration;

use crate::{Serve, dummy_model, temp_dir, wait_until};

/// The direct children of `pid`, from /proc.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    out
}

/// Whether `pid` is a live process (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("X");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Every process below `pid` (its children, theirs, and so on), from /proc.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for child in children_of(p) {
            out.push(child);
            next.push(child);
        }
    }
    out
}

/// A process's command line, for a failure's message.
pub fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// serve's temporary folder (`1bit-serve-PID` in the temporary directory).
pub fn run_dir_of(pid: u32) -> PathBuf {
    std::env::temp_dir().join(format!("1bit-serve-{pid}"))
}

/// `kill -9` of `serve` with everything below it recorded first; then: no process of that tree
/// is alive 2 s later, and the next serve that starts removes the dead one's temporary folder.
/// Panics with the survivors' command lines, or the folder, otherwise.
pub fn kill9_leaves_nothing(mut serve: Serve) {
    let tree = descendants(serve.pid());
    let run_dir = run_dir_of(serve.pid());
    assert!(run_dir.is_dir(), "serve made no {}", run_dir.display());
    serve.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = serve.wait_exit(Duration::from_secs(2));
    let gone = wait_until(Duration::from_secs(2), || tree.iter().all(|p| !alive(*p)));
    let left: Vec<String> = tree
        .iter()
        .filter(|p| alive(**p))
        .map(|p| format!("{p}: {}", cmdline(*p)))
        .collect();
    for p in tree.iter().filter(|p| alive(**p)) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*p as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(
        gone,
        "alive 2 s after kill -9 of serve:\n{}",
        left.join("\n")
    );
    let dir = temp_dir("next-serve");
    let model = dummy_model(&dir, "next.gguf");
    let next = Serve::with_fake(&model, &[], &[]);
    next.ready();
    assert!(
        !run_dir.exists(),
        "the next serve left {} in place:\n{}",
        run_dir.display(),
        next.output()
    );
}

/// Established TCP connections on this machine whose remote end is 127.0.0.1:`port`.
pub fn connections_to(port: u16) -> usize {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return 0;
    };
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            cols.len() > 3 && cols[2] == remote && cols[3] == "01"
        })
        .count()
}
