//! What `GET /metrics` says: serve's own series (Prometheus text 0.0.4, through
//! prometheus-client; `requests` for the request counter and added-time histogram both relay
//! engines record), the backend's own `/metrics` text when it answers, and the state file that
//! keeps serve's counters across restarts. The handler itself is the front's (`front::endpoints`).
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use onebit_supervision::backends::health::ProbeClient;

pub mod requests;
pub mod text;

/// The content type of Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// How long a scrape waits for the backend's own `/metrics`.
const BACKEND_TIMEOUT: Duration = Duration::from_secs(1);
/// GTT use from which engine #315's faults were seen.
const GTT_FAULT_ZONE_BYTES: u64 = 95 << 30;

/// serve's own counters for this run, beside the request series (`requests`): one set per
/// serve, held in [`Sources`]; a clone counts into the same series, so what counts holds one
/// (the relay's keep-alive comments, the Laya daemon). Any thread; never blocks.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// SSE keep-alive comments sent (`onebit_sse_keepalives`).
    keepalives: Counter,
    /// Generations ended by `--max-generation-s` (`onebit_generation_deadlines`).
    deadlines: Counter,
    /// `--laya-model`'s daemon: 0 when none runs, 1 while it answers, 2 once it exited
    /// (`onebit_laya_scorer_up`).
    laya_scorer: Arc<AtomicU64>,
    /// The conversations the rule-based classifier decided in the daemon's place, by why
    /// (`onebit_laya_fallbacks`).
    laya_fallbacks: Arc<[AtomicU64; 3]>,
}

impl Counters {
    /// Count one keep-alive comment sent.
    pub fn keepalive_sent(&self) {
        self.keepalives.inc();
    }

    /// Count one generation ended by its deadline (`--max-generation-s`).
    pub fn deadline_passed(&self) {
        self.deadlines.inc();
    }

    /// The Laya daemon is up (it said ready) or gone (it exited).
    pub fn laya_scorer_up(&self, up: bool) {
        self.laya_scorer
            .store(if up { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Count one decision the rules made for the Laya daemon.
    pub fn laya_fallback(&self, why: LayaFallback) {
        self.laya_fallbacks[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the rule-based classifier decided in the Laya daemon's place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayaFallback {
    /// It did not answer within its bound.
    Timeout,
    /// It answered something outside its protocol.
    BadAnswer,
    /// It had exited.
    Exited,
}

impl LayaFallback {
    const ALL: [LayaFallback; 3] = [Self::Timeout, Self::BadAnswer, Self::Exited];

    fn label(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::BadAnswer => "bad_answer",
            Self::Exited => "exited",
        }
    }
}

/// serve's counters that outlive one serve process (Lemonade restarts a backend by starting
/// serve again), per model.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Counts {
    /// The model id the file belongs to.
    pub model: String,
    pub serve_starts: u64,
    pub watchdog_kills: u64,
    pub backend_exits: u64,
}

/// `<state dir>/<hash of the model id>.json`, read once at start and rewritten atomically on
/// each change. Its methods do file I/O: call them off the async threads.
pub struct StateFile {
    path: PathBuf,
    counts: Mutex<Counts>,
}

/// `$ONEBIT_STATE_DIR`, else the first of `$STATE_DIRECTORY` (what systemd sets for a unit's
/// `StateDirectory=`, a colon-separated list), else `~/.local/state/1bit/serve` with the home
/// directory from the user database (not `$HOME`, which a service manager may not set).
pub fn state_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ONEBIT_STATE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var("STATE_DIRECTORY")
        .ok()
        .and_then(|list| list.split(':').next().map(str::to_string))
        .filter(|d| !d.is_empty())
    {
        return Some(PathBuf::from(dir));
    }
    let user = nix::unistd::User::from_uid(nix::unistd::getuid()).ok()??;
    Some(user.dir.join(".local/state/1bit/serve"))
}

impl StateFile {
    /// Open the file for `model` in `dir`. A missing file starts at zero; a corrupt one is
    /// replaced, with a warning line. Never fails: the counters are a report, not a reason to
    /// stop serving.
    pub fn open(dir: &Path, model: &str) -> StateFile {
        let hash = Sha256::digest(model.as_bytes());
        let name: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        let path = dir.join(format!("{name}.json"));
        let fresh = Counts {
            model: model.to_string(),
            ..Counts::default()
        };
        let counts = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Counts>(&bytes) {
                Ok(c) => Counts {
                    model: model.to_string(),
                    ..c
                },
                Err(e) => {
                    tracing::warn!(
                        "1bit serve: warning: the state file {} is not valid ({e}); starting its counters again",
                        path.display()
                    );
                    fresh
                }
            },
            Err(_) => fresh,
        };
        StateFile {
            path,
            counts: Mutex::new(counts),
        }
    }

    pub fn counts(&self) -> Counts {
        self.counts.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Change the counts and write them: a temporary file beside it, then a rename, so a
    /// reader never sees half a file. A write that fails is said once and otherwise ignored.
    pub fn bump(&self, change: impl FnOnce(&mut Counts)) {
        let counts = match self.counts.lock() {
            Ok(mut c) => {
                change(&mut c);
                c.clone()
            }
            Err(_) => return,
        };
        if let Err(e) = self.write(&counts) {
            tracing::warn!(
                "1bit serve: warning: cannot write the state file {} ({e})",
                self.path.display()
            );
        }
    }

    fn write(&self, counts: &Counts) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let temp = self
            .path
            .with_extension(format!("json.tmp{}", std::process::id()));
        let text = serde_json::to_string_pretty(counts).map_err(std::io::Error::other)?;
        std::fs::write(&temp, text + "\n")?;
        std::fs::rename(&temp, &self.path)
    }
}

/// Bump the state file on a blocking thread and wait for the write.
pub async fn bump(state: &Option<Arc<StateFile>>, change: fn(&mut Counts)) {
    if let Some(state) = state.clone() {
        let _ = tokio::task::spawn_blocking(move || state.bump(change)).await;
    }
}

/// What `/metrics` needs beyond the app's status.
pub struct Sources {
    pub state: Option<Arc<StateFile>>,
    /// Each backend's port and Prometheus route.
    pub backends: Vec<(u16, Option<String>)>,
    /// Where amdgpu's and k10temp's files are (`$ONEBIT_SYSFS_ROOT`, else `/sys`).
    pub sysfs_root: PathBuf,
    /// serve's own counters for this run.
    pub counters: Counters,
    /// The label naming serve's route on `onebit_up` ([`text::route_label`]).
    pub route_label: &'static str,
}

/// `$ONEBIT_SYSFS_ROOT`, else `/sys`.
pub fn sysfs_root() -> PathBuf {
    std::env::var_os("ONEBIT_SYSFS_ROOT")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/sys"))
}

/// What the machine's files say; None where a file is absent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Machine {
    pub gtt_total: Option<u64>,
    pub gtt_used: Option<u64>,
    pub tctl_celsius: Option<f64>,
}

fn read_number(path: &Path) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn sorted_entries(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// The first amdgpu card's GTT (`class/drm/card*/device/mem_info_gtt_total|used`) and k10temp's
/// Tctl (`class/hwmon/hwmon*/name` = k10temp, the `temp*_label` that reads Tctl, its
/// `temp*_input` in millidegrees). Reads files: call it on a blocking thread.
pub fn read_machine(root: &Path) -> Machine {
    let mut m = Machine::default();
    for card in sorted_entries(&root.join("class/drm"), "card") {
        let dev = card.join("device");
        if let Some(total) = read_number(&dev.join("mem_info_gtt_total")) {
            m.gtt_total = Some(total.max(0) as u64);
            m.gtt_used = read_number(&dev.join("mem_info_gtt_used")).map(|u| u.max(0) as u64);
            break;
        }
    }
    m.tctl_celsius = tctl_celsius(root);
    m
}

/// CPU Tctl in degrees Celsius from k10temp, when present. Reads files.
pub fn tctl_celsius(root: &Path) -> Option<f64> {
    for hwmon in sorted_entries(&root.join("class/hwmon"), "hwmon") {
        let name = std::fs::read_to_string(hwmon.join("name")).unwrap_or_default();
        if name.trim() != "k10temp" {
            continue;
        }
        for label in sorted_entries(&hwmon, "temp") {
            let file = label.file_name()?.to_string_lossy().into_owned();
            let Some(n) = file.strip_suffix("_label") else {
                continue;
            };
            if std::fs::read_to_string(&label).unwrap_or_default().trim() == "Tctl" {
                return read_number(&hwmon.join(format!("{n}_input"))).map(|m| m as f64 / 1000.0);
            }
        }
    }
    None
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
enum GttKind {
    total,
    used,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GttLabel {
    kind: GttKind,
}

/// serve's own series as Prometheus text: every series with a source, and none without.
/// `route_label` names the route's label on `onebit_up` ([`text::route_label`]).
pub fn render_own(
    (route_label, device): (&'static str, &str),
    up: bool,
    counts: Option<&Counts>,
    machine: &Machine,
    counters: &Counters,
) -> String {
    let mut registry = Registry::default();
    let up_family = Family::<Vec<(&'static str, String)>, Gauge>::default();
    up_family
        .get_or_create(&vec![(route_label, device.to_string())])
        .set(i64::from(up));
    registry.register(
        "onebit_up",
        "1 while the model is served; device names the route",
        up_family,
    );
    if let Some(c) = counts {
        for (name, help, n) in [
            (
                "onebit_serve_starts",
                "Loads of this model by serve, kept across restarts",
                c.serve_starts,
            ),
            (
                "onebit_watchdog_kills",
                "Backends the progress watchdog killed, kept across restarts",
                c.watchdog_kills,
            ),
            (
                "onebit_backend_exits",
                "Backends that exited on their own, kept across restarts",
                c.backend_exits,
            ),
        ] {
            let counter = Counter::<u64>::default();
            counter.inc_by(n);
            registry.register(name, help, counter);
        }
    }
    registry.register(
        "onebit_sse_keepalives",
        "SSE keep-alive comments sent on streams whose backend was silent",
        counters.keepalives.clone(),
    );
    registry.register(
        "onebit_generation_deadlines",
        "Generations ended by --max-generation-s while still running",
        counters.deadlines.clone(),
    );
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let tasks = Gauge::<i64>::default();
        tasks.set(i64::try_from(runtime.metrics().num_alive_tasks()).unwrap_or(i64::MAX));
        registry.register(
            "onebit_runtime_tasks",
            "Tasks alive in serve's async runtime (connections, requests, monitors); flat when idle",
            tasks,
        );
    }
    laya_series(&mut registry, counters);
    if machine.gtt_total.is_some() || machine.gtt_used.is_some() {
        let gtt = Family::<GttLabel, Gauge>::default();
        for (kind, v) in [
            (GttKind::total, machine.gtt_total),
            (GttKind::used, machine.gtt_used),
        ] {
            if let Some(v) = v {
                gtt.get_or_create(&GttLabel { kind })
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
        registry.register(
            "onebit_gtt_bytes",
            "The amdgpu GTT pool the GPU allocates from (mem_info_gtt_*)",
            gtt,
        );
    }
    if let Some(used) = machine.gtt_used {
        let zone = Gauge::<i64>::default();
        zone.set(i64::from(used >= GTT_FAULT_ZONE_BYTES));
        registry.register(
            "onebit_gtt_fault_zone",
            "1 when GTT use is at or above 95 GiB, where engine #315's faults were seen",
            zone,
        );
    }
    if let Some(t) = machine.tctl_celsius {
        let tctl = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        tctl.set(t);
        registry.register("onebit_tctl_celsius", "CPU Tctl (k10temp)", tctl);
    }
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
    text::strict_004(&out)
}

/// `onebit_laya_scorer_up` and `onebit_laya_fallbacks_total{reason}`, when a Laya daemon was
/// started (`--laya-model`).
fn laya_series(registry: &mut Registry, counters: &Counters) {
    let state = counters.laya_scorer.load(Ordering::Relaxed);
    if state == 0 {
        return;
    }
    let up = Gauge::<i64>::default();
    up.set(i64::from(state == 1));
    registry.register(
        "onebit_laya_scorer_up",
        "1 while the Laya daemon (--laya-model) answers; 0 once it exited (the rule-based classifier decides)",
        up,
    );
    let fallbacks = Family::<Vec<(&'static str, String)>, Counter>::default();
    for why in LayaFallback::ALL {
        fallbacks
            .get_or_create(&vec![("reason", why.label().to_string())])
            .inc_by(counters.laya_fallbacks[why as usize].load(Ordering::Relaxed));
    }
    registry.register(
        "onebit_laya_fallbacks",
        "New conversations the rule-based classifier decided because the Laya daemon was late (timeout), answered outside its protocol (bad_answer) or had exited",
        fallbacks,
    );
}

pub fn append(body: &mut String, text: &str) {
    if text.trim().is_empty() {
        return;
    }
    body.push_str(text);
    if !text.ends_with('\n') {
        body.push('\n');
    }
}

/// The backend's `/metrics` text and its reply headers (llama-server's `Process-Start-Time-Unix`,
/// which serve relays), asked with a one-second limit; None when it does not answer 200 in
/// time.
pub async fn backend_reply(
    client: &ProbeClient,
    port: u16,
    path: &str,
) -> Option<(String, hyper::HeaderMap)> {
    let request = hyper::Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let call = async {
        let reply = client.request(request).await.ok()?;
        if !reply.status().is_success() {
            return None;
        }
        let (parts, body) = reply.into_parts();
        let bytes = body.collect().await.ok()?.to_bytes();
        String::from_utf8(bytes.to_vec())
            .ok()
            .map(|text| (text, parts.headers))
    };
    tokio::time::timeout(BACKEND_TIMEOUT, call).await.ok()?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("onebit-metrics-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn counts_survive_a_reopen_and_a_corrupt_file_starts_again() {
        let dir = temp("state");
        let state = StateFile::open(&dir, "smol");
        state.bump(|c| c.serve_starts += 1);
        state.bump(|c| c.watchdog_kills += 1);
        let again = StateFile::open(&dir, "smol");
        assert_eq!(again.counts().serve_starts, 1);
        assert_eq!(again.counts().watchdog_kills, 1);
        assert_eq!(again.counts().model, "smol");
        assert_eq!(StateFile::open(&dir, "other").counts().serve_starts, 0);
        std::fs::write(&again.path, b"{not json").unwrap();
        let broken = StateFile::open(&dir, "smol");
        assert_eq!(broken.counts().serve_starts, 0);
        broken.bump(|c| c.serve_starts += 1);
        assert_eq!(StateFile::open(&dir, "smol").counts().serve_starts, 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_machine_is_read_from_amdgpu_and_k10temp_files() {
        let root = temp("sysfs");
        let dev = root.join("class/drm/card1/device");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("mem_info_gtt_total"), "128849018880\n").unwrap();
        std::fs::write(dev.join("mem_info_gtt_used"), "102005473280\n").unwrap();
        let other = root.join("class/hwmon/hwmon0");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("name"), "nvme\n").unwrap();
        let k10 = root.join("class/hwmon/hwmon3");
        std::fs::create_dir_all(&k10).unwrap();
        std::fs::write(k10.join("name"), "k10temp\n").unwrap();
        std::fs::write(k10.join("temp1_label"), "Tctl\n").unwrap();
        std::fs::write(k10.join("temp1_input"), "71500\n").unwrap();
        let m = read_machine(&root);
        assert_eq!(m.gtt_total, Some(128_849_018_880));
        assert_eq!(m.gtt_used, Some(102_005_473_280));
        assert_eq!(m.tctl_celsius, Some(71.5));
        let text = render_own(("device", "cpu"), true, None, &m, &Counters::default());
        assert!(text.contains("onebit_gtt_fault_zone 1\n"), "{text}");
        assert!(
            text.contains("onebit_gtt_bytes{kind=\"used\"} 102005473280\n"),
            "{text}"
        );
        assert!(text.contains("onebit_tctl_celsius 71.5\n"), "{text}");
        assert!(!text.contains("onebit_serve_starts"), "{text}");
        assert_eq!(read_machine(&root.join("nothing")), Machine::default());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// The runtime's live tasks are a series of their own (the soak samples it for leaks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn the_runtimes_live_tasks_are_counted() {
        let count = || {
            let text = render_own(
                ("device", "cpu"),
                true,
                None,
                &Machine::default(),
                &Counters::default(),
            );
            text.lines()
                .find_map(|l| l.strip_prefix("onebit_runtime_tasks "))
                .and_then(|n| n.parse::<i64>().ok())
                .unwrap_or_else(|| panic!("no onebit_runtime_tasks:\n{text}"))
        };
        let before = count();
        let waiting: Vec<_> = (0..3)
            .map(|_| tokio::spawn(std::future::pending::<()>()))
            .collect();
        assert_eq!(count(), before + 3);
        for task in &waiting {
            task.abort();
        }
        for task in waiting {
            let _ = task.await;
        }
        assert_eq!(count(), before);
        // Outside a runtime there is no such series.
        let text = std::thread::spawn(|| {
            render_own(
                ("device", "cpu"),
                true,
                None,
                &Machine::default(),
                &Counters::default(),
            )
        })
        .join()
        .unwrap();
        assert!(!text.contains("onebit_runtime_tasks"), "{text}");
    }
}
