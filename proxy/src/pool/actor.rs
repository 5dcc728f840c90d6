//! The pool actor: one task owns the table `model id → slot` and all pool policy. It
//! answers [`Command`]s, hears engine events, timers and released leases, decides with the
//! pure parts ([`crate::placement`], [`crate::policy`], [`super::lifecycle`]) and carries
//! out the effects those decisions return.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::handle::{Command, Lease, PoolHandle, Reply};
use super::lifecycle::{self, Effect, PoolMood, StandbyStart, Timing};
use super::queue::{self, Admission, AdmitRules, Pass, Placement, Room, Unload};
use super::slot::{KeepAlive, Slot, WaitKind, Waiter};
use crate::catalog::Catalog;
use crate::config::Config;
use crate::engine::{self, EngineEvent, EngineHandle, EngineMsg, EngineSpec};
use crate::error::ProxyError;
use crate::exit::ExitReport;
use crate::logs::Logs;
use crate::metrics::{EvictionLabels, Metrics};
use crate::placement::{Budget, Plan, Resident};
use crate::policy::{ModelLimits, RestartPolicy};
use crate::reload::ReloadPlan;

/// Deadlines the actor set for itself, delivered back to it by timer tasks.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Timer {
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
        /// Which check: a later one replaces it (see [`Slot::idle_timer`]).
        number: u64,
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
    /// A spare engine that waited for its model's engine to be idle starts now anyway.
    StandbyDue {
        model: String,
    },
    /// A waiter's queue timeout is over.
    WaiterDeadline {
        model: String,
        waiter: u64,
    },
}

/// How long a spare engine waits for its model's engine to be idle before it starts anyway.
pub(super) const STANDBY_WAIT: Duration = Duration::from_secs(10);

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
    let n = parts.catalog.models.len();
    for (i, entry) in parts.catalog.models.iter().enumerate() {
        let socket = mlxd_ipc::socket::engine_socket_path(&parts.runtime_dir, i)?;
        // Spares' sockets are numbered after the models'.
        let spare = mlxd_ipc::socket::engine_socket_path(&parts.runtime_dir, n + i)?;
        let log = parts.logs.get_or_create(&entry.id);
        slots.insert(
            entry.id.clone(),
            Slot::new(entry.clone(), log, (socket, spare), now),
        );
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
        next_socket: 2 * n,
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
                    Timer::IdleCheck { model, number } => self.idle_check(&model, number),
                    Timer::LimitsRecovery { model } => self.limits_recovery(&model),
                    Timer::CapacityDeadline { model, ticket } => self.capacity_deadline(&model, ticket),
                    Timer::HangCheck { model, generation } => self.hang_check(&model, generation),
                    Timer::WaiterDeadline { model, waiter } => self.waiter_deadline(&model, waiter),
                    Timer::StandbyDue { model } => self.start_standby(&model, true),
                },
            }
            self.refresh_gauges();
            if self.shutting_down
                && self
                    .slots
                    .values()
                    .all(|s| s.state.engine().is_none() && s.standby.is_none())
            {
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
            Command::Acquire { model, kind, reply } => self.acquire(&model, kind, reply),
            Command::Unload { model, reply } => self.unload(&model, reply),
            Command::KeepAlive { model, keep, reply } => {
                let _ = reply.send(self.keep_alive(&model, keep));
            }
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
                    let done = lifecycle::reset(slot);
                    if done.limits_restored {
                        slot.log
                            .push("[mlxd] configured limits restored (admin reset)");
                        restored.push((slot.id().to_string(), lifecycle::limits_grew(slot)));
                    }
                    if done.failure_cleared || done.limits_restored {
                        reset.push(slot.id().to_string());
                    }
                }
                for (key, effects) in restored {
                    self.apply(&key, effects);
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
            Command::RuntimeAdapters {
                model,
                adapters,
                reply,
            } => {
                let _ = reply.send(self.runtime_adapters(&model, adapters));
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

    /// The placement plan for an engine that needs `needed` bytes beside the resident
    /// engines and the running jobs; see [`queue::plan_beside_jobs`].
    fn plan_beside_jobs(&self, needed: u64) -> Plan {
        let room = Room {
            budget: self.budget,
            job_bytes: self.jobs.values().sum(),
        };
        queue::plan_beside_jobs(needed, &self.residents(), room)
    }

    /// A request for `key`'s engine; see [`queue::request`].
    fn acquire(&mut self, key: &str, kind: WaitKind, reply: Reply<Result<Lease, ProxyError>>) {
        let now = Instant::now();
        let c = &self.config.server;
        let rules = AdmitRules {
            failed_cooldown: Duration::from_millis(c.failed_cooldown_ms),
            queue_capacity: c.queue_capacity,
            max_in_flight: c.max_in_flight_per_model,
        };
        let mood = self.mood();
        let slot = self.slots.get_mut(key);
        match queue::request(slot, key, mood, kind, now, &rules) {
            Admission::Grant => {
                let lease = self
                    .slots
                    .get_mut(key)
                    .and_then(|slot| slot.grant(&self.release_tx, &self.policy, now));
                if let Some(lease) = lease {
                    let _ = reply.send(Ok(lease));
                }
            }
            Admission::Refuse(e) => {
                let _ = reply.send(Err(e));
            }
            Admission::Wait => {
                let id = self.next_waiter;
                self.next_waiter += 1;
                let Some(slot) = self.slots.get_mut(key) else {
                    return;
                };
                let effects = queue::wait(
                    slot,
                    Waiter { id, kind, reply },
                    self.config.queue_timeout(),
                );
                self.apply(key, effects);
            }
        }
    }

    /// See [`queue::waiter_deadline`].
    fn waiter_deadline(&mut self, key: &str, waiter: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = queue::waiter_deadline(slot, waiter);
        self.apply(key, effects);
    }

    /// Numbers `key`'s wait for room; see [`queue::queue`].
    fn enqueue(&mut self, key: &str) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = queue::queue(slot, ticket, self.config.pool.capacity_wait);
        self.apply(key, effects);
    }

    /// The engines that hold resources, as the placement policy sees them.
    fn residents(&self) -> Vec<Resident> {
        self.slots
            .values()
            .filter(|s| s.resident())
            .map(|s| Resident {
                id: s.entry.id.clone(),
                pinned: s.entry.pinned,
                in_flight: s.in_flight(),
                last_used: s.last_used,
                bytes: s.footprint(),
                ready: s.state.is_ready(),
                leaving: s.state.is_draining(),
            })
            .collect()
    }

    /// Starts, evicts for, or refuses queued models, in arrival order ([`queue::place`]
    /// decides each). Each model is planned against the engines resident after the
    /// decisions before it were carried out (a start that fails to spawn holds nothing).
    fn place(&mut self) {
        let mut pass = Pass::default();
        let waiting: Vec<String> = self.queue.iter().cloned().collect();
        for key in waiting {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            if !queue::still_queued(slot) {
                self.queue.retain(|k| *k != key);
                continue;
            }
            let needed = slot.planned_bytes();
            let plan = self.plan_beside_jobs(needed);
            match queue::place(&key, plan, &mut pass, self.budget.memory_bytes) {
                Placement::Start => {
                    self.queue.retain(|k| *k != key);
                    self.start(&key);
                }
                Placement::Evict(victims) => {
                    for v in victims {
                        info!(model = %v, for_model = %key, "evicting least recently used idle engine");
                        self.evict(&v, "lru");
                    }
                }
                Placement::Wait => {}
                Placement::Refuse(err) => {
                    if let Some(slot) = self.slots.get_mut(&key) {
                        let effects = queue::refuse(slot, err);
                        self.apply(&key, effects);
                    }
                }
            }
        }
    }

    /// See [`queue::capacity_deadline`].
    fn capacity_deadline(&mut self, key: &str, ticket: u64) {
        let Some(needed) = self.slots.get(key).map(Slot::planned_bytes) else {
            return;
        };
        let making_room = self.slots.values().any(|s| s.state.is_draining());
        let plan = self.plan_beside_jobs(needed);
        let budget = self.budget.memory_bytes;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = queue::capacity_deadline(slot, ticket, making_room, plan, budget);
        self.apply(key, effects);
    }

    /// Drains `key`'s engine and stops it once its in-flight requests are done.
    fn evict(&mut self, key: &str, reason: &'static str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::drain(slot, reason);
        self.apply(key, effects);
    }

    /// An admin unload; see [`queue::unload`].
    fn unload(&mut self, key: &str, reply: Reply<Result<(), ProxyError>>) {
        let Some(slot) = self.slots.get_mut(key) else {
            let _ = reply.send(Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            ))));
            return;
        };
        match queue::unload(slot) {
            Unload::Now(effects) => {
                self.apply(key, effects);
                let _ = reply.send(Ok(()));
            }
            Unload::WhenStopped(effects) => {
                slot.unload_replies.push(reply);
                self.apply(key, effects);
            }
        }
    }

    fn release(&mut self, key: &str, generation: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::release(slot, generation, Instant::now());
        self.apply(key, effects);
    }

    /// See [`lifecycle::limits_recovery`].
    fn limits_recovery(&mut self, key: &str) {
        let policy = self.policy;
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::limits_recovery(slot, &policy, Instant::now());
        self.apply(key, effects);
    }

    /// Starts the idle clock's timer for `key`; see [`lifecycle::arm_idle`].
    fn arm_idle_timer(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::arm_idle(slot);
        self.apply(key, effects);
    }

    /// See [`lifecycle::idle_check`].
    fn idle_check(&mut self, key: &str, number: u64) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::idle_check(slot, number, Instant::now());
        self.apply(key, effects);
    }

    /// A request's keep-alive for `key`; see [`lifecycle::keep_alive`].
    fn keep_alive(&mut self, key: &str, keep: KeepAlive) -> Result<(), ProxyError> {
        let Some(slot) = self.slots.get_mut(key) else {
            return Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            )));
        };
        let effects = lifecycle::keep_alive(slot, keep, Instant::now());
        self.apply(key, effects);
        Ok(())
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
            options: slot.entry.launch_options(),
            stop_timeout: self.config.grace(),
            restarts: slot.restarts,
            log: Some(slot.log.clone()),
        }
    }

    /// What the pool is doing, as the transitions see it.
    fn mood(&self) -> PoolMood {
        PoolMood {
            shutting_down: self.shutting_down,
        }
    }

    /// The settings the lifecycle transitions need.
    fn timing(&self) -> Timing {
        let c = &self.config.server;
        Timing {
            policy: self.policy,
            load_timeout: Duration::from_millis(c.load_timeout_ms),
            hang_timeout: Duration::from_millis(c.hang_timeout_ms),
            failed_cooldown: Duration::from_millis(c.failed_cooldown_ms),
        }
    }

    fn start(&mut self, key: &str) {
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let spec = self.spec(slot);
        let timing = self.timing();
        let slot = self.slots.get_mut(key).expect("slot checked above");
        slot.generation = slot.next_generation();
        slot.last_ready = None;
        self.metrics.loads.get_or_create(&Metrics::label(key)).inc();
        match (self.spawner)(spec.clone(), slot.generation, self.engine_tx.clone()) {
            Ok(handle) => {
                let effects =
                    lifecycle::started(slot, handle, spec.limits, Instant::now(), &timing);
                self.apply(key, effects);
            }
            Err(e) => {
                let report = Arc::new(engine::spawn_failure_report(&spec, &e));
                error!(model = %key, cause = %report.cause, "engine could not be spawned");
                self.exited(key, report);
            }
        }
    }

    /// Starts `key`'s spare engine if the model keeps one, serves, has none yet and the
    /// memory budget holds it beside everything resident (this model's engine included).
    /// While the engine has requests in flight (streams just resumed on it) the spare's load
    /// would compete with them: it waits for the engine's last release, or
    /// [`STANDBY_WAIT`] at most (`due`).
    fn start_standby(&mut self, key: &str, due: bool) {
        let mood = self.mood();
        let Some(decision) = self
            .slots
            .get(key)
            .map(|slot| lifecycle::standby_start(slot, mood, due))
        else {
            return;
        };
        match decision {
            StandbyStart::No => return,
            StandbyStart::Later(effects) => {
                self.apply(key, effects);
                return;
            }
            StandbyStart::Now => {}
        }
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let needed = slot.planned_bytes();
        if !matches!(self.plan_beside_jobs(needed), Plan::Start) {
            warn!(model = %key, needed, "no room for a standby engine; the model runs without one");
            slot.log
                .push("[mlxd] no room for a standby engine (engine slots or memory)");
            return;
        }
        let mut spec = self.spec(slot);
        spec.socket_path = slot.spare_socket.clone();
        let slot = self.slots.get_mut(key).expect("slot checked above");
        let generation = slot.next_generation();
        match (self.spawner)(spec.clone(), generation, self.engine_tx.clone()) {
            Ok(handle) => {
                let effects = lifecycle::standby_started(slot, handle, spec.limits, Instant::now());
                self.apply(key, effects);
            }
            Err(e) => {
                error!(model = %key, error = %e, "the standby engine could not be spawned");
                slot.log.push(format!(
                    "[mlxd] the standby engine could not be spawned: {e}"
                ));
            }
        }
    }

    fn engine_event(&mut self, msg: EngineMsg) {
        let timing = self.timing();
        let Some(slot) = self.slots.get_mut(&msg.model) else {
            return;
        };
        let key = msg.model;
        // Whatever became of the slot since the exit: its record gets the status.
        if let EngineEvent::Reaped { early, reaped } = msg.event {
            lifecycle::reaped(slot, &early, reaped);
            return;
        }
        if slot
            .standby
            .as_ref()
            .is_some_and(|s| s.engine.handle.generation == msg.generation)
        {
            let effects = lifecycle::standby_event(slot, msg.event);
            self.apply(&key, effects);
            return;
        }
        if msg.generation != slot.generation {
            return;
        }
        match msg.event {
            EngineEvent::Loading { phase, progress } => lifecycle::loading(slot, phase, progress),
            // Nothing counts for an engine that is gone.
            EngineEvent::Stats(_) if slot.state.engine().is_none() => {}
            EngineEvent::Stats(s) => {
                // The engine's totals restart with the process (`stats` go with it).
                let (drafted, accepted, ssd, prefix) =
                    (s.drafted_tokens, s.accepted_tokens, s.ssd, s.prefix);
                let before = lifecycle::stats(slot, s, Instant::now());
                let (d0, a0, ssd0, prefix0) = before
                    .map_or((0, 0, Default::default(), Default::default()), |p| {
                        (p.drafted_tokens, p.accepted_tokens, p.ssd, p.prefix)
                    });
                self.metrics.record_drafts(
                    &key,
                    drafted.saturating_sub(d0),
                    accepted.saturating_sub(a0),
                );
                self.metrics.record_ssd(&key, &ssd0, &ssd);
                self.metrics.record_prefix(&key, &prefix0, &prefix);
                // Reported memory changed what fits.
                if !self.queue.is_empty() {
                    self.place();
                }
            }
            EngineEvent::Ready(r) => {
                let effects = lifecycle::ready(slot, r, Instant::now(), &timing);
                self.apply(&key, effects);
            }
            EngineEvent::Exited(report) => self.exited(&key, report),
            // Handled above, whatever the generation.
            EngineEvent::Reaped { .. } => {}
        }
    }

    fn exited(&mut self, key: &str, report: Arc<ExitReport>) {
        let timing = self.timing();
        let mood = self.mood();
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = lifecycle::exited(
            slot,
            report,
            Instant::now(),
            SystemTime::now(),
            &timing,
            mood,
        );
        self.apply(key, effects);
    }

    /// Carries out what a transition of `key`'s slot asked for, in order.
    fn apply(&mut self, key: &str, effects: Vec<Effect>) {
        for effect in effects {
            match effect {
                Effect::After(delay, timer) => self.after(delay, timer),
                Effect::Log(line) => {
                    if let Some(slot) = self.slots.get(key) {
                        slot.log.push(line);
                    }
                }
                Effect::Control(msg) => {
                    if let Some(e) = self.slots.get(key).and_then(|s| s.state.engine()) {
                        e.handle.send(msg);
                    }
                }
                Effect::Stop => {
                    if let Some(e) = self.slots.get_mut(key).and_then(|s| s.state.engine_mut()) {
                        e.handle.stop();
                    }
                }
                Effect::Kill(reason) => {
                    if let Some(e) = self.slots.get(key).and_then(|s| s.state.engine()) {
                        e.handle.kill(reason);
                    }
                }
                Effect::GrantWaiters => {
                    let now = Instant::now();
                    if let Some(slot) = self.slots.get_mut(key) {
                        for w in queue::to_grant(slot) {
                            if let Some(lease) = slot.grant(&self.release_tx, &self.policy, now) {
                                w.send(Ok(lease));
                            }
                        }
                    }
                }
                Effect::FailWaiters(err) => {
                    if let Some(slot) = self.slots.get_mut(key) {
                        slot.fail_waiters(&err);
                    }
                }
                Effect::AnswerUnloads => {
                    if let Some(slot) = self.slots.get_mut(key) {
                        for r in slot.unload_replies.drain(..) {
                            let _ = r.send(Ok(()));
                        }
                    }
                }
                Effect::ArmIdleTimer => self.arm_idle_timer(key),
                Effect::Enqueue => self.enqueue(key),
                Effect::JoinQueue => self.queue.push_back(key.to_string()),
                Effect::StartStandby => self.start_standby(key, false),
                Effect::StopStandby => {
                    if let Some(s) = self.slots.get_mut(key).and_then(|s| s.standby.as_mut()) {
                        s.engine.handle.stop();
                    }
                }
                Effect::LeaveQueue => self.queue.retain(|k| k != key),
                Effect::FailWaiter(waiter, err) => waiter.send(Err(err)),
                Effect::Place => self.place(),
                Effect::Forget => self.forget(key),
                Effect::CountRestart => {
                    self.metrics
                        .restarts
                        .get_or_create(&Metrics::label(key))
                        .inc();
                }
                Effect::ObserveLoad(took) => {
                    self.metrics
                        .load_duration
                        .get_or_create(&Metrics::label(key))
                        .observe(took.as_secs_f64());
                }
                Effect::CountEviction(reason) => {
                    self.metrics
                        .evictions
                        .get_or_create(&EvictionLabels {
                            model: key.to_string(),
                            reason: reason.to_string(),
                        })
                        .inc();
                }
            }
        }
    }

    /// Delivers `timer` back to the actor after `delay`.
    fn after(&self, delay: Duration, timer: Timer) {
        send_after(self.timer_tx.clone(), delay, timer);
    }

    fn load_deadline(&mut self, key: &str, generation: u64) {
        let timing = self.timing();
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let effects = lifecycle::load_deadline(slot, generation, &timing);
        self.apply(key, effects);
    }

    /// A ready engine's liveness check; see [`lifecycle::hang_check`].
    fn hang_check(&mut self, key: &str, generation: u64) {
        let timing = self.timing();
        let Some(slot) = self.slots.get(key) else {
            return;
        };
        let effects = lifecycle::hang_check(slot, generation, Instant::now(), &timing);
        self.apply(key, effects);
    }

    fn restart_due(&mut self, key: &str, generation: u64) {
        let mood = self.mood();
        if self
            .slots
            .get(key)
            .is_some_and(|s| lifecycle::restart_due(s, generation, mood))
        {
            self.start(key);
        }
    }

    fn refresh_gauges(&self) {
        let m = &self.metrics;
        for (id, s) in &self.slots {
            let l = Metrics::label(id);
            let live = s.waiters.iter().filter(|w| !w.is_closed()).count();
            m.queue_depth.get_or_create(&l).set(live as i64);
            m.in_flight.get_or_create(&l).set(i64::from(s.in_flight()));
            let mem = if s.resident() { s.footprint() } else { 0 };
            m.memory
                .get_or_create(&l)
                .set(i64::try_from(mem).unwrap_or(i64::MAX));
            m.loaded
                .get_or_create(&l)
                .set(i64::from(s.state.is_ready()));
        }
    }

    /// See [`PoolHandle::set_runtime_adapters`].
    fn runtime_adapters(
        &mut self,
        key: &str,
        adapters: Vec<(String, String)>,
    ) -> Result<(), ProxyError> {
        let Some(slot) = self.slots.get_mut(key) else {
            return Err(ProxyError::NotFound(format!(
                "model {key} is not configured"
            )));
        };
        let effects = lifecycle::runtime_adapters(slot, adapters);
        self.apply(key, effects);
        Ok(())
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
                let path = |i| mlxd_ipc::socket::engine_socket_path(&self.runtime_dir, i);
                let sockets = match (path(self.next_socket), path(self.next_socket + 1)) {
                    (Ok(s), Ok(spare)) => (s, spare),
                    (Err(e), _) | (_, Err(e)) => {
                        error!(model = %id, error = %e, "no socket path for an added model; it is not served");
                        continue;
                    }
                };
                self.next_socket += 2;
                let log = self.logs.get_or_create(id);
                log.push(match entry.stored {
                    true => "[mlxd] found in the model store",
                    false => "[mlxd] added by a configuration reload",
                });
                let mut slot = Slot::new(entry.clone(), log, sockets, now);
                slot.generation = self.retired_generations.remove(id).unwrap_or(0);
                self.slots.insert(id.clone(), slot);
            }
            match entry.stored {
                true => {
                    info!(model = %id, source = %entry.source, "model found in the store: served by name")
                }
                false => {
                    info!(model = %id, source = %entry.source, "model added by a configuration reload")
                }
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
            let effects = lifecycle::reconfigured(slot, entry.clone(), &change.fields);
            self.apply(&change.id, effects);
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

    /// A reload removed `key`; see [`queue::remove`].
    fn remove_model(&mut self, key: &str) {
        let Some(slot) = self.slots.get_mut(key) else {
            return;
        };
        let effects = queue::remove(slot);
        self.apply(key, effects);
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
                .insert(key.to_string(), slot.generations.max(slot.generation));
            self.metrics.forget_model(key);
        }
    }

    fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        self.queue.clear();
        let keys: Vec<String> = self.slots.keys().cloned().collect();
        for key in keys {
            let Some(slot) = self.slots.get_mut(&key) else {
                continue;
            };
            let effects = queue::shut_down(slot);
            self.apply(&key, effects);
        }
    }
}

fn send_after(tx: mpsc::UnboundedSender<Timer>, delay: Duration, timer: Timer) {
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let _ = tx.send(timer);
    });
}
