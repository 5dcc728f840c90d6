//! `mlxd-engine __job <spec>`: one managed job in a process of its own, started by `mlxd`
//! beside its engines (never inside one), so that a job that crashes or is killed cannot
//! touch serving.
//!
//! The spec ([`JobSpec`], JSON) names resolved paths only. Progress and the result go to the
//! supervisor as [`JobMsg`] frames on stdout ([`channel::Reporter`]); logs go to stderr. The
//! output is built in the spec's `staging` directory and renamed into place only once it is
//! complete; on any failure the job removes its staging directory, and the supervisor removes
//! it again after a kill (`kill -9`, cancel), so the store never holds a partial model.
pub mod channel;
pub mod fuse;
pub mod quantize;
pub mod train;

use std::path::{Path, PathBuf};
use std::time::Instant;

use mlxd_protocol::jobs::{JobMsg, JobProgress, JobResult, JobSpec};
use mlxd_store as store;

use channel::Reporter;

/// Why a job failed; the message reaches `GET /v1/jobs/{id}` as the job's `error`.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("invalid job spec: {0}")]
    Spec(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Input(String),
    #[error("MLX: {0}")]
    Mlx(String),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("converting {gguf}: {source}")]
    Convert {
        gguf: PathBuf,
        #[source]
        source: store::convert::ConvertError,
    },
    #[error("{0} already exists; the job does not overwrite a model directory")]
    OutputExists(PathBuf),
    #[error("the job could not report to the supervisor: {0}")]
    Channel(String),
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JobError + '_ {
    move |source| JobError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Runs the job `spec_json` to its end and returns the process exit code: 0 after
/// [`JobMsg::Done`], 1 after [`JobMsg::Failed`], 2 when even reporting is impossible.
pub fn main(spec_json: &str) -> i32 {
    if let Err(e) = mlxd_ipc::control::set_parent_death_signal() {
        eprintln!("mlxd-engine __job: {e}");
        return 2;
    }
    let reporter = match Reporter::from_stdio() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mlxd-engine __job: control channel: {e}");
            return 2;
        }
    };
    // The supervisor holds our stdin open; its end means the supervisor is gone.
    channel::exit_when_stdin_closes();
    let started = Instant::now();
    let spec: Result<JobSpec, JobError> =
        serde_json::from_str(spec_json).map_err(|e| JobError::Spec(e.to_string()));
    let outcome = spec.and_then(|spec| {
        tracing::info!(?spec, "job started");
        let staging = match &spec {
            JobSpec::Quantize { staging, .. }
            | JobSpec::Convert { staging, .. }
            | JobSpec::Lora { staging, .. }
            | JobSpec::Fuse { staging, .. } => Some(staging.clone()),
            JobSpec::Fetch { .. } => None,
        };
        let result = run(spec, &reporter, started);
        if result.is_err() {
            if let Some(staging) = staging {
                let _ = std::fs::remove_dir_all(staging);
            }
        }
        result
    });
    match outcome {
        Ok(result) => {
            tracing::info!(dir = %result.dir.display(), seconds = result.seconds, "job done");
            match reporter.send(&JobMsg::Done(result)) {
                Ok(()) => 0,
                Err(e) => {
                    tracing::error!(error = %e, "reporting the result failed");
                    2
                }
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "job failed");
            let _ = reporter.send(&JobMsg::Failed {
                message: e.to_string(),
            });
            1
        }
    }
}

fn run(spec: JobSpec, reporter: &Reporter, started: Instant) -> Result<JobResult, JobError> {
    match spec {
        JobSpec::Quantize {
            source,
            bits,
            group_size,
            staging,
            out,
        } => {
            crate::device::check_mlx_version().map_err(JobError::Mlx)?;
            let options = quantize::QuantizeOptions { bits, group_size };
            let bytes = quantize::quantize_dir(&source, &staging, &out, options, reporter)?;
            Ok(JobResult {
                model_id: store::served_id(&out.to_string_lossy()),
                dir: out,
                bytes,
                seconds: started.elapsed().as_secs_f64(),
            })
        }
        JobSpec::Convert { gguf, staging, out } => {
            if out.exists() {
                return Err(JobError::OutputExists(out));
            }
            reporter.progress(JobProgress {
                phase: "converting".into(),
                done: 0,
                total: 1,
                unit: "files".into(),
                detail: Some(gguf.display().to_string()),
                training: None,
            })?;
            std::fs::create_dir_all(&staging).map_err(io(&staging))?;
            let built = staging.join("model");
            let options = store::convert::ConvertOptions {
                float_dtype: store::convert::FloatDtype::F32,
            };
            store::convert::convert_gguf_with(&gguf, &built, &options).map_err(|source| {
                JobError::Convert {
                    gguf: gguf.clone(),
                    source,
                }
            })?;
            let bytes = quantize::weight_bytes(&built);
            place(&built, &staging, &out)?;
            reporter.progress(JobProgress {
                phase: "converting".into(),
                done: 1,
                total: 1,
                unit: "files".into(),
                detail: Some(gguf.display().to_string()),
                training: None,
            })?;
            Ok(JobResult {
                model_id: store::served_id(&out.to_string_lossy()),
                dir: out,
                bytes,
                seconds: started.elapsed().as_secs_f64(),
            })
        }
        JobSpec::Lora {
            source,
            data,
            params,
            checkpoints,
            resume,
            init_adapter,
            staging,
            out,
        } => {
            crate::device::check_mlx_version().map_err(JobError::Mlx)?;
            if out.exists() {
                return Err(JobError::OutputExists(out));
            }
            train::configure_process();
            let built = staging.join("adapter");
            let config = train::TrainConfig {
                source,
                data,
                params: *params,
                checkpoints: checkpoints.clone(),
                resume,
                init_adapter,
                out: built.clone(),
            };
            let summary = match train::train(&config, &mut |p| reporter.progress(p)) {
                Ok(summary) => summary,
                Err(e) => {
                    // A run that failed before its first checkpoint leaves nothing to resume.
                    if !checkpoints.join(train::CHECKPOINT).exists() {
                        let _ = std::fs::remove_dir_all(&checkpoints);
                    }
                    return Err(e);
                }
            };
            place(&built, &staging, &out)?;
            // The run is complete: its checkpoints are of no further use.
            let _ = std::fs::remove_dir_all(&checkpoints);
            Ok(JobResult {
                model_id: out
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                dir: out,
                bytes: summary.bytes,
                seconds: started.elapsed().as_secs_f64(),
            })
        }
        JobSpec::Fuse {
            source,
            adapter,
            staging,
            out,
        } => {
            crate::device::check_mlx_version().map_err(JobError::Mlx)?;
            let bytes = fuse::fuse_dir(&source, &adapter, &staging, &out, &mut |p| {
                reporter.progress(p)
            })?;
            Ok(JobResult {
                model_id: store::served_id(&out.to_string_lossy()),
                dir: out,
                bytes,
                seconds: started.elapsed().as_secs_f64(),
            })
        }
        JobSpec::Fetch { model, home } => {
            let mut opts = store::StoreOptions::from_env(&home);
            let events = reporter.clone();
            opts.progress = store::Progress::new(move |event| {
                // A failed report ends the job through the next progress call or the result.
                let _ = events.progress(store_progress(event));
            });
            let resolved = store::resolve_model_with(&model, &opts)?;
            Ok(JobResult {
                bytes: quantize::weight_bytes(&resolved.dir),
                model_id: resolved.id,
                dir: resolved.dir,
                seconds: started.elapsed().as_secs_f64(),
            })
        }
    }
}

/// The store's progress as the job's.
fn store_progress(event: &store::StoreEvent) -> JobProgress {
    match event {
        store::StoreEvent::Download { what, done, total } => JobProgress {
            phase: "downloading".into(),
            done: *done,
            total: *total,
            unit: "bytes".into(),
            detail: Some(what.clone()),
            training: None,
        },
        store::StoreEvent::Downloaded { what } => JobProgress {
            phase: "downloaded".into(),
            done: 1,
            total: 1,
            unit: "files".into(),
            detail: Some(what.clone()),
            training: None,
        },
        store::StoreEvent::Converting { source } => JobProgress {
            phase: "converting".into(),
            done: 0,
            total: 1,
            unit: "files".into(),
            detail: Some(source.display().to_string()),
            training: None,
        },
        store::StoreEvent::Converted { dir, .. } => JobProgress {
            phase: "converting".into(),
            done: 1,
            total: 1,
            unit: "files".into(),
            detail: Some(dir.display().to_string()),
            training: None,
        },
    }
}

/// Test switch (`MLXD_ALLOW_FAULTS=1` and `MLXD_JOB_FAULT=stall@N`, which `mlxd` passes to its
/// jobs when it has them): a quantize job stops for good after N tensors, with partial output
/// in its staging directory, so that cancelling and killing mid-way can be tested without
/// racing a fast job.
pub(crate) fn stall_after() -> Option<u64> {
    if std::env::var("MLXD_ALLOW_FAULTS").as_deref() != Ok("1") {
        return None;
    }
    let spec = std::env::var("MLXD_JOB_FAULT").ok()?;
    let n = spec.strip_prefix("stall@")?.parse().ok();
    if n.is_none() {
        tracing::warn!(%spec, "MLXD_JOB_FAULT: expected stall@<tensors>; ignored");
    }
    n
}

/// Stops here until killed (the fault switch), after writing a partial file into `built`.
pub(crate) fn stall(built: &Path) -> ! {
    let _ = std::fs::write(built.join("partial.safetensors"), b"partial");
    tracing::warn!("MLXD_JOB_FAULT: stalling until killed");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// Renames the finished directory `built` (inside `staging`) to `out` and removes `staging`.
/// `out` must not exist: a rename onto an existing directory would replace an empty one or
/// fail on a full one, and neither is what the caller asked for.
pub(crate) fn place(built: &Path, staging: &Path, out: &Path) -> Result<(), JobError> {
    if out.exists() {
        return Err(JobError::OutputExists(out.to_path_buf()));
    }
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    std::fs::rename(built, out).map_err(io(out))?;
    std::fs::remove_dir_all(staging).map_err(io(staging))
}
