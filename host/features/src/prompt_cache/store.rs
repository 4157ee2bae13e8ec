//! The prompt cache's folder: each saved state (`NAME.state`, llama.cpp's sequence-state
//! file as llama-server writes it) beside its description (`NAME.json`: the identity that made
//! it, its tokens, size and CRC-32), the folder's budget and the least recently used order.
//! Several serves may share the folder (docs/fleet.md): each lists it again when its stamp
//! says another changed it; a file is only ever made whole under a temporary name and renamed
//! into place (mode 0600), never written in place, and a restore reads a private copy, so no
//! writer corrupts another's states nor a reader's restore. A description that does not fit
//! its state is discarded; a state of another identity is never restored, and left to its own
//! serves. std and serde only; every function blocks (file I/O) and is called on a blocking
//! thread.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::folder::{self, Stamp};
use super::identity::Identity;

/// The description's format; another is discarded as foreign. Format 2 added `exact`.
const FORMAT: u32 = 2;
/// llama.cpp's sequence-state file: `ggsq`, version 4 (include/llama.h).
const SEQ_MAGIC: u32 = 0x6767_7371;
const SEQ_VERSION: u32 = 4;
/// A state with no description younger than this may be another serve's save under way.
const ORPHAN_AGE: Duration = Duration::from_secs(120);

/// Why a file was discarded, or not used: the label of `onebit_prompt_cache_discards_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Made by another model file, llama.cpp build or context settings (or described in
    /// another format): never restored, and left in the folder for the serves it is theirs.
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

/// A state of another identity, first seen: not used, left in the folder.
#[derive(Debug)]
pub struct Other {
    pub file: PathBuf,
    pub why: String,
    /// The first of its reason: said (once for each reason).
    pub first: bool,
}

/// What the listings of the folder found since it was last asked ([`Store::take_news`]).
#[derive(Debug, Default)]
pub struct News {
    pub discarded: Vec<Discarded>,
    pub others: Vec<Other>,
}

/// Where a restore reads its state from ([`copy::private`](super::copy::private)).
#[derive(Debug, PartialEq, Eq)]
pub enum Source {
    /// This serve's own copy (the temporary name it was given), checked against the
    /// description; its token list marked to end the match at the restore's cut when
    /// `marked`.
    Copy { marked: bool },
    /// The state itself, checked, restored whole: no copy could be written (a read-only or
    /// full folder).
    Whole,
}

/// Why a state cannot be restored.
#[derive(Debug)]
pub enum Unusable {
    /// Its file is gone: another serve evicted or replaced it. Forgotten without a word.
    Gone,
    /// It does not fit its description, or is another identity's.
    Bad(Reason, String),
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
    pub(super) crc32: u32,
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

/// What [`Store::admit`] did with a state llama-server saved.
#[derive(Debug, PartialEq, Eq)]
pub enum Admitted {
    /// Kept as this entry; `evicted` entries (least recently used, or now a prefix of it) went.
    Kept { bytes: u64, evicted: usize },
    /// Not kept: shorter than the minimum, already held by an entry, or over the budget alone.
    Dropped(&'static str),
}

/// The folder and what this identity finds in it.
pub struct Store {
    dir: PathBuf,
    budget: u64,
    identity: Identity,
    /// The identity's key: the first part of its states' names.
    key: String,
    entries: Vec<Entry>,
    /// Descriptions in the folder of another identity or format: not read again.
    others: HashSet<String>,
    /// The reasons of others' states already said.
    said: HashSet<String>,
    /// The folder as it was when last listed; None: list it at the next refresh.
    stamp: Option<Stamp>,
    /// The bytes of every state in the folder, whoever made it, at the last eviction pass.
    folder_bytes: u64,
    news: News,
}

impl Store {
    /// Read the folder ([`refresh`](Self::refresh); a folder that cannot be read is an empty
    /// one until it can), then apply the budget to it. What was discarded, and the states of
    /// other identities, are in [`take_news`](Self::take_news).
    pub fn open(dir: &Path, budget: u64, identity: Identity) -> Store {
        let mut store = Store {
            dir: dir.to_path_buf(),
            budget,
            key: identity.key(),
            identity,
            entries: Vec::new(),
            others: HashSet::new(),
            said: HashSet::new(),
            stamp: None,
            folder_bytes: 0,
            news: News::default(),
        };
        let _ = store.refresh();
        store.evict_to_budget(None);
        store
    }

    /// See what other serves did in the folder since it was last listed: when its stamp is
    /// the one seen then (one `stat`), nothing; else it is listed again: the descriptions not
    /// yet known read (this identity's entered, others' set aside), the entries whose
    /// description is gone (evicted or replaced by another serve) forgotten, leftovers
    /// removed. Returns whether it was listed. An error when the folder cannot be read (gone,
    /// replaced by a file, its disk lost): the cache is not used until it can be.
    pub fn refresh(&mut self) -> std::io::Result<bool> {
        let stamp = Stamp::of(&self.dir)?;
        if self.stamp == Some(stamp) {
            return Ok(false);
        }
        self.list()?;
        self.stamp = (!stamp.racy()).then_some(stamp);
        Ok(true)
    }

    /// What the listings discarded and found of others since the last call.
    pub fn take_news(&mut self) -> News {
        std::mem::take(&mut self.news)
    }

    fn list(&mut self) -> std::io::Result<()> {
        let mut described = HashSet::new();
        let mut states = Vec::new();
        for item in std::fs::read_dir(&self.dir)?.flatten() {
            let file_name = item.file_name().to_string_lossy().into_owned();
            let path = item.path();
            if file_name.starts_with("tmp-") {
                if folder::leftover(&file_name, &path) {
                    let _ = std::fs::remove_file(&path);
                }
            } else if let Some(name) = file_name.strip_suffix(".json") {
                described.insert(name.to_string());
            } else if let Some(name) = file_name.strip_suffix(".state") {
                states.push((name.to_string(), path));
            }
        }
        self.entries.retain(|e| described.contains(&e.name));
        self.others.retain(|n| described.contains(n));
        let known: HashSet<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        let mut new: Vec<String> = described
            .iter()
            .filter(|n| !self.others.contains(*n) && !known.contains(n.as_str()))
            .cloned()
            .collect();
        new.sort();
        for name in new {
            self.enter(&name);
        }
        for (name, path) in states {
            if described.contains(&name) {
                continue;
            }
            let young = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age < ORPHAN_AGE);
            if !young {
                let _ = std::fs::remove_file(&path);
                self.news.discarded.push(Discarded {
                    file: path,
                    reason: Reason::Corrupt,
                    why: "it has no description (a save cut off)".to_string(),
                });
            }
        }
        Ok(())
    }

    /// A description not seen before: this identity's an entry; another's set aside (its
    /// reason said once); one without its state forgotten (another serve is removing it);
    /// one that does not fit its state removed with it.
    fn enter(&mut self, name: &str) {
        match self.read_description(name) {
            Ok(entry) => self.entries.push(entry),
            Err(Unusable::Gone) => {
                let _ = std::fs::remove_file(self.dir.join(format!("{name}.json")));
            }
            Err(Unusable::Bad(Reason::Foreign, why)) => {
                self.others.insert(name.to_string());
                let first = self.said.insert(why.clone());
                self.news.others.push(Other {
                    file: self.dir.join(format!("{name}.state")),
                    why,
                    first,
                });
            }
            Err(Unusable::Bad(reason, why)) => {
                remove_pair(&self.dir, name);
                self.news.discarded.push(Discarded {
                    file: self.dir.join(format!("{name}.state")),
                    reason,
                    why,
                });
            }
        }
    }

    fn read_description(&self, name: &str) -> Result<Entry, Unusable> {
        let bad = |reason, why: String| Unusable::Bad(reason, why);
        let path = self.dir.join(format!("{name}.json"));
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unusable::Gone),
            Err(e) => {
                return Err(bad(
                    Reason::Corrupt,
                    format!("its description is unreadable ({e})"),
                ));
            }
        };
        let d: Description = serde_json::from_str(&text).map_err(|e| {
            bad(
                Reason::Corrupt,
                format!("its description is not serve's ({e})"),
            )
        })?;
        if d.format != FORMAT {
            return Err(bad(
                Reason::Foreign,
                format!("its description is format {}, not {FORMAT}", d.format),
            ));
        }
        if let Some(why) = self.identity.mismatch(&d.identity) {
            return Err(bad(Reason::Foreign, why));
        }
        // The identity's key is the first part of the name serve gives a state (an older
        // serve's names have none): one that is not this key is not this identity's.
        if let Some((key, _)) = name.split_once('-')
            && key != self.key
        {
            return Err(bad(
                Reason::Foreign,
                format!("its name says identity {key}, not {}", self.key),
            ));
        }
        let state = self.dir.join(format!("{name}.state"));
        let bytes = match std::fs::metadata(&state) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unusable::Gone),
            Err(e) => {
                return Err(bad(
                    Reason::Truncated,
                    format!("its state file cannot be read ({e})"),
                ));
            }
        };
        if bytes != d.bytes {
            return Err(bad(
                Reason::Truncated,
                format!(
                    "it has {bytes} bytes, not the {} it was saved with",
                    d.bytes
                ),
            ));
        }
        Ok(Entry {
            name: name.to_string(),
            exact: d.exact.min(d.tokens.len()),
            tokens: d.tokens,
            bytes: d.bytes,
            crc32: d.crc32,
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

    /// Forget an entry whose file another serve removed.
    pub fn forget(&mut self, entry: &Entry) {
        self.entries.retain(|e| e.name != entry.name);
    }

    /// An entry was restored: it is the most recently used (its description's mtime says so
    /// across restarts, and to every serve of the folder).
    pub fn touch(&self, entry: &Entry) {
        let path = self.dir.join(format!("{}.json", entry.name));
        if let Ok(file) = std::fs::File::options().append(true).open(&path) {
            let _ = file.set_modified(SystemTime::now());
        }
    }

    /// Whether an entry already holds all of `tokens`, at least `exact` of them exactly (a
    /// save would add nothing).
    pub fn holds(&self, tokens: &[i32], exact: usize) -> bool {
        self.entries
            .iter()
            .any(|e| e.tokens.starts_with(tokens) && e.exact >= exact.min(tokens.len()))
    }

    /// A temporary name in the folder for llama-server to save a slot as (this serve's:
    /// `tmp-<pid space>-<pid>-<seq>.state`).
    pub fn temp_name(seq: u64) -> String {
        folder::temp_name(&format!("{seq}.state"))
    }

    /// A temporary name in the folder for a restore's private copy.
    pub fn restore_temp_name(seq: u64) -> String {
        folder::temp_name(&format!("r{seq}.state"))
    }

    /// Take the state llama-server saved as `temp` (a name from [`temp_name`](Self::temp_name)):
    /// the folder refreshed (another serve may hold it already), its tokens read from the
    /// file, made 0600, its description written, both renamed into place (the description
    /// last: a state without one is never restored); entries that are a prefix of it (and no
    /// more exact) and the folder's least recently used states beyond the budget removed.
    /// `exact`: how many tokens of `prompt`, the prompt whose prefill filled the slot, hold
    /// what a cold prefill computes; of the state, only what it shares with that prompt is
    /// vouched for (another request may have taken the slot before its save), and a state
    /// with fewer than `min_tokens` such tokens could never be restored and is not kept. Its name is the
    /// identity's key and a hash of its tokens, CRC-32 and exact part: two serves saving the
    /// same state at once write the same bytes under the same names. An I/O error (a full,
    /// read-only or lost folder) is returned, the temporary file removed.
    pub fn admit(
        &mut self,
        temp: &str,
        min_tokens: usize,
        prompt: &[i32],
        exact: usize,
    ) -> std::io::Result<Admitted> {
        let temp_path = self.dir.join(temp);
        let result = self
            .refresh()
            .and_then(|_| self.admit_file(&temp_path, min_tokens, prompt, exact));
        let _ = std::fs::remove_file(&temp_path);
        result
    }

    fn admit_file(
        &mut self,
        temp_path: &Path,
        min_tokens: usize,
        prompt: &[i32],
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
        let exact = exact.min(common_prefix(&tokens, prompt));
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
            let text = format!(
                "{:?}:{}:{}",
                description.tokens, description.crc32, description.exact
            );
            let hash = super::identity::hex(&sha2::Digest::finalize(
                <sha2::Sha256 as sha2::Digest>::new_with_prefix(text.as_bytes()),
            ));
            format!("{}-{}", self.key, &hash[..20])
        };
        std::fs::set_permissions(temp_path, std::fs::Permissions::from_mode(0o600))?;
        let state = self.dir.join(format!("{name}.state"));
        std::fs::rename(temp_path, &state)?;
        let described = write_atomically(
            &self.dir.join(format!("{name}.json")),
            &self.dir.join(folder::temp_name(&format!("{name}.json"))),
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
        });
        evicted += self.evict_to_budget(Some(&name));
        Ok(Admitted::Kept { bytes, evicted })
    }

    /// The folder's budget: its least recently used states (whoever made them; a
    /// description's mtime is its last use) but `keep` removed until the states in the folder
    /// are within it; the number removed. Two serves evicting at once may each remove one
    /// (the folder ends further below its budget); neither breaks the other's restore.
    fn evict_to_budget(&mut self, keep: Option<&str>) -> usize {
        let Ok(listing) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut states: Vec<(SystemTime, u64, String)> = listing
            .flatten()
            .filter_map(|item| {
                let file_name = item.file_name().to_string_lossy().into_owned();
                let name = file_name.strip_suffix(".json")?;
                if file_name.starts_with("tmp-") {
                    return None;
                }
                let used = item.metadata().and_then(|m| m.modified()).ok()?;
                let bytes = std::fs::metadata(self.dir.join(format!("{name}.state")))
                    .ok()?
                    .len();
                Some((used, bytes, name.to_string()))
            })
            .collect();
        states.sort();
        let mut total: u64 = states.iter().map(|(_, bytes, _)| bytes).sum();
        let mut evicted = 0;
        for (_, bytes, name) in states {
            if total <= self.budget {
                break;
            }
            if Some(name.as_str()) == keep {
                continue;
            }
            remove_pair(&self.dir, &name);
            self.entries.retain(|e| e.name != name);
            self.others.remove(&name);
            total -= bytes;
            evicted += 1;
        }
        self.folder_bytes = total;
        evicted
    }

    /// The bytes of the folder's states, whoever made them, when the budget was last applied.
    pub fn folder_bytes(&self) -> u64 {
        self.folder_bytes
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

fn remove_pair(dir: &Path, name: &str) {
    let _ = std::fs::remove_file(dir.join(format!("{name}.json")));
    let _ = std::fs::remove_file(dir.join(format!("{name}.state")));
}

/// Write `data` to `temp`, mode 0600, flush it, and rename it to `path`.
fn write_atomically(path: &Path, temp: &Path, data: &[u8]) -> std::io::Result<()> {
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
