//! What a native llama.cpp build depends on beyond its flags: the compilers and what
//! `-march=native` means to them on this CPU. Recorded in the build's stamp, so a cache carried
//! to a machine whose CPU differs is rebuilt from scratch instead of dying of SIGILL.

use std::collections::BTreeSet;
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::Failure;

/// The machine a build was made for, as its compilers see it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildTarget {
    /// The first line of `cc --version` and of `c++ --version` (or of `$CC`/`$CXX`, as cmake picks).
    pub compilers: Vec<String>,
    /// The macros `-march=native` defines beyond the compiler's defaults, sorted: the CPU's
    /// instruction sets and tuning (`__AVX2__`, `__AMX_TILE__`, `__znver3`, ...).
    pub native_macros: Vec<String>,
}

impl BuildTarget {
    /// Asks this machine's C and C++ compilers; a few tens of milliseconds.
    pub fn of_this_machine() -> Result<Self, Failure> {
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
        let compilers = vec![first_line_of_version(&cc)?, first_line_of_version(&cxx)?];
        let native = predefined_macros(&cc, &["-march=native"])?;
        let plain = predefined_macros(&cc, &[])?;
        Ok(BuildTarget {
            compilers,
            native_macros: native.difference(&plain).cloned().collect(),
        })
    }

    /// Why a build made for `self` must not run here (`None` when it may), in words.
    pub fn unlike(&self, here: &BuildTarget) -> Option<String> {
        if self.compilers != here.compilers {
            return Some(format!(
                "it was built by {} and this machine has {}",
                self.compilers.join(" / "),
                here.compilers.join(" / ")
            ));
        }
        if self.native_macros == here.native_macros {
            return None;
        }
        let (built, now): (BTreeSet<_>, BTreeSet<_>) = (
            self.native_macros.iter().collect(),
            here.native_macros.iter().collect(),
        );
        let list = |names: Vec<&&String>| {
            names
                .into_iter()
                .map(|name| name.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let lacking = list(built.difference(&now).collect());
        let extra = list(now.difference(&built).collect());
        Some(match (lacking.is_empty(), extra.is_empty()) {
            (false, _) => format!("it was built for a CPU with {lacking}, which this one lacks"),
            (true, false) => format!("this CPU has {extra}, which it was not built for"),
            (true, true) => "its CPU target differs from this one".to_owned(),
        })
    }
}

fn first_line_of_version(compiler: &str) -> Result<String, Failure> {
    let output = Command::new(compiler).arg("--version").output();
    match output {
        Ok(output) if output.status.success() => Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .next()
            .unwrap_or(compiler)
            .trim()
            .to_owned()),
        _ => Err(Failure::new(
            format!("cannot run `{compiler} --version`"),
            "install a C/C++ compiler (apt-get install build-essential), then rerun `cargo xtask setup`",
        )),
    }
}

/// The names of the macros `compiler` predefines for C with `flags`.
fn predefined_macros(compiler: &str, flags: &[&str]) -> Result<BTreeSet<String>, Failure> {
    let output = Command::new(compiler)
        .args(flags)
        .args(["-dM", "-E", "-x", "c", "/dev/null"])
        .output();
    match output {
        Ok(output) if output.status.success() => {
            Ok(macro_names(&String::from_utf8_lossy(&output.stdout)))
        }
        _ => Err(Failure::new(
            format!("`{compiler} {} -dM -E` failed", flags.join(" ")),
            "install a C compiler that takes -march=native (apt-get install build-essential), then rerun `cargo xtask setup`",
        )),
    }
}

/// `#define NAME VALUE` lines to their names.
fn macro_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("#define "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(compiler: &str, macros: &[&str]) -> BuildTarget {
        BuildTarget {
            compilers: vec![compiler.to_owned(), compiler.to_owned()],
            native_macros: macros.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    #[test]
    fn a_build_for_this_cpu_and_compiler_may_run() {
        let here = target("gcc 12.2.0", &["__AVX2__", "__FMA__"]);
        assert_eq!(here.clone().unlike(&here), None);
    }

    #[test]
    fn a_build_for_a_cpu_with_more_instructions_must_not_run() {
        let built = target("gcc 12.2.0", &["__AMX_TILE__", "__AVX2__", "__AVX512F__"]);
        let here = target("gcc 12.2.0", &["__AVX2__"]);
        assert_eq!(
            built.unlike(&here).as_deref(),
            Some("it was built for a CPU with __AMX_TILE__ __AVX512F__, which this one lacks")
        );
    }

    #[test]
    fn a_build_for_a_lesser_cpu_or_by_another_compiler_is_rebuilt_too() {
        let built = target("gcc 12.2.0", &["__AVX2__"]);
        let here = target("gcc 12.2.0", &["__AVX2__", "__AVX512F__"]);
        assert!(built.unlike(&here).unwrap().contains("__AVX512F__"));
        let other = target("gcc 13.1.0", &["__AVX2__"]);
        assert!(built.unlike(&other).unwrap().contains("gcc 13.1.0"));
    }

    #[test]
    fn macro_names_reads_define_lines() {
        let names = macro_names("#define __AVX2__ 1\n#define __znver3 1\n#define X(a) a\nnoise\n");
        assert_eq!(
            names.into_iter().collect::<Vec<_>>(),
            ["X(a)", "__AVX2__", "__znver3"]
        );
    }

    #[test]
    fn this_machine_native_target_names_its_instruction_sets() {
        let here = BuildTarget::of_this_machine().expect("the machine has cc");
        // Every x86-64 CPU llama.cpp runs on has SSE2 by default; -march=native adds at least SSE3.
        assert!(
            here.native_macros.iter().any(|m| m.starts_with("__SSE")),
            "{here:?}"
        );
        assert!(
            !here.native_macros.contains(&"__x86_64__".to_owned()),
            "defaults are not counted: {here:?}"
        );
    }
}
