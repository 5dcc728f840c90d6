//! Hugging Face `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.ggml.*`
//! metadata. Supported: byte-level BPE (`tokenizer.ggml.model` = `gpt2`) with the `smollm`
//! pre-tokenizer (every digit split on its own, then the GPT-2 byte-level regex) or the plain
//! GPT-2 one (`gpt-2`, `default`).
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

/// Builds both files. `model_max_length` is the model's context length.
pub fn build(g: &GgufFile, model_max_length: usize) -> Result<TokenizerFiles, ConvertError> {
    let model = g.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(err(format!(
            "tokenizer.ggml.model {model:?} is not supported (supported: \"gpt2\", byte-level BPE)"
        )));
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "default",
        Some(_) => g.str("tokenizer.ggml.pre")?,
    };
    let byte_level = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true
    });
    let pre_tokenizer = match pre {
        "smollm" => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level.clone()
            ]
        }),
        "gpt-2" | "default" => byte_level.clone(),
        other => {
            return Err(err(format!(
                "tokenizer.ggml.pre {other:?} is not supported (supported: \"smollm\", \"gpt-2\", \"default\")"
            )))
        }
    };

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
    let merges = strings(g, "tokenizer.ggml.merges")?;

    let mut vocab = Map::new();
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
    for (id, tok) in tokens.iter().enumerate() {
        if let Some(prev) = seen.insert(tok, id) {
            return Err(err(format!(
                "token {tok:?} appears twice in tokenizer.ggml.tokens (ids {prev} and {id})"
            )));
        }
        vocab.insert((*tok).to_string(), json!(id));
    }
    for (i, m) in merges.iter().enumerate() {
        let parts: Vec<&str> = m.split(' ').collect();
        if parts.len() != 2 || parts.iter().any(|p| !seen.contains_key(p)) {
            return Err(err(format!(
                "tokenizer.ggml.merges[{i}] {m:?} is not two known tokens separated by one space"
            )));
        }
        if !seen.contains_key(format!("{}{}", parts[0], parts[1]).as_str()) {
            return Err(err(format!(
                "tokenizer.ggml.merges[{i}] {m:?} merges into a token that is not in the vocabulary"
            )));
        }
    }

    let mut added_tokens = Vec::new();
    let mut added_decoder = BTreeMap::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        let special = match ty {
            TYPE_NORMAL | TYPE_UNUSED => continue,
            TYPE_CONTROL | TYPE_UNKNOWN => true,
            TYPE_USER_DEFINED => false,
            other => {
                return Err(err(format!(
                    "token {id} {tok:?} has type {other}, which a byte-level BPE vocabulary does not use (expected 1 to 5 except 6)"
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

    let bos_id = token_id(g, "tokenizer.ggml.bos_token_id", n)?;
    let eos_id = token_id(g, "tokenizer.ggml.eos_token_id", n)?;
    let unk_id = token_id(g, "tokenizer.ggml.unknown_token_id", n)?;
    let pad_id = token_id(g, "tokenizer.ggml.padding_token_id", n)?;
    // GGUF's default for byte-level BPE is no BOS.
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let tok_of = |id: Option<u32>| id.map(|i| tokens[i as usize]);

    let post_processor = if add_bos || add_eos {
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
        json!({
            "type": "Sequence",
            "processors": [
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
                {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}
            ]
        })
    } else {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true})
    };

    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
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
        "tokenizer_class": "GPT2Tokenizer"
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
