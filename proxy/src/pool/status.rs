//! What `GET /engines` (and `/v1/models`, `mlxd ps`) shows of each model.

use std::path::PathBuf;
use std::time::UNIX_EPOCH;

use mlxd_protocol::control::{LoadPhase, MemoryStats, PrefixStats, SsdStats};
use serde::Serialize;
use tokio::time::Instant;

use super::slot::{Slot, State};
use crate::policy::RestartPolicy;

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
    /// How long the engine may sit idle before it is unloaded (absent: never), the
    /// configured TTL or a request's `keep_alive`.
    pub ttl_s: Option<f64>,
    /// `ttl_s` is a request's `keep_alive` (Ollama), not the configured TTL.
    pub ttl_from_request: bool,
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
    /// The model's spare engine (`standby = true`), while one runs.
    pub standby: Option<StandbyInfo>,
}

/// A spare engine: its process, and whether it is ready to take over.
#[derive(Debug, Clone, Serialize)]
pub struct StandbyInfo {
    pub pid: u32,
    pub generation: u64,
    /// `starting` (loading its weights) or `ready` (waiting to take over).
    pub state: &'static str,
    /// Counted against the budget for it.
    pub memory_bytes: u64,
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
    /// A hybrid model's recurrent state per sequence (see `Ready`).
    pub state_bytes_per_sequence: u64,
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
    /// Sequences still prefilling their prompts (counted in `active`) and the prompt tokens
    /// they have left.
    pub prefilling: u32,
    pub prefill_tokens_left: u64,
    /// The SSD KV tier of the running engine (absent without `ssd_cache`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssd: Option<SsdStats>,
    /// The running engine's prefix cache: lookups, hits, reused tokens, evictions since it
    /// started, and what it holds now.
    pub prefix: PrefixStats,
    /// The engine's memory by where it is: resident set, MLX's arrays, cache and peak
    /// (absent when the engine does not report it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
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
    /// What the running engine runs with: these, with its own choices where they are unset
    /// (the batch size for its device, a KV budget from the GPU's free memory, the context
    /// that budget holds). Absent before it is ready, and from older engines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub in_force: Option<mlxd_protocol::control::Limits>,
}

impl Slot {
    pub(super) fn status(&self, now: Instant, policy: &RestartPolicy) -> EngineStatus {
        let failure = match &self.state {
            State::Failed { cause, .. } => Some(cause.clone()),
            _ => None,
        };
        let engine = self.state.engine();
        let serving = self.state.serving();
        let ready = serving.map(|s| &s.ready).or(self.last_ready.as_ref());
        let loading = match &self.state {
            State::Starting { loading, .. } => Some(*loading),
            _ => None,
        };
        let in_flight = self.in_flight();
        EngineStatus {
            model: self.entry.id.clone(),
            aliases: self.entry.aliases.clone(),
            source: self.entry.source.clone(),
            pinned: self.entry.pinned,
            state: self.state.name(),
            availability: self.state.availability(),
            failure,
            pid: engine.map(|e| e.handle.pid),
            socket: self.socket.clone(),
            generation: self.generation,
            restarts: self.restarts,
            crashes_in_window: self.history.recent(),
            uptime_s: serving.map(|s| now.duration_since(s.ready_at).as_secs_f64()),
            idle_s: (engine.is_some() && in_flight == 0)
                .then(|| now.duration_since(self.last_used).as_secs_f64()),
            ttl_s: self.ttl().map(|t| t.as_secs_f64()),
            ttl_from_request: self.keep_alive.is_some() && !self.entry.pinned,
            // A ready engine has loaded everything.
            loading_progress: loading.map_or(serving.map(|_| 1.0), |l| l.progress),
            loading_phase: loading.and_then(|l| l.phase).map(LoadPhase::name),
            device: ready.map(|r| r.device.to_string()),
            configured: !self.removed,
            in_flight,
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
            ready: ready.map(|r| ReadyInfo {
                model_id: r.model_id.clone(),
                weight_bytes: r.weight_bytes,
                kv_bytes_per_token: r.kv_bytes_per_token,
                state_bytes_per_sequence: r.state_bytes_per_sequence,
                context_length: r.context_length,
                capabilities: r.capabilities.clone(),
                device: r.device.clone(),
            }),
            stats: engine.and_then(|e| e.stats.as_ref()).map(|s| StatsInfo {
                active: s.active,
                queued: s.queued,
                kv_bytes: s.kv_bytes,
                memory_bytes: s.memory_bytes,
                drafted_tokens: s.drafted_tokens,
                accepted_tokens: s.accepted_tokens,
                prefilling: s.prefilling,
                prefill_tokens_left: s.prefill_tokens_left,
                ssd: (s.ssd != SsdStats::default()).then_some(s.ssd),
                prefix: s.prefix,
                memory: s.memory.clone(),
            }),
            standby: self.standby.as_ref().map(|s| StandbyInfo {
                pid: s.engine.handle.pid,
                generation: s.engine.handle.generation,
                state: if s.ready.is_some() {
                    "ready"
                } else {
                    "starting"
                },
                memory_bytes: self.standby_bytes(),
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
                    in_force: self.state.serving().and_then(|s| s.ready.limits.clone()),
                }
            },
        }
    }
}
