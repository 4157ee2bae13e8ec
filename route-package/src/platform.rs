//! Where a package can run: this machine's architecture, CPU features and glibc, judged
//! against what a manifest says its files need ([`Platform`]), and the variant of a carried
//! file this CPU runs best. Judged at install and by serve at every start, before any file of
//! the package is opened, so a package built for a newer CPU is refused in one line instead of
//! taking serve down with SIGILL.

use std::collections::BTreeSet;
use std::path::Path;

use crate::manifest::{CarriedFile, Platform, glibc_version};

/// The variable that narrows the CPU features serve believes this CPU has to those it names
/// (comma-separated): a way to try a package's build for older CPUs on a newer one.
pub const FEATURES_VAR: &str = "ONEBIT_CPU_FEATURES";

/// What this machine offers a package.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// The CPU architecture, as Rust names it (`x86_64`).
    pub arch: String,
    /// The CPU's features, as `/proc/cpuinfo` names them (its `flags`, or `Features` on Arm).
    pub cpu_features: BTreeSet<String>,
    /// The glibc serve runs on (major, minor); None when it could not be read.
    pub glibc: Option<(u32, u32)>,
}

impl Machine {
    /// This machine: reads `/proc/cpuinfo` (narrowed by [`FEATURES_VAR`]), and the C library
    /// serve has mapped (its newest `GLIBC_` version). Blocks on a few reads (the C library's file is ~2 MB, read only
    /// when `glibc` is asked by [`Machine::judge`]); any thread.
    pub fn this() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let mut cpu_features = cpu_features(&cpuinfo);
        // A stand-in for an older CPU: only the features named that this one has (a package's
        // variants for a CPU this one is not, tried here; never a feature this CPU lacks).
        if let Some(only) = std::env::var(FEATURES_VAR).ok().filter(|v| !v.is_empty()) {
            let only: BTreeSet<&str> = only.split(',').map(str::trim).collect();
            cpu_features.retain(|f| only.contains(f.as_str()));
        }
        Machine {
            arch: std::env::consts::ARCH.to_string(),
            cpu_features,
            glibc: None,
        }
    }

    /// Whether this machine runs a package that needs `platform`: Ok, or what is missing in
    /// words (`CPU features avx512f and amx_tile, which this CPU lacks`).
    pub fn judge(&self, platform: &Platform) -> Result<(), String> {
        if platform.arch != self.arch {
            return Err(format!(
                "it is built for {}, and this machine is {}",
                platform.arch, self.arch
            ));
        }
        let missing: Vec<&str> = platform
            .cpu_features
            .iter()
            .filter(|f| !self.cpu_features.contains(*f))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "it needs the CPU feature{} {}, which this CPU lacks",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(" and ")
            ));
        }
        if let Some(needed) = platform.glibc.as_deref() {
            let here = self.glibc.or_else(running_glibc);
            match (glibc_version(needed), here) {
                (Some(needed_v), Some(here_v)) if here_v < needed_v => {
                    return Err(format!(
                        "it needs glibc {needed}, and this machine has {}.{}",
                        here_v.0, here_v.1
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The path in the package of the build of `file` to use here: the variant whose CPU
    /// features this CPU has, the one needing the most winning (the first of equals), else the
    /// file itself. Pure.
    pub fn best_variant<'a>(&self, file: &'a CarriedFile) -> &'a str {
        file.variants
            .iter()
            .filter(|v| v.cpu_features.iter().all(|f| self.cpu_features.contains(f)))
            .fold(
                None,
                |best: Option<&crate::manifest::Variant>, v| match best {
                    Some(b) if b.cpu_features.len() >= v.cpu_features.len() => Some(b),
                    _ => Some(v),
                },
            )
            .map_or(file.path.as_str(), |v| v.path.as_str())
    }
}

/// The features a `/proc/cpuinfo` text lists for its first CPU (`flags` on x86, `Features` on
/// Arm).
fn cpu_features(cpuinfo: &str) -> BTreeSet<String> {
    cpuinfo
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            matches!(key.trim(), "flags" | "Features").then_some(value)
        })
        .map(|v| v.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// The newest `GLIBC_x.y` a file's bytes name (an ELF file's needed symbol versions are in its
/// string table; the C library's own, the versions it defines). None when it names none.
pub fn newest_glibc_named(bytes: &[u8]) -> Option<(u32, u32)> {
    const TAG: &[u8] = b"GLIBC_";
    let mut newest = None;
    let mut at = 0;
    while let Some(found) = find(&bytes[at..], TAG) {
        let start = at + found + TAG.len();
        let digits = bytes[start..]
            .iter()
            .take_while(|b| b.is_ascii_digit() || **b == b'.')
            .count();
        let text = String::from_utf8_lossy(&bytes[start..start + digits]);
        if let Some(v) = glibc_version(&text) {
            newest = newest.max(Some(v));
        }
        at = start;
    }
    newest
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    let first = needle[0];
    let mut from = 0;
    while let Some(i) = haystack[from..].iter().position(|&b| b == first) {
        let i = from + i;
        if haystack[i..].starts_with(needle) {
            return Some(i);
        }
        from = i + 1;
    }
    None
}

/// The glibc this process runs on: the newest version its mapped C library defines.
fn running_glibc() -> Option<(u32, u32)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let libc = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libc.so"))
        })?;
    newest_glibc_named(&std::fs::read(libc).ok()?)
}

/// The architecture an ELF file is built for, as Rust names it; None when it is not ELF (a
/// script) or of a machine this list does not name.
pub fn elf_arch(path: &Path) -> Option<&'static str> {
    use std::io::Read;
    let mut head = [0u8; 20];
    std::fs::File::open(path).ok()?.read_exact(&mut head).ok()?;
    if &head[..4] != b"\x7fELF" {
        return None;
    }
    let machine = if head[5] == 2 {
        u16::from_be_bytes([head[18], head[19]])
    } else {
        u16::from_le_bytes([head[18], head[19]])
    };
    match machine {
        62 => Some("x86_64"),
        183 => Some("aarch64"),
        243 => Some("riscv64"),
        3 => Some("x86"),
        40 => Some("arm"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Variant;

    fn machine(features: &[&str], glibc: (u32, u32)) -> Machine {
        Machine {
            arch: "x86_64".into(),
            cpu_features: features.iter().map(|f| f.to_string()).collect(),
            glibc: Some(glibc),
        }
    }

    fn platform(features: &[&str], glibc: Option<&str>) -> Platform {
        Platform {
            arch: "x86_64".into(),
            cpu_features: features.iter().map(|f| f.to_string()).collect(),
            glibc: glibc.map(str::to_string),
        }
    }

    #[test]
    fn a_machine_runs_what_it_has_and_names_what_it_lacks() {
        let here = machine(&["sse4_2", "avx2", "fma"], (2, 36));
        assert_eq!(here.judge(&platform(&["avx2"], Some("2.34"))), Ok(()));
        let why = here
            .judge(&platform(&["avx2", "avx512f", "amx_tile"], None))
            .unwrap_err();
        assert_eq!(
            why,
            "it needs the CPU features avx512f and amx_tile, which this CPU lacks"
        );
        let why = here.judge(&platform(&[], Some("2.38"))).unwrap_err();
        assert_eq!(why, "it needs glibc 2.38, and this machine has 2.36");
        let arm = Platform {
            arch: "aarch64".into(),
            ..platform(&[], None)
        };
        assert_eq!(
            here.judge(&arm).unwrap_err(),
            "it is built for aarch64, and this machine is x86_64"
        );
    }

    #[test]
    fn the_variant_needing_the_most_features_this_cpu_has_wins() {
        let variant = |path: &str, features: &[&str]| Variant {
            path: path.into(),
            sha256: "a".repeat(64),
            executable: Some(true),
            cpu_features: features.iter().map(|f| f.to_string()).collect(),
        };
        let file = CarriedFile {
            path: "engine".into(),
            version: "1".into(),
            sha256: "a".repeat(64),
            executable: Some(true),
            variants: vec![
                variant("engine.avx2", &["avx2", "fma"]),
                variant("engine.avx512", &["avx2", "fma", "avx512f"]),
            ],
        };
        assert_eq!(machine(&["sse4_2"], (2, 36)).best_variant(&file), "engine");
        assert_eq!(
            machine(&["avx2", "fma"], (2, 36)).best_variant(&file),
            "engine.avx2"
        );
        assert_eq!(
            machine(&["avx2", "fma", "avx512f"], (2, 36)).best_variant(&file),
            "engine.avx512"
        );
    }

    #[test]
    fn cpuinfo_and_glibc_versions_are_read() {
        let info = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n";
        let features = cpu_features(info);
        assert!(features.contains("avx2") && features.contains("sse4_2"));
        assert_eq!(
            newest_glibc_named(b"\0GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_PRIVATE\0GLIBC_2.17\0"),
            Some((2, 34))
        );
        assert_eq!(newest_glibc_named(b"no versions here"), None);
        assert_eq!(glibc_version("2.36"), Some((2, 36)));
        assert!(
            running_glibc().is_some_and(|v| v >= (2, 17)),
            "this machine's glibc is read"
        );
        let this = Machine::this();
        assert_eq!(this.arch, std::env::consts::ARCH);
        assert!(
            !this.cpu_features.is_empty(),
            "/proc/cpuinfo lists features"
        );
    }
}
