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
}

impl JobRequest {
    pub fn kind(&self) -> JobKind {
        match self {
            Self::Quantize { .. } => JobKind::Quantize,
            Self::Convert { .. } => JobKind::Convert,
            Self::Fetch { .. } => JobKind::Fetch,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Quantize,
    Convert,
    Fetch,
}

impl JobKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quantize => "quantize",
            Self::Convert => "convert",
            Self::Fetch => "fetch",
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
}
