//! The relay decision: one [`RelayPlan`] per request, made once from its head (and its body's
//! `stream` flag when it has a body), by whichever engine reads the request first.
//!
//! The plan says where the request goes (a backend, an answer of the route's table, the route
//! asked at run time, an in-process route, `--pm`'s tool loop), whether `--laya` picks its
//! backend by conversation, which rewrites it needs (the served name in the
//! reply, `--precise`, the served name in each streamed event), whether the watchdog tracks it,
//! and which engine can carry it. The fast engine carries the plans whose engine is
//! [`Engine::Fast`]; it hands every other request, with its plan, to the general engine, which
//! carries it without deciding again. Which headers pass in each direction ([`passes`]) and
//! the head the backend gets ([`upstream_head`]) are decided here too, once for both engines.

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};
use onebit_plugin_api::{Action, BodyKind, ReplyShape, Rule};
use serde::Deserialize;

use crate::App;
use crate::attribution::{self, Place};
use onebit_command::error::ApiError;
use onebit_features::laya::Routed;
use onebit_features::prompt_cache::sessions::{self, Api};
/// Which engine carries a request: also the label of `onebit_requests_total`.
pub use onebit_metrics::requests::Engine;
use onebit_supervision::backends::health::Status;

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
    /// Answered by the route in serve's own process (an `InProcess` rule, ABI 1.2 `respond`),
    /// not over a socket. Only the general engine carries it (`relay::in_process`): the route
    /// runs on a blocking thread and writes into a bounded sink.
    InProcess,
    /// `--pm`: a chat the Project Manager's tool loop answers (`pm::Pm::answer`): its rounds go
    /// to the backend with this index (the chat rule's), its delegations to Lemonade, and it
    /// writes the reply itself. Only the general engine carries it.
    ToolLoop(usize),
}

/// Whose choice the backend of a [`Target::Backend`] is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The rule's backend.
    Rule,
    /// `--laya`: its conversation's device's backend, which Laya picks from the body
    /// ([`RelayPlan::on_device`]); only the general engine reads a body for that.
    ByConversation,
    /// Laya picked the target's backend; the reply says why (`X-1bit-Route: <class>
    /// <confidence> <device>`).
    Chosen(HeaderValue),
}

/// The one decision for one request. Made by [`RelayPlan::for_head`], completed by
/// [`RelayPlan::with_body`]; read by both engines on the connection's task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayPlan {
    pub target: Target,
    /// Whether the rule or the conversation (`--laya`) chose the target's backend.
    pub device_choice: DeviceChoice,
    /// A generation: the route marked the rule as inference (chats, completions, the other
    /// routes that run the model): the watchdog tracks it, `--max-generations` counts it, and
    /// the rewrites below may apply.
    pub generation: bool,
    /// What the request's body is (the rule's kind for its method): what is read, checked
    /// and relayed.
    pub body: BodyKind,
    /// Where an inference reply names its model, for the served-name rewrites.
    pub reply: ReplyShape,
    /// The body asked for a streamed reply (`"stream": true`).
    pub streamed: bool,
    /// `--precise`: the body goes with `cache_prompt` false.
    pub precise: bool,
    /// Where Claude Code's attribution line would be in the body, by the API the path speaks
    /// (`relay::attribution::Place`; None: a request that cannot carry it).
    pub attribution: Option<Place>,
    /// A body that may begin its system prompt (Messages' `system`, a chat's first system
    /// message, Responses' `instructions`) with the line goes without it
    /// (`relay::attribution`; off with `--keep-attribution`).
    pub drop_attribution: bool,
    /// A whole JSON reply gets the served name in `model`.
    pub name_reply: bool,
    /// Each streamed event gets the served name in `model` (`Plan::rename_in_streams`).
    pub rename_stream: bool,
    /// The request holds a watchdog ticket (when serve runs a watchdog).
    pub watched: bool,
    /// The persistent prompt cache could prepare it: a chat or completion relayed to backend 0
    /// by its rule, serve keeping a cache.
    pub cacheable: bool,
    /// The cache prepares it (cacheable, and a body long enough to hold a prefix worth a
    /// state): the general engine asks `prompt_cache` before forwarding.
    pub prompt_cache: bool,
    /// An agent's request whose session the cache keeps apart from the others'
    /// (`prompt_cache::sessions`): a Messages or Responses request relayed to backend 0 by its
    /// rule, serve keeping a cache (from the head), and a body that may name a session.
    pub session: Option<Api>,
    /// Which engine can carry it.
    pub engine: Engine,
}

impl RelayPlan {
    /// The plan from the request's method and path: its rule in the route's table, and
    /// whether serve can take it now. A refusal (no rule: 404; not ready: 503) is the
    /// general engine's to send. The plan assumes no body until [`with_body`](Self::with_body).
    pub fn for_head(app: &App, method: &str, path: &str) -> Result<RelayPlan, ApiError> {
        let Some(rule) = app.settings.rule_for(method, path) else {
            return Err(ApiError::NotFound {
                method: method.to_string(),
                path: path.to_string(),
            });
        };
        let plan = RelayPlan::for_rule(app, method, path, rule);
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

    fn for_rule(app: &App, method: &str, path: &str, rule: &Rule) -> RelayPlan {
        let target = match &rule.action {
            // --pm: a chat the route relays is the PM's tool loop, on the same backend.
            Action::Proxy { backend }
                if app.pm.is_some() && onebit_features::pm::Pm::takes(method, path) =>
            {
                Target::ToolLoop(*backend)
            }
            Action::Proxy { backend } => Target::Backend(*backend),
            Action::AskRoute => Target::AskRoute,
            Action::InProcess => Target::InProcess,
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
        let body = rule.body.for_method(method);
        let cacheable = app.prompt_cache.is_some()
            && rule.inference
            && body == BodyKind::Json
            && target == Target::Backend(0)
            && onebit_features::prompt_cache::takes(path);
        // An agent's Messages or Responses request the cache may keep apart by its session.
        let cacheable_api = app.prompt_cache.is_some()
            && rule.inference
            && body == BodyKind::Json
            && target == Target::Backend(0);
        // --laya: an inference request goes to its conversation's device, read from its JSON.
        let device_choice = if app.laya.is_some()
            && rule.inference
            && body == BodyKind::Json
            && matches!(target, Target::Backend(_))
        {
            DeviceChoice::ByConversation
        } else {
            DeviceChoice::Rule
        };
        RelayPlan {
            target,
            device_choice,
            generation: rule.inference,
            body,
            reply: rule.reply,
            streamed: false,
            precise: false,
            attribution: Place::of(path, rule.reply),
            drop_attribution: false,
            name_reply: false,
            rename_stream: false,
            watched: false,
            cacheable,
            prompt_cache: false,
            session: match Place::of(path, rule.reply) {
                Some(Place::System) if cacheable_api => Some(Api::Messages),
                Some(Place::Instructions) if cacheable_api => Some(Api::Responses),
                _ => None,
            },
            engine: Engine::General,
        }
        .settle(
            app.settings.precise,
            app.settings.rename_in_streams,
            app.settings.names_model,
        )
    }

    /// The plan once the body and its `stream` flag are known (false and empty without a JSON
    /// body). A body shorter than the cache's minimum in bytes holds fewer tokens than that,
    /// so the cache is not asked (and the fast engine may carry it). A body that may hold
    /// Claude Code's attribution line where its API puts a system prompt is the general
    /// engine's, to drop it.
    pub fn with_body(mut self, app: &App, streamed: bool, body: &[u8]) -> RelayPlan {
        self.streamed = streamed;
        self.prompt_cache = self.cacheable
            && app
                .prompt_cache
                .as_ref()
                .is_some_and(|cache| body.len() >= cache.min_tokens());
        self.drop_attribution =
            attribution::to_drop(self.attribution, app.settings.keep_attribution, body);
        self.session = self
            .session
            .filter(|api| sessions::may_name_one(*api, body));
        self.settle(
            app.settings.precise,
            app.settings.rename_in_streams,
            app.settings.names_model,
        )
    }

    /// Work out the rewrites, the watch and the engine from the target and the flags.
    fn settle(mut self, precise: bool, rename_in_streams: bool, names_model: bool) -> RelayPlan {
        // The served-name rules hold for an in-process answer as for a relayed one; the
        // watchdog covers only a backend's progress (an in-process route has no child to kill).
        // The PM's tool loop writes its own reply (the served name in it) from whole rounds,
        // which it sends itself: --precise reaches its rounds, nothing else does.
        let tool_loop = matches!(self.target, Target::ToolLoop(_));
        let relayed = matches!(self.target, Target::Backend(_) | Target::AskRoute);
        let answered = relayed || self.target == Target::InProcess;
        let generating = answered && self.generation;
        // --precise sets a JSON field: a body of another kind goes as it came.
        let json = self.body == BodyKind::Json;
        self.precise = (generating || tool_loop && self.generation) && json && precise;
        self.drop_attribution &= generating && json;
        self.name_reply = generating && !self.streamed && names_model;
        self.rename_stream = generating && self.streamed && rename_in_streams;
        self.watched = relayed && self.generation;
        self.prompt_cache &= !self.precise;
        self.session = self.session.filter(|_| generating && json && !self.precise);
        // A choice made from the body (--laya) is the general engine's to make and carry.
        let by_rule = self.device_choice == DeviceChoice::Rule;
        self.engine = match self.target {
            Target::InProcess => Engine::InProcess,
            Target::Backend(_)
                if by_rule
                    && !self.precise
                    && !self.drop_attribution
                    && !self.prompt_cache
                    && self.session.is_none() =>
            {
                Engine::Fast
            }
            _ => Engine::General,
        };
        self
    }

    /// `--laya`: the plan once Laya has picked the conversation's device (`laya::Laya::route`
    /// on the body): that device's backend becomes the target, and the reply will say why.
    /// None (a body that opens no conversation) keeps the rule's backend. Any other plan is
    /// returned as it is. The engine stays the general one, which asked. Called by the general
    /// engine once the body is read; never blocks.
    pub fn on_device(mut self, routed: Option<Routed>) -> RelayPlan {
        if self.device_choice != DeviceChoice::ByConversation {
            return self;
        }
        match routed {
            Some(routed) => {
                self.target = Target::Backend(routed.backend);
                self.device_choice = DeviceChoice::Chosen(routed.header);
            }
            None => self.device_choice = DeviceChoice::Rule,
        }
        self
    }

    /// Whether the fast engine can carry it.
    pub fn fast(&self) -> bool {
        self.engine == Engine::Fast
    }
}

impl RelayPlan {
    /// The plan completed with the request's whole body, on the general engine: the device
    /// `--laya` picks by the conversation (its backend), and the body's rewrites: `--precise`
    /// (`cache_prompt` false: every chat and completion prefilled whole, as a cold run is) and
    /// Claude Code's attribution line dropped (it changes every turn, so the engine's cached
    /// prefix would end at it; `--keep-attribution` keeps it). Awaits `--laya`'s scorer, at
    /// most its bound.
    pub async fn placed(self, app: &App, body: bytes::Bytes) -> (RelayPlan, bytes::Bytes) {
        let plan = match &app.laya {
            Some(laya) if self.device_choice == DeviceChoice::ByConversation => {
                self.on_device(laya.route(&body).await)
            }
            _ => self,
        };
        let body = if plan.precise {
            without_prompt_cache(body)
        } else {
            body
        };
        let body = match plan.attribution {
            Some(place) if plan.drop_attribution => attribution::without_attribution(body, place),
            _ => body,
        };
        let body = match (&app.prompt_cache, plan.session) {
            (Some(cache), Some(api)) => cache.keep_session(api, body).await,
            _ => body,
        };
        (plan, body)
    }
}

/// The request body with `cache_prompt` false, so the backend reuses no cached prefix.
pub fn without_prompt_cache(body: bytes::Bytes) -> bytes::Bytes {
    let Ok(mut value) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return body;
    };
    match value.as_object_mut() {
        Some(object) => {
            object.insert("cache_prompt".to_string(), serde_json::Value::Bool(false));
            serde_json::to_vec(&value)
                .map(bytes::Bytes::from)
                .unwrap_or(body)
        }
        None => body,
    }
}

/// A request the fast engine read, judged and planned, handed to the general engine with its
/// connection: the general engine takes the plan instead of deciding again. Rides as a request
/// extension on the first request hyper reads from the handed connection.
#[derive(Clone, Debug)]
pub struct HandedPlan {
    pub plan: RelayPlan,
    /// The body was read and checked by its kind (for JSON: UTF-8, an object, an accepted
    /// Content-Type) by the fast engine; false when it had not all arrived.
    pub body_checked: bool,
}

// Which headers pass, and the backend's request head: part of the same decision.

/// Headers that belong to one connection, not to the message (lowercase, as `http` keeps
/// names); both relay paths drop them.
const HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether a header (any case) belongs to one connection, not to the message.
pub fn is_hop_header(name: &str) -> bool {
    HOP_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h))
}

/// Whether a header (any case) is a CORS header. llama-server answers any Origin with
/// `Access-Control-Allow-Origin` (and credentials), which would let any web page read the
/// replies it can make a browser request; serve sends no CORS headers at all
/// (docs/security.md).
pub fn is_cors_header(name: &str) -> bool {
    name.get(..15)
        .is_some_and(|p| p.eq_ignore_ascii_case("access-control-"))
}

/// The direction a message is passed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// The client's request, to the backend.
    Upstream,
    /// The backend's reply, to the client; `cors`: the user's `--cors-origins` allows origins
    /// (`Settings::cors`), so the reply's CORS headers pass.
    Reply { cors: bool },
}

/// Whether a header of a message passed on in `way` goes through: not a hop-by-hop header, not
/// one its `Connection` headers name (`connection`: their values as sent), and besides, toward
/// the backend, not `Host` or `Content-Length` (the engine writes its own) nor
/// `Authorization` or `X-Api-Key` (the API key stays with serve), and toward the client, no CORS
/// header unless the user's `--cors-origins` allows origins (`guard::cors`). Framing headers of a reply (`Content-Length`) are the engine's.
/// Called per header by both engines on the connection's task; never blocks or allocates.
pub fn passes(way: Direction, name: &str, connection: &[&[u8]]) -> bool {
    if is_hop_header(name) || named_by_connection(name, connection) {
        return false;
    }
    // The request's id is serve's to send and to answer with (`relay::request_id`): a
    // client's or backend's own goes no further.
    if name.eq_ignore_ascii_case(crate::request_id::HEADER) {
        return false;
    }
    match way {
        // Authorization is serve's (its API key) or nothing the backend asked for: serve's
        // backends take no key, and a client's key must not reach them.
        Direction::Upstream => {
            !name.eq_ignore_ascii_case("host")
                && !name.eq_ignore_ascii_case("content-length")
                && !name.eq_ignore_ascii_case("authorization")
                && !name.eq_ignore_ascii_case(onebit_features::guard::X_API_KEY)
        }
        Direction::Reply { cors } => cors || !is_cors_header(name),
    }
}

/// Whether one of the `Connection` header values names `name` (a header that belongs to this
/// connection only, RFC 9110 7.6.1).
fn named_by_connection(name: &str, connection: &[&[u8]]) -> bool {
    connection.iter().any(|value| {
        value
            .split(|b| *b == b',')
            .any(|token| token.trim_ascii().eq_ignore_ascii_case(name.as_bytes()))
    })
}

/// [`passes`] applied to a header map (the general engine's messages).
pub fn filter(way: Direction, headers: &mut HeaderMap) {
    let connection: Vec<Vec<u8>> = headers
        .get_all(header::CONNECTION)
        .iter()
        .map(|v| v.as_bytes().to_vec())
        .collect();
    let connection: Vec<&[u8]> = connection.iter().map(Vec::as_slice).collect();
    let dropped: Vec<HeaderName> = headers
        .keys()
        .filter(|name| !passes(way, name.as_str(), &connection))
        .cloned()
        .collect();
    for name in dropped {
        headers.remove(name);
    }
}

/// What serve itself puts in a backend's request head, beside the client's headers.
#[derive(Clone, Copy)]
pub struct UpstreamLine<'a> {
    pub method: &'a str,
    pub target: &'a str,
    /// The backend's port, for `Host`.
    pub port: u16,
    /// The body's length, when the request has one.
    pub body_len: Option<usize>,
    /// The request's id (`relay::request_id`), sent as `X-Request-Id`.
    pub request_id: &'a [u8],
}

/// The request head the backend gets, appended to `out`: the client's method and target,
/// `Host` naming the backend, the client's headers that pass [`Direction::Upstream`] (given its
/// `Connection` header values), the request's `X-Request-Id`, and `Content-Length` when the
/// request has a body. The fast engine writes it as is; the general engine's hyper client
/// writes the same head from the map [`filter`] leaves.
pub fn upstream_head<'h>(
    out: &mut Vec<u8>,
    line: &UpstreamLine<'_>,
    headers: impl Iterator<Item = (&'h str, &'h [u8])>,
    connection: &[&[u8]],
) {
    let UpstreamLine {
        method,
        target,
        port,
        body_len,
        request_id,
    } = *line;
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: 127.0.0.1:");
    out.extend_from_slice(port.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if !passes(Direction::Upstream, name, connection) {
            continue;
        }
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"X-Request-Id: ");
    out.extend_from_slice(request_id);
    out.extend_from_slice(b"\r\n");
    if let Some(len) = body_len {
        out.extend_from_slice(b"Content-Length: ");
        out.extend_from_slice(len.to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

// The body's checks by its kind: one function, for both engines.

/// Only the one field serve needs from a request body; serde still checks the whole body is
/// well-formed JSON and an object, without building it.
#[derive(Deserialize)]
struct RequestShape {
    #[serde(default)]
    stream: Option<bool>,
}

/// Content types serve reads as JSON: `application/json` and `+json` types (any parameters),
/// and `application/x-www-form-urlencoded`, which `curl -d` sends for a JSON body. A browser
/// form's other types (`text/plain`, `multipart/form-data`) are refused for a JSON body (a
/// rule whose body is a multipart upload takes the latter); see docs/security.md.
pub fn json_content_type(value: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
        || essence.eq_ignore_ascii_case("application/x-www-form-urlencoded")
        || essence
            .get(..12)
            .is_some_and(|p| p.eq_ignore_ascii_case("application/"))
            && essence
                .get(essence.len().saturating_sub(5)..)
                .is_some_and(|s| s.eq_ignore_ascii_case("+json"))
}

/// Whether a Content-Type is a `multipart/form-data` upload with its boundary (any case, any
/// other parameters).
pub fn multipart_content_type(value: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    let mut parts = text.split(';');
    let essence = parts.next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("multipart/form-data")
        && parts.any(|p| {
            p.split_once('=').is_some_and(|(name, value)| {
                name.trim().eq_ignore_ascii_case("boundary") && !value.trim().is_empty()
            })
        })
}

/// Refuse a Content-Type the body's kind does not take: JSON's (see [`json_content_type`];
/// none is fine), a multipart upload's (see [`multipart_content_type`]; it must say its
/// boundary); a raw body or none takes any. Called before a byte of the body is read.
pub fn check_content_type(kind: BodyKind, content_type: Option<&[u8]>) -> Result<(), ApiError> {
    let shown = |ct: &[u8]| String::from_utf8_lossy(ct).chars().take(100).collect();
    match (kind, content_type) {
        (BodyKind::Json | BodyKind::ByMethod, Some(ct)) if !json_content_type(ct) => {
            Err(ApiError::BadContentType(shown(ct)))
        }
        (BodyKind::Multipart, Some(ct)) if !multipart_content_type(ct) => {
            Err(ApiError::NotMultipart(shown(ct)))
        }
        (BodyKind::Multipart, None) => Err(ApiError::NotMultipart(String::new())),
        _ => Ok(()),
    }
}

/// The checks of a request body by its kind: for JSON, an accepted Content-Type, UTF-8, one
/// JSON object (serde checks the whole body without building it), and its `stream` flag is
/// returned; for a multipart upload, its Content-Type; a raw body (or none) is not looked at.
/// False for any body but JSON. Called by both engines on the connection's task, once per
/// request: the fast engine passes a body it checked on with [`HandedPlan::body_checked`].
pub fn check_body(
    kind: BodyKind,
    content_type: Option<&[u8]>,
    body: &[u8],
) -> Result<bool, ApiError> {
    check_content_type(kind, content_type)?;
    if !matches!(kind, BodyKind::Json | BodyKind::ByMethod) {
        return Ok(false);
    }
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::BadJson(format!("it is not UTF-8: {e}")));
    }
    match serde_json::from_slice::<RequestShape>(body) {
        Ok(shape) => Ok(shape.stream.unwrap_or(false)),
        Err(e) => Err(ApiError::BadJson(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(target: Target, generation: bool, streamed: bool) -> RelayPlan {
        RelayPlan {
            target,
            device_choice: DeviceChoice::Rule,
            generation,
            body: BodyKind::Json,
            reply: ReplyShape::OpenAi,
            streamed,
            precise: false,
            attribution: None,
            drop_attribution: false,
            session: None,
            name_reply: false,
            rename_stream: false,
            watched: false,
            cacheable: false,
            prompt_cache: false,
            engine: Engine::General,
        }
    }

    #[test]
    fn the_fast_engine_carries_what_needs_no_rewrite() {
        // A streamed inference request, plainly proxied: fast, watched.
        let p = plan(Target::Backend(0), true, true).settle(false, false, true);
        assert_eq!((p.engine, p.watched), (Engine::Fast, true));
        // Not inference (tokenize, embeddings): fast, not watched.
        let p = plan(Target::Backend(0), false, false).settle(true, true, true);
        assert_eq!((p.engine, p.watched), (Engine::Fast, false));
        // A non-streamed inference reply gets the served name, in the whole reply: fast.
        let p = plan(Target::Backend(0), true, false).settle(false, false, true);
        assert_eq!((p.engine, p.name_reply), (Engine::Fast, true));
        // --precise rewrites the body: general. Renaming the events is the reply's phases',
        // on either engine: fast.
        let p = plan(Target::Backend(0), true, true).settle(true, false, true);
        assert_eq!((p.engine, p.precise), (Engine::General, true));
        let p = plan(Target::Backend(0), true, true).settle(false, true, true);
        assert_eq!((p.engine, p.rename_stream), (Engine::Fast, true));
        // The route asked, or the table's answer: general; in process: its own engine.
        assert_eq!(
            plan(Target::AskRoute, true, true)
                .settle(false, false, true)
                .engine,
            Engine::General
        );
        let answer = Target::Answer {
            status: 501,
            content_type: "application/json".into(),
            body: "{}".into(),
        };
        let p = plan(answer, true, false).settle(true, true, true);
        assert_eq!(
            (p.engine, p.watched, p.precise),
            (Engine::General, false, false)
        );
        assert_eq!(
            plan(Target::InProcess, false, false)
                .settle(false, false, true)
                .engine,
            Engine::InProcess
        );
    }

    #[test]
    fn the_pm_and_laya_are_the_general_engines_to_carry() {
        // --pm: the tool loop, streamed or not, is general; --precise reaches its rounds; it
        // names the model itself and holds no ticket of its own.
        for streamed in [false, true] {
            let p = plan(Target::ToolLoop(0), true, streamed).settle(true, true, true);
            assert_eq!(p.engine, Engine::General);
            assert!(p.precise && !p.name_reply && !p.rename_stream && !p.watched);
        }
        // --laya: a streamed inference request that would go fast waits for Laya's choice.
        let mut by_conversation = plan(Target::Backend(0), true, true);
        by_conversation.device_choice = DeviceChoice::ByConversation;
        let p = by_conversation.settle(false, false, true);
        assert_eq!((p.engine, p.watched), (Engine::General, true));
        // Laya's pick becomes the target, and the header rides on the plan.
        let header = HeaderValue::from_static("code 0.90 hrx");
        let chosen = p.clone().on_device(Some(Routed {
            backend: 2,
            header: header.clone(),
        }));
        assert_eq!(chosen.target, Target::Backend(2));
        assert_eq!(chosen.device_choice, DeviceChoice::Chosen(header));
        assert_eq!(chosen.engine, Engine::General);
        // No conversation in the body: the rule's backend.
        let kept = p.on_device(None);
        assert_eq!(
            (kept.target, kept.device_choice),
            (Target::Backend(0), DeviceChoice::Rule)
        );
        // A plan Laya does not decide is left alone.
        let plain = plan(Target::Backend(1), false, false).settle(false, false, true);
        let routed = Routed {
            backend: 3,
            header: HeaderValue::from_static("x"),
        };
        assert_eq!(plain.clone().on_device(Some(routed)), plain);
    }

    #[test]
    fn hop_connection_named_cors_and_framing_headers_do_not_pass() {
        let conn: &[&[u8]] = &[b"keep-alive, X-Secret"];
        for name in [
            "Connection",
            "Keep-Alive",
            "TE",
            "Transfer-Encoding",
            "x-secret",
        ] {
            assert!(!passes(Direction::Upstream, name, conn), "{name}");
            assert!(
                !passes(Direction::Reply { cors: false }, name, conn),
                "{name}"
            );
        }
        assert!(!passes(Direction::Upstream, "Host", conn));
        assert!(!passes(Direction::Upstream, "content-length", conn));
        assert!(passes(
            Direction::Reply { cors: false },
            "content-type",
            conn
        ));
        assert!(!passes(
            Direction::Reply { cors: false },
            "Access-Control-Allow-Origin",
            conn
        ));
        assert!(passes(
            Direction::Upstream,
            "Access-Control-Request-Method",
            conn
        ));
        assert!(passes(Direction::Upstream, "x-secret-not", conn));
    }

    #[test]
    fn the_upstream_head_names_the_backend_and_its_own_length() {
        let headers: [(&str, &[u8]); 6] = [
            ("Host", b"localhost:8080"),
            ("x-request-id", b"the client's"),
            ("Connection", b"close, X-Drop"),
            ("X-Drop", b"1"),
            ("Content-Length", b"7"),
            ("Content-Type", b"application/json"),
        ];
        let mut out = Vec::new();
        let line = UpstreamLine {
            method: "POST",
            target: "/v1/x?a=1",
            port: 9000,
            body_len: Some(2),
            request_id: b"0123456789abcdef",
        };
        upstream_head(
            &mut out,
            &line,
            headers.iter().copied(),
            &[b"close, X-Drop"],
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/x?a=1 HTTP/1.1\r\nHost: 127.0.0.1:9000\r\n\
             Content-Type: application/json\r\nX-Request-Id: 0123456789abcdef\r\n\
             Content-Length: 2\r\n\r\n"
        );
    }

    #[test]
    fn a_header_map_is_filtered_by_the_same_rule() {
        let mut headers = HeaderMap::new();
        headers.insert("access-control-allow-origin", "*".parse().unwrap());
        headers.insert(header::CONNECTION, "x-hop".parse().unwrap());
        headers.insert("x-hop", "1".parse().unwrap());
        headers.insert(header::CONTENT_TYPE, "text/plain".parse().unwrap());
        filter(Direction::Reply { cors: false }, &mut headers);
        assert_eq!(headers.len(), 1);
        assert!(headers.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn json_content_types() {
        for yes in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/x-www-form-urlencoded",
            "application/vnd.api+json",
        ] {
            assert!(json_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "text/plain",
            "multipart/form-data; boundary=x",
            "application/xml",
            "",
            "+json",
        ] {
            assert!(!json_content_type(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn multipart_content_types_name_their_boundary() {
        for yes in [
            "multipart/form-data; boundary=x",
            "Multipart/Form-Data; charset=utf-8; BOUNDARY=\"a b\"",
        ] {
            assert!(multipart_content_type(yes.as_bytes()), "{yes}");
        }
        for no in [
            "multipart/form-data",
            "multipart/form-data; boundary=",
            "multipart/mixed; boundary=x",
            "application/json",
            "",
        ] {
            assert!(!multipart_content_type(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn each_body_kind_gets_its_own_checks() {
        let json = Some(&b"application/json"[..]);
        let form = Some(&b"multipart/form-data; boundary=B"[..]);
        let upload =
            b"--B\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\n\xff\x00\r\n--B--\r\n";
        // JSON: an object, its stream flag read; an upload is refused.
        assert_eq!(
            check_body(BodyKind::Json, json, br#"{"stream":true}"#),
            Ok(true)
        );
        assert!(matches!(
            check_body(BodyKind::Json, form, upload),
            Err(ApiError::BadContentType(_))
        ));
        assert!(matches!(
            check_body(BodyKind::Json, None, b"[1]"),
            Err(ApiError::BadJson(_))
        ));
        // A multipart upload: bytes that are neither UTF-8 nor JSON pass; JSON is refused.
        assert_eq!(check_body(BodyKind::Multipart, form, upload), Ok(false));
        assert!(matches!(
            check_body(BodyKind::Multipart, json, br#"{"file":1}"#),
            Err(ApiError::NotMultipart(_))
        ));
        assert!(matches!(
            check_body(BodyKind::Multipart, None, upload),
            Err(ApiError::NotMultipart(_))
        ));
        // Raw: anything.
        assert_eq!(
            check_body(BodyKind::Raw, Some(b"text/plain"), b"[1]"),
            Ok(false)
        );
        assert_eq!(check_body(BodyKind::Raw, None, upload), Ok(false));
    }

    #[test]
    fn dropping_the_attribution_line_is_the_general_engines() {
        // A streamed Messages request, or chat completion, whose body may hold the line:
        // general, to drop it.
        let mut messages = plan(Target::Backend(0), true, true);
        messages.reply = ReplyShape::Anthropic;
        messages.attribution = Some(Place::System);
        messages.drop_attribution = true;
        let p = messages.clone().settle(false, false, true);
        assert_eq!((p.engine, p.drop_attribution), (Engine::General, true));
        let mut chat = plan(Target::Backend(0), true, true);
        chat.attribution = Some(Place::FirstSystemMessage);
        chat.drop_attribution = true;
        let p = chat.settle(false, false, true);
        assert_eq!((p.engine, p.drop_attribution), (Engine::General, true));
        // Not a generation, or not JSON: nothing to drop; fast.
        let mut counted = messages.clone();
        counted.generation = false;
        let p = counted.settle(false, false, true);
        assert_eq!((p.engine, p.drop_attribution), (Engine::Fast, false));
        let mut upload = messages;
        upload.body = BodyKind::Multipart;
        let p = upload.settle(false, false, true);
        assert_eq!((p.engine, p.drop_attribution), (Engine::Fast, false));
    }

    #[test]
    fn precise_rewrites_only_a_json_body() {
        let mut upload = plan(Target::Backend(0), true, false);
        upload.body = BodyKind::Multipart;
        let p = upload.settle(true, false, true);
        assert!(!p.precise && p.watched && p.name_reply);
        let p = plan(Target::Backend(0), true, false).settle(true, false, true);
        assert!(p.precise);
    }

    #[test]
    fn a_json_body_must_be_one_object() {
        let json = Some(&b"application/json"[..]);
        assert_eq!(
            check_body(BodyKind::Json, json, br#"{"stream":true,"x":[1]}"#),
            Ok(true)
        );
        assert_eq!(check_body(BodyKind::Json, json, br#"{"x":1}"#), Ok(false));
        for bad in [&b"[1,2]"[..], b"{bad", b"", b"\xff{}"] {
            assert!(
                matches!(
                    check_body(BodyKind::Json, json, bad),
                    Err(ApiError::BadJson(_))
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // 1.3 and older rules: a POST body is checked as JSON.
        assert!(check_body(BodyKind::ByMethod, json, b"[1]").is_err());
    }
}
