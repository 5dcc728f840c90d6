//! A prompt's first token, sampled from the last prefill pass over it.
//!
//! The pass that writes a prompt's last token into its cache also gives that position's
//! logits, so the first token is sampled there, with the row's own sampling (seed and step,
//! penalties over the prompt, bias, constraint, log-probabilities), and handed out once the
//! step's prefill is evaluated. The row then joins the decode batch with that token as its
//! input. mlx-lm instead keeps the prompt's last token for its first decode step, which costs
//! every request a whole decode step of time to first token (a prefix hit at 5k on an H200: a
//! 3.8 ms step after a 7.4 ms pass). Its lazy graph never computes the last layer's attention
//! output and feed-forward for prompt positions; this pass computes them for the last position
//! alone (`CausalLm::forward_last`), so it costs no more. On by default; the switch
//! ([`super::RuntimeLimits::first_token_from_prefill`]) keeps mlx-lm's order for comparison.
use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::sampler::{BatchSampler, PickedLogprobs, RowSampling};
use super::sequence::Sequence;

/// The `[B, vocab]` additive mask of the next token of `seqs` when some row is constrained:
/// each constrained row's allowed set, zeros for the others (a failing constraint fails its
/// row, see [`Sequence::write_mask`]).
pub(super) fn constraint_mask(
    seqs: &mut [Sequence],
    vocab: usize,
) -> Result<Option<Array>, Exception> {
    if seqs.iter().all(|s| s.constraint.is_none()) {
        return Ok(None);
    }
    let mut mask = vec![0.0f32; vocab * seqs.len()];
    for (seq, row) in seqs.iter_mut().zip(mask.chunks_mut(vocab)) {
        seq.write_mask(row);
    }
    Ok(Some(Array::from_slice(
        &mask,
        &[seqs.len() as i32, vocab as i32],
    )))
}

/// The first tokens of a prefill unit's rows, on the device until the step's prefill is
/// evaluated.
pub(super) struct FirstTokens {
    /// `[B]` u32, one per row in order.
    tokens: Array,
    logprobs: Option<PickedLogprobs>,
}

impl FirstTokens {
    /// Samples one token per row of `seqs` from `logits` `[B, vocab]` (each row's prompt's
    /// last position), as the decode batch's sampler would at the row's first step.
    pub fn sample(seqs: &mut [Sequence], logits: &Array, vocab: usize) -> Result<Self, Exception> {
        let mut sampler = BatchSampler::new(vocab);
        let rows: Vec<RowSampling<'_>> = seqs.iter().map(Sequence::row_sampling).collect();
        sampler.extend(&rows)?;
        if let Some(mask) = constraint_mask(seqs, vocab)? {
            sampler.set_mask(mask);
        }
        let tokens = sampler.sample(logits)?;
        Ok(Self {
            tokens,
            logprobs: sampler.take_logprobs(),
        })
    }

    /// What the step's wait must evaluate.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut all = vec![&self.tokens];
        all.extend(self.logprobs.iter().flat_map(PickedLogprobs::arrays));
        all
    }

    /// Hands each row its token (evaluated): the first generated token, which may also be
    /// its last (a stop token, `max_tokens` of 1, a finished constraint).
    pub fn hand_out(&self, seqs: &mut [Sequence]) -> Result<(), Exception> {
        let tokens: &[u32] = self
            .tokens
            .try_as_slice()
            .map_err(|e| Exception::custom(format!("reading first tokens: {e:?}")))?;
        for (r, (seq, &token)) in seqs.iter_mut().zip(tokens).enumerate() {
            if let (Some(want), Some(lp)) = (seq.logprobs, &self.logprobs) {
                seq.set_logprobs(lp.at(r, want)?);
            }
            seq.sampled += 1;
            let last = seq.at_limit();
            seq.emit(token, last);
        }
        Ok(())
    }
}
