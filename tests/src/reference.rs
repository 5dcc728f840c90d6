//! The reference implementations the parity tests compare with, run from the project's
//! `.venv` (`scripts/setup.sh --test` installs them): mlx-lm's greedy tokens and
//! transformers' chat-template token ids.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{ensure, Context, Result};

use crate::workspace_root;

/// The project's Python: `MLXD_PYTHON`, else the `.venv`'s; an error that says how to get it.
pub fn python() -> Result<PathBuf> {
    let py = std::env::var_os("MLXD_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    ensure!(
        py.is_file(),
        "{} is missing: run scripts/setup.sh --test (or set MLXD_PYTHON)",
        py.display()
    );
    Ok(py)
}

/// Runs `python <args>` and reads the whitespace-separated token ids it prints.
fn token_ids(what: &str, args: &mut Command) -> Result<Vec<u32>> {
    let out = args.output().with_context(|| format!("running {what}"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .with_context(|| format!("{what} printed non-UTF-8"))?
        .split_whitespace()
        .map(|t| t.parse().with_context(|| format!("{what} printed {t:?}")))
        .collect()
}

/// Greedy tokens from mlx-lm's `generate_step` on the model in `model` for the prompt ids
/// `prompt` (`scripts/mlx_lm_greedy.py`).
pub fn mlx_lm_greedy(model: &Path, max_tokens: usize, prompt: &[u32]) -> Result<Vec<u32>> {
    token_ids(
        "mlx-lm",
        Command::new(python()?)
            .arg(workspace_root().join("scripts/mlx_lm_greedy.py"))
            .arg(model)
            .arg(max_tokens.to_string())
            .args(prompt.iter().map(u32::to_string)),
    )
}

/// [`mlx_lm_greedy`] with the mlx-lm LoRA adapter in `adapter` applied (mlx-lm's
/// `load_adapters`, as `mlx_lm.load(..., adapter_path=...)`).
pub fn mlx_lm_greedy_with_adapter(
    model: &Path,
    adapter: &Path,
    max_tokens: usize,
    prompt: &[u32],
) -> Result<Vec<u32>> {
    token_ids(
        "mlx-lm",
        Command::new(python()?)
            .arg(workspace_root().join("scripts/mlx_lm_greedy.py"))
            .arg("--adapter")
            .arg(adapter)
            .arg(model)
            .arg(max_tokens.to_string())
            .args(prompt.iter().map(u32::to_string)),
    )
}

/// Chat-template token ids of one user turn (with the generation prompt) from Hugging Face
/// `transformers`, the reference renderer.
pub fn hf_chat_tokens(model: &Path, user: &str) -> Result<Vec<u32>> {
    let script = "import sys\nfrom transformers import AutoTokenizer\n\
        t = AutoTokenizer.from_pretrained(sys.argv[1])\n\
        ids = t.apply_chat_template([{'role': 'user', 'content': sys.argv[2]}], add_generation_prompt=True)\n\
        ids = ids if isinstance(ids, list) else ids['input_ids']\n\
        print(' '.join(map(str, ids)))";
    token_ids(
        "transformers",
        Command::new(python()?)
            .args(["-c", script])
            .arg(model)
            .arg(user),
    )
}
