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

/// What prompt lookup would accept if a row drafted, worked out from the tokens the row emits
/// without drafts. It replays drafting: a proposal made where the row's text ended is checked
/// against the tokens that came next, and the next proposal starts where that verification
/// pass would have left the row. A greedy row accepts what matches; a sampled row accepts a
/// lookup's draft token with the probability that it samples that token, so the matched share
/// estimates acceptance either way. It costs no forward pass, so a row whose text does not
/// repeat itself never drafts to find that out.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowLookup {
    /// Where the pending proposal starts: the text's length when it is made.
    at: usize,
    /// The pending proposal, made from the text's first `at` tokens.
    proposal: Option<Vec<u32>>,
}

impl ShadowLookup {
    /// Shadowing from a text of `at` tokens.
    pub fn new(at: usize) -> Self {
        Self { at, proposal: None }
    }

    /// The row drafted for real: shadowing resumes at the end of its text.
    pub fn restart(&mut self, at: usize) {
        *self = Self::new(at);
    }

    /// Checks the pending proposals of `k` drafts against the row's whole text `tokens`;
    /// returns the (drafted, accepted) verdict of each pass this settles, in order. A verdict
    /// is known once a token differs from its draft, or when every draft matched and the
    /// pass's own next token has come. A lookup that finds nothing makes no pass (the row
    /// would take its one token like a row without drafts) and no verdict.
    pub fn observe(&mut self, tokens: &[u32], sizes: NgramSizes, k: usize) -> Vec<(usize, usize)> {
        let mut verdicts = Vec::new();
        while self.at <= tokens.len() {
            let at = self.at;
            let proposal = self
                .proposal
                .get_or_insert_with(|| propose(&tokens[..at], sizes, k));
            let next = &tokens[at..];
            let accepted = proposal
                .iter()
                .zip(next)
                .take_while(|(d, t)| d == t)
                .count();
            let differed = accepted < proposal.len() && accepted < next.len();
            let all_matched = accepted == proposal.len() && next.len() > accepted;
            if !(differed || all_matched) {
                break;
            }
            if !proposal.is_empty() {
                verdicts.push((proposal.len(), accepted));
            }
            self.at += accepted + 1;
            self.proposal = None;
        }
        verdicts
    }
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

    /// Feeds `text` past `start` one token at a time, as a pipelined row emits it.
    fn shadow(text: &[u32], start: usize, k: usize) -> Vec<(usize, usize)> {
        let mut sh = ShadowLookup::new(start);
        (start..=text.len())
            .flat_map(|n| sh.observe(&text[..n], sizes(1, 3), k))
            .collect()
    }

    #[test]
    fn a_shadow_replays_the_passes_drafting_would_have_made() {
        // The text repeats its start: after "1 2 3 4 | 1", lookups propose what followed.
        let text = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2];
        // At 4 ("1 2 3 4"): "4" never came before: no lookup, no pass; "1" comes.
        // At 5 (…"4 1"): proposes "2 3 4", all three match, and the pass's own token "1"
        // follows. At 9: proposes "2 3 4"; "2" matches, then the text ends: unsettled.
        assert_eq!(shadow(&text, 4, 3), vec![(3, 3)]);
    }

    #[test]
    fn a_rejected_draft_settles_the_pass_and_the_next_starts_after_its_token() {
        // At 3 ("5 6 5"): proposes "6 5" after the earlier "5"; the text goes on "6 7".
        let text = [5, 6, 5, 6, 7, 8];
        let mut sh = ShadowLookup::new(3);
        assert!(
            sh.observe(&text[..4], sizes(1, 3), 2).is_empty(),
            "unsettled after a match"
        );
        // "7" differs from the second draft: 1 of 2 accepted, the pass emits "6 7", and the
        // next lookup starts at 5 ("…6 7"), where "7" never came before: nothing to judge.
        assert_eq!(sh.observe(&text[..5], sizes(1, 3), 2), vec![(2, 1)]);
        assert!(sh.observe(&text, sizes(1, 3), 2).is_empty());
        // Past it, at 6 ("…7 8"), "8" never came before either.
        assert!(sh
            .observe(&[5, 6, 5, 6, 7, 8, 6], sizes(1, 3), 2)
            .is_empty());
    }

    #[test]
    fn a_restart_after_real_drafts_shadows_from_the_new_end() {
        let text = [1, 2, 1, 2, 1, 2, 1];
        let mut sh = ShadowLookup::new(2);
        sh.observe(&text[..3], sizes(1, 2), 2);
        sh.restart(6);
        // Only the text past 6 counts now: "…1 2" proposes "1 2", and "1" matches so far.
        assert!(sh.observe(&text, sizes(1, 2), 2).is_empty());
    }
}
