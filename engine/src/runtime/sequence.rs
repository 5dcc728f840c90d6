//! One request's state on the MLX thread, from admission to its last token.
use std::time::Instant;

use tokio::sync::mpsc;

use super::request::{FinishReason, GenerateRequest, GenerationError, TokenEvent, TokenLogprobs};
use super::sampler::RowSampling;
use super::sampling_params::SamplingParams;
use crate::adapters::AdapterId;
use crate::cache::KvSpace;
use crate::cache::Reservation;
use crate::constraint::TokenConstraint;

pub struct Sequence {
    /// Prompt, then every generated token read back so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: usize,
    /// Prompt + generated tokens may not exceed this.
    pub context_length: usize,
    pub stop_ids: Vec<u32>,
    pub params: SamplingParams,
    /// The request's seed, or one drawn from the OS for an unseeded request.
    pub seed: u64,
    /// Index of the first generated token in the request's random stream.
    pub sample_offset: usize,
    /// Tokens sampled on the device, read back or still in flight.
    pub sampled: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub reservation: Option<Reservation>,
    /// Speculative drafts proposed for this sequence, and how many were accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// Recent acceptance, which decides whether the row is given drafts.
    pub acceptance: super::draft::adaptive::Acceptance,
    /// Generated tokens covered by the last generation checkpoint.
    pub checkpointed: usize,
    /// Which tokens may come next; while any row has one, its batch steps synchronously.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Alternatives to report per token when the request wants log-probabilities.
    pub logprobs: Option<usize>,
    /// The LoRA adapter of this row's forward passes (`None`: the base model).
    pub adapter: Option<AdapterId>,
    /// The prefix cache's space of this row's KV (its adapter's, or the base model's), set
    /// at admission; `None`: its KV is neither looked up nor kept (an adapter whose space the
    /// engine does not know).
    pub space: Option<KvSpace>,
    /// The log-probabilities of the token about to be emitted.
    pending_logprobs: Option<TokenLogprobs>,
    events: mpsc::UnboundedSender<TokenEvent>,
    prompt_reported: bool,
    /// When it was admitted: its first token's latency in the runtime (the prefix trace).
    pub admitted: Instant,
    /// No more tokens wanted: a stop token came, the client left, or it failed.
    pub finished: bool,
}

impl Sequence {
    pub fn new(request: GenerateRequest, context_length: usize) -> Self {
        let seed = request.sampling.seed.unwrap_or_else(rand::random);
        Self {
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            max_tokens: request.max_tokens,
            context_length,
            stop_ids: request.stop_token_ids,
            params: request.sampling,
            seed,
            sample_offset: request.sample_offset,
            sampled: 0,
            cached_tokens: 0,
            reservation: None,
            drafted: 0,
            accepted: 0,
            acceptance: Default::default(),
            checkpointed: 0,
            constraint: request.constraint,
            logprobs: request.logprobs,
            adapter: request.adapter,
            space: request.adapter.is_none().then_some(KvSpace::BASE),
            pending_logprobs: None,
            events: request.events,
            prompt_reported: false,
            admitted: Instant::now(),
            finished: false,
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    /// What a sampler needs of this row as it joins one: its parameters, seed and step, its
    /// prompt and the tokens it has generated so far (for the penalties).
    pub fn row_sampling(&self) -> RowSampling<'_> {
        RowSampling {
            params: &self.params,
            seed: self.seed,
            prompt: self.prompt(),
            generated: &self.tokens[self.prompt_len..],
            next_step: (self.sample_offset + self.sampled) as u64,
            logprobs: self.logprobs,
        }
    }

    /// The last token held: the newest generated one, which the next decode step runs.
    pub fn last_token(&self) -> u32 {
        *self.tokens.last().expect("a sequence is never empty")
    }

    /// Tokens that may still be generated, by `max_tokens` and the context length.
    pub fn remaining(&self) -> usize {
        (self.max_tokens.saturating_sub(self.sampled)).min(
            self.context_length
                .saturating_sub(self.prompt_len + self.sampled),
        )
    }

    /// True while the client still listens.
    pub fn is_open(&self) -> bool {
        !self.events.is_closed()
    }

    /// True when another token should be sampled after those sampled so far.
    pub fn wants_more(&self) -> bool {
        !self.finished
            && self.is_open()
            && self.sampled < self.max_tokens
            && self.prompt_len + self.sampled < self.context_length
    }

    /// True when the tokens sampled so far reach `max_tokens` or the context's end.
    pub fn at_limit(&self) -> bool {
        self.sampled >= self.max_tokens || self.prompt_len + self.sampled >= self.context_length
    }

    /// Writes the mask row of this sequence's next token (left all zeros without a
    /// constraint); a failing constraint fails the sequence, which then leaves the batch.
    pub fn write_mask(&mut self, row: &mut [f32]) {
        let Some(constraint) = self.constraint.as_mut() else {
            return;
        };
        if let Err(e) = constraint.mask(row) {
            row.fill(0.0);
            self.fail(GenerationError::Constraint(e.to_string()));
        }
    }

    /// Sets the log-probabilities that go with the next [`emit`](Self::emit).
    pub fn set_logprobs(&mut self, logprobs: TokenLogprobs) {
        self.pending_logprobs = Some(logprobs);
    }

    /// Hands one generated token to the client. `last` says no further token was sampled
    /// for it (a limit was reached), so the generation ends here either way.
    pub fn emit(&mut self, token: u32, last: bool) {
        self.tokens.push(token);
        let logprobs = self.pending_logprobs.take();
        if self.finished {
            return;
        }
        if !self.prompt_reported {
            self.prompt_reported = true;
            tracing::debug!(
                target: "mlxd_engine::prefix",
                prompt = self.prompt_len,
                cached = self.cached_tokens,
                first_token_us = self.admitted.elapsed().as_micros() as u64,
                "first token"
            );
            let _ = self.events.send(TokenEvent::PromptDone {
                prompt_tokens: self.prompt_len,
                cached: self.cached_tokens,
            });
        }
        if self.stop_ids.contains(&token) {
            self.finish(FinishReason::Stop);
            return;
        }
        if let Some(lp) = logprobs {
            let _ = self.events.send(TokenEvent::Logprobs(lp));
        }
        if self.events.send(TokenEvent::Token(token)).is_err() {
            self.finished = true;
            return;
        }
        if let Some(constraint) = self.constraint.as_mut() {
            match constraint.commit(token) {
                Ok(false) => {}
                Ok(true) => return self.finish(FinishReason::Stop),
                Err(e) => return self.fail(GenerationError::Constraint(e.to_string())),
            }
        }
        crate::fault::on_token();
        if last {
            self.finish(FinishReason::Length);
        }
    }

    pub fn finish(&mut self, reason: FinishReason) {
        self.finished = true;
        if self.drafted > 0 {
            let _ = self.events.send(TokenEvent::Drafts {
                drafted: self.drafted,
                accepted: self.accepted,
            });
        }
        let _ = self.events.send(TokenEvent::Finished(reason));
    }

    pub fn fail(&mut self, error: GenerationError) {
        self.finished = true;
        let _ = self.events.send(TokenEvent::Failed(error));
    }
}
