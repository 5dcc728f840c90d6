//! The reference implementations the parity tests compare with, run from the project's
//! `.venv` (`scripts/setup.sh --test` installs them): mlx-lm's greedy tokens and
//! transformers' chat-template token ids.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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

/// Runs `python <args>` with `input` on its standard input and reads one line of
/// whitespace-separated token ids per answer: `count` lines.
fn token_lines(what: &str, args: &mut Command, input: &str, count: usize) -> Result<Vec<Vec<u32>>> {
    let mut child = args
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {what}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())
        .with_context(|| format!("writing to {what}"))?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text =
        String::from_utf8(out.stdout).with_context(|| format!("{what} printed non-UTF-8"))?;
    let lines: Vec<Vec<u32>> = text
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|t| t.parse().with_context(|| format!("{what} printed {t:?}")))
                .collect()
        })
        .collect::<Result<_>>()?;
    ensure!(
        lines.len() == count,
        "{what} answered {} lines for {count} inputs",
        lines.len()
    );
    Ok(lines)
}

/// [`mlx_lm_greedy`] for several prompts, in one Python process that loads the model once
/// (a test's reference costs mostly Python's start-up and the model load).
pub fn mlx_lm_greedy_many(
    model: &Path,
    max_tokens: usize,
    prompts: &[Vec<u32>],
) -> Result<Vec<Vec<u32>>> {
    let input: String = prompts
        .iter()
        .map(|p| {
            let ids: Vec<String> = p.iter().map(u32::to_string).collect();
            ids.join(" ") + "\n"
        })
        .collect();
    ensure!(
        prompts.iter().all(|p| !p.is_empty()),
        "mlx-lm needs a token in every prompt"
    );
    token_lines(
        "mlx-lm",
        Command::new(python()?)
            .arg(workspace_root().join("scripts/mlx_lm_greedy.py"))
            .arg("--many")
            .arg(model)
            .arg(max_tokens.to_string()),
        &input,
        prompts.len(),
    )
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

/// [`hf_chat_tokens`] for several user turns (each a conversation of its own), in one Python
/// process (importing `transformers` takes seconds).
pub fn hf_chat_tokens_many(model: &Path, users: &[&str]) -> Result<Vec<Vec<u32>>> {
    let script = "import sys, json\nfrom transformers import AutoTokenizer\n\
        t = AutoTokenizer.from_pretrained(sys.argv[1])\n\
        for line in sys.stdin:\n\
        \x20   ids = t.apply_chat_template([{'role': 'user', 'content': json.loads(line)}], add_generation_prompt=True)\n\
        \x20   ids = ids if isinstance(ids, list) else ids['input_ids']\n\
        \x20   print(' '.join(map(str, ids)), flush=True)";
    let input: String = users
        .iter()
        .map(|u| serde_json::to_string(u).expect("a string serializes") + "\n")
        .collect();
    token_lines(
        "transformers",
        Command::new(python()?).args(["-c", script]).arg(model),
        &input,
        users.len(),
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
