//! Whether a request is the fast engine's: its head read, its plan made, its body all here
//! within the grace, and then the backend request made ([`Fast`]); else what is still due, or
//! the hand-over to the general engine with the plan so far ([`Verdict`]).

use super::*;
use crate::reply_loop::ReplyPhases;

/// What [`qualify`] found.
// Made once per request and moved once: boxing the fast variant would add an allocation to
// the hot path for nothing.
#[allow(clippy::large_enum_variant)]
pub(super) enum Verdict {
    /// The fast engine carries it: what to send where, and its reply's phases holding the
    /// request's exchange, admitted and sending (phases 1 to 5 of `relay::exchange`).
    Fast(Fast, ReplyPhases),
    /// The head has not all arrived (and is not yet too large).
    HeadDue,
    /// The plan so far is the fast engine's; the body has not all arrived.
    BodyDue(RelayPlan),
    /// Not a fast request (malformed and too large heads included: the general engine answers
    /// them), with its plan when the request got that far.
    HandOver(Option<HandedPlan>),
}

/// A request that qualified: what to send where.
pub(super) struct Fast {
    pub(super) port: u16,
    /// The backend request, head and body.
    pub(super) upstream: Vec<u8>,
    /// Bytes of the client's buffer the request took.
    pub(super) consumed: usize,
    /// The client asked to close after this reply.
    pub(super) close: bool,
    /// Sent to the backend, and on the reply.
    pub(super) id: RequestId,
}

/// Read the request at the start of `buf` and decide it: the transport conditions the fast
/// engine needs (a whole HTTP/1.1 head, no Transfer-Encoding, Expect or Upgrade, a body of at
/// most 256 KiB), the guard, the request's [`RelayPlan`], its admission, and the backend
/// request. Runs on the connection's task; never blocks.
pub(super) fn qualify(app: &Arc<App>, buf: &[u8], began: Instant) -> Verdict {
    let mut storage = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let head = match wire::read_head(buf, &mut storage) {
        Head::Whole(head) => head,
        Head::Due => return Verdict::HeadDue,
        Head::Unfit => return Verdict::HandOver(None),
    };
    let (method, target, path, head_len) = (head.method, head.target, head.path, head.head_len);
    let seen = Seen {
        method: method.as_bytes(),
        hosts: head.hosts(),
        authority: None,
        origins: head.origins(),
    };
    if guard::check(app.settings.guard, app.settings.cors.as_deref(), &seen).is_err() {
        return Verdict::HandOver(None);
    }
    // The API key: a refusal (401) is the general engine's to send.
    if let Some(key) = &app.settings.api_key
        && !guard::key::open_path(path)
        && key.admits(head.authorization(), head.x_api_key()).is_err()
    {
        return Verdict::HandOver(None);
    }
    // A refusal (404, 503) is the general engine's to send.
    let Ok(plan) = RelayPlan::for_head(app, method, path) else {
        return Verdict::HandOver(None);
    };
    // From here the request is judged: a hand-over carries its plan.
    let decided = |plan, body_checked| Verdict::HandOver(Some(HandedPlan { plan, body_checked }));
    let Target::Backend(backend) = plan.target else {
        return decided(plan, false);
    };

    // The rule's kind says whether there is a body to relay: a body sent where none is
    // read (a GET's, say) is the general engine's to drop.
    let has_body = plan.body != BodyKind::None;
    let body_len = head.content_length.unwrap_or(0);
    if !has_body && body_len > 0 {
        return decided(plan, false);
    }
    if body_len > app.settings.body_limit.min(MAX_FAST_BODY) {
        return decided(plan, false);
    }
    let Some(body) = buf.get(head_len..head_len + body_len) else {
        return Verdict::BodyDue(plan);
    };
    let mut streamed = false;
    if has_body {
        // A body that fails a check gets its refusal from the general engine.
        match plan::check_body(plan.body, head.content_type, body) {
            Ok(stream) => streamed = stream,
            Err(_) => return decided(plan, false),
        }
    }
    let plan = plan.with_body(app, streamed, body);
    let Some(port) = app
        .settings
        .ports
        .get(backend)
        .copied()
        .filter(|_| plan.fast())
    else {
        return decided(plan, has_body);
    };

    // Admission: a refusal is the general engine's to send (it admits the request again).
    let mut exchange = Exchange::begin(app, Engine::Fast, PathClass::of(path), began);
    let id = RequestId::for_request(head.request_ids());
    exchange.record(id, Record::logged(method, path));
    if exchange.admit(&plan).is_err() {
        return decided(plan, has_body);
    }
    exchange.sending(&plan, method, path, backend, body_len);

    let mut upstream = Vec::with_capacity(head_len + body_len + 64);
    let line = plan::UpstreamLine {
        method,
        target,
        port,
        body_len: has_body.then_some(body_len),
        request_id: id.as_bytes(),
    };
    plan::upstream_head(
        &mut upstream,
        &line,
        head.headers.iter().map(|h| (h.name, h.value)),
        head.connection(),
    );
    upstream.extend_from_slice(body);
    let fast = Fast {
        port,
        upstream,
        consumed: head_len + body_len,
        close: head.close,
        id,
    };
    let mut phases = ReplyPhases::new(&app.replies, &plan, exchange.deadline());
    phases.holds(exchange);
    Verdict::Fast(fast, phases)
}
