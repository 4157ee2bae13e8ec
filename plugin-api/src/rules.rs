//! A plan's request table: how each method and path is handled (its action, body kind and
//! reply shape), and the pinned llama-server's own table that the llama-server routes start
//! from. Carried in the plan as JSON, like every type of `types`.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// How one method and path is handled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Rule {
    /// `GET`, `POST`, `DELETE`, ...
    pub method: String,
    /// An exact path, or a prefix ending in `*` (`/slots/*`).
    pub path: String,
    /// What the host does with a request that matches.
    pub action: Action,
    /// The request is a generation (what the host's relay calls `RelayPlan::generation`): a
    /// chat, completion, Responses, Anthropic Messages, `/infill` or transcription request in
    /// [`llama_server_rules`]. The watchdog tracks it, `--max-generations` counts it, a
    /// streamed one gets keep-alive comments and the token clock, and a non-streamed JSON reply
    /// gets the served model name. (The field keeps its 1.0 name: routes set it by it.)
    pub inference: bool,
    /// 1.4: what the request's body is, and so what the host checks before it relays it; by
    /// default, as 1.3 and older: none for `GET` and `HEAD`, a JSON object for any other
    /// method.
    pub body: BodyKind,
    /// 1.4: where an inference reply names its model, for the served-name rewrite; by
    /// default OpenAI's shape.
    pub reply: ReplyShape,
}

/// What a request's body is (ABI 1.4), and what the host checks before relaying it. Whatever
/// the kind, a body is relayed byte for byte (`--precise` aside) and held to the body limit
/// and time limit; only [`BodyKind::Json`] is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BodyKind {
    /// The rule of 1.3 and older routes: [`BodyKind::None`] for `GET` and `HEAD`,
    /// [`BodyKind::Json`] for any other method ([`BodyKind::for_method`]).
    #[default]
    ByMethod,
    /// One JSON object, sent with a JSON Content-Type (or none): its `stream` flag says whether
    /// the reply is streamed. Anything else is refused with 400.
    Json,
    /// A `multipart/form-data` upload (a file, say: `/v1/audio/transcriptions`), with its
    /// boundary: relayed as it came, never parsed. Another Content-Type is refused with 400.
    Multipart,
    /// No body: none is read or relayed (`GET /slots`, `DELETE /v1/stream`).
    None,
    /// Any bytes, any Content-Type, relayed unchecked: for a body the backend alone can judge
    /// (llama-server's `/cors-proxy`, whose body is the proxied request's, or a JSON array).
    Raw,
}

impl BodyKind {
    /// The kind for a request of `method`: [`BodyKind::ByMethod`] resolved, any other kind as
    /// it is. Pure.
    pub fn for_method(self, method: &str) -> BodyKind {
        match self {
            BodyKind::ByMethod if method == "GET" || method == "HEAD" => BodyKind::None,
            BodyKind::ByMethod => BodyKind::Json,
            kind => kind,
        }
    }
}

/// Where an inference reply names its model (ABI 1.4), so the host puts the served name there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyShape {
    /// OpenAI's (and llama-server's own): `model` at the top of a whole reply and of each
    /// streamed event.
    #[default]
    OpenAi,
    /// Anthropic's Messages API: `model` at the top of a whole reply; in a stream, only the
    /// `message_start` event names it, inside its `message`.
    Anthropic,
}

/// What the host does with a request that matches a rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Relay it unchanged to `backends[backend]`, same method, path and query.
    Proxy {
        /// The backend's index in the plan.
        backend: usize,
    },
    /// Answer it directly.
    Answer {
        /// The HTTP status.
        status: u16,
        /// The reply's `Content-Type`.
        content_type: String,
        /// The reply's body.
        body: String,
    },
    /// Ask the route ([`crate::DeviceRoute::forward`]) on a blocking thread.
    AskRoute,
    /// 1.2: the route answers it itself, streaming ([`crate::DeviceRoute::respond`], on a
    /// blocking thread the host owns for the request).
    InProcess,
}

/// The request table of a route whose backend is a llama-server: every route the pinned
/// llama-server registers, relayed unchanged to `backends[backend]`, except those serve
/// answers itself (`/health`, `/v1/health`, `/v1/models`, `/models`, `/metrics`) and slot save
/// and restore (`POST /slots/*`), which each route decides. Inference routes (chats,
/// completions, Responses, Anthropic's Messages, `/infill`, transcriptions) are marked; each
/// rule says its body's kind and, for inference, its reply's shape. A route adds its own rules
/// before or after (the first match wins): the public llama-server routes answer
/// `POST /slots/*` with 501, say. Called by a route's `plan`.
///
/// The routes of llama-server's router mode (`POST /models`, `/models/load`, ...) are relayed
/// too: a llama-server that is no router answers them 404 itself, as it would directly.
pub fn llama_server_rules(backend: usize) -> Vec<Rule> {
    use BodyKind::{Json, Multipart, None as NoBody, Raw};
    let rule =
        |method: &str, path: &str, inference: bool, body: BodyKind, reply: ReplyShape| Rule {
            method: method.to_string(),
            path: path.to_string(),
            action: Action::Proxy { backend },
            inference,
            body,
            reply,
        };
    let openai = ReplyShape::OpenAi;
    let generation = |path: &str| rule("POST", path, true, Json, openai);
    let post = |path: &str| rule("POST", path, false, Json, openai);
    let get = |path: &str| rule("GET", path, false, NoBody, openai);
    vec![
        // Generation: OpenAI's, llama.cpp's own, Anthropic's.
        generation("/v1/chat/completions"),
        generation("/chat/completions"),
        generation("/v1/completions"),
        generation("/completions"),
        generation("/completion"),
        generation("/v1/responses"),
        generation("/responses"),
        generation("/infill"),
        rule("POST", "/v1/messages", true, Json, ReplyShape::Anthropic),
        rule("POST", "/v1/audio/transcriptions", true, Multipart, openai),
        rule("POST", "/audio/transcriptions", true, Multipart, openai),
        // A control action on a generation in flight (`reasoning_end`): no generation itself.
        post("/v1/chat/completions/control"),
        // Token counts, templates, tokens.
        post("/v1/chat/completions/input_tokens"),
        post("/chat/completions/input_tokens"),
        post("/v1/responses/input_tokens"),
        post("/responses/input_tokens"),
        post("/v1/messages/count_tokens"),
        post("/tokenize"),
        post("/detokenize"),
        post("/apply-template"),
        // Embeddings, reranking, decisions.
        post("/v1/embeddings"),
        post("/embeddings"),
        post("/embedding"),
        post("/v1/rerank"),
        post("/rerank"),
        post("/v1/reranking"),
        post("/reranking"),
        post("/v1/systemone"),
        // The server's state.
        get("/slots"),
        get("/props"),
        post("/props"),
        get("/lora-adapters"),
        // Its body is a JSON array, which llama-server checks.
        rule("POST", "/lora-adapters", false, Raw, openai),
        // Resumable streams (a replay of a generation another request runs).
        get("/v1/stream"),
        rule("DELETE", "/v1/stream", false, NoBody, openai),
        post("/v1/streams/lookup"),
        // The Web UI's helpers: 403 unless llama-server was started with them.
        get("/tools"),
        post("/tools"),
        get("/cors-proxy"),
        rule("POST", "/cors-proxy", false, Raw, openai),
        // Router mode.
        post("/models"),
        post("/models/load"),
        post("/models/unload"),
        get("/models/sse"),
        rule("DELETE", "/models", false, NoBody, openai),
    ]
}

impl Default for Action {
    fn default() -> Self {
        Action::Proxy { backend: 0 }
    }
}
