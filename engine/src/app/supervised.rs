//! Supervised mode (`--control`): an engine under `mlxd`, speaking the control channel
//! (launch, load progress, ready, stats, spill, drain, fatal reports).
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use mlxd_ipc::control::{ChildChannel, ControlSender, ParentEvent};
use mlxd_protocol::control::{
    ChildMsg, FatalKind, Launch, Limits, LoadPhase, Ready, Spilled, SsdStats, Stats,
    PROTOCOL_VERSION,
};
use tokio::sync::Notify;

use super::load::{load_in_group, Engine};
use super::options::launch_options;
use crate::cache::ssd::{SsdCounters, SsdHandle};
use crate::distributed::replica::EXIT_GROUP_BROKEN;
use crate::loader::LoadReporter;
use crate::runtime::FatalHook;
use crate::server::{self, ApiError};

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
            crate::fault::arm(spec);
        }
        Ok(None) => {}
        Err(e) => {
            tracing::error!(error = %e, "invalid fault switch");
            fatal_exit(&control, FatalKind::LoadFailed, e, 2);
        }
    }
    let oom_control = control.clone();
    let on_fatal: FatalHook = Box::new(move |kind, message| {
        let code = match kind {
            FatalKind::OutOfMemory => {
                tracing::error!(%message, "out of memory; exiting so the supervisor restarts the engine smaller");
                super::memory_watch::EXIT_OUT_OF_MEMORY
            }
            _ => {
                tracing::error!(%message, "the GPU failed; exiting so the supervisor restarts the engine");
                EXIT_DEVICE_LOST
            }
        };
        fatal_exit(&oom_control, kind, message, code);
    });
    let _ = control.send_loading(LoadPhase::Starting, 0.0);
    if let Some(delay) = crate::fault::load_delay() {
        tracing::warn!(
            delay_ms = delay.as_millis() as u64,
            "slowing the load down (MLXD_FAULT)"
        );
        std::thread::sleep(delay);
    }
    // An engine group's rank 0 starts the other ranks and joins them first.
    let group_control = control.clone();
    let on_rank_failure: super::group_launch::OnRankFailure = Arc::new(move |message| {
        // Before Ready the supervisor reports it as the load's failure, after as a crash;
        // either way it restarts the whole group.
        FATAL_EXIT.store(EXIT_GROUP_BROKEN, Ordering::SeqCst);
        let _ = group_control.send_fatal(FatalKind::Internal, message);
    });
    // A step that hangs (a rank stopped, a network stalled) is reported the same way.
    let hang_report = on_rank_failure.clone();
    crate::distributed::replica::report_hangs_to(Box::new(move |why| hang_report(why.into())));
    let group = match super::group_launch::lead_group(&launch, home, on_rank_failure) {
        Ok(group) => group,
        Err(e) => {
            tracing::error!(error = %e, "engine group failed");
            let (kind, message) = e.report(&launch.model, home);
            fatal_exit(&control, kind, message, 2);
        }
    };
    // A single engine watches its model thread; a group's ranks watch their own steps.
    let step_timeout = group.is_none().then_some(options.limits.step_timeout);
    // Likewise the memory-pressure watch, for a single engine only.
    let memory_watch = options
        .limits
        .memory_watch
        .filter(|_| group.is_none())
        .map(|window| super::memory_watch::Bounds {
            window,
            slowdown: f64::from(options.limits.memory_watch_slowdown),
        });
    let engine = match load_in_group(
        &launch.model,
        home,
        options.limits,
        options.draft,
        Some(on_fatal),
        Some(loading_reporter(control.clone())),
        group,
    ) {
        Ok(engine) => engine,
        Err(e) => {
            tracing::error!(error = %e, "load failed");
            let (kind, message) = e.report(&launch.model, home);
            fatal_exit(&control, kind, message, 2);
        }
    };
    *ssd.lock().expect("ssd lock") = engine.runtime.ssd.clone();
    if let Some(bound) = step_timeout {
        // The default depends on the device, which the load has selected by now.
        let bound = bound.unwrap_or_else(crate::runtime::default_step_timeout);
        super::step_watch::spawn(
            engine.runtime.stats.clone(),
            bound,
            exit_with(
                &control,
                FatalKind::Internal,
                super::step_watch::EXIT_STALLED,
                "stalled; exiting so the supervisor restarts the engine",
            ),
        )?;
    }
    if let Some(bounds) = memory_watch {
        let on = super::memory_watch::spawn(
            engine.runtime.stats.clone(),
            bounds,
            exit_with(
                &control,
                FatalKind::OutOfMemory,
                super::memory_watch::EXIT_OUT_OF_MEMORY,
                "out of memory; exiting so the supervisor restarts the engine",
            ),
        )?;
        if !on {
            tracing::debug!("no memory-pressure watch: the device does not report its free memory");
        }
    }
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
/// The exit status of an engine whose GPU failed under it
/// ([`GenerationError::DeviceLost`](crate::runtime::request::GenerationError::DeviceLost)).
pub const EXIT_DEVICE_LOST: i32 = 5;

/// A watch's way out: logs `what` with the watch's message, reports it as `kind` and exits
/// with `code` ([`fatal_exit`]).
fn exit_with(
    control: &ControlSender,
    kind: FatalKind,
    code: i32,
    what: &'static str,
) -> Box<dyn FnOnce(String) + Send> {
    let control = control.clone();
    Box::new(move |message| {
        tracing::error!(%message, "{what}");
        fatal_exit(&control, kind, message, code)
    })
}

fn fatal_exit(control: &ControlSender, kind: FatalKind, message: String, code: i32) -> ! {
    FATAL_EXIT.store(code, Ordering::SeqCst);
    let _ = control.send_fatal(kind, message);
    // `_exit`, not `exit`: another thread may be inside MLX, and running C++'s static
    // destructors under it aborted an H100 engine after its out-of-memory report ("double free
    // or corruption", 2026-12-05). The report is written and flushed above; logs go to stderr
    // unbuffered.
    // SAFETY: `_exit` takes any status and has no memory-safety preconditions.
    unsafe { libc::_exit(code) }
}

async fn serve_supervised(
    engine: Engine,
    launch: Launch,
    control: ControlSender,
    draining: Arc<AtomicBool>,
    shutdown: Arc<Notify>,
) -> anyhow::Result<()> {
    let listener = mlxd_ipc::socket::bind_unix(&launch.socket_path)?;
    // The model is loaded: its GPU context exists, and the supervisor learns of this
    // process's death sooner through a descriptor opened after it.
    control.move_above_gpu()?;
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
        limits: Some(Limits {
            max_batch_size: Some(engine.runtime.in_force.max_batch_size as u32),
            kv_budget_bytes: engine.runtime.in_force.kv_budget_bytes,
            context_length: Some(info.context_length as u32),
        }),
    })?;
    tracing::info!(socket = %launch.socket_path.display(), device = %engine.device, "ready");

    let stats = engine.runtime.stats.clone();
    let stats_control = control.clone();
    let reporter = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut memory_unreadable = false;
        loop {
            tick.tick().await;
            let memory = match super::memory::snapshot() {
                Ok(m) => Some(m),
                Err(e) => {
                    // Said once: the figures are then left out of each report.
                    if !std::mem::replace(&mut memory_unreadable, true) {
                        tracing::warn!(error = %e, "memory figures left out of the stats");
                    }
                    None
                }
            };
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
                memory,
                prefix: *stats.prefix.lock().unwrap_or_else(|p| p.into_inner()),
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
}
