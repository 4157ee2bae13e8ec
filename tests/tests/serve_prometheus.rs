//! The Grafana dashboard (docs/grafana/1bit-serve.json) against a real Prometheus: Debian's
//! `prometheus` scrapes serve (the cpu route, the pinned llama-server and the default model) on
//! loopback while streamed chats go through, and every expression of every panel, asked of
//! Prometheus's HTTP API, returns data.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use onebit_tests::*;

/// Debian's Prometheus server, stopped (and reaped) when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Prometheus {
    /// Scraping `target` (host:port) every second; ready when its `/-/ready` answers 200.
    fn start(dir: &Path, target: &str) -> Prometheus {
        let binary = ["/usr/bin/prometheus", "/usr/sbin/prometheus"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .expect("Debian's prometheus server: apt-get install -y prometheus");
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: 1bit-serve\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("prometheus starts");
        let prometheus = Prometheus { child, port, log };
        let ready = wait_until(Duration::from_secs(60), || {
            get(&prometheus.url("/-/ready")).0 == 200
        });
        assert!(ready, "prometheus is not ready:\n{}", prometheus.log());
        prometheus
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// An instant query: the API's `data.result`.
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let mut url = self.url("/api/v1/query?query=");
        url.push_str(&percent_encoded(expr));
        let (status, body) = get(&url);
        assert_eq!(status, 200, "{expr}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{expr}: {body}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// A range query from `start` (Unix seconds) to now, one point a second: the API's
    /// `data.result`.
    fn query_range(&self, expr: &str, start: f64) -> Vec<serde_json::Value> {
        let end = unix_now();
        let mut url = self.url("/api/v1/query_range?query=");
        url.push_str(&percent_encoded(expr));
        url.push_str(&format!("&start={start:.3}&end={end:.3}&step=1"));
        let (status, body) = get(&url);
        assert_eq!(status, 200, "{expr}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every `expr` of every panel of the dashboard, Grafana's `$__rate_interval` made a range
/// that spans the test's scrapes.
fn dashboard_exprs() -> Vec<(String, String)> {
    let dashboard = dashboard();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("an expr");
            exprs.push((
                panel["title"].as_str().unwrap_or("").to_string(),
                expr.replace("$__rate_interval", "30s"),
            ));
        }
    }
    exprs
}

/// docs/grafana/1bit-serve.json, parsed.
fn dashboard() -> serde_json::Value {
    let path = route_fixture::root().join("docs/grafana/1bit-serve.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// The dashboard's panels as Prometheus answers their queries over the run begun at `start`,
/// for `cargo xtask dashboard` to draw: `{"panels": [{"title", "type", "unit", "series":
/// [{"legend", "points": [[seconds since start, value], ...]}]}]}`.
fn answered_panels(prometheus: &Prometheus, start: f64) -> serde_json::Value {
    let dashboard = dashboard();
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let mut series = Vec::new();
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "30s");
            let legend = target["legendFormat"].as_str().unwrap_or("");
            for answer in prometheus.query_range(&expr, start) {
                let points: Vec<[f64; 2]> = answer["values"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| {
                        let v: f64 = p[1].as_str()?.parse().ok()?;
                        v.is_finite().then_some([p[0].as_f64()? - start, v])
                    })
                    .collect();
                series.push(serde_json::json!({
                    "legend": legend_of(legend, &answer["metric"]),
                    "points": points,
                }));
            }
        }
        panels.push(serde_json::json!({
            "title": panel["title"],
            "type": panel["type"],
            "unit": panel["fieldConfig"]["defaults"]["unit"],
            "series": series,
        }));
    }
    serde_json::json!({
        "caption": "1bit serve, cpu route, SmolLM2-135M: six streamed chats as a real Prometheus scraped them",
        "panels": panels,
    })
}

/// Grafana's legend format with each `{{label}}` replaced by the series' label value.
fn legend_of(format: &str, metric: &serde_json::Value) -> String {
    let mut legend = format.to_string();
    if let Some(labels) = metric.as_object() {
        for (name, value) in labels {
            legend = legend.replace(&format!("{{{{{name}}}}}"), value.as_str().unwrap_or(""));
        }
    }
    legend
}

/// A sysfs with one amdgpu card's GTT (this machine has none), for the memory panel.
fn fake_sysfs(dir: &Path) -> PathBuf {
    let root = dir.join("sys");
    let dev = root.join("class/drm/card0/device");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("mem_info_gtt_total"), "68719476736\n").unwrap();
    std::fs::write(dev.join("mem_info_gtt_used"), "1073741824\n").unwrap();
    root
}

fn streamed_chats(serve: &Serve, n: usize) {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Count from one to ten."}],
        "temperature": 0,
        "max_tokens": 24,
        "stream": true,
    })
    .to_string();
    for _ in 0..n {
        let url = serve.url("/v1/chat/completions");
        let events = std::panic::catch_unwind(|| sse(&url, &body))
            .unwrap_or_else(|_| panic!("serve's log:\n{}", serve.output()));
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    }
}

#[test]
fn every_dashboard_expression_returns_data_from_a_real_prometheus() {
    let dir = temp_dir("prometheus");
    let sysfs = fake_sysfs(&dir);
    let state = dir.join("state");
    let server = installed_llama_server();
    let model = installed_model("SmolLM2-135M-Instruct-Q4_1.gguf");
    let serve = Serve::start(
        &[
            "-m",
            model.to_str().unwrap(),
            "--device",
            "cpu",
            "--ctx-size",
            "2048",
            "--llama-server",
            server.to_str().unwrap(),
        ],
        &[
            ("ONEBIT_SYSFS_ROOT", sysfs.to_str().unwrap()),
            ("ONEBIT_STATE_DIR", state.to_str().unwrap()),
        ],
    );
    assert!(
        serve.wait_health(200, Duration::from_secs(120)),
        "llama-server did not become ready:\n{}",
        serve.output()
    );
    let prometheus = Prometheus::start(&dir, &format!("127.0.0.1:{}", serve.port));
    let start = unix_now();
    let scraped = |expr: &str| !prometheus.query(expr).is_empty();
    assert!(
        wait_until(Duration::from_secs(30), || scraped("onebit_up")),
        "prometheus never scraped serve:\n{}",
        prometheus.log()
    );
    // Two bounded batches with scrapes between, so every rate has two samples that differ.
    streamed_chats(&serve, 3);
    std::thread::sleep(Duration::from_secs(3));
    streamed_chats(&serve, 3);
    assert!(
        wait_until(Duration::from_secs(30), || {
            prometheus
                .query("onebit_time_to_first_token_seconds_count")
                .iter()
                .any(|s| s["value"][1] == "6")
        }),
        "prometheus never saw the six streams:\n{}",
        prometheus.log()
    );
    std::thread::sleep(Duration::from_secs(2));
    let mut empty = Vec::new();
    for (panel, expr) in dashboard_exprs() {
        let result = prometheus.query(&expr);
        let values: Vec<f64> = result
            .iter()
            .filter_map(|s| s["value"][1].as_str()?.parse().ok())
            .collect();
        if !values.iter().any(|v| v.is_finite()) {
            empty.push(format!("{panel}: {expr} = {result:?}"));
        }
    }
    assert!(
        empty.is_empty(),
        "panels without data:\n{}",
        empty.join("\n")
    );
    // What the panels showed, for `cargo xtask dashboard` to draw (docs/grafana/1bit-serve.svg).
    if let Ok(path) = std::env::var("ONEBIT_DASHBOARD_DATA") {
        let answers = answered_panels(&prometheus, start);
        std::fs::write(path, answers.to_string()).unwrap();
    }
}
