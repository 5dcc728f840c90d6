//! Prefix-cache benchmark of the engine core: time to first token of a prompt whose first `n`
//! tokens are in the prefix cache (a hit) against the same prompt with nothing cached (a miss),
//! for each length `n` given, without HTTP, tokenizer or template (the served path's share is
//! `scripts/bench/prefix_cache.py`).
//!
//! `cargo run --release --example bench_prefix -- <model dir> <runs> <prefix tokens>... [--together N]`
//!
//! Each run takes a fresh pseudo-random prefix (so the miss finds nothing cached), sends it with
//! a 16-token question and 8 new tokens (the miss; the prefix cache keeps its KV when it
//! leaves), then the same prefix with another 16-token question (the hit: 16 tokens to
//! prefill over `n` cached). Prints one JSON line per length with the medians of `runs` runs
//! after one warm-up run: `miss_ttft_s`, `hit_ttft_s`, their ratio and the tokens the hit
//! found cached. `RUST_LOG=mlxd_engine::prefix=debug` shows where a hit's time goes (lookup,
//! copy-in, prefill of the rest, first step).
//!
//! `--together N`: each run sends `N` prompts of `n` tokens with distinct prefixes at once (the
//! misses), then the same prefixes with other questions at once (the hits: a burst of prefix
//! hits, as a chat server sees after a restart of its clients or an agent fanning out), and
//! prints the medians over runs of the burst's median and slowest time to first token (with a
//! 32 GiB prefix cache, so that every prefix of the burst stays cached).
//!
//! `MLXD_HOST_PROFILE=<file>` (Linux) samples the host during the timed single hits only
//! (`support/host_sampler.rs`; `scripts/bench/host_profile.py` reads the file).
use std::time::Instant;

#[path = "support/host_sampler.rs"]
mod host_sampler;

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
    let start = Instant::now();
    let rx = submit(runtime, prompt)?;
    first_token(rx, start)
}

/// Sends one greedy 8-token request.
fn submit(
    runtime: &Runtime,
    prompt: Vec<u32>,
) -> anyhow::Result<tokio::sync::mpsc::UnboundedReceiver<TokenEvent>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
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
    Ok(rx)
}

/// Seconds from `start` to the request's first token (read to its end), and the prompt tokens
/// found cached.
fn first_token(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<TokenEvent>,
    start: Instant,
) -> anyhow::Result<(f64, usize)> {
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

/// A burst's times to first token (seconds) and the fewest tokens any of its prompts found
/// cached.
struct Burst {
    median: f64,
    slowest: f64,
    cached: usize,
}

/// `prompts` sent at once.
fn burst(runtime: &Runtime, prompts: Vec<Vec<u32>>) -> anyhow::Result<Burst> {
    let start = Instant::now();
    let receivers = prompts
        .into_iter()
        .map(|p| submit(runtime, p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut times = Vec::new();
    let mut cached = usize::MAX;
    for rx in receivers {
        let (t, c) = first_token(rx, start)?;
        times.push(t);
        cached = cached.min(c);
    }
    let slowest = times.iter().copied().fold(0.0, f64::max);
    Ok(Burst {
        median: median(times),
        slowest,
        cached,
    })
}

fn main() -> anyhow::Result<()> {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_prefix <model dir> <runs> <prefix tokens>... [--together N]";
    let together: Option<usize> = match args.iter().position(|a| a == "--together") {
        Some(i) => {
            anyhow::ensure!(i + 1 < args.len(), "{usage}");
            let n = args.remove(i + 1).parse()?;
            args.remove(i);
            anyhow::ensure!(n > 0, "--together needs at least one prompt");
            Some(n)
        }
        None => None,
    };
    anyhow::ensure!(args.len() >= 3, "{usage}");
    let runs: usize = args[1].parse()?;
    let lengths: Vec<usize> = args[2..]
        .iter()
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    // A burst's prefixes must all stay cached: room for 32 prompts of 30k tokens of a 1B
    // model (32 KiB a token) rather than the default's 1 GiB.
    let limits = match together {
        Some(_) => RuntimeLimits {
            prompt_cache_bytes: 32 << 30,
            ..RuntimeLimits::default()
        },
        None => RuntimeLimits::default(),
    };
    let runtime = Runtime::start(args[0].clone().into(), limits, None)?;
    let vocab = runtime.info.vocab_size;
    let sampler = host_sampler::Sampler::from_env()?;
    // Samples the timed single hits alone (nothing with `--together`).
    let sample_hits = |on: bool| {
        if let Some(s) = &sampler {
            s.set_sampling(on);
        }
    };
    sample_hits(false);
    let mut seed = 0;
    for &n in &lengths {
        if let Some(count) = together {
            let mut rounds = Vec::new();
            for run in 0..=runs {
                seed += 1;
                let prefixes: Vec<Vec<u32>> = (0..count as u64)
                    .map(|i| tokens(n, vocab, seed * 1000 + i * 7))
                    .collect();
                let ask = |q: u64| -> Vec<Vec<u32>> {
                    prefixes
                        .iter()
                        .enumerate()
                        .map(|(i, p)| {
                            [
                                p.clone(),
                                tokens(16, vocab, seed * 1000 + q + 97 * i as u64),
                            ]
                            .concat()
                        })
                        .collect()
                };
                let miss = burst(&runtime, ask(1))?;
                let hit = burst(&runtime, ask(2))?;
                if run > 0 {
                    rounds.push((miss, hit));
                }
            }
            let pick = |f: &dyn Fn(&(Burst, Burst)) -> f64| median(rounds.iter().map(f).collect());
            let found = rounds.iter().map(|r| r.1.cached).min().unwrap_or(0);
            println!(
                "{}",
                serde_json::json!({
                    "impl": "mlxd",
                    "together": count,
                    "prefix_tokens": n,
                    "cached_tokens_min": found,
                    "miss_ttft_p50_s": pick(&|r| r.0.median),
                    "miss_ttft_max_s": pick(&|r| r.0.slowest),
                    "hit_ttft_p50_s": pick(&|r| r.1.median),
                    "hit_ttft_max_s": pick(&|r| r.1.slowest),
                })
            );
            continue;
        }
        let (mut misses, mut hits, mut found) = (Vec::new(), Vec::new(), 0);
        for run in 0..=runs {
            seed += 1;
            let prefix = tokens(n, vocab, seed * 1000);
            let ask = |q: u64| [prefix.clone(), tokens(16, vocab, seed * 1000 + q)].concat();
            let (miss, _) = ttft(&runtime, ask(1))?;
            sample_hits(run > 0);
            let hit = ttft(&runtime, ask(2));
            sample_hits(false);
            let (hit, cached) = hit?;
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
    if let Some(sampler) = sampler {
        sampler.finish()?;
    }
    runtime.join();
    Ok(())
}
