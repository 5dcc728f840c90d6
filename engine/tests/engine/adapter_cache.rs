//! The prefix cache and the SSD tier keyed by adapter (`mlxd_engine::cache::KvSpace`): a
//! prompt run with a LoRA adapter reuses the KV of earlier prompts run with the same adapter
//! (in memory, and from disk in a new engine), and never the base model's or another
//! adapter's. Tokens are checked against mlx-lm's `generate` with `adapter_path`.
use std::path::Path;

use mlxd_engine::adapters::AdapterId;
use mlxd_engine::cache::ssd::SsdConfig;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

use crate::common::{
    adapter_dir, collect, mlx_lm_greedy, mlx_lm_greedy_with_adapter, submit_greedy, tiny_model,
    Output,
};

const NEW_TOKENS: usize = 6;

/// A runtime on `model` with adapters `a` and `b`, a prefix cache, the SSD tier in `ssd`, and
/// the warm-up on.
fn start(model: &Path, ssd: &Path) -> Runtime {
    let limits = RuntimeLimits {
        prompt_cache_bytes: 64 << 20,
        adapters: vec![
            ("a".into(), adapter_dir("tiny-llama-lora-a")),
            ("b".into(), adapter_dir("tiny-llama-lora-b")),
        ],
        ssd: Some(SsdConfig {
            dir: ssd.to_path_buf(),
            max_bytes: None,
            demote_idle: None,
            checkpoint_every: None,
        }),
        // The warm-up runs rows of each adapter too (on a GPU it compiles their kernels):
        // what follows must find no KV, entry or figure of it, in any adapter's space.
        warm_up: Some(true),
        ..Default::default()
    };
    Runtime::start(model.to_path_buf(), limits, None).expect("load with adapters")
}

fn id(runtime: &Runtime, name: &str) -> AdapterId {
    let table = runtime.adapters.as_ref().expect("a table");
    table
        .id_of(name)
        .unwrap_or_else(|| panic!("adapter {name} loaded"))
}

/// One request alone, to its end.
fn run(runtime: &Runtime, prompt: &[u32], adapter: Option<AdapterId>) -> Output {
    collect(submit_greedy(runtime, prompt, NEW_TOKENS, adapter))
}

#[test]
fn an_adapters_prompts_reuse_only_their_own_kv_in_memory_and_on_disk() {
    let model = tiny_model("tiny-llama");
    let lora_a = adapter_dir("tiny-llama-lora-a");
    let ssd = tempfile::tempdir().unwrap();
    let first: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    // A second turn: the first prompt, then tokens of its own (not the first answer).
    let mut second = first.clone();
    second.extend([11, 12, 13, 14]);
    let mut third = second.clone();
    third.extend([21, 22]);

    let runtime = start(&model, ssd.path());
    let (a, b) = (id(&runtime, "a"), id(&runtime, "b"));
    assert_eq!(run(&runtime, &first, Some(a)).cached, 0);
    // Another adapter and the base model find nothing of adapter a's.
    let other = run(&runtime, &second, Some(b));
    assert_eq!(other.cached, 0, "adapter b reused adapter a's KV");
    let base = run(&runtime, &second, None);
    assert_eq!(base.cached, 0, "the base model reused adapter a's KV");
    assert_eq!(
        base.tokens,
        mlx_lm_greedy(&model, NEW_TOKENS, &second),
        "base tokens"
    );
    // Adapter a's second turn reuses its first prompt's KV and gives mlx-lm's tokens.
    let hit = run(&runtime, &second, Some(a));
    assert_eq!(hit.cached, first.len(), "adapter a's first turn in memory");
    assert_eq!(
        hit.tokens,
        mlx_lm_greedy_with_adapter(&model, &lora_a, NEW_TOKENS, &second),
        "tokens after a hit in adapter a's space"
    );
    runtime.join();

    // A new engine restores adapter a's entries from the SSD tier, in its space only.
    let runtime = start(&model, ssd.path());
    let (a, b) = (id(&runtime, "a"), id(&runtime, "b"));
    let restored = run(&runtime, &third, Some(a));
    assert!(
        restored.cached >= second.len(),
        "adapter a's second turn restored from disk: {} cached",
        restored.cached
    );
    assert_eq!(
        restored.tokens,
        mlx_lm_greedy_with_adapter(&model, &lora_a, NEW_TOKENS, &third),
        "tokens after a restore in adapter a's space"
    );
    // Adapter b's own entry (its first run of `second`) is on disk too, and serves b alone.
    let b_again = run(&runtime, &third, Some(b));
    assert!(b_again.cached >= second.len(), "{}", b_again.cached);
    assert_eq!(
        b_again.tokens,
        mlx_lm_greedy_with_adapter(
            &model,
            &adapter_dir("tiny-llama-lora-b"),
            NEW_TOKENS,
            &third
        ),
        "tokens after a restore in adapter b's space"
    );
    runtime.join();
}
