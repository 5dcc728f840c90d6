//! Managed jobs: long work (quantizing a model, converting a GGUF, fetching a repository) that
//! `mlxd` runs in a child process of its own, beside serving and never inside an engine.
//!
//! Two audiences share these types:
//! - the HTTP API (`POST /v1/jobs`, `GET /v1/jobs[/{id}]`, `DELETE /v1/jobs/{id}`): the
//!   request ([`JobRequest`]), the job as it is reported ([`Job`]), its progress;
//! - the job process, started as `mlxd-engine __job <JobSpec as JSON>` ([`JOB_ENTRY`]): it
//!   reports [`JobMsg`]s on its stdout in the control channel's framing (`mlxd-ipc`'s
//!   length-prefixed bincode), and exits 0 only after [`JobMsg::Done`]. Its stdin is a pipe
//!   from the supervisor: end of file means the supervisor is gone, and the job stops.
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The private first argument that makes `mlxd-engine` run one job instead of serving.
pub const JOB_ENTRY: &str = "__job";

/// The default quantization group size (elements sharing one scale and bias), as mlx-lm's.
pub const DEFAULT_GROUP_SIZE: u32 = 64;
/// The default bits per quantized weight, as mlx-lm's.
pub const DEFAULT_BITS: u32 = 4;
/// Group sizes MLX's affine quantization takes.
pub const GROUP_SIZES: &[u32] = &[32, 64, 128];
/// Bits per weight a job quantizes to.
pub const BITS: &[u32] = &[4, 8];

/// A quantize job writes its output in safetensors shards of at most this many bytes, so its
/// memory peak is about one shard (and `mlxd`'s admission estimate counts that).
pub const QUANTIZE_SHARD_BYTES: u64 = 2 << 30;

/// What `POST /v1/jobs` asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobRequest {
    /// Quantize the model directory behind `model` (a path, a configured model id, a known
    /// name in the store, or a Hugging Face repo in the cache) to MLX affine quantization.
    Quantize {
        model: String,
        /// 4 or 8 (default 4).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bits: Option<u32>,
        /// 32, 64 or 128 (default 64).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        group_size: Option<u32>,
        /// The new model directory (default: beside the store's models,
        /// `<home>/models/<name>-<bits>bit-g<group>`). It must not exist.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        out: Option<String>,
    },
    /// Convert a GGUF file into an MLX model directory with the store's converter.
    Convert {
        gguf: String,
        /// Default: `<home>/models/<gguf stem>`. It must not exist.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        out: Option<String>,
    },
    /// Fetch a Hugging Face repository (`org/name[@revision]`) or a known model into the
    /// store; the default model when `model` is absent.
    Fetch {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    },
    /// Fine-tune a LoRA adapter of `model` on the mlx-lm data directory `data`
    /// (`train.jsonl`, `valid.jsonl`), written in mlx-lm's adapter format to `out`.
    Lora {
        model: String,
        /// A directory holding `train.jsonl` and `valid.jsonl` (`test.jsonl` optional).
        data: String,
        /// The adapter directory: a plain name for `<home>/adapters/<name>` or an absolute
        /// path (default: `<home>/adapters/<model leaf>-lora`). It must not exist.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        out: Option<String>,
        /// Continue from the last checkpoint of an earlier run with the same `out` (after a
        /// cancel or a crash) instead of starting anew.
        #[serde(default)]
        resume: bool,
        /// An adapter file (`adapters.safetensors`) whose factors start the training instead
        /// of a random initialisation (mlx-lm's `--resume-adapter-file`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        init_adapter: Option<String>,
        #[serde(flatten)]
        params: TrainParams,
    },
    /// Merge a LoRA adapter into its base: a new model directory in the store, served by its
    /// name (mlx-lm's `fuse`; a quantized base is dequantized, merged and quantized again
    /// with its own settings).
    Fuse {
        model: String,
        /// The adapter: a name in the store (`<home>/adapters/<name>`) or an absolute path.
        adapter: String,
        /// Default: `<home>/models/<model leaf>-<adapter leaf>`. It must not exist.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        out: Option<String>,
    },
}

impl JobRequest {
    pub fn kind(&self) -> JobKind {
        match self {
            Self::Quantize { .. } => JobKind::Quantize,
            Self::Convert { .. } => JobKind::Convert,
            Self::Fetch { .. } => JobKind::Fetch,
            Self::Lora { .. } => JobKind::Lora,
            Self::Fuse { .. } => JobKind::Fuse,
        }
    }
}

/// The optimizers a LoRA job takes (mlx-lm's default is `adam`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// MLX's Adam: betas 0.9 and 0.999, eps 1e-8, no bias correction.
    Adam,
    /// Adam with decoupled weight decay 0.01, as MLX's AdamW.
    Adamw,
}

/// A LoRA job's hyperparameters, with mlx-lm's defaults (`mlx_lm/lora.py`'s
/// `CONFIG_DEFAULTS`); each field may be left out of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainParams {
    /// Layers to adapt, counted from the last; 0 or less, or more than the model has: all.
    pub num_layers: i32,
    pub rank: u32,
    pub scale: f32,
    pub dropout: f32,
    /// `lora` or `dora` (mlx-lm's `DoRALinear`: LoRA's update and a learned magnitude per
    /// output row).
    pub fine_tune_type: String,
    pub optimizer: Optimizer,
    pub learning_rate: f32,
    pub batch_size: u32,
    pub iters: u64,
    /// Validation batches per evaluation; -1 for the whole validation set.
    pub val_batches: i32,
    pub steps_per_eval: u64,
    /// Iterations between checkpoints (and mlx-lm's `save_every`).
    pub save_every: u64,
    pub max_seq_length: u32,
    pub seed: u64,
    /// Train on the completion (the last assistant message) only.
    pub mask_prompt: bool,
    /// A learning-rate schedule in place of the constant `learning_rate` (mlx-lm's
    /// `lr_schedule`).
    pub lr_schedule: Option<LrSchedule>,
    /// Recompute each layer's activations in the backward pass instead of keeping them:
    /// the same losses, less memory, more time (mlx-lm's `grad_checkpoint`).
    pub grad_checkpoint: bool,
}

/// mlx-lm's `lr_schedule` (`tuner/utils.py`'s `build_schedule`): one of MLX's schedulers by
/// name with its arguments (the first is the initial rate), optionally behind a linear warmup
/// from `warmup_init` over `warmup` steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// `cosine_decay` (init, decay_steps[, end]), `linear_schedule` (init, end, steps),
    /// `exponential_decay` (init, decay_rate) or `step_decay` (init, decay_rate, step_size).
    pub name: String,
    pub arguments: Vec<f64>,
    #[serde(default)]
    pub warmup: u64,
    #[serde(default)]
    pub warmup_init: f64,
}

impl LrSchedule {
    /// The rate of optimizer step `step` (0 for the first update), as MLX computes it.
    pub fn rate(&self, step: u64) -> f64 {
        let a = &self.arguments;
        let main = |step: f64| match self.name.as_str() {
            "cosine_decay" => {
                let (init, steps, end) = (a[0], a[1], a.get(2).copied().unwrap_or(0.0));
                let s = step.min(steps);
                let decay = 0.5 * (1.0 + (std::f64::consts::PI / steps * s).cos());
                end + decay * (init - end)
            }
            "linear_schedule" => {
                let (init, end, steps) = (a[0], a[1], a[2]);
                step.min(steps) * ((end - init) / steps) + init
            }
            "exponential_decay" => a[0] * a[1].powf(step),
            _ => a[0] * a[1].powf((step / a[2]).floor()),
        };
        let step = step as f64;
        if self.warmup == 0 {
            return main(step);
        }
        let warmup = self.warmup as f64;
        if step < warmup + 1.0 {
            step.min(warmup) * ((a[0] - self.warmup_init) / warmup) + self.warmup_init
        } else {
            main(step - (warmup + 1.0))
        }
    }

    pub fn check(&self) -> Result<(), String> {
        let (min, max) = match self.name.as_str() {
            "cosine_decay" => (2, 3),
            "linear_schedule" | "step_decay" => (3, 3),
            "exponential_decay" => (2, 2),
            other => {
                return Err(format!(
                    "lr_schedule name {other:?}: expected cosine_decay, linear_schedule, \
                     exponential_decay or step_decay"
                ))
            }
        };
        let n = self.arguments.len();
        if n < min || n > max || self.arguments.iter().any(|v| !v.is_finite()) {
            return Err(format!(
                "lr_schedule {}: {n} arguments {:?}, expected {min} to {max} finite numbers",
                self.name, self.arguments
            ));
        }
        let steps = match self.name.as_str() {
            "cosine_decay" => Some(self.arguments[1]),
            "linear_schedule" | "step_decay" => Some(self.arguments[2]),
            _ => None,
        };
        if steps.is_some_and(|s| s < 1.0) {
            return Err(format!(
                "lr_schedule {}: its step count {:?} must be at least 1",
                self.name, steps
            ));
        }
        Ok(())
    }
}

impl Default for TrainParams {
    fn default() -> Self {
        Self {
            num_layers: 16,
            rank: 8,
            scale: 20.0,
            dropout: 0.0,
            fine_tune_type: "lora".into(),
            optimizer: Optimizer::Adam,
            learning_rate: 1e-5,
            batch_size: 4,
            iters: 1000,
            val_batches: 25,
            steps_per_eval: 200,
            save_every: 100,
            max_seq_length: 2048,
            seed: 0,
            mask_prompt: false,
            lr_schedule: None,
            grad_checkpoint: false,
        }
    }
}

impl TrainParams {
    /// The first setting out of range, named with its value.
    pub fn check(&self) -> Result<(), String> {
        if self.fine_tune_type == "full" {
            return Err(
                "fine_tune_type \"full\" is not built: mlxd trains adapters \
                 (fine_tune_type \"lora\" or \"dora\"); fine-tune a whole model with mlx_lm.lora"
                    .into(),
            );
        }
        if !matches!(self.fine_tune_type.as_str(), "lora" | "dora") {
            return Err(format!(
                "fine_tune_type {:?}: expected \"lora\" or \"dora\"",
                self.fine_tune_type
            ));
        }
        if self.rank == 0 || self.rank > 1024 {
            return Err(format!("rank {}: expected 1 to 1024", self.rank));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!(
                "dropout {}: expected at least 0 and below 1",
                self.dropout
            ));
        }
        if !self.scale.is_finite() {
            return Err(format!("scale {}: expected a finite number", self.scale));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(format!(
                "learning_rate {}: expected a positive number",
                self.learning_rate
            ));
        }
        if self.batch_size == 0 {
            return Err("batch_size 0: expected at least 1".into());
        }
        if self.iters == 0 {
            return Err("iters 0: expected at least 1".into());
        }
        if self.steps_per_eval == 0 || self.save_every == 0 {
            return Err(format!(
                "steps_per_eval {} and save_every {}: expected at least 1",
                self.steps_per_eval, self.save_every
            ));
        }
        if self.max_seq_length < 2 {
            return Err(format!(
                "max_seq_length {}: expected at least 2",
                self.max_seq_length
            ));
        }
        if let Some(schedule) = &self.lr_schedule {
            schedule.check()?;
        }
        if self.val_batches == 0 || self.val_batches < -1 {
            return Err(format!(
                "val_batches {}: expected -1 (all) or at least 1",
                self.val_batches
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Quantize,
    Convert,
    Fetch,
    Lora,
    Fuse,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quantize => "quantize",
            Self::Convert => "convert",
            Self::Fetch => "fetch",
            Self::Lora => "lora",
            Self::Fuse => "fuse",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for memory (see [`Job::waiting_for`]).
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    /// Succeeded, failed or cancelled: nothing more will happen.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// How far a job has got. Plain fields (no skipping) so that it travels in bincode too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobProgress {
    /// What is being done: `quantizing`, `writing`, `converting`, `downloading`.
    pub phase: String,
    pub done: u64,
    /// 0 when unknown.
    pub total: u64,
    /// What `done` and `total` count: `tensors` or `bytes`.
    pub unit: String,
    /// The tensor or file at hand, when there is one.
    pub detail: Option<String>,
    /// A training job's figures (`None` for other jobs).
    #[serde(default)]
    pub training: Option<TrainingProgress>,
}

/// A LoRA job's figures as of its last iteration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingProgress {
    /// Iterations done (optimizer updates applied).
    pub iteration: u64,
    pub iters: u64,
    /// The loss of the last iteration's batch (mean over its unmasked tokens).
    pub train_loss: Option<f64>,
    /// The latest validation loss and the iteration it was measured after.
    pub val_loss: Option<f64>,
    pub val_iteration: Option<u64>,
    /// Tokens (unmasked targets) per second over the iterations since the last report.
    pub tokens_per_second: f64,
    pub trained_tokens: u64,
    /// MLX's peak memory of the job process so far.
    pub peak_memory_bytes: u64,
    /// The last checkpoint's iteration (what a resumed run starts from).
    pub checkpoint: Option<u64>,
}

/// What a job made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobResult {
    /// The model directory, complete.
    pub dir: PathBuf,
    /// The id the model is served under with `mlxd --model <dir>`.
    pub model_id: String,
    /// Bytes of weights written (or found, for a fetch).
    pub bytes: u64,
    /// Time the job process took.
    pub seconds: f64,
}

/// A job as `GET /v1/jobs/{id}` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: String,
    pub kind: JobKind,
    pub state: JobState,
    pub request: JobRequest,
    /// Unix seconds.
    pub created: u64,
    pub started: Option<u64>,
    pub finished: Option<u64>,
    /// The memory the job is counted for against the pool's budget (its estimated peak).
    pub memory_bytes: u64,
    /// Why a queued job waits, with the numbers.
    pub waiting_for: Option<String>,
    /// The job process, while it runs (its process group has the same id).
    pub pid: Option<u32>,
    pub progress: Option<JobProgress>,
    pub result: Option<JobResult>,
    /// Why it failed or was cancelled.
    pub error: Option<String>,
}

/// `GET /v1/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobList {
    pub jobs: Vec<Job>,
}

/// The names of the SSE events of `GET /v1/jobs/{id}?follow=1`: first `job` (the job as it
/// stands), then `progress` ([`JobProgress`]) as the work advances and `job` again on each
/// change of state, and last `result` (the final [`Job`]), after which the stream ends.
pub mod event {
    pub const JOB: &str = "job";
    pub const PROGRESS: &str = "progress";
    pub const RESULT: &str = "result";
}

/// What the supervisor asks a job process to do: resolved paths only, so that the job needs
/// no configuration. Passed as JSON in the argument after [`JOB_ENTRY`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobSpec {
    Quantize {
        /// A model directory.
        source: PathBuf,
        bits: u32,
        group_size: u32,
        /// Where to build the output (created by the job; removed by the supervisor unless
        /// the job succeeds). Same filesystem as `out`.
        staging: PathBuf,
        /// Where the output is renamed on success; must not exist.
        out: PathBuf,
    },
    Convert {
        gguf: PathBuf,
        staging: PathBuf,
        out: PathBuf,
    },
    Fetch {
        model: String,
        home: PathBuf,
    },
    Lora {
        /// The base model directory.
        source: PathBuf,
        /// The data directory.
        data: PathBuf,
        params: Box<TrainParams>,
        /// Checkpoints of this run (kept after a cancel or crash, for `resume`; removed on
        /// success).
        checkpoints: PathBuf,
        resume: bool,
        init_adapter: Option<PathBuf>,
        staging: PathBuf,
        out: PathBuf,
    },
    Fuse {
        /// The base model directory.
        source: PathBuf,
        /// The adapter directory.
        adapter: PathBuf,
        staging: PathBuf,
        out: PathBuf,
    },
}

/// Messages from a job process to the supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum JobMsg {
    Progress(JobProgress),
    /// Sent once the output is in place, just before exiting 0.
    Done(JobResult),
    /// Sent before a controlled non-zero exit.
    Failed {
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_tagged_by_kind_and_optional_fields_default() {
        let r: JobRequest =
            serde_json::from_str(r#"{"kind":"quantize","model":"m","bits":8}"#).unwrap();
        assert_eq!(
            r,
            JobRequest::Quantize {
                model: "m".into(),
                bits: Some(8),
                group_size: None,
                out: None
            }
        );
        assert_eq!(
            serde_json::to_value(JobRequest::Fetch { model: None }).unwrap(),
            serde_json::json!({"kind": "fetch"})
        );
    }

    #[test]
    fn spec_round_trips_as_json() {
        let spec = JobSpec::Convert {
            gguf: "/a.gguf".into(),
            staging: "/s".into(),
            out: "/o".into(),
        };
        let text = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<JobSpec>(&text).unwrap(), spec);
    }

    #[test]
    fn a_lora_request_takes_hyperparameters_beside_its_fields_with_mlx_lm_defaults() {
        let r: JobRequest =
            serde_json::from_str(r#"{"kind":"lora","model":"m","data":"/d","rank":4}"#).unwrap();
        let JobRequest::Lora { params, resume, .. } = &r else {
            panic!("{r:?}")
        };
        assert!(!resume);
        assert_eq!(params.rank, 4);
        assert_eq!(
            (params.scale, params.iters, params.batch_size),
            (20.0, 1000, 4)
        );
        assert_eq!(params.optimizer, Optimizer::Adam);
        let back: JobRequest = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        assert!(TrainParams::default().check().is_ok());
        let with = |kind: &str| TrainParams {
            fine_tune_type: kind.into(),
            ..TrainParams::default()
        };
        assert!(with("dora").check().is_ok());
        assert!(with("full").check().unwrap_err().contains("not built"));
        assert!(with("qlora").check().unwrap_err().contains("expected"));
    }

    #[test]
    fn schedules_give_mlx_s_rates() {
        let cosine = LrSchedule {
            name: "cosine_decay".into(),
            arguments: vec![1e-3, 10.0, 1e-4],
            warmup: 2,
            warmup_init: 1e-4,
        };
        assert!(cosine.check().is_ok());
        // Warmup: 1e-4, 5.5e-4, then 1e-3 at step 2 (MLX's join at warmup + 1), then the
        // cosine from its own step 0.
        let rates: Vec<f64> = (0..5).map(|s| cosine.rate(s)).collect();
        let want = [
            1e-4,
            5.5e-4,
            1e-3,
            1e-3,
            1e-4 + 0.5 * (1.0 + (0.1f64 * std::f64::consts::PI).cos()) * 9e-4,
        ];
        for (r, w) in rates.iter().zip(want) {
            assert!((r - w).abs() < 1e-12, "{rates:?}");
        }
        assert!((cosine.rate(100) - 1e-4).abs() < 1e-12);
        let bad = LrSchedule {
            name: "cosine_decay".into(),
            arguments: vec![1e-3],
            warmup: 0,
            warmup_init: 0.0,
        };
        assert!(bad.check().unwrap_err().contains("1 arguments"));
    }
}
