//! GGUF → MLX-format model directory, in pure Rust.
//!
//! [`convert_gguf`] writes `config.json`, `model.safetensors`, `tokenizer.json` and
//! `tokenizer_config.json` in the layout mlx-lm reads: quantized matrices become MLX affine
//! quantization (`<module>.weight` `u32`, `<module>.scales`/`.biases` `f16`, group size 32),
//! everything else `f16`. The directory is assembled beside `out_dir` and renamed into place at
//! the end, so `out_dir` either does not exist or is complete.
//!
//! Architectures (`general.architecture`): `llama` ([`llama`]), `qwen2`, `qwen3` and `qwen3moe`
//! ([`qwen`]), `gemma3` ([`gemma3`]) and `phi3` ([`phi3`]), each mapped onto the Hugging Face
//! architecture mlx-lm loads, inverting what llama.cpp's converter did to names, layouts and
//! values; a file that does not map exactly is refused with the key or tensor at fault.
//!
//! Every directory also gets [`STAMP_FILE`], which records [`CONVERTER_VERSION`] and the
//! options, so that the store converts again when a newer converter would write something
//! different ([`Stamp::read`], [`Stamp::is_current`]).
pub mod arch;
pub mod blocks;
pub mod gemma3;
pub mod gguf;
pub mod llama;
pub mod phi3;
pub mod quant;
pub mod qwen;
pub mod report;
pub mod tokenizer;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{json, Value};

use arch::{ArchPlan, TensorMap};
use gguf::{GgmlType, GgufFile};
use llama::{LlamaParams, SpecialIds};
pub use quant::FloatDtype;
pub use report::ConversionReport;

/// The version of what [`convert_gguf_with`] writes. Bump it with every change that alters the
/// output (a tensor's layout or dtype, a config or tokenizer field, a fix to any of them): the
/// store then converts its existing directories again instead of serving stale ones. Version 1
/// was every converter before the stamp, whose directories have no [`STAMP_FILE`]; version 3
/// added the K-quants, Q5_0/Q5_1, the `llama-bpe` and SentencePiece tokenizers, and the
/// conversion report in the stamp.
pub const CONVERTER_VERSION: u32 = 3;

/// The file in a converted directory that says how it was made.
pub const STAMP_FILE: &str = "mlxd-convert.json";

/// The contents of [`STAMP_FILE`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub converter_version: u32,
    pub float_dtype: FloatDtype,
}

impl Stamp {
    /// The stamp this converter writes with `opts`.
    pub fn current(opts: &ConvertOptions) -> Self {
        Self {
            converter_version: CONVERTER_VERSION,
            float_dtype: opts.float_dtype,
        }
    }

    /// The stamp of `dir`; `None` when it has none or one this code cannot read (a directory
    /// from a converter older than the stamp, or a damaged file), both of which mean "convert
    /// again".
    pub fn read(dir: &Path) -> Option<Self> {
        let v: Value = serde_json::from_slice(&fs::read(dir.join(STAMP_FILE)).ok()?).ok()?;
        let converter_version = u32::try_from(v.get("converter_version")?.as_u64()?).ok()?;
        let float_dtype = match v.get("float_dtype")?.as_str()? {
            "float16" => FloatDtype::F16,
            "float32" => FloatDtype::F32,
            _ => return None,
        };
        Some(Self {
            converter_version,
            float_dtype,
        })
    }

    /// Whether `dir` is a complete conversion that this converter, with `opts`, would write
    /// again unchanged.
    pub fn is_current(dir: &Path, opts: &ConvertOptions) -> bool {
        dir.join("config.json").is_file() && Self::read(dir) == Some(Self::current(opts))
    }

    /// The stamp's JSON; `source` (the GGUF converted, for `mlxd ls`) and `tensor_types` (the
    /// conversion report: each GGML type's MLX form and error) are informative only.
    fn to_json(&self, source: &Path, report: &ConversionReport) -> Value {
        json!({
            "converter_version": self.converter_version,
            "source": source.display().to_string(),
            "tensor_types": report.to_json(),
            "float_dtype": match self.float_dtype {
                FloatDtype::F16 => "float16",
                FloatDtype::F32 => "float32",
            },
        })
    }
}

/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConvertOptions {
    /// The float type of unquantized tensors and of quantization scales and biases.
    pub float_dtype: FloatDtype,
}

/// The `general.architecture` values converted, for messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "\"llama\", \"qwen2\", \"qwen3\", \"qwen3moe\", \"gemma3\", \"phi3\"";

/// Why a conversion failed. Messages name the file, key, tensor or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file ({found}, expected magic \"GGUF\")")]
    NotGguf { path: PathBuf, found: String },
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    #[error("GGUF metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("GGUF metadata key {key:?} is a {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("architecture {0:?} is not supported (supported: {SUPPORTED_ARCHITECTURES})")]
    UnsupportedArchitecture(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor {name:?} has type {ggml_type}, which cannot be converted")]
    UnsupportedTensorType { name: String, ggml_type: String },
    #[error("tensor {name:?} is not part of the {arch} architecture as converted here")]
    UnknownTensor { name: String, arch: String },
    #[error("tensor {0:?} is missing from the GGUF file")]
    MissingTensor(String),
    #[error("tensor shape: {0}")]
    Shape(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("output directory {0} already exists")]
    OutputExists(PathBuf),
    #[error("output directory {0} has no parent directory to build it in")]
    NoParent(PathBuf),
    #[error("writing safetensors: {0}")]
    Safetensors(String),
}

impl ConvertError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn wrong_type(key: &str, expected: &'static str, v: &gguf::MetaValue) -> Self {
        Self::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }
}

/// One output tensor.
struct OutTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl safetensors::View for &OutTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The converted weights and the `quantization` section of config.json.
struct Weights {
    tensors: BTreeMap<String, OutTensor>,
    report: ConversionReport,
    quantization: Option<Value>,
    tie_word_embeddings: bool,
}

fn convert_tensors(
    g: &GgufFile,
    map: &dyn TensorMap,
    float_dtype: FloatDtype,
) -> Result<Weights, ConvertError> {
    let float_st = match float_dtype {
        FloatDtype::F16 => Dtype::F16,
        FloatDtype::F32 => Dtype::F32,
    };
    let mut tensors = BTreeMap::new();
    let mut report = ConversionReport::default();
    // module path → Some((bits, group size)) when quantized, None when a float matrix.
    let mut matrices: BTreeMap<String, Option<(u32, usize)>> = BTreeMap::new();
    let present: BTreeSet<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    // A tensor the architecture does not have (a fused or shared-expert variant, say) is
    // named before any tensor it replaces is reported missing.
    let roles = g
        .tensors
        .iter()
        .map(|info| map.role(&info.name))
        .collect::<Result<Vec<_>, _>>()?;
    for name in map.required() {
        if !present.contains(name.as_str()) {
            return Err(ConvertError::MissingTensor(name));
        }
    }

    for (info, role) in g.tensors.iter().zip(roles) {
        let Some(role) = role else {
            // Read into config.json by the architecture's hyper-parameters.
            continue;
        };
        let hf_shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if hf_shape != role.shape {
            return Err(ConvertError::Shape(format!(
                "{}: shape {:?} (GGUF dims {:?}), expected {:?} for {}",
                info.name,
                hf_shape,
                info.dims,
                role.shape,
                role.output_name()
            )));
        }
        // Every dimension but the last is a row: stacked experts are `experts x out` rows.
        let (outer, cols) = hf_shape.split_at(hf_shape.len() - 1);
        let (rows, cols) = (outer.iter().product::<usize>(), cols[0]);
        let order = match role.unpermute_heads {
            Some(heads) => quant::unpermute_qk_rows(&info.name, rows, heads)?,
            None => (0..rows).collect(),
        };
        let data = g.tensor_data(info);
        let ty = info.ggml_type;
        let is_matrix = hf_shape.len() >= 2 && role.param == arch::Param::Weight;
        if blocks::affine_bits(ty).is_some() {
            if !is_matrix || role.shift != 0.0 {
                return Err(ConvertError::UnsupportedTensorType {
                    name: info.name.clone(),
                    ggml_type: format!(
                        "{ty:?} on {} (only matrices may be quantized)",
                        role.output_name()
                    ),
                });
            }
            let q = quant::repack(&info.name, ty, data, rows, cols, &order, float_dtype)?;
            let words = cols * q.bits as usize / 32;
            let groups = cols / q.group_size;
            report.add(
                ty,
                format!(
                    "affine {}-bit, group {}, {} scales",
                    q.bits,
                    q.group_size,
                    float_dtype.torch_name()
                ),
                &info.name,
                q.error,
            );
            let with_last = |last: usize| [outer, &[last]].concat();
            tensors.insert(
                format!("{}.weight", role.module),
                OutTensor {
                    dtype: Dtype::U32,
                    shape: with_last(words),
                    data: q.weight,
                },
            );
            for (suffix, values) in [("scales", &q.scales), ("biases", &q.biases)] {
                tensors.insert(
                    format!("{}.{suffix}", role.module),
                    OutTensor {
                        dtype: float_st,
                        shape: with_last(groups),
                        data: quant::float_bytes(float_dtype, values),
                    },
                );
            }
            matrices.insert(role.module, Some((q.bits, q.group_size)));
        } else if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16) {
            let (bytes, error) = quant::to_float_shifted(
                &info.name,
                ty,
                data,
                (rows, cols),
                &order,
                role.shift,
                float_dtype,
            )?;
            report.add(ty, float_dtype.torch_name().to_string(), &info.name, error);
            if is_matrix {
                matrices.insert(role.module.clone(), None);
            }
            tensors.insert(
                role.output_name(),
                OutTensor {
                    dtype: float_st,
                    shape: hf_shape,
                    data: bytes,
                },
            );
        } else {
            return Err(ConvertError::UnsupportedTensorType {
                name: info.name.clone(),
                ggml_type: format!(
                    "{ty:?} (supported: F32, F16, BF16, {})",
                    quant::QUANTIZED_TYPES
                ),
            });
        }
    }

    Ok(Weights {
        tensors,
        report,
        quantization: quantization_config(&matrices),
        tie_word_embeddings: !present.contains("output.weight"),
    })
}

/// mlx-lm's `quantization`: the most common (bits, group size) as the default, and an entry
/// per module that differs (`false` for a float matrix). None when nothing is quantized.
fn quantization_config(matrices: &BTreeMap<String, Option<(u32, usize)>>) -> Option<Value> {
    let mut counts: HashMap<(u32, usize), usize> = HashMap::new();
    for q in matrices.values().flatten() {
        *counts.entry(*q).or_default() += 1;
    }
    // Ties broken by the larger bit width, so the choice does not depend on hash order.
    let (bits, group_size) = counts
        .into_iter()
        .max_by_key(|&((bits, gs), n)| (n, bits, gs))?
        .0;
    let mut q = json!({"group_size": group_size, "bits": bits, "mode": "affine"});
    let obj = q.as_object_mut().expect("object");
    for (module, m) in matrices {
        match m {
            Some(pair) if *pair == (bits, group_size) => {}
            Some((b, gs)) => {
                obj.insert(
                    module.clone(),
                    json!({"group_size": gs, "bits": b, "mode": "affine"}),
                );
            }
            None => {
                obj.insert(module.clone(), json!(false));
            }
        }
    }
    Some(q)
}

/// The weights, config.json and tokenizer files of `g`, by its architecture.
fn convert_model(
    g: &GgufFile,
    float_dtype: FloatDtype,
) -> Result<(Weights, Value, tokenizer::TokenizerFiles), ConvertError> {
    let arch = g.str("general.architecture")?;
    let plan = match arch {
        "llama" => {
            let params = LlamaParams::from_gguf(g)?;
            let tok = tokenizer::build(g, params.context_length)?;
            let weights = convert_tensors(g, &params, float_dtype)?;
            let config = llama::config_json(
                &params,
                weights.tie_word_embeddings,
                SpecialIds {
                    bos: tok.bos_id,
                    eos: tok.eos_id,
                },
                weights.quantization.clone(),
                float_dtype,
            );
            return Ok((weights, config, tok));
        }
        "qwen2" | "qwen3" | "qwen3moe" => {
            let variant = qwen::Variant::from_arch(arch).expect("matched above");
            qwen::plan(g, variant)?
        }
        "gemma3" => gemma3::plan(g)?,
        "phi3" => phi3::plan(g)?,
        other => return Err(ConvertError::UnsupportedArchitecture(other.to_string())),
    };
    let tok = tokenizer::build(g, plan.context_length)?;
    let weights = convert_tensors(g, &plan.tensors, float_dtype)?;
    let config = finish_config(g, plan, &weights, &tok, float_dtype)?;
    Ok((weights, config, tok))
}

/// An [`ArchPlan`]'s config.json with what the tensors and the tokenizer decide: the tied
/// embedding, the token ids (every token that ends a generation as `eos_token_id`), the dtype
/// and the quantization.
fn finish_config(
    g: &GgufFile,
    plan: ArchPlan,
    weights: &Weights,
    tok: &tokenizer::TokenizerFiles,
    float_dtype: FloatDtype,
) -> Result<Value, ConvertError> {
    let mut c = plan.config;
    c.insert(
        "tie_word_embeddings".into(),
        json!(weights.tie_word_embeddings),
    );
    c.insert("torch_dtype".into(), json!(float_dtype.torch_name()));
    c.insert("bos_token_id".into(), json!(tok.bos_id));
    let extra = arch::extra_stop_ids(g, tok.eos_id)?;
    let eos = match (tok.eos_id, extra.is_empty()) {
        (eos, true) => json!(eos),
        (eos, false) => json!(eos.into_iter().chain(extra).collect::<Vec<_>>()),
    };
    c.insert("eos_token_id".into(), eos);
    if let Some(q) = &weights.quantization {
        c.insert("quantization".into(), q.clone());
        // mlx-lm writes both keys; transformers-style readers look for the second.
        c.insert("quantization_config".into(), q.clone());
    }
    Ok(Value::Object(c))
}

/// Removes the staging directory unless the conversion finished.
struct Staging {
    path: PathBuf,
    done: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ConvertError> {
    let mut f = fs::File::create(path).map_err(|e| ConvertError::io(path, e))?;
    f.write_all(bytes).map_err(|e| ConvertError::io(path, e))?;
    f.sync_all().map_err(|e| ConvertError::io(path, e))
}

fn write_json(path: &Path, v: &Value) -> Result<(), ConvertError> {
    let mut bytes = serde_json::to_vec_pretty(v).expect("JSON values serialize");
    bytes.push(b'\n');
    write_file(path, &bytes)
}

/// Converts the GGUF file at `gguf_path` into an MLX model directory at `out_dir`, which must
/// not exist yet, with the default options (f16). On error nothing is left at `out_dir` or
/// beside it. Returns what became of each tensor type and its error against GGML's own
/// dequantization.
pub fn convert_gguf(gguf_path: &Path, out_dir: &Path) -> Result<ConversionReport, ConvertError> {
    convert_gguf_with(gguf_path, out_dir, &ConvertOptions::default())
}

/// [`convert_gguf`] with explicit options.
pub fn convert_gguf_with(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
) -> Result<ConversionReport, ConvertError> {
    if out_dir.exists() {
        return Err(ConvertError::OutputExists(out_dir.to_path_buf()));
    }
    let g = GgufFile::open(gguf_path)?;
    let (weights, config, tok) = convert_model(&g, opts.float_dtype)?;

    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        Some(_) => PathBuf::from("."),
        None => return Err(ConvertError::NoParent(out_dir.to_path_buf())),
    };
    fs::create_dir_all(&parent).map_err(|e| ConvertError::io(&parent, e))?;
    let leaf = out_dir
        .file_name()
        .ok_or_else(|| ConvertError::NoParent(out_dir.to_path_buf()))?
        .to_string_lossy()
        .into_owned();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut staging = Staging {
        path: parent.join(format!(".{leaf}.partial-{}-{nanos}", std::process::id())),
        done: false,
    };
    fs::create_dir(&staging.path).map_err(|e| ConvertError::io(&staging.path, e))?;

    write_json(&staging.path.join("config.json"), &config)?;
    write_json(&staging.path.join("tokenizer.json"), &tok.tokenizer_json)?;
    write_json(
        &staging.path.join("tokenizer_config.json"),
        &tok.tokenizer_config,
    )?;
    write_json(
        &staging.path.join(STAMP_FILE),
        &Stamp::current(opts).to_json(gguf_path, &weights.report),
    )?;
    let st_path = staging.path.join("model.safetensors");
    let metadata: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    safetensors::serialize_to_file(weights.tensors.iter(), &Some(metadata), &st_path)
        .map_err(|e| ConvertError::Safetensors(format!("{}: {e}", st_path.display())))?;
    fs::File::open(&st_path)
        .and_then(|f| f.sync_all())
        .map_err(|e| ConvertError::io(&st_path, e))?;

    fs::rename(&staging.path, out_dir).map_err(|e| {
        if out_dir.exists() {
            ConvertError::OutputExists(out_dir.to_path_buf())
        } else {
            ConvertError::io(out_dir, e)
        }
    })?;
    staging.done = true;
    // Make the rename durable.
    if let Ok(d) = fs::File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(weights.report)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::gguf::tests::GgufBuilder;
    use super::*;
    use half::f16;

    const HIDDEN: u64 = 64;
    const HEADS: u32 = 2;
    const KV_HEADS: u32 = 1;
    const HEAD_DIM: usize = 32;
    const FFN: u64 = 96;
    const TOKENS: [&str; 6] = ["<|endoftext|>", "<|im_start|>", "a", "b", "ab", "Ġ"];

    /// Deterministic block data: `n_blocks` Q4_1/Q4_0/Q8_0 blocks with distinct contents.
    fn blocks(ty: GgmlType, n_blocks: usize, salt: usize) -> Vec<u8> {
        let (_, size) = ty.block_layout();
        let mut out = Vec::new();
        for b in 0..n_blocks {
            let d = f16::from_f32(0.01 * ((b + salt) % 7 + 1) as f32);
            out.extend_from_slice(&d.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                out.extend_from_slice(&f16::from_f32(-0.05 * (b % 3) as f32).to_le_bytes());
            }
            while out.len() % size as usize != 0 {
                out.push(((out.len() * 31 + b * 17 + salt) % 251) as u8);
            }
        }
        out
    }

    fn f32s(n: usize, salt: usize) -> Vec<u8> {
        (0..n)
            .flat_map(|i| (1.0 + ((i + salt) % 5) as f32 * 0.25).to_le_bytes())
            .collect()
    }

    /// A one-layer llama with every supported tensor type somewhere.
    pub(crate) fn tiny_llama(add_bos: bool, extra: Option<(&str, u32)>) -> GgufBuilder {
        let mut b = GgufBuilder::default();
        b.kv_str("general.architecture", "llama")
            .kv_u32("llama.block_count", 1)
            .kv_u32("llama.context_length", 256)
            .kv_u32("llama.embedding_length", HIDDEN as u32)
            .kv_u32("llama.feed_forward_length", FFN as u32)
            .kv_u32("llama.attention.head_count", HEADS)
            .kv_u32("llama.attention.head_count_kv", KV_HEADS)
            .kv_f32("llama.rope.freq_base", 10000.0)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-6)
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str("tokenizer.ggml.pre", "smollm")
            .kv_str_array("tokenizer.ggml.tokens", &TOKENS)
            .kv_i32_array("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1, 1])
            .kv_str_array("tokenizer.ggml.merges", &["a b"])
            .kv_u32("tokenizer.ggml.bos_token_id", 1)
            .kv_u32("tokenizer.ggml.eos_token_id", 0)
            .kv_bool("tokenizer.ggml.add_bos_token", add_bos)
            .kv_str("tokenizer.chat_template", "{{ messages }}");
        let v = TOKENS.len() as u64;
        let blocks_of = |rows: u64, cols: u64| (rows * cols / 32) as usize;
        let q_rows = HEADS as u64 * HEAD_DIM as u64;
        let kv_rows = KV_HEADS as u64 * HEAD_DIM as u64;
        b.tensor(
            "token_embd.weight",
            &[HIDDEN, v],
            8,
            blocks(GgmlType::Q8_0, blocks_of(v, HIDDEN), 1),
        )
        .tensor(
            "output.weight",
            &[HIDDEN, v],
            8,
            blocks(GgmlType::Q8_0, blocks_of(v, HIDDEN), 2),
        )
        .tensor("output_norm.weight", &[HIDDEN], 0, f32s(HIDDEN as usize, 3))
        .tensor(
            "blk.0.attn_norm.weight",
            &[HIDDEN],
            0,
            f32s(HIDDEN as usize, 4),
        )
        .tensor(
            "blk.0.ffn_norm.weight",
            &[HIDDEN],
            0,
            f32s(HIDDEN as usize, 5),
        )
        .tensor(
            "blk.0.attn_q.weight",
            &[HIDDEN, q_rows],
            3,
            blocks(GgmlType::Q4_1, blocks_of(q_rows, HIDDEN), 6),
        )
        .tensor(
            "blk.0.attn_k.weight",
            &[HIDDEN, kv_rows],
            2,
            blocks(GgmlType::Q4_0, blocks_of(kv_rows, HIDDEN), 7),
        )
        .tensor(
            "blk.0.attn_v.weight",
            &[HIDDEN, kv_rows],
            1,
            (0..kv_rows * HIDDEN)
                .flat_map(|i| f16::from_f32(i as f32 / 64.0).to_le_bytes())
                .collect(),
        )
        .tensor(
            "blk.0.attn_output.weight",
            &[q_rows, HIDDEN],
            3,
            blocks(GgmlType::Q4_1, blocks_of(HIDDEN, q_rows), 8),
        )
        .tensor(
            "blk.0.ffn_gate.weight",
            &[HIDDEN, FFN],
            3,
            blocks(GgmlType::Q4_1, blocks_of(FFN, HIDDEN), 9),
        )
        .tensor(
            "blk.0.ffn_up.weight",
            &[HIDDEN, FFN],
            3,
            blocks(GgmlType::Q4_1, blocks_of(FFN, HIDDEN), 10),
        )
        .tensor(
            "blk.0.ffn_down.weight",
            &[FFN, HIDDEN],
            3,
            blocks(GgmlType::Q4_1, blocks_of(HIDDEN, FFN), 11),
        );
        if let Some((name, ty)) = extra {
            let (_, size) = GgmlType::Q6K.block_layout();
            b.tensor(name, &[256], ty, vec![0u8; size as usize]);
        }
        b
    }

    /// name → (dtype, shape, bytes)
    type Loaded = HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

    fn load(dir: &Path) -> (Value, Loaded) {
        let config: Value =
            serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        let bytes = fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
            .collect();
        (config, tensors)
    }

    #[test]
    fn converts_a_tiny_llama_end_to_end() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("tiny.gguf");
        let b = tiny_llama(true, None);
        b.write(&src);
        let out = tmp.path().join("out");
        let report = convert_gguf(&src, &out).unwrap();
        let (config, t) = load(&out);
        // Q4_0, Q4_1 and Q8_0 keep GGML's f16 scales: exact. The f32 norms round to f16.
        for ty in ["Q4_0", "Q4_1", "Q8_0", "F16"] {
            assert!(report.types[ty].error.is_exact(), "{ty}: {report:?}");
        }
        assert_eq!(report.types["Q4_1"].tensors, 5);
        let stamp: Value =
            serde_json::from_slice(&fs::read(out.join(STAMP_FILE)).unwrap()).unwrap();
        assert_eq!(stamp["tensor_types"]["Q8_0"]["exact"], true);

        assert_eq!(config["tie_word_embeddings"], false);
        assert_eq!(config["head_dim"], HEAD_DIM);
        assert_eq!(config["num_key_value_heads"], KV_HEADS);
        assert_eq!(config["vocab_size"], TOKENS.len());
        assert_eq!(config["bos_token_id"], 1);
        let q = &config["quantization"];
        assert_eq!(
            (q["bits"].as_u64(), q["group_size"].as_u64()),
            (Some(4), Some(32))
        );
        assert_eq!(q["model.embed_tokens"]["bits"], 8);
        assert_eq!(q["lm_head"]["bits"], 8);
        assert_eq!(q["model.layers.0.self_attn.v_proj"], false);
        assert!(q.get("model.layers.0.self_attn.k_proj").is_none());
        // 2 norms + final norm + v (float) + 8 quantized matrices x 3.
        assert_eq!(t.len(), 4 + 8 * 3);
        assert_eq!(t["lm_head.weight"].1, vec![TOKENS.len(), 16]);
        assert_eq!(t["model.layers.0.self_attn.v_proj.weight"].0, Dtype::F16);
        assert_eq!(t["model.layers.0.mlp.down_proj.weight"].1, vec![64, 12]);

        // Q rows arrive un-permuted, whole, with their own scales: output row r of head h is
        // GGUF row h*hd + 2i + j where r = h*hd + j*hd/2 + i.
        let g = GgufFile::open(&src).unwrap();
        let info = g
            .tensors
            .iter()
            .find(|t| t.name == "blk.0.attn_q.weight")
            .unwrap();
        let rows = HEADS as usize * HEAD_DIM;
        let identity: Vec<usize> = (0..rows).collect();
        let plain = quant::repack(
            "q",
            GgmlType::Q4_1,
            g.tensor_data(info),
            rows,
            64,
            &identity,
            FloatDtype::F16,
        )
        .unwrap()
        .dequantize();
        let (_, _, w) = &t["model.layers.0.self_attn.q_proj.weight"];
        let f16s = |name: &str| -> Vec<f32> {
            t[name]
                .2
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()
        };
        let got = quant::dequantize_affine(
            4,
            32,
            w,
            &f16s("model.layers.0.self_attn.q_proj.scales"),
            &f16s("model.layers.0.self_attn.q_proj.biases"),
        );
        let half = HEAD_DIM / 2;
        for h in 0..HEADS as usize {
            for j in 0..2 {
                for i in 0..half {
                    let r = h * HEAD_DIM + j * half + i;
                    let src_row = h * HEAD_DIM + 2 * i + j;
                    assert_eq!(
                        got[r * 64..(r + 1) * 64],
                        plain[src_row * 64..(src_row + 1) * 64]
                    );
                }
            }
        }

        // The tokenizer loads in the `tokenizers` crate, merges, and adds BOS as asked.
        let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
        assert_eq!(tok.encode("ab", false).unwrap().get_ids(), &[4]);
        assert_eq!(tok.encode("ab", true).unwrap().get_ids(), &[1, 4]);
        assert_eq!(
            tok.encode("<|endoftext|>ab", false).unwrap().get_ids(),
            &[0, 4]
        );
        let tc: Value =
            serde_json::from_slice(&fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
        assert_eq!(tc["add_bos_token"], true);
        assert_eq!(tc["bos_token"], "<|im_start|>");
        assert_eq!(tc["chat_template"], "{{ messages }}");
        assert_eq!(tc["model_max_length"], 256);

        // f32 output: same structure, wider floats.
        let out32 = tmp.path().join("out32");
        let opts = ConvertOptions {
            float_dtype: FloatDtype::F32,
        };
        convert_gguf_with(&src, &out32, &opts).unwrap();
        let (config32, t32) = load(&out32);
        assert_eq!(config32["torch_dtype"], "float32");
        assert_eq!(t32["model.norm.weight"].0, Dtype::F32);
        assert_eq!(t32["lm_head.scales"].0, Dtype::F32);
        assert_eq!(t32["lm_head.weight"].2, t["lm_head.weight"].2);
    }

    #[test]
    fn rope_freqs_become_rope_scaling_or_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let factors = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|f| f.to_le_bytes()).collect() };
        // All ones: no scaling.
        let mut b = tiny_llama(false, None);
        b.tensor(llama::ROPE_FREQS, &[16], 0, factors(&[1.0; 16]));
        let src = tmp.path().join("ones.gguf");
        b.write(&src);
        convert_gguf(&src, &tmp.path().join("ones")).unwrap();
        let (config, _) = load(&tmp.path().join("ones"));
        assert!(config.get("rope_scaling").is_none(), "{config}");
        // Factors no Llama 3 scaling produces.
        let mut b = tiny_llama(false, None);
        b.tensor(llama::ROPE_FREQS, &[16], 0, factors(&[2.0; 16]));
        let src = tmp.path().join("odd.gguf");
        b.write(&src);
        let e = convert_gguf(&src, &tmp.path().join("odd")).unwrap_err();
        assert!(
            e.to_string()
                .contains("does not match Llama 3 rope scaling"),
            "{e}"
        );
        assert!(!tmp.path().join("odd").exists());
    }

    #[test]
    fn unknown_or_unsupported_tensors_fail_without_leftovers() {
        let tmp = tempfile::tempdir().unwrap();
        for (extra, needle) in [
            (("blk.0.attn_qkv.weight", 14), "blk.0.attn_qkv.weight"),
            (("output_norm.bias", 14), "output_norm.bias"),
        ] {
            let src = tmp.path().join("bad.gguf");
            tiny_llama(false, Some(extra)).write(&src);
            let out = tmp.path().join("out");
            let e = convert_gguf(&src, &out).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
            assert!(!out.exists());
        }
        // Another architecture.
        let mut b = GgufBuilder::default();
        b.kv_str("general.architecture", "falcon");
        let src = tmp.path().join("falcon.gguf");
        b.write(&src);
        let e = convert_gguf(&src, &tmp.path().join("out")).unwrap_err();
        assert!(e.to_string().contains("\"falcon\""), "{e}");
        let names: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| n.ends_with(".gguf")), "{names:?}");
    }
}
