//! Sliding-window layers keep a bounded cache in the batched runtime, and nothing a bounded
//! cache does changes greedy tokens: on the tiny Gemma 3 model (`family-gemma3_text`: window
//! 8 on every other layer), a 200-token generation holds bounded KV bytes and gives the tokens
//! of the unbounded cache and of mlx-lm; in a padded batch; on a prefix-cache hit, a hit that
//! the window makes a miss, an SSD restore and a resume from a generation checkpoint; and
//! with n-gram drafts rolled back inside cut caches.
//!
//! The model is wrapped so that the test decides which layer windows the runtime sees:
//! those of `config.json` (bounded), or none (every position kept, the window a mask only).
use crate::common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{generate_alone, generate_together, Gen, Output};
use mlx_rs::error::Exception;
use mlx_rs::Array;
use mlxd_engine::cache::ssd::SsdConfig;
use mlxd_engine::cache::{LayerCache, WINDOW_SLACK};
use mlxd_engine::loader::LoadError;
use mlxd_engine::models::{self, CausalLm, Feature, ModelInfo};
use mlxd_engine::runtime::draft::{DraftSource, NgramSizes, Speculation};
use mlxd_engine::runtime::request::TokenEvent;
use mlxd_engine::runtime::{ModelLoader, Runtime, RuntimeLimits};

const FAMILY: &str = "family-gemma3_text";

/// A loaded model that reports the layer windows the test chooses.
struct Windowed {
    inner: Box<dyn CausalLm>,
    windows: Vec<Option<usize>>,
}

impl CausalLm for Windowed {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        self.inner.hidden(tokens, caches)
    }
    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        self.inner.head(hidden)
    }
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn refuses(&self, feature: Feature) -> Option<String> {
        self.inner.refuses(feature)
    }
    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.windows.clone()
    }
}

/// Gemma 3's windows as mlx-lm places them: every layer but each `sliding_window_pattern`-th
/// attends within `sliding_window`.
fn config_windows(dir: &Path) -> Vec<Option<usize>> {
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let c: serde_json::Value = serde_json::from_str(&text).expect("config JSON");
    let window = c["sliding_window"].as_u64().expect("sliding_window") as usize;
    let pattern = c["sliding_window_pattern"].as_u64().expect("pattern") as usize;
    let layers = c["num_hidden_layers"].as_u64().expect("layers") as usize;
    (0..layers)
        .map(|i| ((i + 1) % pattern != 0).then_some(window))
        .collect()
}

fn model_dir() -> PathBuf {
    common::tiny_model(FAMILY)
}

/// A runtime on the model with bounded window caches or unbounded ones.
fn start(bounded: bool, limits: RuntimeLimits) -> Runtime {
    let dir = model_dir();
    let windows = if bounded {
        config_windows(&dir)
    } else {
        vec![None; config_windows(&dir).len()]
    };
    let load: ModelLoader = Box::new(move |dir: &Path| -> Result<Box<dyn CausalLm>, LoadError> {
        let inner = models::load(dir)?;
        // Once the family reports its windows itself, they must be mlx-lm's.
        let own = inner.layer_windows();
        if own.iter().any(Option::is_some) {
            assert_eq!(own, config_windows(dir), "the family's layer windows");
        }
        Ok(Box::new(Windowed { inner, windows }))
    });
    Runtime::start_with_loader(dir, limits, None, load).expect("load")
}

fn cache_limits(prompt_cache_bytes: u64) -> RuntimeLimits {
    RuntimeLimits {
        prompt_cache_bytes,
        ..Default::default()
    }
}

/// A prompt of `n` tokens that does not repeat itself.
fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 101 + 11) % 397)
        .collect()
}

/// Greedy tokens for `prompt`, with the largest KV bytes the runtime reported meanwhile.
fn generate_watching_kv(runtime: &Runtime, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, u64) {
    let mut rx = common::submit_greedy(runtime, prompt, max_tokens, None);
    let (mut tokens, mut most) = (Vec::new(), 0);
    while let Some(event) = rx.blocking_recv() {
        most = most.max(runtime.stats.kv_bytes.load(Ordering::Relaxed));
        match event {
            TokenEvent::Token(t) => tokens.push(t),
            TokenEvent::Finished(_) => break,
            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
            _ => {}
        }
    }
    (tokens, most)
}

fn tokens(outputs: &[Output]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.tokens.clone()).collect()
}

#[test]
fn a_long_generation_holds_bounded_kv_and_the_unbounded_tokens() {
    let dir = model_dir();
    let windows = config_windows(&dir);
    let p = prompt(100, 1);
    let bounded = start(true, cache_limits(0));
    let (ours, bounded_most) = generate_watching_kv(&bounded, &p, 200);
    let info = bounded.info.clone();
    bounded.join();
    let unbounded = start(false, cache_limits(0));
    let (theirs, unbounded_most) = generate_watching_kv(&unbounded, &p, 200);
    unbounded.join();
    assert_eq!(ours.len(), 200);
    assert_eq!(ours, theirs, "bounded window caches changed greedy tokens");
    assert_eq!(
        ours,
        common::mlx_lm_greedy(&dir, 200, &p),
        "greedy tokens differ from mlx-lm's (its rotating window cache)"
    );

    // 300 positions: a global layer's buffer grows to 513 positions (whole steps of 256 plus
    // one, `cache::stored::capacity_for`); a windowed one holds at most two spans of window +
    // slack.
    let per_layer_position = (info.kv_bytes_per_token / info.num_layers) as u64;
    let global = windows.iter().filter(|w| w.is_none()).count() as u64;
    let span = windows.iter().flatten().map(|w| w + WINDOW_SLACK);
    let bound = (global * 513 + span.map(|s| 2 * s as u64).sum::<u64>()) * per_layer_position;
    assert!(
        bounded_most <= bound,
        "bounded caches held {bounded_most} bytes, more than {bound}"
    );
    assert!(
        unbounded_most > bound,
        "the unbounded run ({unbounded_most} bytes) should not fit the bound {bound}"
    );
}

#[test]
fn a_padded_batch_with_cut_caches_gives_each_rows_tokens() {
    let gens: Vec<Gen> = [(90, 2), (7, 3), (41, 4), (1, 5)]
        .into_iter()
        .map(|(n, seed)| Gen::greedy(&prompt(n, seed), 120))
        .collect();
    let unbounded = start(false, cache_limits(0));
    let reference = tokens(&generate_alone(&unbounded, &gens));
    unbounded.join();
    let bounded = start(true, cache_limits(0));
    assert_eq!(tokens(&generate_together(&bounded, &gens)), reference);
    assert_eq!(tokens(&generate_alone(&bounded, &gens)), reference);
    bounded.join();
}

#[test]
fn hits_restores_and_checkpoints_of_cut_caches_give_the_tokens_of_a_miss() {
    let ssd = tempfile::tempdir().expect("tempdir");
    let with_ssd = RuntimeLimits {
        ssd: Some(SsdConfig {
            dir: ssd.path().to_path_buf(),
            max_bytes: None,
            demote_idle: None,
            checkpoint_every: Some(40),
        }),
        ..cache_limits(64 << 20)
    };
    let miss = start(true, cache_limits(0));
    let fresh = |g: &Gen| generate_alone(&miss, std::slice::from_ref(g)).remove(0);

    let p = prompt(100, 6);
    let first = Gen::greedy(&p, 200);
    let cached = start(true, with_ssd.clone());
    let out = generate_alone(&cached, std::slice::from_ref(&first)).remove(0);
    assert_eq!(out.tokens, fresh(&first).tokens);
    let history: Vec<u32> = p.iter().chain(&out.tokens).copied().collect();

    // A follow-up turn: the whole conversation is cached.
    let mut turn = history.clone();
    turn.extend([5, 6, 7]);
    let follow_up = Gen::greedy(&turn, 40);
    let hit = generate_alone(&cached, std::slice::from_ref(&follow_up)).remove(0);
    assert!(
        hit.cached > 250,
        "the follow-up turn hit {} tokens",
        hit.cached
    );
    let expected = fresh(&follow_up).tokens;
    assert_eq!(hit.tokens, expected, "a hit on cut caches");

    // A prompt branching a few tokens before the entry's end still finds the window.
    let mut near = history[..history.len() - 6].to_vec();
    near.extend([3, 3]);
    let near = Gen::greedy(&near, 30);
    let out = generate_alone(&cached, std::slice::from_ref(&near)).remove(0);
    assert_eq!(out.cached, history.len() - 6);
    assert_eq!(out.tokens, fresh(&near).tokens);

    // A prompt branching early needs positions the windowed layers evicted: a miss.
    let mut early = p[..32].to_vec();
    early.extend([9, 9, 9]);
    let early = Gen::greedy(&early, 30);
    let out = generate_alone(&cached, std::slice::from_ref(&early)).remove(0);
    assert_eq!(out.cached, 0, "an entry whose window moved on cannot serve");
    assert_eq!(out.tokens, fresh(&early).tokens);

    let report = cached
        .ssd
        .as_ref()
        .expect("SSD")
        .flush(Duration::from_secs(60));
    assert!(report.complete && report.files >= 3, "{report:?}");
    cached.join();

    // A new runtime restores the conversation from the SSD tier...
    let restored = start(true, with_ssd.clone());
    let out = generate_alone(&restored, std::slice::from_ref(&follow_up)).remove(0);
    assert!(out.cached > 250, "restored {} tokens", out.cached);
    assert_eq!(out.tokens, expected, "restored from the SSD tier");
    restored.join();

    // ...and a resume after a crash, 120 tokens in, from a generation checkpoint (the final
    // entry's windows have moved past it).
    let resumed = start(true, with_ssd);
    let resume = Gen::greedy(&history[..220], 60);
    let out = generate_alone(&resumed, std::slice::from_ref(&resume)).remove(0);
    assert!(
        out.cached >= 200,
        "the resume restored {} tokens: no checkpoint served",
        out.cached
    );
    assert_eq!(
        out.tokens,
        fresh(&resume).tokens,
        "resumed from a checkpoint"
    );
    assert_eq!(
        out.tokens,
        history[220..280],
        "resumed where the first run was"
    );
    resumed.join();
    miss.join();
}

/// Greedy tokens of `gens` with speculative decoding from `source` equal `reference`, in a
/// batch and alone; returns the (drafted, accepted) totals of the batch.
fn drafting_leaves_tokens(
    gens: &[Gen],
    reference: &[Vec<u32>],
    source: DraftSource,
    num_draft: usize,
) -> (usize, usize) {
    let spec = start(
        true,
        RuntimeLimits {
            speculation: Some(Speculation { source, num_draft }),
            ..cache_limits(0)
        },
    );
    let together = generate_together(&spec, gens);
    assert_eq!(
        tokens(&together),
        reference,
        "{num_draft} drafts in a batch"
    );
    assert_eq!(
        tokens(&generate_alone(&spec, gens)),
        reference,
        "{num_draft} drafts alone"
    );
    spec.join();
    together
        .iter()
        .filter_map(|o| o.drafts)
        .fold((0, 0), |(d, a), (x, y)| (d + x, a + y))
}

#[test]
fn drafts_rolled_back_in_cut_caches_leave_greedy_tokens_unchanged() {
    let run: Vec<u32> = (40..52).collect();
    let mut repeated = prompt(30, 7);
    for _ in 0..4 {
        repeated.extend(&run);
        repeated.push(3);
    }
    let gens = vec![
        Gen::greedy(&repeated, 200),
        Gen::greedy(&prompt(60, 8), 150),
        Gen::greedy(&[11, 12, 11, 12, 11, 12], 180),
    ];
    let plain = start(true, cache_limits(0));
    let reference = tokens(&generate_alone(&plain, &gens));
    plain.join();
    // Prompt lookup: this random model's text does not repeat, so rows stay shadowed and
    // seldom draft; what does draft must not change a token.
    for num_draft in [3, 16] {
        let ngram = DraftSource::Ngram(NgramSizes::new(1, 3).expect("sizes"));
        drafting_leaves_tokens(&gens, &reference, ngram, num_draft);
    }
    // The model's 4-bit copy drafts: close but not equal logits, so passes accept some drafts
    // and roll the rest back, row by row, in caches that cuts keep bounded.
    let draft = common::tiny_model(&format!("{FAMILY}-q4"));
    for num_draft in [4, 16] {
        let (drafted, accepted) = drafting_leaves_tokens(
            &gens,
            &reference,
            DraftSource::Model(draft.clone()),
            num_draft,
        );
        assert!(
            accepted > 0 && drafted > accepted,
            "{num_draft} drafts: {accepted} of {drafted} accepted; rollback untested"
        );
    }
}
