//! GGUF → MLX-format model directory, in pure Rust.
//!
//! [`convert_gguf`] writes `config.json`, `model.safetensors`, `tokenizer.json` and
//! `tokenizer_config.json` in the layout mlx-lm reads: quantized matrices become MLX affine
//! quantization (`<module>.weight` `u32`, `<module>.scales`/`.biases` `f16`, group size 32),
//! everything else `f16`. The directory is assembled beside `out_dir` and renamed into place at
//! the end, so `out_dir` either does not exist or is complete.
pub mod gguf;
pub mod llama;
pub mod quant;
pub mod tokenizer;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{json, Value};

use gguf::{GgmlType, GgufFile};
use llama::{LlamaParams, SpecialIds};
pub use quant::FloatDtype;

/// How to convert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConvertOptions {
    /// The float type of unquantized tensors and of quantization scales and biases.
    pub float_dtype: FloatDtype,
}

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
    #[error("architecture {0:?} is not supported (supported: \"llama\")")]
    UnsupportedArchitecture(String),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor {name:?} has type {ggml_type}, which cannot be converted")]
    UnsupportedTensorType { name: String, ggml_type: String },
    #[error("tensor {0:?} is not part of the llama architecture as converted here")]
    UnknownTensor(String),
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
    quantization: Option<Value>,
    tie_word_embeddings: bool,
}

fn convert_tensors(
    g: &GgufFile,
    p: &LlamaParams,
    float_dtype: FloatDtype,
) -> Result<Weights, ConvertError> {
    let float_st = match float_dtype {
        FloatDtype::F16 => Dtype::F16,
        FloatDtype::F32 => Dtype::F32,
    };
    let mut tensors = BTreeMap::new();
    // module path → Some((bits, group size)) when quantized, None when a float matrix.
    let mut matrices: BTreeMap<String, Option<(u32, usize)>> = BTreeMap::new();
    let present: BTreeSet<&str> = g.tensors.iter().map(|t| t.name.as_str()).collect();
    for name in p.required_tensors() {
        if !present.contains(name.as_str()) {
            return Err(ConvertError::MissingTensor(name));
        }
    }

    for info in &g.tensors {
        let role = llama::tensor_role(p, &info.name)?;
        let hf_shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if hf_shape != role.shape {
            return Err(ConvertError::Shape(format!(
                "{}: shape {:?} (GGUF dims {:?}), expected {:?} for {}",
                info.name, hf_shape, info.dims, role.shape, role.module
            )));
        }
        let (rows, cols) = match hf_shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => unreachable!("roles have one or two dimensions"),
        };
        let order = match role.unpermute_heads {
            Some(heads) => quant::unpermute_qk_rows(&info.name, rows, heads)?,
            None => (0..rows).collect(),
        };
        let data = g.tensor_data(info);
        match info.ggml_type {
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
                if hf_shape.len() != 2 {
                    return Err(ConvertError::UnsupportedTensorType {
                        name: info.name.clone(),
                        ggml_type: format!(
                            "{:?} on a 1-D tensor (only matrices may be quantized)",
                            info.ggml_type
                        ),
                    });
                }
                let q = quant::repack(&info.name, info.ggml_type, data, rows, cols, &order)?;
                let words = cols * q.bits as usize / 32;
                let groups = cols / q.group_size;
                tensors.insert(
                    format!("{}.weight", role.module),
                    OutTensor {
                        dtype: Dtype::U32,
                        shape: vec![rows, words],
                        data: q.weight,
                    },
                );
                for (suffix, bytes) in [("scales", q.scales), ("biases", q.biases)] {
                    tensors.insert(
                        format!("{}.{suffix}", role.module),
                        OutTensor {
                            dtype: float_st,
                            shape: vec![rows, groups],
                            data: quant::f16_bytes_as(float_dtype, bytes),
                        },
                    );
                }
                matrices.insert(role.module, Some((q.bits, q.group_size)));
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => {
                let bytes = quant::to_float(
                    &info.name,
                    info.ggml_type,
                    data,
                    rows,
                    cols,
                    &order,
                    float_dtype,
                )?;
                if hf_shape.len() == 2 {
                    matrices.insert(role.module.clone(), None);
                }
                tensors.insert(
                    format!("{}.weight", role.module),
                    OutTensor {
                        dtype: float_st,
                        shape: hf_shape,
                        data: bytes,
                    },
                );
            }
            other => {
                return Err(ConvertError::UnsupportedTensorType {
                    name: info.name.clone(),
                    ggml_type: format!("{other:?} (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)"),
                })
            }
        }
    }

    Ok(Weights {
        tensors,
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
/// beside it.
pub fn convert_gguf(gguf_path: &Path, out_dir: &Path) -> Result<(), ConvertError> {
    convert_gguf_with(gguf_path, out_dir, &ConvertOptions::default())
}

/// [`convert_gguf`] with explicit options.
pub fn convert_gguf_with(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
) -> Result<(), ConvertError> {
    if out_dir.exists() {
        return Err(ConvertError::OutputExists(out_dir.to_path_buf()));
    }
    let g = GgufFile::open(gguf_path)?;
    let arch = g.str("general.architecture")?;
    if arch != "llama" {
        return Err(ConvertError::UnsupportedArchitecture(arch.to_string()));
    }
    let params = LlamaParams::from_gguf(&g)?;
    let tok = tokenizer::build(&g, params.context_length)?;
    let weights = convert_tensors(&g, &params, opts.float_dtype)?;
    let config = llama::config_json(
        &params,
        weights.tie_word_embeddings,
        SpecialIds {
            bos: tok.bos_id,
            eos: tok.eos_id,
        },
        weights.quantization.clone(),
        opts.float_dtype,
    );

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
    Ok(())
}
