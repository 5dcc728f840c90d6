//! Loads a Hugging Face / MLX-format model directory: `config.json` plus safetensors, single or
//! sharded (`model.safetensors.index.json`), in f32/f16/bf16 or MLX-quantized form.
//!
//! Every checkpoint tensor must be consumed by the model and every parameter found; otherwise
//! loading fails naming the tensors. Weights are evaluated before the model is declared loaded,
//! so a truncated or corrupt file fails the load, not the first request.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};
use mlxd_protocol::control::LoadPhase;
use serde_json::Value;

use crate::distributed::shard_read::{self, TensorOnDisk};
use crate::distributed::{Group, Piece, ShardPlan};
use crate::models::quant::QuantMode;

/// Where a load reports how far it has got: a phase and the fraction of it done (`0.0..=1.0`).
/// Under `mlxd` it sends `Loading` frames; tests collect the calls.
pub type LoadReporter = Arc<dyn Fn(LoadPhase, f32) + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("invalid config.json: {0}")]
    Config(String),
    #[error("no safetensors weights found in {0}")]
    NoWeights(PathBuf),
    #[error("cannot load {path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("tensor {name} appears in both {first} and {second}")]
    DuplicateTensor {
        name: String,
        first: String,
        second: String,
    },
    #[error("the checkpoint lacks tensor(s) the model needs: {}", .0.join(", "))]
    MissingTensors(Vec<String>),
    #[error("the checkpoint has {} tensor(s) the model does not use: {}", .0.len(), .0.join(", "))]
    UnusedTensors(Vec<String>),
    #[error("tensor {name} has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        found: Vec<i32>,
        expected: Vec<i32>,
    },
    #[error("tensor {name} has dtype {found:?}; supported: float32, float16, bfloat16, and quantized uint32 with uint8 mxfp4 scales")]
    Dtype { name: String, found: Dtype },
    #[error("{name} is quantized but config.json has no `quantization` entry for it")]
    Quantization { name: String },
    #[error("unsupported architecture {0:?}; supported: {1}")]
    Architecture(String, String),
    #[error("MLX failed while loading weights: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    /// The device's facts could not be read, or a test's stand-in for them is malformed.
    #[error("{0}")]
    Device(String),
    /// The device has no room for a KV cache beside the loaded weights
    /// ([`crate::cache::kv_budget_within`]); the supervisor treats it as any out-of-memory exit.
    #[error("out of memory: {0}")]
    Memory(String),
    /// The loaded model failed its warm-up generations (`crate::runtime::warm_up`).
    #[error("the warm-up pass before serving failed: {0}")]
    WarmUp(String),
}

/// Quantization of one layer, as `mlx.nn.quantize` records it in config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

/// The tensors of a checkpoint, handed out by name exactly once.
pub struct Weights {
    tensors: HashMap<String, Array>,
    missing: Vec<String>,
    quant_default: Option<QuantSpec>,
    quant_overrides: HashMap<String, Option<QuantSpec>>,
    taken_bytes: usize,
    /// Told how many weight bytes have been read while the model materializes them.
    reporter: Option<LoadReporter>,
    /// The tensor-parallel group this rank loads for (`crate::distributed`), and the plan
    /// the family's `shard` function gave for dividing its tensors: each tensor taken is
    /// this rank's part only.
    group: Option<Group>,
    plan: Option<ShardPlan>,
    /// Tensors the plan could not divide (reported by [`Weights::finish`]).
    unsplittable: Vec<String>,
    /// The checkpoint's files, and where in them each tensor lies (read from their headers
    /// when the first tensor is taken under a plan): a divided tensor's part is read from its
    /// file (`distributed::shard_read`) instead of MLX reading it whole.
    files: Vec<PathBuf>,
    on_disk: Option<HashMap<String, TensorOnDisk>>,
    /// Tensors a sanitize step made ([`Self::insert`]): their bytes were counted as read when
    /// their sources were removed.
    made: HashSet<String>,
    /// Checkpoint bytes this load reads: the tensors MLX reads whole, plus the parts read from
    /// the files.
    read_bytes: u64,
}

/// Reads `config.json` from a model directory.
pub fn read_config(dir: &Path) -> Result<Value, LoadError> {
    read_json(&dir.join("config.json"))
}

pub fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json {
        path: path.into(),
        source,
    })
}

pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let value = read_json(&index)?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                LoadError::Config(format!("{} has no weight_map object", index.display()))
            })?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(Value::as_str)
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let entries = fs::read_dir(dir).map_err(|source| LoadError::Io {
        path: dir.into(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadError::NoWeights(dir.into()));
    }
    Ok(files)
}

/// One layer's quantization entry (`{"group_size", "bits", "mode"}`); `Ok(None)` when the
/// entry has no group size or bits. An unknown mode is an error: a wrong guess would load
/// garbage.
fn parse_spec(v: &Value) -> Result<Option<QuantSpec>, LoadError> {
    let mode = match v.get("mode").and_then(Value::as_str) {
        None => QuantMode::Affine,
        Some(name) => QuantMode::parse(name).map_err(LoadError::Config)?,
    };
    let (Some(group_size), Some(bits)) = (
        v.get("group_size").and_then(Value::as_i64),
        v.get("bits").and_then(Value::as_i64),
    ) else {
        return Ok(None);
    };
    Ok(Some(QuantSpec {
        group_size: group_size as i32,
        bits: bits as i32,
        mode,
    }))
}

impl Weights {
    /// Opens every safetensors file of the directory; `config` supplies the quantization.
    pub fn open(dir: &Path, config: &Value) -> Result<Self, LoadError> {
        let mut tensors = HashMap::new();
        let mut source_of: HashMap<String, String> = HashMap::new();
        let files = weight_files(dir)?;
        for file in &files {
            let loaded = Array::load_safetensors(file).map_err(|e| LoadError::Safetensors {
                path: file.clone(),
                message: e.to_string(),
            })?;
            let file_name = file
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            for (name, array) in loaded {
                if let Some(first) = source_of.get(&name) {
                    return Err(LoadError::DuplicateTensor {
                        name,
                        first: first.clone(),
                        second: file_name,
                    });
                }
                match array.dtype() {
                    // uint8: the shared exponents of `mxfp4` groups (their scales).
                    Dtype::Float32
                    | Dtype::Float16
                    | Dtype::Bfloat16
                    | Dtype::Uint32
                    | Dtype::Uint8 => {}
                    found => return Err(LoadError::Dtype { name, found }),
                }
                source_of.insert(name.clone(), file_name.clone());
                tensors.insert(name, array);
            }
        }
        let quant = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"));
        let quant_default = quant.map(parse_spec).transpose()?.flatten();
        let mut quant_overrides = HashMap::new();
        if let Some(Value::Object(map)) = quant {
            for (key, value) in map {
                match value {
                    Value::Object(_) => {
                        quant_overrides.insert(key.clone(), parse_spec(value)?);
                    }
                    Value::Bool(false) => {
                        quant_overrides.insert(key.clone(), None);
                    }
                    _ => {}
                }
            }
        }
        Ok(Self {
            tensors,
            missing: Vec::new(),
            quant_default,
            quant_overrides,
            taken_bytes: 0,
            reporter: None,
            group: None,
            plan: None,
            unsplittable: Vec::new(),
            files,
            on_disk: None,
            made: HashSet::new(),
            read_bytes: 0,
        })
    }

    /// Reports the weights read ([`LoadPhase::Weights`]) to `reporter` while the model
    /// materializes them.
    pub fn with_reporter(mut self, reporter: Option<LoadReporter>) -> Self {
        self.reporter = reporter;
        self
    }

    /// Loads this rank's part of the model for `group` (none: the whole model).
    pub fn with_group(mut self, group: Option<Group>) -> Self {
        self.group = group;
        self
    }

    /// The tensor-parallel group this load is for, if any.
    pub fn group(&self) -> Option<&Group> {
        self.group.as_ref()
    }

    /// Divides the tensors taken from now on as `plan` says (a family's `shard` function).
    pub fn shard_by(&mut self, plan: ShardPlan) {
        self.plan = Some(plan);
    }

    /// This rank's part of the tensor `name` (all of it outside a group). A checkpoint
    /// tensor the plan divides is read from its file, only this rank's part; the lazily
    /// loaded whole is dropped unread. A tensor a sanitize step made is cut in memory.
    fn part(&mut self, name: &str, a: Array) -> Result<Array, LoadError> {
        let Some(plan) = &self.plan else {
            self.count_whole(name, &a);
            return Ok(a);
        };
        let piece = plan.piece(name, a.shape())?;
        let on_disk = match &mut self.on_disk {
            Some(on_disk) => on_disk,
            None => {
                let mut on_disk = shard_read::index(&self.files)?;
                on_disk.retain(|name, _| !self.made.contains(name));
                self.on_disk.insert(on_disk)
            }
        };
        match (piece, on_disk.remove(name)) {
            (Piece::Range { .. } | Piece::Zeros, Some(on_disk)) if on_disk.describes(&a) => {
                let (part, bytes) = on_disk.read(piece)?;
                self.read_bytes += bytes;
                Ok(part)
            }
            (piece, _) => {
                let part = plan.cut(name, a.clone())?;
                if piece != Piece::Zeros {
                    self.count_whole(name, &a);
                }
                Ok(part)
            }
        }
    }

    /// Counts a checkpoint tensor that MLX reads whole when it is evaluated.
    fn count_whole(&mut self, name: &str, a: &Array) {
        if !self.made.contains(name) {
            self.read_bytes += a.nbytes() as u64;
        }
    }

    /// The checkpoint bytes this load reads (so far): every tensor taken whole, the parts of
    /// divided ones, and the sources of what sanitize steps made.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes
    }

    /// The reporter the model's materialization reports to.
    pub fn reporter(&self) -> Option<&LoadReporter> {
        self.reporter.as_ref()
    }

    /// How the layer at `prefix` is quantized, if its checkpoint tensors are quantized.
    pub fn quantization_for(&mut self, prefix: &str) -> Option<QuantSpec> {
        if !self.tensors.contains_key(&format!("{prefix}.scales")) {
            return None;
        }
        let spec = match self.quant_overrides.get(prefix) {
            Some(spec) => *spec,
            None => self.quant_default,
        };
        if spec.is_none() {
            self.missing
                .push(format!("quantization settings for {prefix} (config.json)"));
        }
        spec.or(Some(QuantSpec {
            group_size: 64,
            bits: 4,
            mode: QuantMode::Affine,
        }))
    }

    /// The names of the tensors not taken yet (for a family's `sanitize` step).
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// Whether the checkpoint holds `name` (not taken yet).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The dtype of the checkpoint's tensor `name` (not taken yet), read from its header.
    pub fn dtype_of(&self, name: &str) -> Option<Dtype> {
        self.tensors.get(name).map(Array::dtype)
    }

    /// Removes a tensor to transform it (a `sanitize` step, such as stacking per-expert
    /// matrices); what is made of it goes back with [`Self::insert`]. Not counted as loaded.
    pub fn remove_raw(&mut self, name: &str) -> Option<Array> {
        let a = self.tensors.remove(name)?;
        if let Some(on_disk) = &mut self.on_disk {
            on_disk.remove(name);
        }
        self.count_whole(name, &a);
        Some(a)
    }

    /// Adds a tensor that a `sanitize` step made, under the name the model takes it by.
    pub fn insert(&mut self, name: String, array: Array) {
        if let Some(on_disk) = &mut self.on_disk {
            on_disk.remove(&name);
        }
        self.made.insert(name.clone());
        self.tensors.insert(name, array);
    }

    /// Takes a required tensor. A missing one is recorded and reported by [`Weights::finish`],
    /// so one load reports every missing name at once.
    pub fn take(&mut self, name: &str) -> Result<Array, LoadError> {
        match self.tensors.remove(name) {
            Some(a) => {
                let a = self.part(name, a)?;
                self.taken_bytes += a.nbytes();
                Ok(a)
            }
            None => {
                self.missing.push(name.to_owned());
                Ok(Array::from_f32(0.0))
            }
        }
    }

    /// Takes a tensor the checkpoint may or may not have.
    pub fn take_optional(&mut self, name: &str) -> Option<Array> {
        let a = self.tensors.remove(name)?;
        let a = match self.part(name, a) {
            Ok(a) => a,
            Err(e) => {
                self.unsplittable.push(e.to_string());
                return None;
            }
        };
        self.taken_bytes += a.nbytes();
        Some(a)
    }

    /// The text half of a multimodal checkpoint as mlx-lm's `sanitize` (Qwen3.5, Mistral 3)
    /// leaves it: the tensors `drop` names go (a vision tower, a projector), and every other is
    /// named `language_model.…` whichever Hugging Face layout it came in
    /// (`model.language_model.x` → `language_model.model.x`, a bare `x` → `language_model.x`).
    pub fn nest_language_model(&mut self, drop: impl Fn(&str) -> bool) {
        for name in self.names() {
            if drop(&name) {
                self.discard(&name);
                continue;
            }
            let renamed = if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("language_model.model.{rest}")
            } else if name.starts_with("language_model.") {
                continue;
            } else {
                format!("language_model.{name}")
            };
            if let Some(a) = self.remove_raw(&name) {
                self.insert(renamed, a);
            }
        }
    }

    /// Drops a tensor that is known to be redundant (for example a tied `lm_head.weight`).
    pub fn discard(&mut self, name: &str) {
        self.tensors.remove(name);
    }

    /// Checks that every parameter was found and every tensor used; returns the bytes loaded.
    pub fn finish(self) -> Result<usize, LoadError> {
        if !self.unsplittable.is_empty() {
            return Err(LoadError::Config(self.unsplittable.join("; ")));
        }
        if let (Some(group), None) = (&self.group, &self.plan) {
            return Err(LoadError::Config(format!(
                "this architecture's file did not divide its weights among the group's {} ranks",
                group.size()
            )));
        }
        if !self.missing.is_empty() {
            return Err(LoadError::MissingTensors(self.missing));
        }
        if !self.tensors.is_empty() {
            let unused: BTreeMap<_, _> = self.tensors.keys().map(|k| (k.clone(), ())).collect();
            return Err(LoadError::UnusedTensors(unused.into_keys().collect()));
        }
        tracing::info!(
            read_bytes = self.read_bytes,
            held_bytes = self.taken_bytes,
            "checkpoint read"
        );
        Ok(self.taken_bytes)
    }
}

/// Checks a tensor's shape against what the config implies.
pub fn expect_shape(name: &str, a: &Array, expected: &[i32]) -> Result<(), LoadError> {
    if a.shape() != expected {
        return Err(LoadError::Shape {
            name: name.into(),
            found: a.shape().to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

/// Evaluates `params` (reading them from disk now) in steps of about a twentieth of their
/// bytes, telling `reporter` the fraction read after each; returns the bytes held. One step
/// per tensor would be as exact but costs a graph evaluation per tensor.
pub fn materialize(params: &[&Array], reporter: Option<&LoadReporter>) -> Result<usize, LoadError> {
    let total: usize = params.iter().map(|a| a.nbytes()).sum();
    let Some(report) = reporter else {
        mlx_rs::transforms::eval(params.iter().copied())?;
        return Ok(total);
    };
    report(LoadPhase::Weights, 0.0);
    let step = (total / 20).max(1);
    let (mut done, mut pending, mut start) = (0usize, 0usize, 0usize);
    for (i, a) in params.iter().enumerate() {
        pending += a.nbytes();
        if pending >= step || i + 1 == params.len() {
            mlx_rs::transforms::eval(params[start..=i].iter().copied())?;
            done += pending;
            pending = 0;
            start = i + 1;
            report(LoadPhase::Weights, weights_fraction(done, total));
        }
    }
    Ok(total)
}

/// `done` of `total` bytes as a fraction in `0.0..=1.0` (1 for nothing to read).
pub fn weights_fraction(done: usize, total: usize) -> f32 {
    if total == 0 {
        1.0
    } else {
        (done as f64 / total as f64).clamp(0.0, 1.0) as f32
    }
}
