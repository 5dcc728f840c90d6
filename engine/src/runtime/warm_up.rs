//! A warm-up pass run before an engine reports ready.
//!
//! On a GPU the first forward passes of a process load and compile their kernels (on CUDA,
//! hundreds of milliseconds for the first prefill, tens for each new pass shape). An engine
//! pays that on its first requests; a standby engine, whose whole point is to take over a
//! crashed engine's streams at once, would pay it in the middle of the takeover. The warm-up
//! runs a few short generations through a throwaway [`Executor`] on the loaded model — the
//! same code path as real requests, prefill, decode and the sampler — so the kernels are
//! ready before `Ready` is sent. With LoRA adapters loaded, rows of an adapter alone and a
//! batch mixing the base and every adapter (up to [`MIXED_ADAPTERS`]) follow: the adapter
//! passes have kernels of their own. On CUDA the decode attention kernels for plain caches,
//! which serve only long contexts, take every warm-up pass of two or more rows
//! ([`crate::models::decode_attention::warming_up`]), and one batch holds two rows of one
//! length, whose passes have no mask (only there), so both variants compile here. The throwaway executor
//! has no prefix cache, no SSD tier and its own counters: the warm-up leaves no entry, no KV
//! and no figure behind.
use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::mpsc;

use super::executor::Executor;
use super::request::{GenerateRequest, TokenEvent};
use super::sampling_params::SamplingParams;
use super::scheduler::SchedulerLimits;
use super::RuntimeStats;
use crate::adapters::AdapterId;
use crate::cache::{CacheManager, KvLayout, KvSpace};
use crate::loader::LoadError;
use crate::models::{decode_attention, CausalLm, ModelInfo};

/// Prompt tokens of each warm-up generation: long enough for a real prefill pass, short
/// enough to cost milliseconds on a GPU.
const PROMPT_TOKENS: usize = 48;
/// Tokens the first row of each warm-up batch makes: the first comes from the prefill, the
/// rest from decode steps ([`new_tokens`]).
const NEW_TOKENS: usize = 3;

/// One warm-up generation: its prompt, sampling and adapter (none: the base model).
pub type WarmUpRow = (Vec<u32>, SamplingParams, Option<AdapterId>);

/// The most adapters the mixed warm-up batch holds a row of.
pub const MIXED_ADAPTERS: usize = 4;

/// The warm-up batches with adapters loaded (none without): the first adapter's row alone,
/// then a batch of a base row and a row of each of the first [`MIXED_ADAPTERS`] adapters.
pub fn adapter_batches(vocab: usize, adapters: &[AdapterId]) -> Vec<Vec<WarmUpRow>> {
    let Some(&first) = adapters.first() else {
        return Vec::new();
    };
    let rows = requests(vocab);
    let row = |(prompt, sampling): &(Vec<u32>, SamplingParams), adapter| {
        (prompt.clone(), sampling.clone(), adapter)
    };
    let alone = vec![row(&rows[0], Some(first))];
    let mut mixed = vec![row(&rows[1], None)];
    mixed.extend(
        adapters
            .iter()
            .take(MIXED_ADAPTERS)
            .zip(rows.iter().cycle())
            .map(|(&id, r)| row(r, Some(id))),
    );
    vec![alone, mixed]
}

/// The warm-up generations: one greedy row alone, then a batch of greedy and sampled rows
/// (the sampler's kernels: seeded with top-p, and unseeded with the temperature alone, the
/// two draw their noise differently), the prompts' lengths different so rows join unaligned.
/// Public so that tests can check the warm-up left no prefix-cache entry for these prompts.
///
/// On a machine where MLX has never run, each kernel MLX compiles at first use (and keeps on
/// disk) costs seconds: a first burst of 32 sampled streams on a fresh H100 waited 8.6 s
/// (2026-12-05) for kernels this warm-up did not reach then (the unseeded draw, the gathers
/// that drop finished rows from the batch), which is why both are here.
pub fn requests(vocab: usize) -> Vec<(Vec<u32>, SamplingParams)> {
    let sampled = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: Some(0),
        ..SamplingParams::default()
    };
    let unseeded = SamplingParams {
        temperature: 0.7,
        ..SamplingParams::default()
    };
    vec![
        (prompt(vocab, PROMPT_TOKENS, 1), SamplingParams::default()),
        (prompt(vocab, PROMPT_TOKENS, 2), SamplingParams::default()),
        (prompt(vocab, PROMPT_TOKENS / 2, 3), sampled.clone()),
        (prompt(vocab, PROMPT_TOKENS + 5, 4), sampled),
        (prompt(vocab, PROMPT_TOKENS - 7, 5), unseeded),
    ]
}

/// A warm-up prompt of `len` tokens below `vocab`, varied by `salt`.
fn prompt(vocab: usize, len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7 + salt) % vocab.max(1)) as u32)
        .collect()
}

/// Tokens the `index`-th row of a warm-up batch makes: one more than the row before, so that
/// rows finish at different steps and the batch drops finished rows while others decode.
fn new_tokens(index: usize) -> usize {
    NEW_TOKENS + index
}

/// Runs the warm-up generations on `model` to the end; an error names the failure (an engine
/// that cannot run a 48-token prompt cannot serve, so the load fails with it).
pub fn run(
    model: &dyn CausalLm,
    info: &ModelInfo,
    adapter_spaces: &HashMap<AdapterId, KvSpace>,
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
    )
    .with_adapter_spaces(adapter_spaces.clone());
    let mut batches = requests(info.vocab_size);
    let rest = batches.split_off(1);
    let mut all: Vec<Vec<WarmUpRow>> = [batches, rest]
        .into_iter()
        .map(|b| b.into_iter().map(|(p, s)| (p, s, None)).collect())
        .collect();
    let mut adapters: Vec<AdapterId> = adapter_spaces.keys().copied().collect();
    adapters.sort_by_key(|id| id.0);
    all.extend(adapter_batches(info.vocab_size, &adapters));
    if decode_attention::serves_plain_caches() {
        // Two rows of one length: an aligned batch (no mask), which the others are not.
        all.insert(
            1,
            [1, 6]
                .map(|salt| {
                    let prompt = prompt(info.vocab_size, PROMPT_TOKENS, salt);
                    (prompt, SamplingParams::default(), None)
                })
                .to_vec(),
        );
    }
    decode_attention::warming_up(|| run_batches(&mut executor, all))
}

/// Runs each warm-up batch to its end on `executor`; the first failed row fails the warm-up.
fn run_batches(executor: &mut Executor<'_>, all: Vec<Vec<WarmUpRow>>) -> Result<(), LoadError> {
    for batch in all {
        let (work, rx) = mpsc::unbounded_channel();
        let mut events = Vec::new();
        for (index, (prompt, sampling, adapter)) in batch.into_iter().enumerate() {
            let (tx, events_rx) = mpsc::unbounded_channel();
            work.send(GenerateRequest {
                prompt,
                sampling,
                max_tokens: new_tokens(index),
                stop_token_ids: Vec::new(),
                sample_offset: 0,
                events: tx,
                constraint: None,
                logprobs: None,
                adapter,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warm_up_draws_seeded_and_unseeded_and_drops_rows_at_different_steps() {
        let rows = requests(100);
        let sampled: Vec<Option<u64>> = rows
            .iter()
            .filter(|(_, s)| s.temperature > 0.0)
            .map(|(_, s)| s.seed)
            .collect();
        assert!(sampled.iter().any(Option::is_some), "{sampled:?}");
        assert!(sampled.iter().any(Option::is_none), "{sampled:?}");
        let lengths: Vec<usize> = (0..rows.len()).map(new_tokens).collect();
        assert!(lengths.windows(2).all(|w| w[0] < w[1]), "{lengths:?}");
        assert_eq!(lengths[0], NEW_TOKENS);
    }

    #[test]
    fn adapter_rows_are_warmed_alone_and_mixed_with_the_base() {
        assert!(
            adapter_batches(100, &[]).is_empty(),
            "no adapters: no batch"
        );
        let ids: Vec<AdapterId> = (1..=6).map(AdapterId).collect();
        let batches = adapter_batches(100, &ids);
        let adapters =
            |b: &Vec<(Vec<u32>, SamplingParams, Option<AdapterId>)>| -> Vec<Option<u64>> {
                b.iter().map(|(_, _, a)| a.map(|id| id.0)).collect()
            };
        assert_eq!(adapters(&batches[0]), [Some(1)]);
        assert_eq!(
            adapters(&batches[1]),
            [None, Some(1), Some(2), Some(3), Some(4)],
            "a base row beside the first MIXED_ADAPTERS adapters"
        );
        // Unaligned prompts and a sampled row, as in the plain warm-up.
        let lens: Vec<usize> = batches[1].iter().map(|(p, _, _)| p.len()).collect();
        assert!(lens.iter().any(|&l| l != lens[0]), "{lens:?}");
        assert!(batches[1].iter().any(|(_, s, _)| s.temperature > 0.0));
    }
}
