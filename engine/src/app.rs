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

use crate::runtime::request::is_out_of_memory;
use crate::runtime::{OomHook, Runtime, RuntimeLimits};
use crate::server::{self, ApiError, ServerState};
use crate::store::{self, ResolvedModel};
use crate::tokenizer::Tokenizer;

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

    let defaults = RuntimeLimits::default();
    let limits = RuntimeLimits {
        max_batch_size: launch
            .limits
            .max_batch_size
            .map_or(defaults.max_batch_size, |n| n as usize),
        kv_budget_bytes: launch.limits.kv_budget_bytes,
        context_length: launch.limits.context_length.map(|n| n as usize),
        prompt_cache_bytes: defaults.prompt_cache_bytes,
        prefill_chunk: defaults.prefill_chunk,
        kv_quant: defaults.kv_quant,
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
