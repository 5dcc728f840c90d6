//! Quality of a quantized KV cache: greedy tokens with an 8- and a 4-bit cache against the
//! model's own dtype, on the same prompts. Reported, not asserted: quantization changes the
//! numbers, and a greedy path that flips once goes its own way after.
//!
//! `cargo run --release --example kv_agreement -- <model dir> <prompts.json> <new tokens>`
//!
//! `prompts.json` is a list of token-id lists (templated chat prompts). Prints one JSON line
//! per bit width: tokens compared, tokens equal before the first difference (summed over the
//! prompts), and tokens equal position by position.
use mlxd_engine::cache::KvQuant;
use mlxd_engine::runtime::request::{GenerateRequest, TokenEvent};
use mlxd_engine::runtime::{Runtime, RuntimeLimits};

fn greedy(runtime: &Runtime, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    runtime
        .work
        .send(GenerateRequest {
            prompt: prompt.to_vec(),
            sampling: Default::default(),
            max_tokens: n,
            stop_token_ids: vec![],
            sample_offset: 0,
            events: tx,
            constraint: None,
            logprobs: None,
            adapter: None,
        })
        .map_err(|_| anyhow::anyhow!("the runtime stopped"))?;
    let mut out = Vec::new();
    while let Some(event) = rx.blocking_recv() {
        match event {
            TokenEvent::Token(t) => out.push(t),
            TokenEvent::Finished(_) => break,
            TokenEvent::Failed(e) => anyhow::bail!("generation failed: {e}"),
            TokenEvent::PromptDone { .. } | TokenEvent::Drafts { .. } | TokenEvent::Logprobs(_) => {
            }
        }
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() == 3,
        "usage: kv_agreement <model dir> <prompts.json> <new tokens>"
    );
    let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(&args[1])?)?;
    let n: usize = args[2].parse()?;
    let run = |kv_quant: Option<KvQuant>| -> anyhow::Result<Vec<Vec<u32>>> {
        let limits = RuntimeLimits {
            prompt_cache_bytes: 0,
            kv_quant,
            ..Default::default()
        };
        let runtime = Runtime::start(args[0].clone().into(), limits, None)?;
        let out = prompts
            .iter()
            .map(|p| greedy(&runtime, p, n))
            .collect::<anyhow::Result<_>>()?;
        runtime.join();
        Ok(out)
    };
    let reference = run(None)?;
    for bits in [8, 4] {
        let quantized = run(Some(KvQuant {
            bits,
            group_size: 64,
        }))?;
        let compared: usize = reference.iter().map(Vec::len).sum();
        let prefix: usize = reference
            .iter()
            .zip(&quantized)
            .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
            .sum();
        let positions: usize = reference
            .iter()
            .zip(&quantized)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x == y).count())
            .sum();
        println!(
            "{{\"kv_bits\":{bits},\"prompts\":{},\"new_tokens\":{n},\"compared\":{compared},\"equal_before_first_difference\":{prefix},\"equal_positions\":{positions}}}",
            prompts.len()
        );
    }
    Ok(())
}
