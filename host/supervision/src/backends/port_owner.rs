//! Who listens on a backend's port: the listening socket's owner, read from /proc, so serve
//! becomes ready only against the backend it started and never relays clients to an impostor.
//!
//! A socket listening on the port (the kernel's TCP table, state LISTEN) belongs to the backend
//! when one of the backend's processes holds it as an open file (`/proc/<pid>/fd/*` →
//! `socket:[inode]`). The backend's processes are its pid and every descendant, so a wrapper
//! script that starts the engine as its child passes; a process that merely shares the port (or
//! was detached from the backend and re-parented elsewhere) does not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use super::tcp_table;

/// What holds the port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listener {
    /// The backend (its pid or a descendant) holds a listening socket on the port.
    Backend,
    /// Only other processes do; the first one found, when it could be seen (pid, command name).
    Other(Option<(u32, String)>),
    /// Nothing could be judged (no /proc, no LISTEN entry for the port): not refused, since
    /// serve cannot tell.
    Unknown,
}

/// Judge who listens on loopback/any-address `port`, for a backend whose process is `pid`.
///
/// Called by serve's supervisor once the backend answers its health route, before serve says
/// ready (and wherever a backend is started again). Blocks on reading /proc: a few hundred small
/// files, a millisecond or two; call it where that is fine (it runs once per start).
pub fn listener(proc_root: &Path, port: u16, pid: u32) -> Listener {
    let inodes = tcp_table::listening_inodes(proc_root, port);
    if inodes.is_empty() {
        return Listener::Unknown;
    }
    let pids = all_pids(proc_root);
    let family = descendants(proc_root, &pids, pid);
    if family.iter().any(|p| holds_any(proc_root, *p, &inodes)) {
        return Listener::Backend;
    }
    let owner = pids
        .iter()
        .copied()
        .find(|p| !family.contains(p) && holds_any(proc_root, *p, &inodes))
        .map(|p| (p, command_name(proc_root, p)));
    Listener::Other(owner)
}

/// The line serve exits 1 with when another process answers on the backend's port. It ends in
/// the original's words, "not from the backend serve started".
pub fn impostor_line(engine: &str, port: u16, owner: &Option<(u32, String)>) -> String {
    let who = match owner {
        Some((pid, name)) if !name.is_empty() => format!("another process ({name}, pid {pid})"),
        Some((pid, _)) => format!("another process (pid {pid})"),
        None => "another process".to_string(),
    };
    format!(
        "port {port}, which serve gave its {engine}, is held by {who}: the answers there are not from the backend serve started"
    )
}

fn all_pids(proc_root: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// `pid` and every process descended from it, from each process's parent in `/proc/<p>/stat`.
fn descendants(proc_root: &Path, pids: &[u32], pid: u32) -> BTreeSet<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &p in pids {
        if let Some(parent) = parent_of(proc_root, p) {
            children.entry(parent).or_default().push(p);
        }
    }
    let mut family = BTreeSet::from([pid]);
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
            if family.insert(c) {
                todo.push(c);
            }
        }
    }
    family
}

fn parent_of(proc_root: &Path, pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn holds_any(proc_root: &Path, pid: u32, inodes: &BTreeSet<u64>) -> bool {
    let Ok(fds) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .ok()
            .and_then(|target| {
                let target = target.to_str()?;
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse::<u64>()
                    .ok()
            })
            .is_some_and(|inode| inodes.contains(&inode))
    })
}

fn command_name(proc_root: &Path, pid: u32) -> String {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::process::Command;

    #[test]
    // A bare child stands in for a backend: this test reads /proc, it starts nothing for serve.
    #[allow(clippy::disallowed_methods)]
    fn a_listener_of_this_process_is_its_own_and_not_a_childs() {
        let proc_root = Path::new("/proc");
        let socket = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let me = std::process::id();
        assert_eq!(listener(proc_root, port, me), Listener::Backend);
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        match listener(proc_root, port, child.id()) {
            Listener::Other(Some((pid, _))) => assert_eq!(pid, me),
            other => panic!("{other:?}"),
        }
        let _ = child.kill();
        let _ = child.wait();
        drop(socket);
        assert_eq!(listener(proc_root, port, me), Listener::Unknown);
    }

    #[test]
    fn the_line_ends_in_the_originals_words() {
        let line = impostor_line("llama-server", 4242, &Some((7, "python3".into())));
        assert!(line.starts_with("port 4242, which serve gave its llama-server, is held by another process (python3, pid 7)"));
        assert!(
            line.ends_with("not from the backend serve started"),
            "{line}"
        );
    }
}
