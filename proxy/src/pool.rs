//! The pool actor: one task owns the table `model id → engine state`; everyone else
//! sends it a [`Command`] with a oneshot reply through a cloneable [`PoolHandle`].
//!
//! Today the table holds the single configured model and every requested model name
//! routes to it. The pool policy of issue 4 (LRU eviction, max engines, memory budget,
//! TTL) belongs in [`Pool`] beside `acquire`.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlxd_protocol::control::{Limits, Ready, Stats};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::engine::{self, DeathWatch, EngineEvent, EngineHandle, EngineMsg, EngineSpec};
use crate::error::ProxyError;
use crate::exit::{ExitCause, ExitReport};
use crate::policy::{shrink_after_oom, CrashHistory, Decision, RestartPolicy};

/// Permission to send one request to one engine generation.
#[derive(Debug, Clone)]
pub struct Lease {
    pub model: String,
    pub socket: PathBuf,
    pub generation: u64,
    /// Resolves with the exit report if this engine dies.
    pub death: DeathWatch,
}

type Reply<T> = oneshot::Sender<T>;

#[derive(Debug)]
enum Command {
    Acquire {
        model: Option<String>,
        /// Do not hand out this engine generation (it was found dead).
        not_generation: Option<u64>,
        reply: Reply<Result<Lease, ProxyError>>,
    },
    Status {
        reply: Reply<Vec<EngineStatus>>,
    },
    Reset {
        model: Option<String>,
        reply: Reply<Vec<String>>,
    },
    Shutdown {
        reply: Reply<()>,
    },
}

/// The HTTP side's handle on the pool.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    tx: mpsc::Sender<Command>,
    queue_timeout: Duration,
}

impl PoolHandle {
    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Option<oneshot::Receiver<T>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.ok()?;
        Some(rx)
    }

    /// A lease on a ready engine for `model`, waiting (bounded) while it starts.
    pub async fn acquire(&self, model: Option<String>) -> Result<Lease, ProxyError> {
        self.acquire_avoiding(model, None).await
    }

    /// Like [`acquire`](Self::acquire), but never returns engine generation
    /// `not_generation` (one the caller found dead before the pool heard of its exit).
    pub async fn acquire_avoiding(
        &self,
        model: Option<String>,
        not_generation: Option<u64>,
    ) -> Result<Lease, ProxyError> {
        let label = model.clone().unwrap_or_else(|| "(default)".into());
        let rx = self
            .ask(|reply| Command::Acquire {
                model,
                not_generation,
                reply,
            })
            .await
            .ok_or(ProxyError::ShuttingDown)?;
        match tokio::time::timeout(self.queue_timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ProxyError::ShuttingDown),
            Err(_) => Err(ProxyError::Unavailable {
                model: label,
                state: "still starting",
                retry_after: Duration::from_secs(2),
            }),
        }
    }

    pub async fn status(&self) -> Vec<EngineStatus> {
        match self.ask(|reply| Command::Status { reply }).await {
            Some(rx) => rx.await.unwrap_or_default(),
            None => Vec::new(),
        }
    }

    /// Clears the failed state (and crash history) of `model`, or of all models.
    /// Returns the models that were reset.
    pub async fn reset(&self, model: Option<String>) -> Vec<String> {
        match self.ask(|reply| Command::Reset { model, reply }).await {
            Some(rx) => rx.await.unwrap_or_default(),
            None => Vec::new(),
        }
    }

    /// Stops every engine (Shutdown → SIGTERM → SIGKILL) and waits for them to exit.
    pub async fn shutdown(&self) {
        if let Some(rx) = self.ask(|reply| Command::Shutdown { reply }).await {
            let _ = rx.await;
        }
    }
}

/// One row of `GET /engines`.
#[derive(Debug, Clone, Serialize)]
pub struct EngineStatus {
    pub model: String,
    pub state: &'static str,
    pub pid: Option<u32>,
    pub socket: PathBuf,
    pub generation: u64,
    pub restarts: u32,
    pub crashes_in_window: usize,
    pub uptime_s: Option<f64>,
    pub loading_progress: Option<f32>,
    pub queued_requests: usize,
    pub last_exit: Option<LastExit>,
    pub ready: Option<ReadyInfo>,
    pub stats: Option<StatsInfo>,
    pub limits: LimitsInfo,
}

#[derive(Debug, Clone, Serialize)]
pub struct LastExit {
    pub cause: String,
    pub code: &'static str,
    pub at_unix_s: u64,
    pub stderr_tail: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReadyInfo {
    pub model_id: String,
    pub weight_bytes: u64,
    pub kv_bytes_per_token: u64,
    pub context_length: u32,
    pub capabilities: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatsInfo {
    pub active: u32,
    pub queued: u32,
    pub kv_bytes: u64,
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimitsInfo {
    pub max_batch_size: Option<u32>,
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<u32>,
}

#[derive(Debug, Clone)]
enum State {
    /// Not started (on-demand start at the first request).
    Idle,
    Starting,
    Ready,
    /// Asked to stop; waiting for the exit.
    Draining,
    Restarting {
        at: Instant,
    },
    Failed {
        cause: String,
        since: Instant,
    },
    Stopped,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::Draining => "draining",
            Self::Restarting { .. } => "restarting",
            Self::Failed { .. } => "failed",
            Self::Stopped => "stopped",
        }
    }
}

struct Slot {
    model: String,
    socket: PathBuf,
    state: State,
    engine: Option<EngineHandle>,
    generation: u64,
    restarts: u32,
    history: CrashHistory,
    limits: Limits,
    last_exit: Option<(Arc<ExitReport>, SystemTime)>,
    ready_at: Option<Instant>,
    ready: Option<Ready>,
    stats: Option<Stats>,
    progress: Option<f32>,
    waiters: VecDeque<Reply<Result<Lease, ProxyError>>>,
}

impl Slot {
    fn lease(&self) -> Option<Lease> {
        self.engine.as_ref().map(|e| Lease {
            model: self.model.clone(),
            socket: self.socket.clone(),
            generation: e.generation,
            death: e.death(),
        })
    }

    fn fail_waiters(&mut self, err: &ProxyError) {
        for w in self.waiters.drain(..) {
            let _ = w.send(Err(err.clone()));
        }
    }

    fn status(&self, now: Instant) -> EngineStatus {
        EngineStatus {
            model: self.model.clone(),
            state: self.state.name(),
            pid: self.engine.as_ref().map(|e| e.pid),
            socket: self.socket.clone(),
            generation: self.generation,
            restarts: self.restarts,
            crashes_in_window: self.history.recent(),
            uptime_s: self.ready_at.map(|t| now.duration_since(t).as_secs_f64()),
            loading_progress: self.progress,
            queued_requests: self.waiters.iter().filter(|w| !w.is_closed()).count(),
            last_exit: self.last_exit.as_ref().map(|(r, at)| LastExit {
                cause: r.summary(),
                code: r.cause.code(),
                at_unix_s: at
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                stderr_tail: r.stderr_tail.iter().rev().take(20).rev().cloned().collect(),
            }),
            ready: self.ready.as_ref().map(|r| ReadyInfo {
                model_id: r.model_id.clone(),
                weight_bytes: r.weight_bytes,
                kv_bytes_per_token: r.kv_bytes_per_token,
                context_length: r.context_length,
                capabilities: r.capabilities.clone(),
            }),
            stats: self.stats.as_ref().map(|s| StatsInfo {
                active: s.active,
                queued: s.queued,
                kv_bytes: s.kv_bytes,
                memory_bytes: s.memory_bytes,
            }),
            limits: LimitsInfo {
                max_batch_size: self.limits.max_batch_size,
                kv_budget_bytes: self.limits.kv_budget_bytes,
                context_length: self.limits.context_length,
            },
        }
    }
}

/// Deadlines the actor set for itself, delivered back to it by timer tasks.
#[derive(Debug)]
enum Timer {
    RestartDue { model: String, generation: u64 },
    LoadDeadline { model: String, generation: u64 },
}

/// The actor's state.
struct Pool {
    config: Arc<Config>,
    policy: RestartPolicy,
    slots: BTreeMap<String, Slot>,
    engine_tx: mpsc::UnboundedSender<EngineMsg>,
    timer_tx: mpsc::UnboundedSender<Timer>,
    shutdown_replies: Vec<Reply<()>>,
    shutting_down: bool,
}

/// Starts the pool actor for `config`, with engine sockets in `runtime_dir`.
pub fn start(
    config: Arc<Config>,
    runtime_dir: PathBuf,
) -> Result<PoolHandle, mlxd_ipc::socket::SocketError> {
    let (tx, rx) = mpsc::channel(1024);
    let (engine_tx, engine_rx) = mpsc::unbounded_channel();
    let (timer_tx, timer_rx) = mpsc::unbounded_channel();
    let mut slots = BTreeMap::new();
    let socket = mlxd_ipc::socket::engine_socket_path(&runtime_dir, 0)?;
    slots.insert(
        config.model.clone(),
        Slot {
            model: config.model.clone(),
            socket,
            state: State::Idle,
            engine: None,
            generation: 0,
            restarts: 0,
            history: CrashHistory::default(),
            limits: Limits::from(&config.limits),
            last_exit: None,
            ready_at: None,
            ready: None,
            stats: None,
            progress: None,
            waiters: VecDeque::new(),
        },
    );
    let pool = Pool {
        policy: RestartPolicy::from_config(&config),
        config: config.clone(),
        slots,
        engine_tx,
        timer_tx,
        shutdown_replies: Vec::new(),
        shutting_down: false,
    };
    tokio::spawn(pool.run(rx, engine_rx, timer_rx));
    Ok(PoolHandle {
        tx,
        queue_timeout: config.queue_timeout(),
    })
}

impl Pool {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut engines: mpsc::UnboundedReceiver<EngineMsg>,
        mut timers: mpsc::UnboundedReceiver<Timer>,
    ) {
        let mut handles_gone = false;
        loop {
            tokio::select! {
                cmd = commands.recv(), if !handles_gone => match cmd {
                    Some(cmd) => self.command(cmd),
                    // Every handle is gone: stop the engines and finish.
                    None => {
                        handles_gone = true;
                        if !self.shutting_down {
                            self.begin_shutdown();
                        }
                    }
                },
                Some(msg) = engines.recv() => self.engine_event(msg),
                Some(timer) = timers.recv() => match timer {
                    Timer::RestartDue { model, generation } => self.restart_due(&model, generation),
                    Timer::LoadDeadline { model, generation } => self.load_deadline(&model, generation),
                },
            }
            if self.shutting_down && self.slots.values().all(|s| s.engine.is_none()) {
                for r in self.shutdown_replies.drain(..) {
                    let _ = r.send(());
                }
                info!("all engines stopped");
                return;
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Acquire {
                model,
                not_generation,
                reply,
            } => self.acquire(model, not_generation, reply),
            Command::Status { reply } => {
                let now = Instant::now();
                let _ = reply.send(self.slots.values().map(|s| s.status(now)).collect());
            }
            Command::Reset { model, reply } => {
                let mut reset = Vec::new();
                for slot in self.slots.values_mut() {
                    if model.as_ref().is_some_and(|m| *m != slot.model) {
                        continue;
                    }
                    slot.history.reset();
                    slot.restarts = 0;
                    if matches!(slot.state, State::Failed { .. }) {
                        info!(model = %slot.model, "failed state cleared by admin reset");
                        slot.state = State::Idle;
                        reset.push(slot.model.clone());
                    }
                }
                let _ = reply.send(reset);
            }
            Command::Shutdown { reply } => {
                self.shutdown_replies.push(reply);
                if !self.shutting_down {
                    self.begin_shutdown();
                }
            }
        }
    }

    /// Which slot serves a requested model name. One model for now: all names map to it.
    fn resolve(&self, requested: Option<&str>) -> String {
        match requested {
            Some(m) if self.slots.contains_key(m) => m.to_string(),
            _ => self.config.model.clone(),
        }
    }

    fn acquire(
        &mut self,
        requested: Option<String>,
        not_generation: Option<u64>,
        reply: Reply<Result<Lease, ProxyError>>,
    ) {
        if self.shutting_down {
            let _ = reply.send(Err(ProxyError::ShuttingDown));
            return;
        }
        let key = self.resolve(requested.as_deref());
        let now = Instant::now();
        let cooldown = Duration::from_millis(self.config.failed_cooldown_ms);
        let capacity = self.config.queue_capacity;
        let Some(slot) = self.slots.get_mut(&key) else {
            let _ = reply.send(Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            ))));
            return;
        };
        let known_dead = not_generation.is_some()
            && not_generation == slot.engine.as_ref().map(|e| e.generation);
        let retry_after = match &slot.state {
            // Its exit is on the way: wait in the queue for the restart.
            State::Ready if known_dead => Duration::from_secs(1),
            State::Ready => {
                let _ = reply.send(slot.lease().ok_or_else(|| {
                    ProxyError::Internal(format!("model {key} is ready without an engine"))
                }));
                return;
            }
            State::Failed { cause, since } => {
                let elapsed = now.duration_since(*since);
                if elapsed < cooldown {
                    let _ = reply.send(Err(ProxyError::Failed {
                        model: key,
                        cause: cause.clone(),
                        retry_after: cooldown - elapsed,
                    }));
                    return;
                }
                info!(model = %key, "failed cool-down over; starting again");
                slot.history.reset();
                slot.state = State::Idle;
                Duration::from_secs(1)
            }
            State::Draining => {
                let _ = reply.send(Err(ProxyError::ShuttingDown));
                return;
            }
            State::Restarting { at } => at.saturating_duration_since(now) + Duration::from_secs(1),
            State::Idle | State::Stopped | State::Starting => Duration::from_secs(1),
        };
        slot.waiters.retain(|w| !w.is_closed());
        if slot.waiters.len() >= capacity {
            let _ = reply.send(Err(ProxyError::QueueFull {
                model: key,
                capacity,
                retry_after,
            }));
            return;
        }
        slot.waiters.push_back(reply);
        if matches!(slot.state, State::Idle | State::Stopped) {
            self.start(&key);
        }
    }

    fn spec(&self, slot: &Slot) -> EngineSpec {
        let c = &self.config;
        EngineSpec {
            model: slot.model.clone(),
            bin: c.engine_bin(),
            args: c.engine_args.clone(),
            env: c.engine_env.clone(),
            socket_path: slot.socket.clone(),
            limits: slot.limits.clone(),
            options: c.engine_options.clone(),
            stop_timeout: c.grace(),
            restarts: slot.restarts,
        }
    }

    fn start(&mut self, key: &str) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let spec = self.spec(slot);
        let slot = self.slots.get_mut(key).expect("slot checked above");
        slot.generation += 1;
        slot.progress = None;
        slot.ready = None;
        slot.stats = None;
        match engine::spawn(spec.clone(), slot.generation, self.engine_tx.clone()) {
            Ok(handle) => {
                slot.engine = Some(handle);
                slot.state = State::Starting;
                let generation = slot.generation;
                self.after(
                    Duration::from_millis(self.config.load_timeout_ms),
                    Timer::LoadDeadline {
                        model: key.to_string(),
                        generation,
                    },
                );
            }
            Err(e) => {
                let report = Arc::new(engine::spawn_failure_report(&spec, &e));
                error!(model = %key, cause = %report.cause, "engine could not be spawned");
                self.exited(key, report);
            }
        }
    }

    fn engine_event(&mut self, msg: EngineMsg) {
        let Some(slot) = self.slots.get_mut(&msg.model) else {
            return;
        };
        if msg.generation != slot.generation {
            return;
        }
        match msg.event {
            EngineEvent::Loading { progress } => slot.progress = Some(progress),
            EngineEvent::Stats(s) => slot.stats = Some(s),
            EngineEvent::Ready(r) => {
                if !matches!(slot.state, State::Starting) {
                    return;
                }
                info!(model = %slot.model, generation = slot.generation, model_id = %r.model_id, "engine ready");
                slot.state = State::Ready;
                slot.ready_at = Some(Instant::now());
                slot.ready = Some(r);
                slot.progress = Some(1.0);
                if let Some(lease) = slot.lease() {
                    for w in slot.waiters.drain(..) {
                        let _ = w.send(Ok(lease.clone()));
                    }
                }
            }
            EngineEvent::Exited(report) => {
                let key = msg.model.clone();
                self.exited(&key, report);
            }
        }
    }

    fn exited(&mut self, key: &str, report: Arc<ExitReport>) {
        let now = Instant::now();
        let policy = self.policy;
        let shutting_down = self.shutting_down;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        slot.engine = None;
        slot.stats = None;
        slot.last_exit = Some((report.clone(), SystemTime::now()));
        let ready_for = slot.ready_at.take().map(|t| now.duration_since(t));
        if shutting_down || report.cause.is_requested() {
            slot.state = State::Stopped;
            slot.fail_waiters(&ProxyError::ShuttingDown);
            return;
        }
        if matches!(report.cause, ExitCause::OutOfMemory { .. }) {
            if let Some(smaller) = shrink_after_oom(&slot.limits) {
                warn!(
                    model = %key,
                    old = ?slot.limits,
                    new = ?smaller,
                    "out of memory: restarting with smaller limits"
                );
                slot.limits = smaller;
            }
        }
        match slot.history.on_crash(&policy, now, ready_for) {
            Decision::Restart { delay, attempt } => {
                slot.restarts += 1;
                slot.state = State::Restarting { at: now + delay };
                warn!(
                    model = %key,
                    cause = %report.cause,
                    delay_ms = delay.as_millis() as u64,
                    attempt,
                    "restarting engine after backoff"
                );
                send_after(
                    self.timer_tx.clone(),
                    delay,
                    Timer::RestartDue {
                        model: key.to_string(),
                        generation: slot.generation,
                    },
                );
            }
            Decision::Fail { crashes } => {
                let cause = report.summary();
                error!(
                    model = %key,
                    crashes,
                    window_s = policy.window.as_secs(),
                    cause = %cause,
                    "too many crashes; model marked failed"
                );
                let err = ProxyError::Failed {
                    model: key.to_string(),
                    cause: cause.clone(),
                    retry_after: Duration::from_millis(self.config.failed_cooldown_ms),
                };
                slot.state = State::Failed { cause, since: now };
                slot.fail_waiters(&err);
            }
        }
    }

    /// Delivers `timer` back to the actor after `delay`.
    fn after(&self, delay: Duration, timer: Timer) {
        send_after(self.timer_tx.clone(), delay, timer);
    }

    fn load_deadline(&mut self, key: &str, generation: u64) {
        let timeout_ms = self.config.load_timeout_ms;
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        if slot.generation != generation || !matches!(slot.state, State::Starting) {
            return;
        }
        if let Some(engine) = &slot.engine {
            engine.kill(format!(
                "not ready within the load timeout of {timeout_ms} ms"
            ));
        }
    }

    fn restart_due(&mut self, key: &str, generation: u64) {
        let due = self.slots.get(key).is_some_and(|s| {
            s.generation == generation && matches!(s.state, State::Restarting { .. })
        });
        if due && !self.shutting_down {
            self.start(key);
        }
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        for slot in self.slots.values_mut() {
            slot.fail_waiters(&ProxyError::ShuttingDown);
            if let Some(engine) = slot.engine.as_mut() {
                info!(model = %slot.model, pid = engine.pid, "stopping engine");
                engine.stop();
                slot.state = State::Draining;
            } else if !matches!(slot.state, State::Failed { .. }) {
                slot.state = State::Stopped;
            }
        }
    }
}

fn send_after(tx: mpsc::UnboundedSender<Timer>, delay: Duration, timer: Timer) {
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let _ = tx.send(timer);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_with_missing_engine(dir: &std::path::Path) -> PoolHandle {
        let config = Config {
            engine_bin: Some("/nonexistent/mlxd-engine".into()),
            queue_timeout_ms: 60_000,
            ..Config::default()
        };
        start(Arc::new(config), dir.to_path_buf()).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_then_mark_the_model_failed() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool_with_missing_engine(dir.path());
        let t = Instant::now();
        let err = pool.acquire(Some("any-name".into())).await.unwrap_err();
        // Five failures, with 250 + 500 + 1000 + 2000 ms of backoff between them.
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(3750) && waited < Duration::from_millis(3800),
            "{waited:?}"
        );
        match &err {
            ProxyError::Failed { cause, .. } => assert!(cause.contains("cannot start"), "{cause}"),
            other => panic!("{other:?}"),
        }
        let st = pool.status().await;
        assert_eq!(st[0].state, "failed");
        assert_eq!(st[0].restarts, 4);
        assert_eq!(st[0].last_exit.as_ref().unwrap().code, "load_failed");

        // Failed: answered at once, no new attempt.
        let again = pool.acquire(None).await.unwrap_err();
        assert!(matches!(again, ProxyError::Failed { .. }));
        assert_eq!(pool.status().await[0].generation, 5);

        assert_eq!(pool.reset(None).await, vec![Config::default().model]);
        assert_eq!(pool.status().await[0].state, "idle");
        pool.shutdown().await;
        assert!(matches!(
            pool.acquire(None).await,
            Err(ProxyError::ShuttingDown)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_model_cools_down() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool_with_missing_engine(dir.path());
        let _ = pool.acquire(None).await.unwrap_err();
        tokio::time::advance(Duration::from_millis(Config::default().failed_cooldown_ms)).await;
        // The cool-down is over: a new round of attempts, failing again.
        let _ = pool.acquire(None).await.unwrap_err();
        assert_eq!(pool.status().await[0].generation, 10);
    }
}
