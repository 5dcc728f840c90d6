//! One request's generation as the HTTP side sees it: token events from the MLX thread turned
//! into text deltas (detokenized, stop strings applied) with their token ids.
//!
//! Dropping a [`Generation`] drops the event receiver, which cancels the sequence in the MLX
//! thread; a matched stop string closes the receiver at once for the same effect.
use std::collections::VecDeque;
use std::sync::Arc;

use mlxd_protocol::openai::Usage;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::stop::StopMatcher;
use crate::detokenizer::{Delta, Detokenizer};
use crate::runtime::request::{
    FinishReason, GenerateRequest, GenerationError, TokenEvent, TokenLogprobs, WorkSender,
};
use crate::tokenizer::Tokenizer;

/// What a generation yields next.
#[derive(Debug)]
pub enum Step {
    /// Final text with the ids that produced it; never empty text.
    Text(Delta),
    /// The end. `last` holds text still to send (may be empty) and the remaining ids.
    Finished { last: Delta, reason: FinishReason },
    /// The MLX thread failed the request; nothing follows.
    Failed(ApiError),
}

/// A validated request, ready to go to the MLX thread.
pub struct Submission {
    /// Its prompt ends with `resumed`.
    pub request: GenerateRequest,
    /// The receiving half of `request.events`.
    pub events: mpsc::UnboundedReceiver<TokenEvent>,
    /// Stop strings (none empty).
    pub stops: Vec<String>,
    /// Ids of an interrupted earlier generation that this one continues; their text was
    /// already sent and is not sent again, but they count as generated tokens.
    pub resumed: Vec<u32>,
    /// Leave special tokens out of the text (not when a tool-call marker is one).
    pub skip_special: bool,
}

pub struct Generation {
    events: mpsc::UnboundedReceiver<TokenEvent>,
    peeked: Option<TokenEvent>,
    detok: Detokenizer,
    stops: StopMatcher,
    /// As the MLX thread counts them, resumed ids included.
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    resumed: usize,
    /// Speculative drafts proposed and accepted for this request, once reported.
    drafts: Option<(usize, usize)>,
    /// Log-probabilities of the tokens received and not yet taken, in order (only when the
    /// request asked for them), and those of the token about to arrive.
    logprobs: VecDeque<TokenLogprobs>,
    next_logprobs: Option<TokenLogprobs>,
    done: bool,
}

impl Generation {
    /// Sends the request to the MLX thread.
    pub fn start(
        work: &WorkSender,
        tokenizer: Arc<Tokenizer>,
        submission: Submission,
    ) -> Result<Self, ApiError> {
        let Submission {
            request,
            events,
            stops,
            resumed,
            skip_special,
        } = submission;
        let prompt_tokens = request.prompt.len();
        work.send(request)
            .map_err(|_| ApiError::Unavailable("the model thread has stopped".into()))?;
        Ok(Self {
            events,
            peeked: None,
            detok: Detokenizer::with_prior(tokenizer, skip_special, &resumed),
            stops: StopMatcher::new(stops),
            prompt_tokens,
            cached_tokens: 0,
            completion_tokens: 0,
            resumed: resumed.len(),
            drafts: None,
            logprobs: VecDeque::new(),
            next_logprobs: None,
            done: false,
        })
    }

    /// Waits for the first output of the MLX thread (the prompt's processing, then the first
    /// token or the end), so that a failure before any output can still be answered with an
    /// error status instead of a stream.
    pub async fn started(&mut self) -> Result<(), ApiError> {
        while self.peeked.is_none() && !self.done {
            match self.events.recv().await {
                Some(TokenEvent::PromptDone {
                    prompt_tokens,
                    cached,
                }) => {
                    self.prompt_tokens = prompt_tokens;
                    self.cached_tokens = cached;
                }
                Some(TokenEvent::Failed(message)) => {
                    self.done = true;
                    return Err(ApiError::Generation(message));
                }
                Some(event) => self.peeked = Some(event),
                None => {
                    self.done = true;
                    return Err(ApiError::Generation(GenerationError::Stopped));
                }
            }
        }
        Ok(())
    }

    /// The next step; `None` after `Finished` or `Failed`.
    pub async fn next(&mut self) -> Option<Step> {
        while !self.done {
            let event = match self.peeked.take() {
                Some(event) => event,
                None => self
                    .events
                    .recv()
                    .await
                    .unwrap_or(TokenEvent::Failed(GenerationError::Stopped)),
            };
            match event {
                TokenEvent::PromptDone {
                    prompt_tokens,
                    cached,
                } => {
                    self.prompt_tokens = prompt_tokens;
                    self.cached_tokens = cached;
                }
                TokenEvent::Drafts { drafted, accepted } => {
                    self.drafts = Some((drafted, accepted));
                }
                TokenEvent::Logprobs(lp) => self.next_logprobs = Some(lp),
                TokenEvent::Token(id) => {
                    self.completion_tokens += 1;
                    if let Some(lp) = self.next_logprobs.take() {
                        self.logprobs.push_back(lp);
                    }
                    let delta = match self.detok.push(id) {
                        Ok(delta) => delta,
                        Err(e) => {
                            return Some(
                                self.fail(ApiError::Internal(format!("detokenizing: {e}"))),
                            )
                        }
                    };
                    if delta.text.is_empty() {
                        continue;
                    }
                    let out = self.stops.push(delta);
                    if out.stopped {
                        return Some(self.finish_now(out.emit, FinishReason::Stop));
                    }
                    if !out.emit.text.is_empty() {
                        return Some(Step::Text(out.emit));
                    }
                }
                TokenEvent::Finished(reason) => {
                    let tail = match self.detok.flush() {
                        Ok(tail) => tail,
                        Err(e) => {
                            return Some(
                                self.fail(ApiError::Internal(format!("detokenizing: {e}"))),
                            )
                        }
                    };
                    let out = self.stops.push(tail);
                    if out.stopped {
                        return Some(self.finish_now(out.emit, FinishReason::Stop));
                    }
                    let mut last = out.emit;
                    let rest = self.stops.finish();
                    last.text.push_str(&rest.text);
                    last.ids.extend(rest.ids);
                    return Some(self.finish_now(last, reason));
                }
                TokenEvent::Failed(e) => return Some(self.fail(ApiError::Generation(e))),
            }
        }
        None
    }

    /// The stop string that ended the generation, if one did.
    pub fn stop_sequence(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// Token counts so far (final once `next` has returned `Finished`). Resumed ids count as
    /// completion tokens, not prompt tokens, so a resumed response reports the whole response.
    pub fn usage(&self) -> Usage {
        let prompt = self.prompt_tokens.saturating_sub(self.resumed);
        Usage::new(
            prompt as u64,
            (self.completion_tokens + self.resumed) as u64,
            self.cached_tokens.min(prompt) as u64,
        )
    }

    /// The log-probabilities of the tokens `ids` (the ids of the deltas handed out, in order),
    /// paired with them; empty when the request asked for none.
    pub fn take_logprobs(&mut self, ids: &[u32]) -> Vec<(u32, TokenLogprobs)> {
        let n = ids.len().min(self.logprobs.len());
        ids.iter().copied().zip(self.logprobs.drain(..n)).collect()
    }

    /// Drafted and accepted tokens, when speculative decoding ran for this request.
    pub fn drafts(&self) -> Option<(usize, usize)> {
        self.drafts
    }

    fn finish_now(&mut self, last: Delta, reason: FinishReason) -> Step {
        self.done = true;
        // Stop the MLX thread now (after a stop string it would go on generating).
        self.events.close();
        Step::Finished { last, reason }
    }

    fn fail(&mut self, error: ApiError) -> Step {
        self.done = true;
        self.events.close();
        Step::Failed(error)
    }
}
