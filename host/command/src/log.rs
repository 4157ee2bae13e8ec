//! serve's lines, through `tracing`: the one subscriber, set up by `main` before anything is
//! said, from `--log`/`ONEBIT_LOG` (a `tracing` filter) and `--log-format`/`ONEBIT_LOG_FORMAT`.
//!
//! Text (the default) writes each line exactly as serve always wrote it: an info, warning or
//! error event is its message alone, so the lines tests and Lemonade read are unchanged, and a
//! backend's own line (target [`BACKEND`]) is the backend's bytes. A debug or trace event is a
//! record: its message, then its fields as ` name=value` (the per-request line, target
//! [`REQUEST`]). JSON writes one object per line: `time` (RFC 3339, UTC), `level`, `target`,
//! `message` and `fields` (the event's, with those of the spans it is in: a request's
//! `request_id`, a backend line's `source`, `route` and `backend`).
//!
//! Each line is one `write` to stderr, as `eprintln!` did. An event the filter turns off costs
//! its callsite's cached interest (one load), nothing is formatted for it.

use std::fmt::Write as _;
use std::io::Write as _;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::cli::{LogArgs, LogFormat};

/// The target of a backend's own stderr lines.
pub const BACKEND: &str = "onebit::backend";
/// The target of the one line per request (`ONEBIT_LOG=debug`).
pub const REQUEST: &str = "onebit::request";

/// The libraries whose events a bare level does not raise above warn.
const QUIET_LIBRARIES: [&str; 4] = ["hyper", "hyper_util", "axum", "tower"];

/// Set up the process's subscriber. A filter `tracing` cannot read is the one-line error.
pub fn init(args: &LogArgs) -> Result<(), String> {
    let mut filter = EnvFilter::builder()
        .parse(&args.filter)
        .map_err(|e| {
            format!(
                "--log / ONEBIT_LOG: {:?} is not a tracing filter ({e}); use a level (error, warn, info, debug, trace) or target=level pairs such as info,onebit::request=debug",
                args.filter
            )
        })?;
    // A level names serve's lines: the libraries' own events (hyper-util's pool, axum's
    // rejections) stay at warn unless the filter names them, so `debug` adds the request line
    // and not theirs.
    for library in QUIET_LIBRARIES {
        if !args.filter.contains(library)
            && let Ok(directive) = format!("{library}=warn").parse()
        {
            filter = filter.add_directive(directive);
        }
    }
    let lines = Lines {
        json: args.log_format == LogFormat::Json,
    };
    // A second call (a test, say) keeps the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(lines.with_filter(filter))
        .try_init();
    Ok(())
}

/// The layer that writes each event as one line.
struct Lines {
    json: bool,
}

/// A span's fields, kept for the JSON lines of the events inside it.
struct SpanFields(Vec<(&'static str, Value)>);

impl<S> Layer<S> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        if !self.json {
            return;
        }
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields.rest));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let meta = event.metadata();
        let mut line = if self.json {
            let mut all = Map::new();
            if let Some(scope) = ctx.event_scope(event) {
                for span in scope.from_root() {
                    if let Some(SpanFields(own)) = span.extensions().get::<SpanFields>() {
                        for (name, value) in own {
                            all.insert((*name).to_string(), value.clone());
                        }
                    }
                }
            }
            for (name, value) in fields.rest {
                all.insert(name.to_string(), value);
            }
            let object = serde_json::json!({
                "time": now_rfc3339(),
                "level": meta.level().as_str(),
                "target": meta.target(),
                "message": fields.message,
                "fields": all,
            });
            object.to_string()
        } else {
            let mut text = fields.message;
            if *meta.level() >= Level::DEBUG {
                for (name, value) in &fields.rest {
                    match value {
                        Value::String(s) => {
                            let _ = write!(text, " {name}={s}");
                        }
                        other => {
                            let _ = write!(text, " {name}={other}");
                        }
                    }
                }
            }
            text
        };
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// An event's message and its other fields.
#[derive(Default)]
struct Fields {
    message: String,
    rest: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            self.rest.push((field.name(), Value::from(value)));
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.rest.push((field.name(), Value::from(value)));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.rest.push((field.name(), Value::from(value)));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.rest.push((field.name(), Value::from(value)));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.rest.push((field.name(), Value::from(value)));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            // `format_args!` debug-prints as its text.
            let _ = write!(self.message, "{value:?}");
        } else {
            self.rest
                .push((field.name(), Value::from(format!("{value:?}"))));
        }
    }
}

/// The time now, RFC 3339 in UTC with microseconds (`2026-05-01T12:00:00.000123Z`).
fn now_rfc3339() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60,
        now.subsec_micros()
    )
}

/// Days since 1970-01-01 to the proleptic Gregorian (year, month, day) (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_become_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }
}
