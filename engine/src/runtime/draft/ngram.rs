//! Prompt-lookup drafting: propose the tokens that followed the last occurrence of the text's
//! own ending. Pure; no MLX.
//!
//! Input-grounded work (editing, summarising, answering about a given text, code changes)
//! repeats long runs of its input. When the last `n` tokens (`n` from `max` down to `min`)
//! occurred earlier in the prompt or the generated text, the tokens that followed them there
//! are a cheap guess at what comes next, which one forward pass of the model then verifies.

/// The n-gram sizes tried, longest first (`--ngram-max`, `--ngram-min`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSizes {
    pub min: usize,
    pub max: usize,
}

impl NgramSizes {
    /// Sizes that make sense: at least 1, `min <= max`.
    pub fn new(min: usize, max: usize) -> Result<Self, String> {
        if min == 0 || min > max {
            return Err(format!(
                "n-gram sizes must satisfy 1 <= ngram-min <= ngram-max (got {min} and {max})"
            ));
        }
        Ok(Self { min, max })
    }
}

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `tokens` (between `sizes.min` and `sizes.max` long); empty when none occurred.
pub fn propose(tokens: &[u32], sizes: NgramSizes, k: usize) -> Vec<u32> {
    let n = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for size in (sizes.min..=sizes.max.min(n.saturating_sub(1))).rev() {
        let pattern = &tokens[n - size..];
        // Most recent first: the nearest context is the likeliest to continue the same way.
        // `start + size < n` so that at least one token follows the match.
        for start in (0..n - size).rev() {
            if &tokens[start..start + size] == pattern {
                let from = start + size;
                return tokens[from..(from + k).min(n)].to_vec();
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(min: usize, max: usize) -> NgramSizes {
        NgramSizes::new(min, max).unwrap()
    }

    #[test]
    fn proposes_what_followed_the_longest_matching_suffix() {
        // "1 2 3 4 5 ... 1 2 3" → 4 5 followed the trigram.
        let t = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3];
        assert_eq!(propose(&t, sizes(1, 3), 2), vec![4, 5]);
        // The longest suffix wins over a more recent shorter one.
        let t = [7, 3, 8, 1, 2, 3, 6, 2, 3, 5, 1, 2, 3];
        assert_eq!(propose(&t, sizes(1, 3), 1), vec![6]);
    }

    #[test]
    fn the_most_recent_occurrence_wins_among_equal_lengths() {
        let t = [1, 2, 10, 1, 2, 20, 1, 2];
        assert_eq!(propose(&t, sizes(2, 2), 1), vec![20]);
    }

    #[test]
    fn proposals_stop_at_the_end_of_the_text_and_at_k() {
        let t = [4, 5, 6, 4, 5];
        assert_eq!(propose(&t, sizes(2, 2), 5), vec![6, 4, 5]);
        assert_eq!(propose(&t, sizes(2, 2), 1), vec![6]);
        assert_eq!(propose(&t, sizes(2, 2), 0), Vec::<u32>::new());
    }

    #[test]
    fn nothing_when_no_suffix_occurred_before() {
        assert!(propose(&[1, 2, 3, 4], sizes(1, 3), 3).is_empty());
        assert!(propose(&[1], sizes(1, 3), 3).is_empty());
        assert!(propose(&[], sizes(1, 3), 3).is_empty());
        // Shorter than `min` never matches.
        assert!(propose(&[5, 6, 5], sizes(2, 3), 3).is_empty());
    }

    #[test]
    fn bad_sizes_are_refused() {
        assert!(NgramSizes::new(0, 3).is_err());
        assert!(NgramSizes::new(4, 3).is_err());
        assert!(NgramSizes::new(2, 2).is_ok());
    }
}
