//! A warm-up pass run before an engine reports ready.
//!
//! On a GPU the first forward passes of a process load and compile their kernels (on CUDA,
//! hundreds of milliseconds for the first prefill, tens for each new pass shape). An engine
//! pays that on its first requests; a standby engine, whose whole point is to take over a
//! crashed engine's streams at once, would pay it in the middle of the takeover. The warm-up
//! runs a few short generations through a throwaway [`Executor`] on the loaded model — the
//! same code path as real requests, prefill, decode and the sampler — so the kernels are
//! ready before `Ready` is sent. The throwaway executor has no prefix cache, no SSD tier and
//! its own counters: the warm-up leaves no entry, no KV and no figure behind.
use std::sync::Arc;

use tokio::sync::mpsc;

use super::executor::Executor;
use super::request::{GenerateRequest, TokenEvent};
use super::sampling_params::SamplingParams;
use super::scheduler::SchedulerLimits;
use super::RuntimeStats;
use crate::cache::{CacheManager, KvLayout};
use crate::loader::LoadError;
use crate::models::{CausalLm, ModelInfo};

/// Prompt tokens of each warm-up generation: long enough for a real prefill pass, short
/// enough to cost milliseconds on a GPU.
const PROMPT_TOKENS: usize = 48;
/// Tokens each warm-up generation makes: the first comes from the prefill, the rest from
/// decode steps.
const NEW_TOKENS: usize = 3;

/// The warm-up generations: one greedy row alone, then a batch of greedy and sampled rows
/// (the sampler's kernels), the prompts' lengths different so rows join unaligned. Public so
/// that tests can check the warm-up left no prefix-cache entry for these prompts.
pub fn requests(vocab: usize) -> Vec<(Vec<u32>, SamplingParams)> {
    let prompt = |len: usize, salt: usize| -> Vec<u32> {
        (0..len)
            .map(|i| ((i * 7 + salt) % vocab.max(1)) as u32)
            .collect()
    };
    let sampled = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: Some(0),
        ..SamplingParams::default()
    };
    vec![
        (prompt(PROMPT_TOKENS, 1), SamplingParams::default()),
        (prompt(PROMPT_TOKENS, 2), SamplingParams::default()),
        (prompt(PROMPT_TOKENS / 2, 3), sampled.clone()),
        (prompt(PROMPT_TOKENS + 5, 4), sampled),
    ]
}

/// Runs the warm-up generations on `model` to the end; an error names the failure (an engine
/// that cannot run a 48-token prompt cannot serve, so the load fails with it).
pub fn run(
    model: &dyn CausalLm,
    info: &ModelInfo,
    scheduler: SchedulerLimits,
    kv_budget_bytes: Option<u64>,
    plain_bytes_per_token: usize,
    layout: KvLayout,
) -> Result<(), LoadError> {
    let caches = CacheManager::new(
        kv_budget_bytes,
        0,
        plain_bytes_per_token,
        info.kv_bytes_per_token,
        layout,
    );
    let mut executor = Executor::new(
        model,
        info.clone(),
        scheduler,
        caches,
        Arc::new(RuntimeStats::default()),
        None,
        None,
    );
    let mut batches = requests(info.vocab_size);
    let rest = batches.split_off(1);
    for batch in [batches, rest] {
        let (work, rx) = mpsc::unbounded_channel();
        let mut events = Vec::new();
        for (prompt, sampling) in batch {
            let (tx, events_rx) = mpsc::unbounded_channel();
            work.send(GenerateRequest {
                prompt,
                sampling,
                max_tokens: NEW_TOKENS,
                stop_token_ids: Vec::new(),
                sample_offset: 0,
                events: tx,
                constraint: None,
                logprobs: None,
                adapter: None,
            })
            .expect("the receiver is held here");
            events.push(events_rx);
        }
        drop(work);
        executor.run(rx);
        for mut rx in events {
            while let Ok(event) = rx.try_recv() {
                if let TokenEvent::Failed(e) = event {
                    return Err(LoadError::WarmUp(e.to_string()));
                }
            }
        }
    }
    Ok(())
}
