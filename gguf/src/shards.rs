//! The files a model consists of: one GGUF, or every shard of a `-0000i-of-0000N.gguf` split.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind};

/// The split naming llama.cpp's `gguf-split` writes (`llama_split_path`): `<prefix>-%05d-of-%05d.gguf`.
struct SplitName<'a> {
    prefix: &'a str,
    count: u32,
    width: usize,
}

fn parse_split_name(file_name: &str) -> Option<SplitName<'_>> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (head, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = head.rsplit_once('-')?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(index) || !all_digits(count) {
        return None;
    }
    let index: u32 = index.parse().ok()?;
    let width = count.len();
    let count: u32 = count.parse().ok()?;
    // Anything else is an odd name, not a split: treat it as a single file.
    if index == 0 || count == 0 || index > count {
        return None;
    }
    Some(SplitName {
        prefix,
        count,
        width,
    })
}

/// Every file of the model at `path`: for a split model named `name-0000i-of-0000N.gguf`
/// (any of its shards) all N shards in order, each required to exist; otherwise `path` alone.
///
/// Only file metadata is consulted; nothing is read. Called before a backend starts.
pub fn model_files(path: &Path) -> Result<Vec<PathBuf>, Error> {
    let label = path.display().to_string();
    let exists = |p: &Path| {
        fs::metadata(p).map_err(|e| Error::io(p.display().to_string(), "cannot open", e))
    };
    exists(path)?;
    let Some(split) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_split_name)
    else {
        return Ok(vec![path.to_path_buf()]);
    };
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut files = Vec::with_capacity(split.count as usize);
    for i in 1..=split.count {
        let shard = dir.join(format!(
            "{}-{:0w$}-of-{:0w$}.gguf",
            split.prefix,
            i,
            split.count,
            w = split.width
        ));
        if fs::metadata(&shard).is_err() {
            return Err(Error::new(
                label,
                None,
                ErrorKind::MissingShard,
                format!(
                    "shard {i} of {} is missing: {}; download every shard of the model",
                    split.count,
                    shard.display()
                ),
            ));
        }
        files.push(shard);
    }
    Ok(files)
}

/// Bytes on disk of the model at `path`, every shard counted: what its weights will occupy.
///
/// A sparse file counts its full length, as the loader would map it.
pub fn model_size(path: &Path) -> Result<u64, Error> {
    let mut total: u64 = 0;
    for file in model_files(path)? {
        let meta = fs::metadata(&file)
            .map_err(|e| Error::io(file.display().to_string(), "cannot open", e))?;
        total = total.saturating_add(meta.len());
    }
    Ok(total)
}
