//! The engine runtime: the thread that owns MLX and serves every request in one batch.
//!
//! - [`request`]: the contract with the HTTP side (requests in, token events out, typed
//!   failures);
//! - [`sampling_params`]: sampling parameters and their validation, the one place it happens;
//! - [`scheduler`]: admission and prefill planning as pure functions (no MLX);
//! - [`executor`]: the MLX thread's loop, which runs one decode step and one prefill unit per
//!   iteration;
//! - [`batch`]: the decode batch (one forward pass for every decoding sequence);
//! - [`first_token`]: a prompt's first token, sampled from its last prefill pass;
//! - [`sampler`] and [`noise`]: on-device sampling for the whole batch;
//! - [`sequence`]: one request's state;
//! - [`step_trace`]: where a decode step's host time goes (`mlxd_engine::step` trace events);
//! - [`reference`]: the serial single-sequence path that mirrors mlx-lm's `generate_step`.
mod arrivals;
pub mod batch;
pub mod draft;
pub mod executor;
mod first_token;
pub mod lockstep;
pub mod noise;
pub mod reference;
pub mod request;
pub mod sampler;
pub mod sampling_params;
pub mod scheduler;
pub mod sequence;
mod step_graph;
pub mod step_trace;
pub mod warm_up;

use mlxd_protocol::control::FatalKind;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread;

use tokio::sync::mpsc;

use crate::adapters::{AdapterId, AdapterTable};
use crate::cache::ssd::{SsdConfig, SsdCounters, SsdHandle, SsdTier};
use crate::cache::{CacheManager, KvLayout, KvQuant, KvSpace};
use crate::loader::LoadError;
use crate::models::{self, CausalLm, ModelInfo};
use draft::{DraftSource, Drafter, ModelDrafter, Speculation, Speculator};
use executor::Executor;
pub use mlxd_protocol::engine_options::Parallelism;
use request::{AdapterWorkSender, WorkSender};
use scheduler::SchedulerLimits;

/// Sequences decoded together when no limit is given, on the CPU.
pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;
/// Sequences decoded together when no limit is given, on a GPU: a decode step's weights are
/// read once for all rows, so rows are nearly free there until the attention over their KV
/// dominates; the KV budget still bounds what is admitted.
pub const DEFAULT_GPU_MAX_BATCH_SIZE: usize = 128;
/// Most prompt tokens of one sequence per prefill forward pass (mlx-lm's `prefill_step_size`);
/// fewer on a slow device (see [`PREFILL_UNIT_TARGET`]).
pub const PREFILL_CHUNK: usize = 2048;
/// Fewest prompt tokens of a chunk on a slow device (see [`PREFILL_UNIT_TARGET`]).
pub const MIN_PREFILL_CHUNK: usize = 32;
/// Wall time a prefill unit should stay within where the device's measured prefill speed
/// allows: chunks shrink (to [`MIN_PREFILL_CHUNK`]) on a slow device, so that a cancelled
/// prompt stops and a short one is prefilled within about this long.
pub const PREFILL_UNIT_TARGET: std::time::Duration = std::time::Duration::from_millis(500);
/// Prompt tokens (rows × padded length) of all prefill passes of one step on the CPU, when no
/// budget is given; the measured prefill speed shrinks it further (see [`PREFILL_UNIT_TARGET`]).
pub const DEFAULT_PREFILL_STEP_TOKENS: usize = 2048;
/// The same on a GPU: mlx-lm's `BatchGenerator` prefills up to 8 prompts × 2 048 tokens in one
/// pass by default; a step of this many keeps a large GPU's prefill compute-bound.
pub const DEFAULT_GPU_PREFILL_STEP_TOKENS: usize = 16384;

/// What the device MLX computes on (its default device) asks of the defaults.
fn on_gpu() -> bool {
    mlx_rs::Device::try_default()
        .and_then(|d| d.get_type())
        .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}
/// The step watch's bound where `step_timeout` is not set: five minutes on a GPU (as for an
/// engine group's steps), an hour on the CPU, whose first prefill step of a large model may
/// run minutes before the scheduler has measured its speed, and which does not stall the way
/// a GPU does.
pub fn default_step_timeout() -> std::time::Duration {
    if on_gpu() {
        crate::distributed::watchdog::STEP_TIMEOUT
    } else {
        std::time::Duration::from_secs(3600)
    }
}

/// How long the device must stay full while decode (or prefill) steps crawl before the
/// memory-pressure watch ends the engine as out of memory (`memory_watch`;
/// `crate::app::memory_watch`): long against a decode step (tens of milliseconds, so hundreds
/// of them), long enough for a few of the H100 run's crawling steps (seconds each), short
/// against the minutes that crawl lasted.
pub const DEFAULT_MEMORY_WATCH: std::time::Duration = std::time::Duration::from_secs(30);
/// How many times their usual time decode steps must take, on average over the window, with
/// the device full (`memory_watch_slowdown`): the H100 run's crawl was 30-70× (its bystander
/// 40-190×), while a healthy engine's decode step per √row (`RuntimeStats::decode_nanos`)
/// moves a few times at most between one row and a full batch of long contexts.
pub const DEFAULT_MEMORY_WATCH_SLOWDOWN: u32 = 10;

/// Prefix-cache bytes when no size is given (`--prompt-cache`).
pub const DEFAULT_PROMPT_CACHE_BYTES: u64 = 1 << 30;
/// Default [`RuntimeLimits::state_snapshot_every`].
pub const STATE_SNAPSHOT_EVERY: usize = 4096;

/// Limits the supervisor may impose (smaller after an out-of-memory restart).
#[derive(Debug, Clone)]
pub struct RuntimeLimits {
    /// Sequences generating at once; more wait in line. `None`: sized for the device
    /// ([`DEFAULT_GPU_MAX_BATCH_SIZE`] on a GPU, [`DEFAULT_MAX_BATCH_SIZE`] on the CPU).
    pub max_batch_size: Option<usize>,
    /// KV cache bytes that admitted sequences may reserve (prompt + max_tokens each).
    pub kv_budget_bytes: Option<u64>,
    /// Caps the model's context length.
    pub context_length: Option<usize>,
    /// How an engine group divides the model among its ranks (`--distributed-mode`); read by
    /// the group's load (`crate::app::group`), meaningless for one engine.
    pub parallelism: Parallelism,
    /// How long one step of an engine group may run before the rank gives the group up as
    /// hung (`--distributed-step-timeout`, `crate::distributed::watchdog`); meaningless for
    /// one engine.
    pub group_step_timeout: std::time::Duration,
    /// How long one iteration of a single engine's model thread may run while it has work
    /// before the supervised engine reports itself stalled and exits for a restart
    /// (`step_timeout`; `crate::app::step_watch`). `None`: [`default_step_timeout`].
    pub step_timeout: Option<std::time::Duration>,
    /// How long a supervised engine's device may stay full while its decode or prefill steps
    /// crawl before it reports itself out of memory (`memory_watch`; `crate::app::memory_watch`).
    /// `None`: the watch is off.
    pub memory_watch: Option<std::time::Duration>,
    /// How many times their usual time the decode or prefill steps must take for the memory
    /// watch (`memory_watch_slowdown`).
    pub memory_watch_slowdown: u32,
    /// Bytes of KV the prefix cache may keep between requests; 0 disables it.
    pub prompt_cache_bytes: u64,
    /// Most prompt tokens of one sequence per prefill forward pass (the measured prefill
    /// speed may shrink chunks below it, see [`PREFILL_UNIT_TARGET`]).
    pub prefill_chunk: usize,
    /// Most prompt tokens (padding included) that one step's prefill passes hold together
    /// (`--prefill-step-tokens`); the measured prefill speed may shrink it. `None`: sized for
    /// the device ([`DEFAULT_GPU_PREFILL_STEP_TOKENS`] on a GPU,
    /// [`DEFAULT_PREFILL_STEP_TOKENS`] on the CPU).
    pub prefill_step_tokens: Option<usize>,
    /// A group of fresh prompts prefilled in one pass is padded on the left to a multiple of
    /// this many tokens (`--prefill-pad-to`; 1: to the longest), so that bursts run a few pass
    /// shapes.
    pub prefill_pad_to: usize,
    /// Quantize the KV cache (`--kv-bits`, `--kv-group-size`); `None` keeps the model's dtype.
    pub kv_quant: Option<KvQuant>,
    /// With `kv_quant`: a sequence's KV stays unquantized until it holds more than this many
    /// positions (`--quantized-kv-start`); 0 quantizes from the start.
    pub quantized_kv_start: usize,
    /// Speculative decoding (`--draft`, `--draft-model`, `--num-draft-tokens`).
    pub speculation: Option<Speculation>,
    /// The SSD KV tier and generation checkpoints (`--ssd-cache`, `--generation-checkpoint`).
    pub ssd: Option<SsdConfig>,
    /// For a model with recurrent layers: prompt tokens between two snapshots of a long
    /// prompt's state kept in the prefix cache (`--state-snapshot-every`); a state cannot be
    /// cut to a shorter prefix, so a later prompt can only reuse a snapshot it fully extends.
    pub state_snapshot_every: usize,
    /// Run a few short generations before reporting ready ([`warm_up`]), so the first
    /// requests — or a standby's takeover — do not pay for compiling kernels
    /// (`--warm-up`). `None`: on a GPU only (the CPU compiles nothing per pass).
    pub warm_up: Option<bool>,
    /// LoRA adapters loaded beside the model at start, by name (`--adapter name=dir`,
    /// `crate::adapters`).
    pub adapters: Vec<(String, PathBuf)>,
    /// Sample each prompt's first token from the prefill pass that runs its last token
    /// ([`first_token`]) instead of running that token in the row's first decode step.
    /// Default on; `MLXD_FIRST_TOKEN_FROM_PREFILL=0` ([`first_token_from_prefill_env`]) turns
    /// it off, for measuring both orders on one binary. It saves every request a decode step
    /// of time to first token (on a GPU mostly host time: 3.8 ms of an H200's 11.2 ms prefix
    /// hit at 5k). The pass runs its last layer's attention output and feed-forward on the
    /// last position alone (`Queries::Last`), so it computes no more than mlx-lm's order,
    /// whose lazy graph never evaluates them for prompt positions: on this 2-core CPU a tiny
    /// model's 400-token prefix hit 20% sooner, the default model's time to first token and
    /// decode unchanged (session 54).
    pub first_token_from_prefill: bool,
}

/// The default of [`RuntimeLimits::first_token_from_prefill`] (read once): on, unless
/// `MLXD_FIRST_TOKEN_FROM_PREFILL=0` (a switch for measuring mlx-lm's order on one binary).
pub fn first_token_from_prefill_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLXD_FIRST_TOKEN_FROM_PREFILL").map_or(true, |v| v != "0"))
}

impl Default for RuntimeLimits {
    fn default() -> Self {
        Self {
            max_batch_size: None,
            kv_budget_bytes: None,
            context_length: None,
            parallelism: Parallelism::Tensor,
            group_step_timeout: crate::distributed::watchdog::STEP_TIMEOUT,
            step_timeout: None,
            memory_watch: Some(DEFAULT_MEMORY_WATCH),
            memory_watch_slowdown: DEFAULT_MEMORY_WATCH_SLOWDOWN,
            prompt_cache_bytes: DEFAULT_PROMPT_CACHE_BYTES,
            prefill_chunk: PREFILL_CHUNK,
            prefill_step_tokens: None,
            prefill_pad_to: 1,
            kv_quant: None,
            quantized_kv_start: 0,
            speculation: None,
            ssd: None,
            state_snapshot_every: STATE_SNAPSHOT_EVERY,
            warm_up: None,
            adapters: Vec::new(),
            first_token_from_prefill: first_token_from_prefill_env(),
        }
    }
}

impl RuntimeLimits {
    /// The scheduler's limits, with what was not given sized for the device (`gpu`).
    pub fn scheduler(&self, gpu: bool) -> SchedulerLimits {
        let (batch, step) = if gpu {
            (DEFAULT_GPU_MAX_BATCH_SIZE, DEFAULT_GPU_PREFILL_STEP_TOKENS)
        } else {
            (DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_STEP_TOKENS)
        };
        let prefill_chunk = self.prefill_chunk.max(1);
        SchedulerLimits {
            max_batch_size: self.max_batch_size.unwrap_or(batch).max(1),
            prefill_chunk,
            min_prefill_chunk: MIN_PREFILL_CHUNK,
            prefill_unit_target: PREFILL_UNIT_TARGET,
            snapshot_boundaries: false,
            prefill_step_tokens: self.prefill_step_tokens.unwrap_or(step).max(1),
            prefill_pad_to: self.prefill_pad_to.max(1),
            state_snapshot_every: self.state_snapshot_every.max(1),
            first_token_from_prefill: self.first_token_from_prefill,
        }
    }
}

/// Counters the runtime publishes for `Stats` messages and `/health`.
#[derive(Debug, Default)]
pub struct RuntimeStats {
    /// Iterations the model thread has finished: the step watch's sign of progress
    /// (`crate::app::step_watch`).
    pub steps: AtomicU64,
    pub active: AtomicU64,
    pub queued: AtomicU64,
    /// Admitted sequences still prefilling their prompts, and the prompt tokens they have left.
    pub prefilling: AtomicU64,
    pub prefill_tokens_left: AtomicU64,
    /// KV bytes held: the batch, prefills in progress and the prefix cache.
    pub kv_bytes: AtomicU64,
    /// Speculative drafts proposed and accepted since start.
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    /// The SSD tier's counters (all 0 without one).
    pub ssd: Arc<SsdCounters>,
    /// The prefix cache's figures, as of the model thread's last iteration.
    pub prefix: std::sync::Mutex<mlxd_protocol::control::PrefixStats>,
    /// Tokens the admitted sequences hold (prompt and generated; not the prefix cache): their
    /// KV positions (of a prompt still prefilling, those written so far), which the
    /// memory-pressure watch sees grow in an engine that presses on a full device, whether it
    /// decodes or prefills (`crate::app::memory_watch`). Counted in tokens, not bytes: the KV
    /// arrays grow in blocks of positions, and a crawling engine fills a block in minutes.
    pub running_tokens: AtomicU64,
    /// Decode steps run (one forward pass of the batch), and their wall time in nanoseconds
    /// per square root of their rows, summed: the memory-pressure watch's measure of a step's
    /// usual time. The prefill that may follow in the same iteration is not in it (its time
    /// depends on the prompts). A step's time grows with its rows, less than in proportion
    /// (BENCHMARKS.md, H200 engine throughput: gpt-oss-20b 8.5 ms a step at 1 row, 55 ms at
    /// 32, 6.4× where √32 is 5.7; Qwen3-30B-A3B 11.3 ms at 1, 20.7 ms at 8, 1.8× where √8 is
    /// 2.8), so per √row the usual time learned at one batch size holds within a few times at
    /// another.
    ///
    /// A step is counted only when its time is its own: not one that follows an iteration
    /// whose prefill ran behind that iteration's decode pass (see
    /// [`RuntimeStats::prefill_steps`]): the prefill's wait already ran the pass this step
    /// waits for, so it would time next to nothing.
    pub decode_steps: AtomicU64,
    pub decode_nanos: AtomicU64,
    /// Prefill steps timed (one step's prefill passes: the chunks and groups of
    /// `scheduler::plan_prefill`), the prompt tokens their passes ran (padding included: the
    /// device computes it) and their wall time in nanoseconds, summed: the memory-pressure
    /// watch's measure of the usual time per prefilled token, for an engine whose device fills
    /// while it prefills, before its first decode step (BENCHMARKS-soak.md section 6c). A step
    /// is timed from the building of its first pass to the end of the one wait for all of
    /// them, as a decode step is from its building to its wait, and counted only when that
    /// time is its own:
    /// - not when the decode step of the same iteration had rows: that step queues its pass
    ///   and waits for the one before it (`DecodeBatch`'s pipeline), so its own pass may still
    ///   be in flight, and the prefill's wait, behind it on the device's one queue, would time
    ///   it as prefill (and the next decode step, finding it done, next to nothing: that one
    ///   is left out too, see [`RuntimeStats::decode_steps`]). An engine that prefills beside
    ///   running streams at every step is thus judged on neither measure until one of them
    ///   runs alone; the crawl of section 6c had no stream before its prompts were prefilled;
    /// - not when one of its passes has a shape (rows, tokens) this process had not prefilled
    ///   before on a GPU: its time then goes mostly to compiling kernels (the executor's
    ///   `prefill_shapes_seen`, which keeps such a step out of the measured prefill speed too).
    ///
    /// Per token the time is not the same at every pass size: a short pass pays the weights'
    /// reading and the kernels' launches for few tokens, and a pass deep in a long prompt
    /// attends to more positions; the watch's factor leaves room for that.
    pub prefill_steps: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub prefill_nanos: AtomicU64,
}

impl RuntimeStats {
    /// Counts one decode step of `rows` rows (at least 1) that took `took`.
    pub fn record_decode_step(&self, took: std::time::Duration, rows: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let nanos = (took.as_nanos() as f64 / (rows.max(1) as f64).sqrt()) as u64;
        self.decode_nanos.fetch_add(nanos, Relaxed);
        self.decode_steps.fetch_add(1, Relaxed);
    }

    /// Counts one prefill step whose passes ran `tokens` prompt tokens (padding included) in
    /// `took`.
    pub fn record_prefill_step(&self, took: std::time::Duration, tokens: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.prefill_nanos.fetch_add(nanos, Relaxed);
        self.prefill_tokens.fetch_add(tokens as u64, Relaxed);
        self.prefill_steps.fetch_add(1, Relaxed);
    }
}

/// Called once, on the MLX thread, when a step fails in a way the process cannot recover from
/// ([`request::GenerationError::ends_engine`]): out of memory (the supervisor restarts it
/// smaller) or a lost GPU context. It reports and exits with the engine's requests still
/// open, so that the supervisor resumes them on the restarted engine.
pub type FatalHook = Box<dyn FnOnce(FatalKind, String) + Send>;

/// Makes an engine group rank's [`lockstep::Lockstep`] from the request channel, on the MLX
/// thread once the model is loaded.
pub type MakeLockstep = Box<
    dyn FnOnce(mpsc::UnboundedReceiver<request::GenerateRequest>) -> Box<dyn lockstep::Lockstep>
        + Send,
>;

/// Builds the model from its directory, on the MLX thread.
pub type ModelLoader = Box<dyn FnOnce(&Path) -> Result<Box<dyn CausalLm>, LoadError> + Send>;

/// A running model thread.
pub struct Runtime {
    pub work: WorkSender,
    pub info: ModelInfo,
    /// The batch size and KV budget the engine runs with.
    pub in_force: LimitsInForce,
    pub stats: Arc<RuntimeStats>,
    /// Flushes the SSD tier's writes (the `Spill` control message).
    pub ssd: Option<SsdHandle>,
    /// The model's LoRA adapters (`None`: a model that takes none, such as a group's shard);
    /// the HTTP side resolves adapter names against it.
    pub adapters: Option<Arc<AdapterTable>>,
    /// Loads and unloads adapters on the MLX thread (the admin routes).
    pub adapter_work: AdapterWorkSender,
    thread: thread::JoinHandle<()>,
}

/// The limits an engine runs with: the launch's, with the engine's own choices where the
/// launch left them unset (the batch size for the device, a KV budget from the GPU's free
/// memory) and a configured KV budget cut to what the GPU holds. The supervisor shrinks these
/// after an out-of-memory exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsInForce {
    pub max_batch_size: usize,
    /// `None`: unlimited (a device that does not report its free memory, without a
    /// configured budget).
    pub kv_budget_bytes: Option<u64>,
}

/// The KV budget of an engine (see [`crate::cache::kv_budget_within`]): on a device that
/// reports its free memory, outside an engine group, the configured budget while it fits, else
/// what the device holds; the configured one elsewhere. A group keeps its configured budget:
/// only its leader admits, and its ranks' devices need not agree. When the budget is the
/// device's (derived or cut), a context longer than it holds is cut to what it holds, so that
/// a request without `max_tokens`, which reserves the whole context, is still served.
fn kv_budget_on_device(
    configured: Option<u64>,
    info: &mut ModelInfo,
    grouped: bool,
) -> Result<Option<u64>, LoadError> {
    if grouped {
        return Ok(configured);
    }
    let stand_in = crate::fault::device_memory_override().map_err(LoadError::Device)?;
    let memory = crate::fault::observed_memory(stand_in).map_err(LoadError::Device)?;
    let Some(memory) = memory else {
        return Ok(configured);
    };
    let (budget, source) =
        crate::cache::kv_budget_within(configured, memory).map_err(LoadError::Memory)?;
    if source == crate::cache::BudgetSource::Configured {
        return Ok(Some(budget));
    }
    let context = crate::cache::context_held(
        budget,
        info.kv_bytes_per_token as u64,
        info.state_bytes_per_sequence as u64,
        info.context_length,
    )
    .map_err(|e| LoadError::Memory(format!("{e} (the budget is the GPU's free memory)")))?;
    tracing::info!(
        kv_budget_mib = budget >> 20,
        ?source,
        free_mib = memory.free >> 20,
        total_mib = memory.total >> 20,
        context_length = context,
        "KV budget from the GPU's free memory"
    );
    if let crate::cache::BudgetSource::Clamped { configured } = source {
        tracing::warn!(
            configured_mib = configured >> 20,
            kv_budget_mib = budget >> 20,
            "the configured KV budget is more than the GPU holds once the weights are loaded: \
             cut to what it holds"
        );
    }
    if context < info.context_length {
        tracing::warn!(
            model_context = info.context_length,
            context_length = context,
            "the context is cut to what the KV budget holds"
        );
        info.context_length = context;
    }
    Ok(Some(budget))
}

impl Runtime {
    /// Loads the model in `dir` on a new thread; returns once it is ready to serve.
    pub fn start(
        dir: PathBuf,
        limits: RuntimeLimits,
        on_fatal: Option<FatalHook>,
    ) -> Result<Runtime, LoadError> {
        Self::start_reporting(dir, limits, on_fatal, None)
    }

    /// [`start`](Self::start), reporting the weights read to `reporter` while the model loads.
    pub fn start_reporting(
        dir: PathBuf,
        limits: RuntimeLimits,
        on_fatal: Option<FatalHook>,
        reporter: Option<crate::loader::LoadReporter>,
    ) -> Result<Runtime, LoadError> {
        let load: ModelLoader = Box::new(move |dir| models::load_reporting(dir, reporter));
        Self::start_with_loader(dir, limits, on_fatal, load)
    }

    /// [`start`](Self::start) with the model built by `load` (on the MLX thread) instead of
    /// the registry's loader: a model that wraps a family (tests change what it reports).
    /// `dir` still names the model for the SSD tier's fingerprint.
    pub fn start_with_loader(
        dir: PathBuf,
        limits: RuntimeLimits,
        on_fatal: Option<FatalHook>,
        load: ModelLoader,
    ) -> Result<Runtime, LoadError> {
        Self::start_driven(dir, limits, on_fatal, load, None)
    }

    /// [`start_with_loader`](Self::start_with_loader) for a rank of an engine group: the
    /// model thread runs each iteration on the inputs the [`lockstep::Lockstep`] made from
    /// the request channel agrees with the other ranks (`crate::distributed`).
    pub fn start_in_lockstep(
        dir: PathBuf,
        limits: RuntimeLimits,
        on_fatal: Option<FatalHook>,
        load: ModelLoader,
        lockstep: MakeLockstep,
    ) -> Result<Runtime, LoadError> {
        Self::start_driven(dir, limits, on_fatal, load, Some(lockstep))
    }

    fn start_driven(
        dir: PathBuf,
        limits: RuntimeLimits,
        on_fatal: Option<FatalHook>,
        load: ModelLoader,
        lockstep: Option<MakeLockstep>,
    ) -> Result<Runtime, LoadError> {
        if let Some(q) = limits.kv_quant {
            if ![4, 8].contains(&q.bits) || ![32, 64, 128].contains(&q.group_size) {
                return Err(LoadError::Config(format!(
                    "KV quantization of {} bits in groups of {} is not supported: bits must be 4 \
                     or 8, the group size 32, 64 or 128",
                    q.bits, q.group_size
                )));
            }
        }
        if limits.quantized_kv_start > 0 && limits.kv_quant.is_none() {
            return Err(LoadError::Config(
                "a quantized KV start needs a quantized KV cache (--kv-bits)".into(),
            ));
        }
        let stats = Arc::new(RuntimeStats::default());
        let ssd = match &limits.ssd {
            None => None,
            Some(_) if limits.prompt_cache_bytes == 0 => {
                return Err(LoadError::Config(
                    "the SSD cache keeps prefix-cache entries: it needs a prompt cache \
                     (--prompt-cache > 0)"
                        .into(),
                ))
            }
            Some(config) => Some(
                SsdTier::open(config.clone(), &dir, limits.kv_quant, stats.ssd.clone()).map_err(
                    |source| LoadError::Io {
                        path: config.dir.clone(),
                        source,
                    },
                )?,
            ),
        };
        let ssd_handle = ssd.as_ref().map(SsdTier::handle);
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (work, rx) = mpsc::unbounded_channel();
        let (adapter_work, adapter_rx) = mpsc::unbounded_channel();
        let thread_stats = stats.clone();
        let thread = thread::Builder::new()
            .name("mlx".into())
            .spawn(move || match load(&dir) {
                Ok(model) => {
                    if let Some(reason) = refused_option(model.as_ref(), &limits) {
                        let _ = ready_tx.send(Err(LoadError::Config(reason)));
                        return;
                    }
                    if let Err(e) = check_layers(model.as_ref()) {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    let mut info = model.info().clone();
                    if let Some(cap) = limits.context_length {
                        info.context_length = info.context_length.min(cap);
                    }
                    let plain_bytes_per_token = info.kv_bytes_per_token;
                    if let Some(q) = limits.kv_quant {
                        if info.head_dim % q.group_size as usize != 0 {
                            let _ = ready_tx.send(Err(LoadError::Config(format!(
                                "--kv-group-size {} does not divide the model's head dimension {}",
                                q.group_size, info.head_dim
                            ))));
                            return;
                        }
                        let plain = info.kv_dtype_bytes as f64;
                        info.kv_bytes_per_token = (info.kv_bytes_per_token as f64
                            * q.bytes_per_element(info.kv_dtype_bytes)
                            / plain)
                            .ceil() as usize;
                    }
                    let spec = match limits
                        .speculation
                        .as_ref()
                        .map(|s| speculator(s, model.as_ref(), limits.prefill_chunk))
                        .transpose()
                    {
                        Ok(spec) => spec,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let scheduler = limits.scheduler(on_gpu());
                    let kv_budget = match kv_budget_on_device(
                        limits.kv_budget_bytes,
                        &mut info,
                        lockstep.is_some(),
                    ) {
                        Ok(budget) => budget,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let layout = KvLayout {
                        quant: limits.kv_quant,
                        start: limits.quantized_kv_start,
                    };
                    let adapter_spaces = match load_adapters(model.as_ref(), &limits.adapters) {
                        Ok(spaces) => spaces,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    // Not in an engine group: its ranks would have to warm up in lockstep.
                    if lockstep.is_none() && limits.warm_up.unwrap_or_else(on_gpu) {
                        let started = std::time::Instant::now();
                        // After the adapters: their rows compile kernels of their own.
                        if let Err(e) = warm_up::run(
                            model.as_ref(),
                            &info,
                            &adapter_spaces,
                            scheduler.clone(),
                            kv_budget,
                            plain_bytes_per_token,
                            layout,
                        ) {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                        tracing::info!(ms = started.elapsed().as_millis() as u64, "warmed up");
                    }
                    let in_force = LimitsInForce {
                        max_batch_size: scheduler.max_batch_size,
                        kv_budget_bytes: kv_budget,
                    };
                    let _ = ready_tx.send(Ok((info.clone(), model.adapters().cloned(), in_force)));
                    let caches = CacheManager::new(
                        kv_budget,
                        limits.prompt_cache_bytes,
                        plain_bytes_per_token,
                        info.kv_bytes_per_token,
                        layout,
                    )
                    .with_ssd(ssd);
                    tracing::info!(
                        max_batch_size = scheduler.max_batch_size,
                        prefill_step_tokens = scheduler.prefill_step_tokens,
                        "batch limits"
                    );
                    Executor::new(
                        model.as_ref(),
                        info,
                        scheduler,
                        caches,
                        thread_stats,
                        on_fatal,
                        spec,
                    )
                    .with_adapter_spaces(adapter_spaces)
                    .with_adapter_work(adapter_rx)
                    .serve(rx, lockstep);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| LoadError::Io {
                path: "<mlx thread>".into(),
                source: e,
            })?;
        match ready_rx.recv() {
            Ok(Ok((info, adapters, in_force))) => Ok(Runtime {
                work,
                info,
                in_force,
                stats,
                ssd: ssd_handle,
                adapters,
                adapter_work,
                thread,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LoadError::Config(
                "the MLX thread died while loading the model".into(),
            )),
        }
    }

    /// Stops accepting work and waits for the thread to finish what it holds.
    pub fn join(self) {
        drop(self.work);
        let _ = self.thread.join();
    }
}

/// Loads `adapters` (name, directory) into the model's table, on the MLX thread; returns
/// each one's prefix-cache space.
fn load_adapters(
    model: &dyn CausalLm,
    adapters: &[(String, PathBuf)],
) -> Result<HashMap<AdapterId, KvSpace>, LoadError> {
    let mut spaces = HashMap::new();
    if adapters.is_empty() {
        return Ok(spaces);
    }
    let Some(table) = model.adapters() else {
        return Err(LoadError::Config(format!(
            "{} takes no adapters here: an engine group's shard holds part of each layer",
            model.info().architecture
        )));
    };
    for (name, dir) in adapters {
        let id = table
            .load(name, dir)
            .map_err(|e| LoadError::Config(format!("adapter {name} ({}): {e}", dir.display())))?;
        let space = KvSpace::of_adapter_dir(dir).map_err(|source| LoadError::Io {
            path: dir.clone(),
            source,
        })?;
        spaces.insert(id, space);
        tracing::info!(adapter = %name, dir = %dir.display(), ?id, "adapter loaded");
    }
    Ok(spaces)
}

/// The first option in `limits` that the model's family refuses, with its reason. A model
/// with recurrent layers refuses drafts, which need a cache cut back to an earlier position.
fn refused_option(model: &dyn models::CausalLm, limits: &RuntimeLimits) -> Option<String> {
    let architecture = &model.info().architecture;
    if limits.speculation.is_some() && model.layer_kinds().iter().any(|k| k.is_state()) {
        return Some(format!(
            "{architecture} cannot be served with `draft`: its recurrent layers' state cannot be \
             rolled back to reject drafted tokens"
        ));
    }
    let asked = [
        (limits.kv_quant.is_some(), models::Feature::KvQuantization),
        (limits.speculation.is_some(), models::Feature::Speculation),
        (limits.prompt_cache_bytes > 0, models::Feature::PrefixCache),
    ];
    asked
        .into_iter()
        .filter(|(on, _)| *on)
        .find_map(|(_, feature)| {
            model.refuses(feature).map(|reason| {
                format!(
                    "{} cannot be served with `{}`: {reason}",
                    model.info().architecture,
                    feature.option()
                )
            })
        })
}

/// A model's layer kinds must be one per layer, each window at least one key: the caches are
/// bounded by them.
fn check_layers(model: &dyn CausalLm) -> Result<(), LoadError> {
    let kinds = model.layer_kinds();
    let info = model.info();
    if kinds.len() != info.num_layers {
        return Err(LoadError::Config(format!(
            "{} reports {} layer kinds for {} layers",
            info.architecture,
            kinds.len(),
            info.num_layers
        )));
    }
    if kinds.iter().any(|k| k.window() == Some(0)) {
        return Err(LoadError::Config(format!(
            "{} reports a sliding window of 0 keys",
            info.architecture
        )));
    }
    Ok(())
}

/// The drafter for `spec`, loading a draft model on this (the MLX) thread.
fn speculator(
    spec: &Speculation,
    main: &dyn CausalLm,
    prefill_chunk: usize,
) -> Result<Speculator, LoadError> {
    let drafter = match &spec.source {
        DraftSource::Ngram(sizes) => Drafter::Ngram(*sizes),
        DraftSource::Model(dir) => {
            let draft = models::load(dir)?;
            check_layers(draft.as_ref())?;
            if draft.layer_kinds().iter().any(|k| k.is_state()) {
                return Err(LoadError::Config(format!(
                    "the draft model {} ({}) has recurrent layers, whose state cannot be rolled \
                     back to reject drafted tokens",
                    dir.display(),
                    draft.info().architecture
                )));
            }
            let (d, m) = (draft.info().vocab_size, main.info().vocab_size);
            if d > m {
                return Err(LoadError::Config(format!(
                    "the draft model {} scores {d} token ids, more than the {m} of the main model",
                    dir.display()
                )));
            }
            Drafter::Model(ModelDrafter::new(draft, prefill_chunk))
        }
    };
    Ok(Speculator {
        drafter,
        num_draft: spec.num_draft,
        governor: Default::default(),
    })
}
