//! A LoRA job's data, read as mlx-lm's `tuner/datasets.py` reads a local directory:
//! `train.jsonl`, `valid.jsonl` and (optional) `test.jsonl`, one JSON object a line, the
//! format of a file set by its first line:
//!
//! - `{"prompt", "completion"}`: a user and an assistant message through the chat template;
//!   with `mask_prompt`, the loss starts after the prompt's rendering (with the generation
//!   prompt);
//! - `{"messages"}` (with optional `"tools"`): the chat template over the messages; with
//!   `mask_prompt`, the loss covers the last message only;
//! - `{"text"}`: the text with the tokenizer's special tokens, EOS appended when missing.
//!
//! Every line must be of its file's format; the first that is not (or is not JSON) fails the
//! job with the file and line number, before anything is written.
use std::path::{Path, PathBuf};

use mlxd_protocol::openai::{ChatMessage, Role};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

use super::super::JobError;

/// One example: its tokens and where its loss starts (mlx-lm's `(tokens, offset)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub offset: usize,
}

/// The three splits of a data directory (`test` empty when the file is absent).
#[derive(Debug, Clone, Default)]
pub struct Dataset {
    pub train: Vec<Example>,
    pub valid: Vec<Example>,
    pub test: Vec<Example>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Completions,
    Chat,
    Text,
}

impl Format {
    fn of(obj: &serde_json::Map<String, Value>) -> Option<Self> {
        if obj.contains_key("prompt") && obj.contains_key("completion") {
            Some(Self::Completions)
        } else if obj.contains_key("messages") {
            Some(Self::Chat)
        } else if obj.contains_key("text") {
            Some(Self::Text)
        } else {
            None
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Completions => "\"prompt\" and \"completion\"",
            Self::Chat => "\"messages\"",
            Self::Text => "\"text\"",
        }
    }
}

/// Reads and tokenizes `dir`'s splits. `train.jsonl` and `valid.jsonl` must exist and hold
/// at least one example each (mlx-lm's trainer needs both).
pub fn load(dir: &Path, tokenizer: &Tokenizer, mask_prompt: bool) -> Result<Dataset, JobError> {
    if !dir.is_dir() {
        return Err(JobError::Input(format!(
            "{}: not a directory (the data is a directory with train.jsonl and valid.jsonl)",
            dir.display()
        )));
    }
    let mut set = Dataset::default();
    for (name, split, required) in [
        ("train", &mut set.train, true),
        ("valid", &mut set.valid, true),
        ("test", &mut set.test, false),
    ] {
        let path = dir.join(format!("{name}.jsonl"));
        if !path.exists() {
            if required {
                return Err(JobError::Input(format!(
                    "{}: missing; a LoRA job needs train.jsonl and valid.jsonl",
                    path.display()
                )));
            }
            continue;
        }
        *split = load_file(&path, tokenizer, mask_prompt)?;
        if required && split.is_empty() {
            return Err(JobError::Input(format!(
                "{}: holds no examples",
                path.display()
            )));
        }
    }
    Ok(set)
}

/// One `.jsonl` file's examples (see the module comment).
pub fn load_file(
    path: &Path,
    tokenizer: &Tokenizer,
    mask_prompt: bool,
) -> Result<Vec<Example>, JobError> {
    let text = std::fs::read_to_string(path).map_err(super::super::io(path))?;
    let mut format = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = LineRef {
            path: path.to_path_buf(),
            line: i + 1,
        };
        let value: Value =
            serde_json::from_str(line).map_err(|e| at.error(format!("not JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(at.error("not a JSON object".into()));
        };
        let this = Format::of(&obj).ok_or_else(|| {
            at.error(
                "has none of the keys of mlx-lm's formats: \"prompt\" and \"completion\", \
                 \"messages\", or \"text\""
                    .into(),
            )
        })?;
        let format = *format.get_or_insert(this);
        if this != format {
            return Err(at.error(format!(
                "has {} but the file's first line has {}; one format a file",
                this.describe(),
                format.describe()
            )));
        }
        out.push(example(&obj, format, tokenizer, mask_prompt).map_err(|m| at.error(m))?);
    }
    Ok(out)
}

struct LineRef {
    path: PathBuf,
    line: usize,
}

impl LineRef {
    fn error(&self, message: String) -> JobError {
        JobError::Input(format!("{}:{}: {message}", self.path.display(), self.line))
    }
}

fn string<'a>(obj: &'a serde_json::Map<String, Value>, key: &str) -> Result<&'a str, String> {
    obj.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("\"{key}\" must be a string"))
}

fn example(
    obj: &serde_json::Map<String, Value>,
    format: Format,
    tokenizer: &Tokenizer,
    mask_prompt: bool,
) -> Result<Example, String> {
    let tools: Option<Vec<Value>> = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(t.clone()),
        Some(other) => return Err(format!("\"tools\" must be a list, got {other}")),
    };
    let chat = |messages: &[ChatMessage], generation_prompt: bool| {
        tokenizer
            .encode_chat(messages, tools.as_deref(), generation_prompt)
            .map(|(_, ids)| ids)
            .map_err(|e| format!("the chat template: {e}"))
    };
    match format {
        Format::Text => {
            if mask_prompt {
                return Err("mask_prompt: prompt masking is not supported for \"text\" data (mlx-lm refuses it too)".into());
            }
            let mut ids = tokenizer
                .encode(string(obj, "text")?, true)
                .map_err(|e| format!("tokenizing: {e}"))?;
            if let Some(eos) = tokenizer.eos_token().and_then(|t| tokenizer.token_to_id(t)) {
                if ids.last() != Some(&eos) {
                    ids.push(eos);
                }
            }
            Ok(Example {
                tokens: ids,
                offset: 0,
            })
        }
        Format::Completions => {
            let messages = [
                ChatMessage::new(Role::User, string(obj, "prompt")?),
                ChatMessage::new(Role::Assistant, string(obj, "completion")?),
            ];
            let tokens = chat(&messages, false)?;
            let offset = if mask_prompt {
                chat(&messages[..1], true)?.len()
            } else {
                0
            };
            Ok(Example { tokens, offset })
        }
        Format::Chat => {
            let messages: Vec<ChatMessage> = obj
                .get("messages")
                .cloned()
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| format!("\"messages\": {e}"))?
                .unwrap_or_default();
            if messages.is_empty() {
                return Err("\"messages\" is empty".into());
            }
            let tokens = chat(&messages, false)?;
            let offset = if mask_prompt {
                let last_is_assistant = messages.last().is_some_and(|m| m.role == Role::Assistant);
                chat(&messages[..messages.len() - 1], last_is_assistant)?.len()
            } else {
                0
            };
            Ok(Example { tokens, offset })
        }
    }
}

/// A training or validation batch as mlx-lm's `iterate_batches` builds it: `[B, T]` tokens
/// padded with 0 to one plus the next multiple of 32 of the longest (at most
/// `max_seq_length`), each example cut to `max_seq_length`, with each row's
/// `(offset, length)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub rows: usize,
    pub width: usize,
    pub offsets: Vec<u32>,
    pub lengths: Vec<u32>,
}

pub fn batch(examples: &[&Example], max_seq_length: usize) -> Batch {
    let longest = examples.iter().map(|e| e.tokens.len()).max().unwrap_or(0);
    let width = (1 + 32 * longest.div_ceil(32)).min(max_seq_length);
    let mut tokens = vec![0u32; examples.len() * width];
    let mut lengths = Vec::with_capacity(examples.len());
    for (row, e) in examples.iter().enumerate() {
        let n = e.tokens.len().min(max_seq_length);
        tokens[row * width..row * width + n].copy_from_slice(&e.tokens[..n]);
        lengths.push(n as u32);
    }
    Batch {
        tokens,
        rows: examples.len(),
        width,
        offsets: examples.iter().map(|e| e.offset as u32).collect(),
        lengths,
    }
}

/// The batches of `examples`, as mlx-lm groups them: indices sorted by length, cut into
/// runs of `batch_size` (a remainder smaller than a batch is left out).
pub fn batch_indices(examples: &[Example], batch_size: usize) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..examples.len()).collect();
    idx.sort_by_key(|&i| examples[i].tokens.len());
    idx.chunks_exact(batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// A permutation of `0..n` that depends only on `seed` and `epoch` (SplitMix64 driving a
/// Fisher-Yates shuffle), so that a resumed run visits the batches in the same order.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut state = seed ^ epoch.wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(n: usize, offset: usize) -> Example {
        Example {
            tokens: (1..=n as u32).collect(),
            offset,
        }
    }

    #[test]
    fn batches_pad_to_one_plus_a_multiple_of_32_and_cut_at_max_seq_length() {
        let (a, b) = (ex(3, 0), ex(40, 2));
        let batch = batch(&[&a, &b], 2048);
        assert_eq!(batch.width, 65);
        assert_eq!(batch.lengths, vec![3, 40]);
        assert_eq!(batch.offsets, vec![0, 2]);
        assert_eq!(&batch.tokens[..4], &[1, 2, 3, 0]);
        let cut = super::batch(&[&a, &b], 10);
        assert_eq!((cut.width, cut.lengths.clone()), (10, vec![3, 10]));
    }

    #[test]
    fn batches_group_by_length_and_drop_a_short_remainder() {
        let set = vec![ex(5, 0), ex(1, 0), ex(3, 0), ex(2, 0), ex(4, 0)];
        assert_eq!(batch_indices(&set, 2), vec![vec![1, 3], vec![2, 4]]);
    }

    #[test]
    fn epoch_orders_are_permutations_fixed_by_seed_and_epoch() {
        let a = epoch_order(10, 7, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(10, 7, 0));
        assert_ne!(a, epoch_order(10, 7, 1));
    }
}
