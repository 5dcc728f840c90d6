//! Starting a rank of an engine group (`distributed = "ring"`, `crate::distributed`): join
//! the MLX group, agree on what to load (rank 0 tells the others), load this rank's shard,
//! check that every rank loaded, then run the runtime in lockstep — rank 0 serving requests,
//! the others following it.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use mlxd_protocol::engine_options::EngineOptions;

use super::options::{runtime_options, LaunchOptions};
use super::start_error::StartError;
use crate::distributed::pipeline::Stage;
use crate::distributed::replica::{Follower, Leader};
use crate::distributed::wire::broadcast;
use crate::distributed::{Group, GROUP_INIT_TIMEOUT};
use crate::loader::{read_config, LoadError, LoadReporter};
use crate::models;
use crate::runtime::lockstep::Lockstep;
use crate::runtime::{FatalHook, MakeLockstep, ModelLoader, Parallelism, Runtime, RuntimeLimits};

/// Joins the group of `backend` as MLX's environment describes it (`MLX_RANK`,
/// `MLX_HOSTFILE` for `ring`), failing with the reason after [`GROUP_INIT_TIMEOUT`].
pub fn join(backend: &str) -> Result<Group, StartError> {
    let group = Group::init(backend, init_timeout()?).map_err(StartError::Group)?;
    if group.size() < 2 {
        return Err(StartError::Group(crate::distributed::GroupError::Init {
            backend: backend.to_owned(),
            reason: "the group has one rank; MLX found no hostfile (MLX_HOSTFILE) naming the \
                     others"
                .into(),
        }));
    }
    tracing::info!(
        rank = group.rank(),
        size = group.size(),
        backend,
        "joined the engine group"
    );
    Ok(group)
}

/// How long to wait for the other ranks: [`GROUP_INIT_TIMEOUT`], or `MLXD_GROUP_INIT_TIMEOUT`
/// seconds (tests; hosts that start slowly).
fn init_timeout() -> Result<Duration, StartError> {
    match std::env::var("MLXD_GROUP_INIT_TIMEOUT") {
        Err(_) => Ok(GROUP_INIT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|s| (1..=3600).contains(s))
            .map(Duration::from_secs)
            .ok_or_else(|| {
                StartError::Mlx(format!(
                    "MLXD_GROUP_INIT_TIMEOUT = {v:?}: expected seconds from 1 to 3600"
                ))
            }),
    }
}

/// What every rank must run with identically, as rank 0 was given it: the model, the limits
/// and the engine options (which decide admissions, chunking and caching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    pub model: String,
    pub max_batch_size: Option<usize>,
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<usize>,
    pub options: BTreeMap<String, String>,
}

impl Setup {
    /// Rank 0's setup on every rank (`mine` on rank 0, `None` on the others).
    pub fn agree(group: &Group, mine: Option<&Setup>) -> Result<Setup, StartError> {
        let bytes = mine.map(|s| serde_json::to_vec(s).expect("a setup always serializes"));
        let failed = |reason: String| {
            StartError::Group(crate::distributed::GroupError::Init {
                backend: "group".into(),
                reason,
            })
        };
        let got = broadcast(group, bytes.as_deref())
            .map_err(|e| failed(format!("rank 0's setup did not arrive: {e}")))?;
        serde_json::from_slice(&got).map_err(|e| failed(format!("rank 0's setup is corrupt: {e}")))
    }
}

/// Engine options a group cannot honour yet, with the reason; the load fails naming them.
pub fn refused_in_group(limits: &RuntimeLimits) -> Option<String> {
    if limits.speculation.is_some() {
        return Some(
            "speculative decoding (draft, draft_model) is not supported by an engine group yet: \
             its governor times steps, which differ between ranks"
                .into(),
        );
    }
    if limits.warm_up == Some(true) {
        return Some(
            "warm_up is not supported by an engine group yet: its generations run on one rank \
             alone, and the group's ranks would have to run them in lockstep"
                .into(),
        );
    }
    if !limits.adapters.is_empty() {
        return Some(
            "LoRA adapters (adapters) are not supported by an engine group yet: their matrices \
             are not divided among the ranks"
                .into(),
        );
    }
    if limits.ssd.is_some() {
        return Some(
            "the SSD cache (ssd_cache) is not supported by an engine group yet: its writes and \
             idle demotions run on timers, which differ between ranks"
                .into(),
        );
    }
    None
}

/// Starts this rank's runtime: its shard of the model in `dir`, then the lockstep (rank 0
/// leads from the request channel, the others follow). Every rank reports whether it loaded,
/// so that one rank's failure fails the load everywhere instead of a later collective hanging.
pub fn start_rank(
    dir: PathBuf,
    mut limits: RuntimeLimits,
    on_fatal: Option<FatalHook>,
    reporter: Option<LoadReporter>,
    group: Group,
) -> Result<Runtime, LoadError> {
    if let Some(reason) = refused_in_group(&limits) {
        return Err(LoadError::Config(reason));
    }
    let parallelism = limits.parallelism;
    if parallelism == Parallelism::Pipeline {
        // Each rank's prefix cache holds its own layers' KV: sized in proportion, so that
        // every rank keeps and evicts the same entries (`Stage::prefix_budget`).
        let stage = Stage::of(num_layers(&dir)?, group.rank(), group.size())?;
        limits.prompt_cache_bytes = stage.prefix_budget(limits.prompt_cache_bytes);
        tracing::info!(
            rank = stage.rank,
            layers = ?stage.layers,
            prompt_cache_bytes = limits.prompt_cache_bytes,
            "pipeline stage"
        );
    }
    let for_load = group.clone();
    let load: ModelLoader = Box::new(move |dir: &Path| {
        let model = match parallelism {
            Parallelism::Tensor => models::load_for_group(dir, reporter, Some(for_load.clone())),
            Parallelism::Pipeline => models::load_pipeline_stage(dir, reporter, for_load.clone()),
        };
        all_loaded(&for_load, model.is_ok())?;
        model
    });
    let step_timeout = limits.group_step_timeout;
    let lockstep: MakeLockstep = Box::new(move |rx| -> Box<dyn Lockstep> {
        let made: std::io::Result<Box<dyn Lockstep>> = if group.rank() == 0 {
            Leader::new(group, rx, step_timeout).map(|l| Box::new(l) as Box<dyn Lockstep>)
        } else {
            Follower::new(group, step_timeout).map(|f| Box::new(f) as Box<dyn Lockstep>)
        };
        made.unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot start the lockstep's threads; exiting");
            std::process::exit(crate::distributed::replica::EXIT_GROUP_BROKEN)
        })
    });
    Runtime::start_in_lockstep(dir, limits, on_fatal, load, lockstep)
}

/// The model's layer count (`num_hidden_layers`), which a pipeline divides.
fn num_layers(dir: &Path) -> Result<usize, LoadError> {
    read_config(dir)?
        .get("num_hidden_layers")
        .and_then(serde_json::Value::as_u64)
        .map(|n| n as usize)
        .ok_or_else(|| {
            LoadError::Config(
                "config.json has no num_hidden_layers for a pipeline to divide".into(),
            )
        })
}

/// Whether every rank loaded its shard: each contributes a flag, gathered on every rank.
fn all_loaded(group: &Group, loaded: bool) -> Result<(), LoadError> {
    let flags = group.all_gather(&Array::from_slice(&[i32::from(loaded)], &[1]))?;
    mlx_rs::transforms::eval([&flags])?;
    let failed: Vec<String> = flags
        .as_slice::<i32>()
        .iter()
        .enumerate()
        .filter(|(_, &ok)| ok == 0)
        .map(|(rank, _)| rank.to_string())
        .collect();
    if failed.is_empty() || !loaded {
        // A rank that failed itself reports its own reason.
        return Ok(());
    }
    Err(LoadError::Config(format!(
        "rank(s) {} of the engine group could not load the model (their logs say why)",
        failed.join(", ")
    )))
}

impl Setup {
    /// The limits and options every rank runs with.
    pub fn launch_options(&self) -> Result<LaunchOptions, StartError> {
        let mut limits = RuntimeLimits {
            kv_budget_bytes: self.kv_budget_bytes,
            context_length: self.context_length,
            ..RuntimeLimits::default()
        };
        if let Some(n) = self.max_batch_size {
            limits.max_batch_size = Some(n);
        }
        let options = EngineOptions::from_map(&self.options).map_err(|e| StartError::Option {
            key: e.key,
            value: e.value,
            reason: e.reason,
        })?;
        runtime_options(&options, limits)
    }
}

/// `mlxd-engine --distributed <backend>` outside `mlxd` (as `mlx.launch` starts each rank):
/// joins the group, takes rank 0's `given` setup, loads this rank's shard; rank 0 serves
/// `unix` until a signal, the others follow it until it stops. A rank other than 0 given
/// `rank_model` loads that (its host's copy of rank 0's model) instead of rank 0's path.
pub fn run_standalone(
    backend: &str,
    home: &Path,
    given: Setup,
    unix: Option<&Path>,
    rank_model: Option<String>,
) -> anyhow::Result<()> {
    // Options the group cannot honour fail here, before the wait for the other ranks.
    given.launch_options()?;
    let group = join(backend)?;
    let leader = group.rank() == 0;
    if leader && unix.is_none() {
        anyhow::bail!("rank 0 of an engine group serves requests: give it --unix <path>");
    }
    let mut setup = Setup::agree(&group, leader.then_some(&given))?;
    if let Some(model) = rank_model.filter(|_| !leader) {
        setup.model = model;
    }
    let LaunchOptions { limits, draft } = setup.launch_options()?;
    let engine =
        super::load::load_in_group(&setup.model, home, limits, draft, None, None, Some(group))?;
    match unix.filter(|_| leader) {
        Some(socket) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
            .block_on(super::serve_standalone(engine, socket)),
        None => {
            engine.runtime.join();
            Ok(())
        }
    }
}
