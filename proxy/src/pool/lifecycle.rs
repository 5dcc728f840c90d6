//! An engine's life as pure transitions: each takes a model's [`Slot`], an event and the
//! time, moves the slot to its next [`State`] and returns the [`Effect`]s for the actor to
//! carry out (timers, answers to waiters, control messages, metrics). Nothing here reads
//! a clock, sends on a channel or spawns, so every transition is unit-tested without
//! tokio (`lifecycle/tests.rs`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mlxd_protocol::control::{Limits, LoadPhase, ParentMsg, Ready, Stats};
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::actor::{Timer, STANDBY_WAIT};
use super::slot::{Engine, KeepAlive, Loading, Serving, Slot, Standby, State, Waiter};
use crate::engine::EngineEvent;
use crate::engine::EngineHandle;
use crate::error::ProxyError;
use crate::exit::{ExitCause, ExitReport};
use crate::policy::{hang_verdict, Decision, Liveness, RestartPolicy};

/// What the actor does after a transition, in order.
#[derive(Debug)]
pub(super) enum Effect {
    /// Deliver this timer back to the actor after the delay.
    After(Duration, Timer),
    /// A line for the model's log (`GET /logs/{model}`).
    Log(String),
    /// Send a control message to the engine.
    Control(ParentMsg),
    /// Start the engine's stop sequence (Shutdown, SIGTERM, SIGKILL).
    Stop,
    /// SIGKILL the engine; the reason becomes its exit cause.
    Kill(String),
    /// Answer every waiting request with a lease on the ready engine.
    GrantWaiters,
    /// Answer every waiting request with this error.
    FailWaiters(ProxyError),
    /// Answer the admins waiting for an unload: the engine is gone.
    AnswerUnloads,
    /// Start the idle clock (TTL).
    ArmIdleTimer,
    /// Queue the model for a new engine (the actor numbers the wait and calls [`super::queue::queue`]).
    Enqueue,
    /// Put the model in the pool's queue of models waiting for room.
    JoinQueue,
    /// Take the model out of that queue.
    LeaveQueue,
    /// Start the model's spare engine, if it keeps one and it fits ([`Standby`]).
    StartStandby,
    /// Start the spare engine's stop sequence.
    StopStandby,
    /// Answer one waiting request with this error.
    FailWaiter(Waiter, ProxyError),
    /// Run placement again: resources were freed or their use changed.
    Place,
    /// A reload removed the model and its engine is gone: drop the slot.
    Forget,
    /// Metrics: an engine restart; a load's duration; an eviction with its reason.
    CountRestart,
    ObserveLoad(Duration),
    CountEviction(&'static str),
}

/// The settings the transitions need.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timing {
    pub policy: RestartPolicy,
    pub load_timeout: Duration,
    /// Zero: no hang checks.
    pub hang_timeout: Duration,
    pub failed_cooldown: Duration,
}

/// A new engine process for the slot (generation already counted): `Starting`, with a
/// deadline for its load.
pub(super) fn started(
    slot: &mut Slot,
    handle: EngineHandle,
    limits: Limits,
    now: Instant,
    timing: &Timing,
) -> Vec<Effect> {
    let log = format!(
        "[mlxd] engine starting: pid {}, generation {}, source {}",
        handle.pid, slot.generation, slot.entry.source
    );
    slot.last_ready = None;
    slot.state = State::Starting {
        engine: Engine::new(handle, limits, now),
        loading: Loading::default(),
    };
    vec![
        Effect::Log(log),
        Effect::After(
            timing.load_timeout,
            Timer::LoadDeadline {
                model: slot.entry.id.clone(),
                generation: slot.generation,
            },
        ),
    ]
}

/// The engine says how far its load has got.
pub(super) fn loading(slot: &mut Slot, phase: LoadPhase, progress: f32) {
    if let State::Starting { loading, .. } = &mut slot.state {
        loading.phase = Some(phase);
        loading.progress = Some(progress);
    }
}

/// The engine's periodic `Stats`: a heartbeat, and its memory. Returns the previous
/// report of this engine (for the metrics' deltas), if it had one.
pub(super) fn stats(slot: &mut Slot, stats: Stats, now: Instant) -> Option<Stats> {
    let ready = slot.state.is_ready();
    if let Some(serving) = match &mut slot.state {
        State::Ready { serving, .. } => Some(serving),
        State::Draining { serving, .. } => serving.as_mut(),
        _ => None,
    } {
        serving.heartbeat = now;
    }
    let previous = slot.state.engine_mut().and_then(|e| e.stats.replace(stats));
    if ready {
        slot.observed_bytes = slot.observed_bytes.max(slot.reported_bytes());
    }
    previous
}

/// The engine is ready: waiters get their leases, the hang check and the idle clock start.
/// Ignored unless the slot is starting (an engine drained while it loaded stays drained).
pub(super) fn ready(slot: &mut Slot, ready: Ready, now: Instant, timing: &Timing) -> Vec<Effect> {
    let State::Starting { .. } = slot.state else {
        return Vec::new();
    };
    let State::Starting { engine, .. } = std::mem::replace(&mut slot.state, State::Idle) else {
        unreachable!("matched above");
    };
    let took = now.duration_since(engine.spawned_at);
    info!(
        model = %slot.id(),
        generation = slot.generation,
        model_id = %ready.model_id,
        load_ms = took.as_millis() as u64,
        "engine ready"
    );
    let mut effects = vec![
        Effect::Log(format!(
            "[mlxd] engine ready in {} ms (weights {} bytes)",
            took.as_millis(),
            ready.weight_bytes
        )),
        Effect::ObserveLoad(took),
    ];
    slot.last_ready = Some(ready.clone());
    slot.state = State::Ready {
        engine,
        serving: Serving {
            ready,
            ready_at: now,
            heartbeat: now,
        },
    };
    if !timing.hang_timeout.is_zero() {
        effects.push(Effect::After(
            timing.hang_timeout,
            Timer::HangCheck {
                model: slot.entry.id.clone(),
                generation: slot.generation,
            },
        ));
    }
    slot.observed_bytes = slot.observed_bytes.max(slot.reported_bytes());
    // Loaded with nobody using it (pinned preload, admin load): the idle clock runs.
    slot.last_used = now;
    effects.extend([Effect::GrantWaiters, Effect::ArmIdleTimer, Effect::Place]);
    if slot.entry.standby {
        effects.push(Effect::StartStandby);
    }
    effects
}

/// The stable period after an out-of-memory exit is over (the `LimitsRecovery` timer): the
/// configured limits come back, for the next engine and for the running one
/// ([`limits_grew`]). Nothing when they are not reduced any more, or a later out-of-memory
/// exit armed its own timer.
pub(super) fn limits_recovery(
    slot: &mut Slot,
    policy: &RestartPolicy,
    now: Instant,
) -> Vec<Effect> {
    if !slot.limits.recover_if_stable(policy, now) {
        return Vec::new();
    }
    let stable_s = policy.limits_recovery.as_secs();
    info!(model = %slot.id(), limits = ?slot.limits.current(), stable_s, "no out-of-memory exit for the stable period: configured limits restored");
    let mut effects = vec![Effect::Log(format!(
        "[mlxd] configured limits restored after {stable_s} s without an out-of-memory exit"
    ))];
    effects.extend(limits_grew(slot));
    effects
}

/// The model's limits grew back (recovery or an admin reset): an engine running with
/// smaller ones is recycled, drained now if it is ready and idle, else on its last release.
pub(super) fn limits_grew(slot: &mut Slot) -> Vec<Effect> {
    let current = slot.limits.current().clone();
    let draining = slot.state.is_draining();
    let Some(engine) = slot.state.engine_mut() else {
        return Vec::new();
    };
    if draining || engine.limits == current {
        return Vec::new();
    }
    engine.recycle = true;
    if slot.state.is_ready() && slot.in_flight() == 0 {
        return drain(slot, "limits_restored");
    }
    Vec::new()
}

/// A configuration reload changed the model's settings (`fields`, as
/// [`crate::reload::ModelChange`] names them) to `entry`. A running engine keeps the old
/// ones until its next load. A failed model is tried again at once (the new settings may be
/// what its load lacked); a model pinned now (or pinned and failed) is queued for an engine;
/// an unpinned one's idle clock starts again, since its TTL may have changed.
pub(super) fn reconfigured(
    slot: &mut Slot,
    entry: crate::catalog::ModelEntry,
    fields: &[&str],
) -> Vec<Effect> {
    let was_pinned = slot.entry.pinned;
    let was_failed = matches!(slot.state, State::Failed { .. });
    if was_failed {
        slot.state = State::Idle;
        slot.history.reset();
    }
    if fields.contains(&"limits") {
        slot.limits = crate::policy::ModelLimits::new(entry.limits.clone());
    }
    slot.entry = entry;
    let changed = fields;
    let fields = fields.join(", ");
    info!(model = %slot.id(), changed = %fields, "model settings changed by a configuration reload; they apply at its next load");
    let mut effects = vec![Effect::Log(format!(
        "[mlxd] configuration reloaded: {fields} changed (applies at the next load)"
    ))];
    effects.extend(standby_after_reload(slot, changed));
    if slot.entry.pinned && (!was_pinned || was_failed) {
        effects.push(Effect::Enqueue);
    } else if !slot.entry.pinned {
        // The pending check (if any) is replaced.
        slot.idle_timer = None;
        effects.push(Effect::ArmIdleTimer);
    }
    effects
}

/// What a reload does to a running spare: the spare was launched with the settings before it,
/// and "applies at the next load" includes a takeover, so a spare whose launch settings
/// (`source`, `limits`, `options`, `memory`) changed is stopped and another starts with the
/// new ones once it has exited; with `standby` now off it is stopped for good.
fn standby_after_reload(slot: &mut Slot, changed: &[&str]) -> Vec<Effect> {
    if slot.standby.is_none() {
        return Vec::new();
    }
    if !slot.entry.standby {
        return vec![
            Effect::Log("[mlxd] the standby engine stops: standby is off".into()),
            Effect::StopStandby,
        ];
    }
    let launch = ["source", "limits", "options", "memory"];
    if !changed.iter().any(|f| launch.contains(f)) {
        return Vec::new();
    }
    slot.replace_standby = true;
    vec![
        Effect::Log("[mlxd] the standby engine restarts with the reloaded settings".into()),
        Effect::StopStandby,
    ]
}

/// The adapters loaded at run time on the model's engine changed to `adapters`: every later
/// launch loads them. The serving engine was changed in place (by the admin route); a spare
/// launched before lacks them, so it is stopped and another starts once it has exited.
pub(super) fn runtime_adapters(slot: &mut Slot, adapters: Vec<(String, String)>) -> Vec<Effect> {
    let names: Vec<&str> = adapters.iter().map(|(n, _)| n.as_str()).collect();
    let line = format!(
        "[mlxd] adapters loaded at run time: {}",
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    );
    slot.entry.runtime_adapters = adapters;
    let mut effects = vec![Effect::Log(line)];
    if slot.standby.is_some() {
        slot.replace_standby = true;
        effects.push(Effect::Log(
            "[mlxd] the standby engine restarts with the adapters loaded at run time".into(),
        ));
        effects.push(Effect::StopStandby);
    }
    effects
}

/// Whether the model's spare engine should start now.
#[derive(Debug)]
pub(super) enum StandbyStart {
    /// Not wanted: the model keeps none, has one, has no ready engine, or the pool stops.
    No,
    /// Requests are in flight on the engine (streams just resumed on it): the spare's load
    /// would compete with them. These effects try again after [`STANDBY_WAIT`]; the
    /// engine's last release tries earlier.
    Later(Vec<Effect>),
    /// Start it if the memory budget holds it beside everything resident.
    Now,
}

/// Decides whether `slot`'s spare engine starts (`due`: its wait is over, it starts even
/// with requests in flight).
pub(super) fn standby_start(slot: &Slot, mood: PoolMood, due: bool) -> StandbyStart {
    if mood.shutting_down || !slot.entry.standby || slot.standby.is_some() || !slot.state.is_ready()
    {
        return StandbyStart::No;
    }
    if slot.in_flight() > 0 && !due {
        return StandbyStart::Later(vec![Effect::After(
            STANDBY_WAIT,
            Timer::StandbyDue {
                model: slot.entry.id.clone(),
            },
        )]);
    }
    StandbyStart::Now
}

/// The restart timer of engine `generation` went off: a new engine starts if the slot is
/// still restarting that generation and the pool is not shutting down.
pub(super) fn restart_due(slot: &Slot, generation: u64, mood: PoolMood) -> bool {
    slot.generation == generation
        && matches!(slot.state, State::Restarting { .. })
        && !mood.shutting_down
}

/// The model's spare engine was spawned (its generation already counted): it loads.
pub(super) fn standby_started(
    slot: &mut Slot,
    handle: EngineHandle,
    limits: Limits,
    now: Instant,
) -> Vec<Effect> {
    let line = format!(
        "[mlxd] standby engine starting: pid {}, generation {}",
        handle.pid, handle.generation
    );
    slot.standby = Some(Standby {
        engine: Engine::new(handle, limits, now),
        ready: None,
    });
    vec![Effect::Log(line), Effect::Place]
}

/// An event of the spare engine: its `Ready` makes it able to take over, its `Stats` are
/// its memory; its exit ends it (a new one starts when the serving engine is next ready).
pub(super) fn standby_event(slot: &mut Slot, event: EngineEvent) -> Vec<Effect> {
    let Some(standby) = slot.standby.as_mut() else {
        return Vec::new();
    };
    match event {
        EngineEvent::Loading { .. } => Vec::new(),
        EngineEvent::Stats(s) => {
            standby.engine.stats = Some(s);
            Vec::new()
        }
        EngineEvent::Ready(r) => {
            info!(model = %slot.entry.id, pid = standby.engine.handle.pid, "standby engine ready");
            let line = format!(
                "[mlxd] standby engine ready: pid {}, waiting to take over",
                standby.engine.handle.pid
            );
            standby.ready = Some(r);
            vec![Effect::Log(line)]
        }
        EngineEvent::Reaped { .. } => Vec::new(),
        EngineEvent::Exited(report) => {
            slot.standby = None;
            if !report.cause.is_requested() {
                warn!(model = %slot.entry.id, cause = %report.cause, "standby engine exited");
            }
            let mut effects = vec![
                Effect::Log(format!("[mlxd] standby engine exited: {}", report.cause)),
                Effect::Place,
            ];
            if std::mem::take(&mut slot.replace_standby) {
                effects.push(Effect::StartStandby);
            }
            effects
        }
    }
}

/// The serving engine crashed and a ready standby takes over at once: it is the model's
/// engine now (its generation and socket), waiters get leases on it, and a new standby
/// starts behind it. `None` (nothing changed) without a ready standby.
fn promote_standby(slot: &mut Slot, now: Instant, timing: &Timing) -> Option<Vec<Effect>> {
    if slot.standby.as_ref().is_none_or(|s| s.ready.is_none()) {
        return None;
    }
    let Standby { engine, ready } = slot.standby.take()?;
    let ready = ready?;
    slot.generation = engine.handle.generation;
    std::mem::swap(&mut slot.socket, &mut slot.spare_socket);
    slot.restarts += 1;
    slot.last_ready = Some(ready.clone());
    warn!(model = %slot.entry.id, pid = engine.handle.pid, generation = slot.generation, "the standby engine takes over");
    let line = format!(
        "[mlxd] the standby engine (pid {}) serves now",
        engine.handle.pid
    );
    slot.state = State::Ready {
        engine,
        serving: Serving {
            ready,
            ready_at: now,
            heartbeat: now,
        },
    };
    let mut effects = vec![
        Effect::Log(line),
        Effect::CountRestart,
        Effect::GrantWaiters,
    ];
    if !timing.hang_timeout.is_zero() {
        effects.push(Effect::After(
            timing.hang_timeout,
            Timer::HangCheck {
                model: slot.entry.id.clone(),
                generation: slot.generation,
            },
        ));
    }
    // The next spare loads once the streams resumed here are done (their release asks for
    // it), or `STANDBY_WAIT` from now: its load would compete with their first steps.
    effects.extend([
        Effect::ArmIdleTimer,
        Effect::After(
            STANDBY_WAIT,
            Timer::StandbyDue {
                model: slot.entry.id.clone(),
            },
        ),
        Effect::Place,
    ]);
    Some(effects)
}

/// Stops admitting requests to the engine and stops it once its in-flight requests are
/// done; the engine writes its prefix cache to the SSD tier first (a bounded wait of its
/// own), so a later engine of the model starts warm. No-op without an engine or when it
/// drains already.
pub(super) fn drain(slot: &mut Slot, reason: &'static str) -> Vec<Effect> {
    let (engine, serving) = match std::mem::replace(&mut slot.state, State::Idle) {
        State::Starting { engine, .. } => (engine, None),
        State::Ready { engine, serving } => (engine, Some(serving)),
        other => {
            slot.state = other;
            return Vec::new();
        }
    };
    info!(model = %slot.id(), pid = engine.handle.pid, reason, in_flight = engine.in_flight, "draining engine");
    let mut effects = vec![
        Effect::Control(ParentMsg::Spill),
        Effect::Control(ParentMsg::Drain),
        Effect::Log(format!(
            "[mlxd] unloading ({reason}); {} request(s) in flight",
            engine.in_flight
        )),
        Effect::CountEviction(reason),
    ];
    if engine.in_flight == 0 {
        effects.push(Effect::Stop);
    }
    slot.state = State::Draining { engine, serving };
    if slot.standby.is_some() {
        effects.push(Effect::StopStandby);
    }
    effects
}

/// A request on engine `generation` is over.
pub(super) fn release(slot: &mut Slot, generation: u64, now: Instant) -> Vec<Effect> {
    if slot.generation != generation {
        return Vec::new();
    }
    let Some(engine) = slot.state.engine_mut() else {
        return Vec::new();
    };
    engine.in_flight = engine.in_flight.saturating_sub(1);
    let (in_flight, recycle) = (engine.in_flight, engine.recycle);
    slot.last_used = now;
    if in_flight > 0 {
        return Vec::new();
    }
    match slot.state {
        State::Draining { .. } => vec![Effect::Stop],
        State::Ready { .. } if recycle => drain(slot, "limits_restored"),
        State::Ready { .. } if slot.entry.standby && slot.standby.is_none() => {
            vec![Effect::ArmIdleTimer, Effect::Place, Effect::StartStandby]
        }
        State::Ready { .. } => vec![Effect::ArmIdleTimer, Effect::Place],
        _ => Vec::new(),
    }
}

/// Starts the idle clock's timer, unless one is pending already or the slot has no TTL.
pub(super) fn arm_idle(slot: &mut Slot) -> Vec<Effect> {
    let Some(ttl) = slot.ttl() else {
        return Vec::new();
    };
    if slot.idle_timer.is_some() {
        return Vec::new();
    }
    vec![idle_timer(slot, ttl)]
}

/// A new idle check after `delay`, replacing any pending one.
fn idle_timer(slot: &mut Slot, delay: Duration) -> Effect {
    let number = slot.next_idle_timer;
    slot.next_idle_timer += 1;
    slot.idle_timer = Some(number);
    Effect::After(
        delay,
        Timer::IdleCheck {
            model: slot.entry.id.clone(),
            number,
        },
    )
}

/// Idle check `number`: a ready engine idle for its TTL is drained; one idle for less is
/// checked again when the TTL would be reached (a busy engine re-arms on its last release).
pub(super) fn idle_check(slot: &mut Slot, number: u64, now: Instant) -> Vec<Effect> {
    if slot.idle_timer != Some(number) {
        return Vec::new();
    }
    slot.idle_timer = None;
    let Some(ttl) = slot.ttl() else {
        return Vec::new();
    };
    if !slot.state.is_ready() || slot.in_flight() > 0 {
        return Vec::new();
    }
    let idle_for = now.duration_since(slot.last_used);
    if idle_for >= ttl {
        info!(model = %slot.id(), idle_s = idle_for.as_secs_f64(), "idle TTL reached");
        drain(slot, "ttl")
    } else {
        vec![idle_timer(slot, ttl - idle_for)]
    }
}

/// A request's `keep_alive` (Ollama): from now on the engine stays loaded for `keep`
/// after its last request instead of the configured TTL. A pending idle check is replaced,
/// so a shorter keep-alive takes effect at once.
pub(super) fn keep_alive(slot: &mut Slot, keep: KeepAlive, now: Instant) -> Vec<Effect> {
    slot.keep_alive = Some(keep);
    slot.idle_timer = None;
    slot.last_used = now;
    if slot.state.is_ready() && slot.in_flight() == 0 {
        arm_idle(slot)
    } else {
        // A busy engine arms at its last release, a loading one when it is ready.
        Vec::new()
    }
}

/// The load deadline of engine `generation`: still starting means it is killed.
pub(super) fn load_deadline(slot: &Slot, generation: u64, timing: &Timing) -> Vec<Effect> {
    if slot.generation != generation || !matches!(slot.state, State::Starting { .. }) {
        return Vec::new();
    }
    vec![Effect::Kill(format!(
        "not ready within the load timeout of {} ms",
        timing.load_timeout.as_millis()
    ))]
}

/// A ready engine that has sent no `Stats` for the hang timeout is hung (a frozen process,
/// a deadlocked runtime): it is killed, which the exit path treats as a crash (restart,
/// resumption of its requests). Otherwise the check comes again.
pub(super) fn hang_check(
    slot: &Slot,
    generation: u64,
    now: Instant,
    timing: &Timing,
) -> Vec<Effect> {
    if slot.generation != generation {
        return Vec::new();
    }
    let Some(serving) = slot.state.serving() else {
        return Vec::new();
    };
    match hang_verdict(Some(serving.heartbeat), now, timing.hang_timeout) {
        Liveness::Alive { check_in } => vec![Effect::After(
            check_in,
            Timer::HangCheck {
                model: slot.entry.id.clone(),
                generation,
            },
        )],
        Liveness::Hung { silent } => {
            let reason = format!(
                "hung: no Stats for {} ms (server.hang_timeout_ms = {})",
                silent.as_millis(),
                timing.hang_timeout.as_millis()
            );
            warn!(model = %slot.id(), generation, %reason, "killing hung engine");
            vec![
                Effect::Log(format!("[mlxd] engine {reason}; killing it")),
                Effect::Kill(reason),
            ]
        }
    }
}

/// The pool shuts down: a running engine stops (and drains meanwhile); a failed model
/// keeps its failure for the last status; anything else is stopped.
pub(super) fn shut_down(slot: &mut Slot) -> Vec<Effect> {
    let mut effects = shut_down_engine(slot);
    if slot.standby.is_some() {
        effects.push(Effect::StopStandby);
    }
    effects
}

fn shut_down_engine(slot: &mut Slot) -> Vec<Effect> {
    match std::mem::replace(&mut slot.state, State::Stopped) {
        State::Starting { engine, .. } => {
            info!(model = %slot.id(), pid = engine.handle.pid, "stopping engine");
            slot.state = State::Draining {
                engine,
                serving: None,
            };
            vec![Effect::Stop]
        }
        State::Ready { engine, serving } => {
            info!(model = %slot.id(), pid = engine.handle.pid, "stopping engine");
            slot.state = State::Draining {
                engine,
                serving: Some(serving),
            };
            vec![Effect::Stop]
        }
        state @ State::Draining { .. } => {
            slot.state = state;
            vec![Effect::Stop]
        }
        state @ State::Failed { .. } => {
            slot.state = state;
            Vec::new()
        }
        _ => Vec::new(),
    }
}

/// What an admin reset changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResetDone {
    /// The model was failed and is idle now.
    pub failure_cleared: bool,
    /// Limits halved after out-of-memory exits are the configured ones again (a running
    /// engine with the smaller ones is to be recycled).
    pub limits_restored: bool,
}

/// An admin reset (`POST /engines/reset`): the crash history and restart count are
/// forgotten, a failed model becomes idle, reduced limits come back.
pub(super) fn reset(slot: &mut Slot) -> ResetDone {
    slot.history.reset();
    slot.restarts = 0;
    let failure_cleared = matches!(slot.state, State::Failed { .. });
    if failure_cleared {
        info!(model = %slot.id(), "failed state cleared by admin reset");
        slot.state = State::Idle;
    }
    let limits_restored = slot.limits.restore();
    if limits_restored {
        info!(model = %slot.id(), limits = ?slot.limits.current(), "configured limits restored by admin reset");
    }
    ResetDone {
        failure_cleared,
        limits_restored,
    }
}

/// What the pool is doing besides this model when its engine exits.
#[derive(Debug, Clone, Copy)]
pub(super) struct PoolMood {
    pub shutting_down: bool,
}

/// An engine reported gone when its control channel closed was reaped: the slot's record of
/// that exit, and a failure named after it, get the report with the exit status.
pub(super) fn reaped(slot: &mut Slot, early: &Arc<ExitReport>, reaped: Arc<ExitReport>) {
    // Only the slot's last exit: an older one's record is gone, and so is what it caused.
    let Some((report, _)) = slot.last_exit.as_mut() else {
        return;
    };
    if !Arc::ptr_eq(report, early) {
        return;
    }
    *report = reaped.clone();
    if let State::Failed { cause, .. } = &mut slot.state {
        if *cause == early.summary() {
            *cause = reaped.summary();
        } else if *cause == early.cause.to_string() {
            *cause = reaped.cause.to_string();
        }
    }
}

/// The engine exited (or could not be spawned). Requested stops leave the model stopped
/// (restarted at once if requests wait); anything else goes through the restart policy:
/// a restart after backoff, the failed state after too many crashes, or — for a load the
/// engine says cannot succeed — the failed state at once, with no retry.
pub(super) fn exited(
    slot: &mut Slot,
    report: Arc<ExitReport>,
    now: Instant,
    wall: SystemTime,
    timing: &Timing,
    mood: PoolMood,
) -> Vec<Effect> {
    let key = slot.entry.id.clone();
    let policy = timing.policy;
    // Every branch below leaves a state without an engine.
    let recycled = slot.state.engine().is_some_and(|e| e.recycle);
    let ready_for = slot.state.serving().map(|s| now.duration_since(s.ready_at));
    let in_force = slot.state.serving().and_then(|s| s.ready.limits.clone());
    slot.last_exit = Some((report.clone(), wall));
    let mut effects = vec![
        Effect::Log(format!("[mlxd] engine exited: {}", report.cause)),
        Effect::AnswerUnloads,
    ];
    if mood.shutting_down {
        slot.state = State::Stopped;
        effects.push(Effect::FailWaiters(ProxyError::ShuttingDown));
        return effects;
    }
    if slot.removed {
        // Drained after a reload removed it: the model goes.
        slot.state = State::Stopped;
        effects.extend([Effect::Forget, Effect::Place]);
        return effects;
    }
    if report.cause.is_requested() {
        slot.state = State::Stopped;
        // Unloaded: the next engine takes the configured TTL, as Ollama's next runner
        // does, unless its request brings a keep-alive of its own.
        slot.keep_alive = None;
        // Requests that arrived while it drained get a fresh engine; so does a pinned
        // model recycled for its restored limits.
        if slot.live_waiters() > 0 || (recycled && slot.entry.pinned) {
            effects.push(Effect::Enqueue);
        }
        effects.push(Effect::Place);
        return effects;
    }
    // It exited before it was ready: its load failed.
    let load_failed = ready_for.is_none();
    if matches!(report.cause, ExitCause::OutOfMemory { .. }) {
        let old = slot.limits.current().clone();
        if let Some(smaller) = slot.limits.on_oom(now, in_force.as_ref()) {
            warn!(
                model = %key,
                ?old,
                new = ?smaller,
                recovery_s = policy.limits_recovery.as_secs(),
                "out of memory: restarting with smaller limits"
            );
            effects.push(Effect::Log(format!(
                "[mlxd] out of memory: restarting with smaller limits {smaller:?} (configured limits return after {} s without another)",
                policy.limits_recovery.as_secs()
            )));
        }
        if slot.limits.reduced() {
            effects.push(Effect::After(
                policy.limits_recovery,
                Timer::LimitsRecovery { model: key.clone() },
            ));
        }
    }
    let decision = slot.history.on_exit(&policy, &report.cause, now, ready_for);
    let oom = matches!(report.cause, ExitCause::OutOfMemory { .. });
    if matches!(decision, Decision::Restart { .. }) && !oom {
        if let Some(promoted) = promote_standby(slot, now, timing) {
            effects.extend(promoted);
            return effects;
        }
    }
    if slot.standby.is_some() {
        // Failed, or out of memory: a spare with the old limits is no successor.
        effects.push(Effect::StopStandby);
    }
    match decision {
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
            effects.extend([
                Effect::CountRestart,
                Effect::After(
                    delay,
                    Timer::RestartDue {
                        model: key.clone(),
                        generation: slot.generation,
                    },
                ),
            ]);
            if load_failed {
                // Those waiting for this load get its error, not a wait through the
                // backoff (the next request waits for the retry).
                effects.push(Effect::FailWaiters(ProxyError::LoadFailed {
                    model: key.clone(),
                    cause: report.summary(),
                    retry_after: delay.max(Duration::from_secs(1)),
                }));
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
            effects.push(Effect::FailWaiters(ProxyError::Failed {
                model: key.clone(),
                cause: cause.clone(),
                retry_after: timing.failed_cooldown,
            }));
            slot.state = State::Failed {
                cause,
                since: now,
                cannot_load: false,
            };
            slot.keep_alive = None;
        }
        Decision::DoNotRetry => {
            let cause = match &report.cause {
                ExitCause::CannotLoad { detail } => detail.clone(),
                other => other.to_string(),
            };
            error!(model = %key, "cannot load the model: {cause}");
            effects.extend([
                Effect::Log(format!("[mlxd] cannot load the model: {cause}")),
                Effect::FailWaiters(ProxyError::CannotLoad {
                    model: key.clone(),
                    cause: cause.clone(),
                    retry_after: timing.failed_cooldown,
                }),
            ]);
            slot.state = State::Failed {
                cause,
                since: now,
                cannot_load: true,
            };
            slot.keep_alive = None;
        }
    }
    effects.push(Effect::Place);
    effects
}

#[cfg(test)]
pub(super) mod tests;
