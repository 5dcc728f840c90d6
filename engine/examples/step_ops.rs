//! The ops one decode step of a model builds, by primitive: on a GPU a small model's step pays
//! per op more than per byte, so this is the figure behind a launch-bound step.
//!
//! ```text
//! cargo run --release -p mlxd-engine --example step_ops -- <model dir> [rows] [adapter dir] [--kv-bits 4|8] [--padded]
//! ```
//!
//! `rows` sequences (default 8) in the batched cache the runtime decodes with: 16-token
//! prompts are prefilled and evaluated, then the graph of the next token's forward pass is
//! built (not run) and counted (`mlxd_engine::graph_ops`). With an adapter directory, every
//! row runs that adapter (`MLXD_STACKED_PROJECTIONS` applies as in the engine). With
//! `--kv-bits`, the cache is quantized (groups of 64) from the start, so the step's ops include
//! quantizing the new token's keys and values. With `--padded`, every other row is one position
//! shorter (left-padded by one, as prompts one token apart join a served batch), so the step
//! takes the padded layout's mask and per-row rotary offsets. Prints one JSON line.
use std::path::PathBuf;

use anyhow::Context;
use mlx_rs::Array;
use mlxd_engine::graph_ops::op_counts;

fn main() -> anyhow::Result<()> {
    mlxd_engine::models::stacked::stacked_projections_from_env().map_err(anyhow::Error::msg)?;
    let mut all: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: step_ops <model dir> [rows] [adapter dir] [--kv-bits 4|8] [--padded]";
    let padded = match all.iter().position(|a| a == "--padded") {
        Some(i) => {
            all.remove(i);
            true
        }
        None => false,
    };
    let kv_bits: Option<i32> = match all.iter().position(|a| a == "--kv-bits") {
        Some(i) => {
            anyhow::ensure!(i + 1 < all.len(), "{usage}");
            let bits = all.remove(i + 1).parse().context(usage)?;
            all.remove(i);
            Some(bits)
        }
        None => None,
    };
    let quant = kv_bits.map(|bits| mlxd_engine::cache::KvQuant {
        bits,
        group_size: 64,
    });
    let mut args = all.into_iter();
    let dir = PathBuf::from(args.next().context(usage)?);
    let rows: i32 = match args.next() {
        Some(r) => r.parse().context(usage)?,
        None => 8,
    };
    let adapter = args.next().map(PathBuf::from);
    let model = mlxd_engine::models::load(&dir)?;
    let id = match &adapter {
        Some(a) => {
            let table = model
                .adapters()
                .context("this model holds no adapter table")?;
            Some(table.load("probe", a)?)
        }
        None => None,
    };
    let _selected = mlxd_engine::adapters::select(model.as_ref(), vec![id; rows as usize])?;
    let mut caches: Vec<_> = model
        .layer_kinds()
        .into_iter()
        .map(|kind| {
            let padding = (0..rows).map(|r| i32::from(padded && r % 2 == 1)).collect();
            kind.fresh(padding, quant)
        })
        .collect();
    let prompt: Vec<u32> = (0..rows * 16).map(|i| 1 + (i % 97) as u32).collect();
    let logits = model.forward(&Array::from_slice(&prompt, &[rows, 16]), &mut caches)?;
    logits.eval()?;
    for c in &caches {
        mlx_rs::transforms::eval(c.state())?;
    }
    let next = vec![17u32; rows as usize];
    let step = model.forward(&Array::from_slice(&next, &[rows, 1]), &mut caches)?;
    let counts = op_counts(&step);
    let line = serde_json::json!({
        "model": dir.display().to_string(),
        "adapter": adapter.map(|a| a.display().to_string()),
        "stacked": std::env::var("MLXD_STACKED_PROJECTIONS").unwrap_or_else(|_| "1".into()),
        "rows": rows,
        "kv_bits": kv_bits,
        "padded": padded,
        "layers": model.info().num_layers,
        "ops": counts.total(),
        "computing": counts.computing(),
        "products": counts.products(),
        "by_primitive": counts.by_primitive,
    });
    println!("{line}");
    Ok(())
}
