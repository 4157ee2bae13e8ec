//! The fast engine's keep-alive comments in a relayed event stream's silences.

use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::reply_head::ReplyHead;
use crate::busy_poll::BusyPollStream;
use crate::sse_keepalive::{self, SseEdge};
use crate::wire::Framing;
use onebit_metrics::Counters;

/// Keep-alive comments in an event stream's silences. Comments go only into a stream whose
/// framing has room for them: chunks, or a body that ends at the close (which the client gets
/// chunked). One timer for the whole reply, moved on lazily: a read only notes its time, and
/// the timer, when it fires early, is set again for `every` after the last byte.
pub(super) struct Silences {
    every: Duration,
    pub(super) edge: SseEdge,
    pub(super) timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    pub(super) last_byte: tokio::time::Instant,
}

impl Silences {
    /// For a reply with this head, when keep-alive is on (`keepalive`) and the reply is an
    /// event stream with room for comments.
    pub(super) fn for_reply(
        keepalive: Option<Duration>,
        head: &ReplyHead,
        sent: &Counters,
    ) -> Option<Silences> {
        let every = keepalive.filter(|_| head.event_stream)?;
        let edge = match head.framing {
            Framing::Chunked => SseEdge::new(sse_keepalive::Framing::Chunked, sent),
            Framing::UntilClose => SseEdge::new(sse_keepalive::Framing::Payload, sent),
            _ => return None,
        };
        Some(Silences {
            every,
            edge,
            timer: Box::pin(tokio::time::sleep(every)),
            last_byte: tokio::time::Instant::now(),
        })
    }

    /// The timer fired: a comment when the silence has lasted `every` and the stream is
    /// between events, else the timer set again for the silence's end. Err: the client left.
    pub(super) async fn fired(&mut self, client: &mut BusyPollStream) -> Result<(), ()> {
        let now = tokio::time::Instant::now();
        let due = self.last_byte + self.every;
        if now < due {
            self.timer.as_mut().reset(due);
            return Ok(());
        }
        // The client's reply is chunked either way (a body to the close is re-framed), so the
        // comment goes as a chunk.
        if self.edge.at_boundary() {
            self.edge.count_comment();
            client
                .write_all(sse_keepalive::COMMENT_CHUNK)
                .await
                .map_err(|_| ())?;
        }
        self.last_byte = now;
        self.timer.as_mut().reset(now + self.every);
        Ok(())
    }
}
