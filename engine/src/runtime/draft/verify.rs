//! Which drafted tokens a verification pass accepts. Pure; no MLX.
//!
//! The main model runs `[last, d1 .. dq, filler ..]` for a row and samples a token at every
//! position with the row's own sampler (greedy, or seeded noise keyed by the token's index in
//! the generation). Draft `d(i+1)` is accepted while it equals the token sampled at position
//! `i`; the first mismatch is replaced by the sampled token. The emitted tokens are then
//! exactly the tokens the model samples one at a time, so greedy output is unchanged and a
//! sampled row keeps the model's distribution (a deterministic proposal accepted with the
//! probability the model gives it, as standard speculative sampling with a one-hot draft).

/// How a row's verification went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix of the row's drafts).
    pub accepted: usize,
    /// Tokens to emit: the accepted drafts, then the model's own next token.
    pub emitted: Vec<u32>,
    /// Positions of this pass's KV to drop (rejected drafts and fillers).
    pub rollback: usize,
}

/// `drafts` were proposed for the row; `sampled` are the tokens the model sampled at each of
/// the pass's `L` positions (`L >= drafts.len() + 1`).
pub fn verdict(drafts: &[u32], sampled: &[u32]) -> Verdict {
    let accepted = drafts
        .iter()
        .zip(sampled)
        .take_while(|(d, s)| d == s)
        .count();
    Verdict {
        accepted,
        emitted: sampled[..=accepted].to_vec(),
        rollback: sampled.len() - 1 - accepted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_drafts_accepted_adds_the_bonus_token() {
        let v = verdict(&[5, 6, 7], &[5, 6, 7, 8]);
        assert_eq!(v.accepted, 3);
        assert_eq!(v.emitted, vec![5, 6, 7, 8]);
        assert_eq!(v.rollback, 0);
    }

    #[test]
    fn the_first_mismatch_is_replaced_by_the_models_token() {
        let v = verdict(&[5, 6, 7], &[5, 9, 7, 8]);
        assert_eq!(v.accepted, 1);
        assert_eq!(v.emitted, vec![5, 9]);
        // last and d1 stay; d2, d3 go.
        assert_eq!(v.rollback, 2);
    }

    #[test]
    fn fillers_past_the_rows_drafts_are_rolled_back() {
        // One draft in a pass of four positions (other rows drafted three).
        let v = verdict(&[5], &[5, 1, 1, 1]);
        assert_eq!(v.accepted, 1);
        assert_eq!(v.emitted, vec![5, 1]);
        assert_eq!(v.rollback, 2);
        let v = verdict(&[], &[4, 1, 1, 1]);
        assert_eq!((v.accepted, v.emitted, v.rollback), (0, vec![4], 3));
    }
}
