//! The prompt cache in RAM: slots' states kept when they move on, put back for a later prompt.

use crate::ffi::Token;
use crate::state_buffer::StateBuffer;

/// A slot's contents worth keeping when the slot moves on to another prompt: at least this
/// many tokens.
pub(super) const KEEP_AT_LEAST: usize = 32;

/// Prompts kept in RAM once their slot moved on to another (llama-server's `--cache-ram`): a
/// later prompt that shares more with one of them than with any free slot gets that state put
/// back into its slot instead of decoding the shared part again. Bounded in bytes; the least
/// recently kept go first.
pub struct PromptCache {
    pub(super) budget: usize,
    /// Oldest first.
    kept: Vec<Kept>,
}

pub(super) struct Kept {
    pub(super) tokens: Vec<Token>,
    pub(super) state: StateBuffer,
}

impl PromptCache {
    pub fn new(budget_bytes: usize) -> Self {
        PromptCache {
            budget: budget_bytes,
            kept: Vec::new(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.kept.iter().map(|k| k.state.len()).sum()
    }

    /// Keep `tokens`' state, dropping what it makes useless (a kept prompt it starts with)
    /// and then the oldest until it fits; a state larger than the whole budget is not kept.
    pub(super) fn keep(&mut self, tokens: Vec<Token>, state: StateBuffer) {
        if state.len() > self.budget {
            return;
        }
        self.kept.retain(|k| !tokens.starts_with(&k.tokens));
        while self.bytes() + state.len() > self.budget && !self.kept.is_empty() {
            self.kept.remove(0);
        }
        self.kept.push(Kept { tokens, state });
    }

    /// Take out the kept prompt sharing the longest prefix with `prompt`, when it shares more
    /// than `than` tokens.
    pub(super) fn take_best(&mut self, prompt: &[Token], than: usize) -> Option<Kept> {
        let (i, n) = self
            .kept
            .iter()
            .enumerate()
            .map(|(i, k)| (i, shared_prefix(&k.tokens, prompt)))
            .max_by_key(|&(i, n)| (n, i))?;
        (n > than).then(|| self.kept.remove(i))
    }
}

/// How many tokens `a` and `b` share from their start.
pub(super) fn shared_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::PromptCache;
    use crate::state_buffer::StateBuffer;

    fn state(len: usize) -> StateBuffer {
        StateBuffer::zeroed(len).expect("mapped")
    }
    #[test]
    fn the_prompt_cache_keeps_within_its_budget_and_gives_the_longest_match() {
        let mut cache = PromptCache::new(100);
        cache.keep(vec![1, 2, 3], state(40));
        cache.keep(vec![4, 5, 6], state(40));
        // A third does not fit beside both: the oldest goes.
        cache.keep(vec![7, 8, 9], state(40));
        assert_eq!(cache.bytes(), 80);
        assert!(
            cache.take_best(&[1, 2, 3, 4], 0).is_none(),
            "[1, 2, 3] was dropped"
        );
        // A prompt that starts with a kept one makes it useless.
        cache.keep(vec![4, 5, 6, 10], state(10));
        assert_eq!(cache.bytes(), 50);
        // Larger than the whole budget: not kept.
        cache.keep(vec![11], state(101));
        assert_eq!(cache.bytes(), 50);
        // Only a match longer than the slot's own is taken out.
        assert!(cache.take_best(&[4, 5, 6, 10, 12], 4).is_none());
        let best = cache
            .take_best(&[4, 5, 6, 10, 12], 3)
            .expect("a longer match");
        assert_eq!(best.tokens, [4, 5, 6, 10]);
        assert_eq!(cache.bytes(), 40);
    }
}
