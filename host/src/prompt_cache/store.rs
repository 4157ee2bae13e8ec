//! The prompt cache's directory: each saved state (`NAME.state`, llama.cpp's sequence-state
//! file as llama-server writes it) beside its description (`NAME.json`: the identity that made
//! it, its tokens, size and CRC-32), the budget and the least recently used order. Files are
//! written as a temporary name and renamed, mode 0600; a description that does not fit its
//! state, or an identity that is not ours, is discarded, never restored. std and serde only;
//! every function blocks (file I/O) and is called on a blocking thread.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::identity::Identity;

/// The description's format; another is discarded as foreign. Format 2 added `exact`.
const FORMAT: u32 = 2;
/// llama.cpp's sequence-state file: `ggsq`, version 4 (include/llama.h).
const SEQ_MAGIC: u32 = 0x6767_7371;
const SEQ_VERSION: u32 = 4;
/// A state with no description younger than this may be another serve's save under way.
const ORPHAN_AGE: Duration = Duration::from_secs(120);

/// Why a file was discarded: the label of `onebit_prompt_cache_discards_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Made by another model file, llama.cpp build or context settings.
    Foreign,
    /// Shorter than its description says.
    Truncated,
    /// Unreadable, a CRC that does not match, or refused by llama-server.
    Corrupt,
}

impl Reason {
    pub const ALL: [Reason; 3] = [Reason::Foreign, Reason::Truncated, Reason::Corrupt];

    pub fn label(self) -> &'static str {
        match self {
            Reason::Foreign => "foreign",
            Reason::Truncated => "truncated",
            Reason::Corrupt => "corrupt",
        }
    }
}

/// A file discarded, and why (the line serve says).
#[derive(Debug)]
pub struct Discarded {
    pub file: PathBuf,
    pub reason: Reason,
    pub why: String,
}

/// One saved state.
#[derive(Clone, Debug)]
pub struct Entry {
    /// The file names' stem.
    pub name: String,
    /// The tokens the state holds, read from the state file itself.
    pub tokens: Vec<i32>,
    /// How many of them hold what a cold prefill of the same tokens computes, bit for bit (a
    /// multiple of the micro-batch; `PromptCache` works it out when it saves): a restore
    /// stops there at the latest.
    pub exact: usize,
    pub bytes: u64,
    crc32: u32,
    used: SystemTime,
}

/// What `NAME.json` says.
#[derive(Serialize, Deserialize)]
struct Description {
    format: u32,
    identity: Identity,
    bytes: u64,
    crc32: u32,
    tokens: Vec<i32>,
    exact: usize,
}

/// A token of a state file changed for one restore, and what it was.
#[derive(Debug)]
pub struct Mark {
    path: PathBuf,
    offset: u64,
    original: [u8; 4],
}

/// What [`Store::admit`] did with a state llama-server saved.
#[derive(Debug, PartialEq, Eq)]
pub enum Admitted {
    /// Kept as this entry; `evicted` entries (least recently used, or now a prefix of it) went.
    Kept { bytes: u64, evicted: usize },
    /// Not kept: shorter than the minimum, already held by an entry, or over the budget alone.
    Dropped(&'static str),
}

/// The directory and what it holds for one identity.
pub struct Store {
    dir: PathBuf,
    budget: u64,
    identity: Identity,
    entries: Vec<Entry>,
}

impl Store {
    /// Read the directory: every description of this identity whose state has its size is an
    /// entry; every other description and state is discarded (removed) and returned, to be
    /// said. Leftover temporary files of a serve no longer running are removed. Then the
    /// budget is applied.
    pub fn open(dir: &Path, budget: u64, identity: Identity) -> (Store, Vec<Discarded>) {
        let mut store = Store {
            dir: dir.to_path_buf(),
            budget,
            identity,
            entries: Vec::new(),
        };
        let mut discarded = Vec::new();
        let Ok(listing) = std::fs::read_dir(dir) else {
            return (store, discarded);
        };
        let mut states = Vec::new();
        for item in listing.flatten() {
            let file_name = item.file_name().to_string_lossy().into_owned();
            let path = item.path();
            if let Some(pid) = temp_owner(&file_name) {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = std::fs::remove_file(&path);
                }
            } else if let Some(name) = file_name.strip_suffix(".json") {
                match store.read_description(name) {
                    Ok(entry) => store.entries.push(entry),
                    Err((reason, why)) => {
                        remove_pair(dir, name);
                        discarded.push(Discarded {
                            file: dir.join(format!("{name}.state")),
                            reason,
                            why,
                        });
                    }
                }
            } else if let Some(name) = file_name.strip_suffix(".state") {
                states.push((name.to_string(), path));
            }
        }
        for (name, path) in states {
            let described = dir.join(format!("{name}.json")).exists();
            let young = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age < ORPHAN_AGE);
            if !described && !young {
                let _ = std::fs::remove_file(&path);
                discarded.push(Discarded {
                    file: path,
                    reason: Reason::Corrupt,
                    why: "it has no description (a save cut off)".to_string(),
                });
            }
        }
        store.evict_to_budget(None);
        (store, discarded)
    }

    fn read_description(&self, name: &str) -> Result<Entry, (Reason, String)> {
        let path = self.dir.join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            (
                Reason::Corrupt,
                format!("its description is unreadable ({e})"),
            )
        })?;
        let d: Description = serde_json::from_str(&text).map_err(|e| {
            (
                Reason::Corrupt,
                format!("its description is not serve's ({e})"),
            )
        })?;
        if d.format != FORMAT {
            return Err((
                Reason::Foreign,
                format!("its description is format {}, not {FORMAT}", d.format),
            ));
        }
        if let Some(why) = self.identity.mismatch(&d.identity) {
            return Err((Reason::Foreign, why));
        }
        let state = self.dir.join(format!("{name}.state"));
        let bytes = match std::fs::metadata(&state) {
            Ok(m) => m.len(),
            Err(e) => return Err((Reason::Truncated, format!("its state file is gone ({e})"))),
        };
        if bytes != d.bytes {
            return Err((
                Reason::Truncated,
                format!(
                    "it has {bytes} bytes, not the {} it was saved with",
                    d.bytes
                ),
            ));
        }
        let used = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH);
        Ok(Entry {
            name: name.to_string(),
            exact: d.exact.min(d.tokens.len()),
            tokens: d.tokens,
            bytes: d.bytes,
            crc32: d.crc32,
            used,
        })
    }

    /// The entry sharing the longest exact prefix with `tokens` (the shared prefix, up to the
    /// entry's `exact`), and the whole shared prefix's length.
    pub fn best(&self, tokens: &[i32]) -> Option<(Entry, usize)> {
        self.entries
            .iter()
            .map(|e| (e, common_prefix(&e.tokens, tokens)))
            .max_by_key(|(e, n)| ((*n).min(e.exact), *n, std::cmp::Reverse(e.tokens.len())))
            .filter(|(_, n)| *n > 0)
            .map(|(e, n)| (e.clone(), n))
    }

    /// The state file llama-server restores `entry` from (its name in the directory).
    pub fn file_name(entry: &Entry) -> String {
        format!("{}.state", entry.name)
    }

    /// Check an entry's state file against its description (size and CRC-32, the whole file
    /// read) before it is restored. On a mismatch the entry is discarded and returned.
    pub fn verify(&mut self, entry: &Entry) -> Result<(), Discarded> {
        let path = self.dir.join(Self::file_name(entry));
        let checked = std::fs::read(&path)
            .map_err(|e| (Reason::Truncated, format!("it cannot be read ({e})")))
            .and_then(|data| {
                if data.len() as u64 != entry.bytes {
                    return Err((
                        Reason::Truncated,
                        format!(
                            "it has {} bytes, not the {} it was saved with",
                            data.len(),
                            entry.bytes
                        ),
                    ));
                }
                if crc32fast::hash(&data) != entry.crc32 {
                    return Err((
                        Reason::Corrupt,
                        "its CRC-32 does not match the one it was saved with".to_string(),
                    ));
                }
                Ok(())
            });
        checked.map_err(|(reason, why)| self.discard(entry, reason, why))
    }

    /// Remove an entry's files (llama-server refused it, or it failed its check).
    pub fn discard(&mut self, entry: &Entry, reason: Reason, why: String) -> Discarded {
        remove_pair(&self.dir, &entry.name);
        self.entries.retain(|e| e.name != entry.name);
        Discarded {
            file: self.dir.join(Self::file_name(entry)),
            reason,
            why,
        }
    }

    /// Make the state file's token list end its match at `k` (a token there that no prompt
    /// has: llama-server then keeps the first `k` cells it restores and prefills the rest),
    /// and return what undoes it ([`unmark`](Self::unmark)). The KV data is untouched; the
    /// CRC-32 was checked before. None when the file cannot be written (a read-only
    /// directory): the whole state is restored then.
    pub fn mark_end(&self, entry: &Entry, k: usize) -> Option<Mark> {
        use std::os::unix::fs::FileExt;
        let original = *entry.tokens.get(k)?;
        let path = self.dir.join(Self::file_name(entry));
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .ok()?;
        let mut head = [0u8; 20];
        file.read_exact_at(&mut head, 0).ok()?;
        let word = |i: usize| {
            u32::from_le_bytes([
                head[i * 4],
                head[i * 4 + 1],
                head[i * 4 + 2],
                head[i * 4 + 3],
            ])
        };
        let packed = word(3) == u32::MAX && word(4) == 1;
        let offset = 12 + 4 * (k as u64 + if packed { 3 } else { 0 });
        let mut at = [0u8; 4];
        file.read_exact_at(&mut at, offset).ok()?;
        if i32::from_le_bytes(at) != original {
            return None;
        }
        let other: i32 = if original == 0 { 1 } else { 0 };
        file.write_all_at(&other.to_le_bytes(), offset).ok()?;
        Some(Mark {
            path,
            offset,
            original: at,
        })
    }

    /// Put back the token [`mark_end`](Self::mark_end) changed.
    pub fn unmark(mark: Mark) {
        use std::os::unix::fs::FileExt;
        if let Ok(file) = std::fs::File::options().write(true).open(&mark.path) {
            let _ = file.write_all_at(&mark.original, mark.offset);
        }
    }

    /// An entry was restored: it is the most recently used (its description's mtime says so
    /// across restarts).
    pub fn touch(&mut self, entry: &Entry) {
        let now = SystemTime::now();
        let path = self.dir.join(format!("{}.json", entry.name));
        if let Ok(file) = std::fs::File::options().append(true).open(&path) {
            let _ = file.set_modified(now);
        }
        if let Some(e) = self.entries.iter_mut().find(|e| e.name == entry.name) {
            e.used = now;
        }
    }

    /// Whether an entry already holds all of `tokens`, at least `exact` of them exactly (a
    /// save would add nothing).
    pub fn holds(&self, tokens: &[i32], exact: usize) -> bool {
        self.entries
            .iter()
            .any(|e| e.tokens.starts_with(tokens) && e.exact >= exact.min(tokens.len()))
    }

    /// A temporary name in the directory for llama-server to save a slot as.
    pub fn temp_name(seq: u64) -> String {
        format!("tmp-{}-{seq}.state", std::process::id())
    }

    /// Take the state llama-server saved as `temp` (a name from [`temp_name`](Self::temp_name)):
    /// its tokens read from the file, made 0600, its description written, both renamed into
    /// place (the description last: a state without one is never restored); entries that are
    /// a prefix of it (and no more exact) and the least recently used beyond the budget
    /// removed. `exact`: how many of its tokens hold what a cold prefill computes; a state
    /// with fewer than `min_tokens` of them could never be restored and is not kept. An I/O
    /// error (a full or read-only disk) is returned, the temporary file removed.
    pub fn admit(
        &mut self,
        temp: &str,
        min_tokens: usize,
        exact: usize,
    ) -> std::io::Result<Admitted> {
        let temp_path = self.dir.join(temp);
        let result = self.admit_file(&temp_path, min_tokens, exact);
        let _ = std::fs::remove_file(&temp_path);
        result
    }

    fn admit_file(
        &mut self,
        temp_path: &Path,
        min_tokens: usize,
        exact: usize,
    ) -> std::io::Result<Admitted> {
        let data = std::fs::read(temp_path)?;
        let tokens = state_tokens(&data).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "llama-server's state file has no token list serve can read",
            )
        })?;
        if tokens.len() < min_tokens {
            return Ok(Admitted::Dropped("shorter than --prompt-cache-min-tokens"));
        }
        let exact = exact.min(tokens.len());
        if exact < min_tokens {
            return Ok(Admitted::Dropped(
                "fewer exact tokens than --prompt-cache-min-tokens",
            ));
        }
        if self.holds(&tokens, exact) {
            return Ok(Admitted::Dropped("already held"));
        }
        let bytes = data.len() as u64;
        if bytes > self.budget {
            return Ok(Admitted::Dropped("larger than the whole budget"));
        }
        let description = Description {
            format: FORMAT,
            identity: self.identity.clone(),
            bytes,
            crc32: crc32fast::hash(&data),
            tokens,
            exact,
        };
        drop(data);
        let name = {
            let text = format!("{}:{:?}", self.identity.key(), description.tokens);
            super::identity::hex(&sha2::Digest::finalize(
                <sha2::Sha256 as sha2::Digest>::new_with_prefix(text.as_bytes()),
            ))[..24]
                .to_string()
        };
        std::fs::set_permissions(temp_path, std::fs::Permissions::from_mode(0o600))?;
        let state = self.dir.join(format!("{name}.state"));
        std::fs::rename(temp_path, &state)?;
        let described = write_atomically(
            &self.dir.join(format!("{name}.json")),
            &self
                .dir
                .join(format!("tmp-{}-{name}.json", std::process::id())),
            serde_json::to_string(&description)
                .unwrap_or_default()
                .as_bytes(),
        );
        if let Err(e) = described {
            let _ = std::fs::remove_file(&state);
            return Err(e);
        }
        let tokens = description.tokens;
        // An entry whose tokens this state extends, no more exactly, holds nothing this one
        // does not.
        let superseded: Vec<String> = self
            .entries
            .iter()
            .filter(|e| e.name != name && tokens.starts_with(&e.tokens) && e.exact <= exact)
            .map(|e| e.name.clone())
            .collect();
        for gone in &superseded {
            remove_pair(&self.dir, gone);
        }
        self.entries
            .retain(|e| e.name != name && !superseded.contains(&e.name));
        let mut evicted = superseded.len();
        self.entries.push(Entry {
            name: name.clone(),
            tokens,
            exact,
            bytes,
            crc32: description.crc32,
            used: SystemTime::now(),
        });
        evicted += self.evict_to_budget(Some(&name));
        Ok(Admitted::Kept { bytes, evicted })
    }

    /// Remove the least recently used entries (but `keep`) until the total is within the
    /// budget; the number removed.
    fn evict_to_budget(&mut self, keep: Option<&str>) -> usize {
        let mut evicted = 0;
        while self.total_bytes() > self.budget {
            let oldest = self
                .entries
                .iter()
                .filter(|e| Some(e.name.as_str()) != keep)
                .min_by_key(|e| e.used)
                .map(|e| e.name.clone());
            let Some(name) = oldest else { break };
            remove_pair(&self.dir, &name);
            self.entries.retain(|e| e.name != name);
            evicted += 1;
        }
        evicted
    }

    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// How many states it holds.
    pub fn count(&self) -> usize {
        self.entries.len()
    }
}

/// How many leading tokens two lists share.
pub fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The tokens a llama.cpp sequence-state file holds: its header's token list, in the server's
/// packed form (`-1, 1, n, ids...`) or plain. None when it is not such a file.
pub fn state_tokens(data: &[u8]) -> Option<Vec<i32>> {
    let word = |i: usize| -> Option<u32> {
        data.get(i * 4..i * 4 + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if word(0)? != SEQ_MAGIC || word(1)? != SEQ_VERSION {
        return None;
    }
    let count = word(2)? as usize;
    let ids: Vec<i32> = (0..count)
        .map(|i| word(3 + i).map(|w| w as i32))
        .collect::<Option<_>>()?;
    if ids.len() >= 3 && ids[0] == -1 && ids[1] == 1 {
        let n = ids[2] as usize;
        return ids.get(3..3 + n).map(<[i32]>::to_vec);
    }
    Some(ids)
}

/// `tmp-PID-...`: a temporary file of the serve with that process id.
fn temp_owner(file_name: &str) -> Option<u32> {
    file_name
        .strip_prefix("tmp-")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

fn remove_pair(dir: &Path, name: &str) {
    let _ = std::fs::remove_file(dir.join(format!("{name}.json")));
    let _ = std::fs::remove_file(dir.join(format!("{name}.state")));
}

/// Write `data` to `temp`, mode 0600, flush it, and rename it to `path`.
fn write_atomically(path: &Path, temp: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(temp)
        .and_then(|mut f| {
            f.write_all(data)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(temp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(temp);
    }
    written
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
