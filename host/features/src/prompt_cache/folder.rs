//! The prompt cache's folder as several serves share it (one disk for several serves on one
//! box, or NFS for a fleet): who wrote a temporary file and whether it is a leftover, the
//! folder's stamp (what tells a serve, at the cost of one `stat`, that another serve changed
//! it), and the temporary file a task removes whatever ends it. Every function blocks on file
//! I/O but [`TempFile`]'s drop, one `unlink`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

/// A temporary file not written for this long is a leftover whoever wrote it: a save is
/// renamed, a description renamed and a restore's copy removed within seconds of their last
/// write.
const STALE_TEMP: Duration = Duration::from_secs(600);
/// A folder changed this recently may change again within the same tick of its clock (a
/// coarse mtime): it is listed again at the next refresh rather than trusted.
const RACY: Duration = Duration::from_secs(2);

/// This process's writer tag in temporary names: the pid space (8 hex of this boot's id, and
/// the inode of its pid namespace, hex) and the pid. Two serves never share one: not on one
/// box (their pids), not in two containers (their namespaces), not on two machines (their
/// boots), so a serve removes another's leftover only when it can tell that writer is dead.
fn tag() -> &'static (String, u32) {
    // A static because it names this process (its pid, in the pid space of its boot).
    static TAG: OnceLock<(String, u32)> = OnceLock::new();
    TAG.get_or_init(|| (pid_space(std::process::id()), std::process::id()))
}

/// The pid space of a process of this boot (`/proc/<pid>`): `<boot id, 8 hex><pid namespace
/// inode, hex>`, or `0` where `/proc` does not say.
pub fn pid_space(pid: u32) -> String {
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect();
    let namespace = std::fs::read_link(format!("/proc/{pid}/ns/pid"))
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("pid:[")?
                .strip_suffix(']')?
                .parse::<u64>()
                .ok()
        });
    match (boot.len(), namespace) {
        (8, Some(ns)) => format!("{boot}{ns:x}"),
        _ => "0".to_string(),
    }
}

/// A temporary name of this process in the folder: `tmp-<pid space>-<pid>-<rest>`.
pub fn temp_name(rest: &str) -> String {
    let (space, pid) = tag();
    format!("tmp-{space}-{pid}-{rest}")
}

/// Whether the temporary file `name` (a `tmp-` name) is a leftover to remove: its writer is a
/// process of this pid space that is no longer running, or it has not been written for
/// [`STALE_TEMP`] (a writer this serve cannot see: another box, another container, a pid
/// since reused). An older serve's `tmp-<pid>-...` is judged as one of this pid space.
pub fn leftover(name: &str, path: &Path) -> bool {
    let Some(rest) = name.strip_prefix("tmp-") else {
        return false;
    };
    let parts: Vec<&str> = rest.splitn(3, '-').collect();
    let (space, pid) = match parts.as_slice() {
        [space, pid, _] if pid.parse::<u32>().is_ok() => (*space, pid.parse::<u32>().ok()),
        [pid, ..] => (tag().0.as_str(), pid.parse::<u32>().ok()),
        [] => ("", None),
    };
    if space == tag().0
        && let Some(pid) = pid
        && !Path::new(&format!("/proc/{pid}")).exists()
    {
        return true;
    }
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > STALE_TEMP)
}

/// What the folder's own entry says of its contents: its device and inode (a folder removed
/// and made again is another) and its mtime (any file made, renamed or removed in it changes
/// it). Equal stamps: nothing was added or removed since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    mtime: (i64, i64),
}

impl Stamp {
    /// The folder's stamp; an error when it cannot be read or is not a folder any more.
    pub fn of(dir: &Path) -> std::io::Result<Stamp> {
        let m = std::fs::metadata(dir)?;
        if !m.is_dir() {
            return Err(std::io::Error::other("it is not a folder any more"));
        }
        Ok(Stamp {
            dev: m.dev(),
            ino: m.ino(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }

    /// Whether the folder changed so recently (or, its clock ahead of this one, "in the
    /// future") that a change within the same tick would leave its mtime as it is.
    pub fn racy(&self) -> bool {
        let (secs, nanos) = self.mtime;
        let Ok(secs) = u64::try_from(secs) else {
            return true;
        };
        let at = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos.clamp(0, 999_999_999) as u32);
        !at.elapsed().is_ok_and(|age| age >= RACY)
    }
}

/// A temporary file of this serve, removed when the task that made it ends, however it ends:
/// done, failed, or dropped with the runtime at a stop (after the backend stopped, so a save
/// cut by the stop leaves nothing behind).
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
