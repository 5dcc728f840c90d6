//! Helpers for the engine's integration tests that drive the batched runtime in this process.
//! What every test crate shares (paths, tiny models, the reference implementations, a real
//! engine process) is the test kit, `mlxd-tests`; the adapters below turn its errors into
//! panics with the reason, as these tests fail on a missing prerequisite.
use std::path::{Path, PathBuf};

pub use mlxd_tests::{test_home, workspace_root, EngineProcess};

/// The generated test model `name` (`scripts/test.sh` generates them).
pub fn tiny_model(name: &str) -> PathBuf {
    mlxd_tests::tiny_model(name).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Greedy tokens from mlx-lm, the reference implementation.
pub fn mlx_lm_greedy(model: &Path, max_tokens: usize, prompt: &[u32]) -> Vec<u32> {
    mlxd_tests::mlx_lm_greedy(model, max_tokens, prompt).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Greedy tokens from mlx-lm for each of `prompts`, in one Python process.
pub fn mlx_lm_greedy_many(model: &Path, max_tokens: usize, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    mlxd_tests::mlx_lm_greedy_many(model, max_tokens, prompts).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Chat-template token ids from Hugging Face `transformers` for each user turn, in one
/// Python process.
pub fn hf_chat_tokens_many(model: &Path, users: &[&str]) -> Vec<Vec<u32>> {
    mlxd_tests::hf_chat_tokens_many(model, users).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The LoRA adapter fixture `name`, beside the tiny models (`scripts/test.sh` trains it).
pub fn adapter_dir(name: &str) -> PathBuf {
    let dir = mlxd_tests::test_models().join(name);
    assert!(
        dir.join("adapters.safetensors").is_file(),
        "test adapter {} is missing (scripts/test.sh trains it)",
        dir.display()
    );
    dir
}

/// Greedy tokens from mlx-lm with the LoRA adapter in `adapter` applied.
pub fn mlx_lm_greedy_with_adapter(
    model: &Path,
    adapter: &Path,
    max_tokens: usize,
    prompt: &[u32],
) -> Vec<u32> {
    mlxd_tests::mlx_lm_greedy_with_adapter(model, adapter, max_tokens, prompt)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Chat-template token ids from Hugging Face `transformers` (the reference renderer).
pub fn hf_chat_tokens(model: &Path, user: &str) -> Vec<u32> {
    mlxd_tests::hf_chat_tokens(model, user).unwrap_or_else(|e| panic!("{e:#}"))
}

/// One generation for [`generate_together`]: prompt, sampling, max tokens.
#[derive(Clone)]
pub struct Gen {
    pub prompt: Vec<u32>,
    pub sampling: mlxd_engine::runtime::sampling_params::SamplingParams,
    pub max_tokens: usize,
    /// Ask for log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
}

impl Gen {
    pub fn greedy(prompt: &[u32], max_tokens: usize) -> Self {
        Self {
            prompt: prompt.to_vec(),
            sampling: Default::default(),
            max_tokens,
            logprobs: None,
        }
    }
}

/// What the runtime gave back for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub tokens: Vec<u32>,
    pub cached: usize,
    pub finish: Option<mlxd_engine::runtime::request::FinishReason>,
    /// Speculative drafts proposed and accepted, when drafting ran.
    pub drafts: Option<(usize, usize)>,
    /// One entry per token, when the request asked for log-probabilities.
    pub logprobs: Vec<mlxd_engine::runtime::request::TokenLogprobs>,
}

/// Sends one request to a running runtime; its events come on the receiver.
pub fn submit(
    runtime: &mlxd_engine::runtime::Runtime,
    g: &Gen,
) -> tokio::sync::mpsc::UnboundedReceiver<mlxd_engine::runtime::request::TokenEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(mlxd_engine::runtime::request::GenerateRequest {
            prompt: g.prompt.clone(),
            sampling: g.sampling.clone(),
            max_tokens: g.max_tokens,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: g.logprobs,
            adapter: None,
        })
        .expect("runtime is running");
    rx
}

/// Sends one greedy request for `prompt` to a running runtime, its rows run with `adapter`
/// (`None`: the base model); its events come on the receiver.
pub fn submit_greedy(
    runtime: &mlxd_engine::runtime::Runtime,
    prompt: &[u32],
    max_tokens: usize,
    adapter: Option<mlxd_engine::adapters::AdapterId>,
) -> tokio::sync::mpsc::UnboundedReceiver<mlxd_engine::runtime::request::TokenEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(mlxd_engine::runtime::request::GenerateRequest {
            prompt: prompt.to_vec(),
            sampling: Default::default(),
            max_tokens,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter,
        })
        .expect("runtime is running");
    rx
}

/// Sends every request to a running runtime at once (so they share the batch) and collects
/// the tokens of each, in order.
pub fn generate_together(runtime: &mlxd_engine::runtime::Runtime, gens: &[Gen]) -> Vec<Output> {
    let receivers: Vec<_> = gens.iter().map(|g| submit(runtime, g)).collect();
    receivers.into_iter().map(collect).collect()
}

/// Reads one request's events to its end.
pub fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<mlxd_engine::runtime::request::TokenEvent>,
) -> Output {
    use mlxd_engine::runtime::request::TokenEvent;
    let mut out = Output {
        tokens: vec![],
        cached: 0,
        finish: None,
        drafts: None,
        logprobs: vec![],
    };
    while let Some(event) = rx.blocking_recv() {
        match event {
            TokenEvent::PromptDone { cached, .. } => out.cached = cached,
            TokenEvent::Token(t) => out.tokens.push(t),
            TokenEvent::Logprobs(lp) => out.logprobs.push(lp),
            TokenEvent::Drafts { drafted, accepted } => out.drafts = Some((drafted, accepted)),
            TokenEvent::Finished(reason) => {
                out.finish = Some(reason);
                break;
            }
            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
        }
    }
    out
}

/// Each request alone, one after the other.
pub fn generate_alone(runtime: &mlxd_engine::runtime::Runtime, gens: &[Gen]) -> Vec<Output> {
    gens.iter()
        .map(|g| {
            generate_together(
                runtime,
                std::slice::from_ref(&Gen {
                    prompt: g.prompt.clone(),
                    sampling: g.sampling.clone(),
                    max_tokens: g.max_tokens,
                    logprobs: g.logprobs,
                }),
            )
            .remove(0)
        })
        .collect()
}

/// A runtime on the model in `dir` with default limits and the prefix cache `cache_bytes`.
pub fn start_runtime(dir: &Path, cache_bytes: u64) -> mlxd_engine::runtime::Runtime {
    let limits = mlxd_engine::runtime::RuntimeLimits {
        prompt_cache_bytes: cache_bytes,
        ..Default::default()
    };
    mlxd_engine::runtime::Runtime::start(dir.to_path_buf(), limits, None).expect("load")
}
