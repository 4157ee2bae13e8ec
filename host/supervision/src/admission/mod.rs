//! Will it fit? The memory check before any backend starts: the route's estimate against the
//! memory the backend allocates from, decided and said in one line.

use std::path::{Path, PathBuf};

pub mod llama_kv;
pub mod passed_kv;

use onebit_plugin_api::MemoryNeed;

use onebit_command::error::Fatal;

const GIB: f64 = (1u64 << 30) as f64;
/// A load is refused only when its need plus this margin is more than what is free.
pub(crate) const MARGIN_BYTES: u64 = 1 << 30;
/// GTT use at or above this is where engine #315's faults were seen.
const GTT_FAULT_ZONE_BYTES: u64 = 95 << 30;

/// Where serve reads the machine's memory from; tests point both at folders of their own
/// (`ONEBIT_PROC_ROOT`, `ONEBIT_SYSFS_ROOT`).
#[derive(Clone, Debug)]
pub struct Sources {
    pub proc_root: PathBuf,
    pub sysfs_root: PathBuf,
}

impl Sources {
    pub fn from_env() -> Self {
        let root = |var: &str, default: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(default))
        };
        Sources {
            proc_root: root("ONEBIT_PROC_ROOT", "/proc"),
            sysfs_root: root("ONEBIT_SYSFS_ROOT", "/sys"),
        }
    }
}

/// What is free, and how the line describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Free {
    pub bytes: u64,
    /// `(MemAvailable 20.1 GiB)` or `(GTT 73.3 of 120.0 GiB free, MemAvailable 57.7 GiB)`.
    pub detail: String,
    /// GTT in use, when the pool is GTT.
    pub gtt_used: Option<u64>,
}

/// `MemAvailable` from `<proc>/meminfo`, in bytes.
pub fn mem_available(sources: &Sources) -> Option<u64> {
    let text = std::fs::read_to_string(sources.proc_root.join("meminfo")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// The amdgpu GTT pool (total, used) of the first card that reports one.
pub fn gtt(sources: &Sources) -> Option<(u64, u64)> {
    let drm = sources.sysfs_root.join("class/drm");
    let mut cards: Vec<PathBuf> = std::fs::read_dir(&drm)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    cards.sort();
    cards.iter().find_map(|card| {
        let read = |name: &str| -> Option<u64> {
            std::fs::read_to_string(card.join("device").join(name))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        Some((read("mem_info_gtt_total")?, read("mem_info_gtt_used")?))
    })
}

/// Free memory for a backend that allocates from `need.pool`: `ram` is MemAvailable; `gtt` is
/// min(GTT total - GTT used, MemAvailable), since the GTT pool is the same DRAM; `device` is
/// what the route reported of its device's own memory (`need.device`, ABI 1.8).
/// The error (exit 1) says which file could not be read, or that the route reported no device.
pub fn free_for(need: &MemoryNeed, sources: &Sources) -> Result<Free, Fatal> {
    let pool = need.pool.as_str();
    if pool == "device" {
        let device = need.device.as_ref().ok_or_else(|| {
            Fatal::backend(
                "the route judges its device's own memory but reported none (MemoryNeed::device); pass --no-mem-check, or ask its vendor for a fixed route",
            )
        })?;
        return Ok(Free {
            bytes: device.free_bytes,
            detail: format!(
                "({} {:.1} of {:.1} GiB free)",
                device.name,
                gib(device.free_bytes),
                gib(device.total_bytes)
            ),
            gtt_used: None,
        });
    }
    let available = mem_available(sources).ok_or_else(|| {
        Fatal::backend(format!(
            "cannot read MemAvailable from {}; pass --no-mem-check to start without the memory check",
            sources.proc_root.join("meminfo").display()
        ))
    })?;
    if pool == "gtt"
        && let Some((total, used)) = gtt(sources)
    {
        let gtt_free = total.saturating_sub(used);
        return Ok(Free {
            bytes: gtt_free.min(available),
            detail: format!(
                "(GTT {:.1} of {:.1} GiB free, MemAvailable {:.1} GiB)",
                gib(gtt_free),
                gib(total),
                gib(available)
            ),
            gtt_used: Some(used),
        });
    }
    Ok(Free {
        bytes: available,
        detail: format!("(MemAvailable {:.1} GiB)", gib(available)),
        gtt_used: None,
    })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// The check's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub fits: bool,
    /// `<name>: fits: need ...` or `<name> does not fit: need ...; free memory, ...`.
    pub line: String,
    /// Warnings for what grows after load (HRX only).
    pub warnings: Vec<String>,
}

/// Decide: refused when need + 1 GiB is more than free.
pub fn judge(name: &str, model_file: &Path, need: &MemoryNeed, free: &Free) -> Verdict {
    let total = need.weights_bytes + need.kv_bytes + need.compute_bytes;
    let file = model_file
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let need_text = format!(
        "need {:.2} GiB ({file}: weights {:.2} + KV/state {:.2} + compute {:.2}) at {}, free {:.2} GiB {}",
        gib(total),
        gib(need.weights_bytes),
        gib(need.kv_bytes),
        gib(need.compute_bytes),
        need.ctx_source,
        gib(free.bytes),
        free.detail
    );
    let fits = total.saturating_add(MARGIN_BYTES) <= free.bytes;
    let line = if fits {
        format!("{name}: fits: {need_text}")
    } else {
        format!(
            "{name} does not fit: {need_text}; free memory, lower --ctx-size, or pass --no-mem-check"
        )
    };
    let mut warnings = Vec::new();
    if need.pool == "gtt" {
        warnings.push(
            "the HRX graph-program cache grows by 2-9 GiB after load as prompt shapes vary"
                .to_string(),
        );
        if let Some(used) = free.gtt_used
            && used + total >= GTT_FAULT_ZONE_BYTES
        {
            warnings.push(format!(
                "this load lands at {:.1} GiB of GTT, at or above 95 GiB where engine #315's faults were seen",
                gib(used + total)
            ));
        }
    }
    Verdict {
        fits,
        line,
        warnings,
    }
}

/// The line for a model whose need the route cannot estimate: why, and that the check is
/// skipped (the backend says for itself whether it can load the model). Called by serve's
/// start-up (as a warning) and `--mem-check` (on stdout).
pub fn unknown_line(name: &str, why: &str) -> String {
    format!(
        "{name}: cannot estimate its memory ({why}), so the memory check is skipped; the backend will say whether it can load the model"
    )
}

/// Whether the check is skipped: `--no-mem-check`, or `ONEBIT_MEM_CHECK=0` (`env_says_skip`,
/// read by clap).
pub fn skipped(no_mem_check: bool, env_says_skip: bool) -> bool {
    no_mem_check || env_says_skip
}

#[cfg(test)]
mod tests {
    use super::*;

    fn need(weights_gib: f64, kv_gib: f64) -> MemoryNeed {
        MemoryNeed {
            weights_bytes: (weights_gib * GIB) as u64,
            kv_bytes: (kv_gib * GIB) as u64,
            compute_bytes: 512 << 20,
            ctx: 262144,
            ctx_source: "the model's own ctx 262144 (no --ctx-size)".into(),
            pool: "gtt".into(),
            llama_kv: None,
            device: None,
        }
    }

    fn pool_need(pool: &str) -> MemoryNeed {
        MemoryNeed {
            pool: pool.into(),
            ..MemoryNeed::default()
        }
    }

    fn fake_machine(mem_available_kib: u64, gtt: Option<(u64, u64)>) -> Sources {
        let dir = std::env::temp_dir().join(format!(
            "onebit-admission-{}-{mem_available_kib}-{}",
            std::process::id(),
            gtt.map(|g| g.0).unwrap_or(0)
        ));
        std::fs::create_dir_all(dir.join("proc")).unwrap();
        std::fs::write(
            dir.join("proc/meminfo"),
            format!("MemTotal: 1 kB\nMemAvailable:   {mem_available_kib} kB\n"),
        )
        .unwrap();
        if let Some((total, used)) = gtt {
            let dev = dir.join("sys/class/drm/card1/device");
            std::fs::create_dir_all(&dev).unwrap();
            std::fs::write(dev.join("mem_info_gtt_total"), format!("{total}\n")).unwrap();
            std::fs::write(dev.join("mem_info_gtt_used"), format!("{used}\n")).unwrap();
        }
        Sources {
            proc_root: dir.join("proc"),
            sysfs_root: dir.join("sys"),
        }
    }

    #[test]
    fn the_line_reads_as_the_specification_prints_it() {
        let gib = |g: f64| (g * GIB) as u64;
        let sources = fake_machine(gib(57.71) / 1024, Some((gib(120.0), gib(46.7))));
        let free = free_for(&pool_need("gtt"), &sources).unwrap();
        let v = judge(
            "Qwen3.8-27B-UD-Q4_K_XL",
            Path::new("/m/Qwen3.8-27B-UD-Q4_K_XL.gguf"),
            &need(16.35, 16.15),
            &free,
        );
        assert!(v.fits);
        assert_eq!(
            v.line,
            "Qwen3.8-27B-UD-Q4_K_XL: fits: need 33.00 GiB (Qwen3.8-27B-UD-Q4_K_XL.gguf: weights 16.35 + KV/state 16.15 + compute 0.50) at the model's own ctx 262144 (no --ctx-size), free 57.71 GiB (GTT 73.3 of 120.0 GiB free, MemAvailable 57.7 GiB)"
        );
    }

    #[test]
    fn refused_when_need_plus_a_gib_exceeds_free() {
        let free = Free {
            bytes: (34.4 * GIB) as u64,
            detail: "(MemAvailable 34.4 GiB)".into(),
            gtt_used: None,
        };
        let v = judge("m", Path::new("m.gguf"), &need(16.35, 16.15), &free);
        assert!(v.fits, "33.0 + 1 <= 34.4: {}", v.line);
        let free = Free {
            bytes: (33.9 * GIB) as u64,
            ..free
        };
        let v = judge("m", Path::new("m.gguf"), &need(16.35, 16.15), &free);
        assert!(!v.fits);
        assert!(v.line.starts_with("m does not fit: need 33.00 GiB"));
        assert!(
            v.line
                .ends_with("; free memory, lower --ctx-size, or pass --no-mem-check")
        );
    }

    #[test]
    fn gtt_pool_takes_the_smaller_of_gtt_free_and_mem_available_and_warns() {
        let gib = |g: f64| (g * GIB) as u64;
        let sources = fake_machine(gib(10.0) / 1024, Some((gib(120.0), gib(90.0))));
        let free = free_for(&pool_need("gtt"), &sources).unwrap();
        assert_eq!(free.bytes, gib(10.0));
        let v = judge("m", Path::new("m.gguf"), &need(4.0, 1.0), &free);
        assert_eq!(v.warnings.len(), 2, "{:?}", v.warnings);
        assert!(v.warnings[1].contains("95 GiB"));
        let ram = free_for(&pool_need("ram"), &sources).unwrap();
        assert_eq!(ram.detail, "(MemAvailable 10.0 GiB)");
    }

    #[test]
    fn a_device_pool_is_judged_against_what_the_route_reported() {
        let gib = |g: f64| (g * GIB) as u64;
        // The machine's RAM is plentiful: only the device's memory decides.
        let sources = fake_machine(gib(200.0) / 1024, None);
        let mut device = need(6.0, 1.0);
        device.pool = "device".into();
        device.device = Some(onebit_plugin_api::DeviceMemory {
            name: "NPU".into(),
            total_bytes: gib(16.0),
            free_bytes: gib(8.0),
        });
        let free = free_for(&device, &sources).unwrap();
        assert_eq!(free.detail, "(NPU 8.0 of 16.0 GiB free)");
        let v = judge("m", Path::new("m.gguf"), &device, &free);
        assert!(!v.fits, "7.5 + 1 > 8: {}", v.line);
        assert!(
            v.line.contains("free 8.00 GiB (NPU 8.0 of 16.0 GiB free)"),
            "{}",
            v.line
        );
        device.device.as_mut().unwrap().free_bytes = gib(9.0);
        let free = free_for(&device, &sources).unwrap();
        assert!(judge("m", Path::new("m.gguf"), &device, &free).fits);
        device.device = None;
        let Err(e) = free_for(&device, &sources) else {
            panic!("a device pool with no device reported is an error")
        };
        assert!(e.to_string().contains("reported none"), "{e}");
    }
}
