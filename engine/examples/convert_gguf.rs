//! `cargo run -p mlxd-engine --example convert_gguf -- <file.gguf> <out_dir>`: converts a GGUF
//! checkpoint into an MLX model directory (config.json, model.safetensors, tokenizer files).
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gguf, out] = args.as_slice() else {
        anyhow::bail!(
            "usage: convert_gguf <file.gguf> <out_dir> (got {} arguments)",
            args.len()
        );
    };
    let start = std::time::Instant::now();
    mlxd_engine::convert::convert_gguf(&PathBuf::from(gguf), &PathBuf::from(out))?;
    eprintln!("converted {gguf} into {out} in {:.1?}", start.elapsed());
    Ok(())
}
