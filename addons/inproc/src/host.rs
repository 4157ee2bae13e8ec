//! What the machine and this process say of themselves: physical cores (sysfs), memory (/proc).

use std::path::{Path, PathBuf};

use onebit_plugin_api::PlanRequest;

/// llama-server's default thread count: one per physical core (the distinct
/// `thread_siblings` sets under `<sysfs>/devices/system/cpu/cpuN/topology/`, sysfs being
/// `$ONEBIT_SYSFS_ROOT` or `/sys`), so hyperthread siblings do not fight over one core's
/// units; the CPUs serve may use when sysfs does not say. (llama-server also leaves out the
/// efficiency cores of a hybrid Intel CPU, which needs `cpuid` on each core: not done here.)
pub fn default_threads(request: &PlanRequest) -> i32 {
    let sysfs = request
        .env
        .get("ONEBIT_SYSFS_ROOT")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/sys"), PathBuf::from);
    let cpus = sysfs.join("devices/system/cpu");
    let mut cores = std::collections::BTreeSet::new();
    for cpu in 0.. {
        let siblings = cpus.join(format!("cpu{cpu}/topology/thread_siblings"));
        match std::fs::read_to_string(siblings) {
            Ok(text) => {
                cores.insert(text.trim().to_string());
            }
            Err(_) => break,
        }
    }
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    match cores.len() {
        0 => usable as i32,
        n => n.min(usable).max(1) as i32,
    }
}

/// A `/proc/self/status` figure in bytes (`RssAnon:`, say); 0 when /proc cannot say.
pub fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// The resident bytes of the process's mappings of `file` (`/proc/self/smaps`); 0 when /proc
/// cannot say.
pub fn mapped_bytes(file: &Path) -> u64 {
    let file = file.canonicalize().unwrap_or_else(|_| file.to_path_buf());
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let mut inside = false;
    let mut kib = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's first line: range, perms, offset, device, inode, path.
            inside = words.nth(4).is_some_and(|path| Path::new(path) == file);
        } else if inside && first == "Rss:" {
            kib += words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kib * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs with `pairs` cores of two hyperthreads each.
    fn sysfs(name: &str, pairs: usize) -> PathBuf {
        let root = std::env::temp_dir().join(format!("inproc-sysfs-{name}-{}", std::process::id()));
        for cpu in 0..pairs * 2 {
            let topology = root.join(format!("devices/system/cpu/cpu{cpu}/topology"));
            std::fs::create_dir_all(&topology).unwrap();
            // The kernel writes a hex mask; each core's siblings get a mask of their own.
            let mask = format!("{:x}", 3u128 << (2 * (cpu / 2)));
            std::fs::write(topology.join("thread_siblings"), format!("{mask}\n")).unwrap();
        }
        root
    }

    fn request_with(sysfs: &Path) -> PlanRequest {
        PlanRequest {
            env: [("ONEBIT_SYSFS_ROOT".to_string(), sysfs.display().to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn threads_default_to_one_per_physical_core_as_llama_servers_do() {
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get()) as i32;
        // One core of two siblings: one thread, never both hyperthreads.
        assert_eq!(default_threads(&request_with(&sysfs("one", 1))), 1);
        // More cores than serve may use: no more threads than CPUs.
        assert_eq!(
            default_threads(&request_with(&sysfs("many", 60))),
            usable.min(60)
        );
        // No topology to read: the CPUs serve may use.
        assert_eq!(
            default_threads(&request_with(Path::new("/nonexistent"))),
            usable
        );
    }
}
