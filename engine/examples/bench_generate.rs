//! Engine-core benchmark: the runtime (scheduler, batched forward passes, on-device sampling)
//! without HTTP, for `batch` concurrent sequences.
//!
//! `cargo run --release --example bench_generate -- <model dir> <prompt tokens> <new tokens> <runs> [batch] [temperature] [--draft ngram|<draft model dir>] [--num-draft N] [--prompt-ids FILE] [--kv-bits 4|8] [--adapters DIR[,DIR...]] [--ragged] [--cache-limit BYTES]`
//!
//! With `--draft`, speculative decoding runs (n-gram prompt lookup or a draft model) and the
//! line adds `drafted` and `accepted` totals. `--prompt-ids` reads the prompt (a JSON list of
//! token ids, e.g. a templated input-grounded task) instead of the pseudo-random one; every row
//! of the batch gets it. `--adapters` loads each LoRA adapter directory beside the model and
//! gives row `i` adapter `i mod n` (one directory: every row takes it; the line adds
//! `adapters`), the engine-core share of issue 25's mixed-adapter target. `--ragged` makes
//! every other prompt one token shorter, so that the batch's rows sit at different positions
//! (its padded layout: a mask and per-row rotary offsets), as served prompts do.
//! `--cache-limit` bounds MLX's cache of freed buffers as a serving engine does (by default
//! MLX keeps up to its memory limit; `mlxd-engine` sets a bound from its KV budget, 1 GiB
//! without one). The line adds `ragged` and `cache_limit` where given, and always
//! `peak_memory_bytes`: MLX's peak memory over the timed runs (weights included).
//! `MLXD_HOST_PROFILE=<file>` (Linux) samples the host over the timed runs
//! (`support/host_sampler.rs`; `scripts/bench/host_profile.py` reads the file).
//!
//! Prints one JSON object with the medians of `runs` timed runs after one warm-up run:
//! `ttft_s` (submission to the first token of the first sequence), `prefill_tps` (prompt
//! tokens of the whole batch over the time until every sequence has its first token) and
//! `decode_tps` (tokens of all sequences per second once every sequence is decoding). The
//! prompts are fixed pseudo-random token sequences, the same ones
//! `scripts/bench/mlx_lm_bench.py` uses, so the two can be compared in one run
//! (`scripts/bench/engine.sh`). The prefix cache is off, so repeated runs do the same work.
use std::time::Instant;

#[path = "support/host_sampler.rs"]
mod host_sampler;

use mlxd_engine::adapters::AdapterId;
use mlxd_engine::runtime::draft::{DraftSource, Speculation, DEFAULT_NGRAM, DEFAULT_NUM_DRAFT};
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
    drafted: usize,
    accepted: usize,
}

fn run(
    runtime: &Runtime,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    temperature: f32,
    adapters: &[AdapterId],
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
            runtime
                .work
                .send(GenerateRequest {
                    prompt: p.clone(),
                    sampling,
                    max_tokens: new_tokens,
                    stop_token_ids: vec![],
                    sample_offset: 0,
                    events: tx,
                    constraint: None,
                    logprobs: None,
                    adapter: (!adapters.is_empty()).then(|| adapters[i % adapters.len()]),
                })
                .map_err(|_| anyhow::anyhow!("the runtime stopped"))?;
            Ok(rx)
        })
        .collect::<anyhow::Result<_>>()?;
    // One thread per sequence records when each of its tokens arrived.
    let results: Vec<(Vec<Instant>, (usize, usize))> = std::thread::scope(|s| {
        let handles: Vec<_> = receivers
            .into_iter()
            .map(|mut rx| {
                s.spawn(move || {
                    let mut times = Vec::new();
                    let mut drafts = (0, 0);
                    while let Some(event) = rx.blocking_recv() {
                        match event {
                            TokenEvent::Token(_) => times.push(Instant::now()),
                            TokenEvent::Finished(_) => break,
                            TokenEvent::Failed(e) => panic!("generation failed: {e}"),
                            TokenEvent::Drafts { drafted, accepted } => {
                                drafts = (drafted, accepted)
                            }
                            TokenEvent::PromptDone { .. } | TokenEvent::Logprobs(_) => {}
                        }
                    }
                    (times, drafts)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader"))
            .collect()
    });
    let drafted = results.iter().map(|r| r.1 .0).sum();
    let accepted = results.iter().map(|r| r.1 .1).sum();
    let arrivals: Vec<Vec<Instant>> = results.into_iter().map(|r| r.0).collect();
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
        drafted,
        accepted,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    // `MLXD_CUDA_UNFUSED_ATTENTION` and `MLXD_STACKED_PROJECTIONS`, as the engine applies them.
    mlxd_engine::models::layers::unfused_attention_from_env().map_err(anyhow::Error::msg)?;
    mlxd_engine::models::stacked::stacked_projections_from_env().map_err(anyhow::Error::msg)?;
    // With drafting, `RUST_LOG=mlxd_engine::step=trace` shows each decode step's kind, pass
    // width and time on stderr.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut option = |name: &str| -> anyhow::Result<Option<String>> {
        match args.iter().position(|a| a == name) {
            None => Ok(None),
            Some(i) => {
                anyhow::ensure!(i + 1 < args.len(), "{name} needs a value");
                let value = args.remove(i + 1);
                args.remove(i);
                Ok(Some(value))
            }
        }
    };
    let draft = option("--draft")?;
    let num_draft: usize = option("--num-draft")?.map_or(Ok(DEFAULT_NUM_DRAFT), |s| s.parse())?;
    let prompt_ids = option("--prompt-ids")?;
    let kv_bits: Option<i32> = option("--kv-bits")?.map(|s| s.parse()).transpose()?;
    let adapter_dirs: Vec<std::path::PathBuf> = option("--adapters")?
        .map(|list| list.split(',').map(Into::into).collect())
        .unwrap_or_default();
    let cache_limit: Option<usize> = option("--cache-limit")?.map(|s| s.parse()).transpose()?;
    let ragged = match args.iter().position(|a| a == "--ragged") {
        Some(i) => {
            args.remove(i);
            true
        }
        None => false,
    };
    anyhow::ensure!(
        (4..=6).contains(&args.len()),
        "usage: bench_generate <model dir> <prompt tokens> <new tokens> <runs> [batch] [temperature] [--draft ngram|<dir>] [--num-draft N] [--prompt-ids FILE] [--kv-bits 4|8] [--adapters DIR[,DIR...]] [--ragged] [--cache-limit BYTES]"
    );
    if let Some(limit) = cache_limit {
        mlx_rs::memory::set_cache_limit(limit)?;
    }
    let (dir, prompt_len, new_tokens, runs): (&str, usize, usize, usize) = (
        &args[0],
        args[1].parse()?,
        args[2].parse()?,
        args[3].parse()?,
    );
    let batch: usize = args.get(4).map_or(Ok(1), |s| s.parse())?;
    let temperature: f32 = args.get(5).map_or(Ok(0.0), |s| s.parse())?;
    let speculation = draft.as_deref().map(|d| Speculation {
        source: match d {
            "ngram" => DraftSource::Ngram(DEFAULT_NGRAM),
            dir => DraftSource::Model(dir.into()),
        },
        num_draft,
    });
    let limits = RuntimeLimits {
        max_batch_size: Some(batch.max(1)),
        prompt_cache_bytes: 0,
        speculation,
        kv_quant: kv_bits.map(|bits| mlxd_engine::cache::KvQuant {
            bits,
            group_size: 64,
        }),
        adapters: adapter_dirs
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("a{i}"), d.clone()))
            .collect(),
        ..Default::default()
    };
    let runtime = Runtime::start(dir.into(), limits, None)?;
    let adapters: Vec<AdapterId> = match (&runtime.adapters, adapter_dirs.len()) {
        (_, 0) => Vec::new(),
        (Some(table), n) => (0..n)
            .map(|i| {
                table
                    .id_of(&format!("a{i}"))
                    .ok_or_else(|| anyhow::anyhow!("adapter a{i} was not loaded"))
            })
            .collect::<anyhow::Result<_>>()?,
        (None, _) => anyhow::bail!("this model takes no adapters"),
    };
    let vocab = runtime.info.vocab_size;
    let prompts: Vec<Vec<u32>> = match &prompt_ids {
        Some(file) => {
            let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(file)?)?;
            vec![ids; batch]
        }
        None => (0..batch).map(|r| prompt(prompt_len, vocab, r)).collect(),
    };
    let prompts: Vec<Vec<u32>> = prompts
        .into_iter()
        .enumerate()
        .map(|(r, p)| {
            if ragged && r % 2 == 1 && p.len() > 1 {
                p[1..].to_vec()
            } else {
                p
            }
        })
        .collect();
    let prompt_len = prompts[0].len();
    run(
        &runtime,
        &prompts,
        8.min(new_tokens),
        temperature,
        &adapters,
    )?;
    mlx_rs::memory::reset_peak_memory()?;
    let sampler = host_sampler::Sampler::from_env()?;
    let runs: Vec<Run> = (0..runs)
        .map(|_| run(&runtime, &prompts, new_tokens, temperature, &adapters))
        .collect::<Result<_, _>>()?;
    if let Some(sampler) = sampler {
        sampler.finish()?;
    }
    let ttft = median(runs.iter().map(|r| r.ttft).collect());
    let prefill = median(runs.iter().map(|r| r.prefill_tps).collect());
    let decode = median(runs.iter().map(|r| r.decode_tps).collect());
    let drafted: usize = runs.iter().map(|r| r.drafted).sum();
    let accepted: usize = runs.iter().map(|r| r.accepted).sum();
    let kv = kv_bits.map_or(String::new(), |b| {
        format!(
            ",\"kv_bits\":{b},\"kv_bytes_per_token\":{}",
            runtime.info.kv_bytes_per_token
        )
    });
    let draft = match &draft {
        Some(d) => format!(
            ",\"draft\":{:?},\"num_draft\":{num_draft},\"drafted\":{drafted},\"accepted\":{accepted}",
            d
        ),
        None => String::new(),
    };
    let adapted = match adapters.len() {
        0 => String::new(),
        n => format!(",\"adapters\":{n}"),
    };
    let layout = match (ragged, cache_limit) {
        (false, None) => String::new(),
        (r, l) => format!(
            ",\"ragged\":{r}{}",
            l.map_or(String::new(), |l| format!(",\"cache_limit\":{l}"))
        ),
    };
    let peak = mlx_rs::memory::peak_memory()?;
    println!(
        "{{\"impl\":\"mlxd\",\"batch\":{batch},\"temperature\":{temperature},\"prompt_tokens\":{prompt_len},\"new_tokens\":{new_tokens},\"ttft_s\":{ttft:.4},\"prefill_tps\":{prefill:.1},\"decode_tps\":{decode:.2},\"peak_memory_bytes\":{peak}{draft}{kv}{adapted}{layout}}}"
    );
    runtime.join();
    Ok(())
}
