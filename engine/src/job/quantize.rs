//! Quantizes a model directory to MLX affine quantization with MLX's own `quantize`, writing
//! what mlx-lm's `convert -q` writes: `<module>.weight` (packed `uint32`), `.scales` and
//! `.biases` (the weight's float type) for every linear and embedding matrix whose input
//! dimension is a multiple of the group size, everything else unchanged, and config.json with
//! `quantization` = `quantization_config` = `{"group_size", "bits", "mode": "affine"}`.
//!
//! An already quantized source (a converted GGUF, an mlx-lm 4-bit model) is dequantized first
//! with its own settings, then quantized again; mlx-lm refuses such a model instead.
//!
//! Memory: the checkpoint is opened lazily (MLX maps tensors on evaluation); one tensor at a
//! time is evaluated, quantized and its source released, and the output is written in shards
//! of at most [`SHARD_BYTES`], so the peak is about one output shard plus a few copies of the
//! largest tensor (what `mlxd`'s admission estimate counts).
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use mlx_rs::ops::{dequantize, quantize};
use mlx_rs::{Array, Dtype};
use mlxd_protocol::jobs::{JobProgress, QUANTIZE_SHARD_BYTES as SHARD_BYTES};
use serde_json::{json, Value};

use super::channel::Reporter;
use super::{io, place, JobError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeOptions {
    pub bits: u32,
    pub group_size: u32,
}

/// Files of a model directory that are not copied to the quantized one: the weights (written
/// anew) and the store's conversion stamp (it describes the source, not the output).
fn is_weight_or_stamp(name: &str) -> bool {
    name.ends_with(".safetensors")
        || name == "model.safetensors.index.json"
        || name == mlxd_store::convert::STAMP_FILE
}

/// How one quantized matrix of the source is stored (config.json's `quantization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SourceQuant {
    pub group_size: i32,
    pub bits: i32,
}

pub(crate) fn source_quant(config: &Value, prefix: &str) -> Option<SourceQuant> {
    let q = config
        .get("quantization")
        .or_else(|| config.get("quantization_config"))?;
    let spec = |v: &Value| {
        Some(SourceQuant {
            group_size: v.get("group_size")?.as_i64()? as i32,
            bits: v.get("bits")?.as_i64()? as i32,
        })
    };
    match q.get(prefix) {
        Some(v @ Value::Object(_)) => spec(v),
        _ => spec(q),
    }
}

fn mlx(e: impl std::fmt::Display) -> JobError {
    JobError::Mlx(e.to_string())
}

/// Bytes of the `*.safetensors` files in `dir`.
pub fn weight_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Quantizes `source` into `staging/model`, then renames it to `out`. Returns the bytes of
/// weights written.
pub fn quantize_dir(
    source: &Path,
    staging: &Path,
    out: &Path,
    options: QuantizeOptions,
    reporter: &Reporter,
) -> Result<u64, JobError> {
    if !bits_and_group_ok(options) {
        return Err(JobError::Input(format!(
            "bits {} with group size {}: expected bits 4 or 8 and group size 32, 64 or 128",
            options.bits, options.group_size
        )));
    }
    if out.exists() {
        return Err(JobError::OutputExists(out.to_path_buf()));
    }
    let config_path = source.join("config.json");
    let mut config: Value =
        serde_json::from_slice(&fs::read(&config_path).map_err(io(&config_path))?)
            .map_err(|e| JobError::Input(format!("{}: {e}", config_path.display())))?;
    let files = crate::loader::weight_files(source).map_err(|e| JobError::Input(e.to_string()))?;
    let mut tensors: HashMap<String, Array> = HashMap::new();
    for file in &files {
        let loaded = Array::load_safetensors(file)
            .map_err(|e| JobError::Input(format!("{}: {e}", file.display())))?;
        tensors.extend(loaded);
    }
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    // The source's quantized triples: `.scales` and `.biases` travel with their `.weight`.
    let is_companion = |name: &str| {
        ["scales", "biases"].iter().any(|suffix| {
            name.strip_suffix(suffix)
                .and_then(|p| p.strip_suffix('.'))
                .is_some_and(|prefix| {
                    tensors
                        .get(&format!("{prefix}.weight"))
                        .is_some_and(|w| w.dtype() == Dtype::Uint32)
                })
        })
    };
    let items: Vec<String> = names.into_iter().filter(|n| !is_companion(n)).collect();
    let total = items.len() as u64;

    fs::create_dir_all(staging).map_err(io(staging))?;
    let built = staging.join("model");
    fs::create_dir(&built).map_err(io(&built))?;

    let mut shards = ShardWriter::new(&built);
    let group = options.group_size as i32;
    let bits = options.bits as i32;
    let stall = super::stall_after();
    for (i, name) in items.iter().enumerate() {
        reporter.progress(JobProgress {
            phase: "quantizing".into(),
            done: i as u64,
            total,
            unit: "tensors".into(),
            detail: Some(name.clone()),
            training: None,
        })?;
        if stall == Some(i as u64) {
            super::stall(&built);
        }
        let array = tensors
            .remove(name)
            .ok_or_else(|| JobError::Input(format!("tensor {name} vanished")))?;
        let prefix = name.strip_suffix(".weight");
        let dense = match prefix {
            Some(prefix) if array.dtype() == Dtype::Uint32 => {
                let scales = tensors.remove(&format!("{prefix}.scales")).ok_or_else(|| {
                    JobError::Input(format!("{name} is packed but {prefix}.scales is missing"))
                })?;
                let biases = tensors.remove(&format!("{prefix}.biases"));
                let q = source_quant(&config, prefix).ok_or_else(|| {
                    JobError::Input(format!(
                        "{name} is quantized but config.json has no quantization settings for it"
                    ))
                })?;
                dequantize(&array, &scales, biases.as_ref(), q.group_size, q.bits).map_err(mlx)?
            }
            _ => array,
        };
        let quantizable = prefix.is_some()
            && dense.ndim() == 2
            && matches!(
                dense.dtype(),
                Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
            )
            && dense.shape()[1] % group == 0;
        let outputs: Vec<(String, Array)> = match prefix {
            Some(prefix) if quantizable => {
                let (w, scales, biases) = quantize(&dense, group, bits).map_err(mlx)?;
                vec![
                    (format!("{prefix}.weight"), w),
                    (format!("{prefix}.scales"), scales),
                    (format!("{prefix}.biases"), biases),
                ]
            }
            _ => vec![(name.clone(), dense)],
        };
        shards.push(outputs)?;
    }
    reporter.progress(JobProgress {
        phase: "writing".into(),
        done: total,
        total,
        unit: "tensors".into(),
        detail: None,
        training: None,
    })?;
    let written_total = shards.finish()?;

    write_config(&built, &mut config, options)?;
    copy_other_files(source, &built)?;
    place(&built, staging, out)?;
    Ok(written_total)
}

pub(crate) fn bits_and_group_ok(options: QuantizeOptions) -> bool {
    mlxd_protocol::jobs::BITS.contains(&options.bits)
        && mlxd_protocol::jobs::GROUP_SIZES.contains(&options.group_size)
}

/// A model's output tensors written in shards of at most [`SHARD_BYTES`] as they are made (so
/// a job holds about one shard), then named as mlx-lm names them ([`name_shards`]).
pub(crate) struct ShardWriter {
    dir: PathBuf,
    /// The shard being filled and its bytes.
    shard: BTreeMap<String, Array>,
    shard_bytes: u64,
    /// The shards written (path, tensor names) and their bytes on disk.
    written: Vec<(PathBuf, Vec<String>)>,
    written_bytes: u64,
}

impl ShardWriter {
    /// A writer of shards into `dir`.
    pub(crate) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            shard: BTreeMap::new(),
            shard_bytes: 0,
            written: Vec::new(),
            written_bytes: 0,
        }
    }

    /// Adds one source tensor's outputs (evaluated here), writing the shard being filled
    /// first when they would take it past [`SHARD_BYTES`].
    pub(crate) fn push(&mut self, outputs: Vec<(String, Array)>) -> Result<(), JobError> {
        let refs: Vec<&Array> = outputs.iter().map(|(_, a)| a).collect();
        mlx_rs::transforms::eval(refs).map_err(mlx)?;
        let bytes: u64 = outputs.iter().map(|(_, a)| a.nbytes() as u64).sum();
        if self.shard_bytes > 0 && self.shard_bytes + bytes > SHARD_BYTES {
            self.write_shard()?;
        }
        self.shard.extend(outputs);
        self.shard_bytes += bytes;
        Ok(())
    }

    /// Writes the last shard and names the files; returns the bytes written in all.
    pub(crate) fn finish(mut self) -> Result<u64, JobError> {
        self.write_shard()?;
        name_shards(&self.dir, &self.written)?;
        Ok(self.written_bytes)
    }

    fn write_shard(&mut self) -> Result<(), JobError> {
        let path = self
            .dir
            .join(format!("shard-{}.safetensors", self.written.len()));
        let (size, names) = save_shard(std::mem::take(&mut self.shard), &path)?;
        self.written_bytes += size;
        self.written.push((path, names));
        self.shard_bytes = 0;
        Ok(())
    }
}

/// Saves one shard, releasing its arrays; returns the bytes written and the tensor names.
pub(crate) fn save_shard(
    shard: BTreeMap<String, Array>,
    path: &Path,
) -> Result<(u64, Vec<String>), JobError> {
    let metadata: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    Array::save_safetensors(shard.iter(), Some(&metadata), path)
        .map_err(|e| JobError::Mlx(format!("writing {}: {e}", path.display())))?;
    let names = shard.into_keys().collect();
    Ok((fs::metadata(path).map_err(io(path))?.len(), names))
}

/// Renames the shards as mlx-lm names them: `model.safetensors` alone, or
/// `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
pub(crate) fn name_shards(built: &Path, files: &[(PathBuf, Vec<String>)]) -> Result<(), JobError> {
    let n = files.len();
    if n == 1 {
        let to = built.join("model.safetensors");
        fs::rename(&files[0].0, &to).map_err(io(&to))?;
        return Ok(());
    }
    let mut weight_map = serde_json::Map::new();
    let mut total_size = 0u64;
    for (i, (path, keys)) in files.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let to = built.join(&name);
        total_size += fs::metadata(path).map_err(io(path))?.len();
        fs::rename(path, &to).map_err(io(&to))?;
        for key in keys {
            weight_map.insert(key.clone(), Value::String(name.clone()));
        }
    }
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    let path = built.join("model.safetensors.index.json");
    let text = serde_json::to_vec_pretty(&index).expect("JSON values serialize");
    fs::write(&path, text).map_err(io(&path))
}

/// config.json with the new quantization, as mlx-lm writes it.
fn write_config(
    built: &Path,
    config: &mut Value,
    options: QuantizeOptions,
) -> Result<(), JobError> {
    let q = json!({"group_size": options.group_size, "bits": options.bits, "mode": "affine"});
    let obj = config
        .as_object_mut()
        .ok_or_else(|| JobError::Input("config.json is not a JSON object".into()))?;
    obj.insert("quantization".into(), q.clone());
    obj.insert("quantization_config".into(), q);
    let path = built.join("config.json");
    let text = serde_json::to_vec_pretty(config).expect("JSON values serialize");
    fs::write(&path, text).map_err(io(&path))
}

/// Tokenizer files, chat templates, generation config: everything but weights and config.
pub(crate) fn copy_other_files(source: &Path, built: &Path) -> Result<(), JobError> {
    for entry in fs::read_dir(source).map_err(io(source))? {
        let entry = entry.map_err(io(source))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "config.json" || is_weight_or_stamp(&name) || name.starts_with('.') {
            continue;
        }
        let from = entry.path();
        if from.is_file() {
            let to = built.join(&name);
            fs::copy(&from, &to).map_err(io(&to))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_quantization_uses_per_layer_overrides() {
        let config = json!({"quantization": {"group_size": 32, "bits": 4,
            "lm_head": {"group_size": 64, "bits": 8}}});
        assert_eq!(
            source_quant(&config, "model.layers.0.mlp.up_proj"),
            Some(SourceQuant {
                group_size: 32,
                bits: 4
            })
        );
        assert_eq!(
            source_quant(&config, "lm_head"),
            Some(SourceQuant {
                group_size: 64,
                bits: 8
            })
        );
        assert_eq!(source_quant(&json!({}), "lm_head"), None);
    }

    #[test]
    fn only_bits_4_8_and_mlx_group_sizes() {
        for (bits, group_size, ok) in [(4, 64, true), (8, 32, true), (3, 64, false), (4, 48, false)]
        {
            assert_eq!(bits_and_group_ok(QuantizeOptions { bits, group_size }), ok);
        }
    }
}
