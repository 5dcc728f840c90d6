//! What constrained decoding costs per token, on CPU or GPU.
//!
//! `cargo run --release --example bench_constraint -- <model dir> <batch> <new tokens> <runs>`
//!
//! Prints one JSON object:
//! - `grammar_mask_us`, `grammar_commit_us`: llguidance's mask and commit per token for a JSON
//!   schema over the model's vocabulary (a long array of short strings, driven with the
//!   lowest allowed non-EOS token), `mask_upload_us`: turning one mask row into the `[1,
//!   vocab]` array the sampler adds;
//! - `decode_tps_free`: tokens per second of `batch` unconstrained rows (the pipelined path);
//! - `decode_tps_masked`: the same rows each under a constraint that allows every token, so
//!   the difference is the price of the synchronous step and the mask alone (same tokens,
//!   same forward passes);
//! - `decode_tps_mixed`: `batch` rows of which one is constrained (what unconstrained rows
//!   pay for sharing a batch with a constrained one).
use std::time::Instant;

use mlx_rs::Array;
use mlxd_engine::constraint::grammar::{Grammar, GrammarCompiler};
use mlxd_engine::constraint::{ConstraintError, TokenConstraint};
use mlxd_engine::runtime::request::{GenerateRequest, TokenEvent};
use mlxd_engine::runtime::{Runtime, RuntimeLimits};
use mlxd_engine::tokenizer::Tokenizer;

/// Allows every token and never completes.
#[derive(Debug)]
struct AllowAll;

impl TokenConstraint for AllowAll {
    fn mask(&mut self, _row: &mut [f32]) -> Result<(), ConstraintError> {
        Ok(())
    }
    fn commit(&mut self, _token: u32) -> Result<bool, ConstraintError> {
        Ok(false)
    }
}

fn prompt(len: usize, vocab: usize, row: usize) -> Vec<u32> {
    let mut x: u64 = 777 + row as u64;
    (0..len)
        .map(|_| {
            x = (x * 1103515245 + 12345) % (1 << 31);
            100 + (x % (vocab as u64 - 100)) as u32
        })
        .collect()
}

/// Decode tokens per second of `batch` rows, `constrained` of them under [`AllowAll`].
fn decode_tps(
    runtime: &Runtime,
    batch: usize,
    constrained: usize,
    new_tokens: usize,
) -> anyhow::Result<f64> {
    let vocab = runtime.info.vocab_size;
    let receivers: Vec<_> = (0..batch)
        .map(|i| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            runtime.work.send(GenerateRequest {
                prompt: prompt(16, vocab, i),
                sampling: Default::default(),
                max_tokens: new_tokens,
                stop_token_ids: vec![],
                sample_offset: 0,
                events: tx,
                constraint: (i < constrained)
                    .then(|| Box::new(AllowAll) as Box<dyn TokenConstraint>),
                logprobs: None,
                adapter: None,
            })?;
            Ok(rx)
        })
        .collect::<anyhow::Result<_>>()?;
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
                            TokenEvent::PromptDone { .. }
                            | TokenEvent::Drafts { .. }
                            | TokenEvent::Logprobs(_) => {}
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
    let all_started = arrivals.iter().map(|t| t[0]).max().expect("a row");
    let end = arrivals.iter().map(|t| *t.last().unwrap()).max().unwrap();
    let steady: usize = arrivals
        .iter()
        .map(|t| t.iter().filter(|&&x| x > all_started).count())
        .sum();
    Ok(steady as f64 / (end - all_started).as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Mean microseconds of llguidance's mask and commit, and of a mask row's upload, per token.
fn grammar_costs(dir: &str, vocab: usize, tokens: usize) -> anyhow::Result<(f64, f64, f64)> {
    let tokenizer = Tokenizer::from_dir(dir.as_ref())?;
    let compiler = GrammarCompiler::new(tokenizer.hf(), tokenizer.stop_token_ids(), vocab)?;
    let schema = serde_json::json!({"type": "object", "properties": {"items": {"type": "array",
        "items": {"type": "string", "maxLength": 12}}}, "required": ["items"]});
    let mut c = compiler.compile(&Grammar::JsonSchema(schema))?;
    let stops = tokenizer.stop_token_ids().to_vec();
    let (mut mask_s, mut commit_s, mut upload_s) = (0.0, 0.0, 0.0);
    let mut row = vec![0.0f32; vocab];
    for _ in 0..tokens {
        row.fill(0.0);
        let t = Instant::now();
        c.mask(&mut row)?;
        mask_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let a = Array::from_slice(&row, &[1, vocab as i32]);
        a.eval()?;
        upload_s += t.elapsed().as_secs_f64();
        let id = (0..vocab)
            .find(|&i| row[i] == 0.0 && !stops.contains(&(i as u32)))
            .ok_or_else(|| anyhow::anyhow!("only the end is allowed"))? as u32;
        let t = Instant::now();
        let done = c.commit(id)?;
        commit_s += t.elapsed().as_secs_f64();
        anyhow::ensure!(!done, "the grammar ended early");
    }
    let per = |s: f64| s / tokens as f64 * 1e6;
    Ok((per(mask_s), per(commit_s), per(upload_s)))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() == 4,
        "usage: bench_constraint <model dir> <batch> <new tokens> <runs>"
    );
    let dir = &args[0];
    let (batch, new_tokens, runs): (usize, usize, usize) =
        (args[1].parse()?, args[2].parse()?, args[3].parse()?);
    let limits = RuntimeLimits {
        max_batch_size: Some(batch.max(1)),
        prompt_cache_bytes: 0,
        ..Default::default()
    };
    let runtime = Runtime::start(dir.into(), limits, None)?;
    let vocab = runtime.info.vocab_size;
    let (mask_us, commit_us, upload_us) = grammar_costs(dir, vocab, 200)?;
    decode_tps(&runtime, batch, 0, 8)?;
    let measure = |constrained: usize| -> anyhow::Result<f64> {
        Ok(median(
            (0..runs)
                .map(|_| decode_tps(&runtime, batch, constrained, new_tokens))
                .collect::<Result<_, _>>()?,
        ))
    };
    let free = measure(0)?;
    let masked = measure(batch)?;
    let mixed = measure(1)?;
    println!(
        "{{\"batch\":{batch},\"new_tokens\":{new_tokens},\"vocab\":{vocab},\"grammar_mask_us\":{mask_us:.1},\"grammar_commit_us\":{commit_us:.1},\"mask_upload_us\":{upload_us:.1},\"decode_tps_free\":{free:.2},\"decode_tps_masked\":{masked:.2},\"decode_tps_mixed\":{mixed:.2}}}"
    );
    runtime.join();
    Ok(())
}
