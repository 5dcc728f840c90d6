//! `lora` jobs: fine-tunes a LoRA adapter as mlx-lm's trainer does (`mlx_lm/tuner/trainer.py`),
//! through the engine's own model code.
//!
//! - the base model is loaded as for serving ([`crate::models::load`]), quantized weights
//!   staying quantized (QLoRA) and frozen; its linear layers are the sites of its
//!   [`AdapterTable`], and the attention and MLP projections of the last `num_layers` layers
//!   (every linear of those layers, mlx-lm's default keys) get factors `lora_a` `[in, r]`
//!   (uniform in ±1/√in) and `lora_b` `[r, out]` (zeros), in float32, and the expert stacks
//!   of a mixture-of-experts layer one pair per expert, `[E, r, in]` and `[E, out, r]`, as
//!   mlx-lm's `LoRASwitchLinear` (DoRA has no form for expert stacks and is refused there); with
//!   `fine_tune_type` `dora`, also DoRA's magnitude `m` `[out]` (the base weight's row norms,
//!   read from the checkpoint files), trained with them ([`crate::adapters::dora`]);
//! - a step is mlx-lm's `default_loss` (masked cross-entropy over the targets from each
//!   row's offset to its length, summed in float32 and divided by the token count) under
//!   MLX's `value_and_grad` with respect to the factors only, the forward pass reading the
//!   traced factors through [`AdapterTable::select_training`]; then an Adam (or AdamW) update
//!   as MLX's optimizers make it; gradient and update are one function compiled by MLX once
//!   per batch shape, as mlx-lm compiles its step (`step.rs`);
//! - batches as mlx-lm's `iterate_batches` builds them ([`data`]); the order of batches in
//!   each epoch depends on the seed and the epoch only, so a resumed run sees the batches an
//!   uninterrupted one would;
//! - with `grad_checkpoint`, each transformer layer of a step is recomputed in the backward
//!   pass instead of keeping its activations ([`checkpoint`]): the same losses, less memory;
//! - validation before iteration 1, every `steps_per_eval` and before the last iteration, as
//!   mlx-lm's loop does it (reported after the updates done so far);
//! - a checkpoint (factors, Adam's moments, iteration, tokens) every `save_every` iterations,
//!   written beside the output and kept after a cancel or crash; `resume` continues from it;
//! - MLX's memory is read after the load, each validation and each step ([`memory`]): the
//!   progress carries the run's peak, the log each reading (the first ones at info);
//! - MLX's memory limit is set just above the largest first-step peak of the run's batch
//!   widths, so that the host cannot queue work far ahead of the GPU and keep its dead
//!   buffers alive ([`memory_bound`]; `MLXD_TRAIN_MEMORY_LIMIT=off` leaves it);
//! - the output is mlx-lm's adapter directory: `adapters.safetensors` (keys
//!   `<layer>.lora_a` / `.lora_b`, and `.m` for DoRA) and `adapter_config.json`.
mod cross_entropy;
pub mod data;
mod memory;
pub mod memory_bound;
mod step;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use mlx_rs::{Array, Dtype};
use mlxd_protocol::jobs::{JobProgress, Optimizer, TrainParams, TrainingProgress};
use serde_json::{json, Value};

use super::fuse::BaseWeights;
use super::{io, JobError};
use crate::adapters::{dora, layer_of, AdapterTable, SiteInfo};
use crate::cache::LayerKind;
use crate::models::CausalLm;
use crate::tokenizer::Tokenizer;
use memory::MemoryProbe;
pub use memory_bound::MemoryBound;
use memory_bound::MemoryBounder;
pub use step::StepMode;
use step::{factors_by_site, loss, BatchArrays, Step, StepInputs, StepOutputs, StepSpec};

/// The checkpoint file in a run's checkpoint directory.
pub const CHECKPOINT: &str = "checkpoint.safetensors";
/// The run's settings beside its checkpoint; a resumed run must match them.
pub const RUN_FILE: &str = "run.json";

/// What a training run is asked to do.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub source: PathBuf,
    pub data: PathBuf,
    pub params: TrainParams,
    pub checkpoints: PathBuf,
    pub resume: bool,
    pub init_adapter: Option<PathBuf>,
    /// The directory the adapter is written into (created).
    pub out: PathBuf,
}

/// What a finished run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSummary {
    /// Per iteration (1-based index - 1), that iteration's training loss, from the first
    /// iteration this process ran.
    pub train_losses: Vec<(u64, f64)>,
    /// Validation losses with the number of updates done before them.
    pub val_losses: Vec<(u64, f64)>,
    pub trained_tokens: u64,
    /// Bytes of `adapters.safetensors`.
    pub bytes: u64,
    /// How many times the training step was traced: compiled, once per batch shape the run
    /// saw; uncompiled, once per iteration.
    pub step_traces: u64,
}

fn mlx(e: impl std::fmt::Display) -> JobError {
    JobError::Mlx(e.to_string())
}

/// The sites mlx-lm's `linear_to_lora_layers` adapts: every linear of `model.layers[-n:]`
/// (all layers when `n` is 0 or less, or more than the model has).
fn chosen_sites(sites: Vec<SiteInfo>, num_layers: i32, layers: usize) -> Vec<SiteInfo> {
    let first = if num_layers <= 0 || num_layers as usize >= layers {
        0
    } else {
        layers - num_layers as usize
    };
    sites
        .into_iter()
        .filter(|s| layer_of(&s.prefix).is_some_and(|l| l >= first && l < layers))
        .collect()
}

/// The trained arrays: per chosen site, `lora_a`, `lora_b` and, for DoRA, `m`.
struct Lora {
    sites: Vec<SiteInfo>,
    /// Whether each site has DoRA's `m` (3 arrays per site, else 2).
    dora: bool,
    params: Vec<Array>,
    m: Vec<Array>,
    v: Vec<Array>,
}

impl Lora {
    /// The arrays per site.
    fn per_site(&self) -> usize {
        if self.dora {
            3
        } else {
            2
        }
    }

    fn names(&self) -> Vec<String> {
        let parts: &[&str] = if self.dora {
            &["lora_a", "lora_b", "m"]
        } else {
            &["lora_a", "lora_b"]
        };
        self.sites
            .iter()
            .flat_map(|s| parts.iter().map(move |p| format!("{}.{p}", s.prefix)))
            .collect()
    }

    /// Fresh factors; `magnitudes` (one per site) makes a DoRA adapter.
    fn fresh(
        sites: Vec<SiteInfo>,
        rank: i32,
        seed: u64,
        magnitudes: Option<Vec<Array>>,
    ) -> Result<Self, JobError> {
        let dora = magnitudes.is_some();
        let mut magnitudes = magnitudes.unwrap_or_default().into_iter();
        let mut params = Vec::with_capacity(sites.len() * 3);
        let key = mlx_rs::random::key(seed).map_err(mlx)?;
        let mut key = key;
        for s in &sites {
            let (k, next) = mlx_rs::random::split(&key, 2).map_err(mlx)?;
            key = next;
            let bound = 1.0 / (s.in_dims as f32).sqrt();
            // mlx-lm's layouts: `LoRALinear` `[in, r]`/`[r, out]`, `LoRASwitchLinear`
            // `[E, r, in]`/`[E, out, r]`.
            let (a_shape, b_shape) = match s.experts {
                Some(e) => (vec![e, rank, s.in_dims], vec![e, s.out_dims, rank]),
                None => (vec![s.in_dims, rank], vec![rank, s.out_dims]),
            };
            params
                .push(mlx_rs::random::uniform::<_, f32>(-bound, bound, &a_shape, &k).map_err(mlx)?);
            params.push(mlx_rs::ops::zeros::<f32>(&b_shape).map_err(mlx)?);
            if dora {
                let m = magnitudes
                    .next()
                    .ok_or_else(|| JobError::Mlx(format!("no DoRA magnitude for {}", s.prefix)))?;
                params.push(m);
            }
        }
        let m = zeros_like(&params)?;
        let v = zeros_like(&params)?;
        Ok(Self {
            sites,
            dora,
            params,
            m,
            v,
        })
    }

    /// Replaces the factors by those of an mlx-lm adapter file: every chosen site's pair must
    /// be there with this rank's shapes. A DoRA site's `m` is taken when the file has it and
    /// kept (the base weight's norms) when not, as mlx-lm's `--resume-adapter-file` loads
    /// the file over the fresh layers (`load_weights(..., strict=False)`).
    fn load_factors(&mut self, path: &Path) -> Result<(), JobError> {
        let tensors = Array::load_safetensors(path)
            .map_err(|e| JobError::Input(format!("{}: {e}", path.display())))?;
        self.take_from(&tensors, "", path, true)
    }

    fn take_from(
        &mut self,
        tensors: &HashMap<String, Array>,
        prefix: &str,
        path: &Path,
        magnitude_optional: bool,
    ) -> Result<(), JobError> {
        for (i, name) in self.names().into_iter().enumerate() {
            let key = format!("{prefix}{name}");
            if magnitude_optional && name.ends_with(".m") && !tensors.contains_key(&key) {
                continue;
            }
            let t = tensors.get(&key).ok_or_else(|| {
                JobError::Input(format!(
                    "{}: no tensor {prefix}{name} (the adapted layers and rank must match)",
                    path.display()
                ))
            })?;
            if t.shape() != self.params[i].shape() {
                return Err(JobError::Input(format!(
                    "{}: {prefix}{name} has shape {:?}, expected {:?}",
                    path.display(),
                    t.shape(),
                    self.params[i].shape()
                )));
            }
            self.params[i] = t.as_dtype(Dtype::Float32).map_err(mlx)?;
        }
        Ok(())
    }

    fn adapter_map(&self) -> Vec<(String, &Array)> {
        self.names().into_iter().zip(self.params.iter()).collect()
    }
}

fn zeros_like(arrays: &[Array]) -> Result<Vec<Array>, JobError> {
    arrays
        .iter()
        .map(|a| mlx_rs::ops::zeros_like(a).map_err(mlx))
        .collect()
}

/// DoRA's starting magnitudes of `sites`: the row norms of their base weights, read from the
/// model's files (the loaded model keeps its weights inside its layers).
fn base_magnitudes(source: &Path, sites: &[SiteInfo]) -> Result<Vec<Array>, JobError> {
    let base = BaseWeights::open(source)?;
    sites
        .iter()
        .map(|s| {
            let m = dora::initial_magnitude(&base.dense(&s.prefix)?).map_err(mlx)?;
            m.eval().map_err(mlx)?;
            Ok(m)
        })
        .collect()
}

/// Where the training stands, as a checkpoint keeps it.
struct Position {
    iteration: u64,
    trained_tokens: u64,
}

/// The attention scores up to which a training process attends unfused on CUDA
/// ([`crate::models::layers::set_unfused_max_scores`]): none, so that every pass of more than
/// a decode's queries goes to MLX's fused kernel, as mlx-lm's attention does.
///
/// **Decision: a training process sends its passes to the fused kernel.** The serving default
/// attends unfused up to 2^26 scores to spare cuDNN a plan per new shape, and a training batch
/// (4 rows × 32 heads × 511² at Llama 3.2 1B, batch 4 × 512) is under it. Unfused, each
/// layer's softmax `[B, heads, L, T]` (67 MB in bf16 there) is kept for the backward pass,
/// and the scores' gradients are made from it, for every adapted layer: with the unfused
/// cross-entropy, that put mlxd's peak at 12.27 GB against mlx-lm's 9.67 GB on an H100
/// (`scripts/bench/lora_train.py`). The fused kernel keeps its log-sum-exp per query only; a
/// run meets a few batch widths (one plan each, built once), not a server's stream of shapes.
pub const TRAINING_UNFUSED_MAX_SCORES: u64 = 0;

/// Sets what a training job's process attends with ([`TRAINING_UNFUSED_MAX_SCORES`]), and
/// that its model computes each projection on its own (`crate::models::stacked`: the gradient
/// of a stacked product's split is a zero-filled array per part); called by the job's process
/// before it loads the model, never inside an engine (process-wide settings).
pub fn configure_process() {
    crate::models::layers::set_unfused_max_scores(TRAINING_UNFUSED_MAX_SCORES);
    crate::models::stacked::set_enabled(false);
}

/// Called after each event of the run; an error stops it (the job's channel is gone, or a
/// test's stop).
pub type Report<'a> = dyn FnMut(JobProgress) -> Result<(), JobError> + 'a;

/// Runs the training to its end and writes the adapter into `config.out`, its steps compiled
/// unless `MLXD_TRAIN_COMPILE=0` ([`StepMode::from_env`]), MLX's memory limit bounded unless
/// `MLXD_TRAIN_MEMORY_LIMIT=off` ([`MemoryBound::from_env`]). The limit is the process's: this
/// is a job process's entry.
pub fn train(config: &TrainConfig, report: &mut Report<'_>) -> Result<TrainSummary, JobError> {
    train_with(
        config,
        StepMode::from_env()?,
        MemoryBound::from_env()?,
        report,
    )
}

/// [`train`] with its steps run as `mode` says and MLX's memory limit as `bound` says (`Off`
/// where the process is shared, as a test binary's is).
pub fn train_with(
    config: &TrainConfig,
    mode: StepMode,
    bound: MemoryBound,
    report: &mut Report<'_>,
) -> Result<TrainSummary, JobError> {
    let p = &config.params;
    p.check().map_err(JobError::Input)?;
    let tokenizer = Tokenizer::from_dir(&config.source)
        .map_err(|e| JobError::Input(format!("{}: {e}", config.source.display())))?;
    // The data first: a bad line fails the job before anything is loaded or written.
    let set = data::load(&config.data, &tokenizer, p.mask_prompt)?;
    let batch_size = p.batch_size as usize;
    for (name, split) in [("train", &set.train), ("valid", &set.valid)] {
        if split.len() < batch_size {
            return Err(JobError::Input(format!(
                "{name}.jsonl has {} examples; batch_size {batch_size} needs at least that many",
                split.len()
            )));
        }
    }
    let mut bounder = MemoryBounder::new(bound)?;
    let mut memory = MemoryProbe::new();
    let model: Rc<dyn CausalLm> = crate::models::load(&config.source)
        .map_err(|e| JobError::Input(format!("loading {}: {e}", config.source.display())))?
        .into();
    memory.log("model loaded", 0, None, true)?;
    if let Some(kind) = model
        .layer_kinds()
        .into_iter()
        .find(|k| !matches!(k, LayerKind::Attention { .. }))
    {
        return Err(JobError::Input(format!(
            "{}: a model with recurrent layers ({kind:?}) cannot be trained by mlxd yet; \
             only attention models",
            model.info().architecture
        )));
    }
    let table = model
        .adapters()
        .cloned()
        .ok_or_else(|| JobError::Input("this model holds no adapter table".into()))?;
    let sites = chosen_sites(table.sites(), p.num_layers, model.info().num_layers);
    if sites.is_empty() {
        return Err(JobError::Input(format!(
            "{}: no linear layer under model.layers to adapt",
            model.info().architecture
        )));
    }
    let magnitudes = match p.fine_tune_type.as_str() {
        "dora" => {
            if let Some(s) = sites.iter().find(|s| s.experts.is_some()) {
                return Err(JobError::Input(format!(
                    "{}: DoRA has no form for expert stacks ({} is one; mlx-lm refuses it too: \
                     \"SwitchLinear doesn't support DoRA\"); train a LoRA adapter for this model",
                    model.info().architecture,
                    s.prefix
                )));
            }
            Some(base_magnitudes(&config.source, &sites)?)
        }
        _ => None,
    };
    let mut lora = Lora::fresh(sites, p.rank as i32, p.seed, magnitudes)?;
    if let Some(init) = &config.init_adapter {
        lora.load_factors(init)?;
    }
    let mut at = Position {
        iteration: 0,
        trained_tokens: 0,
    };
    std::fs::create_dir_all(&config.checkpoints).map_err(io(&config.checkpoints))?;
    let run_file = config.checkpoints.join(RUN_FILE);
    let run = json!({"source": config.source, "data": config.data, "params": p,
        "init_adapter": config.init_adapter});
    if config.resume {
        let saved: Value = std::fs::read(&run_file)
            .ok()
            .and_then(|t| serde_json::from_slice(&t).ok())
            .ok_or_else(|| {
                JobError::Input(format!(
                    "resume: no checkpoint of an earlier run in {}",
                    config.checkpoints.display()
                ))
            })?;
        if saved != run {
            return Err(JobError::Input(format!(
                "resume: the checkpoint in {} is of a run with other settings ({saved}); \
                 resume with the same model, data and parameters",
                config.checkpoints.display()
            )));
        }
        let path = config.checkpoints.join(CHECKPOINT);
        if path.exists() {
            at = load_checkpoint(&path, &mut lora)?;
        }
    } else {
        let text = serde_json::to_vec_pretty(&run).expect("JSON values serialize");
        std::fs::write(&run_file, text).map_err(io(&run_file))?;
    }
    tracing::info!(
        layers = lora.sites.len(),
        params = lora.params.iter().map(|a| a.size()).sum::<usize>(),
        from = at.iteration,
        "training"
    );

    let train_batches = data::batch_indices(&set.train, batch_size);
    let valid_batches = data::batch_indices(&set.valid, batch_size);
    let max_len = p.max_seq_length as usize;
    let mut summary = TrainSummary {
        train_losses: Vec::new(),
        val_losses: Vec::new(),
        trained_tokens: 0,
        bytes: 0,
        step_traces: 0,
    };
    let mut figures = TrainingProgress {
        iteration: at.iteration,
        iters: p.iters,
        train_loss: None,
        val_loss: None,
        val_iteration: None,
        tokens_per_second: 0.0,
        trained_tokens: at.trained_tokens,
        peak_memory_bytes: 0,
        checkpoint: (at.iteration > 0).then_some(at.iteration),
    };
    let progress = |figures: &TrainingProgress, phase: &str| JobProgress {
        phase: phase.into(),
        done: figures.iteration,
        total: figures.iters,
        unit: "iterations".into(),
        detail: None,
        training: Some(figures.clone()),
    };
    report(progress(&figures, "training"))?;
    let stall = super::stall_after();
    // Built once and kept: MLX keys its compiled graphs by this function (one per batch
    // shape). Declared after the model's last use below and dropped before it.
    let mut step = Step::new(
        model.clone(),
        table.clone(),
        StepSpec {
            sites: lora.sites.clone(),
            per_site: lora.per_site(),
            scale: p.scale,
            dropout: (p.dropout > 0.0).then_some(p.dropout),
            grad_checkpoint: p.grad_checkpoint,
            adamw: p.optimizer == Optimizer::Adamw,
        },
        mode,
    );
    let first_iteration = at.iteration;
    for it in at.iteration + 1..=p.iters {
        if it == 1 || it % p.steps_per_eval == 0 || it == p.iters {
            let val = evaluate(model.as_ref(), &table, &lora, &set.valid, &valid_batches, p)?;
            summary.val_losses.push((it - 1, val));
            figures.val_loss = Some(val);
            figures.val_iteration = Some(it - 1);
            report(progress(&figures, "validating"))?;
            memory.log("validated", it, None, true)?;
        }
        let started = Instant::now();
        let b = nth_batch(&train_batches, p.seed, it - 1);
        let examples: Vec<&data::Example> = b.iter().map(|&i| &set.train[i]).collect();
        let batch = BatchArrays::from(&data::batch(&examples, max_len));
        let width = batch.tokens.shape()[1];
        bounder.before_step(width)?;
        // The step's dropout key, a function of (seed, iteration) so that a resumed run
        // draws the masks an uninterrupted one does.
        let key = (p.dropout > 0.0)
            .then(|| mlx_rs::random::key(p.seed.wrapping_mul(1_000_003).wrapping_add(it)))
            .transpose()
            .map_err(mlx)?;
        // mlx-lm: the schedule replaces the constant rate; MLX evaluates it at the update's
        // step (0 for the first).
        let rate = match &p.lr_schedule {
            Some(schedule) => schedule.rate(it - 1) as f32,
            None => p.learning_rate,
        };
        let StepOutputs {
            loss,
            tokens,
            params,
            m,
            v,
        } = step
            .run(StepInputs {
                params: &lora.params,
                m: &lora.m,
                v: &lora.v,
                lr: Array::from_f32(rate),
                batch: &batch,
                key,
            })
            .map_err(mlx)?;
        // The old arrays are dropped before the evaluation, so that MLX may reuse their
        // buffers for the new ones.
        (lora.params, lora.m, lora.v) = (params, m, v);
        let mut to_eval: Vec<&Array> = vec![&loss, &tokens];
        to_eval.extend(lora.params.iter().chain(&lora.m).chain(&lora.v));
        mlx_rs::transforms::eval(to_eval).map_err(mlx)?;
        // Every step is read (the run's peak is the readings' largest); the first ones at
        // info, to place a run's peak without a debug log.
        let reading = memory.log("trained", it, Some(width), it <= first_iteration + 2)?;
        bounder.after_step(it, width, reading.peak)?;
        let train_loss = loss.item_exact::<f32>() as f64;
        let tokens = tokens.item_exact::<i32>() as u64;
        let seconds = started.elapsed().as_secs_f64();
        at.iteration = it;
        at.trained_tokens += tokens;
        summary.train_losses.push((it - 1, train_loss));
        summary.trained_tokens += tokens;
        if it % p.save_every == 0 && it < p.iters {
            save_checkpoint(&config.checkpoints, &lora, &at)?;
            figures.checkpoint = Some(it);
        }
        figures.iteration = it;
        figures.train_loss = Some(train_loss);
        figures.tokens_per_second = if seconds > 0.0 {
            tokens as f64 / seconds
        } else {
            0.0
        };
        figures.trained_tokens = at.trained_tokens;
        figures.peak_memory_bytes = memory.run_peak() as u64;
        report(progress(&figures, "training"))?;
        // The test switch stalls a fresh run only, so that its resumed run can finish.
        if stall == Some(it) && !config.resume {
            tracing::warn!("MLXD_JOB_FAULT: stalling until killed");
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }
    std::fs::create_dir_all(&config.out).map_err(io(&config.out))?;
    summary.step_traces = step.traces();
    summary.bytes = save_adapter(&config.out, &lora, config)?;
    report(progress(&figures, "writing"))?;
    Ok(summary)
}

/// The batch of (0-based) iteration `i`: the batches in an order per epoch.
fn nth_batch(batches: &[Vec<usize>], seed: u64, i: u64) -> &[usize] {
    let n = batches.len() as u64;
    let order = data::epoch_order(batches.len(), seed, i / n);
    &batches[order[(i % n) as usize]]
}

/// mlx-lm's `evaluate`: the token-weighted mean loss over the first `val_batches` batches
/// (all with -1), in the sorted order (validation is not shuffled here: the mean over the
/// same batches does not depend on their order).
fn evaluate(
    model: &dyn CausalLm,
    table: &AdapterTable,
    lora: &Lora,
    examples: &[data::Example],
    batches: &[Vec<usize>],
    p: &TrainParams,
) -> Result<f64, JobError> {
    let take = if p.val_batches < 0 {
        batches.len()
    } else {
        (p.val_batches as usize).min(batches.len())
    };
    let (mut sum, mut tokens) = (0.0f64, 0u64);
    for b in &batches[..take] {
        let rows: Vec<&data::Example> = b.iter().map(|&i| &examples[i]).collect();
        let batch = BatchArrays::from(&data::batch(&rows, p.max_seq_length as usize));
        let _selected = table.select_training(
            factors_by_site(table, &lora.sites, &lora.params, lora.per_site()),
            p.scale,
            None,
        );
        let out = loss(model, &batch).map_err(mlx)?;
        mlx_rs::transforms::eval(out.iter()).map_err(mlx)?;
        let n = out[1].item_exact::<i32>() as u64;
        sum += out[0].item_exact::<f32>() as f64 * n as f64;
        tokens += n;
    }
    Ok(if tokens == 0 {
        0.0
    } else {
        sum / tokens as f64
    })
}

fn save_checkpoint(dir: &Path, lora: &Lora, at: &Position) -> Result<(), JobError> {
    let names = lora.names();
    let mut tensors: Vec<(String, &Array)> = Vec::with_capacity(names.len() * 3);
    for (i, name) in names.iter().enumerate() {
        tensors.push((format!("adapter.{name}"), &lora.params[i]));
        tensors.push((format!("adam_m.{name}"), &lora.m[i]));
        tensors.push((format!("adam_v.{name}"), &lora.v[i]));
    }
    let metadata: HashMap<String, String> = [
        ("iteration".to_string(), at.iteration.to_string()),
        ("trained_tokens".to_string(), at.trained_tokens.to_string()),
    ]
    .into();
    let tmp = dir.join("checkpoint.partial.safetensors");
    Array::save_safetensors(tensors.iter().map(|(k, v)| (k, *v)), Some(&metadata), &tmp)
        .map_err(|e| JobError::Mlx(format!("writing {}: {e}", tmp.display())))?;
    let path = dir.join(CHECKPOINT);
    std::fs::rename(&tmp, &path).map_err(io(&path))
}

fn load_checkpoint(path: &Path, lora: &mut Lora) -> Result<Position, JobError> {
    let (tensors, metadata) = Array::load_safetensors_with_metadata(path)
        .map_err(|e| JobError::Input(format!("{}: {e}", path.display())))?;
    let number = |key: &str| {
        metadata
            .get(key)
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| JobError::Input(format!("{}: no {key} in its metadata", path.display())))
    };
    let at = Position {
        iteration: number("iteration")?,
        trained_tokens: number("trained_tokens")?,
    };
    lora.take_from(&tensors, "adapter.", path, false)?;
    let names = lora.names();
    for (i, name) in names.iter().enumerate() {
        for (prefix, slot) in [("adam_m.", &mut lora.m[i]), ("adam_v.", &mut lora.v[i])] {
            *slot = tensors
                .get(&format!("{prefix}{name}"))
                .cloned()
                .ok_or_else(|| JobError::Input(format!("{}: no {prefix}{name}", path.display())))?;
        }
    }
    tracing::info!(iteration = at.iteration, "resuming from the checkpoint");
    Ok(at)
}

/// Writes `adapters.safetensors` and `adapter_config.json` as mlx-lm's trainer does; returns
/// the bytes of the weights.
fn save_adapter(out: &Path, lora: &Lora, config: &TrainConfig) -> Result<u64, JobError> {
    let p = &config.params;
    let weights = out.join("adapters.safetensors");
    let metadata: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    let map = lora.adapter_map();
    Array::save_safetensors(map.iter().map(|(k, v)| (k, *v)), Some(&metadata), &weights)
        .map_err(|e| JobError::Mlx(format!("writing {}: {e}", weights.display())))?;
    let adapter_config = json!({
        "fine_tune_type": p.fine_tune_type,
        "model": config.source,
        "data": config.data,
        "num_layers": p.num_layers,
        "lora_parameters": {"rank": p.rank, "scale": p.scale, "dropout": p.dropout},
        "optimizer": p.optimizer,
        "learning_rate": p.learning_rate,
        "batch_size": p.batch_size,
        "iters": p.iters,
        "val_batches": p.val_batches,
        "steps_per_eval": p.steps_per_eval,
        "save_every": p.save_every,
        "max_seq_length": p.max_seq_length,
        "seed": p.seed,
        "mask_prompt": p.mask_prompt,
        "trained_by": "mlxd",
    });
    let path = out.join("adapter_config.json");
    let text = serde_json::to_vec_pretty(&adapter_config).expect("JSON values serialize");
    std::fs::write(&path, text).map_err(io(&path))?;
    Ok(std::fs::metadata(&weights).map_err(io(&weights))?.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(index: usize, prefix: &str) -> SiteInfo {
        SiteInfo {
            index,
            prefix: prefix.into(),
            in_dims: 4,
            out_dims: 4,
            experts: None,
        }
    }

    /// A training pass longer than a short pass (17 queries) attends fused on CUDA (the
    /// unfused scores, kept for the backward pass, raised the peak above mlx-lm's), where the
    /// serving default would attend unfused at these shapes.
    #[test]
    fn training_passes_attend_fused_where_serving_would_not() {
        use crate::models::layers::{attends_unfused, DEFAULT_UNFUSED_MAX_SCORES};
        let (rows, heads, kv_heads, head_dim) = (4, 32, 8, 64);
        for width in [19, 33, 65, 129, 257, 512] {
            let l = width - 1;
            let q = Array::zeros::<f32>(&[rows, heads, l, head_dim]).unwrap();
            let k = Array::zeros::<f32>(&[rows, kv_heads, l, head_dim]).unwrap();
            assert!(
                !attends_unfused(&q, &k, TRAINING_UNFUSED_MAX_SCORES),
                "width {width}"
            );
            assert!(
                attends_unfused(&q, &k, DEFAULT_UNFUSED_MAX_SCORES),
                "width {width}"
            );
        }
    }

    #[test]
    fn the_last_num_layers_layers_are_adapted() {
        let sites = vec![
            site(0, "model.layers.0.self_attn.q_proj"),
            site(1, "model.layers.1.mlp.up_proj"),
            site(2, "model.layers.2.mlp.down_proj"),
            site(3, "lm_head"),
        ];
        let names = |n| -> Vec<String> {
            chosen_sites(sites.clone(), n, 3)
                .into_iter()
                .map(|s| s.prefix)
                .collect()
        };
        assert_eq!(
            names(2),
            vec!["model.layers.1.mlp.up_proj", "model.layers.2.mlp.down_proj"]
        );
        assert_eq!(names(-1).len(), 3);
        assert_eq!(names(16).len(), 3);
    }
}
