//! The engine's tuning options, defined once: `mlxd-engine`'s flags, `mlxd serve`'s flags
//! (both flatten [`EngineOptions`] with the `cli` feature), `mlxd.toml`'s
//! `[server.engine_options]` and a model's `options`, `--engine-opt key=value`, and
//! `Launch.options` (the string map [`EngineOptions::to_map`] writes and
//! [`EngineOptions::from_map`] reads). Every value is checked by the same functions
//! wherever it comes from, so a bad one fails at flag parsing or config load, naming the
//! option, before any engine starts; the engine checks `Launch.options` again the same way.
//!
//! Fields are `None` when not given; the engine applies the defaults (`DEFAULT_*`).
use std::collections::BTreeMap;
use std::path::PathBuf;

/// GiB of KV the prefix cache keeps when `prompt_cache` is not given.
pub const DEFAULT_PROMPT_CACHE_GIB: f64 = 1.0;
/// Elements sharing one scale and bias in a quantized KV cache.
pub const DEFAULT_KV_GROUP_SIZE: u32 = 64;
/// Drafted tokens per verification pass.
pub const DEFAULT_NUM_DRAFT_TOKENS: u32 = 3;
/// The most drafts one pass may verify.
pub const MAX_NUM_DRAFT_TOKENS: u32 = 16;
/// Shortest and longest n-gram prompt lookup matches.
pub const DEFAULT_NGRAM_MIN: u32 = 2;
pub const DEFAULT_NGRAM_MAX: u32 = 4;
/// Largest GiB figure accepted (`prompt_cache`, `ssd_cache_max`).
const MAX_GIB: f64 = 1024.0 * 1024.0;
/// Largest token count accepted (`quantized_kv_start`, `generation_checkpoint`).
const MAX_TOKENS: u64 = 1 << 24;

/// Every option's key, with what it takes.
pub const KEYS: &[(&str, &str)] = &[
    (
        "prompt_cache",
        "GiB of prefix cache, a number >= 0 (0 disables it)",
    ),
    ("kv_bits", "4 or 8: store the KV cache quantized"),
    ("kv_group_size", "32, 64 or 128 (with kv_bits)"),
    (
        "quantized_kv_start",
        "tokens kept unquantized before a sequence's KV converts (with kv_bits; default 0)",
    ),
    (
        "draft",
        "\"ngram\": speculative decoding with prompt-lookup drafts",
    ),
    (
        "draft_model",
        "a model (name, directory or GGUF) with the same tokenizer, to draft tokens",
    ),
    (
        "num_draft_tokens",
        "drafts per verification pass, 1 to 16 (default 3)",
    ),
    (
        "ngram_min",
        "shortest n-gram prompt lookup matches (default 2)",
    ),
    (
        "ngram_max",
        "longest n-gram prompt lookup matches (default 4)",
    ),
    (
        "ssd_cache",
        "a directory: prefix-cache entries are written behind to it and restored by later engines",
    ),
    (
        "ssd_cache_max",
        "GiB the model's SSD cache files may take, a number >= 0 (0 = unlimited; with ssd_cache)",
    ),
    (
        "ssd_demote_idle",
        "seconds after which an unused prefix leaves memory for the SSD cache (with ssd_cache)",
    ),
    (
        "generation_checkpoint",
        "write a running request's KV to the SSD cache every N generated tokens (with ssd_cache)",
    ),
    (
        "distributed",
        "ring, jaccl or nccl: this engine is one rank of an engine group (one model divided \
         among processes by MLX distributed); set by mlxd from a model's `distributed` entry",
    ),
    (
        "distributed_hosts",
        "with distributed: the group's hosts, one per rank (rank 0 first): comma-separated \
         names, or a JSON list of mlx.launch hostfile entries; rank 0 starts the other ranks \
         itself, through ssh on other machines (set by mlxd)",
    ),
    (
        "distributed_mode",
        "with distributed: tensor (every layer divided among the ranks, the default) or \
         pipeline (the layers divided among the ranks); set by mlxd from the model's \
         `distributed` entry",
    ),
    (
        "distributed_step_timeout",
        "with distributed: seconds a step of the group may run before a rank that makes no \
         progress (stopped, or its network stalled) takes the group down for a restart, 1 to \
         86400 (default 300)",
    ),
    (
        "step_timeout",
        "seconds one step of the engine's model thread may run while it has work before the \
         engine reports itself stalled (a device that stopped answering) and exits for a \
         restart, 1 to 86400 (default 300 on a GPU, 3600 on the CPU; an engine group uses \
         distributed_step_timeout)",
    ),
    (
        "memory_watch",
        "seconds the GPU may report its memory full (under 1 % free) while the engine's decode \
         steps take memory_watch_slowdown times their usual time and its running sequences grow, \
         before the engine reports itself out of memory and exits for a restart with halved \
         limits (another process took the GPU's memory and the driver pages instead of \
         failing), 1 to 3600, or off (default 30; only on a device that reports its free \
         memory: CUDA)",
    ),
    (
        "memory_watch_slowdown",
        "with memory_watch: how many times their usual time the decode steps must take, on \
         average over the window, 2 to 1000 (default 10)",
    ),
    (
        "state_snapshot_every",
        "models with recurrent layers: prompt tokens between two snapshots of the state in the \
         prefix cache (default 4096)",
    ),
    (
        "prefill_step_tokens",
        "prompt tokens prefilled per step, all prompts together, 32 to 1048576 (default: 16384 \
         on a GPU, 2048 on the CPU)",
    ),
    (
        "prefill_pad_to",
        "pad a group of prompts prefilled together on the left to a multiple of this many tokens, \
         so that bursts repeat a few pass shapes, 1 to 1024 (default 1: to the longest)",
    ),
    (
        "warm_up",
        "true or false: run a few short generations before reporting ready, so kernels are \
         compiled before the first request or a standby's takeover (default: true on a GPU)",
    ),
    (
        "adapters",
        "LoRA adapters served beside the model, name=dir pairs separated by commas (mlx-lm \
         adapter directories); a request selects one with \"model\": \"<model>:<name>\"",
    ),
];

/// An option with a value it cannot take, or in a combination that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("engine option {key} = {value:?}: {reason}")]
pub struct OptionError {
    pub key: String,
    pub value: String,
    pub reason: String,
}

/// Where speculative drafts come from without a draft model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draft {
    /// Prompt lookup: the tokens that followed the text's own ending where it occurred
    /// before (prompt or output).
    Ngram,
}

/// The engine's tuning options (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct EngineOptions {
    /// GiB of KV the prefix cache keeps between requests, reused by prompts that share a
    /// prefix (multi-turn chats, system prompts); 0 disables it [default: 1].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_prompt_cache))]
    pub prompt_cache: Option<f64>,
    /// Quantize the KV cache to 4 or 8 bits (attention then runs on MLX's quantized
    /// matmuls) [default: the model's dtype].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_kv_bits))]
    pub kv_bits: Option<u32>,
    /// With --kv-bits: elements of a head that share one scale and bias (32, 64 or 128)
    /// [default: 64].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_kv_group_size))]
    pub kv_group_size: Option<u32>,
    /// With --kv-bits: a sequence's KV stays in the model's dtype until it holds more than
    /// this many tokens, then converts (as mlx-lm's --quantized-kv-start) [default: 0].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_quantized_kv_start))]
    pub quantized_kv_start: Option<u64>,
    /// Speculative decoding with prompt-lookup drafts: `ngram` proposes the tokens that
    /// followed the text's own ending where it occurred before (prompt or output).
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_draft))]
    pub draft: Option<Draft>,
    /// Speculative decoding with a smaller model (name, directory or GGUF) that has the
    /// same tokenizer.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_draft_model))]
    pub draft_model: Option<String>,
    /// With --draft or --draft-model: drafted tokens verified per forward pass, 1 to 16
    /// [default: 3].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_num_draft_tokens))]
    pub num_draft_tokens: Option<u32>,
    /// With --draft ngram: shortest n-gram prompt lookup matches, 1 to 64 [default: 2].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_ngram))]
    pub ngram_min: Option<u32>,
    /// With --draft ngram: longest n-gram prompt lookup matches, 1 to 64 [default: 4].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_ngram))]
    pub ngram_max: Option<u32>,
    /// Write prefix-cache entries behind to this directory (one subdirectory per model), so
    /// that a restarted engine restores prefixes from disk instead of prefilling them.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_ssd_cache))]
    pub ssd_cache: Option<PathBuf>,
    /// With --ssd-cache: GiB the model's SSD cache files may take; the oldest are deleted
    /// past it (0 = unlimited).
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_ssd_cache_max))]
    pub ssd_cache_max: Option<f64>,
    /// With --ssd-cache: seconds after which an unused prefix leaves memory; it stays on
    /// disk.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_ssd_demote_idle))]
    pub ssd_demote_idle: Option<f64>,
    /// With --ssd-cache: every N generated tokens, write a running request's KV to the SSD
    /// cache, so a resume after a crash restores instead of prefilling.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_generation_checkpoint))]
    pub generation_checkpoint: Option<u64>,
    /// Run as one rank of an engine group over this MLX distributed backend (ring, jaccl or
    /// nccl), as `mlx.launch` starts one: the rank and the other hosts come from MLX's own
    /// environment (`MLX_RANK`, and `MLX_HOSTFILE` for ring, `MLX_IBV_DEVICES` and
    /// `MLX_JACCL_COORDINATOR` for jaccl); rank 0 serves, the others take the model and every
    /// option from it.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_distributed))]
    pub distributed: Option<String>,
    /// With --distributed: the group's hosts, one per rank (rank 0 first), comma-separated
    /// names or a JSON list of entries (`mlxd_protocol::group_hosts`); rank 0 then starts the
    /// other ranks itself (through ssh on other machines) and writes MLX's hostfile. Without
    /// it the group comes from MLX's environment.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_distributed_hosts))]
    pub distributed_hosts: Option<String>,
    /// With --distributed: how the group divides the model: `tensor` (each layer's matrices
    /// among the ranks) or `pipeline` (the layers among the ranks, activations passed from
    /// rank to rank) [default: tensor].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_distributed_mode))]
    pub distributed_mode: Option<Parallelism>,
    /// With --distributed: seconds one step of the group (rank 0's broadcast and the forward
    /// pass) may run before the rank gives the group up as hung and exits for a restart
    /// [default: 300].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_distributed_step_timeout))]
    pub distributed_step_timeout: Option<u64>,
    /// Seconds one step of the model thread may run while the engine has work before the
    /// engine reports itself stalled (a device that stopped answering) and exits, so that the
    /// supervisor restarts it and resumes its streams [default: 300 on a GPU, 3600 on the
    /// CPU].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_step_timeout))]
    pub step_timeout: Option<u64>,
    /// Seconds the GPU may report its memory full while the decode steps take
    /// --memory-watch-slowdown times their usual time and the running sequences grow, before the engine reports itself out
    /// of memory and exits, so that the supervisor restarts it with halved limits; `off`
    /// turns the watch off [default: 30; only where the device reports its free memory].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_memory_watch))]
    pub memory_watch: Option<MemoryWatch>,
    /// With --memory-watch: how many times their usual time the decode steps must take
    /// [default: 10].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_memory_watch_slowdown))]
    pub memory_watch_slowdown: Option<u32>,
    /// For models with recurrent layers (Qwen3-Next, Mamba-2, ...), whose state cannot be cut
    /// back to a shorter prefix: prompt tokens between two snapshots of the state kept in the
    /// prefix cache, and the most a prefill chunk holds [default: 4096].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_state_snapshot_every))]
    pub state_snapshot_every: Option<u64>,
    /// Prompt tokens (padding included) that one step prefills, every waiting prompt's chunks
    /// together, beside the decode step; fewer where the measured prefill speed would make the
    /// step outlast half a second [default: 16384 on a GPU, 2048 on the CPU].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_prefill_step_tokens))]
    pub prefill_step_tokens: Option<u64>,
    /// A group of short prompts prefilled together in one pass is padded on the left to a
    /// multiple of this many tokens, so that bursts of prompts of nearby lengths run a few
    /// pass shapes (each new one costs a GPU a build of its kernels) [default: 1, to the
    /// longest prompt].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_prefill_pad_to))]
    pub prefill_pad_to: Option<u64>,
    /// Run a few short generations before reporting ready, so that the kernels a GPU
    /// compiles on first use are ready before the first request — or before a standby
    /// engine takes over a crashed one's streams [default: true on a GPU, false on the CPU].
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_warm_up))]
    pub warm_up: Option<bool>,
    /// LoRA adapters (mlx-lm's `adapter_config.json` + `adapters.safetensors` directories)
    /// served beside the model without reloading it, as `name=dir` pairs separated by commas;
    /// a request selects one with `"model": "<model>:<name>"`, and rows of different adapters
    /// share the batch.
    #[cfg_attr(feature = "cli", arg(long, value_parser = parse_adapters))]
    pub adapters: Option<String>,
}

// One parser per option: what flags, config values and `Launch.options` all go through.

fn parse_gib(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|g| g.is_finite() && (0.0..=MAX_GIB).contains(g))
        .ok_or_else(|| format!("expected GiB between 0 and {MAX_GIB}"))
}

fn parse_in<T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy>(
    s: &str,
    lo: T,
    hi: T,
    what: &str,
) -> Result<T, String> {
    s.trim()
        .parse::<T>()
        .ok()
        .filter(|n| *n >= lo && *n <= hi)
        .ok_or_else(|| format!("expected {what} from {lo} to {hi}"))
}

pub fn parse_prompt_cache(s: &str) -> Result<f64, String> {
    parse_gib(s)
}

pub fn parse_kv_bits(s: &str) -> Result<u32, String> {
    match s.trim() {
        "4" => Ok(4),
        "8" => Ok(8),
        _ => Err("expected 4 or 8".into()),
    }
}

pub fn parse_kv_group_size(s: &str) -> Result<u32, String> {
    match s.trim() {
        "32" => Ok(32),
        "64" => Ok(64),
        "128" => Ok(128),
        _ => Err("expected 32, 64 or 128".into()),
    }
}

pub fn parse_quantized_kv_start(s: &str) -> Result<u64, String> {
    parse_in(s, 0, MAX_TOKENS, "a number of tokens")
}

pub fn parse_draft(s: &str) -> Result<Draft, String> {
    match s.trim() {
        "ngram" => Ok(Draft::Ngram),
        _ => Err("expected \"ngram\" (a draft model is draft_model)".into()),
    }
}

pub fn parse_draft_model(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("expected a model name, directory or GGUF file".into());
    }
    Ok(s.to_owned())
}

pub fn parse_num_draft_tokens(s: &str) -> Result<u32, String> {
    parse_in(s, 1, MAX_NUM_DRAFT_TOKENS, "a number of tokens")
}

pub fn parse_ngram(s: &str) -> Result<u32, String> {
    parse_in(s, 1, 64, "a number of tokens")
}

pub fn parse_ssd_cache(s: &str) -> Result<PathBuf, String> {
    if s.trim().is_empty() {
        return Err("expected a directory".into());
    }
    Ok(PathBuf::from(s))
}

pub fn parse_ssd_cache_max(s: &str) -> Result<f64, String> {
    parse_gib(s)
}

pub fn parse_ssd_demote_idle(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0 && *v <= 1e9)
        .ok_or_else(|| "expected seconds > 0".into())
}

pub fn parse_generation_checkpoint(s: &str) -> Result<u64, String> {
    parse_in(s, 1, MAX_TOKENS, "a number of tokens")
}

/// The MLX distributed backends, by the names `mx.distributed.init` takes.
pub const DISTRIBUTED_BACKENDS: &[&str] = &["ring", "jaccl", "nccl"];

pub fn parse_distributed(s: &str) -> Result<String, String> {
    let s = s.trim();
    if DISTRIBUTED_BACKENDS.contains(&s) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "expected one of {}",
            DISTRIBUTED_BACKENDS.join(", ")
        ))
    }
}

/// How an engine group divides its model among the ranks (`distributed_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Parallelism {
    /// Every layer's matrices divided among the ranks.
    #[default]
    Tensor,
    /// The layers divided among the ranks.
    Pipeline,
}

impl Parallelism {
    /// The name `distributed_mode` and `mlxd.toml`'s `mode` take.
    pub fn name(self) -> &'static str {
        match self {
            Parallelism::Tensor => "tensor",
            Parallelism::Pipeline => "pipeline",
        }
    }
}

pub fn parse_distributed_mode(s: &str) -> Result<Parallelism, String> {
    match s.trim() {
        "tensor" => Ok(Parallelism::Tensor),
        "pipeline" => Ok(Parallelism::Pipeline),
        _ => Err("expected tensor or pipeline".into()),
    }
}

pub fn parse_distributed_hosts(s: &str) -> Result<String, String> {
    crate::group_hosts::parse_hosts(s).map(|hosts| crate::group_hosts::to_option(&hosts))
}

/// The engine options an engine group refuses, with the reason (every rank must take the same
/// decisions on the same inputs, and these would not).
pub const GROUP_REFUSES: &[(&str, &str)] = &[
    (
        "draft",
        "speculation's governor times the steps, which differ between ranks",
    ),
    (
        "draft_model",
        "speculation's governor times the steps, which differ between ranks, and the draft \
         model is not divided",
    ),
    (
        "ssd_cache",
        "the SSD tier's writes and idle demotions run on timers, which differ between ranks",
    ),
    (
        "adapters",
        "a LoRA adapter's matrices are not divided among the ranks, and the other ranks would \
         run the base model",
    ),
    (
        "warm_up",
        "warm-up generations run on one rank alone; a group's ranks would have to run them in \
         lockstep",
    ),
    (
        "step_timeout",
        "a group bounds its steps with distributed_step_timeout",
    ),
    (
        "memory_watch",
        "the memory-pressure watch runs in a single engine; a group's ranks would have to \
         agree on the exit",
    ),
    (
        "memory_watch_slowdown",
        "the memory-pressure watch runs in a single engine; a group's ranks would have to \
         agree on the exit",
    ),
];

/// Most seconds a group's step may be given (a day).
const MAX_STEP_TIMEOUT: u64 = 86_400;

pub fn parse_distributed_step_timeout(s: &str) -> Result<u64, String> {
    parse_in(s, 1, MAX_STEP_TIMEOUT, "seconds")
}

pub fn parse_step_timeout(s: &str) -> Result<u64, String> {
    parse_in(s, 1, MAX_STEP_TIMEOUT, "seconds")
}

/// The memory-pressure watch's window (`memory_watch`): seconds, or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryWatch {
    Off,
    Seconds(u64),
}

impl std::fmt::Display for MemoryWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryWatch::Off => f.write_str("off"),
            MemoryWatch::Seconds(s) => write!(f, "{s}"),
        }
    }
}

/// Longest memory-watch window: an hour of a crawling GPU serves nobody.
const MAX_MEMORY_WATCH: u64 = 3600;

pub fn parse_memory_watch(s: &str) -> Result<MemoryWatch, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(MemoryWatch::Off);
    }
    parse_in(s, 1, MAX_MEMORY_WATCH, "seconds")
        .map(MemoryWatch::Seconds)
        .map_err(|e| format!("{e}, or off"))
}

pub fn parse_memory_watch_slowdown(s: &str) -> Result<u32, String> {
    parse_in(s, 2, 1000, "a factor")
}

pub fn parse_state_snapshot_every(s: &str) -> Result<u64, String> {
    parse_in(s, 16, MAX_TOKENS, "a number of tokens")
}

/// Most tokens one step may prefill: a step of more stalls every running stream for longer
/// than any device prefills in a second.
const MAX_PREFILL_STEP_TOKENS: u64 = 1 << 20;

pub fn parse_prefill_step_tokens(s: &str) -> Result<u64, String> {
    parse_in(s, 32, MAX_PREFILL_STEP_TOKENS, "a number of tokens")
}

pub fn parse_prefill_pad_to(s: &str) -> Result<u64, String> {
    parse_in(s, 1, 1024, "a number of tokens")
}

pub fn parse_warm_up(s: &str) -> Result<bool, String> {
    match s.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

/// An adapter name: what `"<model>:<name>"` and a URL path can carry.
pub fn valid_adapter_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `name=dir,name=dir` → the (name, directory) pairs, each name once.
pub fn parse_adapter_list(s: &str) -> Result<Vec<(String, PathBuf)>, String> {
    let mut out: Vec<(String, PathBuf)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((name, dir)) = item.split_once('=') else {
            return Err(format!("expected name=dir, got {item:?}"));
        };
        let (name, dir) = (name.trim(), dir.trim());
        if !valid_adapter_name(name) {
            return Err(format!(
                "adapter name {name:?}: use 1 to 128 of the characters A-Z a-z 0-9 - _ ."
            ));
        }
        if dir.is_empty() {
            return Err(format!("adapter {name} has no directory"));
        }
        if out.iter().any(|(n, _)| n == name) {
            return Err(format!("adapter {name} is listed twice"));
        }
        out.push((name.to_owned(), PathBuf::from(dir)));
    }
    if out.is_empty() {
        return Err("expected name=dir pairs separated by commas".into());
    }
    Ok(out)
}

/// [`parse_adapter_list`], kept in its canonical string form.
pub fn parse_adapters(s: &str) -> Result<String, String> {
    let list = parse_adapter_list(s)?;
    Ok(list
        .iter()
        .map(|(n, d)| format!("{n}={}", d.display()))
        .collect::<Vec<_>>()
        .join(","))
}

impl EngineOptions {
    /// The adapters to load at start (`adapters`), by name.
    pub fn adapter_list(&self) -> Vec<(String, PathBuf)> {
        self.adapters
            .as_deref()
            .and_then(|s| parse_adapter_list(s).ok())
            .unwrap_or_default()
    }

    /// Sets the option `key` from its string form; an unknown key or a value outside the
    /// option's domain is an error naming both.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), OptionError> {
        let bad = |reason: String| OptionError {
            key: key.to_owned(),
            value: value.to_owned(),
            reason,
        };
        match key {
            "prompt_cache" => self.prompt_cache = Some(parse_prompt_cache(value).map_err(bad)?),
            "kv_bits" => self.kv_bits = Some(parse_kv_bits(value).map_err(bad)?),
            "kv_group_size" => self.kv_group_size = Some(parse_kv_group_size(value).map_err(bad)?),
            "quantized_kv_start" => {
                self.quantized_kv_start = Some(parse_quantized_kv_start(value).map_err(bad)?)
            }
            "draft" => self.draft = Some(parse_draft(value).map_err(bad)?),
            "draft_model" => self.draft_model = Some(parse_draft_model(value).map_err(bad)?),
            "num_draft_tokens" => {
                self.num_draft_tokens = Some(parse_num_draft_tokens(value).map_err(bad)?)
            }
            "ngram_min" => self.ngram_min = Some(parse_ngram(value).map_err(bad)?),
            "ngram_max" => self.ngram_max = Some(parse_ngram(value).map_err(bad)?),
            "ssd_cache" => self.ssd_cache = Some(parse_ssd_cache(value).map_err(bad)?),
            "ssd_cache_max" => self.ssd_cache_max = Some(parse_ssd_cache_max(value).map_err(bad)?),
            "ssd_demote_idle" => {
                self.ssd_demote_idle = Some(parse_ssd_demote_idle(value).map_err(bad)?)
            }
            "generation_checkpoint" => {
                self.generation_checkpoint = Some(parse_generation_checkpoint(value).map_err(bad)?)
            }
            "distributed" => self.distributed = Some(parse_distributed(value).map_err(bad)?),
            "distributed_hosts" => {
                self.distributed_hosts = Some(parse_distributed_hosts(value).map_err(bad)?)
            }
            "distributed_mode" => {
                self.distributed_mode = Some(parse_distributed_mode(value).map_err(bad)?)
            }
            "distributed_step_timeout" => {
                self.distributed_step_timeout =
                    Some(parse_distributed_step_timeout(value).map_err(bad)?)
            }
            "step_timeout" => self.step_timeout = Some(parse_step_timeout(value).map_err(bad)?),
            "memory_watch" => self.memory_watch = Some(parse_memory_watch(value).map_err(bad)?),
            "memory_watch_slowdown" => {
                self.memory_watch_slowdown = Some(parse_memory_watch_slowdown(value).map_err(bad)?)
            }
            "state_snapshot_every" => {
                self.state_snapshot_every = Some(parse_state_snapshot_every(value).map_err(bad)?)
            }
            "prefill_step_tokens" => {
                self.prefill_step_tokens = Some(parse_prefill_step_tokens(value).map_err(bad)?)
            }
            "prefill_pad_to" => {
                self.prefill_pad_to = Some(parse_prefill_pad_to(value).map_err(bad)?)
            }
            "warm_up" => self.warm_up = Some(parse_warm_up(value).map_err(bad)?),
            "adapters" => self.adapters = Some(parse_adapters(value).map_err(bad)?),
            _ => {
                let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                return Err(bad(format!("unknown option (known: {})", known.join(", "))));
            }
        }
        Ok(())
    }

    /// Reads `Launch.options` (or a config's option map) and checks the whole.
    pub fn from_map(map: &BTreeMap<String, String>) -> Result<Self, OptionError> {
        let mut options = Self::default();
        for (key, value) in map {
            options.set(key, value)?;
        }
        options.check()?;
        Ok(options)
    }

    /// The options given, in `Launch.options`' string form (read back by [`Self::from_map`]).
    pub fn to_map(&self) -> BTreeMap<String, String> {
        let mut map = BTreeMap::new();
        let mut put = |key: &str, value: Option<String>| {
            if let Some(v) = value {
                map.insert(key.to_owned(), v);
            }
        };
        put("prompt_cache", self.prompt_cache.map(|v| v.to_string()));
        put("kv_bits", self.kv_bits.map(|v| v.to_string()));
        put("kv_group_size", self.kv_group_size.map(|v| v.to_string()));
        put(
            "quantized_kv_start",
            self.quantized_kv_start.map(|v| v.to_string()),
        );
        put(
            "draft",
            self.draft.map(|d| match d {
                Draft::Ngram => "ngram".to_owned(),
            }),
        );
        put("draft_model", self.draft_model.clone());
        put(
            "num_draft_tokens",
            self.num_draft_tokens.map(|v| v.to_string()),
        );
        put("ngram_min", self.ngram_min.map(|v| v.to_string()));
        put("ngram_max", self.ngram_max.map(|v| v.to_string()));
        put(
            "ssd_cache",
            self.ssd_cache.as_ref().map(|p| p.display().to_string()),
        );
        put("ssd_cache_max", self.ssd_cache_max.map(|v| v.to_string()));
        put(
            "ssd_demote_idle",
            self.ssd_demote_idle.map(|v| v.to_string()),
        );
        put(
            "generation_checkpoint",
            self.generation_checkpoint.map(|v| v.to_string()),
        );
        put("distributed", self.distributed.clone());
        put("distributed_hosts", self.distributed_hosts.clone());
        put(
            "distributed_mode",
            self.distributed_mode.map(|m| m.name().to_owned()),
        );
        put(
            "distributed_step_timeout",
            self.distributed_step_timeout.map(|v| v.to_string()),
        );
        put("step_timeout", self.step_timeout.map(|v| v.to_string()));
        put("memory_watch", self.memory_watch.map(|v| v.to_string()));
        put(
            "memory_watch_slowdown",
            self.memory_watch_slowdown.map(|v| v.to_string()),
        );
        put(
            "state_snapshot_every",
            self.state_snapshot_every.map(|v| v.to_string()),
        );
        put(
            "prefill_step_tokens",
            self.prefill_step_tokens.map(|v| v.to_string()),
        );
        put("prefill_pad_to", self.prefill_pad_to.map(|v| v.to_string()));
        put("warm_up", self.warm_up.map(|v| v.to_string()));
        put("adapters", self.adapters.clone());
        map
    }

    /// The combinations that cannot work: options that need another, options that exclude
    /// each other, n-gram sizes out of order.
    pub fn check(&self) -> Result<(), OptionError> {
        let map = self.to_map();
        let refuse = |key: &str, reason: &str| OptionError {
            key: key.to_owned(),
            value: map.get(key).cloned().unwrap_or_default(),
            reason: reason.to_owned(),
        };
        if self.kv_bits.is_none() {
            for key in ["kv_group_size", "quantized_kv_start"] {
                if map.contains_key(key) {
                    return Err(refuse(key, "needs kv_bits"));
                }
            }
        }
        if self.ssd_cache.is_none() {
            for key in ["ssd_cache_max", "ssd_demote_idle", "generation_checkpoint"] {
                if map.contains_key(key) {
                    return Err(refuse(key, "needs ssd_cache (--ssd-cache)"));
                }
            }
        }
        if self.draft.is_none() {
            for key in ["ngram_min", "ngram_max"] {
                if map.contains_key(key) {
                    return Err(refuse(key, "needs draft = \"ngram\""));
                }
            }
        }
        if self.draft.is_some() && self.draft_model.is_some() {
            return Err(refuse(
                "draft_model",
                "draft = \"ngram\" and draft_model exclude each other",
            ));
        }
        if self.distributed.is_some() {
            for (key, why) in GROUP_REFUSES {
                let asked = match *key {
                    // warm_up = false is what a group does anyway.
                    "warm_up" => self.warm_up == Some(true),
                    _ => map.contains_key(*key),
                };
                if asked {
                    return Err(refuse(
                        key,
                        &format!("is not supported by an engine group (distributed) yet: {why}"),
                    ));
                }
            }
        }
        if self.distributed.is_none() && self.distributed_hosts.is_some() {
            return Err(refuse("distributed_hosts", "needs distributed"));
        }
        if self.distributed.is_none() && self.distributed_mode.is_some() {
            return Err(refuse("distributed_mode", "needs distributed"));
        }
        if self.distributed.is_none() && self.distributed_step_timeout.is_some() {
            return Err(refuse("distributed_step_timeout", "needs distributed"));
        }
        let (min, max) = self.ngram_sizes();
        if min > max {
            return Err(refuse(
                "ngram_min",
                &format!(
                    "n-gram sizes must satisfy 1 <= ngram_min <= ngram_max (got {min} and {max})"
                ),
            ));
        }
        if self.draft.is_none() && self.draft_model.is_none() && self.num_draft_tokens.is_some() {
            return Err(refuse(
                "num_draft_tokens",
                "needs draft = \"ngram\" or a draft_model",
            ));
        }
        Ok(())
    }

    /// The prefix cache's size in bytes.
    pub fn prompt_cache_bytes(&self) -> u64 {
        (self.prompt_cache.unwrap_or(DEFAULT_PROMPT_CACHE_GIB) * (1u64 << 30) as f64) as u64
    }

    /// The KV cache's quantization, `(bits, group size)`, when asked for.
    pub fn kv_quant(&self) -> Option<(u32, u32)> {
        self.kv_bits
            .map(|bits| (bits, self.kv_group_size.unwrap_or(DEFAULT_KV_GROUP_SIZE)))
    }

    /// `(ngram_min, ngram_max)` with their defaults.
    pub fn ngram_sizes(&self) -> (u32, u32) {
        (
            self.ngram_min.unwrap_or(DEFAULT_NGRAM_MIN),
            self.ngram_max.unwrap_or(DEFAULT_NGRAM_MAX),
        )
    }

    pub fn num_draft_tokens(&self) -> u32 {
        self.num_draft_tokens.unwrap_or(DEFAULT_NUM_DRAFT_TOKENS)
    }

    /// The SSD tier's size cap in bytes (`None`: unlimited).
    pub fn ssd_cache_max_bytes(&self) -> Option<u64> {
        self.ssd_cache_max
            .filter(|g| *g > 0.0)
            .map(|g| (g * (1u64 << 30) as f64) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_key_round_trips_through_the_map() {
        let given = map(&[
            ("prompt_cache", "0.25"),
            ("kv_bits", "8"),
            ("kv_group_size", "32"),
            ("quantized_kv_start", "128"),
            ("draft", "ngram"),
            ("num_draft_tokens", "5"),
            ("ngram_min", "1"),
            ("ngram_max", "3"),
            ("ssd_cache", "/tmp/ssd"),
            ("ssd_cache_max", "2"),
            ("ssd_demote_idle", "1.5"),
            ("generation_checkpoint", "64"),
            ("state_snapshot_every", "1024"),
            ("prefill_step_tokens", "8192"),
            ("prefill_pad_to", "32"),
            ("warm_up", "false"),
            ("memory_watch", "20"),
            ("memory_watch_slowdown", "5"),
        ]);
        let o = EngineOptions::from_map(&given).unwrap();
        assert_eq!(o.to_map(), given);
        assert_eq!(o.memory_watch, Some(MemoryWatch::Seconds(20)));
        let mut off = EngineOptions::default();
        off.set("memory_watch", "OFF").unwrap();
        assert_eq!(off.memory_watch, Some(MemoryWatch::Off));
        assert_eq!(o.kv_quant(), Some((8, 32)));
        assert_eq!(o.prompt_cache_bytes(), 1 << 28);
        assert_eq!(o.ssd_cache_max_bytes(), Some(2 << 30));
        // KEYS lists exactly the keys `set` knows.
        for (k, _) in KEYS {
            let e = EngineOptions::default().set(k, "").unwrap_err();
            assert!(!e.reason.starts_with("unknown option"), "{k}: {e}");
        }
        assert!(given
            .keys()
            .all(|k| KEYS.iter().any(|(known, _)| known == k)));
        let d = EngineOptions::default();
        assert_eq!(
            (d.prompt_cache_bytes(), d.kv_quant(), d.ngram_sizes()),
            (1 << 30, None, (2, 4))
        );
    }

    #[test]
    fn bad_values_and_combinations_name_the_option() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("kv_bits", "3")], "engine option kv_bits = \"3\": expected 4 or 8"),
            (
                &[("speculative", "yes")],
                "engine option speculative = \"yes\": unknown option (known: prompt_cache,",
            ),
            (
                &[("prompt_cache", "-1")],
                "engine option prompt_cache = \"-1\": expected GiB between 0 and 1048576",
            ),
            (
                &[("state_snapshot_every", "8")],
                "engine option state_snapshot_every = \"8\": expected a number of tokens from 16",
            ),
            (
                &[("num_draft_tokens", "17"), ("draft", "ngram")],
                "engine option num_draft_tokens = \"17\": expected a number of tokens from 1 to 16",
            ),
            (
                &[("kv_group_size", "32")],
                "engine option kv_group_size = \"32\": needs kv_bits",
            ),
            (
                &[("generation_checkpoint", "8")],
                "engine option generation_checkpoint = \"8\": needs ssd_cache (--ssd-cache)",
            ),
            (
                &[("ngram_min", "2")],
                "engine option ngram_min = \"2\": needs draft = \"ngram\"",
            ),
            (
                &[("draft", "ngram"), ("draft_model", "m")],
                "engine option draft_model = \"m\": draft = \"ngram\" and draft_model exclude each other",
            ),
            (
                &[("draft", "ngram"), ("ngram_min", "5")],
                "engine option ngram_min = \"5\": n-gram sizes must satisfy",
            ),
            (
                &[("warm_up", "yes")],
                "engine option warm_up = \"yes\": expected true or false",
            ),
            (
                &[("distributed", "ring"), ("warm_up", "true")],
                "engine option warm_up = \"true\": is not supported by an engine group \
                 (distributed) yet: warm-up generations run on one rank alone",
            ),
            (
                &[("distributed", "ring"), ("adapters", "a=/x")],
                "engine option adapters = \"a=/x\": is not supported by an engine group \
                 (distributed) yet: a LoRA adapter's matrices are not divided",
            ),
            (
                &[("distributed", "ring"), ("ssd_cache", "/x")],
                "engine option ssd_cache = \"/x\": is not supported by an engine group \
                 (distributed) yet: the SSD tier's writes",
            ),
            (
                &[("distributed", "ring"), ("step_timeout", "5")],
                "engine option step_timeout = \"5\": is not supported by an engine group \
                 (distributed) yet: a group bounds its steps with distributed_step_timeout",
            ),
            (
                &[("step_timeout", "0")],
                "engine option step_timeout = \"0\": expected seconds from 1 to 86400",
            ),
            (
                &[("memory_watch", "0")],
                "engine option memory_watch = \"0\": expected seconds from 1 to 3600, or off",
            ),
            (
                &[("memory_watch_slowdown", "1")],
                "engine option memory_watch_slowdown = \"1\": expected a factor from 2 to 1000",
            ),
            (
                &[("distributed", "ring"), ("memory_watch", "off")],
                "engine option memory_watch = \"off\": is not supported by an engine group",
            ),
            (
                &[("distributed_step_timeout", "5")],
                "engine option distributed_step_timeout = \"5\": needs distributed",
            ),
            (
                &[("distributed", "ring"), ("distributed_step_timeout", "0")],
                "engine option distributed_step_timeout = \"0\": expected seconds from 1 to 86400",
            ),
            (
                &[("prefill_step_tokens", "16")],
                "engine option prefill_step_tokens = \"16\": expected a number of tokens from 32 \
                 to 1048576",
            ),
            (
                &[("prefill_step_tokens", "2000000")],
                "engine option prefill_step_tokens = \"2000000\": expected a number of tokens",
            ),
            (
                &[("prefill_pad_to", "0")],
                "engine option prefill_pad_to = \"0\": expected a number of tokens from 1 to 1024",
            ),
            (
                &[("num_draft_tokens", "2")],
                "engine option num_draft_tokens = \"2\": needs draft = \"ngram\" or a draft_model",
            ),
            (
                &[("distributed_mode", "pipeline")],
                "engine option distributed_mode = \"pipeline\": needs distributed",
            ),
            (
                &[("distributed", "ring"), ("distributed_mode", "layers")],
                "engine option distributed_mode = \"layers\": expected tensor or pipeline",
            ),
        ];
        for (pairs, want) in cases {
            let e = EngineOptions::from_map(&map(pairs))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(want), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn adapters_are_name_dir_pairs_each_name_once() {
        let o = EngineOptions::from_map(
            &[("adapters".to_string(), " a=/x/a , b-2=/y ".to_string())].into(),
        )
        .unwrap();
        assert_eq!(o.adapters.as_deref(), Some("a=/x/a,b-2=/y"));
        assert_eq!(
            o.adapter_list(),
            vec![("a".into(), "/x/a".into()), ("b-2".into(), "/y".into())]
        );
        assert_eq!(EngineOptions::from_map(&o.to_map()).unwrap(), o);
        for bad in ["a", "a=", "a b=/x", "a=/x,a=/y", ","] {
            let e = EngineOptions::from_map(&[("adapters".to_string(), bad.to_string())].into());
            assert!(e.is_err(), "{bad:?} accepted");
        }
        let grouped = EngineOptions::from_map(
            &[
                ("adapters".to_string(), "a=/x".to_string()),
                ("distributed".to_string(), "ring".to_string()),
            ]
            .into(),
        );
        assert!(grouped.unwrap_err().key == "adapters");
    }
}
