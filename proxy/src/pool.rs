//! The pool actor: one task owns the table `model id → engine state` and all pool
//! policy; everyone else sends it a [`Command`] with a oneshot reply through a
//! cloneable [`PoolHandle`].
//!
//! Policy (the decisions themselves are in [`crate::placement`]): an engine starts on
//! the first request for its model, if it fits within `max_engines` and the memory
//! budget; otherwise least-recently-used idle, unpinned engines are drained and stopped
//! first, or the request waits (bounded) for busy engines, or it is refused with the
//! numbers. Idle engines stop after their TTL. Pinned models start with the pool and
//! are never evicted. Every request holds an in-flight guard ([`Lease`]) until its
//! response body ends, so the pool knows which engines are busy.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlxd_protocol::control::{LoadPhase, ParentMsg, Ready, SsdStats, Stats};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::catalog::{Catalog, ModelEntry};
use crate::config::Config;
use crate::engine::{self, DeathWatch, EngineEvent, EngineHandle, EngineMsg, EngineSpec};
use crate::error::ProxyError;
use crate::exit::{ExitCause, ExitReport};
use crate::logs::{Logs, ModelLog};
use crate::metrics::{EvictionLabels, Metrics};
use crate::placement::{self, Budget, Plan, Resident, Shortfall};
use crate::policy::{CrashHistory, Decision, KvCapacity, ModelLimits, RestartPolicy};
use crate::reload::ReloadPlan;

/// Permission to send one request to one engine generation. The engine counts as busy
/// until every clone of the lease is dropped.
#[derive(Debug, Clone)]
pub struct Lease {
    pub model: String,
    pub socket: PathBuf,
    pub generation: u64,
    /// Resolves with the exit report if this engine dies.
    pub death: DeathWatch,
    /// What the engine can hold (known once it is ready and has a KV budget), so that a
    /// request it could never serve is refused before it is sent.
    pub kv: Option<KvCapacity>,
    _in_flight: Arc<InFlight>,
}

/// Tells the pool when a request is over.
#[derive(Debug)]
struct InFlight {
    model: String,
    generation: u64,
    tx: mpsc::UnboundedSender<(String, u64)>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // The pool is gone only at shutdown; nothing to count then.
        let _ = self
            .tx
            .send((std::mem::take(&mut self.model), self.generation));
    }
}

type Reply<T> = oneshot::Sender<T>;

#[derive(Debug)]
enum Command {
    Acquire {
        model: String,
        /// Do not hand out this engine generation (it was found dead).
        not_generation: Option<u64>,
        reply: Reply<Result<Lease, ProxyError>>,
    },
    Unload {
        model: String,
        reply: Reply<Result<(), ProxyError>>,
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
    /// Managed jobs (`crate::jobs`): count a job's memory against the budget, if it fits.
    ReserveJob {
        job: String,
        bytes: u64,
        reply: Reply<crate::jobs::admission::Admission>,
    },
    ReleaseJob {
        job: String,
    },
    /// Apply a reloaded configuration (SIGHUP).
    Reload {
        catalog: Arc<Catalog>,
        config: Arc<Config>,
        memory_budget: u64,
        reply: Reply<ReloadPlan>,
    },
}

/// The HTTP side's handle on the pool.
#[derive(Debug, Clone)]
pub struct PoolHandle {
    tx: mpsc::Sender<Command>,
    queue_timeout: Duration,
    /// How long an acquire may wait at most: the pool answers every waiter itself (after
    /// the queue timeout, or when the load it waits for ends), so this only guards against
    /// a pool that stopped answering.
    acquire_backstop: Duration,
}

impl PoolHandle {
    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Option<oneshot::Receiver<T>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).await.ok()?;
        Some(rx)
    }

    /// A lease on a ready engine for model `id`, waiting while it starts: up to the queue
    /// timeout for room or a restart, and for a load in progress until it ends (bounded by
    /// the load timeout), answered with the load's error if it fails.
    pub async fn acquire(&self, id: &str) -> Result<Lease, ProxyError> {
        self.acquire_avoiding(id, None).await
    }

    /// Like [`acquire`](Self::acquire), but never returns engine generation
    /// `not_generation` (one the caller found dead before the pool heard of its exit).
    pub async fn acquire_avoiding(
        &self,
        id: &str,
        not_generation: Option<u64>,
    ) -> Result<Lease, ProxyError> {
        let rx = self
            .ask(|reply| Command::Acquire {
                model: id.to_string(),
                not_generation,
                reply,
            })
            .await
            .ok_or(ProxyError::ShuttingDown)?;
        match tokio::time::timeout(self.acquire_backstop, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ProxyError::ShuttingDown),
            Err(_) => Err(ProxyError::Unavailable {
                model: id.to_string(),
                state: "still starting",
                retry_after: Duration::from_secs(2),
            }),
        }
    }

    /// Loads model `id` (as a request would) and waits until it is ready.
    pub async fn load(&self, id: &str) -> Result<(), ProxyError> {
        self.acquire(id).await.map(drop)
    }

    /// Drains and stops model `id`'s engine (in-flight requests finish first); waits
    /// for the exit, up to the queue timeout.
    pub async fn unload(&self, id: &str) -> Result<(), ProxyError> {
        let rx = self
            .ask(|reply| Command::Unload {
                model: id.to_string(),
                reply,
            })
            .await
            .ok_or(ProxyError::ShuttingDown)?;
        match tokio::time::timeout(self.queue_timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ProxyError::ShuttingDown),
            Err(_) => Err(ProxyError::Unavailable {
                model: id.to_string(),
                state: "still draining",
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

    /// Counts `bytes` for job `job` against the memory budget if the job's admission policy
    /// ([`crate::jobs::admission::admit`]) says it fits beside the engines and other jobs.
    pub async fn reserve_job(&self, job: &str, bytes: u64) -> crate::jobs::admission::Admission {
        let rx = self
            .ask(|reply| Command::ReserveJob {
                job: job.to_string(),
                bytes,
                reply,
            })
            .await;
        match rx {
            Some(rx) => rx
                .await
                .unwrap_or(crate::jobs::admission::Admission::ShuttingDown),
            None => crate::jobs::admission::Admission::ShuttingDown,
        }
    }

    /// Gives back what [`reserve_job`](Self::reserve_job) counted for `job`.
    pub async fn release_job(&self, job: &str) {
        let _ = self
            .tx
            .send(Command::ReleaseJob {
                job: job.to_string(),
            })
            .await;
    }

    /// Applies a reloaded configuration: added models become servable (pinned ones start),
    /// removed ones drain and go, changed ones take their new settings at the next load.
    /// Returns what changed; `None` once the pool has stopped.
    pub async fn reload(
        &self,
        catalog: Arc<Catalog>,
        config: Arc<Config>,
        memory_budget: u64,
    ) -> Option<ReloadPlan> {
        let rx = self
            .ask(|reply| Command::Reload {
                catalog,
                config,
                memory_budget,
                reply,
            })
            .await?;
        rx.await.ok()
    }

    /// Stops every engine (Shutdown → SIGTERM → SIGKILL) and waits for them to exit.
    pub async fn shutdown(&self) {
        if let Some(rx) = self.ask(|reply| Command::Shutdown { reply }).await {
            let _ = rx.await;
        }
    }
}

/// One row of `GET /engines` (every configured model, running or not).
#[derive(Debug, Clone, Serialize)]
pub struct EngineStatus {
    pub model: String,
    pub aliases: Vec<String>,
    pub source: String,
    pub pinned: bool,
    /// Fine-grained: idle, queued, starting, ready, draining, restarting, failed, stopped.
    pub state: &'static str,
    /// Coarse, for `/v1/models`: loaded, loading, unloaded, failed.
    pub availability: &'static str,
    pub failure: Option<String>,
    pub pid: Option<u32>,
    pub socket: PathBuf,
    pub generation: u64,
    pub restarts: u32,
    pub crashes_in_window: usize,
    pub uptime_s: Option<f64>,
    pub idle_s: Option<f64>,
    pub ttl_s: Option<f64>,
    pub loading_progress: Option<f32>,
    /// What the load is doing (`starting`, `downloading`, `converting`, `weights`) while
    /// `loading_progress` runs through it.
    pub loading_phase: Option<&'static str>,
    /// The running engine's device, as `mlxd ps` shows it: `cpu`, `gpu (cuda)`.
    pub device: Option<String>,
    /// False once a configuration reload removed the model: it drains, then disappears.
    pub configured: bool,
    pub in_flight: u32,
    pub queued_requests: usize,
    /// Counted against the budget now (reported once ready, planned before).
    pub memory_bytes: u64,
    /// What a start would plan for.
    pub planned_bytes: u64,
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
    /// Where the engine computes: `{"kind": "gpu", "backend": "cuda"}`.
    pub device: mlxd_protocol::control::Device,
}

#[derive(Debug, Clone, Serialize)]
pub struct StatsInfo {
    pub active: u32,
    pub queued: u32,
    pub kv_bytes: u64,
    pub memory_bytes: u64,
    /// Speculative drafts proposed and accepted by the running engine.
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// The SSD KV tier of the running engine (absent without `ssd_cache`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd: Option<SsdStats>,
}

/// The limits the next engine is launched with; `reduced` (with the configured ones and
/// when they come back) after out-of-memory exits halved them.
#[derive(Debug, Clone, Serialize)]
pub struct LimitsInfo {
    pub max_batch_size: Option<u32>,
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<u32>,
    pub reduced: bool,
    pub configured_max_batch_size: Option<u32>,
    pub configured_kv_budget_bytes: Option<u64>,
    /// Seconds until the configured limits return (absent when not reduced).
    pub recovers_in_s: Option<f64>,
}

#[derive(Debug, Clone)]
enum State {
    /// Not started (on-demand start at the first request).
    Idle,
    /// Wants an engine; waiting for room (engine slots or memory).
    Queued {
        ticket: u64,
    },
    Starting,
    Ready,
    /// Drained (no new requests) and stopping once in-flight requests are done.
    Draining,
    Restarting {
        at: Instant,
    },
    Failed {
        cause: String,
        since: Instant,
        /// The engine said the load cannot succeed as asked (not a crash loop).
        cannot_load: bool,
    },
    Stopped,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Queued { .. } => "queued",
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::Draining => "draining",
            Self::Restarting { .. } => "restarting",
            Self::Failed { .. } => "failed",
            Self::Stopped => "stopped",
        }
    }

    fn availability(&self) -> &'static str {
        match self {
            Self::Ready | Self::Draining => "loaded",
            Self::Queued { .. } | Self::Starting | Self::Restarting { .. } => "loading",
            Self::Idle | Self::Stopped => "unloaded",
            Self::Failed { .. } => "failed",
        }
    }
}

struct Slot {
    entry: ModelEntry,
    log: Arc<ModelLog>,
    socket: PathBuf,
    state: State,
    engine: Option<EngineHandle>,
    generation: u64,
    restarts: u32,
    history: CrashHistory,
    limits: ModelLimits,
    /// The limits the running engine was launched with.
    engine_limits: Option<mlxd_protocol::control::Limits>,
    /// Restart the engine once idle: its limits are smaller than the model's now are.
    recycle: bool,
    last_exit: Option<(Arc<ExitReport>, SystemTime)>,
    spawned_at: Option<Instant>,
    ready_at: Option<Instant>,
    ready: Option<Ready>,
    stats: Option<Stats>,
    /// When the running engine last showed it was alive (`Ready`, then each `Stats`).
    heartbeat: Option<Instant>,
    progress: Option<f32>,
    phase: Option<LoadPhase>,
    /// A reload removed the model: no new requests; the slot goes once its engine is gone.
    removed: bool,
    in_flight: u32,
    last_used: Instant,
    /// The largest footprint an engine of this model has reported.
    observed_bytes: u64,
    /// An idle check is pending (one timer per slot, re-armed while the engine is used).
    idle_timer: bool,
    waiters: VecDeque<Waiter>,
    unload_replies: Vec<Reply<Result<(), ProxyError>>>,
}

/// A request waiting for its model's engine.
#[derive(Debug)]
struct Waiter {
    /// Names its queue-timeout timer.
    id: u64,
    reply: Reply<Result<Lease, ProxyError>>,
}

impl Waiter {
    fn is_closed(&self) -> bool {
        self.reply.is_closed()
    }

    /// Answers the request; a waiter that gave up meanwhile is simply gone.
    fn send(self, result: Result<Lease, ProxyError>) {
        let _ = self.reply.send(result);
    }
}

impl Slot {
    fn new(entry: ModelEntry, log: Arc<ModelLog>, socket: PathBuf, now: Instant) -> Self {
        Self {
            limits: ModelLimits::new(entry.limits.clone()),
            entry,
            log,
            socket,
            state: State::Idle,
            engine: None,
            generation: 0,
            restarts: 0,
            history: CrashHistory::default(),
            engine_limits: None,
            recycle: false,
            last_exit: None,
            spawned_at: None,
            ready_at: None,
            ready: None,
            stats: None,
            heartbeat: None,
            progress: None,
            phase: None,
            removed: false,
            in_flight: 0,
            last_used: now,
            observed_bytes: 0,
            idle_timer: false,
            waiters: VecDeque::new(),
            unload_replies: Vec::new(),
        }
    }

    fn id(&self) -> &str {
        &self.entry.id
    }

    /// What the running engine can hold, for [`crate::policy::check_kv`].
    fn kv_capacity(&self, policy: &RestartPolicy, now: Instant) -> Option<KvCapacity> {
        let ready = self.ready.as_ref()?;
        let budget = self.engine_limits.as_ref()?.kv_budget_bytes?;
        let configured = self.limits.configured().kv_budget_bytes;
        Some(KvCapacity {
            kv_bytes_per_token: ready.kv_bytes_per_token,
            context_length: ready.context_length,
            budget,
            configured_budget: configured,
            recovers_in: (configured != Some(budget)).then(|| {
                self.limits
                    .recovers_at(policy)
                    .map_or(Duration::from_secs(1), |at| {
                        at.saturating_duration_since(now)
                    })
                    .max(Duration::from_secs(1))
            }),
        })
    }

    /// Hands out a lease and counts the request as in flight.
    fn grant(
        &mut self,
        release: &mpsc::UnboundedSender<(String, u64)>,
        policy: &RestartPolicy,
    ) -> Option<Lease> {
        let kv = self.kv_capacity(policy, Instant::now());
        let e = self.engine.as_ref()?;
        self.in_flight += 1;
        self.last_used = Instant::now();
        Some(Lease {
            model: self.entry.id.clone(),
            socket: self.socket.clone(),
            generation: e.generation,
            death: e.death(),
            kv,
            _in_flight: Arc::new(InFlight {
                model: self.entry.id.clone(),
                generation: e.generation,
                tx: release.clone(),
            }),
        })
    }

    fn live_waiters(&mut self) -> usize {
        self.waiters.retain(|w| !w.is_closed());
        self.waiters.len()
    }

    fn fail_waiters(&mut self, err: &ProxyError) {
        for w in self.waiters.drain(..) {
            w.send(Err(err.clone()));
        }
    }

    /// What the engine reports: weights plus KV cache, or its total memory.
    fn reported_bytes(&self) -> u64 {
        let weights = self.ready.as_ref().map_or(0, |r| r.weight_bytes);
        let (kv, total) = self
            .stats
            .as_ref()
            .map_or((0, 0), |s| (s.kv_bytes, s.memory_bytes));
        (weights + kv).max(total)
    }

    /// Memory to plan for before a start.
    fn planned_bytes(&self) -> u64 {
        self.entry.planned_bytes.max(self.observed_bytes)
    }

    /// Memory counted for the running engine: reported once ready, planned before.
    fn footprint(&self) -> u64 {
        match self.state {
            State::Ready | State::Draining if self.reported_bytes() > 0 => self.reported_bytes(),
            _ => self.planned_bytes(),
        }
    }

    /// Holds (or is about to hold) resources.
    fn resident(&self) -> bool {
        self.engine.is_some() || matches!(self.state, State::Restarting { .. })
    }

    fn status(&self, now: Instant, policy: &RestartPolicy) -> EngineStatus {
        let failure = match &self.state {
            State::Failed { cause, .. } => Some(cause.clone()),
            _ => None,
        };
        EngineStatus {
            model: self.entry.id.clone(),
            aliases: self.entry.aliases.clone(),
            source: self.entry.source.clone(),
            pinned: self.entry.pinned,
            state: self.state.name(),
            availability: self.state.availability(),
            failure,
            pid: self.engine.as_ref().map(|e| e.pid),
            socket: self.socket.clone(),
            generation: self.generation,
            restarts: self.restarts,
            crashes_in_window: self.history.recent(),
            uptime_s: self.ready_at.map(|t| now.duration_since(t).as_secs_f64()),
            idle_s: (self.engine.is_some() && self.in_flight == 0)
                .then(|| now.duration_since(self.last_used).as_secs_f64()),
            ttl_s: (!self.entry.ttl.is_zero() && !self.entry.pinned)
                .then_some(self.entry.ttl.as_secs_f64()),
            loading_progress: self.progress,
            loading_phase: self.phase.map(LoadPhase::name),
            device: self.ready.as_ref().map(|r| r.device.to_string()),
            configured: !self.removed,
            in_flight: self.in_flight,
            queued_requests: self.waiters.iter().filter(|w| !w.is_closed()).count(),
            memory_bytes: if self.resident() { self.footprint() } else { 0 },
            planned_bytes: self.planned_bytes(),
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
                device: r.device.clone(),
            }),
            stats: self.stats.as_ref().map(|s| StatsInfo {
                active: s.active,
                queued: s.queued,
                kv_bytes: s.kv_bytes,
                memory_bytes: s.memory_bytes,
                drafted_tokens: s.drafted_tokens,
                accepted_tokens: s.accepted_tokens,
                ssd: (s.ssd != SsdStats::default()).then_some(s.ssd),
            }),
            limits: {
                let (cur, conf) = (self.limits.current(), self.limits.configured());
                LimitsInfo {
                    max_batch_size: cur.max_batch_size,
                    kv_budget_bytes: cur.kv_budget_bytes,
                    context_length: cur.context_length,
                    reduced: self.limits.reduced(),
                    configured_max_batch_size: conf.max_batch_size,
                    configured_kv_budget_bytes: conf.kv_budget_bytes,
                    recovers_in_s: self
                        .limits
                        .recovers_at(policy)
                        .map(|at| at.saturating_duration_since(now).as_secs_f64()),
                }
            },
        }
    }
}

/// Deadlines the actor set for itself, delivered back to it by timer tasks.
#[derive(Debug)]
enum Timer {
    RestartDue {
        model: String,
        generation: u64,
    },
    LoadDeadline {
        model: String,
        generation: u64,
    },
    IdleCheck {
        model: String,
    },
    LimitsRecovery {
        model: String,
    },
    CapacityDeadline {
        model: String,
        ticket: u64,
    },
    HangCheck {
        model: String,
        generation: u64,
    },
    /// A waiter's queue timeout is over.
    WaiterDeadline {
        model: String,
        waiter: u64,
    },
}

/// What the actor needs besides the configuration.
pub struct PoolParts {
    pub catalog: Arc<Catalog>,
    pub runtime_dir: PathBuf,
    pub metrics: Arc<Metrics>,
    pub logs: Logs,
    /// Memory all engines together may use.
    pub memory_budget: u64,
}

/// Starts an engine process (a simulated one in unit tests).
pub(crate) type Spawner = Arc<
    dyn Fn(EngineSpec, u64, mpsc::UnboundedSender<EngineMsg>) -> std::io::Result<EngineHandle>
        + Send
        + Sync,
>;

/// The actor's state.
struct Pool {
    config: Arc<Config>,
    spawner: Spawner,
    policy: RestartPolicy,
    budget: Budget,
    metrics: Arc<Metrics>,
    slots: BTreeMap<String, Slot>,
    /// Models waiting for room, first come first served.
    queue: VecDeque<String>,
    next_ticket: u64,
    engine_tx: mpsc::UnboundedSender<EngineMsg>,
    timer_tx: mpsc::UnboundedSender<Timer>,
    release_tx: mpsc::UnboundedSender<(String, u64)>,
    shutdown_replies: Vec<Reply<()>>,
    shutting_down: bool,
    /// Memory counted for running managed jobs, by job id.
    jobs: BTreeMap<String, u64>,
    /// The catalog the slots were made from (a reload is diffed against it).
    catalog: Arc<Catalog>,
    runtime_dir: PathBuf,
    logs: Logs,
    /// The socket index the next added model gets.
    next_socket: usize,
    next_waiter: u64,
    /// The last engine generation of models removed by a reload: a model added again
    /// continues from it, so no timer or lease of its old engines matches the new ones.
    retired_generations: BTreeMap<String, u64>,
}

/// Starts the pool actor; pinned models start loading at once.
pub fn start(
    config: Arc<Config>,
    parts: PoolParts,
) -> Result<PoolHandle, mlxd_ipc::socket::SocketError> {
    start_with(config, parts, Arc::new(engine::spawn))
}

pub(crate) fn start_with(
    config: Arc<Config>,
    parts: PoolParts,
    spawner: Spawner,
) -> Result<PoolHandle, mlxd_ipc::socket::SocketError> {
    let (tx, rx) = mpsc::channel(1024);
    let (engine_tx, engine_rx) = mpsc::unbounded_channel();
    let (timer_tx, timer_rx) = mpsc::unbounded_channel();
    let (release_tx, release_rx) = mpsc::unbounded_channel();
    let mut slots = BTreeMap::new();
    let now = Instant::now();
    for (i, entry) in parts.catalog.models.iter().enumerate() {
        let socket = mlxd_ipc::socket::engine_socket_path(&parts.runtime_dir, i)?;
        let log = parts.logs.get_or_create(&entry.id);
        slots.insert(entry.id.clone(), Slot::new(entry.clone(), log, socket, now));
    }
    parts
        .metrics
        .memory_budget
        .set(i64::try_from(parts.memory_budget).unwrap_or(i64::MAX));
    info!(
        models = ?parts.catalog.ids(),
        default = %parts.catalog.default_model,
        max_engines = config.pool.max_engines,
        memory_budget = parts.memory_budget,
        "model pool"
    );
    let mut pool = Pool {
        spawner,
        policy: RestartPolicy::from_config(&config),
        budget: Budget {
            max_engines: config.pool.max_engines,
            memory_bytes: parts.memory_budget,
        },
        metrics: parts.metrics,
        config: config.clone(),
        slots,
        queue: VecDeque::new(),
        next_ticket: 0,
        engine_tx,
        timer_tx,
        release_tx,
        shutdown_replies: Vec::new(),
        shutting_down: false,
        jobs: BTreeMap::new(),
        next_socket: parts.catalog.models.len(),
        catalog: parts.catalog.clone(),
        runtime_dir: parts.runtime_dir.clone(),
        logs: parts.logs.clone(),
        next_waiter: 0,
        retired_generations: BTreeMap::new(),
    };
    let pinned: Vec<String> = parts
        .catalog
        .models
        .iter()
        .filter(|m| m.pinned)
        .map(|m| m.id.clone())
        .collect();
    tokio::spawn(async move {
        for id in pinned {
            pool.enqueue(&id);
        }
        pool.run(rx, engine_rx, timer_rx, release_rx).await
    });
    Ok(PoolHandle {
        tx,
        queue_timeout: config.queue_timeout(),
        acquire_backstop: config.queue_timeout()
            + Duration::from_millis(config.server.load_timeout_ms)
            + Duration::from_secs(60),
    })
}

impl Pool {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut engines: mpsc::UnboundedReceiver<EngineMsg>,
        mut timers: mpsc::UnboundedReceiver<Timer>,
        mut releases: mpsc::UnboundedReceiver<(String, u64)>,
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
                Some((model, generation)) = releases.recv() => self.release(&model, generation),
                Some(timer) = timers.recv() => match timer {
                    Timer::RestartDue { model, generation } => self.restart_due(&model, generation),
                    Timer::LoadDeadline { model, generation } => self.load_deadline(&model, generation),
                    Timer::IdleCheck { model } => self.idle_check(&model),
                    Timer::LimitsRecovery { model } => self.limits_recovery(&model),
                    Timer::CapacityDeadline { model, ticket } => self.capacity_deadline(&model, ticket),
                    Timer::HangCheck { model, generation } => self.hang_check(&model, generation),
                    Timer::WaiterDeadline { model, waiter } => self.waiter_deadline(&model, waiter),
                },
            }
            self.refresh_gauges();
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
            } => self.acquire(&model, not_generation, reply),
            Command::Unload { model, reply } => self.unload(&model, reply),
            Command::Status { reply } => {
                let now = Instant::now();
                let policy = self.policy;
                let _ = reply.send(
                    self.slots
                        .values()
                        .map(|s| s.status(now, &policy))
                        .collect(),
                );
            }
            Command::Reset { model, reply } => {
                let mut reset = Vec::new();
                let mut restored = Vec::new();
                for slot in self.slots.values_mut() {
                    if model.as_ref().is_some_and(|m| m != slot.id()) {
                        continue;
                    }
                    slot.history.reset();
                    slot.restarts = 0;
                    let failed = matches!(slot.state, State::Failed { .. });
                    if failed {
                        info!(model = %slot.id(), "failed state cleared by admin reset");
                        slot.state = State::Idle;
                    }
                    if slot.limits.restore() {
                        info!(model = %slot.id(), limits = ?slot.limits.current(), "configured limits restored by admin reset");
                        slot.log
                            .push("[mlxd] configured limits restored (admin reset)");
                        restored.push(slot.id().to_string());
                    }
                    if failed || restored.last().is_some_and(|r| r == slot.id()) {
                        reset.push(slot.id().to_string());
                    }
                }
                for key in restored {
                    self.apply_limits(&key);
                }
                let _ = reply.send(reset);
            }
            Command::Shutdown { reply } => {
                self.shutdown_replies.push(reply);
                if !self.shutting_down {
                    self.begin_shutdown();
                }
            }
            Command::ReserveJob { job, bytes, reply } => {
                let _ = reply.send(self.reserve_job(job, bytes));
            }
            Command::ReleaseJob { job } => {
                if self.jobs.remove(&job).is_some() {
                    self.place();
                }
            }
            Command::Reload {
                catalog,
                config,
                memory_budget,
                reply,
            } => {
                let plan = self.reload(catalog, config, memory_budget);
                let _ = reply.send(plan);
            }
        }
    }

    /// Admits a job's memory against the budget beside the engines and the other jobs.
    fn reserve_job(&mut self, job: String, bytes: u64) -> crate::jobs::admission::Admission {
        use crate::jobs::admission::{admit, Admission, MemorySnapshot};
        if self.shutting_down {
            return Admission::ShuttingDown;
        }
        let residents = self.residents();
        let snapshot = MemorySnapshot {
            budget: self.budget.memory_bytes,
            engines: residents.iter().map(|r| r.bytes).sum(),
            pinned: residents
                .iter()
                .filter(|r| r.pinned && !r.leaving)
                .map(|r| r.bytes)
                .sum(),
            jobs: self.jobs.values().sum(),
        };
        let admission = admit(bytes, &snapshot);
        if admission == Admission::Start {
            self.jobs.insert(job, bytes);
        }
        admission
    }

    /// The placement plan for an engine that needs `needed` bytes, with running jobs'
    /// memory taken out of the budget. A model that would fit but for the jobs waits for
    /// them rather than being refused.
    fn plan_beside_jobs(&self, needed: u64) -> Plan {
        let residents = self.residents();
        let job_bytes: u64 = self.jobs.values().sum();
        let budget = Budget {
            memory_bytes: self.budget.memory_bytes.saturating_sub(job_bytes),
            ..self.budget
        };
        match placement::plan(needed, &residents, budget) {
            Plan::RefuseMemory { needed, available } if job_bytes > 0 => {
                match placement::plan(needed, &residents, self.budget) {
                    Plan::RefuseMemory { .. } => Plan::RefuseMemory { needed, available },
                    _ => Plan::Wait(Shortfall::Memory { needed, available }),
                }
            }
            plan => plan,
        }
    }

    fn acquire(
        &mut self,
        key: &str,
        not_generation: Option<u64>,
        reply: Reply<Result<Lease, ProxyError>>,
    ) {
        if self.shutting_down {
            let _ = reply.send(Err(ProxyError::ShuttingDown));
            return;
        }
        let now = Instant::now();
        let cooldown = Duration::from_millis(self.config.server.failed_cooldown_ms);
        let capacity = self.config.server.queue_capacity;
        let max_in_flight = self.config.server.max_in_flight_per_model;
        let Some(slot) = self.slots.get_mut(key) else {
            let _ = reply.send(Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            ))));
            return;
        };
        if slot.removed {
            let _ = reply.send(Err(ProxyError::NotFound(format!(
                "model {key} was removed from the configuration"
            ))));
            return;
        }
        let known_dead = not_generation.is_some()
            && not_generation == slot.engine.as_ref().map(|e| e.generation);
        let retry_after = match &slot.state {
            // Its exit is on the way: wait in the queue for the restart.
            State::Ready if known_dead => Duration::from_secs(1),
            // The engine's own queue is bounded here, before it grows without limit.
            State::Ready if slot.in_flight >= max_in_flight => {
                let _ = reply.send(Err(ProxyError::TooManyInFlight {
                    model: key.to_string(),
                    limit: max_in_flight,
                    retry_after: Duration::from_secs(1),
                }));
                return;
            }
            State::Ready => {
                let lease = slot.grant(&self.release_tx, &self.policy).ok_or_else(|| {
                    ProxyError::Internal(format!("model {key} is ready without an engine"))
                });
                let _ = reply.send(lease);
                return;
            }
            State::Failed {
                cause,
                since,
                cannot_load,
            } => {
                let elapsed = now.duration_since(*since);
                if elapsed < cooldown {
                    let (model, cause, retry_after) =
                        (key.to_string(), cause.clone(), cooldown - elapsed);
                    let _ = reply.send(Err(if *cannot_load {
                        ProxyError::CannotLoad {
                            model,
                            cause,
                            retry_after,
                        }
                    } else {
                        ProxyError::Failed {
                            model,
                            cause,
                            retry_after,
                        }
                    }));
                    return;
                }
                info!(model = %key, "failed cool-down over; starting again");
                slot.history.reset();
                slot.state = State::Idle;
                Duration::from_secs(1)
            }
            State::Restarting { at } => at.saturating_duration_since(now) + Duration::from_secs(1),
            State::Idle
            | State::Stopped
            | State::Starting
            | State::Queued { .. }
            | State::Draining => Duration::from_secs(1),
        };
        if slot.live_waiters() >= capacity {
            let _ = reply.send(Err(ProxyError::QueueFull {
                model: key.to_string(),
                capacity,
                retry_after,
            }));
            return;
        }
        let id = self.next_waiter;
        self.next_waiter += 1;
        slot.waiters.push_back(Waiter { id, reply });
        let cold = matches!(slot.state, State::Idle | State::Stopped);
        self.after(
            self.config.queue_timeout(),
            Timer::WaiterDeadline {
                model: key.to_string(),
                waiter: id,
            },
        );
        if cold {
            self.enqueue(key);
        }
    }

    /// A waiter's queue timeout is over. Waiting for room, a restart or a drain ends here
    /// with a 503; waiting for a load in progress goes on: the load timeout bounds it, and
    /// its end (ready, or the load's error) answers the waiter.
    fn waiter_deadline(&mut self, key: &str, waiter: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if matches!(slot.state, State::Starting) {
            return;
        }
        let Some(at) = slot.waiters.iter().position(|w| w.id == waiter) else {
            return;
        };
        let state = match slot.state {
            State::Queued { .. } => "waiting for room (engine slots or memory)",
            State::Restarting { .. } => "restarting",
            State::Draining => "draining",
            _ => "still starting",
        };
        if let Some(w) = slot.waiters.remove(at) {
            w.send(Err(ProxyError::Unavailable {
                model: key.to_string(),
                state,
                retry_after: Duration::from_secs(2),
            }));
        }
    }

    /// Marks `key` as wanting an engine and tries to place it.
    fn enqueue(&mut self, key: &str) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if !matches!(slot.state, State::Idle | State::Stopped) {
            return;
        }
        slot.state = State::Queued { ticket };
        self.queue.push_back(key.to_string());
        self.after(
            self.config.pool.capacity_wait,
            Timer::CapacityDeadline {
                model: key.to_string(),
                ticket,
            },
        );
        self.place();
    }

    /// The engines that hold resources, as the placement policy sees them.
    fn residents(&self) -> Vec<Resident> {
        self.slots
            .values()
            .filter(|s| s.resident())
            .map(|s| Resident {
                id: s.entry.id.clone(),
                pinned: s.entry.pinned,
                in_flight: s.in_flight,
                last_used: s.last_used,
                bytes: s.footprint(),
                ready: matches!(s.state, State::Ready),
                leaving: matches!(s.state, State::Draining),
            })
            .collect()
    }

    /// Starts, evicts for, or refuses queued models, in arrival order. Once one has to
    /// wait, those behind it may only start if they fit without evicting anything.
    fn place(&mut self) {
        let mut blocked = false;
        let queue: Vec<String> = self.queue.iter().cloned().collect();
        for key in queue {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if !matches!(slot.state, State::Queued { .. }) {
                self.queue.retain(|k| *k != key);
                continue;
            }
            if slot.live_waiters() == 0 && !slot.entry.pinned {
                // Everyone gave up: no start.
                slot.state = State::Idle;
                self.queue.retain(|k| *k != key);
                continue;
            }
            let needed = slot.planned_bytes();
            match self.plan_beside_jobs(needed) {
                Plan::Start => {
                    self.queue.retain(|k| *k != key);
                    self.start(&key);
                }
                Plan::Evict(victims) if !blocked => {
                    blocked = true;
                    for v in victims {
                        info!(model = %v, for_model = %key, "evicting least recently used idle engine");
                        self.evict(&v, "lru");
                    }
                }
                Plan::Evict(_) | Plan::Wait(_) => blocked = true,
                Plan::RefuseMemory { needed, available } => {
                    let err = ProxyError::InsufficientMemory {
                        model: key.clone(),
                        needed,
                        available,
                        budget: self.budget.memory_bytes,
                        retry_after: None,
                    };
                    self.refuse(&key, err);
                }
                Plan::RefuseEngines {
                    max_engines,
                    pinned,
                } => {
                    let err = ProxyError::NoEngineAvailable {
                        model: key.clone(),
                        max_engines,
                        why: if pinned >= max_engines {
                            "held by pinned models"
                        } else {
                            "busy"
                        },
                        retry_after: None,
                    };
                    self.refuse(&key, err);
                }
            }
        }
    }

    fn refuse(&mut self, key: &str, err: ProxyError) {
        self.queue.retain(|k| k != key);
        if let Some(slot) = self.slots.get_mut(key) {
            warn!(model = %key, error = %err, "model cannot be loaded");
            slot.log.push(format!("[mlxd] cannot load: {err}"));
            slot.state = State::Idle;
            slot.fail_waiters(&err);
        }
    }

    /// Stops waiting for room: the request times out with what was missing.
    fn capacity_deadline(&mut self, key: &str, ticket: u64) {
        let still = self
            .slots
            .get(key)
            .is_some_and(|s| matches!(s.state, State::Queued { ticket: t } if t == ticket));
        if !still {
            return;
        }
        if self
            .slots
            .values()
            .any(|s| s.engine.is_some() && matches!(s.state, State::Draining))
        {
            // Room is being made: keep waiting; the caller's queue timeout bounds it.
            return;
        }
        let needed = self.slots[key].planned_bytes();
        let retry_after = Some(Duration::from_secs(5));
        let err = match self.plan_beside_jobs(needed) {
            Plan::Wait(Shortfall::Memory { needed, available }) => ProxyError::InsufficientMemory {
                model: key.to_string(),
                needed,
                available,
                budget: self.budget.memory_bytes,
                retry_after,
            },
            Plan::Wait(Shortfall::Engines { max_engines }) => ProxyError::NoEngineAvailable {
                model: key.to_string(),
                max_engines,
                why: "busy",
                retry_after,
            },
            // It fits, or will once evictions finish: keep waiting.
            _ => return,
        };
        self.refuse(key, err);
    }

    /// Drains `key`'s engine and stops it once its in-flight requests are done.
    fn evict(&mut self, key: &str, reason: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let Some(engine) = slot.engine.as_mut() else {
            return;
        };
        if matches!(slot.state, State::Draining) {
            return;
        }
        // The engine writes its prefix cache to the SSD tier (a bounded wait of its own)
        // while it drains, so a later engine of the model starts warm.
        engine.send(ParentMsg::Spill);
        engine.send(ParentMsg::Drain);
        slot.state = State::Draining;
        slot.log.push(format!(
            "[mlxd] unloading ({reason}); {} request(s) in flight",
            slot.in_flight
        ));
        info!(model = %key, pid = engine.pid, reason, in_flight = slot.in_flight, "draining engine");
        self.metrics
            .evictions
            .get_or_create(&EvictionLabels {
                model: key.to_string(),
                reason: reason.to_string(),
            })
            .inc();
        if slot.in_flight == 0 {
            engine.stop();
        }
    }

    fn unload(&mut self, key: &str, reply: Reply<Result<(), ProxyError>>) {
        let Some(slot) = self.slots.get_mut(key) else {
            let _ = reply.send(Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            ))));
            return;
        };
        match slot.state {
            State::Queued { .. } => {
                slot.state = State::Idle;
                slot.fail_waiters(&ProxyError::Unavailable {
                    model: key.to_string(),
                    state: "unloaded by an administrator",
                    retry_after: Duration::from_secs(1),
                });
                self.queue.retain(|k| k != key);
                let _ = reply.send(Ok(()));
            }
            _ if slot.engine.is_some() => {
                slot.unload_replies.push(reply);
                self.evict(key, "admin");
            }
            _ => {
                let _ = reply.send(Ok(()));
            }
        }
    }

    fn release(&mut self, key: &str, generation: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.generation != generation || slot.engine.is_none() {
            return;
        }
        slot.in_flight = slot.in_flight.saturating_sub(1);
        slot.last_used = Instant::now();
        if slot.in_flight > 0 {
            return;
        }
        match slot.state {
            State::Draining => {
                if let Some(e) = slot.engine.as_mut() {
                    e.stop();
                }
            }
            State::Ready if slot.recycle => self.evict(key, "limits_restored"),
            State::Ready => {
                self.arm_idle_timer(key);
                self.place();
            }
            _ => {}
        }
    }

    /// The stable period after an out-of-memory exit is over: the configured limits
    /// come back (for the next engine, and the running one is recycled once idle).
    fn limits_recovery(&mut self, key: &str) {
        let now = Instant::now();
        let policy = self.policy;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if !slot.limits.recover_if_stable(&policy, now) {
            // Not reduced any more, or a later OOM armed its own timer.
            return;
        }
        info!(model = %key, limits = ?slot.limits.current(), stable_s = policy.limits_recovery.as_secs(), "no out-of-memory exit for the stable period: configured limits restored");
        slot.log.push(format!(
            "[mlxd] configured limits restored after {} s without an out-of-memory exit",
            policy.limits_recovery.as_secs()
        ));
        self.apply_limits(key);
    }

    /// After the model's limits grew back: an engine running with smaller ones is
    /// restarted as soon as it is idle (a busy one on its last release).
    fn apply_limits(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let outdated = slot.engine.is_some()
            && slot.engine_limits.as_ref() != Some(slot.limits.current())
            && !matches!(slot.state, State::Draining);
        if !outdated {
            return;
        }
        slot.recycle = true;
        if matches!(slot.state, State::Ready) && slot.in_flight == 0 {
            self.evict(key, "limits_restored");
        }
    }

    /// Starts the idle clock's timer for `key`, unless one is pending already.
    fn arm_idle_timer(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        if slot.entry.pinned || slot.entry.ttl.is_zero() || slot.idle_timer {
            return;
        }
        slot.idle_timer = true;
        let ttl = slot.entry.ttl;
        self.after(
            ttl,
            Timer::IdleCheck {
                model: key.to_string(),
            },
        );
    }

    /// Unloads `key` if it has been idle for its TTL; otherwise checks again when the
    /// TTL would be reached (a busy engine re-arms on its last release).
    fn idle_check(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        slot.idle_timer = false;
        if !matches!(slot.state, State::Ready) || slot.in_flight > 0 || slot.entry.pinned {
            return;
        }
        let idle_for = Instant::now().duration_since(slot.last_used);
        if idle_for >= slot.entry.ttl {
            info!(model = %key, idle_s = idle_for.as_secs_f64(), "idle TTL reached");
            self.evict(key, "ttl");
        } else {
            slot.idle_timer = true;
            let left = slot.entry.ttl - idle_for;
            self.after(
                left,
                Timer::IdleCheck {
                    model: key.to_string(),
                },
            );
        }
    }

    fn spec(&self, slot: &Slot) -> EngineSpec {
        let c = &self.config.server;
        EngineSpec {
            model: slot.entry.id.clone(),
            source: slot.entry.source.clone(),
            bin: self.config.engine_bin(),
            args: c.engine_args.clone(),
            env: c.engine_env.clone(),
            socket_path: slot.socket.clone(),
            limits: slot.limits.current().clone(),
            options: slot.entry.options.clone(),
            stop_timeout: self.config.grace(),
            restarts: slot.restarts,
            log: Some(slot.log.clone()),
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
        slot.phase = None;
        slot.ready = None;
        slot.stats = None;
        slot.heartbeat = None;
        slot.in_flight = 0;
        slot.recycle = false;
        slot.engine_limits = Some(spec.limits.clone());
        slot.spawned_at = Some(Instant::now());
        self.metrics.loads.get_or_create(&Metrics::label(key)).inc();
        match (self.spawner)(spec.clone(), slot.generation, self.engine_tx.clone()) {
            Ok(handle) => {
                slot.log.push(format!(
                    "[mlxd] engine starting: pid {}, generation {}, source {}",
                    handle.pid, slot.generation, slot.entry.source
                ));
                slot.engine = Some(handle);
                slot.state = State::Starting;
                let generation = slot.generation;
                self.after(
                    Duration::from_millis(self.config.server.load_timeout_ms),
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
            EngineEvent::Loading { phase, progress } => {
                slot.phase = Some(phase);
                slot.progress = Some(progress);
            }
            EngineEvent::Stats(s) => {
                // The engine's totals restart with the process (`stats` is cleared then).
                let (drafted, accepted) = slot
                    .stats
                    .as_ref()
                    .map_or((0, 0), |p| (p.drafted_tokens, p.accepted_tokens));
                self.metrics.record_drafts(
                    &msg.model,
                    s.drafted_tokens.saturating_sub(drafted),
                    s.accepted_tokens.saturating_sub(accepted),
                );
                let before = slot
                    .stats
                    .as_ref()
                    .map_or_else(SsdStats::default, |p| p.ssd);
                self.metrics.record_ssd(&msg.model, &before, &s.ssd);
                slot.stats = Some(s);
                slot.heartbeat = Some(Instant::now());
                if matches!(slot.state, State::Ready) {
                    slot.observed_bytes = slot.observed_bytes.max(slot.reported_bytes());
                }
                // Reported memory changed what fits.
                if !self.queue.is_empty() {
                    self.place();
                }
            }
            EngineEvent::Ready(r) => {
                if !matches!(slot.state, State::Starting) {
                    return;
                }
                let now = Instant::now();
                let took = slot.spawned_at.map(|t| now.duration_since(t));
                info!(
                    model = %slot.id(),
                    generation = slot.generation,
                    model_id = %r.model_id,
                    load_ms = took.map(|d| d.as_millis() as u64),
                    "engine ready"
                );
                slot.log.push(format!(
                    "[mlxd] engine ready in {} ms (weights {} bytes)",
                    took.map_or(0, |d| d.as_millis()),
                    r.weight_bytes
                ));
                if let Some(d) = took {
                    self.metrics
                        .load_duration
                        .get_or_create(&Metrics::label(&msg.model))
                        .observe(d.as_secs_f64());
                }
                slot.state = State::Ready;
                slot.ready_at = Some(now);
                slot.heartbeat = Some(now);
                let hang_timeout = self.config.server.hang_timeout_ms;
                if hang_timeout > 0 {
                    send_after(
                        self.timer_tx.clone(),
                        Duration::from_millis(hang_timeout),
                        Timer::HangCheck {
                            model: msg.model.clone(),
                            generation: slot.generation,
                        },
                    );
                }
                slot.ready = Some(r);
                slot.progress = Some(1.0);
                slot.phase = None;
                slot.observed_bytes = slot.observed_bytes.max(slot.reported_bytes());
                let waiters: Vec<_> = slot.waiters.drain(..).collect();
                for w in waiters {
                    if w.is_closed() {
                        continue;
                    }
                    if let Some(lease) = slot.grant(&self.release_tx, &self.policy) {
                        w.send(Ok(lease));
                    }
                }
                // Loaded with nobody using it (pinned preload, admin load): idle clock.
                slot.last_used = now;
                let key = msg.model.clone();
                self.arm_idle_timer(&key);
                self.place();
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
        slot.engine_limits = None;
        slot.stats = None;
        slot.in_flight = 0;
        let recycled = std::mem::take(&mut slot.recycle);
        slot.last_exit = Some((report.clone(), SystemTime::now()));
        slot.log
            .push(format!("[mlxd] engine exited: {}", report.cause));
        let ready_for = slot.ready_at.take().map(|t| now.duration_since(t));
        for r in slot.unload_replies.drain(..) {
            let _ = r.send(Ok(()));
        }
        if shutting_down {
            slot.state = State::Stopped;
            slot.fail_waiters(&ProxyError::ShuttingDown);
            return;
        }
        if slot.removed {
            // Drained after a reload removed it: the model goes.
            self.forget(key);
            self.place();
            return;
        }
        // It exited before it was ready: its load failed.
        let load_failed = ready_for.is_none() && !report.cause.is_requested();
        if report.cause.is_requested() {
            slot.state = State::Stopped;
            // Requests that arrived while it drained get a fresh engine; so does a
            // pinned model recycled for its restored limits.
            if slot.live_waiters() > 0 || (recycled && slot.entry.pinned) {
                self.enqueue(key);
            }
            self.place();
            return;
        }
        if matches!(report.cause, ExitCause::OutOfMemory { .. }) {
            let old = slot.limits.current().clone();
            if let Some(smaller) = slot.limits.on_oom(now) {
                warn!(
                    model = %key,
                    ?old,
                    new = ?smaller,
                    recovery_s = policy.limits_recovery.as_secs(),
                    "out of memory: restarting with smaller limits"
                );
                slot.log.push(format!(
                    "[mlxd] out of memory: restarting with smaller limits {smaller:?} (configured limits return after {} s without another)",
                    policy.limits_recovery.as_secs()
                ));
            }
            if slot.limits.reduced() {
                send_after(
                    self.timer_tx.clone(),
                    policy.limits_recovery,
                    Timer::LimitsRecovery {
                        model: key.to_string(),
                    },
                );
            }
        }
        match slot.history.on_exit(&policy, &report.cause, now, ready_for) {
            Decision::Restart { delay, attempt } => {
                slot.restarts += 1;
                slot.state = State::Restarting { at: now + delay };
                self.metrics
                    .restarts
                    .get_or_create(&Metrics::label(key))
                    .inc();
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
                if load_failed {
                    // Those waiting for this load get its error, not a wait through the
                    // backoff (the next request waits for the retry).
                    slot.fail_waiters(&ProxyError::LoadFailed {
                        model: key.to_string(),
                        cause: report.summary(),
                        retry_after: delay.max(Duration::from_secs(1)),
                    });
                }
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
                    retry_after: Duration::from_millis(self.config.server.failed_cooldown_ms),
                };
                slot.state = State::Failed {
                    cause,
                    since: now,
                    cannot_load: false,
                };
                slot.fail_waiters(&err);
            }
            Decision::DoNotRetry => {
                let cause = match &report.cause {
                    ExitCause::CannotLoad { detail } => detail.clone(),
                    other => other.to_string(),
                };
                error!(model = %key, "cannot load the model: {cause}");
                slot.log
                    .push(format!("[mlxd] cannot load the model: {cause}"));
                let err = ProxyError::CannotLoad {
                    model: key.to_string(),
                    cause: cause.clone(),
                    retry_after: Duration::from_millis(self.config.server.failed_cooldown_ms),
                };
                slot.state = State::Failed {
                    cause,
                    since: now,
                    cannot_load: true,
                };
                slot.fail_waiters(&err);
            }
        }
        self.place();
    }

    /// Delivers `timer` back to the actor after `delay`.
    fn after(&self, delay: Duration, timer: Timer) {
        send_after(self.timer_tx.clone(), delay, timer);
    }

    fn load_deadline(&mut self, key: &str, generation: u64) {
        let timeout_ms = self.config.server.load_timeout_ms;
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

    /// A ready engine that has sent no `Stats` for `hang_timeout_ms` is hung (a frozen
    /// process, a deadlocked runtime): it is killed, which the exit path treats as a
    /// crash (restart, resumption of its requests). Re-arms itself while the engine lives.
    fn hang_check(&mut self, key: &str, generation: u64) {
        let timeout = Duration::from_millis(self.config.server.hang_timeout_ms);
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        if slot.generation != generation
            || !matches!(slot.state, State::Ready | State::Draining)
            || slot.engine.is_none()
        {
            return;
        }
        let now = Instant::now();
        match crate::policy::hang_verdict(slot.heartbeat, now, timeout) {
            crate::policy::Liveness::Alive { check_in } => self.after(
                check_in,
                Timer::HangCheck {
                    model: key.to_string(),
                    generation,
                },
            ),
            crate::policy::Liveness::Hung { silent } => {
                let reason = format!(
                    "hung: no Stats for {} ms (server.hang_timeout_ms = {})",
                    silent.as_millis(),
                    timeout.as_millis()
                );
                warn!(model = %key, generation, %reason, "killing hung engine");
                slot.log.push(format!("[mlxd] engine {reason}; killing it"));
                if let Some(engine) = &slot.engine {
                    engine.kill(reason);
                }
            }
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

    fn refresh_gauges(&self) {
        let m = &self.metrics;
        for (id, s) in &self.slots {
            let l = Metrics::label(id);
            let live = s.waiters.iter().filter(|w| !w.is_closed()).count();
            m.queue_depth.get_or_create(&l).set(live as i64);
            m.in_flight.get_or_create(&l).set(i64::from(s.in_flight));
            let mem = if s.resident() { s.footprint() } else { 0 };
            m.memory
                .get_or_create(&l)
                .set(i64::try_from(mem).unwrap_or(i64::MAX));
            m.loaded
                .get_or_create(&l)
                .set(i64::from(matches!(s.state, State::Ready)));
        }
    }

    /// Applies a reloaded configuration; see [`PoolHandle::reload`].
    fn reload(
        &mut self,
        catalog: Arc<Catalog>,
        config: Arc<Config>,
        memory_budget: u64,
    ) -> ReloadPlan {
        let plan = crate::reload::plan(&self.catalog, &catalog);
        let now = Instant::now();
        for id in &plan.removed {
            self.remove_model(id);
        }
        for id in &plan.added {
            let Some(entry) = catalog.get(id).cloned() else {
                continue;
            };
            if let Some(slot) = self.slots.get_mut(id) {
                // Removed by an earlier reload and still draining: configured again.
                slot.removed = false;
                slot.limits = ModelLimits::new(entry.limits.clone());
                slot.entry = entry.clone();
                slot.log.push("[mlxd] configured again by a reload");
            } else {
                let socket = match mlxd_ipc::socket::engine_socket_path(
                    &self.runtime_dir,
                    self.next_socket,
                ) {
                    Ok(s) => s,
                    Err(e) => {
                        error!(model = %id, error = %e, "no socket path for an added model; it is not served");
                        continue;
                    }
                };
                self.next_socket += 1;
                let log = self.logs.get_or_create(id);
                log.push(match entry.stored {
                    true => "[mlxd] found in the model store",
                    false => "[mlxd] added by a configuration reload",
                });
                let mut slot = Slot::new(entry.clone(), log, socket, now);
                slot.generation = self.retired_generations.remove(id).unwrap_or(0);
                self.slots.insert(id.clone(), slot);
            }
            match entry.stored {
                true => info!(model = %id, source = %entry.source, "model found in the store: served by name"),
                false => info!(model = %id, source = %entry.source, "model added by a configuration reload"),
            }
            if entry.pinned {
                self.enqueue(id);
            }
        }
        for change in &plan.changed {
            let (Some(entry), Some(slot)) =
                (catalog.get(&change.id), self.slots.get_mut(&change.id))
            else {
                continue;
            };
            let was_pinned = slot.entry.pinned;
            // New settings may be what the failed load lacked: try them at once.
            let was_failed = matches!(slot.state, State::Failed { .. });
            if was_failed {
                slot.state = State::Idle;
                slot.history.reset();
            }
            if change.fields.contains(&"limits") {
                slot.limits = ModelLimits::new(entry.limits.clone());
            }
            slot.entry = entry.clone();
            let fields = change.fields.join(", ");
            info!(model = %change.id, changed = %fields, "model settings changed by a configuration reload; they apply at its next load");
            slot.log.push(format!(
                "[mlxd] configuration reloaded: {fields} changed (applies at the next load)"
            ));
            if entry.pinned && (!was_pinned || was_failed) {
                self.enqueue(&change.id);
            } else if !entry.pinned {
                self.arm_idle_timer(&change.id);
            }
        }
        self.budget = Budget {
            max_engines: config.pool.max_engines,
            memory_bytes: memory_budget,
        };
        self.metrics
            .memory_budget
            .set(i64::try_from(memory_budget).unwrap_or(i64::MAX));
        self.policy = RestartPolicy::from_config(&config);
        self.config = config;
        self.catalog = catalog;
        self.place();
        plan
    }

    /// A reload removed `key`: its waiters get 404, its engine drains (in-flight requests
    /// finish) and stops, and then the slot goes ([`Self::exited`]); without an engine it
    /// goes now.
    fn remove_model(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        slot.removed = true;
        slot.fail_waiters(&ProxyError::NotFound(format!(
            "model {key} was removed from the configuration"
        )));
        self.queue.retain(|k| k != key);
        info!(model = %key, in_flight = slot.in_flight, "model removed by a configuration reload");
        if slot.engine.is_some() {
            slot.log
                .push("[mlxd] removed from the configuration: draining, then stopping");
            self.evict(key, "removed");
        } else {
            self.forget(key);
        }
    }

    /// Drops a removed model's slot (its engine is gone) and its gauges.
    fn forget(&mut self, key: &str) {
        if let Some(mut slot) = self.slots.remove(key) {
            for r in slot.unload_replies.drain(..) {
                let _ = r.send(Ok(()));
            }
            slot.fail_waiters(&ProxyError::NotFound(format!(
                "model {key} was removed from the configuration"
            )));
            self.retired_generations
                .insert(key.to_string(), slot.generation);
            self.metrics.forget_model(key);
        }
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        self.queue.clear();
        for slot in self.slots.values_mut() {
            slot.fail_waiters(&ProxyError::ShuttingDown);
            if let Some(engine) = slot.engine.as_mut() {
                info!(model = %slot.entry.id, pid = engine.pid, "stopping engine");
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
mod tests;
