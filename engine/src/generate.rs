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

/// Picks a token from log-probabilities copied to the host (temperature, top-p, penalties…).
pub trait HostSampler {
    /// `tokens` is the prompt followed by the generated tokens; `prompt_len` splits them.
    fn sample(
        &mut self,
        logprobs: &mut [f32],
        tokens: &[u32],
        prompt_len: usize,
    ) -> Result<u32, String>;
}

/// Why a generation step failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("MLX: {0}")]
    Mlx(#[from] Exception),
    #[error("sampling: {0}")]
    Sample(String),
}

/// The model inputs and caches of one sequence.
pub struct Sequence {
    caches: Vec<KvCache>,
    /// Prompt followed by every generated token handed out so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions held in the KV cache.
    cached: usize,
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
            cached: 0,
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

    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(KvCache::nbytes).sum()
    }

    /// Prompt tokens (all but the last) not yet prefilled.
    pub fn prefill_remaining(&self) -> usize {
        (self.prompt_len - 1).saturating_sub(self.cached)
    }

    /// Runs the next chunk of at most [`PREFILL_CHUNK`] prompt tokens into the cache.
    pub fn prefill_chunk(&mut self, model: &dyn CausalLm) -> Result<(), Exception> {
        let n = self.prefill_remaining().min(PREFILL_CHUNK);
        let chunk = &self.tokens[self.cached..self.cached + n];
        let input = Array::from_slice(chunk, &[1, n as i32]);
        // Only the cache is needed; the logits are never evaluated.
        let _ = model.forward(&input, &mut self.caches)?;
        let state: Vec<&Array> = self.caches.iter().flat_map(KvCache::state).collect();
        mlx_rs::transforms::eval(state)?;
        self.cached += n;
        Ok(())
    }

    /// Runs one token (`[1, 1]`, possibly not yet evaluated) and returns the log-probabilities
    /// `[1, vocab]` of the next one, lazily.
    pub fn decode(&mut self, model: &dyn CausalLm, input: &Array) -> Result<Array, Exception> {
        let logits = model.forward(input, &mut self.caches)?;
        self.cached += 1;
        let logits = logits.index((.., -1, ..));
        logits.subtract(logits.logsumexp_axis(-1, true)?)
    }

    /// The last known token as a `[1, 1]` input.
    fn last_token(&self) -> Array {
        Array::from_slice(&self.tokens[self.tokens.len() - 1..], &[1, 1])
    }
}

/// Drives one sequence from prompt to tokens.
///
/// Greedy decoding stays on the device and runs one step ahead, as mlx-lm does: the graph for
/// token n+1 is built and queued (`async_eval`) before token n is read back, so the device
/// never waits for the host. Other sampling copies the distribution to the host each step.
pub struct Decoder<S> {
    pub seq: Sequence,
    sampler: Option<S>,
    /// The next greedy token, queued but maybe not yet computed.
    in_flight: Option<Array>,
}

impl<S: HostSampler> Decoder<S> {
    /// `sampler` is `None` for plain greedy decoding.
    pub fn new(model: &dyn CausalLm, prompt: Vec<u32>, sampler: Option<S>) -> Self {
        Self {
            seq: Sequence::new(model, prompt),
            sampler,
            in_flight: None,
        }
    }

    /// True while prompt chunks remain to prefill.
    pub fn prefilling(&self) -> bool {
        self.seq.prefill_remaining() > 0
    }

    /// One unit of work: a prefill chunk (returns `None`) or one generated token. `lookahead`
    /// says whether another token will be wanted after this one (false for the last).
    pub fn advance(
        &mut self,
        model: &dyn CausalLm,
        lookahead: bool,
    ) -> Result<Option<u32>, StepError> {
        if self.prefilling() {
            self.seq.prefill_chunk(model)?;
            return Ok(None);
        }
        let token = match &mut self.sampler {
            Some(sampler) => {
                let input = self.seq.last_token();
                let logprobs = self.seq.decode(model, &input)?;
                let mut host = to_host_f32(&logprobs)?;
                sampler
                    .sample(&mut host, &self.seq.tokens, self.seq.prompt_len)
                    .map_err(StepError::Sample)?
            }
            None => {
                let current = match self.in_flight.take() {
                    Some(t) => t,
                    None => {
                        let input = self.seq.last_token();
                        let t = argmax_axis(self.seq.decode(model, &input)?, -1, None)?;
                        mlx_rs::transforms::async_eval([&t])?;
                        t
                    }
                };
                if lookahead {
                    let next = argmax_axis(
                        self.seq.decode(model, &current.reshape(&[1, 1])?)?,
                        -1,
                        None,
                    )?;
                    mlx_rs::transforms::async_eval([&next])?;
                    self.in_flight = Some(next);
                }
                current.eval()?;
                current.item_exact::<u32>()
            }
        };
        self.seq.tokens.push(token);
        Ok(Some(token))
    }
}

/// Copies a `[1, vocab]` distribution to host memory as f32 (for the host sampler).
pub fn to_host_f32(logprobs: &Array) -> Result<Vec<f32>, Exception> {
    let f = logprobs.as_dtype(mlx_rs::Dtype::Float32)?;
    f.eval()?;
    Ok(f.as_slice::<f32>().to_vec())
}

/// No host sampler: plain greedy decoding.
pub enum NoSampler {}

impl HostSampler for NoSampler {
    fn sample(&mut self, _: &mut [f32], _: &[u32], _: usize) -> Result<u32, String> {
        match *self {}
    }
}

/// Greedy generation of up to `max_tokens` tokens, stopping after any of `stop_ids`.
/// Used by parity tests and benchmarks; the server goes through the worker's scheduler.
pub fn greedy(
    model: &dyn CausalLm,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
) -> Result<Vec<u32>, StepError> {
    let mut decoder = Decoder::<NoSampler>::new(model, prompt.to_vec(), None);
    while decoder.seq.generated().len() < max_tokens {
        let lookahead = decoder.seq.generated().len() + 1 < max_tokens;
        if let Some(token) = decoder.advance(model, lookahead)? {
            if stop_ids.contains(&token) {
                break;
            }
        }
    }
    Ok(decoder.seq.generated().to_vec())
}
