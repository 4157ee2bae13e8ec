//! Where a prompt's decodes end, as llama-server's batches end on the models it checkpoints.

use crate::ffi::Token;

/// Where a decode of the prompt's tokens `from..to` ends: at the first of `breaks` inside it
/// (a decode that starts at a break goes past it), else at `to`.
pub(super) fn prompt_chunk_end(from: usize, to: usize, breaks: &[usize]) -> usize {
    breaks
        .iter()
        .copied()
        .filter(|point| from < *point && *point < to)
        .min()
        .unwrap_or(to)
}

/// Where llama-server ends the batches of a `len`-token prompt on a model it checkpoints
/// (windowed attention): `n` tokens before the end for each `n` of `ends` (4 + n_ubatch and
/// 4), and before the user messages starting at `user_starts` (of a chat): the last one, and
/// the first; another only when it is more than [`CHECKPOINT_MIN_STEP`] past the previous
/// break (the spacing of its checkpoints). Sorted.
pub(super) fn prompt_breaks(len: usize, ends: &[usize], user_starts: &[usize]) -> Vec<usize> {
    let mut breaks: Vec<usize> = ends.iter().filter_map(|n| len.checked_sub(*n)).collect();
    let last = user_starts.iter().copied().filter(|&u| u > 0).max();
    let mut previous: Option<usize> = None;
    for &start in user_starts.iter().filter(|&&u| u > 0) {
        if Some(start) == last || previous.is_none_or(|p| start > p + CHECKPOINT_MIN_STEP) {
            breaks.push(start);
            previous = Some(start);
        }
    }
    breaks.sort_unstable();
    breaks.dedup();
    breaks
}

/// llama-server's least spacing of context checkpoints (`checkpoint_min_step`).
const CHECKPOINT_MIN_STEP: usize = 8192;

/// The positions in `tokens` where `marker` starts (none when it is empty), as llama-server
/// finds a chat prompt's messages.
pub(super) fn user_starts(tokens: &[Token], marker: &[Token]) -> Vec<usize> {
    if marker.is_empty() {
        return Vec::new();
    }
    let mut starts = Vec::new();
    let mut at = 0;
    while at + marker.len() <= tokens.len() {
        if tokens[at..at + marker.len()] == *marker {
            starts.push(at);
        }
        at += 1;
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::{prompt_breaks, prompt_chunk_end, user_starts};

    #[test]
    fn a_chats_batches_also_end_where_user_messages_start() {
        let ends = [516, 4];
        // One user message at 1 (after BOS) of 20 tokens: [0, 1), [1, 16), [16, 20).
        assert_eq!(prompt_breaks(20, &ends, &[1]), [1, 16]);
        // Three: the first and the last; the middle one is within the checkpoints' spacing.
        assert_eq!(prompt_breaks(100, &ends, &[1, 30, 60]), [1, 60, 96]);
        // One more than 8192 past the first gets a break of its own.
        assert_eq!(
            prompt_breaks(20_000, &ends, &[1, 9000, 9100, 15_000]),
            [1, 9000, 15_000, 19_484, 19_996]
        );
        // A message at the prompt's start is not a break (nothing comes before it).
        assert_eq!(prompt_breaks(20, &ends, &[0]), [16]);
        assert_eq!(user_starts(&[7, 1, 2, 9, 1, 2, 1], &[1, 2]), [1, 4]);
        assert_eq!(user_starts(&[1, 2], &[]), Vec::<usize>::new());
    }

    /// llama-server's batch ends on a windowed model: 4 + n_ubatch and 4 tokens before the
    /// prompt's end, only inside a decode; a decode starting at such a point goes on.
    #[test]
    fn a_prompt_decode_ends_where_llama_servers_does() {
        let ends = [516, 4];
        let at = |from, to, len| prompt_chunk_end(from, to, &prompt_breaks(len, &ends, &[]));
        // 9 tokens: 5, then the last 4.
        assert_eq!(at(0, 9, 9), 5);
        assert_eq!(at(5, 9, 9), 9);
        // 1,000 tokens in a 2,048 batch: 484, then 512, then 4.
        assert_eq!(at(0, 1000, 1000), 484);
        assert_eq!(at(484, 1000, 1000), 996);
        assert_eq!(at(996, 1000, 1000), 1000);
        // A batch that ends before the points, a prompt of 4 or fewer, a model without them.
        assert_eq!(at(0, 300, 1000), 300);
        assert_eq!(at(0, 3, 3), 3);
        assert_eq!(prompt_chunk_end(0, 9, &prompt_breaks(9, &[], &[])), 9);
    }
}
