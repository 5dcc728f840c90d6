//! Start-up glue for the `mlxd-engine` binary: resolve the model, load it on the MLX thread,
//! serve HTTP on a unix socket, and (under `mlxd`) speak the control channel.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use mlxd_ipc::control::{ChildChannel, ControlSender, ParentEvent};
use mlxd_protocol::control::{FatalKind, Launch, Ready, Stats, PROTOCOL_VERSION};
use tokio::sync::Notify;

use crate::cache::KvQuant;
use crate::runtime::request::is_out_of_memory;
use crate::runtime::{OomHook, Runtime, RuntimeLimits};
use crate::server::{self, ApiError, ServerState};
use crate::tokenizer::Tokenizer;
use mlxd_store::{self as store, ResolvedModel};

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("loading the tokenizer of {dir}: {source}")]
    Tokenizer {
        dir: PathBuf,
        source: crate::tokenizer::TokenizerError,
    },
    #[error("loading the model in {dir}: {source}")]
    Load {
        dir: PathBuf,
        source: crate::loader::LoadError,
    },
    #[error("{0}")]
    Mlx(String),
    #[error("engine option {key} = {value:?}: {reason}")]
    Option {
        key: String,
        value: String,
        reason: String,
    },
}

/// The engine options `mlxd` passes in `Launch.options` (`[server.engine_options]` and a
/// model's `options` in `mlxd.toml`), each with what it takes.
pub const ENGINE_OPTIONS: &[(&str, &str)] = &[
    (
        "prompt_cache",
        "GiB of prefix cache, a number >= 0 (0 disables it)",
    ),
    ("kv_bits", "4 or 8: store the KV cache quantized"),
    ("kv_group_size", "32, 64 or 128 (with kv_bits)"),
];

/// The runtime limits for a supervised engine: `Launch.limits` and `Launch.options` over the
/// defaults. An unknown option or a value out of its domain is an error, never ignored.
pub fn runtime_limits(launch: &Launch) -> Result<RuntimeLimits, StartError> {
    let defaults = RuntimeLimits::default();
    let mut limits = RuntimeLimits {
        max_batch_size: launch
            .limits
            .max_batch_size
            .map_or(defaults.max_batch_size, |n| n as usize),
        kv_budget_bytes: launch.limits.kv_budget_bytes,
        context_length: launch.limits.context_length.map(|n| n as usize),
        ..defaults
    };
    let mut kv_bits = None;
    let mut kv_group_size = None;
    for (key, value) in &launch.options {
        let bad = |reason: &str| StartError::Option {
            key: key.clone(),
            value: value.clone(),
            reason: reason.to_owned(),
        };
        match key.as_str() {
            "prompt_cache" => {
                let gib: f64 = value
                    .parse()
                    .ok()
                    .filter(|g: &f64| g.is_finite() && (0.0..=1024.0 * 1024.0).contains(g))
                    .ok_or_else(|| bad("expected GiB between 0 and 1048576"))?;
                limits.prompt_cache_bytes = (gib * (1u64 << 30) as f64) as u64;
            }
            "kv_bits" => {
                kv_bits = Some(
                    value
                        .parse::<i32>()
                        .ok()
                        .filter(|b| [4, 8].contains(b))
                        .ok_or_else(|| bad("expected 4 or 8"))?,
                )
            }
            "kv_group_size" => {
                kv_group_size = Some(
                    value
                        .parse::<i32>()
                        .ok()
                        .filter(|g| [32, 64, 128].contains(g))
                        .ok_or_else(|| bad("expected 32, 64 or 128"))?,
                )
            }
            _ => {
                let known: Vec<&str> = ENGINE_OPTIONS.iter().map(|(k, _)| *k).collect();
                return Err(bad(&format!(
                    "unknown option (known: {})",
                    known.join(", ")
                )));
            }
        }
    }
    limits.kv_quant = match (kv_bits, kv_group_size) {
        (Some(bits), group) => Some(KvQuant {
            bits,
            group_size: group.unwrap_or(64),
        }),
        (None, Some(group)) => {
            return Err(StartError::Option {
                key: "kv_group_size".into(),
                value: group.to_string(),
                reason: "needs kv_bits".into(),
            })
        }
        (None, None) => None,
    };
    Ok(limits)
}

impl StartError {
    /// How the supervisor should classify this failure.
    pub fn fatal_kind(&self) -> FatalKind {
        if is_out_of_memory(&self.to_string()) {
            FatalKind::OutOfMemory
        } else {
            FatalKind::LoadFailed
        }
    }
}

/// A model loaded and ready to serve.
pub struct Engine {
    pub model: ResolvedModel,
    pub runtime: Runtime,
    pub tokenizer: Arc<Tokenizer>,
}

/// Resolves `spec` in the model store at `home`, then loads tokenizer and weights.
pub fn load(
    spec: &str,
    home: &Path,
    limits: RuntimeLimits,
    on_oom: Option<OomHook>,
) -> Result<Engine, StartError> {
    crate::mlx_runtime::check_mlx_version().map_err(StartError::Mlx)?;
    let model = store::resolve_model(spec, home)?;
    tracing::info!(model = %model.id, dir = %model.dir.display(), "loading");
    let tokenizer = Tokenizer::from_dir(&model.dir).map_err(|source| StartError::Tokenizer {
        dir: model.dir.clone(),
        source,
    })?;
    let runtime =
        Runtime::start(model.dir.clone(), limits, on_oom).map_err(|source| StartError::Load {
            dir: model.dir.clone(),
            source,
        })?;
    tracing::info!(
        model = %model.id,
        weight_bytes = runtime.info.weight_bytes,
        context_length = runtime.info.context_length,
        "loaded"
    );
    Ok(Engine {
        model,
        runtime,
        tokenizer: Arc::new(tokenizer),
    })
}

impl Engine {
    fn state(&self) -> ServerState {
        ServerState::new(
            self.model.id.clone(),
            self.tokenizer.clone(),
            self.runtime.info.context_length,
            self.runtime.work.clone(),
        )
    }
}

/// Standalone mode (`--unix`): serve until SIGINT or SIGTERM.
pub async fn serve_standalone(engine: Engine, socket: &Path) -> anyhow::Result<()> {
    let listener = server::bind(socket)?;
    tracing::info!(socket = %socket.display(), "serving");
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    server::serve(listener, engine.state(), shutdown).await?;
    engine.runtime.join();
    Ok(())
}

/// Supervised mode (`--control`): the whole life of an engine under `mlxd`.
pub fn run_supervised(home: &Path) -> anyhow::Result<()> {
    mlxd_ipc::control::set_parent_death_signal()?;
    let mut channel = ChildChannel::from_stdio()?;
    let launch = channel.read_launch()?;
    let control = channel.sender();

    let draining = Arc::new(AtomicBool::new(false));
    let shutdown = Arc::new(Notify::new());
    {
        let (draining, shutdown) = (draining.clone(), shutdown.clone());
        channel.watch_parent(move |event| match event {
            ParentEvent::Drain => draining.store(true, Ordering::SeqCst),
            ParentEvent::Shutdown => {
                draining.store(true, Ordering::SeqCst);
                shutdown.notify_one();
            }
            // The supervisor is gone: nobody can reach us any more.
            ParentEvent::Closed | ParentEvent::Broken(_) => std::process::exit(0),
        });
    }

    let limits = match runtime_limits(&launch) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::error!(error = %e, "invalid engine options");
            let _ = control.send_fatal(FatalKind::LoadFailed, e.to_string());
            std::process::exit(2);
        }
    };
    let oom_control = control.clone();
    let on_oom: OomHook = Box::new(move |message| {
        tracing::error!(%message, "out of memory; exiting so the supervisor restarts the engine");
        let _ = oom_control.send_fatal(FatalKind::OutOfMemory, message);
        std::process::exit(3);
    });
    let _ = control.send_loading(0.0);
    let engine = match load(&launch.model, home, limits, Some(on_oom)) {
        Ok(engine) => engine,
        Err(e) => {
            tracing::error!(error = %e, "load failed");
            let _ = control.send_fatal(e.fatal_kind(), e.to_string());
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve_supervised(
        engine, launch, control, draining, shutdown,
    ))
}

async fn serve_supervised(
    engine: Engine,
    launch: Launch,
    control: ControlSender,
    draining: Arc<AtomicBool>,
    shutdown: Arc<Notify>,
) -> anyhow::Result<()> {
    let listener = mlxd_ipc::socket::bind_unix(&launch.socket_path)?;
    let info = &engine.runtime.info;
    control.send_ready(Ready {
        version: PROTOCOL_VERSION,
        model_id: engine.model.id.clone(),
        weight_bytes: info.weight_bytes as u64,
        kv_bytes_per_token: info.kv_bytes_per_token as u64,
        context_length: info.context_length as u32,
        capabilities: vec![
            "chat".into(),
            "completions".into(),
            "stream".into(),
            "token_ids".into(),
        ],
    })?;
    tracing::info!(socket = %launch.socket_path.display(), "ready");

    let stats = engine.runtime.stats.clone();
    let stats_control = control.clone();
    let reporter = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let message = Stats {
                active: stats.active.load(Ordering::Relaxed) as u32,
                queued: stats.queued.load(Ordering::Relaxed) as u32,
                kv_bytes: stats.kv_bytes.load(Ordering::Relaxed),
                memory_bytes: mlx_rs::memory::active_memory().unwrap_or(0) as u64,
            };
            if stats_control.send_stats(message).is_err() {
                return;
            }
        }
    });

    let app = server::router(engine.state()).layer(middleware::from_fn_with_state(
        draining,
        refuse_when_draining,
    ));
    let stop = async move { shutdown.notified().await };
    axum::serve(listener, app)
        .with_graceful_shutdown(stop)
        .await?;
    reporter.abort();
    engine.runtime.join();
    tracing::info!("shut down");
    Ok(())
}

/// While draining, new generation requests get 503; everything else (health, models) and the
/// requests already in flight go on.
async fn refuse_when_draining(
    State(draining): State<Arc<AtomicBool>>,
    request: Request,
    next: Next,
) -> Response {
    if draining.load(Ordering::SeqCst) && request.method() == axum::http::Method::POST {
        return ApiError::Unavailable("the engine is draining before it stops".into())
            .into_response();
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxd_protocol::control::Limits;

    fn launch(options: &[(&str, &str)]) -> Launch {
        Launch {
            version: PROTOCOL_VERSION,
            model: "m".into(),
            socket_path: "/tmp/s".into(),
            limits: Limits {
                max_batch_size: Some(8),
                kv_budget_bytes: Some(1 << 20),
                context_length: None,
            },
            options: options
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn limits_and_options_become_runtime_limits() {
        let l = runtime_limits(&launch(&[("prompt_cache", "0.5"), ("kv_bits", "8")])).unwrap();
        assert_eq!(l.max_batch_size, 8);
        assert_eq!(l.kv_budget_bytes, Some(1 << 20));
        assert_eq!(l.prompt_cache_bytes, 1 << 29);
        assert_eq!(
            l.kv_quant,
            Some(KvQuant {
                bits: 8,
                group_size: 64
            })
        );
        let l = runtime_limits(&launch(&[])).unwrap();
        assert_eq!(l.kv_quant, None);
        assert_eq!(
            l.prompt_cache_bytes,
            RuntimeLimits::default().prompt_cache_bytes
        );
    }

    #[test]
    fn unknown_or_out_of_range_options_are_refused_with_the_reason() {
        for (opts, needle) in [
            (&[("kv_bits", "5")][..], "expected 4 or 8"),
            (&[("prompt_cache", "-1")][..], "between 0 and"),
            (&[("kv_group_size", "64")][..], "needs kv_bits"),
            (
                &[("kv_bits", "4"), ("kv_group_size", "48")][..],
                "32, 64 or 128",
            ),
            (
                &[("speculative", "yes")][..],
                "unknown option (known: prompt_cache",
            ),
        ] {
            let e = runtime_limits(&launch(opts))
                .expect_err("refused")
                .to_string();
            assert!(e.contains(needle), "{opts:?}: {e}");
        }
    }
}
