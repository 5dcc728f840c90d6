//! The HTTP side's handle on the pool actor: commands with oneshot replies, and the
//! lease a request holds on an engine until its response body ends.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::slot::{KeepAlive, WaitKind};
use super::status::EngineStatus;
use crate::catalog::Catalog;
use crate::config::Config;
use crate::engine::DeathWatch;
use crate::error::ProxyError;
use crate::policy::{check_kv, KvCapacity, Unservable};
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
    pub(super) _in_flight: Arc<InFlight>,
}

/// Tells the pool when a request is over.
#[derive(Debug)]
pub(super) struct InFlight {
    pub(super) model: String,
    pub(super) generation: u64,
    pub(super) tx: mpsc::UnboundedSender<(String, u64)>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // The pool is gone only at shutdown; nothing to count then.
        let _ = self
            .tx
            .send((std::mem::take(&mut self.model), self.generation));
    }
}

pub(super) type Reply<T> = oneshot::Sender<T>;

#[derive(Debug)]
pub(super) enum Command {
    Acquire {
        model: String,
        /// A request, a retried one (never handed the engine generation it found dead), or
        /// the start-up load; only a request takes a place of the request queue.
        kind: WaitKind,
        reply: Reply<Result<Lease, ProxyError>>,
    },
    Unload {
        model: String,
        reply: Reply<Result<(), ProxyError>>,
    },
    KeepAlive {
        model: String,
        keep: KeepAlive,
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
    /// The model's adapters loaded at run time changed: engines it launches from now on
    /// load them ([`crate::catalog::ModelEntry::launch_options`]).
    RuntimeAdapters {
        model: String,
        adapters: Vec<(String, String)>,
        reply: Reply<Result<(), ProxyError>>,
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
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) queue_timeout: Duration,
    /// How long an acquire may wait at most: the pool answers every waiter itself (after
    /// the queue timeout, or when the load it waits for ends), so this only guards against
    /// a pool that stopped answering.
    pub(super) acquire_backstop: Duration,
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
    /// `not_generation` (one the caller found dead before the pool heard of its exit). Such a
    /// caller is a request admitted before, sent again or resumed: it waits without taking a
    /// place of the request queue ([`WaitKind::Retry`]).
    pub async fn acquire_avoiding(
        &self,
        id: &str,
        not_generation: Option<u64>,
    ) -> Result<Lease, ProxyError> {
        let kind = match not_generation {
            Some(dead) => WaitKind::Retry { dead },
            None => WaitKind::Request,
        };
        self.acquire_as(id, kind).await
    }

    async fn acquire_as(&self, id: &str, kind: WaitKind) -> Result<Lease, ProxyError> {
        let rx = self
            .ask(|reply| Command::Acquire {
                model: id.to_string(),
                kind,
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

    /// One dispatch attempt's admission, the same for a request's first attempt and for
    /// its resumption on a restarted engine: a lease on a ready engine of `model` (never
    /// generation `avoid`, one found dead), refused before anything is sent if the engine
    /// could not hold a request of `max_tokens` ([`check_kv`]).
    pub async fn lease_for(
        &self,
        model: &str,
        avoid: Option<u64>,
        max_tokens: Option<u64>,
    ) -> Result<Lease, ProxyError> {
        let lease = self.acquire_avoiding(model, avoid).await?;
        if let Some(cap) = &lease.kv {
            check_kv(max_tokens, cap).map_err(|u| unservable(model, max_tokens.unwrap_or(0), u))?;
        }
        Ok(lease)
    }

    /// Loads model `id` (as a request would, taking a place of its request queue) and waits
    /// until it is ready.
    pub async fn load(&self, id: &str) -> Result<(), ProxyError> {
        self.acquire(id).await.map(drop)
    }

    /// The server's start-up load of model `id` (`mlxd serve --model`): like [`load`](Self::load),
    /// but it takes no place of the request queue, which stays whole for the clients that
    /// arrive while the model loads.
    pub async fn load_at_start_up(&self, id: &str) -> Result<(), ProxyError> {
        self.acquire_as(id, WaitKind::StartUp).await.map(drop)
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

    /// A request's keep-alive (Ollama's `keep_alive`): model `id` stays loaded for `keep`
    /// after its last request instead of its configured TTL, until it is unloaded.
    pub async fn keep_alive(&self, id: &str, keep: KeepAlive) -> Result<(), ProxyError> {
        let rx = self
            .ask(|reply| Command::KeepAlive {
                model: id.to_string(),
                keep,
                reply,
            })
            .await
            .ok_or(ProxyError::ShuttingDown)?;
        rx.await.unwrap_or(Err(ProxyError::ShuttingDown))
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

    /// Sets the adapters loaded at run time on `model`'s engine (name, directory), which
    /// every later launch of it loads too: a crash restart, a standby (one already running
    /// without them is replaced), the next load.
    pub async fn set_runtime_adapters(
        &self,
        model: &str,
        adapters: Vec<(String, String)>,
    ) -> Result<(), ProxyError> {
        let rx = self
            .ask(|reply| Command::RuntimeAdapters {
                model: model.to_string(),
                adapters,
                reply,
            })
            .await
            .ok_or(ProxyError::ShuttingDown)?;
        rx.await.map_err(|_| ProxyError::ShuttingDown)?
    }

    /// Stops every engine (Shutdown → SIGTERM → SIGKILL) and waits for them to exit.
    pub async fn shutdown(&self) {
        if let Some(rx) = self.ask(|reply| Command::Shutdown { reply }).await {
            let _ = rx.await;
        }
    }
}

/// Why the engine cannot take a request of `max_tokens`, as the client's error.
fn unservable(model: &str, max_tokens: u64, u: Unservable) -> ProxyError {
    match u {
        Unservable::TooLarge { needed, budget } => ProxyError::ExceedsKvBudget {
            model: model.to_string(),
            max_tokens,
            needed,
            budget,
        },
        Unservable::LimitsReduced {
            needed,
            budget,
            configured,
            retry_after,
        } => ProxyError::LimitsReduced {
            model: model.to_string(),
            needed,
            budget,
            configured,
            retry_after,
        },
    }
}
