//! The relay decision: one [`RelayPlan`] per request, made once from its head (and its body's
//! `stream` flag when it has a body), by whichever engine reads the request first.
//!
//! The plan says where the request goes (a backend, an answer of the route's table, the route
//! asked at run time, an in-process route), which rewrites it needs (the served name in the
//! reply, `--precise`, the served name in each streamed event), whether the watchdog tracks it,
//! and which engine can carry it. The fast engine carries the plans whose engine is
//! [`Engine::Fast`]; it hands every other request, with its plan, to the general engine, which
//! carries it without deciding again.

use onebit_plugin_api::{Action, Rule};

use crate::backends::health::Status;
use crate::error::ApiError;
/// Which engine carries a request: also the label of `onebit_requests_total`.
pub use crate::metrics::requests::Engine;
use crate::relay::App;

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Straight to the backend with this index in the plan's order (a `Proxy` rule).
    Backend(usize),
    /// The route's table answers it itself (an `Answer` rule, e.g. a 501).
    Answer {
        status: u16,
        content_type: String,
        body: String,
    },
    /// The route is asked at run time (`forward`): a backend with a rewritten body, or an
    /// answer. Only the general engine carries it (it calls into the route on a blocking
    /// thread).
    AskRoute,
    /// Answered by an in-process route, not over a socket. No table names one yet; the general
    /// engine's `relay::in_process` is the seam where one is wired.
    InProcess,
}

/// The one decision for one request. Made by [`RelayPlan::for_head`], completed by
/// [`RelayPlan::with_body`]; read by both engines on the connection's task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayPlan {
    pub target: Target,
    /// The route marked the rule as inference (chats, completions): the watchdog tracks it,
    /// and the rewrites below may apply.
    pub inference: bool,
    /// The body asked for a streamed reply (`"stream": true`).
    pub streamed: bool,
    /// `--precise`: the body goes with `cache_prompt` false.
    pub precise: bool,
    /// A whole JSON reply gets the served name in `model`.
    pub name_reply: bool,
    /// Each streamed event gets the served name in `model` (`Plan::rename_in_streams`).
    pub rename_stream: bool,
    /// The request holds a watchdog ticket (when serve runs a watchdog).
    pub watched: bool,
    /// Which engine can carry it.
    pub engine: Engine,
}

impl RelayPlan {
    /// The plan from the request's method and path: its rule in the route's table, and
    /// whether serve can take it now. A refusal (no rule: 404; not ready: 503) is the
    /// general engine's to send. The plan assumes no body until [`with_body`](Self::with_body).
    pub fn for_head(app: &App, method: &str, path: &str) -> Result<RelayPlan, ApiError> {
        let Some(rule) = app.rule_for(method, path) else {
            return Err(ApiError::NotFound {
                method: method.to_string(),
                path: path.to_string(),
            });
        };
        let plan = RelayPlan::for_rule(app, rule);
        if !matches!(plan.target, Target::Answer { .. }) {
            // An answer of the table needs no backend; everything else needs serve ready.
            match app.status() {
                Status::Ready => {}
                Status::Loading => {
                    return Err(ApiError::Unavailable(
                        "the model is loading; retry when /health answers 200".into(),
                    ));
                }
                Status::Down(reason) | Status::Failed(reason) => {
                    return Err(ApiError::Unavailable(reason));
                }
            }
        }
        Ok(plan)
    }

    fn for_rule(app: &App, rule: &Rule) -> RelayPlan {
        let target = match &rule.action {
            Action::Proxy { backend } => Target::Backend(*backend),
            Action::AskRoute => Target::AskRoute,
            Action::Answer {
                status,
                content_type,
                body,
            } => Target::Answer {
                status: *status,
                content_type: content_type.clone(),
                body: body.clone(),
            },
        };
        RelayPlan {
            target,
            inference: rule.inference,
            streamed: false,
            precise: false,
            name_reply: false,
            rename_stream: false,
            watched: false,
            engine: Engine::General,
        }
        .settle(app.precise, app.rename_in_streams)
    }

    /// The plan once the body's `stream` flag is known (false without a body).
    pub fn with_body(mut self, app: &App, streamed: bool) -> RelayPlan {
        self.streamed = streamed;
        self.settle(app.precise, app.rename_in_streams)
    }

    /// Work out the rewrites, the watch and the engine from the target and the flags.
    fn settle(mut self, precise: bool, rename_in_streams: bool) -> RelayPlan {
        let relayed = matches!(self.target, Target::Backend(_) | Target::AskRoute);
        let inference = relayed && self.inference;
        self.precise = inference && precise;
        self.name_reply = inference && !self.streamed;
        self.rename_stream = inference && self.streamed && rename_in_streams;
        self.watched = inference;
        self.engine = match self.target {
            Target::InProcess => Engine::InProcess,
            Target::Backend(_) if !self.precise && !self.name_reply && !self.rename_stream => {
                Engine::Fast
            }
            _ => Engine::General,
        };
        self
    }

    /// Whether the fast engine can carry it.
    pub fn fast(&self) -> bool {
        self.engine == Engine::Fast
    }
}

/// A request the fast engine read, judged and planned, handed to the general engine with its
/// connection: the general engine takes the plan instead of deciding again. Rides as a request
/// extension on the first request hyper reads from the handed connection.
#[derive(Clone, Debug)]
pub struct Decided {
    pub plan: RelayPlan,
    /// The body was read and checked (UTF-8, a JSON object, an accepted Content-Type) by the
    /// fast engine; false when it had not all arrived.
    pub body_checked: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(target: Target, inference: bool, streamed: bool) -> RelayPlan {
        RelayPlan {
            target,
            inference,
            streamed,
            precise: false,
            name_reply: false,
            rename_stream: false,
            watched: false,
            engine: Engine::General,
        }
    }

    #[test]
    fn the_fast_engine_carries_what_needs_no_rewrite() {
        // A streamed inference request, plainly proxied: fast, watched.
        let p = plan(Target::Backend(0), true, true).settle(false, false);
        assert_eq!((p.engine, p.watched), (Engine::Fast, true));
        // Not inference (tokenize, embeddings): fast, not watched.
        let p = plan(Target::Backend(0), false, false).settle(true, true);
        assert_eq!((p.engine, p.watched), (Engine::Fast, false));
        // A non-streamed inference reply gets the served name: general.
        let p = plan(Target::Backend(0), true, false).settle(false, false);
        assert_eq!((p.engine, p.name_reply), (Engine::General, true));
        // --precise rewrites the body; renaming streams rewrites the events.
        let p = plan(Target::Backend(0), true, true).settle(true, false);
        assert_eq!((p.engine, p.precise), (Engine::General, true));
        let p = plan(Target::Backend(0), true, true).settle(false, true);
        assert_eq!((p.engine, p.rename_stream), (Engine::General, true));
        // The route asked, or the table's answer: general; in process: its own engine.
        assert_eq!(
            plan(Target::AskRoute, true, true)
                .settle(false, false)
                .engine,
            Engine::General
        );
        let answer = Target::Answer {
            status: 501,
            content_type: "application/json".into(),
            body: "{}".into(),
        };
        let p = plan(answer, true, false).settle(true, true);
        assert_eq!(
            (p.engine, p.watched, p.precise),
            (Engine::General, false, false)
        );
        assert_eq!(
            plan(Target::InProcess, false, false)
                .settle(false, false)
                .engine,
            Engine::InProcess
        );
    }
}
