//! Control-channel messages between `mlxd` (parent) and `mlxd-engine` (child).
//!
//! The channel is the child's stdin (parent → child) and stdout (child → parent).
//! Framing and encoding live in `mlxd-ipc`; this module only defines the types.
//!
//! Versioning: the first frame the parent sends is always [`ParentMsg::Launch`], whose
//! `version` must equal the child's [`PROTOCOL_VERSION`]; the child echoes its own
//! version in [`Ready`]. A mismatch on either side is a load failure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Bumped on any incompatible change to the types in this module.
pub const PROTOCOL_VERSION: u32 = 3;

/// Messages from the supervisor to an engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ParentMsg {
    /// Always the first frame: what to load and where to listen.
    Launch(Launch),
    /// Stop admitting new requests; finish the ones in flight.
    Drain,
    /// Finish quickly and exit with code 0.
    Shutdown,
    /// Write everything the prefix cache holds to the SSD tier now (before the pool evicts
    /// or drains the engine), so a later engine of the model starts warm; answered by
    /// [`ChildMsg::Spilled`].
    Spill,
}

/// Everything an engine needs to start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    /// Must equal [`PROTOCOL_VERSION`].
    pub version: u32,
    /// A model name (`smollm2-135m`) or a directory path, as given to `mlxd --model`.
    pub model: String,
    /// The unix socket the engine must bind (the parent has removed any stale file).
    pub socket_path: PathBuf,
    pub limits: Limits,
    /// Free-form options (engine tuning; the fake engine's test script).
    pub options: BTreeMap<String, String>,
}

/// Resource limits; `None` means "engine default".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub max_batch_size: Option<u32>,
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<u32>,
}

/// Messages from an engine to the supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ChildMsg {
    /// Loading progress: `progress` in `0.0..=1.0` through `phase` (each phase runs from 0
    /// to 1 on its own, so a bar never has to guess how long the next phase takes).
    Loading { phase: LoadPhase, progress: f32 },
    /// The socket is bound and the model is loaded: requests may be sent.
    Ready(Ready),
    /// Periodic load and memory figures.
    Stats(Stats),
    /// Sent just before a controlled exit with a non-zero code.
    Fatal(Fatal),
    /// The answer to [`ParentMsg::Spill`].
    Spilled(Spilled),
}

/// What a spill left on disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spilled {
    /// The model's SSD files and their bytes after the spill (0 without an SSD tier).
    pub files: u64,
    pub bytes: u64,
    /// False when the engine's bounded wait ran out with writes still queued.
    pub complete: bool,
}

/// The SSD KV tier's figures in [`Stats`] (all 0 without one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SsdStats {
    /// Files and bytes the model's SSD directory holds now.
    pub files: u64,
    pub bytes: u64,
    /// Prefix lookups restored from disk, and the prompt tokens they did not prefill.
    pub hits: u64,
    pub restored_tokens: u64,
    /// Entries written (prefixes and generation checkpoints), checkpoints among them.
    pub writes: u64,
    pub checkpoints: u64,
    /// Files found corrupt, truncated or foreign, and deleted.
    pub invalid: u64,
    pub write_errors: u64,
}

/// The prefix cache's figures in [`Stats`], counted since the engine started (all 0 with the
/// cache off, `prompt_cache = 0`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixStats {
    /// Prompts looked up, those that found a cached prefix (in memory, or on the SSD tier),
    /// and the prompt tokens those prefixes spared the prefill.
    pub lookups: u64,
    pub hits: u64,
    pub reused_tokens: u64,
    /// Entries dropped to stay within the cache's budget (not those a longer entry of the same
    /// tokens made redundant). Many evictions and few hits, where prompts repeat: they outgrow
    /// `prompt_cache`, and each evicts what the next one needed (where every prompt is new,
    /// evictions only make room).
    pub evictions: u64,
    /// Entries and bytes held now.
    pub entries: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ready {
    /// The child's [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The id the engine answers to in `/v1/models`.
    pub model_id: String,
    pub weight_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// Cache bytes of one sequence whatever its length: the recurrent layers' states of a
    /// hybrid model (0 for a model that only attends). A sequence of `n` tokens needs this
    /// plus `n × kv_bytes_per_token`. Absent from older engines.
    #[serde(default)]
    pub state_bytes_per_sequence: u64,
    pub context_length: u32,
    /// e.g. `chat`, `completions`, `tools`.
    pub capabilities: Vec<String>,
    /// Where the model runs.
    pub device: Device,
    /// The limits the engine runs with: the launch's, with the engine's own choices where the
    /// launch left them unset (the batch size for the device, a KV budget from the GPU's free
    /// memory, the context cut to what that budget holds) and a KV budget cut to what the GPU
    /// holds. An out-of-memory exit shrinks these, not the launch's unset ones. Absent from
    /// older engines.
    #[serde(default)]
    pub limits: Option<Limits>,
}

/// What an engine is doing while it loads, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadPhase {
    /// Launched; the model is being looked up in the store.
    Starting,
    /// Downloading the model's files (progress: bytes of the current file).
    Downloading,
    /// Converting a GGUF file into the store's MLX format.
    Converting,
    /// Reading the weights into memory (progress: bytes read of all weights).
    Weights,
}

impl LoadPhase {
    /// The phase's name as `/engines` and the chat page show it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Downloading => "downloading",
            Self::Converting => "converting",
            Self::Weights => "weights",
        }
    }
}

/// The device an engine computes on: the kind MLX was asked for and the backend that runs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    pub kind: DeviceKind,
    pub backend: Backend,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

/// MLX's backend for the device: its CPU backend, CUDA (Linux, NVIDIA) or Metal (macOS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
        }
    }
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Metal => "metal",
        }
    }
}

impl std::fmt::Display for Device {
    /// `gpu (cuda)`, `gpu (metal)`, `cpu`: what the start-up line and `mlxd ps` print.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Gpu => write!(f, "gpu ({})", self.backend.name()),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Sequences being generated.
    pub active: u32,
    /// Requests admitted but not yet scheduled.
    pub queued: u32,
    pub kv_bytes: u64,
    /// Total memory in use by the engine (device + host), in bytes.
    pub memory_bytes: u64,
    /// Speculative drafts proposed and accepted since the engine started (0 without
    /// speculative decoding).
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// The SSD KV tier since the engine started.
    pub ssd: SsdStats,
    /// Sequences admitted whose prompts are still being prefilled (counted in `active` too),
    /// and the prompt tokens they have left: a long prefill is visible while it runs.
    /// Absent from older engines.
    #[serde(default)]
    pub prefilling: u32,
    #[serde(default)]
    pub prefill_tokens_left: u64,
    /// Where the engine's memory is, so that growth can be told apart (absent from older
    /// engines, and when the engine could not read a figure).
    #[serde(default)]
    pub memory: Option<MemoryStats>,
    /// The prefix cache since the engine started (absent from older engines).
    #[serde(default)]
    pub prefix: PrefixStats,
}

/// An engine's memory by where it is: the process as the kernel sees it, and MLX's
/// allocator. The KV held by sequences and the prefix cache is `Stats.kv_bytes`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Resident set size of the engine process (host memory: on a GPU, the arrays are in
    /// the MLX figures instead).
    pub rss_bytes: u64,
    /// Bytes of MLX arrays alive: weights, KV, activations.
    pub mlx_active_bytes: u64,
    /// Freed buffers MLX keeps for reuse, and the limit it keeps them under (set from the
    /// KV budget at start-up).
    pub mlx_cache_bytes: u64,
    pub mlx_cache_limit_bytes: u64,
    /// The most `mlx_active_bytes` has been since the engine started.
    pub mlx_peak_bytes: u64,
    /// MLX's memory limit, the guideline it evaluates under (above it, it gives its cache
    /// back first).
    pub mlx_memory_limit_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fatal {
    pub kind: FatalKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FatalKind {
    OutOfMemory,
    /// The load failed in a way another attempt may not repeat (an I/O error, a download
    /// cut short): the supervisor retries it with backoff, as a crash.
    LoadFailed,
    Internal,
    /// The load cannot succeed as asked — no such model or path, a refused option, a
    /// download impossible offline — so a restart would fail the same way: the supervisor
    /// fails the load once, with the message (which says what to do), and does not retry.
    CannotLoad,
}
