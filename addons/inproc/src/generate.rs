//! One completion on a loaded session: the prompt decoded, tokens sampled until an end token,
//! a stop string or the token budget, and the text handed out as it becomes final.

use std::time::Instant;

use crate::ffi::{Session, Token};

/// The one context and the tokens it holds, in order (what the next prompt may reuse). Held
/// behind the route's mutex: one request at a time.
pub struct Slot<'a> {
    pub session: Session<'a>,
    pub cached: Vec<Token>,
}

/// How one request samples and when it stops.
#[derive(Clone, Debug)]
pub struct Settings {
    /// At most this many new tokens (None: until the context is full).
    pub max_tokens: Option<u32>,
    /// 0 (or less) is greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// The sampler's seed (llama.cpp's "random" value 0xFFFFFFFF when the request has none).
    pub seed: u32,
    /// Strings that end the completion; the text stops before the first one found.
    pub stop: Vec<String>,
}

/// Why generation ended, as OpenAI's `finish_reason` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    /// The client left (`emit` said so): nothing more is sent.
    Gone,
}

impl Finish {
    pub fn reason(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Gone => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a completion took.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub finish: Finish,
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the last request's context instead of decoded again.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
}

/// Why a completion could not run: a request error (the prompt does not fit) or the engine's.
#[derive(Debug)]
pub enum Failure {
    /// The client's fault: answered 400.
    Request(String),
    /// The engine failed: answered 500.
    Engine(String),
}

/// Run one completion of `prompt`. Calls `emit` with each piece of final text (never a
/// partial UTF-8 character, never text that might still turn out to start a stop string);
/// `emit` returns false once the client is gone, which stops generation at that token.
/// Called on the request's blocking thread with the session held; blocks for the whole
/// generation.
pub fn complete(
    slot: &mut Slot<'_>,
    prompt: &str,
    settings: &Settings,
    mut emit: impl FnMut(&str) -> bool,
) -> Result<Outcome, Failure> {
    let session = &slot.session;
    let started = Instant::now();
    let tokens = session.tokenize(prompt).map_err(Failure::Engine)?;
    let n_ctx = session.n_ctx() as usize;
    if tokens.is_empty() {
        return Err(Failure::Request(
            "the prompt is empty; send some text to complete".to_string(),
        ));
    }
    if tokens.len() >= n_ctx {
        return Err(Failure::Request(format!(
            "the prompt is {} tokens and the context holds {n_ctx}; shorten it or serve with a larger --ctx-size",
            tokens.len()
        )));
    }
    let room = n_ctx - tokens.len();
    let budget = settings.max_tokens.map_or(room, |m| (m as usize).min(room));
    // Reuse the longest prefix the context already holds, but decode at least the prompt's
    // last token: its logits choose the first new token.
    let common = slot
        .cached
        .iter()
        .zip(&tokens)
        .take_while(|(a, b)| a == b)
        .count();
    let mut reused = common.min(tokens.len() - 1);
    if reused == 0 || !session.keep_first(reused) {
        session.clear();
        reused = 0;
    }
    // Until this request's decodes succeed, the context's contents are unknown.
    slot.cached.clear();
    session.decode(&tokens[reused..]).map_err(Failure::Engine)?;
    slot.cached.extend_from_slice(&tokens);
    let prompt_ms = started.elapsed().as_secs_f64() * 1000.0;
    let predicting = Instant::now();

    let mut sampler = session.sampler(settings.temperature, settings.top_p, settings.seed);
    let mut text = StopScan::new(&settings.stop);
    let mut generated = 0usize;
    let finish = loop {
        if generated >= budget {
            break Finish::Length;
        }
        let token = session.sample(&mut sampler);
        if session.is_end(token) {
            break Finish::Stop;
        }
        generated += 1;
        let (ready, stopped) = text.push(&session.piece(token, false));
        if !ready.is_empty() && !emit(&ready) {
            break Finish::Gone;
        }
        if stopped {
            break Finish::Stop;
        }
        if generated < budget {
            if let Err(e) = session.decode(&[token]) {
                slot.cached.clear();
                return Err(Failure::Engine(e));
            }
            slot.cached.push(token);
        }
    };
    if finish != Finish::Gone {
        let rest = text.finish();
        if !rest.is_empty() {
            emit(&rest);
        }
    }
    Ok(Outcome {
        finish,
        prompt_tokens: tokens.len(),
        cached_tokens: reused,
        completion_tokens: generated,
        prompt_ms,
        predicted_ms: predicting.elapsed().as_secs_f64() * 1000.0,
    })
}

/// The generated text, released as it becomes final: bytes wait until they make whole UTF-8
/// characters, and text waits while its end could be the start of a stop string.
pub struct StopScan<'a> {
    stops: &'a [String],
    /// Bytes of an unfinished UTF-8 character.
    partial: Vec<u8>,
    /// Text held back (a possible stop string's start).
    held: String,
    stopped: bool,
}

impl<'a> StopScan<'a> {
    pub fn new(stops: &'a [String]) -> Self {
        StopScan {
            stops,
            partial: Vec::new(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Add a token's bytes; returns the text now final and whether a stop string was reached
    /// (the text before it is in the returned text; the stop string itself never is).
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.partial.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.partial) {
            Ok(s) => s.len(),
            // An error with no length is an unfinished character at the end: wait for it.
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // Invalid bytes: let them through as replacement characters.
            Err(_) => self.partial.len(),
        };
        let whole: Vec<u8> = self.partial.drain(..valid).collect();
        self.held.push_str(&String::from_utf8_lossy(&whole));
        let first_stop = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self
            .stops
            .iter()
            .map(|s| longest_prefix_suffix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The text still held at the end (no stop string came). Bytes of a character the last
    /// token left unfinished are dropped, as llama-server drops them.
    pub fn finish(&mut self) -> String {
        self.partial.clear();
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest end of `text` that is a proper start of `stop` (on a char boundary).
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::StopScan;

    #[test]
    fn text_before_a_stop_string_is_released_and_the_stop_string_never() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        let mut scan = StopScan::new(&stops);
        assert_eq!(scan.push(b"Hello E"), ("Hello ".to_string(), false));
        assert_eq!(scan.push(b"N"), (String::new(), false));
        assert_eq!(scan.push(b"X, then"), ("ENX, then".to_string(), false));
        assert_eq!(scan.push(b"\n"), (String::new(), false));
        assert_eq!(scan.push(b"\nmore"), (String::new(), true));
        assert_eq!(scan.finish(), "");
    }

    #[test]
    fn a_character_split_across_tokens_waits_for_its_last_byte() {
        let mut scan = StopScan::new(&[]);
        let e = "é".as_bytes();
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.push(&e[1..]), ("é".to_string(), false));
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.finish(), "", "an unfinished last character is dropped");
    }
}
