//! Engine-core benchmark: the runtime (scheduler, batched forward passes, on-device sampling)
//! without HTTP, for `batch` concurrent sequences.
//!
//! `cargo run --release --example bench_generate -- <model dir> <prompt tokens> <new tokens> <runs> [batch] [temperature]`
//!
//! Prints one JSON object with the medians of `runs` timed runs after one warm-up run:
//! `ttft_s` (submission to the first token of the first sequence), `prefill_tps` (prompt
//! tokens of the whole batch over the time until every sequence has its first token) and
//! `decode_tps` (tokens of all sequences per second once every sequence is decoding). The
//! prompts are fixed pseudo-random token sequences, the same ones
//! `scripts/bench/mlx_lm_bench.py` uses, so the two can be compared in one run
//! (`scripts/bench/engine.sh`). The prefix cache is off, so repeated runs do the same work.
use std::time::Instant;

use mlxd_engine::runtime::request::{GenerateRequest, TokenEvent};
use mlxd_engine::runtime::sampling_params::SamplingParams;
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

/// Benchmark prompt `row`: a linear congruential sequence over `[100, vocab)`.
fn prompt(len: usize, vocab: usize, row: usize) -> Vec<u32> {
    let mut x: u64 = 12345 + row as u64;
    (0..len)
        .map(|_| {
            x = (x * 1103515245 + 12345) % (1 << 31);
            100 + (x % (vocab as u64 - 100)) as u32
        })
        .collect()
}

struct Run {
    ttft: f64,
    prefill_tps: f64,
    decode_tps: f64,
}

fn run(
    runtime: &Runtime,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    temperature: f32,
) -> anyhow::Result<Run> {
    let start = Instant::now();
    let receivers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let sampling = SamplingParams {
                temperature,
                seed: Some(i as u64),
                ..Default::default()
            };
            runtime.work.send(GenerateRequest {
                prompt: p.clone(),
                sampling,
                max_tokens: new_tokens,
                stop_token_ids: vec![],
                sample_offset: 0,
                events: tx,
                constraint: None,
            })?;
            Ok(rx)
        })
        .collect::<anyhow::Result<_>>()?;
    // One thread per sequence records when each of its tokens arrived.
    let arrivals: Vec<Vec<Instant>> = std::thread::scope(|s| {
        let handles: Vec<_> = receivers
            .into_iter()
            .map(|mut rx| {
                s.spawn(move || {
                    let mut times = Vec::new();
                    while let Some(event) = rx.blocking_recv() {
                        match event {
                            TokenEvent::Token(_) => times.push(Instant::now()),
                            TokenEvent::Finished(_) => break,
                            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
                            TokenEvent::PromptDone { .. } => {}
                        }
                    }
                    times
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader"))
            .collect()
    });
    let first = arrivals.iter().map(|t| t[0]).min().expect("a sequence");
    let all_started = arrivals.iter().map(|t| t[0]).max().expect("a sequence");
    let end = arrivals.iter().map(|t| *t.last().unwrap()).max().unwrap();
    let steady: usize = arrivals
        .iter()
        .map(|t| t.iter().filter(|&&x| x > all_started).count())
        .sum();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(Run {
        ttft: (first - start).as_secs_f64(),
        prefill_tps: prompt_tokens as f64 / (all_started - start).as_secs_f64(),
        decode_tps: steady as f64 / (end - all_started).as_secs_f64(),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        (4..=6).contains(&args.len()),
        "usage: bench_generate <model dir> <prompt tokens> <new tokens> <runs> [batch] [temperature]"
    );
    let (dir, prompt_len, new_tokens, runs): (&str, usize, usize, usize) = (
        &args[0],
        args[1].parse()?,
        args[2].parse()?,
        args[3].parse()?,
    );
    let batch: usize = args.get(4).map_or(Ok(1), |s| s.parse())?;
    let temperature: f32 = args.get(5).map_or(Ok(0.0), |s| s.parse())?;
    let limits = RuntimeLimits {
        max_batch_size: batch.max(1),
        prompt_cache_bytes: 0,
        ..Default::default()
    };
    let runtime = Runtime::start(dir.into(), limits, None)?;
    let vocab = runtime.info.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch).map(|r| prompt(prompt_len, vocab, r)).collect();
    run(&runtime, &prompts, 8.min(new_tokens), temperature)?;
    let runs: Vec<Run> = (0..runs)
        .map(|_| run(&runtime, &prompts, new_tokens, temperature))
        .collect::<Result<_, _>>()?;
    let ttft = median(runs.iter().map(|r| r.ttft).collect());
    let prefill = median(runs.iter().map(|r| r.prefill_tps).collect());
    let decode = median(runs.iter().map(|r| r.decode_tps).collect());
    println!(
        "{{\"impl\":\"mlxd\",\"batch\":{batch},\"temperature\":{temperature},\"prompt_tokens\":{prompt_len},\"new_tokens\":{new_tokens},\"ttft_s\":{ttft:.4},\"prefill_tps\":{prefill:.1},\"decode_tps\":{decode:.2}}}"
    );
    runtime.join();
    Ok(())
}
