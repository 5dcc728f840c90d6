//! One sequence's generation state and the step that advances it, written once for every model.
//!
//! The step order mirrors mlx-lm's `generate_step`: the prompt except its last token is
//! prefilled in chunks (only the cache is evaluated), then the last prompt token and each
//! generated token are run one at a time and turned into log-probabilities. Matching that
//! order keeps greedy outputs identical to mlx-lm's.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::Array;

use crate::cache::KvCache;
use crate::models::CausalLm;

/// Prompt tokens per prefill forward pass (mlx-lm's `prefill_step_size`).
pub const PREFILL_CHUNK: usize = 2048;

/// What one call to [`Sequence::step`] produced.
pub enum Step {
    /// A prefill chunk went into the cache; no distribution yet.
    Prefilled,
    /// Log-probabilities `[1, vocab]` for the next token.
    Next(Array),
}

pub struct Sequence {
    caches: Vec<KvCache>,
    /// Prompt followed by every generated token.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens already run through the model.
    processed: usize,
}

impl Sequence {
    /// `prompt` must not be empty.
    pub fn new(model: &dyn CausalLm, prompt: Vec<u32>) -> Self {
        assert!(
            !prompt.is_empty(),
            "a sequence needs at least one prompt token"
        );
        let prompt_len = prompt.len();
        Self {
            caches: model.new_caches(),
            tokens: prompt,
            prompt_len,
            processed: 0,
        }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Positions held in the KV cache.
    pub fn cached_len(&self) -> usize {
        self.processed
    }

    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(KvCache::nbytes).sum()
    }

    /// Records the token chosen from the last distribution; the next step will run it.
    pub fn push(&mut self, token: u32) {
        self.tokens.push(token);
    }

    /// Advances by one prefill chunk or one token.
    pub fn step(&mut self, model: &dyn CausalLm) -> Result<Step, Exception> {
        let pending = self.tokens.len() - self.processed;
        debug_assert!(pending >= 1, "step called with no token to run");
        if pending > 1 {
            let n = (pending - 1).min(PREFILL_CHUNK);
            let chunk = &self.tokens[self.processed..self.processed + n];
            let input = Array::from_slice(chunk, &[1, n as i32]);
            // Only the cache is needed; the logits are never evaluated.
            let _ = model.forward(&input, &mut self.caches)?;
            let state: Vec<&Array> = self.caches.iter().flat_map(KvCache::state).collect();
            mlx_rs::transforms::eval(state)?;
            self.processed += n;
            return Ok(Step::Prefilled);
        }
        let input = Array::from_slice(&self.tokens[self.processed..], &[1, 1]);
        let logits = model.forward(&input, &mut self.caches)?;
        self.processed += 1;
        let logits = logits.index((.., -1, ..));
        let logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        Ok(Step::Next(logprobs))
    }
}

/// The most likely token of a `[1, vocab]` distribution, computed on the device.
pub fn argmax_token(logprobs: &Array) -> Result<u32, Exception> {
    let id = argmax_axis(logprobs, -1, None)?;
    id.eval()?;
    Ok(id.item_exact::<u32>())
}

/// Copies a `[1, vocab]` distribution to host memory as f32 (for the CPU sampler).
pub fn to_host_f32(logprobs: &Array) -> Result<Vec<f32>, Exception> {
    let f = logprobs.as_dtype(mlx_rs::Dtype::Float32)?;
    f.eval()?;
    Ok(f.as_slice::<f32>().to_vec())
}

/// Greedy generation of up to `max_tokens` tokens, stopping after any of `stop_ids`.
/// Used by parity tests and benchmarks; the server uses the worker's scheduler.
pub fn greedy(
    model: &dyn CausalLm,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, Exception> {
    let mut seq = Sequence::new(model, prompt.to_vec());
    while seq.generated().len() < max_tokens {
        if let Step::Next(logprobs) = seq.step(model)? {
            let token = argmax_token(&logprobs)?;
            seq.push(token);
            if stop_ids.contains(&token) {
                break;
            }
        }
    }
    Ok(seq.generated().to_vec())
}
