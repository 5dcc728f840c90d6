//! Engine-core benchmark: time to first token, prefill and decode speed for greedy generation.
//!
//! `cargo run --release --example bench_generate -- <model dir> <prompt tokens> <new tokens> <runs>`
//!
//! Prints one JSON object with the median of `runs` timed runs after one warm-up run. The
//! prompt is a fixed pseudo-random token sequence, the same one `scripts/bench/mlx_lm_bench.py`
//! uses, so the two can be compared in one run (`scripts/bench/engine.sh`).
use std::time::Instant;

use mlxd_engine::generate::{Decoder, NoSampler};
use mlxd_engine::models::{self, CausalLm};

/// The benchmark prompt: a linear congruential sequence over `[100, vocab)`.
fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    let mut x: u64 = 12345;
    (0..len)
        .map(|_| {
            x = (x * 1103515245 + 12345) % (1 << 31);
            100 + (x % (vocab as u64 - 100)) as u32
        })
        .collect()
}

struct Run {
    ttft: f64,
    decode_tps: f64,
}

fn run(model: &dyn CausalLm, prompt: &[u32], new_tokens: usize) -> anyhow::Result<Run> {
    let start = Instant::now();
    let mut decoder = Decoder::<NoSampler>::new(model, prompt.to_vec(), None);
    let mut first = None;
    let mut produced = 0;
    while produced < new_tokens {
        if decoder.advance(model, produced + 1 < new_tokens)?.is_some() {
            produced += 1;
            first.get_or_insert_with(Instant::now);
        }
    }
    let end = Instant::now();
    let first = first.expect("at least one token");
    Ok(Run {
        ttft: (first - start).as_secs_f64(),
        decode_tps: (new_tokens - 1) as f64 / (end - first).as_secs_f64(),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() == 4,
        "usage: bench_generate <model dir> <prompt tokens> <new tokens> <runs>"
    );
    let (dir, prompt_len, new_tokens, runs) = (
        &args[0],
        args[1].parse()?,
        args[2].parse()?,
        args[3].parse()?,
    );
    let model = models::load(std::path::Path::new(dir))?;
    let prompt = prompt(prompt_len, model.info().vocab_size);
    run(model.as_ref(), &prompt, 8.min(new_tokens))?;
    let runs: Vec<Run> = (0..runs)
        .map(|_| run(model.as_ref(), &prompt, new_tokens))
        .collect::<Result<_, _>>()?;
    let ttft = median(runs.iter().map(|r| r.ttft).collect());
    let decode = median(runs.iter().map(|r| r.decode_tps).collect());
    println!(
        "{{\"impl\":\"mlxd\",\"prompt_tokens\":{prompt_len},\"new_tokens\":{new_tokens},\"ttft_s\":{ttft:.4},\"prefill_tps\":{:.1},\"decode_tps\":{decode:.2}}}",
        prompt_len as f64 / ttft
    );
    Ok(())
}
