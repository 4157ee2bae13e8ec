//! The generated text released as it becomes final: whole UTF-8 characters, never a stop string.

/// The generated text, released as it becomes final: bytes wait until they make whole UTF-8
/// characters, and text waits while its end could be the start of a stop string.
pub struct StopScan {
    stops: Vec<String>,
    /// Bytes of an unfinished UTF-8 character.
    partial: Vec<u8>,
    /// Text held back (a possible stop string's start).
    held: String,
    stopped: bool,
}

impl StopScan {
    pub fn new(stops: Vec<String>) -> Self {
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
        let mut scan = StopScan::new(stops);
        assert_eq!(scan.push(b"Hello E"), ("Hello ".to_string(), false));
        assert_eq!(scan.push(b"N"), (String::new(), false));
        assert_eq!(scan.push(b"X, then"), ("ENX, then".to_string(), false));
        assert_eq!(scan.push(b"\n"), (String::new(), false));
        assert_eq!(scan.push(b"\nmore"), (String::new(), true));
        assert_eq!(scan.finish(), "");
    }

    #[test]
    fn a_character_split_across_tokens_waits_for_its_last_byte() {
        let mut scan = StopScan::new(Vec::new());
        let e = "é".as_bytes();
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.push(&e[1..]), ("é".to_string(), false));
        assert_eq!(scan.push(&e[..1]), (String::new(), false));
        assert_eq!(scan.finish(), "", "an unfinished last character is dropped");
    }
}
