//! A training step as one function of arrays, compiled by MLX once per batch shape, as
//! mlx-lm compiles its `step` (`tuner/trainer.py`: `mx.compile` over the model, the optimizer
//! and the random state).
//!
//! The function takes everything that changes between steps as an input: the trained arrays
//! (LoRA's factors, DoRA's magnitudes), Adam's two moments, the learning rate (an array, so
//! that a schedule does not bake one step's rate into the graph), the batch (tokens, offsets,
//! lengths) and, with dropout, the step's PRNG key (each site's key is derived from it inside
//! the graph). It returns the loss, the token count and the new arrays and moments. The base
//! weights are constants of the graph: they do not change.
//!
//! **Decision: compile the whole step, gradient and update together.** Compiling fuses the
//! elementwise work (Adam's update per array, the activations and their gradients) into fewer
//! kernels and frees intermediates sooner. MLX traces the function again for each new input
//! shape (the batch's width: one plus a multiple of 32 tokens, capped at `max_seq_length`), so
//! a run compiles it at most once per width its batches have; [`Step`] is built once per run
//! and kept, since MLX keys its cache by the compiled function.
//!
//! The same function also runs op by op ([`StepMode::Uncompiled`], `MLXD_TRAIN_COMPILE=0`), so
//! that the two can be compared; a compiled step that fails is an error, never a silent run
//! without compilation.
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::super::JobError;
use super::cross_entropy::cross_entropy;
use crate::adapters::{checkpoint, AdapterTable, SiteInfo, TrainingDropout, TrainingFactors};
use crate::models::CausalLm;

/// MLX's `AdamW` default weight decay.
const WEIGHT_DECAY: f32 = 0.01;

/// Whether a run's steps go through MLX's compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepMode {
    /// One compiled graph per batch shape (the default).
    Compiled,
    /// The same function op by op, traced again every step (for comparison).
    Uncompiled,
}

impl StepMode {
    /// `MLXD_TRAIN_COMPILE`: unset or `1` compiles, `0` does not; anything else is refused
    /// rather than guessed.
    pub fn from_env() -> Result<Self, JobError> {
        match std::env::var("MLXD_TRAIN_COMPILE").as_deref() {
            Err(_) | Ok("1") => Ok(Self::Compiled),
            Ok("0") => Ok(Self::Uncompiled),
            Ok(other) => Err(JobError::Input(format!(
                "MLXD_TRAIN_COMPILE={other:?}: expected 1 (compile the training step, the \
                 default) or 0 (run it op by op)"
            ))),
        }
    }
}

/// A batch as arrays: tokens `[B, T]`, offsets and lengths `[B, 1]`.
pub(super) struct BatchArrays {
    pub tokens: Array,
    pub offsets: Array,
    pub lengths: Array,
}

impl From<&super::data::Batch> for BatchArrays {
    fn from(b: &super::data::Batch) -> Self {
        let rows = b.rows as i32;
        let offsets: Vec<i32> = b.offsets.iter().map(|&o| o as i32).collect();
        let lengths: Vec<i32> = b.lengths.iter().map(|&l| l as i32).collect();
        Self {
            tokens: Array::from_slice(&b.tokens, &[rows, b.width as i32]),
            offsets: Array::from_slice(&offsets, &[rows, 1]),
            lengths: Array::from_slice(&lengths, &[rows, 1]),
        }
    }
}

/// mlx-lm's `default_loss`: the mean cross-entropy ([`cross_entropy`], fused on the GPU as
/// mlx-lm's) over each row's targets from its offset to its length; returns `[loss, tokens]`.
pub(super) fn loss(model: &dyn CausalLm, batch: &BatchArrays) -> Result<Vec<Array>, Exception> {
    use mlx_rs::ops::indexing::IndexOp;
    let t = batch.tokens.shape()[1];
    let inputs = batch.tokens.index((.., ..t - 1));
    let targets = batch.tokens.index((.., 1..));
    let mut caches = model.new_dense_caches();
    let logits = model.forward(&inputs, &mut caches)?;
    let steps = Array::arange::<_, i32>(1, t, None)?;
    let mask = steps
        .ge(&batch.offsets)?
        .logical_and(&steps.le(&batch.lengths)?)?;
    let ce = cross_entropy(&logits, &targets)?;
    let ce = ce.multiply(&mask.as_dtype(ce.dtype())?)?;
    let ntoks = mask.as_dtype(Dtype::Int32)?.sum(None)?;
    let total = ce.as_dtype(Dtype::Float32)?.sum(None)?;
    Ok(vec![total.divide(&ntoks.as_dtype(Dtype::Float32)?)?, ntoks])
}

/// The selection of a step's factors on `table` (`per_site` arrays per site: `lora_a`,
/// `lora_b`, and DoRA's `m` when 3).
pub(super) fn factors_by_site(
    table: &AdapterTable,
    lora: &[SiteInfo],
    params: &[Array],
    per_site: usize,
) -> Vec<Option<TrainingFactors>> {
    let n = table.sites().iter().map(|s| s.index + 1).max().unwrap_or(0);
    let mut out: Vec<Option<TrainingFactors>> = vec![None; n];
    for (i, s) in lora.iter().enumerate() {
        let p = &params[per_site * i..per_site * (i + 1)];
        out[s.index] = Some(TrainingFactors {
            a: p[0].clone(),
            b: p[1].clone(),
            m: p.get(2).cloned(),
        });
    }
    out
}

/// One update of MLX's `Adam` (betas 0.9 and 0.999, eps 1e-8, no bias correction) or, with
/// `decay` (`learning_rate * weight_decay`, an array of the graph), `AdamW`: returns the
/// parameter and the moments.
fn adam_step(
    param: &Array,
    g: &Array,
    m: &Array,
    v: &Array,
    lr: &Array,
    decay: Option<&Array>,
) -> Result<(Array, Array, Array), Exception> {
    const B1: f32 = 0.9;
    const B2: f32 = 0.999;
    const EPS: f32 = 1e-8;
    let f = Array::from_f32;
    let m = m.multiply(f(B1))?.add(g.multiply(f(1.0 - B1))?)?;
    let v = v.multiply(f(B2))?.add(g.square()?.multiply(f(1.0 - B2))?)?;
    let param = match decay {
        Some(d) => param.multiply(f(1.0).subtract(d)?)?,
        None => param.clone(),
    };
    let update = lr.multiply(&m)?.divide(v.sqrt()?.add(f(EPS))?)?;
    Ok((param.subtract(update)?, m, v))
}

/// What a run's steps share: the trained sites and the settings that do not change between
/// steps (and so may be constants of the graph).
#[derive(Clone)]
pub(super) struct StepSpec {
    pub sites: Vec<SiteInfo>,
    /// Trained arrays per site (2, or 3 with DoRA's `m`).
    pub per_site: usize,
    pub scale: f32,
    /// Dropout's probability; with it the step takes a key.
    pub dropout: Option<f32>,
    pub grad_checkpoint: bool,
    pub adamw: bool,
}

impl StepSpec {
    fn arrays(&self) -> usize {
        self.sites.len() * self.per_site
    }
}

/// A step's inputs.
pub(super) struct StepInputs<'a> {
    pub params: &'a [Array],
    pub m: &'a [Array],
    pub v: &'a [Array],
    /// The learning rate of this update, a float32 scalar.
    pub lr: Array,
    pub batch: &'a BatchArrays,
    /// The step's dropout key, when the run has dropout.
    pub key: Option<Array>,
}

/// A step's outputs, not yet evaluated.
pub(super) struct StepOutputs {
    pub loss: Array,
    pub tokens: Array,
    pub params: Vec<Array>,
    pub m: Vec<Array>,
    pub v: Vec<Array>,
}

type Function = Box<dyn FnMut(&[Array]) -> Result<Vec<Array>, Exception>>;

/// A run's step function, compiled or not, kept for the whole run.
pub(super) struct Step {
    function: Function,
    spec: StepSpec,
    mode: StepMode,
    /// How many times the function body ran: with compilation, once per batch shape.
    traces: Rc<Cell<u64>>,
}

impl Step {
    /// The step of a run training `spec`'s sites of `model` (whose adapter table is `table`).
    /// The model must stay alive as long as the step: a checkpointed layer's function, which
    /// the compiled graph keeps, refers to it.
    pub fn new(
        model: Rc<dyn CausalLm>,
        table: Arc<AdapterTable>,
        spec: StepSpec,
        mode: StepMode,
    ) -> Self {
        let traces = Rc::new(Cell::new(0));
        let body = {
            let spec = spec.clone();
            let traces = traces.clone();
            move |args: &[Array]| -> Result<Vec<Array>, Exception> {
                traces.set(traces.get() + 1);
                graph(model.as_ref(), &table, &spec, args)
            }
        };
        let function: Function = match mode {
            StepMode::Compiled => Box::new(mlx_rs::transforms::compile::compile(body, false)),
            StepMode::Uncompiled => Box::new(body),
        };
        Self {
            function,
            spec,
            mode,
            traces,
        }
    }

    /// How many times the step's function was traced (built as a graph) so far.
    pub fn traces(&self) -> u64 {
        self.traces.get()
    }

    /// Builds one step's outputs (lazily: the caller evaluates them).
    pub fn run(&mut self, inputs: StepInputs<'_>) -> Result<StepOutputs, Exception> {
        let n = self.spec.arrays();
        if [inputs.params.len(), inputs.m.len(), inputs.v.len()] != [n; 3]
            || inputs.key.is_some() != self.spec.dropout.is_some()
        {
            return Err(Exception::custom(format!(
                "training step: {} arrays, {} and {} moments, key {}; expected {n} each and a \
                 key {}",
                inputs.params.len(),
                inputs.m.len(),
                inputs.v.len(),
                inputs.key.is_some(),
                self.spec.dropout.is_some()
            )));
        }
        let mut args = Vec::with_capacity(3 * n + 5);
        args.extend(inputs.params.iter().cloned());
        args.extend(inputs.m.iter().cloned());
        args.extend(inputs.v.iter().cloned());
        args.extend([
            inputs.lr,
            inputs.batch.tokens.clone(),
            inputs.batch.offsets.clone(),
            inputs.batch.lengths.clone(),
        ]);
        args.extend(inputs.key);
        let before = self.traces();
        let out = (self.function)(&args)?;
        if self.mode == StepMode::Compiled && self.traces() > before {
            tracing::info!(
                batch = ?inputs.batch.tokens.shape(),
                traces = self.traces(),
                "compiled the training step for a new batch shape"
            );
        }
        if out.len() != 2 + 3 * n {
            return Err(Exception::custom(format!(
                "training step: {} outputs, expected {}",
                out.len(),
                2 + 3 * n
            )));
        }
        let mut out = out.into_iter();
        let (loss, tokens) = (out.next(), out.next());
        let params: Vec<Array> = out.by_ref().take(n).collect();
        let m: Vec<Array> = out.by_ref().take(n).collect();
        let v: Vec<Array> = out.collect();
        Ok(StepOutputs {
            loss: loss.expect("counted above"),
            tokens: tokens.expect("counted above"),
            params,
            m,
            v,
        })
    }
}

/// The step's graph. Arguments: the trained arrays, Adam's `m` and `v` (as many each), the
/// learning rate, the batch's tokens, offsets and lengths, and the dropout key when `spec` has
/// dropout. Outputs: loss, token count, the new arrays, `m` and `v`. Every value that changes
/// between steps is an argument; what is made here from Rust values is fixed for the run.
fn graph(
    model: &dyn CausalLm,
    table: &Arc<AdapterTable>,
    spec: &StepSpec,
    args: &[Array],
) -> Result<Vec<Array>, Exception> {
    let n = spec.arrays();
    let expected = 3 * n + 4 + usize::from(spec.dropout.is_some());
    if args.len() != expected {
        return Err(Exception::custom(format!(
            "training step graph: {} arguments, expected {expected}",
            args.len()
        )));
    }
    let (params, rest) = args.split_at(n);
    let (m, rest) = rest.split_at(n);
    let (v, rest) = rest.split_at(n);
    let lr = &rest[0];
    let batch = BatchArrays {
        tokens: rest[1].clone(),
        offsets: rest[2].clone(),
        lengths: rest[3].clone(),
    };
    let dropout = spec.dropout.map(|p| TrainingDropout {
        p,
        key: rest[4].clone(),
    });
    let forward = |params: &[Array]| -> Result<Vec<Array>, Exception> {
        // Set while the function is traced: a compiled step's graph keeps what the forward
        // pass built from this selection, so later steps need neither.
        let _selected = table.select_training(
            factors_by_site(table, &spec.sites, params, spec.per_site),
            spec.scale,
            dropout.clone(),
        );
        let _checkpointing = spec
            .grad_checkpoint
            .then(|| checkpoint::checkpointing(table.clone()));
        loss(model, &batch)
    };
    let argnums: Vec<i32> = (0..n as i32).collect();
    let (values, grads) =
        mlx_rs::transforms::value_and_grad_with_argnums(forward, &argnums[..])(params)?;
    let decay = spec
        .adamw
        .then(|| lr.multiply(Array::from_f32(WEIGHT_DECAY)))
        .transpose()?;
    let mut out = values;
    let (mut new_m, mut new_v) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut new_params = Vec::with_capacity(n);
    for (i, g) in grads.iter().enumerate() {
        let (p, mi, vi) = adam_step(&params[i], g, &m[i], &v[i], lr, decay.as_ref())?;
        new_params.push(p);
        new_m.push(mi);
        new_v.push(vi);
    }
    out.extend(new_params);
    out.extend(new_m);
    out.extend(new_v);
    Ok(out)
}
