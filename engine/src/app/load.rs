//! Loading a model: resolve it (and a draft model) in the store, then read tokenizer and
//! weights on the device `MLXD_DEVICE` selects, reporting progress on the way.
use std::path::Path;
use std::sync::Arc;

use mlxd_protocol::control::{Device, LoadPhase};

use super::options::{DraftChoice, DraftOptions};
use super::start_error::StartError;
use crate::loader::LoadReporter;
use crate::runtime::draft::{DraftSource, Speculation};
use crate::runtime::{FatalHook, Runtime, RuntimeLimits};
use crate::server::ServerState;
use crate::tokenizer::Tokenizer;
use mlxd_store::{self as store, ResolvedModel};

/// A model loaded and ready to serve.
pub struct Engine {
    pub model: ResolvedModel,
    pub runtime: Runtime,
    pub tokenizer: Arc<Tokenizer>,
    /// Where it computes (`MLXD_DEVICE`, else the GPU when this MLX build has one).
    pub device: Device,
}

/// Resolves `spec` (and a draft model) in the model store at `home`, then loads tokenizer and
/// weights.
pub fn load(
    spec: &str,
    home: &Path,
    limits: RuntimeLimits,
    draft: Option<DraftOptions>,
    on_fatal: Option<FatalHook>,
) -> Result<Engine, StartError> {
    load_reporting(spec, home, limits, draft, on_fatal, None)
}

/// What a store event means for the load's progress: downloads and a GGUF conversion are
/// phases of their own.
pub fn store_event_progress(event: &store::StoreEvent) -> Option<(LoadPhase, f32)> {
    match event {
        store::StoreEvent::Download { done, total, .. } if *total > 0 => Some((
            LoadPhase::Downloading,
            (*done as f64 / *total as f64).clamp(0.0, 1.0) as f32,
        )),
        store::StoreEvent::Download { .. } => None,
        store::StoreEvent::Downloaded { .. } => Some((LoadPhase::Downloading, 1.0)),
        store::StoreEvent::Converting { .. } => Some((LoadPhase::Converting, 0.0)),
        store::StoreEvent::Converted { .. } => Some((LoadPhase::Converting, 1.0)),
    }
}

/// [`load`], on the device `MLXD_DEVICE` selects, telling `reporter` how far it has got:
/// downloads and a GGUF conversion in the store, then the weights read.
pub fn load_reporting(
    spec: &str,
    home: &Path,
    limits: RuntimeLimits,
    draft: Option<DraftOptions>,
    on_fatal: Option<FatalHook>,
    reporter: Option<LoadReporter>,
) -> Result<Engine, StartError> {
    load_in_group(spec, home, limits, draft, on_fatal, reporter, None)
}

/// [`load_reporting`] of this rank's shard when `group` is an engine group's
/// ([`super::group`]); its runtime then runs in lockstep with the other ranks.
pub fn load_in_group(
    spec: &str,
    home: &Path,
    mut limits: RuntimeLimits,
    draft: Option<DraftOptions>,
    on_fatal: Option<FatalHook>,
    reporter: Option<LoadReporter>,
    group: Option<crate::distributed::Group>,
) -> Result<Engine, StartError> {
    crate::device::check_mlx_version().map_err(StartError::Mlx)?;
    let request = crate::device::device_request_from_env().map_err(StartError::Device)?;
    let device = crate::device::select_device(request).map_err(StartError::Device)?;
    tracing::info!(device = %device, "device selected");
    let (cache_limit, mlx_default) =
        super::memory::bound_mlx_cache(limits.kv_budget_bytes).map_err(StartError::Mlx)?;
    tracing::info!(
        cache_limit,
        mlx_default,
        kv_budget = ?limits.kv_budget_bytes,
        "MLX's buffer cache bounded by the KV budget"
    );
    let mut opts = store::StoreOptions::from_env(home);
    if let Some(report) = reporter.clone() {
        opts.progress = store::Progress::new(move |event| {
            if let Some((phase, fraction)) = store_event_progress(event) {
                report(phase, fraction);
            }
        });
    }
    let model = store::resolve_model_with(spec, &opts)?;
    tracing::info!(model = %model.id, dir = %model.dir.display(), "loading");
    let tokenizer = Tokenizer::from_dir(&model.dir).map_err(|source| StartError::Tokenizer {
        dir: model.dir.clone(),
        source,
    })?;
    limits.speculation = match draft {
        None => None,
        Some(DraftOptions { choice, num_draft }) => Some(Speculation {
            num_draft,
            source: match choice {
                DraftChoice::Ngram(sizes) => DraftSource::Ngram(sizes),
                DraftChoice::Model(draft_spec) => {
                    let draft = store::resolve_model(&draft_spec, home)?;
                    let draft_tokenizer = Tokenizer::from_dir(&draft.dir).map_err(|source| {
                        StartError::Tokenizer {
                            dir: draft.dir.clone(),
                            source,
                        }
                    })?;
                    if let Some(reason) = tokenizer.vocabulary_mismatch(&draft_tokenizer) {
                        return Err(StartError::DraftTokenizer {
                            draft: draft.id,
                            model: model.id,
                            reason,
                        });
                    }
                    tracing::info!(draft = %draft.id, dir = %draft.dir.display(), "draft model");
                    DraftSource::Model(draft.dir)
                }
            },
        }),
    };
    let runtime = match group {
        None => Runtime::start_reporting(model.dir.clone(), limits, on_fatal, reporter),
        Some(group) => {
            super::group::start_rank(model.dir.clone(), limits, on_fatal, reporter, group)
        }
    }
    .map_err(|source| StartError::Load {
        dir: model.dir.clone(),
        source,
    })?;
    tracing::info!(
        model = %model.id,
        weight_bytes = runtime.info.weight_bytes,
        context_length = runtime.info.context_length,
        device = %device,
        "loaded"
    );
    Ok(Engine {
        model,
        runtime,
        tokenizer: Arc::new(tokenizer),
        device,
    })
}

impl Engine {
    /// What the HTTP routes share; with [`server::router`] it serves this engine's API without
    /// a socket (the in-process transport of `mlxd-client`).
    pub fn state(&self) -> ServerState {
        ServerState::new(
            self.model.id.clone(),
            self.tokenizer.clone(),
            self.runtime.info.context_length,
            self.runtime.work.clone(),
        )
        .with_model_vocab(self.runtime.info.vocab_size)
        .with_adapters(self.runtime.adapters.clone())
        .with_adapter_work(self.runtime.adapter_work.clone())
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_events_become_load_phases() {
        use store::StoreEvent;
        let dl = |done, total| StoreEvent::Download {
            what: "w".into(),
            done,
            total,
        };
        assert_eq!(
            store_event_progress(&dl(25, 100)),
            Some((LoadPhase::Downloading, 0.25))
        );
        assert_eq!(store_event_progress(&dl(25, 0)), None);
        assert_eq!(
            store_event_progress(&StoreEvent::Converting {
                source: "/a.gguf".into()
            }),
            Some((LoadPhase::Converting, 0.0))
        );
        assert_eq!(
            store_event_progress(&StoreEvent::Converted {
                dir: "/d".into(),
                seconds: 1.0
            }),
            Some((LoadPhase::Converting, 1.0))
        );
    }
}
