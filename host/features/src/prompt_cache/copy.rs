//! A restore's private copy of a state: the state read once, through one open file, checked
//! against its description as it is copied to a temporary file of this serve's, and the copy
//! marked where the restore stops. The state in the folder is never written, so serves that
//! share the folder read what was saved, and one evicting it meanwhile leaves the copy whole.
//! Blocks (file I/O); called on a blocking thread, without the store's lock.

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::store::{Entry, Reason, Source, Store, Unusable};

/// Copy an entry's state to `temp` (a name from [`restore_temp_name`]), this serve's own,
/// checking it against its description (size and CRC-32, the whole file read) as it goes,
/// and make the copy's token list end its match at `k` (a token there that no prompt has:
/// llama-server then keeps the first `k` cells it restores and prefills the rest). The
/// state is read through one open file: another serve may evict it meanwhile, the copy is
/// whole all the same; and the state itself is never written, so a serve reading it at
/// the same time reads what was saved. A copy that cannot be written (a read-only or full
/// folder): the state is restored whole, as it is. Called without the store's lock.
///
/// [`restore_temp_name`]: Store::restore_temp_name
pub fn private(dir: &Path, entry: &Entry, k: usize, temp: &str) -> Result<Source, Unusable> {
    let bad = |reason, why: String| Unusable::Bad(reason, why);
    let mut state = match std::fs::File::open(dir.join(Store::file_name(entry))) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unusable::Gone),
        Err(e) => return Err(bad(Reason::Truncated, format!("it cannot be read ({e})"))),
    };
    let copy_path = dir.join(temp);
    let mut copy = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&copy_path)
        .ok();
    let mut crc = crc32fast::Hasher::new();
    let mut bytes = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let failed = loop {
        let n = match state.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Some((Reason::Truncated, format!("it cannot be read ({e})"))),
        };
        crc.update(&buf[..n]);
        bytes += n as u64;
        if let Some(file) = copy.as_mut()
            && file.write_all(&buf[..n]).is_err()
        {
            copy = None;
            let _ = std::fs::remove_file(&copy_path);
        }
    };
    let failed = failed.or_else(|| {
        if bytes != entry.bytes {
            Some((
                Reason::Truncated,
                format!(
                    "it has {bytes} bytes, not the {} it was saved with",
                    entry.bytes
                ),
            ))
        } else if crc.finalize() != entry.crc32 {
            Some((
                Reason::Corrupt,
                "its CRC-32 does not match the one it was saved with".to_string(),
            ))
        } else {
            None
        }
    });
    if let Some((reason, why)) = failed {
        drop(copy);
        let _ = std::fs::remove_file(&copy_path);
        return Err(bad(reason, why));
    }
    Ok(match copy {
        Some(file) => Source::Copy {
            marked: mark_end(&file, entry, k),
        },
        None => Source::Whole,
    })
}

/// Make a private copy's token list end its match at `k` (the token there changed to one no
/// prompt has there); false when it cannot (the copy is then restored whole).
fn mark_end(file: &std::fs::File, entry: &Entry, k: usize) -> bool {
    let Some(&original) = entry.tokens.get(k) else {
        return false;
    };
    let mut head = [0u8; 20];
    if file.read_exact_at(&mut head, 0).is_err() {
        return false;
    }
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
    if file.read_exact_at(&mut at, offset).is_err() || i32::from_le_bytes(at) != original {
        return false;
    }
    let other: i32 = if original == 0 { 1 } else { 0 };
    file.write_all_at(&other.to_le_bytes(), offset).is_ok()
}
