//! Requests and models waiting, as pure transitions: a request's admission (a lease now,
//! a refusal, or a place among its model's waiters), a cold model's wait for room (engine
//! slots or memory) in the pool's queue and placement's decision for it (start, evict
//! idle engines first, keep waiting, or refuse), the ends of both waits (queue timeout,
//! capacity deadline, an admin unload, the model's removal, shutdown). Like
//! [`super::lifecycle`], each takes a model's [`Slot`] (or placement's numbers) and the
//! time and returns [`Effect`]s for the actor to carry out; nothing here reads a clock,
//! sends on a channel or spawns, so each is unit-tested without tokio (`queue/tests.rs`).

use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::actor::Timer;
use super::lifecycle::{self, Effect, PoolMood};
use super::slot::{Slot, State, WaitKind, Waiter};
use crate::error::ProxyError;
use crate::placement::{self, Budget, Plan, Resident, Shortfall};

/// Decides a request for model `key` (`slot`: its slot, if configured) before the slot's
/// own rules ([`admit`]): a pool shutting down, a model it does not know and one a reload
/// removed answer at once.
pub(super) fn request(
    slot: Option<&mut Slot>,
    key: &str,
    mood: PoolMood,
    kind: WaitKind,
    now: Instant,
    rules: &AdmitRules,
) -> Admission {
    if mood.shutting_down {
        return Admission::Refuse(ProxyError::ShuttingDown);
    }
    let Some(slot) = slot else {
        return Admission::Refuse(ProxyError::NotFound(format!(
            "model {key} is not configured"
        )));
    };
    if slot.removed {
        return Admission::Refuse(ProxyError::NotFound(format!(
            "model {key} was removed from the configuration"
        )));
    }
    admit(slot, kind, now, rules)
}

/// What a request may ask of the pool.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdmitRules {
    pub failed_cooldown: Duration,
    /// Requests that may wait for one model.
    pub queue_capacity: usize,
    /// Requests one engine may have in flight.
    pub max_in_flight: u32,
}

/// What a request for the model gets now.
#[derive(Debug)]
pub(super) enum Admission {
    /// A lease on the ready engine.
    Grant,
    /// This answer at once.
    Refuse(ProxyError),
    /// A place among the model's waiters (the actor starts a cold model).
    Wait,
}

/// Decides a request for the slot's model (a retried one never gets the engine generation it
/// found dead). A failed model answers with its failure until the cool-down is over, and is
/// then tried again; a full queue answers a new request 429 with when to retry (a retried
/// request and the start-up load, which take no place, always wait:
/// [`WaitKind::takes_a_place`]).
pub(super) fn admit(
    slot: &mut Slot,
    kind: WaitKind,
    now: Instant,
    rules: &AdmitRules,
) -> Admission {
    let avoid = kind.avoids();
    let key = slot.entry.id.clone();
    let known_dead = avoid.is_some() && avoid == slot.state.engine().map(|e| e.handle.generation);
    let in_flight = slot.in_flight();
    let retry_after = match &slot.state {
        // Its exit is on the way: wait in the queue for the restart.
        State::Ready { .. } if known_dead => Duration::from_secs(1),
        // The engine's own queue is bounded here, before it grows without limit; as with the
        // request queue, only new work is refused (a retried request was in flight before).
        State::Ready { .. } if in_flight >= rules.max_in_flight && kind.takes_a_place() => {
            return Admission::Refuse(ProxyError::TooManyInFlight {
                model: key,
                limit: rules.max_in_flight,
                retry_after: Duration::from_secs(1),
            });
        }
        State::Ready { .. } => return Admission::Grant,
        State::Failed {
            cause,
            since,
            cannot_load,
        } => {
            let elapsed = now.duration_since(*since);
            if elapsed < rules.failed_cooldown {
                let (cause, retry_after) = (cause.clone(), rules.failed_cooldown - elapsed);
                return Admission::Refuse(if *cannot_load {
                    ProxyError::CannotLoad {
                        model: key,
                        cause,
                        retry_after,
                    }
                } else {
                    ProxyError::Failed {
                        model: key,
                        cause,
                        retry_after,
                    }
                });
            }
            info!(model = %key, "failed cool-down over; starting again");
            slot.history.reset();
            slot.state = State::Idle;
            Duration::from_secs(1)
        }
        State::Restarting { at } => at.saturating_duration_since(now) + Duration::from_secs(1),
        State::Idle
        | State::Stopped
        | State::Starting { .. }
        | State::Queued { .. }
        | State::Draining { .. } => Duration::from_secs(1),
    };
    if kind.takes_a_place() && slot.queued_requests() >= rules.queue_capacity {
        return Admission::Refuse(ProxyError::QueueFull {
            model: key,
            capacity: rules.queue_capacity,
            retry_after,
        });
    }
    Admission::Wait
}

/// The engine is ready ([`Effect::GrantWaiters`]): every waiter leaves the queue, and those
/// whose client is still there, in arrival order, are the ones to get a lease; one whose
/// client left gets nothing (no lease is counted in flight for it).
pub(super) fn to_grant(slot: &mut Slot) -> Vec<Waiter> {
    slot.waiters.drain(..).filter(|w| !w.is_closed()).collect()
}

/// A request that has to wait for the model's engine ([`Admission::Wait`]) joins its
/// waiters and its queue timeout starts; a cold model is queued for an engine.
pub(super) fn wait(slot: &mut Slot, waiter: Waiter, queue_timeout: Duration) -> Vec<Effect> {
    let timer = Timer::WaiterDeadline {
        model: slot.entry.id.clone(),
        waiter: waiter.id,
    };
    slot.waiters.push_back(waiter);
    let mut effects = vec![Effect::After(queue_timeout, timer)];
    if slot.state.is_cold() {
        effects.push(Effect::Enqueue);
    }
    effects
}

/// A cold model wants an engine: it waits for room (engine slots or memory) as wait
/// `ticket`, for at most `capacity_wait`, and placement runs. Anything not cold already
/// has (or is getting) an engine.
pub(super) fn queue(slot: &mut Slot, ticket: u64, capacity_wait: Duration) -> Vec<Effect> {
    if !slot.state.is_cold() {
        return Vec::new();
    }
    slot.state = State::Queued { ticket };
    vec![
        Effect::JoinQueue,
        Effect::After(
            capacity_wait,
            Timer::CapacityDeadline {
                model: slot.entry.id.clone(),
                ticket,
            },
        ),
        Effect::Place,
    ]
}

/// Placement's look at a model in its queue: whether it still wants an engine. One no
/// longer queued leaves the queue; one whose requests all gave up (and not pinned) goes
/// back to idle without a start.
pub(super) fn still_queued(slot: &mut Slot) -> bool {
    if !matches!(slot.state, State::Queued { .. }) {
        return false;
    }
    if slot.live_waiters() == 0 && !slot.entry.pinned {
        slot.state = State::Idle;
        return false;
    }
    true
}

/// The model cannot get an engine: it leaves the queue, idle, and its waiters get `err`.
pub(super) fn refuse(slot: &mut Slot, err: ProxyError) -> Vec<Effect> {
    warn!(model = %slot.id(), error = %err, "model cannot be loaded");
    slot.state = State::Idle;
    vec![
        Effect::LeaveQueue,
        Effect::Log(format!("[mlxd] cannot load: {err}")),
        Effect::FailWaiters(err),
    ]
}

/// Wait `ticket` for room is over. While engines drain (room is being made) it goes on —
/// the requests' queue timeouts bound it; otherwise, if placement (`plan`, for the model
/// now) still has to wait, the model is refused with what was missing.
pub(super) fn capacity_deadline(
    slot: &mut Slot,
    ticket: u64,
    making_room: bool,
    plan: Plan,
    budget_bytes: u64,
) -> Vec<Effect> {
    if !matches!(slot.state, State::Queued { ticket: t } if t == ticket) || making_room {
        return Vec::new();
    }
    let model = slot.entry.id.clone();
    let retry_after = Some(Duration::from_secs(5));
    let err = match plan {
        Plan::Wait(Shortfall::Memory { needed, available }) => ProxyError::InsufficientMemory {
            model,
            needed,
            available,
            budget: budget_bytes,
            retry_after,
        },
        Plan::Wait(Shortfall::Engines { max_engines }) => ProxyError::NoEngineAvailable {
            model,
            max_engines,
            why: "busy",
            retry_after,
        },
        // It fits, or will once evictions finish: keep waiting.
        _ => return Vec::new(),
    };
    refuse(slot, err)
}

/// Waiter `waiter`'s queue timeout is over. Waiting for room, a restart or a drain ends
/// here with a 503; waiting for a load in progress goes on: the load timeout bounds it,
/// and its end (ready, or the load's error) answers the waiter.
pub(super) fn waiter_deadline(slot: &mut Slot, waiter: u64) -> Vec<Effect> {
    let state = match slot.state {
        State::Starting { .. } => return Vec::new(),
        State::Queued { .. } => "waiting for room (engine slots or memory)",
        State::Restarting { .. } => "restarting",
        State::Draining { .. } => "draining",
        _ => "still starting",
    };
    let Some(at) = slot.waiters.iter().position(|w| w.id == waiter) else {
        return Vec::new();
    };
    let Some(w) = slot.waiters.remove(at) else {
        return Vec::new();
    };
    vec![Effect::FailWaiter(
        w,
        ProxyError::Unavailable {
            model: slot.entry.id.clone(),
            state,
            retry_after: Duration::from_secs(2),
        },
    )]
}

/// An admin unload of a model still waiting for room: it stops waiting, idle, and its
/// requests are answered 503. `None` when the model is not queued.
pub(super) fn unqueue(slot: &mut Slot) -> Option<Vec<Effect>> {
    if !matches!(slot.state, State::Queued { .. }) {
        return None;
    }
    slot.state = State::Idle;
    Some(vec![
        Effect::LeaveQueue,
        Effect::FailWaiters(ProxyError::Unavailable {
            model: slot.entry.id.clone(),
            state: "unloaded by an administrator",
            retry_after: Duration::from_secs(1),
        }),
    ])
}

/// What placement can use: the budget, and the memory running jobs hold out of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    pub budget: Budget,
    pub job_bytes: u64,
}

/// The placement plan for an engine that needs `needed` bytes beside `residents`, with the
/// jobs' memory taken out of the budget. A model that would fit but for the jobs waits for
/// them rather than being refused.
pub(super) fn plan_beside_jobs(needed: u64, residents: &[Resident], room: Room) -> Plan {
    let budget = Budget {
        memory_bytes: room.budget.memory_bytes.saturating_sub(room.job_bytes),
        ..room.budget
    };
    match placement::plan(needed, residents, budget) {
        Plan::RefuseMemory { needed, available } if room.job_bytes > 0 => {
            match placement::plan(needed, residents, room.budget) {
                Plan::RefuseMemory { .. } => Plan::RefuseMemory { needed, available },
                _ => Plan::Wait(Shortfall::Memory { needed, available }),
            }
        }
        plan => plan,
    }
}

/// One pass of placement over the pool's queue, in arrival order. Once a model has to
/// wait (or evicts to make room), those behind it may only start if they fit without
/// evicting anything: the room being made is the first one's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pass {
    pub blocked: bool,
}

/// What placement does for one queued model.
#[derive(Debug)]
pub(super) enum Placement {
    /// Start its engine now (it leaves the queue).
    Start,
    /// Drain and stop these idle engines for it; it stays queued until they are gone.
    Evict(Vec<String>),
    /// Keep waiting (its capacity deadline bounds the wait).
    Wait,
    /// It can never fit: refuse it with this ([`refuse`]).
    Refuse(ProxyError),
}

/// Placement's decision for queued model `key` given its `plan` ([`plan_beside_jobs`] on
/// the engines resident now), the pass so far and the memory budget (for the refusal's
/// numbers).
pub(super) fn place(key: &str, plan: Plan, pass: &mut Pass, budget_bytes: u64) -> Placement {
    match plan {
        Plan::Start => Placement::Start,
        Plan::Evict(victims) if !pass.blocked => {
            pass.blocked = true;
            Placement::Evict(victims)
        }
        Plan::Evict(_) | Plan::Wait(_) => {
            pass.blocked = true;
            Placement::Wait
        }
        Plan::RefuseMemory { needed, available } => {
            Placement::Refuse(ProxyError::InsufficientMemory {
                model: key.to_string(),
                needed,
                available,
                budget: budget_bytes,
                retry_after: None,
            })
        }
        Plan::RefuseEngines {
            max_engines,
            pinned,
        } => Placement::Refuse(ProxyError::NoEngineAvailable {
            model: key.to_string(),
            max_engines,
            why: if pinned >= max_engines {
                "held by pinned models"
            } else {
                "busy"
            },
            retry_after: None,
        }),
    }
}

/// What an admin unload (`POST /engines/unload`) does to the model.
#[derive(Debug)]
pub(super) enum Unload {
    /// Done with these effects: the admin is answered at once.
    Now(Vec<Effect>),
    /// The engine drains with these effects; the admin is answered when it is gone
    /// ([`Effect::AnswerUnloads`]).
    WhenStopped(Vec<Effect>),
}

/// An admin unload: a model waiting for room stops waiting ([`unqueue`]); a running engine
/// drains and stops; a model without an engine is done already.
pub(super) fn unload(slot: &mut Slot) -> Unload {
    if let Some(effects) = unqueue(slot) {
        return Unload::Now(effects);
    }
    if slot.state.engine().is_some() {
        return Unload::WhenStopped(lifecycle::drain(slot, "admin"));
    }
    Unload::Now(Vec::new())
}

/// A reload removed the model: its waiters get 404 and it leaves the queue; its engine
/// drains (in-flight requests finish) and stops, and the slot goes when it has exited
/// ([`lifecycle::exited`]); without an engine it goes now.
pub(super) fn remove(slot: &mut Slot) -> Vec<Effect> {
    slot.removed = true;
    let mut effects = vec![
        Effect::FailWaiters(ProxyError::NotFound(format!(
            "model {} was removed from the configuration",
            slot.id()
        ))),
        Effect::LeaveQueue,
    ];
    info!(model = %slot.id(), in_flight = slot.in_flight(), "model removed by a configuration reload");
    if slot.state.engine().is_some() {
        effects.push(Effect::Log(
            "[mlxd] removed from the configuration: draining, then stopping".into(),
        ));
        effects.extend(lifecycle::drain(slot, "removed"));
    } else {
        effects.push(Effect::Forget);
    }
    effects
}

/// The pool shuts down: the model's waiters are answered 503 and its engine stops
/// ([`lifecycle::shut_down`]).
pub(super) fn shut_down(slot: &mut Slot) -> Vec<Effect> {
    let mut effects = vec![Effect::FailWaiters(ProxyError::ShuttingDown)];
    effects.extend(lifecycle::shut_down(slot));
    effects
}

#[cfg(test)]
mod tests;
