//! A generation's deadline (`--max-generation-s`): set by `Exchange::admit` for a generation
//! when serve has one, and ended by the reply's phases (`reply_loop::ReplyPhases::woke`)
//! whatever carries the reply.

use std::time::Duration;

use onebit_command::error::ApiError;
use onebit_metrics::Counters;
use tokio::time::Instant;

/// When a generation must be over, and where its end is counted.
#[derive(Clone, Debug)]
pub struct Deadline {
    at: Instant,
    after: Duration,
    counted: Counters,
}

impl Deadline {
    /// A deadline `after` from now, counted in `counted` when it ends a request.
    pub fn new(after: Duration, counted: &Counters) -> Deadline {
        Deadline {
            at: Instant::now() + after,
            after,
            counted: counted.clone(),
        }
    }

    /// When it passes.
    pub fn at(&self) -> Instant {
        self.at
    }

    /// The error a reply not yet begun gets (504).
    pub fn error(&self) -> ApiError {
        ApiError::GenerationDeadline { after: self.after }
    }

    /// The error's JSON body, for the last event of a stream of events under way.
    pub fn body(&self) -> String {
        let error = self.error();
        onebit_command::error::openai_error_body(
            error.status(),
            error.error_type(),
            &error.message(),
        )
    }

    /// The deadline ended a request: counted (`onebit_generation_deadlines_total`) and said,
    /// once per request.
    pub fn ended(&self) {
        self.counted.deadline_passed();
        tracing::info!(
            "1bit serve: a generation was ended by --max-generation-s {}",
            self.after.as_secs()
        );
    }
}
