//! The contract between the HTTP side (tokio) and the thread that owns MLX.
//!
//! The HTTP side tokenizes, renders chat templates, validates, detokenizes and matches stop
//! strings. The MLX thread only turns prompt token ids into generated token ids. A request is
//! cancelled by dropping its [`TokenEvent`] receiver: the MLX thread notices the closed channel
//! at its next step and frees the sequence.
use tokio::sync::mpsc;

use crate::sampling::SamplingParams;

/// One generation job for the MLX thread.
#[derive(Debug)]
pub struct GenerateRequest {
    /// Prompt token ids, already templated; never empty.
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Generate at most this many tokens (≥ 1).
    pub max_tokens: usize,
    /// Generation ends after emitting one of these (the model's end-of-sequence tokens).
    pub stop_token_ids: Vec<u32>,
    /// Where generated tokens go, in order.
    pub events: mpsc::UnboundedSender<TokenEvent>,
}

/// What the MLX thread reports for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// The prompt was processed; `cached` of its tokens came from the prompt cache.
    PromptDone { prompt_tokens: usize, cached: usize },
    /// One generated token.
    Token(u32),
    /// Generation ended; no more events follow.
    Finished(FinishReason),
    /// Generation failed; no more events follow.
    Failed(String),
}

/// Why a generation ended, in OpenAI's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// The sending half that the HTTP side holds; cloneable and cheap.
pub type WorkSender = mpsc::UnboundedSender<GenerateRequest>;
