//! Prefix-cache benchmark of the engine core: time to first token of a prompt whose first `n`
//! tokens are in the prefix cache (a hit) against the same prompt with nothing cached (a miss),
//! for each length `n` given, without HTTP, tokenizer or template (the served path's share is
//! `scripts/bench/prefix_cache.py`).
//!
//! `cargo run --release --example bench_prefix -- <model dir> <runs> <prefix tokens>...`
//!
//! Each run takes a fresh pseudo-random prefix (so the miss finds nothing cached), sends it with
//! a 16-token question and 8 new tokens (the miss; the prefix cache keeps its KV when it
//! leaves), then the same prefix with another 16-token question (the hit: 16 tokens to
//! prefill over `n` cached). Prints one JSON line per length with the medians of `runs` runs
//! after one warm-up run: `miss_ttft_s`, `hit_ttft_s`, their ratio and the tokens the hit
//! found cached. `RUST_LOG=mlxd_engine::prefix=debug` shows where a hit's time goes (lookup,
//! copy-in, prefill of the rest, first step).
use std::time::Instant;

use mlxd_engine::runtime::request::{GenerateRequest, TokenEvent};
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

/// A linear congruential sequence over `[100, vocab)`, seeded by `seed`.
fn tokens(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x: u64 = 12345 + seed;
    (0..len)
        .map(|_| {
            x = (x * 1103515245 + 12345) % (1 << 31);
            100 + (x % (vocab as u64 - 100)) as u32
        })
        .collect()
}

/// Submission to the first token, and the prompt tokens found cached.
fn ttft(runtime: &Runtime, prompt: Vec<u32>) -> anyhow::Result<(f64, usize)> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    runtime
        .work
        .send(GenerateRequest {
            prompt,
            sampling: Default::default(),
            max_tokens: 8,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: None,
        })
        .map_err(|_| anyhow::anyhow!("the runtime stopped"))?;
    let mut first = None;
    let mut cached = 0;
    while let Some(event) = rx.blocking_recv() {
        match event {
            TokenEvent::PromptDone { cached: c, .. } => cached = c,
            TokenEvent::Token(_) => {
                first.get_or_insert_with(|| start.elapsed().as_secs_f64());
            }
            TokenEvent::Finished(_) => break,
            TokenEvent::Failed(e) => anyhow::bail!("generation failed: {e}"),
            TokenEvent::Drafts { .. } | TokenEvent::Logprobs(_) => {}
        }
    }
    Ok((first.ok_or_else(|| anyhow::anyhow!("no token"))?, cached))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() >= 3,
        "usage: bench_prefix <model dir> <runs> <prefix tokens>..."
    );
    let runs: usize = args[1].parse()?;
    let lengths: Vec<usize> = args[2..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let runtime = Runtime::start(args[0].clone().into(), RuntimeLimits::default(), None)?;
    let vocab = runtime.info.vocab_size;
    let mut seed = 0;
    for &n in &lengths {
        let (mut misses, mut hits, mut found) = (Vec::new(), Vec::new(), 0);
        for run in 0..=runs {
            seed += 1;
            let prefix = tokens(n, vocab, seed * 1000);
            let ask = |q: u64| [prefix.clone(), tokens(16, vocab, seed * 1000 + q)].concat();
            let (miss, _) = ttft(&runtime, ask(1))?;
            let (hit, cached) = ttft(&runtime, ask(2))?;
            if run > 0 {
                misses.push(miss);
                hits.push(hit);
                found = cached;
            }
        }
        let (miss, hit) = (median(misses), median(hits));
        println!(
            "{{\"impl\":\"mlxd\",\"prefix_tokens\":{n},\"cached_tokens\":{found},\"miss_ttft_s\":{miss:.4},\"hit_ttft_s\":{hit:.4},\"hit_over_miss\":{:.3}}}",
            hit / miss
        );
    }
    runtime.join();
    Ok(())
}
