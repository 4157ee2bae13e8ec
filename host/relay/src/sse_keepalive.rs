//! SSE keep-alive: a streamed reply whose backend has been silent for `--sse-keepalive-s`
//! seconds (a long prefill, say) gets an SSE comment, `: keep-alive`, at an event boundary, so
//! a client that gives up on a silent stream (Lemonade 11.8's stall timer) keeps it. When a
//! comment is due is the reply's phases' (`reply_loop`); what it is, the early stream's head,
//! and where a stream's events stand are here.

/// The default of `--sse-keepalive-s`: well under every client window met (Lemonade 11.8.0's
/// 120 s stall, its later `global_timeout` of 600 s).
pub const DEFAULT_SECS: u64 = onebit_command::cli::SSE_KEEPALIVE_DEFAULT_S;

/// The comment sent: a line starting with `:` is ignored by every SSE parser.
pub const COMMENT: &[u8] = b": keep-alive\n\n";
/// The same, as one chunk of a chunked body (14 bytes = 0xe).
pub const COMMENT_CHUNK: &[u8] = b"e\r\n: keep-alive\n\n\r\n";

/// The head serve sends for a stream whose backend has not answered yet: the reply is then an
/// event stream whatever the backend says, in chunks.
pub const EARLY_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n";

/// Whether the events relayed so far stand at an event boundary, where a comment may go:
/// nothing yet, or the bytes end with a blank line. Fed every event byte the client gets, in
/// order (the transfer coding undone); never blocks.
#[derive(Debug)]
pub struct SseEdge {
    /// The last three event bytes (a blank line is `\n\n` or `\n\r\n`).
    tail: [u8; 3],
}

impl Default for SseEdge {
    fn default() -> Self {
        SseEdge { tail: [b'\n'; 3] }
    }
}

impl SseEdge {
    /// Feed event bytes as relayed to the client.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in &bytes[bytes.len().saturating_sub(3)..] {
            self.tail = [self.tail[1], self.tail[2], b];
        }
    }

    /// Whether a comment may go now: between events.
    pub fn at_boundary(&self) -> bool {
        self.tail[1..] == *b"\n\n" || self.tail == *b"\n\r\n"
    }
}

#[cfg(test)]
#[path = "sse_keepalive_tests.rs"]
mod tests;
