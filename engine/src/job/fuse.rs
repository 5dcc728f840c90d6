//! `fuse` jobs: merges an mlx-lm LoRA or DoRA adapter into its base model, as mlx-lm's `fuse`
//! does (`LoRALinear.fuse`, `DoRALinear.fuse`): each adapted linear's weight becomes
//! `W + ((scale * lora_b^T) @ lora_a^T).astype(W.dtype)`, and for DoRA each row of that is
//! then scaled by `m / ‖row‖` ([`crate::adapters::dora::fuse`]); an expert stack `[E, out, in]`
//! (`LoRASwitchLinear.fuse`) becomes `W + ((scale * lora_b) @ lora_a).astype(W.dtype)`, each
//! expert merged with its own pair (`lora_b` `[E, out, r]`, `lora_a` `[E, r, in]`), in the
//! stacked form mlx-lm writes (`switch_mlp`); a quantized weight is
//! dequantized with its own settings, merged, and quantized again with the same group size
//! and bits (mlx-lm's default, without `--dequantize`). Every other tensor, config.json and the
//! tokenizer files are copied unchanged, so the new directory is a model served by its name.
//!
//! Memory: the checkpoint is opened lazily; one tensor at a time is evaluated and the output
//! is written in shards, as a quantize job does (`quantize::ShardWriter`).
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

use mlx_rs::ops::{dequantize, quantize};
use mlx_rs::{Array, Dtype};
use mlxd_protocol::jobs::JobProgress;
use serde_json::Value;

use super::quantize::{copy_other_files, source_quant, ShardWriter, SourceQuant};
use super::{io, place, JobError};
use crate::adapters::config::AdapterKind;
use crate::adapters::dora;

fn mlx(e: impl std::fmt::Display) -> JobError {
    JobError::Mlx(e.to_string())
}

/// Called with the job's progress; an error stops it.
pub type Report<'a> = dyn FnMut(JobProgress) -> Result<(), JobError> + 'a;

/// Fuses `adapter` into `source`, building `staging/model` and renaming it to `out`. Returns
/// the bytes of weights written.
pub fn fuse_dir(
    source: &Path,
    adapter: &Path,
    staging: &Path,
    out: &Path,
    report: &mut Report<'_>,
) -> Result<u64, JobError> {
    if out.exists() {
        return Err(JobError::OutputExists(out.to_path_buf()));
    }
    let config_path = adapter.join("adapter_config.json");
    let text = fs::read_to_string(&config_path).map_err(io(&config_path))?;
    let adapter_config =
        crate::adapters::config::parse(&text).map_err(|e| JobError::Input(e.to_string()))?;
    let weights_path = adapter.join("adapters.safetensors");
    let lora = Array::load_safetensors(&weights_path)
        .map_err(|e| JobError::Input(format!("{}: {e}", weights_path.display())))?;
    let is_dora = adapter_config.kind == AdapterKind::Dora;
    let mut parts: BTreeMap<String, [Option<Array>; 3]> = BTreeMap::new();
    for (key, array) in lora {
        let (prefix, part) = if let Some(p) = key.strip_suffix(".lora_a") {
            (p, 0)
        } else if let Some(p) = key.strip_suffix(".lora_b") {
            (p, 1)
        } else if let Some(p) = key.strip_suffix(".m").filter(|_| is_dora) {
            (p, 2)
        } else {
            let what = if is_dora {
                "a DoRA tensor (a .lora_a, .lora_b or .m)"
            } else {
                "a LoRA tensor (a .lora_a or .lora_b)"
            };
            return Err(JobError::Input(format!(
                "{}: {key} is not {what}",
                weights_path.display()
            )));
        };
        parts.entry(prefix.to_owned()).or_default()[part] = Some(array);
    }

    let model_config_path = source.join("config.json");
    let BaseWeights {
        tensors,
        config: model_config,
    } = BaseWeights::open(source)?;
    // Each adapted layer must be a linear of this model.
    let mut deltas: HashMap<String, Delta> = HashMap::new();
    for (prefix, [a, b, m]) in parts {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(JobError::Input(format!(
                "{prefix}: the adapter has only one of lora_a and lora_b"
            )));
        };
        if is_dora && m.is_none() {
            return Err(JobError::Input(format!(
                "{prefix}: a DoRA adapter's layer has no m (its magnitude)"
            )));
        }
        let stack = a.ndim() == 3;
        if stack && is_dora {
            return Err(JobError::Input(format!(
                "{prefix}: a DoRA adapter changes an expert stack, and DoRA has no form for \
                 expert stacks (mlx-lm refuses it too)"
            )));
        }
        if stack && !tensors.contains_key(&format!("{prefix}.weight")) {
            return Err(JobError::Input(format!(
                "{prefix}: the adapter changes an expert stack, and {} does not hold it stacked \
                 ({prefix}.weight, mlx-lm's form; a checkpoint with one tensor per expert is \
                 not fused: convert it with mlx_lm.convert first)",
                source.display()
            )));
        }
        if !tensors.contains_key(&format!("{prefix}.weight")) {
            return Err(JobError::Input(format!(
                "{prefix}: the adapter changes a layer this model does not have ({} has no \
                 {prefix}.weight)",
                source.display()
            )));
        }
        deltas.insert(prefix, Delta { a, b, m });
    }
    let mut names: Vec<String> = tensors.keys().cloned().collect();
    names.sort();
    let total = deltas.len() as u64;

    fs::create_dir_all(staging).map_err(io(staging))?;
    let built = staging.join("model");
    fs::create_dir(&built).map_err(io(&built))?;
    let mut shards = ShardWriter::new(&built);
    let mut fused = 0u64;
    let scale = adapter_config.scale;
    for name in &names {
        let Some(array) = tensors.get(name).cloned() else {
            continue;
        };
        let prefix = name.strip_suffix(".weight");
        let outputs: Vec<(String, Array)> = match prefix.and_then(|p| deltas.get(p).map(|d| (p, d)))
        {
            Some((prefix, delta)) => {
                report(JobProgress {
                    phase: "fusing".into(),
                    done: fused,
                    total,
                    unit: "layers".into(),
                    detail: Some(prefix.to_owned()),
                    training: None,
                })?;
                fused += 1;
                fuse_one(prefix, array, delta, scale, &tensors, &model_config)?
            }
            None if is_companion(name, &tensors, &deltas) => continue,
            None => vec![(name.clone(), array)],
        };
        shards.push(outputs)?;
    }
    report(JobProgress {
        phase: "writing".into(),
        done: fused,
        total,
        unit: "layers".into(),
        detail: None,
        training: None,
    })?;
    let written_total = shards.finish()?;
    let to = built.join("config.json");
    fs::copy(&model_config_path, &to).map_err(io(&to))?;
    copy_other_files(source, &built)?;
    place(&built, staging, out)?;
    Ok(written_total)
}

/// One adapted layer's arrays in the adapter.
struct Delta {
    a: Array,
    b: Array,
    /// DoRA's magnitude.
    m: Option<Array>,
}

/// A model directory's tensors (opened lazily: a tensor is read when evaluated) and its
/// `config.json`.
pub(crate) struct BaseWeights {
    pub tensors: HashMap<String, Array>,
    pub config: Value,
}

impl BaseWeights {
    pub fn open(source: &Path) -> Result<Self, JobError> {
        let config_path = source.join("config.json");
        let config: Value =
            serde_json::from_slice(&fs::read(&config_path).map_err(io(&config_path))?)
                .map_err(|e| JobError::Input(format!("{}: {e}", config_path.display())))?;
        let files =
            crate::loader::weight_files(source).map_err(|e| JobError::Input(e.to_string()))?;
        let mut tensors: HashMap<String, Array> = HashMap::new();
        for file in &files {
            let loaded = Array::load_safetensors(file)
                .map_err(|e| JobError::Input(format!("{}: {e}", file.display())))?;
            tensors.extend(loaded);
        }
        Ok(Self { tensors, config })
    }

    /// The weight of linear `prefix`, dense (a quantized one dequantized with its settings).
    pub fn dense(&self, prefix: &str) -> Result<Array, JobError> {
        let weight = self
            .tensors
            .get(&format!("{prefix}.weight"))
            .ok_or_else(|| JobError::Input(format!("the model has no {prefix}.weight")))?;
        Ok(dense_of(prefix, weight.clone(), &self.tensors, &self.config)?.0)
    }
}

/// A packed weight's settings, scales and biases.
type Packing = (SourceQuant, Array, Option<Array>);

/// `weight` of linear `prefix` as a dense matrix, with how it was packed when quantized.
fn dense_of(
    prefix: &str,
    weight: Array,
    tensors: &HashMap<String, Array>,
    config: &Value,
) -> Result<(Array, Option<Packing>), JobError> {
    let quant = if weight.dtype() == Dtype::Uint32 {
        let q = source_quant(config, prefix).ok_or_else(|| {
            JobError::Input(format!(
                "{prefix}.weight is quantized but config.json has no quantization settings for it"
            ))
        })?;
        let scales = tensors.get(&format!("{prefix}.scales")).ok_or_else(|| {
            JobError::Input(format!(
                "{prefix}.weight is packed but {prefix}.scales is missing"
            ))
        })?;
        let biases = tensors.get(&format!("{prefix}.biases"));
        Some((q, scales.clone(), biases.cloned()))
    } else {
        None
    };
    let dense = match &quant {
        Some((q, scales, biases)) => {
            dequantize(&weight, scales, biases.as_ref(), q.group_size, q.bits).map_err(mlx)?
        }
        None => weight,
    };
    Ok((dense, quant))
}

/// A quantized adapted layer's `.scales` and `.biases`: written with its fused weight.
fn is_companion(
    name: &str,
    tensors: &HashMap<String, Array>,
    deltas: &HashMap<String, Delta>,
) -> bool {
    ["scales", "biases"].iter().any(|suffix| {
        name.strip_suffix(suffix)
            .and_then(|p| p.strip_suffix('.'))
            .is_some_and(|prefix| {
                deltas.contains_key(prefix)
                    && tensors
                        .get(&format!("{prefix}.weight"))
                        .is_some_and(|w| w.dtype() == Dtype::Uint32)
            })
    })
}

/// The fused tensors of one adapted linear: its weight (and, quantized, scales and biases).
fn fuse_one(
    prefix: &str,
    weight: Array,
    delta: &Delta,
    scale: f32,
    tensors: &HashMap<String, Array>,
    config: &Value,
) -> Result<Vec<(String, Array)>, JobError> {
    let (dense, quant) = dense_of(prefix, weight, tensors, config)?;
    let Delta { a, b, m } = delta;
    let scale_of = |b: &Array| Array::from_f32(scale).as_dtype(b.dtype());
    let delta = if a.ndim() == 3 {
        // `LoRASwitchLinear.fuse`: `((self.scale * self.lora_b) @ self.lora_a)`, per expert.
        b.multiply(scale_of(b).map_err(mlx)?)
            .and_then(|s| s.matmul(a))
    } else {
        // `LoRALinear.fuse`: `((self.scale * self.lora_b.T) @ self.lora_a.T)`.
        b.t()
            .multiply(scale_of(b).map_err(mlx)?)
            .and_then(|s| s.matmul(a.t()))
    }
    .and_then(|d| d.as_dtype(dense.dtype()))
    .map_err(mlx)?;
    if delta.shape() != dense.shape() {
        return Err(JobError::Input(format!(
            "{prefix}: the adapter's update has shape {:?}, the layer's weight {:?}",
            delta.shape(),
            dense.shape()
        )));
    }
    let merged = match m {
        Some(m) if m.shape() != [dense.shape()[0]] => {
            return Err(JobError::Input(format!(
                "{prefix}.m has shape {:?}, the layer has {} outputs",
                m.shape(),
                dense.shape()[0]
            )))
        }
        Some(m) => dora::fuse(&dense, a, b, m, scale).map_err(mlx)?,
        None => dense.add(&delta).map_err(mlx)?,
    };
    Ok(match quant {
        Some((q, _, _)) => {
            let (w, scales, biases) = quantize(&merged, q.group_size, q.bits).map_err(mlx)?;
            vec![
                (format!("{prefix}.weight"), w),
                (format!("{prefix}.scales"), scales),
                (format!("{prefix}.biases"), biases),
            ]
        }
        None => vec![(format!("{prefix}.weight"), merged)],
    })
}
