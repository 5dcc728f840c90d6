//! What a model is, read from its directory without loading it: architecture, parameter
//! count, quantization, context length, chat template, license, where it lives. One place for
//! `mlxd show` and the Ollama `/api/show` route.
//!
//! Everything comes from the files mlx-lm reads too: `config.json`, the safetensors headers
//! (shapes only, never the data), `tokenizer_config.json` or `chat_template.jinja`, and the
//! model card (`README.md`'s front matter) or a `LICENSE` file.
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::inventory::{self, StoredKind};
use crate::{io, HfRepoId, StoreError, StoreOptions, KNOWN_MODELS};

/// Largest safetensors header read (the format itself allows 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// The facts of one model directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    /// The model directory.
    pub dir: PathBuf,
    /// `architectures[0]` of config.json (`LlamaForCausalLM`), else its `model_type`.
    pub architecture: String,
    /// config.json's `model_type` (`llama`, `qwen3`, …).
    pub model_type: Option<String>,
    /// Weights in the checkpoint, counted from the safetensors shapes (a quantized matrix
    /// counts the weights it packs); `None` when a header cannot be read.
    pub parameters: Option<u64>,
    /// `mlx 4-bit`, `bfloat16`, …, as `mlxd ls` shows it.
    pub quantization: String,
    /// Longest context the checkpoint was made for (`max_position_embeddings` and kin).
    pub context_length: Option<u64>,
    pub layers: Option<u64>,
    pub hidden_size: Option<u64>,
    pub vocab_size: Option<u64>,
    /// The chat template's format ([`chat_format`]), when the model has a template.
    pub chat_format: Option<&'static str>,
    /// The Jinja chat template itself.
    pub chat_template: Option<String>,
    /// The license as the model card names it (`apache-2.0`), else a `LICENSE` file's first
    /// line, else what the store knows of a known model.
    pub license: Option<String>,
    /// Bytes of the directory's files.
    pub size_bytes: u64,
}

/// The facts of the model `spec` names, found without fetching or converting anything: a
/// name `mlxd ls` lists, a model directory, a `.gguf` file already converted, or a Hugging
/// Face repo id in the cache.
pub fn show(spec: &str, opts: &StoreOptions) -> Result<ModelFacts, StoreError> {
    let (dir, known) = locate(spec, opts)?;
    let mut facts = model_facts(&dir)?;
    if facts.license.is_none() {
        facts.license = known.and_then(|k| {
            KNOWN_MODELS
                .iter()
                .find(|m| m.name == k)
                .map(|m| m.license.to_string())
        });
    }
    Ok(facts)
}

/// The directory of `spec` (see [`show`]) and, for a known model, its name.
fn locate(spec: &str, opts: &StoreOptions) -> Result<(PathBuf, Option<String>), StoreError> {
    if let Some(found) = inventory::find(spec, opts) {
        let known = (found.kind == StoredKind::Known).then(|| found.name.clone());
        return Ok((found.dir, known));
    }
    let path = Path::new(spec);
    if path.is_dir() {
        if !path.join("config.json").is_file() {
            return Err(StoreError::MissingConfig(path.to_path_buf()));
        }
        return Ok((fs::canonicalize(path).map_err(io(path))?, None));
    }
    if path.is_file() {
        let gguf = fs::canonicalize(path).map_err(io(path))?;
        return inventory::scan(opts)
            .into_iter()
            .find(|f| matches!(&f.kind, StoredKind::Gguf { source: Some(s) } if *s == gguf))
            .map(|f| (f.dir, None))
            .ok_or_else(|| StoreError::NotStored(spec.to_string()));
    }
    if HfRepoId::parse(spec).is_some() {
        // Offline: only what the cache holds.
        let offline = StoreOptions {
            hf_offline: true,
            ..opts.clone()
        };
        return crate::resolve_model_with(spec, &offline).map(|r| (r.dir, None));
    }
    Err(StoreError::NotStored(spec.to_string()))
}

/// The facts of the model directory `dir`.
pub fn model_facts(dir: &Path) -> Result<ModelFacts, StoreError> {
    let config_path = dir.join("config.json");
    let config: Value = serde_json::from_slice(&fs::read(&config_path).map_err(io(&config_path))?)
        .map_err(|e| StoreError::Io {
            path: config_path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
    // Wrapper checkpoints (Gemma 3, Mistral 3) keep the language model's numbers apart.
    let text = config.get("text_config").unwrap_or(&config);
    let number = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| text.get(*k).or_else(|| config.get(*k)))
            .and_then(Value::as_u64)
    };
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .map(String::from);
    let architecture = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .map(String::from)
        .or_else(|| model_type.clone())
        .unwrap_or_else(|| "unknown".into());
    let chat_template = chat_template(dir);
    Ok(ModelFacts {
        dir: dir.to_path_buf(),
        architecture,
        model_type,
        parameters: parameter_count(dir, &config),
        quantization: inventory::format_of(dir),
        context_length: number(&[
            "max_position_embeddings",
            "max_sequence_length",
            "n_positions",
            "seq_length",
            "n_ctx",
        ]),
        layers: number(&["num_hidden_layers", "n_layer", "num_layers"]),
        hidden_size: number(&["hidden_size", "n_embd", "d_model"]),
        vocab_size: number(&["vocab_size"]),
        chat_format: chat_template.as_deref().map(chat_format),
        chat_template,
        license: license(dir),
        size_bytes: inventory::dir_size(dir),
    })
}

/// The chat template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
/// (a string, or a list of named templates of which `default` is the chat one).
fn chat_template(dir: &Path) -> Option<String> {
    if let Ok(t) = fs::read_to_string(dir.join("chat_template.jinja")) {
        return Some(t);
    }
    let v: Value =
        serde_json::from_slice(&fs::read(dir.join("tokenizer_config.json")).ok()?).ok()?;
    match v.get("chat_template")? {
        Value::String(t) => Some(t.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| named.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(String::from),
        _ => None,
    }
}

/// The chat format a template writes, by the markers it uses: `chatml`, `llama3`, `gemma`,
/// `harmony` (gpt-oss), `mistral`, `phi3`, `deepseek`, `glm4`; `custom` for anything else.
pub fn chat_format(template: &str) -> &'static str {
    let has = |s: &str| template.contains(s);
    if has("<|channel|>") && has("<|start|>") {
        "harmony"
    } else if has("<|im_start|>") {
        "chatml"
    } else if has("<|start_header_id|>") {
        "llama3"
    } else if has("<start_of_turn>") {
        "gemma"
    } else if has("[INST]") {
        "mistral"
    } else if has("<｜User｜>") || has("<｜Assistant｜>") {
        "deepseek"
    } else if has("[gMASK]") {
        "glm4"
    } else if has("<|user|>") && has("<|end|>") {
        "phi3"
    } else {
        "custom"
    }
}

/// The model card's `license:` (a Hugging Face README's YAML front matter), else the first
/// non-empty line of a `LICENSE` file.
fn license(dir: &Path) -> Option<String> {
    if let Ok(card) = fs::read_to_string(dir.join("README.md")) {
        if let Some(l) = card_license(&card) {
            return Some(l);
        }
    }
    ["LICENSE", "LICENSE.txt", "LICENSE.md"]
        .iter()
        .find_map(|f| fs::read_to_string(dir.join(f)).ok())
        .and_then(|t| {
            t.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .map(String::from)
        })
}

/// `license:` in the front matter between the first two `---` lines.
fn card_license(card: &str) -> Option<String> {
    let mut lines = card.lines();
    if lines.next()?.trim() != "---" {
        return None;
    }
    lines
        .take_while(|l| l.trim() != "---")
        .find_map(|l| l.strip_prefix("license:"))
        .map(|v| v.trim().trim_matches(['"', '\'']).to_string())
        .filter(|v| !v.is_empty())
}

/// Weights in the checkpoint's safetensors files. A quantized matrix (a `weight` beside
/// `scales`) counts `32 / bits` weights per packed 32-bit element; its scales and biases are
/// not weights of the model.
fn parameter_count(dir: &Path, config: &Value) -> Option<u64> {
    let quant = config
        .get("quantization")
        .or_else(|| config.get("quantization_config"));
    let bits_of = |prefix: &str| {
        quant
            .and_then(|q| q.get(prefix))
            .and_then(|p| p.get("bits"))
            .or_else(|| quant.and_then(|q| q.get("bits")))
            .and_then(Value::as_u64)
            .filter(|b| (1..=32).contains(b))
    };
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if files.is_empty() {
        return None;
    }
    files.sort();
    let mut total = 0u64;
    for file in files {
        let header = safetensors_header(&file)?;
        for (name, t) in &header {
            if name == "__metadata__" {
                continue;
            }
            let elements = t
                .get("shape")?
                .as_array()?
                .iter()
                .try_fold(1u64, |n, d| d.as_u64().map(|d| n.saturating_mul(d)))?;
            let (prefix, leaf) = name.rsplit_once('.').unwrap_or(("", name));
            let quantized = header.contains_key(&format!("{prefix}.scales"));
            total += match leaf {
                "scales" | "biases" if header.contains_key(&format!("{prefix}.weight")) => 0,
                "weight" if quantized => {
                    let packed = t.get("dtype").and_then(Value::as_str) == Some("U32");
                    match (packed, bits_of(prefix)) {
                        (true, Some(bits)) => elements.saturating_mul(32 / bits),
                        _ => elements,
                    }
                }
                _ => elements,
            };
        }
    }
    Some(total)
}

/// The JSON header of a safetensors file: tensor name → `{dtype, shape, data_offsets}`.
fn safetensors_header(file: &Path) -> Option<Map<String, Value>> {
    let mut f = fs::File::open(file).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return None;
    }
    let mut buf = vec![0u8; usize::try_from(len).ok()?];
    f.read_exact(&mut buf).ok()?;
    match serde_json::from_slice(&buf).ok()? {
        Value::Object(m) => Some(m),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file whose header lists `tensors` (name, dtype, shape); the data is
    /// zeros of the right length.
    fn safetensors(path: &Path, tensors: &[(&str, &str, &[u64])]) {
        let mut header = Map::new();
        let mut offset = 0u64;
        for (name, dtype, shape) in tensors {
            let size = match *dtype {
                "U32" | "F32" => 4,
                "BF16" | "F16" => 2,
                _ => 1,
            };
            let bytes = shape.iter().product::<u64>() * size;
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
        let h = serde_json::to_vec(&Value::Object(header)).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        out.extend(vec![0u8; offset as usize]);
        fs::write(path, out).unwrap();
    }

    #[test]
    fn facts_of_a_quantized_llama() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(
            d.join("config.json"),
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "max_position_embeddings": 8192, "num_hidden_layers": 2, "hidden_size": 64,
                "vocab_size": 100, "quantization": {"bits": 4, "group_size": 32,
                "model.embed_tokens": {"bits": 8, "group_size": 32}}}"#,
        )
        .unwrap();
        safetensors(
            &d.join("model.safetensors"),
            &[
                // 100 x 64 at 8 bits: 16 columns of u32.
                ("model.embed_tokens.weight", "U32", &[100, 16]),
                ("model.embed_tokens.scales", "BF16", &[100, 2]),
                ("model.embed_tokens.biases", "BF16", &[100, 2]),
                // 64 x 64 at 4 bits: 8 columns of u32.
                ("model.layers.0.mlp.up_proj.weight", "U32", &[64, 8]),
                ("model.layers.0.mlp.up_proj.scales", "BF16", &[64, 2]),
                ("model.layers.0.mlp.up_proj.biases", "BF16", &[64, 2]),
                ("model.norm.weight", "BF16", &[64]),
            ],
        );
        fs::write(
            d.join("tokenizer_config.json"),
            r#"{"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"}"#,
        )
        .unwrap();
        fs::write(
            d.join("README.md"),
            "---\nlibrary_name: mlx\nlicense: apache-2.0\n---\n# x\n",
        )
        .unwrap();
        let f = model_facts(d).unwrap();
        assert_eq!(f.architecture, "LlamaForCausalLM");
        assert_eq!(f.model_type.as_deref(), Some("llama"));
        assert_eq!(f.parameters, Some(100 * 64 + 64 * 64 + 64));
        assert_eq!(f.quantization, "mlx 4-bit");
        assert_eq!(f.context_length, Some(8192));
        assert_eq!(
            (f.layers, f.hidden_size, f.vocab_size),
            (Some(2), Some(64), Some(100))
        );
        assert_eq!(f.chat_format, Some("chatml"));
        assert!(f.chat_template.unwrap().contains("<|im_start|>"));
        assert_eq!(f.license.as_deref(), Some("apache-2.0"));
        assert!(f.size_bytes > 0);
    }

    #[test]
    fn facts_of_a_bare_model_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("config.json"), r#"{"model_type": "qwen3", "torch_dtype": "bfloat16", "text_config": {"max_position_embeddings": 40960}}"#).unwrap();
        fs::write(d.join("chat_template.jinja"), "<|start_header_id|>").unwrap();
        fs::write(d.join("LICENSE"), "\n  MIT License\n\nCopyright").unwrap();
        let f = model_facts(d).unwrap();
        assert_eq!(f.architecture, "qwen3");
        assert_eq!(f.parameters, None);
        assert_eq!(f.quantization, "bfloat16");
        assert_eq!(f.context_length, Some(40960));
        assert_eq!(f.chat_format, Some("llama3"));
        assert_eq!(f.license.as_deref(), Some("MIT License"));
        // A header that is not JSON: no count, not an error.
        fs::write(
            d.join("model.safetensors"),
            [4, 0, 0, 0, 0, 0, 0, 0, b'x', b'y', b'z', b'!'],
        )
        .unwrap();
        assert_eq!(model_facts(d).unwrap().parameters, None);
        let empty = tempfile::tempdir().unwrap();
        let e = model_facts(empty.path()).unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
    }

    #[test]
    fn chat_formats_and_model_cards() {
        assert_eq!(chat_format("<|start|>x<|channel|>"), "harmony");
        assert_eq!(chat_format("<start_of_turn>user"), "gemma");
        assert_eq!(chat_format("[INST] x [/INST]"), "mistral");
        assert_eq!(chat_format("{{ messages }}"), "custom");
        assert_eq!(
            card_license("---\nlicense: \"mit\"\n---"),
            Some("mit".into())
        );
        assert_eq!(card_license("# no front matter\nlicense: mit"), None);
        assert_eq!(card_license("---\ntags: [a]\n---\nlicense: mit"), None);
    }

    #[test]
    fn show_finds_stored_models_without_fetching() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = StoreOptions {
            hf_cache: Some(tmp.path().join("hub")),
            ..crate::tests::opts(&tmp.path().join("home"))
        };
        let q8 = opts.home.join("models/smol-q8");
        fs::create_dir_all(&q8).unwrap();
        fs::write(q8.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
        assert_eq!(show("smol-q8", &opts).unwrap().dir, q8);
        assert_eq!(
            show(q8.to_str().unwrap(), &opts).unwrap().dir,
            fs::canonicalize(&q8).unwrap()
        );
        // The known model is not fetched: it is not in the store.
        let e = show(crate::DEFAULT_MODEL, &opts).unwrap_err();
        assert!(matches!(e, StoreError::NotStored(_)), "{e}");
        // Nor is a repo downloaded.
        let e = show("org/absent", &opts).unwrap_err();
        assert!(matches!(e, StoreError::HfNotCached { .. }), "{e}");
        let known = opts.home.join("models").join(crate::DEFAULT_MODEL);
        fs::create_dir_all(&known).unwrap();
        fs::write(known.join("config.json"), "{}").unwrap();
        assert_eq!(
            show(crate::DEFAULT_MODEL, &opts)
                .unwrap()
                .license
                .as_deref(),
            Some("Apache-2.0")
        );
    }
}
