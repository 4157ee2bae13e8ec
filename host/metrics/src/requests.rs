//! serve's request series: `onebit_requests_total` by route path class, status class and the
//! relay engine that carried the request, `onebit_request_added_seconds`, the time serve
//! itself adds to a relayed request, and the per-request timing only serve sees, by path class
//! and engine: `onebit_request_duration_seconds` (the request in hand to its reply's end),
//! `onebit_time_to_first_token_seconds` (a streamed inference request in hand to the first
//! body bytes written to the client) and `onebit_inter_token_seconds` (between the writes of
//! one stream's events); `onebit_requests_in_flight` is the relay's gauge.
//!
//! The added time is serve's own handling on either side of the backend: from the request's
//! head in serve's hands to the request written to the backend, plus from the backend's reply
//! head read to the reply head written (fast engine) or handed to hyper (general engine). The
//! backend's own time (from the request written to its reply head read) is left out, and so
//! are the kernel's socket hops and, on the general engine, hyper's parsing and writing, which
//! happen outside serve's code. `cargo xtask bench hop` measures the whole hop from outside.

use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Which relay engine carried a request (`relay::plan` decides it).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Engine {
    /// The fast engine, on the raw socket.
    Fast,
    /// The general engine (hyper, axum): rewrites, refusals, serve's own routes.
    General,
    /// An in-process route.
    InProcess,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Fast => "fast",
            Engine::General => "general",
            Engine::InProcess => "in_process",
        }
    }

    const COUNT: usize = 3;

    fn index(self) -> usize {
        self as usize
    }
}

impl EncodeLabelValue for Engine {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

/// The kind of route a request asked for: a closed set, so a client cannot grow the series.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum PathClass {
    /// `/v1/chat/completions`, `/chat/completions`.
    Chat,
    /// `/v1/completions`, `/completion`, `/completions`.
    Completion,
    /// `/v1/embeddings`, `/embedding(s)`.
    Embedding,
    /// A status read: `/health`, `/metrics`, `/props`, `/slots`, `/models` (with or without
    /// `/v1`). Not counted in any series, so a scrape or a health poll never changes what the
    /// next scrape shows (as llama-server's own counters leave them out).
    Status,
    /// Anything else (tokenize, a slot's save or restore, unknown paths).
    Other,
}

impl PathClass {
    /// The class of a request path (no query). Called per request; never allocates.
    pub fn of(path: &str) -> PathClass {
        let path = path.strip_prefix("/v1").unwrap_or(path);
        match path {
            "/chat/completions" => PathClass::Chat,
            "/completions" | "/completion" => PathClass::Completion,
            "/embeddings" | "/embedding" => PathClass::Embedding,
            "/health" | "/metrics" | "/props" | "/slots" | "/models" => PathClass::Status,
            _ => PathClass::Other,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            PathClass::Chat => "chat",
            PathClass::Completion => "completion",
            PathClass::Embedding => "embedding",
            PathClass::Status => "status",
            PathClass::Other => "other",
        }
    }

    const COUNT: usize = 5;

    fn index(self) -> usize {
        self as usize
    }
}

impl EncodeLabelValue for PathClass {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

/// A status's first digit: `2xx` .. `5xx`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct StatusClass(u8);

impl StatusClass {
    pub fn of(status: u16) -> StatusClass {
        StatusClass((status / 100).clamp(1, 5) as u8)
    }

    const COUNT: usize = 5;

    fn index(self) -> usize {
        usize::from(self.0 - 1)
    }
}

impl EncodeLabelValue for StatusClass {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        write!(encoder, "{}xx", self.0)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    path_class: PathClass,
    status_class: StatusClass,
    engine: Engine,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineLabels {
    engine: Engine,
}

/// The histogram's bounds, in seconds: serve adds tens of microseconds to a relayed request.
const ADDED_BUCKETS: [f64; 12] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3,
];

fn added_histogram() -> Histogram {
    Histogram::new(ADDED_BUCKETS)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    path_class: PathClass,
    engine: Engine,
}

/// Bounds for local inference, in seconds: a token in a millisecond to a reply in two minutes.
const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

type Latency = Family<RouteLabels, Histogram, fn() -> Histogram>;

/// A family's children by label set, each taken from the family at its first use and kept: a
/// request then records with the child's own atomics, without the family's lock and map (two
/// to four lookups a request, and one per streamed event, otherwise). The children stay the
/// family's, so `/metrics` renders them as before, and a label set never used is not shown.
struct Children<T, const N: usize>([OnceLock<T>; N]);

impl<T, const N: usize> Default for Children<T, N> {
    fn default() -> Self {
        Children(std::array::from_fn(|_| OnceLock::new()))
    }
}

impl<T: Clone, const N: usize> Children<T, N> {
    fn get(&self, index: usize, make: impl FnOnce() -> T) -> &T {
        self.0[index].get_or_init(make)
    }
}

const ROUTES: usize = PathClass::COUNT * Engine::COUNT;

fn route_index(labels: &RouteLabels) -> usize {
    labels.path_class.index() * Engine::COUNT + labels.engine.index()
}

/// A latency family and its children by path class and engine.
struct Timed {
    family: Latency,
    children: Children<Histogram, ROUTES>,
}

impl Timed {
    fn new() -> Timed {
        Timed {
            family: Family::new_with_constructor(latency_histogram),
            children: Children::default(),
        }
    }

    fn observe(&self, labels: &RouteLabels, seconds: f64) {
        self.children
            .get(route_index(labels), || {
                self.family.get_or_create(labels).clone()
            })
            .observe(seconds);
    }
}

/// One stream's clock: the first write of body bytes is its first token, each later write
/// the time since the one before.
pub struct StreamClock {
    began: Instant,
    last: Option<Instant>,
    labels: RouteLabels,
}

impl StreamClock {
    /// A stream of a request that was in hand at `began`.
    pub fn new(began: Instant, path: PathClass, engine: Engine) -> StreamClock {
        StreamClock {
            began,
            last: None,
            labels: RouteLabels {
                path_class: path,
                engine,
            },
        }
    }

    /// Body bytes of the stream were just written to the client.
    pub fn wrote(&mut self, series: &RequestSeries) {
        let now = Instant::now();
        match self.last {
            None => series
                .first_token
                .observe(&self.labels, now.duration_since(self.began).as_secs_f64()),
            Some(last) => series
                .inter_token
                .observe(&self.labels, now.duration_since(last).as_secs_f64()),
        }
        self.last = Some(now);
        if !series.streamed.load(Ordering::Relaxed) {
            series.streamed.store(true, Ordering::Relaxed);
        }
    }
}

/// The request series, kept in `App` for serve's life. Both engines record into it on the
/// connection's task: a few atomic adds, no lock after a label set's first use.
pub struct RequestSeries {
    requests: Family<RequestLabels, Counter>,
    counters: Children<Counter, { PathClass::COUNT * StatusClass::COUNT * Engine::COUNT }>,
    added: Family<EngineLabels, Histogram, fn() -> Histogram>,
    added_by_engine: Children<Histogram, { Engine::COUNT }>,
    duration: Timed,
    first_token: Timed,
    inter_token: Timed,
    /// Whether each has a sample yet: a series without one is left out, not shown empty.
    counted: AtomicBool,
    timed: AtomicBool,
    lasted: AtomicBool,
    streamed: AtomicBool,
}

impl Default for RequestSeries {
    fn default() -> Self {
        RequestSeries {
            requests: Family::default(),
            counters: Children::default(),
            added: Family::new_with_constructor(added_histogram),
            added_by_engine: Children::default(),
            duration: Timed::new(),
            first_token: Timed::new(),
            inter_token: Timed::new(),
            counted: AtomicBool::new(false),
            timed: AtomicBool::new(false),
            lasted: AtomicBool::new(false),
            streamed: AtomicBool::new(false),
        }
    }
}

impl RequestSeries {
    /// One request answered with `status` (counted when its reply head goes out).
    pub fn count(&self, path: PathClass, status: u16, engine: Engine) {
        onebit_supervision::heap_trim::worked();
        if path == PathClass::Status {
            return;
        }
        let labels = RequestLabels {
            path_class: path,
            status_class: StatusClass::of(status),
            engine,
        };
        let index = (path.index() * StatusClass::COUNT + labels.status_class.index())
            * Engine::COUNT
            + engine.index();
        self.counters
            .get(index, || self.requests.get_or_create(&labels).clone())
            .inc();
        if !self.counted.load(Ordering::Relaxed) {
            self.counted.store(true, Ordering::Relaxed);
        }
    }

    /// The time serve added to one relayed request (see the module's text).
    pub fn added(&self, path: PathClass, engine: Engine, added: Duration) {
        if path == PathClass::Status {
            return;
        }
        self.added_by_engine
            .get(engine.index(), || {
                self.added.get_or_create(&EngineLabels { engine }).clone()
            })
            .observe(added.as_secs_f64());
        if !self.timed.load(Ordering::Relaxed) {
            self.timed.store(true, Ordering::Relaxed);
        }
    }

    /// One request's whole time, from in hand to its reply's end (or the client's leaving).
    pub fn lasted(&self, path: PathClass, engine: Engine, lasted: Duration) {
        if path == PathClass::Status {
            return;
        }
        self.duration.observe(
            &RouteLabels {
                path_class: path,
                engine,
            },
            lasted.as_secs_f64(),
        );
        if !self.lasted.load(Ordering::Relaxed) {
            self.lasted.store(true, Ordering::Relaxed);
        }
    }

    /// The series as Prometheus text, with the relay's requests in flight now and the times
    /// busy polling paused; each histogram is left out until it has a sample.
    pub fn render(&self, in_flight: usize, busy_poll_pauses: u64) -> String {
        let mut registry = Registry::default();
        let gauge = Gauge::<i64>::default();
        gauge.set(i64::try_from(in_flight).unwrap_or(i64::MAX));
        registry.register(
            "onebit_requests_in_flight",
            "Relayed requests in flight: read, and their reply not yet ended",
            gauge,
        );
        registry.register(
            "onebit_busy_poll_pauses",
            "Times busy polling paused (a second, doubled while the machine stays starved): a yield of the CPU came back late",
            ConstCounter::new(busy_poll_pauses),
        );
        if self.lasted.load(Ordering::Relaxed) {
            registry.register(
                "onebit_request_duration_seconds",
                "Requests from in hand to their reply's end, by route path class and engine",
                self.duration.family.clone(),
            );
        }
        if self.streamed.load(Ordering::Relaxed) {
            registry.register(
                "onebit_time_to_first_token_seconds",
                "Streamed inference requests from in hand to their first body bytes written to the client",
                self.first_token.family.clone(),
            );
            registry.register(
                "onebit_inter_token_seconds",
                "Time between the writes of one stream's events to the client",
                self.inter_token.family.clone(),
            );
        }
        if self.counted.load(Ordering::Relaxed) {
            registry.register(
                "onebit_requests",
                "Requests answered, by route path class, status class and the relay engine that carried them",
                self.requests.clone(),
            );
        }
        if self.timed.load(Ordering::Relaxed) {
            registry.register(
                "onebit_request_added_seconds",
                "serve's own time on a relayed request, the backend's time left out",
                self.added.clone(),
            );
        }
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &registry);
        super::text::strict_004(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_counter_is_typed_under_its_sample_name() {
        let requests = RequestSeries::default();
        requests.count(PathClass::Chat, 200, Engine::Fast);
        let text = requests.render(0, 0);
        assert!(
            text.contains("# TYPE onebit_requests_total counter"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
    }

    #[test]
    fn paths_fall_in_a_closed_set_of_classes() {
        assert_eq!(PathClass::of("/v1/chat/completions"), PathClass::Chat);
        assert_eq!(PathClass::of("/chat/completions"), PathClass::Chat);
        assert_eq!(PathClass::of("/completion"), PathClass::Completion);
        assert_eq!(PathClass::of("/v1/embeddings"), PathClass::Embedding);
        assert_eq!(PathClass::of("/v1/health"), PathClass::Status);
        assert_eq!(PathClass::of("/props"), PathClass::Status);
        assert_eq!(PathClass::of("/v1/models"), PathClass::Status);
        assert_eq!(PathClass::of("/slots/0"), PathClass::Other);
        assert_eq!(PathClass::of("/v1/chat/completions/x"), PathClass::Other);
        assert_eq!(PathClass::of("/tokenize"), PathClass::Other);
    }

    #[test]
    fn the_series_render_with_typed_labels() {
        let series = RequestSeries::default();
        assert!(
            !series.render(0, 0).contains("_seconds"),
            "no sample, no histogram"
        );
        series.count(PathClass::Chat, 200, Engine::Fast);
        series.count(PathClass::Chat, 200, Engine::Fast);
        series.count(PathClass::Other, 404, Engine::General);
        series.added(PathClass::Chat, Engine::Fast, Duration::from_micros(30));
        let text = series.render(3, 0);
        assert!(text.contains("onebit_requests_in_flight 3"), "{text}");
        assert!(
            text.contains(
                r#"onebit_requests_total{path_class="chat",status_class="2xx",engine="fast"} 2"#
            ),
            "{text}"
        );
        assert!(text.contains(
            r#"onebit_requests_total{path_class="other",status_class="4xx",engine="general"} 1"#
        ));
        assert!(
            text.contains(r#"onebit_request_added_seconds_bucket{le="5e-5",engine="fast"} 1"#)
                || text.contains(
                    r#"onebit_request_added_seconds_bucket{le="0.00005",engine="fast"} 1"#
                ),
            "{text}"
        );
    }

    #[test]
    fn status_reads_are_in_no_series() {
        let series = RequestSeries::default();
        series.count(PathClass::Chat, 200, Engine::Fast);
        let before = series.render(0, 0);
        for path in ["/metrics", "/health", "/v1/models", "/props", "/slots"] {
            let class = PathClass::of(path);
            series.count(class, 200, Engine::General);
            series.added(class, Engine::Fast, Duration::from_micros(30));
            series.lasted(class, Engine::General, Duration::from_millis(2));
        }
        assert_eq!(series.render(0, 0), before);
    }
}
