//! A package folder as one `.tar.gz`, and back: packing is deterministic (the same folder
//! gives the same bytes; a file's mode is 0755 when it is executable, else 0644); unpacking
//! takes regular files and folders alone, inside the target, and keeps the executable bit.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;

use crate::{MANIFEST_FILE, PackageError};

/// At most this many entries in a package archive.
const MAX_ENTRIES: usize = 10_000;
/// At most this many bytes unpacked from one archive (llama.cpp's libraries are ~30 MB; a
/// vendor's kernels may be large, a bomb is larger).
const MAX_BYTES: u64 = 16 << 30;

/// Pack the package folder `dir` into `DIR.tar.gz` beside it, its files under the folder's
/// name. Returns the archive's path.
pub fn pack(dir: &Path) -> Result<PathBuf, PackageError> {
    let name = dir
        .file_name()
        .ok_or_else(|| PackageError::new(format!("{}: not a package folder", dir.display())))?;
    let archive = dir.with_file_name(format!("{}.tar.gz", name.to_string_lossy()));
    let file =
        std::fs::File::create(&archive).map_err(|e| PackageError::io("creating", &archive, &e))?;
    let mut tar = tar::Builder::new(GzEncoder::new(file, Compression::default()));
    tar.mode(tar::HeaderMode::Deterministic);
    let mut files = Vec::new();
    collect(dir, &mut files).map_err(|e| PackageError::io("reading", dir, &e))?;
    files.sort();
    for path in files {
        let inside = Path::new(name).join(path.strip_prefix(dir).unwrap_or(&path));
        tar.append_path_with_name(&path, &inside)
            .map_err(|e| PackageError::io("packing", &path, &e))?;
    }
    let gz = tar
        .into_inner()
        .map_err(|e| PackageError::io("writing", &archive, &e))?;
    gz.finish()
        .map_err(|e| PackageError::io("writing", &archive, &e))?;
    Ok(archive)
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if std::fs::symlink_metadata(&path)?.is_dir() {
            collect(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether `path` names an archive rather than a folder (by its name: `.tar.gz`, `.tgz`).
pub fn is_archive(path: &Path) -> bool {
    let name = path.to_string_lossy();
    name.ends_with(".tar.gz") || name.ends_with(".tgz")
}

/// Unpack `archive` into the empty folder `into`; returns the package folder inside it (the
/// one folder holding the manifest). Refuses links, devices, paths outside `into`, and
/// archives past the size limits; a truncated or damaged archive is an error. On error the
/// caller removes `into`.
pub fn unpack(archive: &Path, into: &Path) -> Result<PathBuf, PackageError> {
    let damaged = |why: String| {
        PackageError::new(format!(
            "{}: not a whole package archive ({why}); download or build it again",
            archive.display()
        ))
    };
    let file =
        std::fs::File::open(archive).map_err(|e| PackageError::io("reading", archive, &e))?;
    let mut tar = tar::Archive::new(GzDecoder::new(file));
    let mut bytes = 0u64;
    let entries = tar.entries().map_err(|e| damaged(e.to_string()))?;
    for (count, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|e| damaged(e.to_string()))?;
        if count >= MAX_ENTRIES {
            return Err(damaged(format!("more than {MAX_ENTRIES} entries")));
        }
        let path = entry
            .path()
            .map_err(|e| damaged(e.to_string()))?
            .into_owned();
        if path
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(damaged(format!(
                "{} points outside the package",
                path.display()
            )));
        }
        let kind = entry.header().entry_type();
        let target = into.join(&path);
        if kind.is_dir() {
            std::fs::create_dir_all(&target)
                .map_err(|e| PackageError::io("creating", &target, &e))?;
            continue;
        }
        if !kind.is_file() {
            return Err(damaged(format!(
                "{} is a link or a device; a package holds files alone",
                path.display()
            )));
        }
        bytes = bytes.saturating_add(entry.size());
        if bytes > MAX_BYTES {
            return Err(damaged(format!(
                "more than {} GiB unpacked",
                MAX_BYTES >> 30
            )));
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| PackageError::io("creating", parent, &e))?;
        }
        // The executable bit survives (a program the route runs); nothing else of the mode
        // does: a package's files are the installing user's, 0755 or 0644.
        let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(if executable { 0o755 } else { 0o644 })
            .open(&target)
            .map_err(|e| PackageError::io("creating", &target, &e))?;
        // `mode` is masked by the umask; the bit a manifest records must not be.
        let mode = if executable { 0o755 } else { 0o644 };
        out.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(|e| PackageError::io("creating", &target, &e))?;
        std::io::copy(&mut entry, &mut out).map_err(|e| damaged(e.to_string()))?;
        out.sync_all()
            .map_err(|e| PackageError::io("writing", &target, &e))?;
    }
    // The gzip stream's end (its checksum) is read only past the tar's end: read it, so a cut
    // archive is not taken whole.
    let mut rest = tar.into_inner();
    std::io::copy(&mut rest, &mut std::io::sink()).map_err(|e| damaged(e.to_string()))?;
    package_folder(into).ok_or_else(|| damaged(format!("it holds no {MANIFEST_FILE}")))
}

/// `into` itself, or its one sub-folder, whichever holds the manifest.
fn package_folder(into: &Path) -> Option<PathBuf> {
    if into.join(MANIFEST_FILE).is_file() {
        return Some(into.to_path_buf());
    }
    let dirs: Vec<PathBuf> = std::fs::read_dir(into)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    match dirs.as_slice() {
        [one] if one.join(MANIFEST_FILE).is_file() => Some(one.clone()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::tests::sample_package;
    use crate::testing::scratch;

    #[test]
    fn a_packed_folder_unpacks_to_the_same_checked_package() {
        let root = scratch("pack");
        let dir = sample_package(&root, "1.2.0");
        let archive = pack(&dir).unwrap();
        assert_eq!(archive, root.join("dist/acme-1.2.0.tar.gz"));
        let first = std::fs::read(&archive).unwrap();
        assert_eq!(
            std::fs::read(pack(&dir).unwrap()).unwrap(),
            first,
            "deterministic"
        );
        let into = root.join("into");
        std::fs::create_dir(&into).unwrap();
        let unpacked = unpack(&archive, &into).unwrap();
        assert_eq!(unpacked, into.join("acme-1.2.0"));
        crate::check(&unpacked).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(
            mode(&unpacked.join("acme-engine")),
            0o755,
            "a program stays executable"
        );
        assert_eq!(mode(&unpacked.join("libacme_kernels.so.1")), 0o644);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_truncated_archive_is_refused_at_every_cut() {
        let root = scratch("truncated");
        let archive = pack(&sample_package(&root, "1.2.0")).unwrap();
        let whole = std::fs::read(&archive).unwrap();
        for cut in [10, whole.len() / 2, whole.len() - 9, whole.len() - 1] {
            let cut_file = root.join(format!("cut-{cut}.tar.gz"));
            std::fs::write(&cut_file, &whole[..cut]).unwrap();
            let into = root.join(format!("into-{cut}"));
            std::fs::create_dir(&into).unwrap();
            let why = unpack(&cut_file, &into).unwrap_err().to_string();
            assert!(
                why.contains("not a whole package archive"),
                "cut at {cut}: {why}"
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn links_and_paths_outside_are_refused() {
        let root = scratch("hostile");
        for (name, build) in [("link", 0u8), ("dotdot", 1u8)] {
            let path = root.join(format!("{name}.tar.gz"));
            let file = std::fs::File::create(&path).unwrap();
            let mut tar = tar::Builder::new(GzEncoder::new(file, Compression::default()));
            let mut header = tar::Header::new_gnu();
            if build == 0 {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_size(0);
                tar.append_link(&mut header, "pkg/libk.so", "/etc/passwd")
                    .unwrap();
            } else {
                header.set_size(1);
                header.set_mode(0o644);
                // `append_data` refuses `..`; write the name into the header by hand.
                header.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../evil.s");
                header.set_cksum();
                tar.append(&header, &b"x"[..]).unwrap();
            }
            tar.into_inner().unwrap().finish().unwrap();
            let into = root.join(format!("into-{name}"));
            std::fs::create_dir(&into).unwrap();
            let why = unpack(&path, &into).unwrap_err().to_string();
            assert!(
                why.contains("a link or a device") || why.contains("points outside the package"),
                "{name}: {why}"
            );
            assert!(!root.join("evil.s").exists());
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
