//! What a llama-server's stderr lines mean to serve: a lost GPU, and the log-derived series
//! (ggml-hrx's program-cache flushes and its CPU-fallback report), counted per route.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a line means the backend lost its GPU, or None. ggml-hrx logs `AMDGPU hardware
/// exception` after a GPU reset; Vulkan reports `ErrorDeviceLost` / `VK_ERROR_DEVICE_LOST`.
/// Called on the stderr reader thread for every line: substring checks only.
pub fn lost_device(line: &str) -> Option<String> {
    const MARKS: [&str; 3] = [
        "AMDGPU hardware exception",
        "ErrorDeviceLost",
        "VK_ERROR_DEVICE_LOST",
    ];
    MARKS.iter().any(|m| line.contains(m)).then(|| {
        format!(
            "the backend lost its GPU (its line: {}); it cannot use the device again",
            line.trim()
        )
    })
}

/// ggml-hrx's WARN line when its graph-program cache is flushed.
const FLUSH_MARK: &str = "HRX graph program cache over its limit";
/// The markers of engine #390's load report of ops placed off HRX.
const FALLBACK_MARKS: [&str; 2] = ["CPU fallback", "off HRX"];

/// The series a route derives from its backend's stderr. Shared between the stderr reader
/// thread (`observe`) and `/metrics` (`render`); both are quick.
#[derive(Default)]
pub struct LogSeries {
    /// Program-cache flush lines seen; None until the first one (a series with no source is
    /// left out, not reported as 0).
    flushes: AtomicU64,
    flush_seen: AtomicU64,
    /// The last CPU-fallback report: op → count, with "all" the total.
    fallback: Mutex<Option<BTreeMap<String, u64>>>,
}

impl LogSeries {
    /// Look at one stderr line.
    pub fn observe(&self, line: &str) {
        if line.contains(FLUSH_MARK) {
            self.flushes.fetch_add(1, Ordering::Relaxed);
            self.flush_seen.store(1, Ordering::Relaxed);
        }
        if let Some(report) = fallback_report(line)
            && let Ok(mut last) = self.fallback.lock()
        {
            *last = Some(report);
        }
    }

    /// The series seen so far, as Prometheus text (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if self.flush_seen.load(Ordering::Relaxed) == 1 {
            let n = self.flushes.load(Ordering::Relaxed);
            let _ = write!(
                out,
                "# HELP onebit_program_cache_flushes_total ggml-hrx graph program cache flushes (its \"over its limit\" WARN lines).\n\
                 # TYPE onebit_program_cache_flushes_total counter\n\
                 onebit_program_cache_flushes_total {n}\n"
            );
        }
        if let Ok(last) = self.fallback.lock()
            && let Some(report) = last.as_ref()
        {
            out.push_str(
                "# HELP onebit_cpu_fallback_ops Ops the engine placed off the GPU in its last load report, per op; op=\"all\" is the total.\n\
                 # TYPE onebit_cpu_fallback_ops gauge\n",
            );
            for (op, n) in report {
                let _ = writeln!(out, "onebit_cpu_fallback_ops{{op=\"{op}\"}} {n}");
            }
        }
        out
    }
}

/// Parse a CPU-fallback report: a line naming `CPU fallback` or `off HRX`, followed by
/// `OP=count`, `OP xcount` or `OP: count` pairs, or by a total alone. `all` is the total (the
/// one the line gives, else the pairs' sum).
pub fn fallback_report(line: &str) -> Option<BTreeMap<String, u64>> {
    let at = FALLBACK_MARKS
        .iter()
        .filter_map(|m| line.find(m).map(|i| i + m.len()))
        .min()?;
    let tokens: Vec<&str> = line[at..]
        .split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == '(' || c == ')')
        .filter(|t| !t.is_empty())
        .collect();
    let is_op = |t: &str| {
        t.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let number = |t: &str| t.parse::<u64>().ok();
    let mut pairs = BTreeMap::new();
    let mut total = None;
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i];
        if let Some((op, n)) = t.split_once('=').or_else(|| t.split_once(':'))
            && is_op(op)
        {
            if let Some(n) = number(n) {
                *pairs.entry(op.to_string()).or_insert(0) += n;
                i += 1;
                continue;
            }
            if n.is_empty()
                && let Some(n) = tokens.get(i + 1).and_then(|n| number(n))
            {
                *pairs.entry(op.to_string()).or_insert(0) += n;
                i += 2;
                continue;
            }
        }
        if is_op(t)
            && let Some(n) = tokens
                .get(i + 1)
                .and_then(|n| n.strip_prefix('x'))
                .and_then(number)
        {
            *pairs.entry(t.to_string()).or_insert(0) += n;
            i += 2;
            continue;
        }
        if total.is_none()
            && let Some(n) = number(t.trim_end_matches(':'))
        {
            total = Some(n);
        }
        i += 1;
    }
    if pairs.is_empty() && total.is_none() {
        return None;
    }
    let all = total.unwrap_or_else(|| pairs.values().sum());
    pairs.remove("all");
    pairs.insert("all".to_string(), all);
    Some(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_device_lines_are_recognised_and_others_not() {
        assert!(lost_device("ggml_hrx: AMDGPU hardware exception").is_some());
        assert!(lost_device("ggml_vulkan: vk::Device::waitForFences: ErrorDeviceLost").is_some());
        assert!(lost_device("error VK_ERROR_DEVICE_LOST").is_some());
        assert!(lost_device("srv  update_slots: all slots are idle").is_none());
    }

    #[test]
    fn fallback_reports_in_every_documented_shape() {
        let r = fallback_report("ggml_hrx: CPU fallback: MUL_MAT=3, ROPE=2").unwrap();
        assert_eq!(r["MUL_MAT"], 3);
        assert_eq!(r["ROPE"], 2);
        assert_eq!(r["all"], 5);
        let r = fallback_report("W hrx: 4 nodes off HRX: SOFT_MAX x3 GET_ROWS x1").unwrap();
        assert_eq!((r["SOFT_MAX"], r["GET_ROWS"], r["all"]), (3, 1, 4));
        let r = fallback_report("W hrx: CPU fallback ops: ARGSORT: 6").unwrap();
        assert_eq!((r["ARGSORT"], r["all"]), (6, 6));
        let r = fallback_report("W hrx: CPU fallback: 7").unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r["all"], 7);
        assert!(fallback_report("W hrx: CPU fallback disabled").is_none());
        assert!(fallback_report("MUL_MAT=3").is_none());
    }

    #[test]
    fn series_are_left_out_until_their_line_comes() {
        let s = LogSeries::default();
        assert_eq!(s.render(), "");
        s.observe("W ggml_hrx: HRX graph program cache over its limit; flushing");
        s.observe("W ggml_hrx: HRX graph program cache over its limit; flushing");
        let text = s.render();
        assert!(text.contains("onebit_program_cache_flushes_total 2\n"));
        assert!(!text.contains("onebit_cpu_fallback_ops"));
        s.observe("W hrx: CPU fallback: MUL_MAT=1");
        assert!(
            s.render()
                .contains("onebit_cpu_fallback_ops{op=\"all\"} 1\n")
        );
    }
}
