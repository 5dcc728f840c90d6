//! The model pool: one actor task owns the table `model id → engine state` and all pool
//! policy; everyone else sends it a command with a oneshot reply through a cloneable
//! [`PoolHandle`].
//!
//! Policy (the decisions themselves are in [`crate::placement`]): an engine starts on
//! the first request for its model, if it fits within `max_engines` and the memory
//! budget; otherwise least-recently-used idle, unpinned engines are drained and stopped
//! first, or the request waits (bounded) for busy engines, or it is refused with the
//! numbers. Idle engines stop after their TTL. Pinned models start with the pool and
//! are never evicted. Every request holds an in-flight guard ([`Lease`]) until its
//! response body ends, so the pool knows which engines are busy.
//!
//! Layout: [`handle`] (the HTTP side's API and the lease), [`actor`] (the task: commands,
//! events, timers, and the effects it carries out), [`slot`] (one model: its state, each
//! state holding its own data), [`lifecycle`] (an engine's life as pure transitions from
//! state, event and time to state and effects), [`queue`] (requests waiting for an engine
//! and models waiting for room, as pure transitions of the same kind), [`status`] (what
//! `/engines` shows).

mod actor;
mod handle;
mod lifecycle;
mod queue;
mod slot;
mod status;

pub use actor::{start, PoolParts};
#[cfg(test)]
use actor::{start_with, Spawner};
pub use handle::{Lease, PoolHandle};
pub use slot::KeepAlive;
pub use status::{EngineStatus, LastExit, LimitsInfo, ReadyInfo, StandbyInfo, StatsInfo};

#[cfg(test)]
mod tests;
