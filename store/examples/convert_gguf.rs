//! `cargo run -p mlxd-store --example convert_gguf -- <file.gguf> <out_dir> [f16|f32]`:
//! converts a GGUF checkpoint into an MLX model directory (config.json, model.safetensors,
//! tokenizer files). The optional last argument picks the float type (default f16). Prints,
//! per GGML tensor type, the MLX form it became and its error against GGML's dequantization.
use std::path::PathBuf;

use mlxd_store::convert::{convert_gguf_with, ConvertOptions, FloatDtype};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (gguf, out, float_dtype) = match args.as_slice() {
        [g, o] => (g, o, FloatDtype::F16),
        [g, o, d] if d == "f16" => (g, o, FloatDtype::F16),
        [g, o, d] if d == "f32" => (g, o, FloatDtype::F32),
        _ => anyhow::bail!("usage: convert_gguf <file.gguf> <out_dir> [f16|f32] (got {args:?})"),
    };
    let start = std::time::Instant::now();
    let opts = ConvertOptions { float_dtype };
    let report = convert_gguf_with(&PathBuf::from(gguf), &PathBuf::from(out), &opts)?;
    eprintln!("converted {gguf} into {out} in {:.1?}", start.elapsed());
    for line in report.lines() {
        eprintln!("  {line}");
    }
    Ok(())
}
