//! Start-up glue for the `mlxd-engine` binary: resolve the model, load it on the MLX thread,
//! serve HTTP on a unix socket, and (under `mlxd`) speak the control channel.
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use mlxd_ipc::control::{ChildChannel, ControlSender, ParentEvent};
use mlxd_protocol::control::{
    ChildMsg, Device, FatalKind, Launch, LoadPhase, Ready, Spilled, SsdStats, Stats,
    PROTOCOL_VERSION,
};
use mlxd_protocol::engine_options::{Draft, EngineOptions, OptionError};
use tokio::sync::Notify;

use crate::cache::ssd::{SsdConfig, SsdCounters, SsdHandle};
use crate::cache::KvQuant;
use crate::loader::LoadReporter;
use crate::runtime::draft::{DraftSource, NgramSizes, Speculation};
use crate::runtime::{OomHook, Runtime, RuntimeLimits};
use crate::server::{self, ApiError, ServerState};
use crate::tokenizer::Tokenizer;
use mlxd_store::{self as store, ResolvedModel};

pub use crate::start_error::StartError;

/// The engine options `mlxd` passes in `Launch.options` (`[server.engine_options]` and a
/// model's `options` in `mlxd.toml`), each with what it takes: the one definition in
/// `mlxd_protocol::engine_options`.
pub use mlxd_protocol::engine_options::KEYS as ENGINE_OPTIONS;

/// Where drafts should come from, before the draft model is resolved in the store.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftChoice {
    Ngram(NgramSizes),
    /// A model spec, as `--model` takes.
    Model(String),
}

/// Speculative decoding as asked for (`--draft`/`--draft-model`, or `Launch.options`).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftOptions {
    pub choice: DraftChoice,
    pub num_draft: usize,
}

/// What a supervised engine runs with: limits, and speculative decoding if asked for.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub limits: RuntimeLimits,
    pub draft: Option<DraftOptions>,
}

/// The options of a supervised engine: `Launch.limits` and `Launch.options` over the
/// defaults. An unknown option, a value out of its domain or a combination that cannot work is
/// an error (the rules `mlxd` applied at config load), never ignored.
pub fn launch_options(launch: &Launch) -> Result<LaunchOptions, StartError> {
    let defaults = RuntimeLimits::default();
    let limits = RuntimeLimits {
        max_batch_size: launch
            .limits
            .max_batch_size
            .map_or(defaults.max_batch_size, |n| n as usize),
        kv_budget_bytes: launch.limits.kv_budget_bytes,
        context_length: launch.limits.context_length.map(|n| n as usize),
        ..defaults
    };
    let options = EngineOptions::from_map(&launch.options).map_err(option_error)?;
    runtime_options(&options, limits)
}

fn option_error(e: OptionError) -> StartError {
    StartError::Option {
        key: e.key,
        value: e.value,
        reason: e.reason,
    }
}

/// What checked engine options (from `Launch.options` or the flags) mean for the runtime,
/// over `limits`.
pub fn runtime_options(
    options: &EngineOptions,
    mut limits: RuntimeLimits,
) -> Result<LaunchOptions, StartError> {
    options.check().map_err(option_error)?;
    limits.prompt_cache_bytes = options.prompt_cache_bytes();
    limits.kv_quant = options.kv_quant().map(|(bits, group_size)| KvQuant {
        bits: bits as i32,
        group_size: group_size as i32,
    });
    limits.quantized_kv_start = options.quantized_kv_start.unwrap_or(0) as usize;
    if let Some(n) = options.state_snapshot_every {
        limits.state_snapshot_every = n as usize;
    }
    limits.ssd = options.ssd_cache.clone().map(|dir| SsdConfig {
        dir,
        max_bytes: options.ssd_cache_max_bytes(),
        demote_idle: options.ssd_demote_idle.map(Duration::from_secs_f64),
        checkpoint_every: options.generation_checkpoint.map(|n| n as usize),
    });
    let choice = match (options.draft, &options.draft_model) {
        (Some(Draft::Ngram), _) => {
            let (min, max) = options.ngram_sizes();
            let sizes = NgramSizes::new(min as usize, max as usize).map_err(|reason| {
                StartError::Option {
                    key: "ngram_min".into(),
                    value: min.to_string(),
                    reason,
                }
            })?;
            Some(DraftChoice::Ngram(sizes))
        }
        (None, Some(spec)) => Some(DraftChoice::Model(spec.clone())),
        (None, None) => None,
    };
    Ok(LaunchOptions {
        limits,
        draft: choice.map(|choice| DraftOptions {
            choice,
            num_draft: options.num_draft_tokens() as usize,
        }),
    })
}

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
    on_oom: Option<OomHook>,
) -> Result<Engine, StartError> {
    load_reporting(spec, home, limits, draft, on_oom, None)
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
    mut limits: RuntimeLimits,
    draft: Option<DraftOptions>,
    on_oom: Option<OomHook>,
    reporter: Option<LoadReporter>,
) -> Result<Engine, StartError> {
    crate::mlx_runtime::check_mlx_version().map_err(StartError::Mlx)?;
    let request = crate::mlx_runtime::device_request_from_env().map_err(StartError::Device)?;
    let device = crate::mlx_runtime::select_device(request).map_err(StartError::Device)?;
    tracing::info!(device = %device, "device selected");
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
    let runtime = Runtime::start_reporting(model.dir.clone(), limits, on_oom, reporter).map_err(
        |source| StartError::Load {
            dir: model.dir.clone(),
            source,
        },
    )?;
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
    let ssd: Arc<Mutex<Option<SsdHandle>>> = Arc::default();
    {
        let (draining, shutdown) = (draining.clone(), shutdown.clone());
        let (ssd, control) = (ssd.clone(), control.clone());
        channel.watch_parent(move |event| match event {
            ParentEvent::Drain => draining.store(true, Ordering::SeqCst),
            ParentEvent::Spill => spill(ssd.lock().expect("ssd lock").clone(), control.clone()),
            ParentEvent::Shutdown => {
                draining.store(true, Ordering::SeqCst);
                shutdown.notify_one();
            }
            // The supervisor is gone: nobody can reach us any more. If a fatal report is on
            // its way out, its exit status stands (the supervisor may close our stdin as soon
            // as it has read the report).
            ParentEvent::Closed | ParentEvent::Broken(_) => {
                std::process::exit(FATAL_EXIT.load(Ordering::SeqCst))
            }
        });
    }

    let options = match launch_options(&launch) {
        Ok(options) => options,
        Err(e) => {
            tracing::error!(error = %e, "invalid engine options");
            let (kind, message) = e.report(&launch.model, home);
            fatal_exit(&control, kind, message, 2);
        }
    };
    match crate::fault::from_env() {
        Ok(Some(spec)) => {
            let fault_control = control.clone();
            crate::fault::arm(
                spec,
                Box::new(move |message| {
                    tracing::error!(%message, "out of memory; exiting so the supervisor restarts the engine");
                    fatal_exit(&fault_control, FatalKind::OutOfMemory, message, 3);
                }),
            );
        }
        Ok(None) => {}
        Err(e) => {
            tracing::error!(error = %e, "invalid fault switch");
            fatal_exit(&control, FatalKind::LoadFailed, e, 2);
        }
    }
    let oom_control = control.clone();
    let on_oom: OomHook = Box::new(move |message| {
        tracing::error!(%message, "out of memory; exiting so the supervisor restarts the engine");
        fatal_exit(&oom_control, FatalKind::OutOfMemory, message, 3);
    });
    let _ = control.send_loading(LoadPhase::Starting, 0.0);
    if let Some(delay) = crate::fault::load_delay() {
        tracing::warn!(
            delay_ms = delay.as_millis() as u64,
            "slowing the load down (MLXD_FAULT)"
        );
        std::thread::sleep(delay);
    }
    let engine = match load_reporting(
        &launch.model,
        home,
        options.limits,
        options.draft,
        Some(on_oom),
        Some(loading_reporter(control.clone())),
    ) {
        Ok(engine) => engine,
        Err(e) => {
            tracing::error!(error = %e, "load failed");
            let (kind, message) = e.report(&launch.model, home);
            fatal_exit(&control, kind, message, 2);
        }
    };
    *ssd.lock().expect("ssd lock") = engine.runtime.ssd.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve_supervised(
        engine, launch, control, draining, shutdown,
    ))
}

/// How long a `Spill` waits for the SSD writer before answering.
const SPILL_WAIT: Duration = Duration::from_secs(10);

/// Answers `Spill`: every prefix-cache entry is written behind as it is stored, so a spill
/// waits (at most [`SPILL_WAIT`], on a thread of its own) for the writer's queue to empty.
fn spill(ssd: Option<SsdHandle>, control: ControlSender) {
    let Some(ssd) = ssd else {
        let _ = control.send(&ChildMsg::Spilled(Spilled {
            complete: true,
            ..Spilled::default()
        }));
        return;
    };
    let work = move || {
        let r = ssd.flush(SPILL_WAIT);
        let report = Spilled {
            files: r.files,
            bytes: r.bytes,
            complete: r.complete,
        };
        tracing::info!(
            files = report.files,
            bytes = report.bytes,
            complete = report.complete,
            "prefix cache spilled to the SSD tier"
        );
        let _ = control.send(&ChildMsg::Spilled(report));
    };
    if let Err(e) = std::thread::Builder::new()
        .name("ssd-spill".into())
        .spawn(work)
    {
        tracing::warn!(error = %e, "could not start the spill");
    }
}

/// The SSD tier's counters as `Stats` reports them.
fn ssd_stats(c: &SsdCounters) -> SsdStats {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    SsdStats {
        files: get(&c.files),
        bytes: get(&c.bytes),
        hits: get(&c.hits),
        restored_tokens: get(&c.restored_tokens),
        writes: get(&c.writes),
        checkpoints: get(&c.checkpoints),
        invalid: get(&c.invalid),
        write_errors: get(&c.write_errors),
    }
}

/// Sends the load's progress to the supervisor as `Loading` frames: each new phase, and
/// within a phase each step of at least a hundredth (a download reports every chunk).
fn loading_reporter(control: ControlSender) -> LoadReporter {
    let last = std::sync::Mutex::new(None::<(LoadPhase, f32)>);
    Arc::new(move |phase, fraction| {
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        if worth_reporting(*last, (phase, fraction)) {
            *last = Some((phase, fraction));
            // A broken channel ends the engine through the parent watch; nothing to do here.
            let _ = control.send_loading(phase, fraction);
        }
    })
}

/// Whether a progress step is worth a frame after `last`: a new phase, the phase's end, or
/// a hundredth more of it.
pub fn worth_reporting(last: Option<(LoadPhase, f32)>, next: (LoadPhase, f32)) -> bool {
    match last {
        None => true,
        Some((phase, _)) if phase != next.0 => true,
        Some((_, done)) => next.1 >= done + 0.01 || (next.1 >= 1.0 && done < 1.0),
    }
}

/// The exit status of a fatal report in progress (0 while there is none), for the parent
/// watch: a supervisor that closes our stdin after reading the report must not turn a failed
/// load into a clean exit.
static FATAL_EXIT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Reports `kind` to the supervisor and exits with `code`.
fn fatal_exit(control: &ControlSender, kind: FatalKind, message: String, code: i32) -> ! {
    FATAL_EXIT.store(code, Ordering::SeqCst);
    let _ = control.send_fatal(kind, message);
    std::process::exit(code)
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
        state_bytes_per_sequence: info.state_bytes_per_sequence as u64,
        context_length: info.context_length as u32,
        capabilities: vec![
            "chat".into(),
            "completions".into(),
            "stream".into(),
            "token_ids".into(),
        ],
        device: engine.device.clone(),
    })?;
    tracing::info!(socket = %launch.socket_path.display(), device = %engine.device, "ready");

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
                drafted_tokens: stats.drafted.load(Ordering::Relaxed),
                accepted_tokens: stats.accepted.load(Ordering::Relaxed),
                ssd: ssd_stats(&stats.ssd),
                prefilling: stats.prefilling.load(Ordering::Relaxed) as u32,
                prefill_tokens_left: stats.prefill_tokens_left.load(Ordering::Relaxed),
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

    #[test]
    fn progress_frames_for_new_phases_ends_and_hundredths() {
        use LoadPhase::*;
        assert!(worth_reporting(None, (Starting, 0.0)));
        assert!(worth_reporting(Some((Starting, 0.0)), (Weights, 0.0)));
        assert!(!worth_reporting(
            Some((Downloading, 0.5)),
            (Downloading, 0.505)
        ));
        assert!(worth_reporting(
            Some((Downloading, 0.5)),
            (Downloading, 0.52)
        ));
        assert!(worth_reporting(Some((Weights, 0.995)), (Weights, 1.0)));
        assert!(!worth_reporting(Some((Weights, 1.0)), (Weights, 1.0)));
    }

    #[test]
    fn limits_and_options_become_runtime_limits() {
        let o = launch_options(&launch(&[("prompt_cache", "0.5"), ("kv_bits", "8")])).unwrap();
        assert_eq!(o.draft, None);
        let l = o.limits;
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
        let l = launch_options(&launch(&[])).unwrap().limits;
        assert_eq!(l.kv_quant, None);
        assert_eq!(
            l.prompt_cache_bytes,
            RuntimeLimits::default().prompt_cache_bytes
        );
    }

    #[test]
    fn ssd_options_become_the_tier_config() {
        let o = launch_options(&launch(&[
            ("ssd_cache", "/var/cache/kv"),
            ("ssd_cache_max", "2"),
            ("ssd_demote_idle", "30"),
            ("generation_checkpoint", "64"),
        ]))
        .unwrap();
        assert_eq!(
            o.limits.ssd,
            Some(SsdConfig {
                dir: "/var/cache/kv".into(),
                max_bytes: Some(2 << 30),
                demote_idle: Some(Duration::from_secs(30)),
                checkpoint_every: Some(64),
            })
        );
        let unlimited = launch_options(&launch(&[("ssd_cache", "d"), ("ssd_cache_max", "0")]))
            .unwrap()
            .limits
            .ssd
            .unwrap();
        assert_eq!(unlimited.max_bytes, None);
        assert_eq!(launch_options(&launch(&[])).unwrap().limits.ssd, None);
    }

    #[test]
    fn draft_options_become_speculation() {
        let o = launch_options(&launch(&[("draft", "ngram"), ("ngram_max", "6")])).unwrap();
        assert_eq!(
            o.draft,
            Some(DraftOptions {
                choice: DraftChoice::Ngram(NgramSizes { min: 2, max: 6 }),
                num_draft: crate::runtime::draft::DEFAULT_NUM_DRAFT,
            })
        );
        let o = launch_options(&launch(&[
            ("draft_model", "tiny"),
            ("num_draft_tokens", "5"),
        ]))
        .unwrap();
        assert_eq!(
            o.draft,
            Some(DraftOptions {
                choice: DraftChoice::Model("tiny".into()),
                num_draft: 5,
            })
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
            (&[("draft", "eagle")][..], "expected \"ngram\""),
            (
                &[("draft", "ngram"), ("draft_model", "smollm2-135m")][..],
                "exclude each other",
            ),
            (&[("ngram_max", "3")][..], "needs draft"),
            (&[("quantized_kv_start", "256")][..], "needs kv_bits"),
            (
                &[("kv_bits", "8"), ("quantized_kv_start", "-1")][..],
                "a number of tokens",
            ),
            (&[("num_draft_tokens", "3")][..], "needs draft"),
            (&[("generation_checkpoint", "8")][..], "needs ssd_cache"),
            (&[("ssd_cache_max", "1")][..], "needs ssd_cache"),
            (
                &[("ssd_cache", "/tmp/x"), ("generation_checkpoint", "0")][..],
                "from 1 to",
            ),
            (
                &[("ssd_cache", "/tmp/x"), ("ssd_demote_idle", "-3")][..],
                "seconds > 0",
            ),
            (&[("ssd_cache", " ")][..], "expected a directory"),
            (
                &[("draft", "ngram"), ("num_draft_tokens", "0")][..],
                "1 to 16",
            ),
            (
                &[("draft", "ngram"), ("ngram_min", "4"), ("ngram_max", "2")][..],
                "ngram_min <= ngram_max",
            ),
        ] {
            let e = launch_options(&launch(opts))
                .expect_err("refused")
                .to_string();
            assert!(e.contains(needle), "{opts:?}: {e}");
        }
    }
}
