//! The contract between the HTTP side (tokio) and the thread that owns MLX.
//!
//! The HTTP side tokenizes, renders chat templates, validates, detokenizes and matches stop
//! strings. The MLX thread only turns prompt token ids into generated token ids. A request is
//! cancelled by dropping its [`TokenEvent`] receiver: the MLX thread notices the closed channel
//! at its next step and frees the sequence.
use mlxd_protocol::control::FatalKind;
use tokio::sync::mpsc;

use super::sampling_params::{SamplingError, SamplingParams};
use crate::adapters::{AdapterError, AdapterId, AdapterSummary};
use crate::constraint::TokenConstraint;

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
    /// Index of the first token to generate in the request's random stream: the number of
    /// tokens an interrupted generation already produced (0 for a new one), so that a resumed
    /// seeded request continues its draws where they stopped.
    pub sample_offset: usize,
    /// Where generated tokens go, in order.
    pub events: mpsc::UnboundedSender<TokenEvent>,
    /// Which tokens may come next (structured output, forced tool calls); `None` for free
    /// generation. A constrained sequence gets no speculative drafts and makes its batch
    /// step synchronously.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// (`None`: none). A sequence that wants them gets no speculative drafts and makes its
    /// batch step synchronously.
    pub logprobs: Option<usize>,
    /// The LoRA adapter this request's rows run with (`crate::adapters`); `None`: the base
    /// model.
    pub adapter: Option<AdapterId>,
}

/// Alternatives per token a request may ask for (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model (the log-softmax of its logits, before
/// bias, penalties, temperature or truncation, as mlx-lm and vLLM report it) and the most
/// likely tokens at its position, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What the MLX thread reports for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenEvent {
    /// The prompt was processed; `cached` of its tokens came from the prompt cache.
    PromptDone { prompt_tokens: usize, cached: usize },
    /// One generated token.
    Token(u32),
    /// The log-probabilities of the next `Token` (only for requests that asked).
    Logprobs(TokenLogprobs),
    /// Speculative decoding's account of this request, just before `Finished`.
    Drafts { drafted: usize, accepted: usize },
    /// Generation ended; no more events follow.
    Finished(FinishReason),
    /// Generation failed; no more events follow.
    Failed(GenerationError),
}

/// Why the MLX thread could not complete a request, by kind, so that the HTTP side maps each
/// to its status (see `server/error.rs`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GenerationError {
    /// The request's worst case cannot fit in the engine's KV budget, even alone.
    #[error(
        "the request needs {needed} bytes of KV cache (prompt {prompt_tokens} + max_tokens \
         {max_tokens} tokens), more than the engine's KV budget of {budget} bytes"
    )]
    KvBudget {
        needed: u64,
        budget: u64,
        prompt_tokens: usize,
        max_tokens: usize,
    },
    #[error("invalid sampling parameters: {0}")]
    Sampling(#[from] SamplingError),
    /// A token id outside the model's vocabulary (in the prompt or in `logit_bias`).
    #[error("{what} names token {token}, outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        what: &'static str,
        token: u32,
        vocab: usize,
    },
    /// MLX could not allocate; the engine is about to restart with smaller limits.
    #[error("the engine ran out of memory: {0}")]
    OutOfMemory(String),
    /// The GPU reported an error that leaves its context unusable (an illegal memory access,
    /// a failed launch): every later operation of the process fails, so the engine is about
    /// to restart.
    #[error("the GPU failed: {0}")]
    DeviceLost(String),
    /// The constraint could not advance or build its mask (a grammar engine failure).
    #[error("{0}")]
    Constraint(String),
    /// The request asks for what this engine cannot do as configured (a constrained request
    /// to an engine group), naming the request's field that asks it where there is one.
    #[error("{reason}")]
    Unsupported {
        param: Option<&'static str>,
        reason: String,
    },
    /// Any other MLX failure.
    #[error("MLX failed: {0}")]
    Mlx(String),
    /// The MLX thread stopped before the request finished.
    #[error("the model thread stopped")]
    Stopped,
    /// The request's adapter was unloaded between the request naming it and its admission.
    #[error("the adapter {0:?} was unloaded before the request started")]
    AdapterUnloaded(AdapterId),
}

impl GenerationError {
    /// Classifies an MLX failure message.
    pub fn from_mlx(message: String) -> Self {
        if is_out_of_memory(&message) {
            GenerationError::OutOfMemory(message)
        } else if is_device_lost(&message) {
            GenerationError::DeviceLost(message)
        } else {
            GenerationError::Mlx(message)
        }
    }

    /// How a failed step with this error ends a supervised engine, if it does: out of memory
    /// (restarted with smaller limits) or a lost device (restarted as after a crash). Either
    /// way the supervisor resumes the engine's streams on the new one.
    pub fn ends_engine(&self) -> Option<FatalKind> {
        match self {
            GenerationError::OutOfMemory(_) => Some(FatalKind::OutOfMemory),
            GenerationError::DeviceLost(_) => Some(FatalKind::Internal),
            _ => None,
        }
    }
}

/// CUDA's "sticky" errors, after which the process's GPU context fails every call (CUDA's
/// documentation: the context must be destroyed). Seen on an H100 whose memory another process
/// had taken (2026-12-05): "cudaGetLastError() failed: an illegal memory access was
/// encountered", then every step of that engine failed on.
const DEVICE_LOST: &[&str] = &[
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "device-side assert",
    "illegal instruction",
    "misaligned address",
    "hardware stack error",
    "ecc error",
];

/// MLX's allocation-failure messages (CPU malloc, Metal and CUDA allocators).
const OUT_OF_MEMORY: &[&str] = &[
    "unable to allocate",
    "out of memory",
    "outofmemory",
    "bad_alloc",
    "insufficient memory",
];

/// Whether `message`, case aside, contains any of `phrases`.
fn mentions_any(message: &str, phrases: &[&str]) -> bool {
    let m = message.to_ascii_lowercase();
    phrases.iter().any(|p| m.contains(p))
}

/// True for one of CUDA's sticky errors ([`DEVICE_LOST`]).
pub fn is_device_lost(message: &str) -> bool {
    mentions_any(message, DEVICE_LOST)
}

/// True for MLX's allocation-failure messages ([`OUT_OF_MEMORY`]).
pub fn is_out_of_memory(message: &str) -> bool {
    mentions_any(message, OUT_OF_MEMORY)
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

/// Adapter work for the MLX thread (the admin routes' `POST` and `DELETE
/// /admin/adapters`): loading reads and evaluates the factors there, and both change the
/// table and the executor's prefix-cache spaces between forward passes.
#[derive(Debug)]
pub enum AdapterWork {
    /// Load the mlx-lm adapter in `dir` under `name`.
    Load {
        name: String,
        dir: std::path::PathBuf,
        reply: tokio::sync::oneshot::Sender<Result<AdapterSummary, AdapterWorkError>>,
    },
    /// Unload the adapter `name`, refused while a request in flight runs with it.
    Unload {
        name: String,
        reply: tokio::sync::oneshot::Sender<Result<AdapterSummary, AdapterWorkError>>,
    },
}

/// Why adapter work failed, by kind (see `server/error.rs` for the statuses).
#[derive(Debug, thiserror::Error)]
pub enum AdapterWorkError {
    #[error(transparent)]
    Load(#[from] AdapterError),
    /// The adapter's files could not be read to name its prefix-cache space.
    #[error("cannot read the adapter in {path}: {message}")]
    Space {
        path: std::path::PathBuf,
        message: String,
    },
    #[error("no adapter named {name:?} is loaded (loaded: {})", loaded.join(", "))]
    Unknown { name: String, loaded: Vec<String> },
    /// Requests in flight (waiting, prefilling or decoding) run with it.
    #[error(
        "the adapter {name:?} is in use by {requests} request(s) in flight; unload it once \
         they finish"
    )]
    InUse { name: String, requests: usize },
    /// A model without an adapter table (an engine group's shard).
    #[error("this model takes no adapters")]
    NotAdaptable,
}

/// The sending half of the MLX thread's adapter work.
pub type AdapterWorkSender = mpsc::UnboundedSender<AdapterWork>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlx_failures_are_classified_by_what_they_leave_of_the_engine() {
        let oom = "cudaMallocAsync(&data, size, stream) failed: out of memory at transforms.cpp:15";
        assert!(matches!(
            GenerationError::from_mlx(oom.into()),
            GenerationError::OutOfMemory(_)
        ));
        let lost = "cudaGetLastError() failed: an illegal memory access was encountered";
        let e = GenerationError::from_mlx(lost.into());
        assert!(matches!(e, GenerationError::DeviceLost(_)), "{e:?}");
        assert_eq!(e.ends_engine(), Some(FatalKind::Internal));
        assert_eq!(
            GenerationError::from_mlx(oom.into()).ends_engine(),
            Some(FatalKind::OutOfMemory)
        );
        // A failure of one operation leaves the engine usable: its requests fail, it serves on.
        let other = GenerationError::from_mlx("[matmul] shapes (2,3) and (4,5) mismatch".into());
        assert!(matches!(other, GenerationError::Mlx(_)));
        assert_eq!(other.ends_engine(), None);
    }
}
