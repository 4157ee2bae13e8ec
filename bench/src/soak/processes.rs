//! serve's process tree as /proc shows it: its memory, descriptors and threads, its children
//! and descendants, which of them still run.

use super::*;

/// Those of `pids` still alive. A zombie (state `Z`: it has ended, its parent has not reaped
/// it yet; an orphan waits on PID 1, which may never reap it) does not count.
pub(super) fn still_running(pids: Vec<u32>) -> Vec<u32> {
    pids.into_iter()
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // The state follows the command name's closing parenthesis.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            state.is_some_and(|s| s != 'Z')
        })
        .collect()
}

/// A sample of serve's process (its memory, descriptors and threads), at 0 s and without the
/// scraped series.
pub(super) fn sample(pid: u32) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(Sample {
        at_s: 0.0,
        rss_kib: field("VmRSS:")?,
        rss_anon_kib: field("RssAnon:")?,
        rss_file_kib: field("RssFile:")?,
        fds,
        threads: field("Threads:")?,
        tasks: None,
        prompt_cache_kib: None,
    })
}

pub(super) fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            out.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    out
}

pub(super) fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children(p) {
            out.push(c);
            next.push(c);
        }
    }
    out
}
