//! What crossed a worker's link, by RPC command: the relay counts each request (command, size
//! and payload) and each answer (size and payload), and `1bit rpc-worker --traffic FILE`
//! writes the counts as JSON, a few times a second while they change and at exit. A
//! benchmark reads the file around a request to learn what each token costs the link
//! (docs/rpc.md, What a link costs).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// ggml-rpc.cpp's `enum rpc_cmd` of the pinned build, by value (RPC_CMD_NONE and past it are
/// never sent).
pub const COMMANDS: [&str; 18] = [
    "ALLOC_BUFFER",
    "GET_ALIGNMENT",
    "GET_MAX_SIZE",
    "BUFFER_GET_BASE",
    "FREE_BUFFER",
    "BUFFER_CLEAR",
    "SET_TENSOR",
    "SET_TENSOR_HASH",
    "GET_TENSOR",
    "COPY_TENSOR",
    "GRAPH_COMPUTE",
    "GET_DEVICE_MEMORY",
    "INIT_TENSOR",
    "GET_ALLOC_SIZE",
    "HELLO",
    "DEVICE_COUNT",
    "GRAPH_RECOMPUTE",
    "MEMSET_TENSOR",
];

/// How often the file is rewritten while the counts change.
const EVERY: Duration = Duration::from_millis(200);

/// One command's counts.
#[derive(Default)]
struct Count {
    requests: AtomicU64,
    request_bytes: AtomicU64,
    answers: AtomicU64,
    answer_bytes: AtomicU64,
}

/// The counts of one worker's relay, by command (one more slot for a command the pinned
/// build does not have). Shared by the relay's threads; lock free.
#[derive(Default)]
pub struct Traffic {
    by_command: [Count; COMMANDS.len() + 1],
}

impl Traffic {
    fn slot(&self, cmd: u8) -> &Count {
        let i = (cmd as usize).min(COMMANDS.len());
        &self.by_command[i]
    }

    /// A request passed to the worker: `bytes` with its 9-byte head.
    pub fn request(&self, cmd: u8, bytes: u64) {
        let c = self.slot(cmd);
        c.requests.fetch_add(1, Ordering::Relaxed);
        c.request_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// An answer passed back: `bytes` with its 8-byte size.
    pub fn answer(&self, cmd: u8, bytes: u64) {
        let c = self.slot(cmd);
        c.answers.fetch_add(1, Ordering::Relaxed);
        c.answer_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The counts as JSON: totals (`requests`, `round_trips`: the requests the client waits
    /// an answer for, `bytes_up`, `bytes_down`) and, for each command seen, its own four.
    pub fn to_json(&self) -> serde_json::Value {
        let mut commands = serde_json::Map::new();
        let (mut requests, mut answers, mut up, mut down) = (0, 0, 0, 0);
        for (i, c) in self.by_command.iter().enumerate() {
            let n = c.requests.load(Ordering::Relaxed);
            let a = c.answers.load(Ordering::Relaxed);
            if n == 0 && a == 0 {
                continue;
            }
            let (rb, ab) = (
                c.request_bytes.load(Ordering::Relaxed),
                c.answer_bytes.load(Ordering::Relaxed),
            );
            requests += n;
            answers += a;
            up += rb;
            down += ab;
            let name = COMMANDS.get(i).copied().unwrap_or("OTHER");
            commands.insert(
                name.to_string(),
                serde_json::json!({
                    "requests": n,
                    "request_bytes": rb,
                    "answers": a,
                    "answer_bytes": ab,
                }),
            );
        }
        serde_json::json!({
            "requests": requests,
            "round_trips": answers,
            "bytes_up": up,
            "bytes_down": down,
            "commands": commands,
        })
    }

    /// Write the counts to `path` now: a temporary file beside it, renamed over it, so a
    /// reader never sees half a file.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = tmp_path(path);
        std::fs::write(&tmp, format!("{:#}\n", self.to_json()))?;
        std::fs::rename(&tmp, path)
    }

    fn total_messages(&self) -> u64 {
        self.by_command
            .iter()
            .map(|c| c.requests.load(Ordering::Relaxed) + c.answers.load(Ordering::Relaxed))
            .sum()
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Write `traffic` to `path` at once (so the file exists from the start), then every
/// [`EVERY`] while it changes, on a thread of its own for as long as the process lives. A
/// write that fails says one line, once.
pub fn keep_written(traffic: std::sync::Arc<Traffic>, path: PathBuf) -> std::io::Result<()> {
    traffic.write(&path)?;
    std::thread::Builder::new()
        .name("rpc-traffic".into())
        .spawn(move || {
            let mut last = traffic.total_messages();
            let mut warned = false;
            loop {
                std::thread::sleep(EVERY);
                let now = traffic.total_messages();
                if now == last {
                    continue;
                }
                last = now;
                if let Err(e) = traffic.write(&path)
                    && !warned
                {
                    warned = true;
                    tracing::warn!(
                        "1bit rpc-worker: cannot write --traffic {} ({e}); the counts go on",
                        path.display()
                    );
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_by_command_and_in_total() {
        let t = Traffic::default();
        t.request(10, 9 + 1000); // GRAPH_COMPUTE, not answered
        t.request(8, 9 + 40); // GET_TENSOR, answered
        t.answer(8, 8 + 2048);
        t.request(8, 9 + 40);
        t.answer(8, 8 + 2048);
        t.request(200, 9); // a command the pinned build lacks
        let j = t.to_json();
        assert_eq!(j["requests"], 4);
        assert_eq!(j["round_trips"], 2);
        assert_eq!(j["bytes_up"], 1009 + 49 + 49 + 9);
        assert_eq!(j["bytes_down"], 2 * 2056);
        assert_eq!(j["commands"]["GET_TENSOR"]["answers"], 2);
        assert_eq!(j["commands"]["GRAPH_COMPUTE"]["request_bytes"], 1009);
        assert_eq!(j["commands"]["OTHER"]["requests"], 1);
        assert!(
            j["commands"].get("HELLO").is_none(),
            "unseen commands left out"
        );
    }

    #[test]
    fn the_file_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("onebit-traffic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        let t = Traffic::default();
        t.request(14, 9 + 8);
        t.write(&path).unwrap();
        let read: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(read["commands"]["HELLO"]["requests"], 1);
        assert!(!tmp_path(&path).exists(), "no temporary file left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
