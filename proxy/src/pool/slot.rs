//! One model's place in the pool: its configuration, its lifecycle [`State`] — each state
//! carrying its own data, so that "ready without an engine" cannot be written — and the
//! requests waiting for it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mlxd_protocol::control::{Limits, LoadPhase, Ready, Stats};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::handle::{InFlight, Lease, Reply};
use crate::catalog::ModelEntry;
use crate::engine::EngineHandle;
use crate::error::ProxyError;
use crate::exit::ExitReport;
use crate::logs::ModelLog;
use crate::policy::{CrashHistory, KvCapacity, ModelLimits, RestartPolicy};

/// A running engine process and what the pool counts of it.
#[derive(Debug)]
pub(super) struct Engine {
    pub handle: EngineHandle,
    /// The limits it was launched with.
    pub limits: Limits,
    pub spawned_at: Instant,
    /// Leases handed out and not yet dropped.
    pub in_flight: u32,
    /// Restart it once idle: the model's limits grew back beyond the ones it runs with.
    pub recycle: bool,
    /// The engine's last `Stats` (its totals restart with the process).
    pub stats: Option<Stats>,
}

impl Engine {
    pub fn new(handle: EngineHandle, limits: Limits, now: Instant) -> Self {
        Self {
            handle,
            limits,
            spawned_at: now,
            in_flight: 0,
            recycle: false,
            stats: None,
        }
    }
}

/// A model's spare engine (`standby = true`): started once the serving engine is ready and
/// only if the memory budget holds both, it loads the weights and waits, never routed to.
/// When the serving engine crashes it serves at once ([`super::lifecycle::exited`]), and a
/// new spare starts behind it.
#[derive(Debug)]
pub(super) struct Standby {
    pub engine: Engine,
    /// Its `Ready` report; `None` while it loads.
    pub ready: Option<Ready>,
}

/// How far a load has got.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Loading {
    pub phase: Option<LoadPhase>,
    pub progress: Option<f32>,
}

/// What a ready engine reported, and when it last showed it was alive.
#[derive(Debug, Clone)]
pub(super) struct Serving {
    pub ready: Ready,
    pub ready_at: Instant,
    /// `Ready`, then each `Stats`.
    pub heartbeat: Instant,
}

#[derive(Debug)]
pub(super) enum State {
    /// Not started (on-demand start at the first request).
    Idle,
    /// Wants an engine; waiting for room (engine slots or memory).
    Queued {
        ticket: u64,
    },
    Starting {
        engine: Engine,
        loading: Loading,
    },
    Ready {
        engine: Engine,
        serving: Serving,
    },
    /// No new requests; stopping once in-flight requests are done. `serving` is absent
    /// for an engine drained before it was ready (an admin unload, shutdown).
    Draining {
        engine: Engine,
        serving: Option<Serving>,
    },
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
    pub fn name(&self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Queued { .. } => "queued",
            Self::Starting { .. } => "starting",
            Self::Ready { .. } => "ready",
            Self::Draining { .. } => "draining",
            Self::Restarting { .. } => "restarting",
            Self::Failed { .. } => "failed",
            Self::Stopped => "stopped",
        }
    }

    pub fn availability(&self) -> &'static str {
        match self {
            Self::Ready { .. } | Self::Draining { .. } => "loaded",
            Self::Queued { .. } | Self::Starting { .. } | Self::Restarting { .. } => "loading",
            Self::Idle | Self::Stopped => "unloaded",
            Self::Failed { .. } => "failed",
        }
    }

    /// The engine process, in the states that have one.
    pub fn engine(&self) -> Option<&Engine> {
        match self {
            Self::Starting { engine, .. }
            | Self::Ready { engine, .. }
            | Self::Draining { engine, .. } => Some(engine),
            _ => None,
        }
    }

    pub fn engine_mut(&mut self) -> Option<&mut Engine> {
        match self {
            Self::Starting { engine, .. }
            | Self::Ready { engine, .. }
            | Self::Draining { engine, .. } => Some(engine),
            _ => None,
        }
    }

    /// What the engine reported at `Ready`, while it serves or drains.
    pub fn serving(&self) -> Option<&Serving> {
        match self {
            Self::Ready { serving, .. } => Some(serving),
            Self::Draining { serving, .. } => serving.as_ref(),
            _ => None,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(self, Self::Ready { .. })
    }

    pub fn is_draining(&self) -> bool {
        matches!(self, Self::Draining { .. })
    }

    /// Not started, or stopped: a request has to start an engine.
    pub fn is_cold(&self) -> bool {
        matches!(self, Self::Idle | Self::Stopped)
    }
}

/// How long an idle engine stays loaded, as a request asked (Ollama's `keep_alive`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepAlive {
    /// Unloaded after this long without requests.
    For(Duration),
    /// Never unloaded for idleness.
    Forever,
}

/// Who waits for a model's engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WaitKind {
    /// A client's request (an Ollama or admin load included): one place of the model's
    /// request queue, refused when the queue is full.
    Request,
    /// A request admitted before whose engine (generation `dead`) died under it: sent again,
    /// or its stream resumed on the successor, never on `dead`. The request queue and the
    /// engine's in-flight limit bound new work, and this is not new: refusing it would break
    /// a stream the client already holds (with more streams in flight than the queue has
    /// places, a `kill -9` cost the streams past them a 429 mid-stream).
    Retry { dead: u64 },
    /// The server's own start-up load (`mlxd serve --model`): a burst of `queue_capacity`
    /// requests at a server still loading its model must all wait (one of 64 streams was
    /// refused 429 on an H100 while the preload held a place).
    StartUp,
}

impl WaitKind {
    /// Whether the waiter takes a place of the request queue, and is refused when the queue
    /// is full or the engine at its in-flight limit (only new requests are).
    pub fn takes_a_place(self) -> bool {
        self == WaitKind::Request
    }

    /// The engine generation not to hand out: the one a retried request found dead.
    pub fn avoids(self) -> Option<u64> {
        match self {
            WaitKind::Retry { dead } => Some(dead),
            WaitKind::Request | WaitKind::StartUp => None,
        }
    }
}

/// A request (or a retried one, or the start-up load) waiting for its model's engine.
#[derive(Debug)]
pub(super) struct Waiter {
    /// Names its queue-timeout timer.
    pub id: u64,
    pub kind: WaitKind,
    pub reply: Reply<Result<Lease, ProxyError>>,
}

impl Waiter {
    pub fn is_closed(&self) -> bool {
        self.reply.is_closed()
    }

    /// Answers the request; a waiter that gave up meanwhile is simply gone.
    pub fn send(self, result: Result<Lease, ProxyError>) {
        let _ = self.reply.send(result);
    }
}

pub(super) struct Slot {
    pub entry: ModelEntry,
    pub log: Arc<ModelLog>,
    pub socket: PathBuf,
    pub state: State,
    /// Bumped at each start: events, timers and leases of older engines are ignored.
    pub generation: u64,
    pub restarts: u32,
    pub history: CrashHistory,
    pub limits: ModelLimits,
    pub last_exit: Option<(Arc<ExitReport>, SystemTime)>,
    /// What the last engine reported at `Ready`; `/engines` shows it until the next start.
    pub last_ready: Option<Ready>,
    /// A reload removed the model: no new requests; the slot goes once its engine is gone.
    pub removed: bool,
    pub last_used: Instant,
    /// The largest footprint an engine of this model has reported.
    pub observed_bytes: u64,
    /// The pending idle check's number (one timer per slot, re-armed while the engine is
    /// used); a check whose number is not this one is stale (the TTL changed since).
    pub idle_timer: Option<u64>,
    /// The number the next idle check gets.
    pub next_idle_timer: u64,
    /// A request's `keep_alive` in place of the configured TTL. As Ollama's runner does,
    /// it holds while the model stays loaded (a crash restart keeps it), later requests
    /// without one leave it, and it goes when the model is unloaded.
    pub keep_alive: Option<KeepAlive>,
    pub waiters: VecDeque<Waiter>,
    pub unload_replies: Vec<Reply<Result<(), ProxyError>>>,
    /// The spare engine, while one runs.
    pub standby: Option<Standby>,
    /// The socket the spare listens on; it and `socket` trade places when it takes over.
    pub spare_socket: PathBuf,
    /// The last engine generation handed out (serving or spare): each start takes the next.
    pub generations: u64,
    /// The spare was stopped because it lacks the adapters loaded at run time or was
    /// launched with settings a reload changed: another starts once it has exited
    /// ([`super::lifecycle::runtime_adapters`], [`super::lifecycle::reconfigured`]).
    pub replace_standby: bool,
}

impl Slot {
    pub fn new(
        entry: ModelEntry,
        log: Arc<ModelLog>,
        (socket, spare_socket): (PathBuf, PathBuf),
        now: Instant,
    ) -> Self {
        Self {
            standby: None,
            replace_standby: false,
            spare_socket,
            generations: 0,
            limits: ModelLimits::new(entry.limits.clone()),
            entry,
            log,
            socket,
            state: State::Idle,
            generation: 0,
            restarts: 0,
            history: CrashHistory::default(),
            last_exit: None,
            last_ready: None,
            removed: false,
            last_used: now,
            observed_bytes: 0,
            idle_timer: None,
            next_idle_timer: 0,
            keep_alive: None,
            waiters: VecDeque::new(),
            unload_replies: Vec::new(),
        }
    }

    /// A new engine generation, above every one handed out (serving or spare).
    pub fn next_generation(&mut self) -> u64 {
        self.generations = self.generations.max(self.generation) + 1;
        self.generations
    }

    pub fn id(&self) -> &str {
        &self.entry.id
    }

    /// How long the engine may sit idle before it is unloaded; `None`: never (pinned, a
    /// `keep_alive` of forever, or `ttl = 0`). A pinned model ignores `keep_alive`.
    pub fn ttl(&self) -> Option<Duration> {
        if self.entry.pinned {
            return None;
        }
        match self.keep_alive {
            Some(KeepAlive::Forever) => None,
            Some(KeepAlive::For(d)) => Some(d),
            None => (!self.entry.ttl.is_zero()).then_some(self.entry.ttl),
        }
    }

    /// Leases in flight on the current engine.
    pub fn in_flight(&self) -> u32 {
        self.state.engine().map_or(0, |e| e.in_flight)
    }

    /// What the ready engine can hold, for [`crate::policy::check_kv`].
    pub fn kv_capacity(&self, policy: &RestartPolicy, now: Instant) -> Option<KvCapacity> {
        let State::Ready { engine, serving } = &self.state else {
            return None;
        };
        // What the engine runs with (a budget it derived from the GPU's free memory, or cut
        // to it), else what it was launched with.
        let budget = serving
            .ready
            .limits
            .as_ref()
            .and_then(|l| l.kv_budget_bytes)
            .or(engine.limits.kv_budget_bytes)?;
        let configured = self.limits.configured().kv_budget_bytes;
        Some(KvCapacity {
            kv_bytes_per_token: serving.ready.kv_bytes_per_token,
            state_bytes_per_sequence: serving.ready.state_bytes_per_sequence,
            context_length: serving.ready.context_length,
            budget,
            configured_budget: configured,
            recovers_in: self.limits.reduced().then(|| {
                self.limits
                    .recovers_at(policy)
                    .map_or(Duration::from_secs(1), |at| {
                        at.saturating_duration_since(now)
                    })
                    .max(Duration::from_secs(1))
            }),
        })
    }

    /// Hands out a lease on the ready engine and counts the request as in flight; `None`
    /// in any other state.
    pub fn grant(
        &mut self,
        release: &mpsc::UnboundedSender<(String, u64)>,
        policy: &RestartPolicy,
        now: Instant,
    ) -> Option<Lease> {
        let kv = self.kv_capacity(policy, now);
        let State::Ready { engine, .. } = &mut self.state else {
            return None;
        };
        engine.in_flight += 1;
        self.last_used = now;
        let generation = engine.handle.generation;
        Some(Lease {
            model: self.entry.id.clone(),
            socket: self.socket.clone(),
            generation,
            death: engine.handle.death(),
            kv,
            _in_flight: Arc::new(InFlight {
                model: self.entry.id.clone(),
                generation,
                tx: release.clone(),
            }),
        })
    }

    pub fn live_waiters(&mut self) -> usize {
        self.waiters.retain(|w| !w.is_closed());
        self.waiters.len()
    }

    /// The places of the request queue taken: live waiters that are requests.
    pub fn queued_requests(&mut self) -> usize {
        self.live_waiters();
        self.waiters
            .iter()
            .filter(|w| w.kind.takes_a_place())
            .count()
    }

    pub fn fail_waiters(&mut self, err: &ProxyError) {
        for w in self.waiters.drain(..) {
            w.send(Err(err.clone()));
        }
    }

    /// What the engine reports: weights plus KV cache, or its total memory.
    pub fn reported_bytes(&self) -> u64 {
        let weights = self.state.serving().map_or(0, |s| s.ready.weight_bytes);
        let (kv, total) = self
            .state
            .engine()
            .and_then(|e| e.stats.as_ref())
            .map_or((0, 0), |s| (s.kv_bytes, s.memory_bytes));
        (weights + kv).max(total)
    }

    /// Memory to plan for before a start.
    pub fn planned_bytes(&self) -> u64 {
        self.entry.planned_bytes.max(self.observed_bytes)
    }

    /// Memory counted for the running engine: reported once ready, planned before; with
    /// its standby's (what that reported, else planned).
    pub fn footprint(&self) -> u64 {
        let serving = match self.state {
            State::Ready { .. } | State::Draining { .. } if self.reported_bytes() > 0 => {
                self.reported_bytes()
            }
            _ => self.planned_bytes(),
        };
        serving + self.standby_bytes()
    }

    /// Memory counted for the standby engine (0 without one).
    pub fn standby_bytes(&self) -> u64 {
        self.standby.as_ref().map_or(0, |s| {
            let reported = s.engine.stats.as_ref().map_or(0, |st| st.memory_bytes);
            let weights = s.ready.as_ref().map_or(0, |r| r.weight_bytes);
            reported.max(weights).max(self.planned_bytes())
        })
    }

    /// Holds (or is about to hold) resources.
    pub fn resident(&self) -> bool {
        self.state.engine().is_some()
            || matches!(self.state, State::Restarting { .. })
            || self.standby.is_some()
    }
}
