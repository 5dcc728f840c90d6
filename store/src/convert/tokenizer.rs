//! Hugging Face `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.ggml.*`
//! metadata. Supported:
//! - byte-level BPE (`tokenizer.ggml.model` = `gpt2`) with the pre-tokenizers `smollm` (every
//!   digit split on its own, then the GPT-2 byte-level regex), `gpt-2`/`default` (the GPT-2
//!   regex) and `llama-bpe` (Llama 3's regex, with whole-word vocabulary hits before merges,
//!   as llama.cpp and Meta's tokenizer.json do) and `qwen2` (Qwen2/Qwen3: Llama 3's regex with
//!   single digits, after Qwen's NFC normalization);
//! - SentencePiece BPE (`tokenizer.ggml.model` = `llama`, Llama 2 / Mistral): the pieces and
//!   their scores become a BPE whose merges rank by the merged piece's score, which is the
//!   order SentencePiece merges in; `<0xXX>` byte tokens give byte fallback; `▁` stands for a
//!   space and is prepended to the text (and after each special token) unless
//!   `tokenizer.ggml.add_space_prefix` is false, as llama.cpp does.
use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Map, Value};

use super::gguf::{GgufFile, MetaValue};
use super::ConvertError;

/// GGUF token types (`tokenizer.ggml.token_type`).
const TYPE_NORMAL: i64 = 1;
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;
const TYPE_UNUSED: i64 = 5;
const TYPE_BYTE: i64 = 6;

/// The two tokenizer files, and the special token ids config.json repeats.
#[derive(Debug, Clone)]
pub struct TokenizerFiles {
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
}

fn err(msg: String) -> ConvertError {
    ConvertError::Tokenizer(msg)
}

fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, ConvertError> {
    g.array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            MetaValue::String(s) => Ok(s.as_str()),
            other => Err(err(format!(
                "{key}[{i}] is a {}, expected a string",
                other.type_name()
            ))),
        })
        .collect()
}

fn token_id(g: &GgufFile, key: &str, n_tokens: usize) -> Result<Option<u32>, ConvertError> {
    match g.opt_u64(key)? {
        None => Ok(None),
        Some(id) if (id as usize) < n_tokens => Ok(Some(id as u32)),
        Some(id) => Err(err(format!(
            "{key} is {id}, outside the vocabulary of {n_tokens} tokens"
        ))),
    }
}

/// Llama 3's pre-tokenizer regex (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3`, the pattern of
/// Meta's tokenizer.json).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's pre-tokenizer regex (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`, the pattern of
/// Qwen's tokenizer.json): Llama 3's with every digit on its own.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";

/// Which vocabulary a GGUF holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Byte-level BPE (`gpt2`).
    ByteLevel,
    /// SentencePiece BPE with scores.
    SentencePiece,
}

/// The `tokenizer.ggml.*` values both kinds share.
struct Vocab<'a> {
    tokens: Vec<&'a str>,
    types: Vec<i64>,
    seen: HashMap<&'a str, usize>,
}

fn read_vocab(g: &GgufFile) -> Result<Vocab<'_>, ConvertError> {
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types: Vec<i64> = match g.get("tokenizer.ggml.token_type") {
        None => vec![TYPE_NORMAL; n],
        Some(_) => g
            .array("tokenizer.ggml.token_type")?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i64().ok_or_else(|| {
                    err(format!(
                        "tokenizer.ggml.token_type[{i}] is a {}, expected an integer",
                        v.type_name()
                    ))
                })
            })
            .collect::<Result<_, _>>()?,
    };
    if types.len() != n {
        return Err(err(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            types.len()
        )));
    }
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
    for (id, tok) in tokens.iter().enumerate() {
        if let Some(prev) = seen.insert(tok, id) {
            return Err(err(format!(
                "token {tok:?} appears twice in tokenizer.ggml.tokens (ids {prev} and {id})"
            )));
        }
    }
    Ok(Vocab {
        tokens,
        types,
        seen,
    })
}

/// The merges of a SentencePiece vocabulary: every split of a normal piece into two normal
/// pieces, ranked by the merged piece's score (highest first, then lower id), which is the
/// order SentencePiece's BPE applies them in.
fn spm_merges(v: &Vocab, scores: &[f32]) -> Vec<String> {
    let normal = |t: &str| v.seen.get(t).is_some_and(|&id| v.types[id] == TYPE_NORMAL);
    let mut ranked: Vec<(f32, usize, usize, String)> = Vec::new();
    for (id, &piece) in v.tokens.iter().enumerate() {
        if v.types[id] != TYPE_NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if normal(l) && normal(r) {
                ranked.push((scores[id], id, v.seen[l], format!("{l} {r}")));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked.into_iter().map(|(_, _, _, m)| m).collect()
}

/// The parts of tokenizer.json and tokenizer_config.json that depend on the kind.
struct Pipeline {
    pre_tokenizer: Value,
    normalizer: Value,
    decoder: Value,
    /// The `model` section (a BPE).
    model: Value,
    /// The post-processor's step before BOS/EOS are added, if any.
    post_first: Option<Value>,
    /// Whether BOS is added when `tokenizer.ggml.add_bos_token` does not say.
    add_bos_default: bool,
    class: &'static str,
}

/// GPT-2's byte-level step; `trim_offsets` in the pre-tokenizer and decoder, not in the
/// post-processor.
fn byte_level(trim_offsets: bool) -> Value {
    json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": trim_offsets,
        "use_regex": true
    })
}

/// Byte-level BPE with the pre-tokenizer `pre` and the file's merges.
fn byte_level_pipeline(
    g: &GgufFile,
    pre: &str,
    v: &Vocab,
    vocab: Map<String, Value>,
) -> Result<Pipeline, ConvertError> {
    let split_then_bytes = |pattern: &str| {
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": false
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": false,
                    "trim_offsets": true,
                    "use_regex": false
                }
            ]
        })
    };
    // (pre-tokenizer, whether whole-word vocabulary hits skip the merges, normalizer)
    let (pre_tokenizer, ignore_merges, normalizer) = match pre {
        "smollm" => (
            json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true)
                ]
            }),
            false,
            Value::Null,
        ),
        "gpt-2" | "default" => (byte_level(true), false, Value::Null),
        "llama-bpe" | "llama3" | "llama-v3" => {
            (split_then_bytes(LLAMA3_PATTERN), true, Value::Null)
        }
        // Qwen's tokenizer.json normalizes to NFC first; llama.cpp does not, which only
        // matters for text that is not already NFC.
        "qwen2" => (
            split_then_bytes(QWEN2_PATTERN),
            false,
            json!({"type": "NFC"}),
        ),
        other => {
            return Err(err(format!(
                "tokenizer.ggml.pre {other:?} is not supported for byte-level BPE (supported: \"llama-bpe\", \"qwen2\", \"smollm\", \"gpt-2\", \"default\")"
            )))
        }
    };
    let merges = strings(g, "tokenizer.ggml.merges")?;
    for (i, m) in merges.iter().enumerate() {
        let parts: Vec<&str> = m.split(' ').collect();
        if parts.len() != 2 || parts.iter().any(|p| !v.seen.contains_key(p)) {
            return Err(err(format!(
                "tokenizer.ggml.merges[{i}] {m:?} is not two known tokens separated by one space"
            )));
        }
        if !v
            .seen
            .contains_key(format!("{}{}", parts[0], parts[1]).as_str())
        {
            return Err(err(format!(
                "tokenizer.ggml.merges[{i}] {m:?} merges into a token that is not in the vocabulary"
            )));
        }
    }
    let model = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": null,
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": false,
        "byte_fallback": false,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": merges
    });
    // Meta's own tokenizer_config.json names the generic fast tokenizer; Qwen's names its own.
    let class = match pre {
        _ if ignore_merges => "PreTrainedTokenizerFast",
        "qwen2" => "Qwen2Tokenizer",
        _ => "GPT2Tokenizer",
    };
    Ok(Pipeline {
        pre_tokenizer,
        normalizer,
        decoder: byte_level(true),
        model,
        post_first: Some(byte_level(false)),
        // GGUF's default for byte-level BPE is no BOS.
        add_bos_default: false,
        class,
    })
}

/// SentencePiece BPE from the pieces and their scores; sets `unk_id` from the token types
/// when the file names none.
fn sentencepiece_pipeline(
    g: &GgufFile,
    v: &Vocab,
    vocab: Map<String, Value>,
    unk_id: &mut Option<u32>,
) -> Result<Pipeline, ConvertError> {
    let (tokens, types, n) = (&v.tokens, &v.types, v.tokens.len());
    if g.opt_bool("tokenizer.ggml.remove_extra_whitespaces")? == Some(true) {
        return Err(err(
            "tokenizer.ggml.remove_extra_whitespaces is true; collapsing whitespace as SentencePiece does is not supported".into(),
        ));
    }
    if g.get("tokenizer.ggml.precompiled_charsmap").is_some() {
        return Err(err(
            "tokenizer.ggml.precompiled_charsmap is set; SentencePiece normalization rules are not supported".into(),
        ));
    }
    let scores: Vec<f32> = g
        .array("tokenizer.ggml.scores")?
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_f64().map(|s| s as f32).ok_or_else(|| {
                err(format!(
                    "tokenizer.ggml.scores[{i}] is a {}, expected a number",
                    s.type_name()
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    if scores.len() != n {
        return Err(err(format!(
            "tokenizer.ggml.scores has {} entries for {n} tokens",
            scores.len()
        )));
    }
    if unk_id.is_none() {
        *unk_id = types
            .iter()
            .position(|&t| t == TYPE_UNKNOWN)
            .map(|i| i as u32);
    }
    let byte_fallback = types.contains(&TYPE_BYTE);
    if byte_fallback {
        for b in 0..=255u8 {
            let t = format!("<0x{b:02X}>");
            if !v.seen.contains_key(t.as_str()) {
                return Err(err(format!(
                    "the vocabulary has byte tokens but not {t}, so byte fallback cannot be complete"
                )));
            }
        }
    }
    let add_space_prefix = g
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let replace_space =
        json!({"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE});
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM_SPACE},
            replace_space
        ]})
    } else {
        replace_space
    };
    let mut steps = vec![
        json!({"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        steps.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let model = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": unk_id.map(|i| tokens[i as usize]),
        "continuing_subword_prefix": null,
        "end_of_word_suffix": null,
        "fuse_unk": true,
        "byte_fallback": byte_fallback,
        "ignore_merges": false,
        "vocab": vocab,
        "merges": spm_merges(v, &scores)
    });
    Ok(Pipeline {
        pre_tokenizer: Value::Null,
        normalizer,
        decoder: json!({"type": "Sequence", "decoders": steps}),
        model,
        post_first: None,
        // llama.cpp's default for SentencePiece is a BOS.
        add_bos_default: true,
        class: "PreTrainedTokenizerFast",
    })
}

/// Builds both files. `model_max_length` is the model's context length.
pub fn build(g: &GgufFile, model_max_length: usize) -> Result<TokenizerFiles, ConvertError> {
    let model = g.str("tokenizer.ggml.model")?;
    let kind = match model {
        "gpt2" => Kind::ByteLevel,
        "llama" => Kind::SentencePiece,
        other => {
            return Err(err(format!(
                "tokenizer.ggml.model {other:?} is not supported (supported: \"gpt2\", byte-level BPE; \"llama\", SentencePiece BPE)"
            )))
        }
    };
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(_) => g.str("tokenizer.ggml.pre")?,
    };
    let v = read_vocab(g)?;
    let n = v.tokens.len();
    let tokens = &v.tokens;
    let types = &v.types;

    let mut vocab = Map::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert((*tok).to_string(), json!(id));
    }

    let bos_id = token_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos_id = token_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let mut unk_id = token_id(g, "tokenizer.ggml.unknown_token_id", n)?;
    let pad_id = token_id(g, "tokenizer.ggml.padding_token_id", n)?;

    let p = match kind {
        Kind::ByteLevel => byte_level_pipeline(g, pre, &v, vocab)?,
        Kind::SentencePiece => sentencepiece_pipeline(g, &v, vocab, &mut unk_id)?,
    };

    let mut added_tokens = Vec::new();
    let mut added_decoder = BTreeMap::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(types).enumerate() {
        let special = match ty {
            TYPE_NORMAL | TYPE_UNUSED => continue,
            TYPE_BYTE if kind == Kind::SentencePiece => continue,
            TYPE_CONTROL | TYPE_UNKNOWN => true,
            TYPE_USER_DEFINED => false,
            other => {
                return Err(err(format!(
                    "token {id} {tok:?} has type {other}, which a {} vocabulary does not use",
                    match kind {
                        Kind::ByteLevel => "byte-level BPE (types 1 to 5)",
                        Kind::SentencePiece => "SentencePiece (types 1 to 6)",
                    }
                )))
            }
        };
        let entry = json!({
            "content": tok,
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": special
        });
        let mut with_id = json!({"id": id});
        with_id
            .as_object_mut()
            .expect("object")
            .extend(entry.as_object().expect("object").clone());
        added_tokens.push(with_id);
        added_decoder.insert(id.to_string(), entry);
    }

    let add_bos = g
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(p.add_bos_default);
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let tok_of = |id: Option<u32>| id.map(|i| tokens[i as usize]);

    let template = if add_bos || add_eos {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut specials = Map::new();
        let mut special = |key: &str, id: Option<u32>| -> Result<Value, ConvertError> {
            let id = id.ok_or_else(|| {
                err(format!(
                    "tokenizer.ggml.add_{key}_token is set but tokenizer.ggml.{key}_token_id is missing"
                ))
            })?;
            let t = tokens[id as usize];
            specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
            Ok(json!({"SpecialToken": {"id": t, "type_id": 0}}))
        };
        let bos = if add_bos {
            Some(special("bos", bos_id)?)
        } else {
            None
        };
        let eos = if add_eos {
            Some(special("eos", eos_id)?)
        } else {
            None
        };
        let wrap = |list: &mut Vec<Value>, seq: &str, type_id: u32| {
            list.extend(bos.clone());
            list.push(json!({"Sequence": {"id": seq, "type_id": type_id}}));
            list.extend(eos.clone());
        };
        wrap(&mut single, "A", 0);
        wrap(&mut pair, "A", 0);
        wrap(&mut pair, "B", 1);
        Some(
            json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}),
        )
    } else {
        None
    };
    let post_processor = match (p.post_first, template) {
        (Some(first), Some(t)) => json!({"type": "Sequence", "processors": [first, t]}),
        (Some(first), None) => first,
        (None, Some(t)) => t,
        (None, None) => Value::Null,
    };

    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": p.normalizer,
        "pre_tokenizer": p.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": p.decoder,
        "model": p.model
    });

    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": false,
        "added_tokens_decoder": added_decoder,
        "bos_token": tok_of(bos_id),
        "eos_token": tok_of(eos_id),
        "unk_token": tok_of(unk_id),
        "pad_token": tok_of(pad_id),
        "clean_up_tokenization_spaces": false,
        "model_max_length": model_max_length,
        "tokenizer_class": p.class
    });
    if let Some(MetaValue::String(t)) = g.get("tokenizer.chat_template") {
        config
            .as_object_mut()
            .expect("object")
            .insert("chat_template".into(), json!(t));
    } else if let Some(v) = g.get("tokenizer.chat_template") {
        return Err(ConvertError::wrong_type(
            "tokenizer.chat_template",
            "string",
            v,
        ));
    }

    Ok(TokenizerFiles {
        tokenizer_json,
        tokenizer_config: config,
        bos_id,
        eos_id,
    })
}
