//! Command line: `mlxd [serve] [flags]`; the store verbs `pull`, `ls`, `rm`, which work on
//! the local model store without a server; and the client verbs `run`, `ps`, `stop`, `bench`
//! (and `ls --server`), which talk to a running server.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{parse_bytes, parse_duration, Config, ConfigError, ModelConfig};

/// The port a server binds, and clients reach, when neither a flag nor `MLXD_PORT` says.
pub const DEFAULT_PORT: u16 = 8080;

#[derive(Debug, Parser)]
#[command(
    name = "mlxd",
    version,
    about = "Local LLM server: supervisor and proxy for MLX engines",
    after_help = "`mlxd` alone is `mlxd serve`. Environment: MLXD_HOST (with or without a \
                  port), MLXD_PORT, MLXD_CONFIG (serve and the client verbs), MLXD_HOME (the \
                  model store), MLXD_URL and MLXD_API_KEY (client verbs). Exit codes of the \
                  client verbs: 0 done, 1 the server or the model refused or failed, 2 bad \
                  usage (flags, input, configuration), 3 the server could not be reached."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags for the default `serve` command.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI-compatible API (the default).
    Serve(Box<ServeArgs>),
    /// Chat with a model of a running server: answer PROMPT (with piped stdin above it) and
    /// exit; piped stdin alone is one prompt; on a terminal without PROMPT, an interactive chat
    /// (`/?` lists its commands; Ctrl-C stops an answer, Ctrl-D or `/bye` leaves).
    #[command(after_help = RUN_HELP)]
    Run(RunArgs),
    /// Fetch a model into the local store, without a server: a known name, a .gguf file to
    /// convert, a model directory to check, or a Hugging Face repo id (org/name[@revision]).
    Pull(PullArgs),
    /// Models in the local store and the Hugging Face cache, with sizes and formats; with
    /// --server (or --url), the configured models of a running server and their states.
    #[command(visible_alias = "list")]
    Ls(LsArgs),
    /// Delete a model from the local store or the Hugging Face cache.
    Rm(RmArgs),
    /// What a model in the local store is: architecture, parameters, quantization, context
    /// length, chat template, license and where it lives (without a server).
    Show(ShowArgs),
    /// Running engines of a running server: model, pid, state, memory, uptime, when an idle
    /// one is unloaded, requests, restarts.
    Ps(PsArgs),
    /// Stop (unload) a model's engine on a running server.
    Stop(StopArgs),
    /// Time to first token with a cold and with a cached prompt, prefill and decode rates of
    /// a model on a running server (medians of at least 3 runs).
    Bench(BenchArgs),
    /// Quantize a model to MLX affine 4- or 8-bit on a running server (a managed job: it runs
    /// beside serving, shows its progress, and Ctrl-C cancels it).
    Quantize(QuantizeArgs),
    /// Fine-tune a LoRA adapter on a running server (a managed job, as `mlx_lm.lora --train`):
    /// shows iteration, losses, tokens/s and peak memory; Ctrl-C cancels it, and `--resume`
    /// continues from its last checkpoint.
    Train(Box<TrainArgs>),
    /// Merge a LoRA adapter into its base model: a new model in the store, served by its name
    /// (a managed job, as `mlx_lm.fuse`).
    Fuse(FuseArgs),
    /// Managed jobs of a running server (quantize, convert, fetch); `mlxd jobs cancel ID`
    /// cancels one.
    Jobs(JobsArgs),
    /// LoRA adapters of a model on a running server, loaded and unloaded at run time without
    /// reloading the model: `load MODEL NAME DIR`, `unload MODEL NAME`, `ls MODEL`.
    Adapter(AdapterArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AdapterArgs {
    #[command(subcommand)]
    pub action: AdapterAction,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum AdapterAction {
    /// Load an mlx-lm adapter directory into MODEL's engine (starting it if it is not
    /// running), served as MODEL:NAME and kept across engine restarts until unloaded.
    Load {
        /// A configured model id or alias.
        model: String,
        /// The adapter's name (A-Z a-z 0-9 - _ .).
        name: String,
        /// The adapter directory (adapter_config.json + adapters.safetensors); made absolute
        /// here, since the server reads it.
        dir: PathBuf,
    },
    /// Unload an adapter loaded at run time (refused while requests use it).
    Unload {
        /// A configured model id or alias.
        model: String,
        /// The adapter's name.
        name: String,
    },
    /// The adapters of MODEL: configured ones and those loaded at run time.
    Ls {
        /// A configured model id or alias.
        model: String,
    },
}

#[derive(Debug, Clone, Args)]
pub struct QuantizeArgs {
    /// A model directory, a configured model id, a model in the store or a Hugging Face repo in
    /// the cache (a path is made absolute here: the server reads it).
    pub model: String,
    /// Bits per weight: 4 or 8.
    #[arg(long, default_value_t = mlxd_protocol::jobs::DEFAULT_BITS, value_parser = parse_bits)]
    pub bits: u32,
    /// Weights sharing one scale and bias: 32, 64 or 128.
    #[arg(long, default_value_t = mlxd_protocol::jobs::DEFAULT_GROUP_SIZE, value_parser = parse_group_size)]
    pub group_size: u32,
    /// The new model: a name (a model in the store, served by that name at once) or a
    /// directory path [default: the name <model>-<bits>bit-g<group>]; it must not exist.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the job's id and return at once instead of following it.
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

fn parse_json_object(s: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str(s) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(other) => Err(format!("expected a JSON object, got {other}")),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// `mlxd train`: every hyperparameter defaults to mlx-lm's (`mlx_lm.lora`'s CONFIG_DEFAULTS).
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// The base model: a model directory, a configured model id, a model in the store or a
    /// Hugging Face repo in the cache (a path is made absolute here: the server reads it).
    #[arg(long)]
    pub model: String,
    /// A directory with train.jsonl and valid.jsonl (test.jsonl optional), lines of
    /// `messages` (+ `tools`), `prompt`/`completion` or `text`.
    #[arg(long)]
    pub data: PathBuf,
    /// The adapter: a name (`<home>/adapters/<name>`) or a directory path [default:
    /// <model>-lora]; it must not exist.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Layers to adapt, from the last (-1: all) [default: 16].
    #[arg(long, allow_hyphen_values = true)]
    pub num_layers: Option<i32>,
    /// The rank of each low-rank update [default: 8].
    #[arg(long)]
    pub rank: Option<u32>,
    /// The factor the update is scaled by [default: 20].
    #[arg(long)]
    pub scale: Option<f32>,
    /// Dropout on the update's input while training [default: 0].
    #[arg(long)]
    pub dropout: Option<f32>,
    /// lora or dora [default: lora].
    #[arg(long)]
    pub fine_tune_type: Option<String>,
    /// adam or adamw.
    #[arg(long)]
    pub optimizer: Option<String>,
    /// The learning rate [default: 1e-5].
    #[arg(long)]
    pub learning_rate: Option<f32>,
    /// Examples per training step [default: 4].
    #[arg(long)]
    pub batch_size: Option<u32>,
    /// Training steps [default: 1000].
    #[arg(long)]
    pub iters: Option<u64>,
    /// Validation batches per evaluation (-1: the whole validation set) [default: 25].
    #[arg(long, allow_hyphen_values = true)]
    pub val_batches: Option<i32>,
    /// Training steps between two validation losses [default: 200].
    #[arg(long)]
    pub steps_per_eval: Option<u64>,
    /// Iterations between checkpoints.
    #[arg(long)]
    pub save_every: Option<u64>,
    /// Longest example in tokens; longer ones are cut [default: 2048].
    #[arg(long)]
    pub max_seq_length: Option<u32>,
    /// Seed of the batch order and the factors' initialisation [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// A learning-rate schedule as mlx-lm's config gives it, in JSON:
    /// '{"name": "cosine_decay", "arguments": [1e-5, 1000, 1e-7], "warmup": 100,
    /// "warmup_init": 1e-7}' (cosine_decay, linear_schedule, exponential_decay, step_decay).
    #[arg(long, value_parser = parse_json_object)]
    pub lr_schedule: Option<serde_json::Value>,
    /// Train on completions only (the last assistant message).
    #[arg(long)]
    pub mask_prompt: bool,
    /// Recompute each layer's activations in the backward pass instead of keeping them
    /// (less memory, more time).
    #[arg(long)]
    pub grad_checkpoint: bool,
    /// Continue the cancelled or crashed run of the same --out from its last checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Start from the factors of this adapters.safetensors (mlx-lm's --resume-adapter-file).
    #[arg(long)]
    pub resume_adapter_file: Option<PathBuf>,
    /// Print the job's id and return at once instead of following it.
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

impl TrainArgs {
    /// The hyperparameters as a `lora` request's fields (only those given: the server fills
    /// in mlx-lm's defaults).
    pub fn params_json(&self) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::json;
        let mut m = serde_json::Map::new();
        let mut put = |k: &str, v: Option<serde_json::Value>| {
            if let Some(v) = v {
                m.insert(k.to_string(), v);
            }
        };
        put("num_layers", self.num_layers.map(|v| json!(v)));
        put("rank", self.rank.map(|v| json!(v)));
        put("scale", self.scale.map(|v| json!(v)));
        put("dropout", self.dropout.map(|v| json!(v)));
        put(
            "fine_tune_type",
            self.fine_tune_type.clone().map(|v| json!(v)),
        );
        put("optimizer", self.optimizer.clone().map(|v| json!(v)));
        put("learning_rate", self.learning_rate.map(|v| json!(v)));
        put("batch_size", self.batch_size.map(|v| json!(v)));
        put("iters", self.iters.map(|v| json!(v)));
        put("val_batches", self.val_batches.map(|v| json!(v)));
        put("steps_per_eval", self.steps_per_eval.map(|v| json!(v)));
        put("save_every", self.save_every.map(|v| json!(v)));
        put("max_seq_length", self.max_seq_length.map(|v| json!(v)));
        put("seed", self.seed.map(|v| json!(v)));
        put("mask_prompt", self.mask_prompt.then(|| json!(true)));
        put("grad_checkpoint", self.grad_checkpoint.then(|| json!(true)));
        put("lr_schedule", self.lr_schedule.clone());
        m
    }
}

#[derive(Debug, Clone, Args)]
pub struct FuseArgs {
    /// The base model: a model directory, a configured model id, a model in the store or a
    /// Hugging Face repo in the cache.
    #[arg(long)]
    pub model: String,
    /// The adapter: a name in the store (`mlxd train --out`) or a directory path.
    #[arg(long)]
    pub adapter: PathBuf,
    /// The new model: a name (a model in the store) or a directory path [default:
    /// <model>-<adapter>]; it must not exist.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the job's id and return at once instead of following it.
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Args)]
pub struct JobsArgs {
    #[command(subcommand)]
    pub action: Option<JobsAction>,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum JobsAction {
    /// Cancel a queued or running job: its processes are killed, its partial output removed.
    Cancel {
        /// The job's id, as `mlxd jobs` lists it.
        id: String,
    },
}

/// `mlxd run --help`'s closing text: the chat's commands and the exit codes.
const RUN_HELP: &str = "In the chat: /? help, /bye leave, /clear forget the conversation, /show \
     the model and settings, /set system TEXT, /set temperature|top_p|top_k|seed|max_tokens \
     VALUE, /set verbose|quiet; \"\"\" starts and ends a multi-line message; Ctrl-C stops the \
     answer and keeps the chat; Ctrl-D on an empty line leaves.\n\n\
     Exit codes: 0 done, 1 the server or the model refused or failed, 2 bad usage (flags, \
     empty input, configuration), 3 the server could not be reached.";

#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The server to ask [default: from MLXD_HOST and MLXD_PORT, else from the config file's
    /// [server] host and port, else http://127.0.0.1:8080].
    #[arg(long, env = "MLXD_URL")]
    pub url: Option<String>,
    /// The API key, if the server requires one [default: the config file's first key].
    #[arg(long, env = "MLXD_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The TOML config file `mlxd serve` reads, for the server's host, port and API key
    /// [default: $XDG_CONFIG_HOME/mlxd/mlxd.toml, else ~/.config/mlxd/mlxd.toml, when it
    /// exists].
    #[arg(long, env = "MLXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Seconds to wait for the server: to connect, for a whole answer, and between two
    /// chunks of a stream.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub timeout: u64,
}

impl ClientArgs {
    /// The server these flags name, found as `mlxd serve` would find its address:
    /// `--url`/`MLXD_URL`, else `MLXD_HOST` (with or without a port) and `MLXD_PORT` over the
    /// config file's `[server]` host and port, over `127.0.0.1:8080`. A config file that
    /// `--config`/`MLXD_CONFIG` names must be readable; the default one only when it exists.
    pub fn target(&self) -> Result<crate::client::Target, ConfigError> {
        let url = self.url.as_deref().filter(|u| !u.trim().is_empty());
        let path = self.config.clone().or_else(default_config_path);
        // With a URL the config is not needed for the address, only for a key.
        let config = match (&path, url.is_some() && self.api_key.is_some()) {
            (Some(p), false) => Some((p.clone(), Config::from_toml_file(p)?)),
            _ => None,
        };
        let host = std::env::var("MLXD_HOST").ok();
        let port = std::env::var("MLXD_PORT").ok();
        let from_file = config
            .as_ref()
            .map(|(p, c)| (p.as_path(), c.server.host.as_str(), c.server.port));
        let (url, from) =
            crate::client::resolve_url(url, host.as_deref(), port.as_deref(), from_file)
                .map_err(|m| flag("MLXD_HOST/MLXD_PORT", m))?;
        let api_key = match (&self.api_key, &config) {
            (Some(k), _) => Some(k.clone()),
            (None, Some((_, c))) => c.api_keys()?.into_iter().next(),
            (None, None) => None,
        };
        Ok(crate::client::Target {
            url,
            from,
            api_key,
            timeout: Duration::from_secs(self.timeout),
        })
    }
}

#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// The model store [default: $MLXD_HOME, else ~/.cache/mlxd].
    #[arg(long, env = "MLXD_HOME")]
    pub home: Option<PathBuf>,
}

impl StoreArgs {
    pub fn options(&self) -> Result<mlxd_store::StoreOptions, mlxd_store::StoreError> {
        let home = match &self.home {
            Some(h) => h.clone(),
            None => mlxd_store::default_home()?,
        };
        Ok(mlxd_store::StoreOptions::from_env(&home))
    }
}

#[derive(Debug, Clone, Args)]
pub struct PullArgs {
    /// A known name (smollm2-135m), a .gguf file, a model directory or a Hugging Face repo id.
    pub model: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct PsArgs {
    /// Everything the server reports about each model, as JSON (full failure texts).
    #[arg(long)]
    pub json: bool,
    /// Every configured model, with a failed one's whole reason instead of its first words.
    #[arg(long, short)]
    pub verbose: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Args)]
pub struct LsArgs {
    /// List the configured models of a running server instead of the local store.
    #[arg(long)]
    pub server: bool,
    /// With --server: a failed model's whole reason instead of its first words.
    #[arg(long, short)]
    pub verbose: bool,
    /// With --server: the server's report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// A name as `mlxd ls` shows it, a model directory, a converted .gguf file or a Hugging
    /// Face repo id in the cache.
    pub model: String,
    /// Print the chat template itself too.
    #[arg(long)]
    pub template: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct RmArgs {
    /// A name as `mlxd ls` shows it, a Hugging Face repo id, or a .gguf file whose
    /// conversions to delete.
    pub model: String,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// A model id or alias of the server (`mlxd ls --server` lists them) [default: the
    /// server's default model].
    pub model: Option<String>,
    /// The question; without it and without piped input, an interactive chat on the terminal.
    pub prompt: Option<String>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy) [default: the server's].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Keep only the K most likely tokens.
    #[arg(long)]
    pub top_k: Option<i64>,
    /// Seed for sampling, for repeatable answers.
    #[arg(long)]
    pub seed: Option<i64>,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// After each answer, print prompt and answer token counts, time to first token, and the
    /// prefill and decode rates (on stderr).
    #[arg(long)]
    pub verbose: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Args)]
pub struct StopArgs {
    /// A model id or alias of the server.
    pub model: String,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// A model id or alias of the server.
    pub model: String,
    /// Runs to time, one after another, each a cold prompt then the same prompt cached (a
    /// first, untimed request warms the engine up); the medians need at least 3.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..=1000))]
    pub requests: u32,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// The prompt.
    #[arg(long, default_value = "Write a short story about a lighthouse keeper.")]
    pub prompt: String,
    #[command(flatten)]
    pub client: ClientArgs,
}

#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// A model to serve (repeatable): a known name, a model directory, a .gguf file or a
    /// Hugging Face repo id. Added to the models of the config file.
    #[arg(long)]
    pub model: Vec<String>,
    /// Scan this directory for models (subdirectories with config.json, *.gguf).
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Where requests without a model go [default: the first model].
    #[arg(long)]
    pub default_model: Option<String>,
    /// At most this many engines at once [default: 4].
    #[arg(long)]
    pub max_engines: Option<usize>,
    /// Memory all engines may use, e.g. 24GiB [default: physical memory minus 2 GiB].
    // Sizes and durations are parsed in `into_config`, not by clap, so that a bad value
    // exits 64 (EX_USAGE) naming the flag, like a bad config file.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// Idle time before an engine is stopped, e.g. 5m; 0 = never [default: 5m].
    #[arg(long)]
    pub ttl: Option<String>,
    /// Keep a standby engine per model (weights loaded, waiting): a crashed engine's
    /// streams continue on it at once. Counts twice against the memory budget.
    #[arg(long)]
    pub standby: bool,
    /// Address to bind [default: 127.0.0.1].
    #[arg(long, env = "MLXD_HOST")]
    pub host: Option<String>,
    /// Port to bind [default: 8080].
    #[arg(long, env = "MLXD_PORT")]
    pub port: Option<u16>,
    /// TOML config file; flags override it [default: $XDG_CONFIG_HOME/mlxd/mlxd.toml, else
    /// ~/.config/mlxd/mlxd.toml, when it exists].
    #[arg(long, env = "MLXD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log lines as text, or one JSON object per line.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Engine binary [default: mlxd-engine beside mlxd].
    #[arg(long)]
    pub engine_bin: Option<PathBuf>,
    /// An engine option as `key=value` (repeatable): the escape hatch beside the flags
    /// below, checked by the same rules (for mlxd-engine; a substitute `--engine-bin`
    /// takes its own).
    #[arg(long = "engine-opt", value_parser = parse_kv)]
    pub engine_opts: Vec<(String, String)>,
    /// Sequences an engine decodes together in one forward pass; more wait in line
    /// [default: 64].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_batch_size: Option<u32>,
    /// The engine's options, the same flags as `mlxd-engine`'s
    /// (`mlxd_protocol::engine_options`); they go to every engine, over the config file's
    /// `[server.engine_options]` and `--engine-opt`.
    #[command(flatten, next_help_heading = "Engine options")]
    pub engine: mlxd_protocol::engine_options::EngineOptions,
    /// Largest routed request body in bytes [default: 33554432].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Shutdown grace period in milliseconds [default: 10000].
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// Client connections served at once [default: 1024, fewer under a low ulimit -n].
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Connections one client IP may hold [default: half of --max-connections].
    #[arg(long)]
    pub max_connections_per_client: Option<usize>,
    /// Time for a client to send its request headers, in ms [default: 30000].
    #[arg(long)]
    pub header_timeout_ms: Option<u64>,
    /// Time for a client to send a JSON request body, in ms (408 after) [default: 30000].
    #[arg(long)]
    pub body_timeout_ms: Option<u64>,
    /// Requests in flight per model; more get 429 [default: 256].
    #[arg(long)]
    pub max_in_flight_per_model: Option<u32>,
    /// Largest max_tokens a request may ask for [default: 131072].
    #[arg(long)]
    pub max_tokens_limit: Option<u64>,
    /// An API key clients must send (repeatable); `/health*` stays open.
    #[arg(long = "api-key")]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// The key for /admin/* and /engines/reset.
    #[arg(long)]
    pub admin_api_key: Option<String>,
    /// An origin allowed cross-origin (CORS), e.g. http://localhost:3000 (repeatable).
    #[arg(long = "allowed-origin")]
    pub allowed_origins: Vec<String>,
    /// A host name accepted in the Host header besides loopback names (repeatable).
    #[arg(long = "allowed-host")]
    pub allowed_hosts: Vec<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The config file read when `--config` and `MLXD_CONFIG` name none: `mlxd/mlxd.toml` under
/// `$XDG_CONFIG_HOME`, else under `$HOME/.config`; `None` when that file does not exist.
pub fn default_config_path() -> Option<PathBuf> {
    default_config_path_from(
        std::env::var_os("XDG_CONFIG_HOME"),
        std::env::var_os("HOME"),
    )
    .filter(|p| p.is_file())
}

/// [`default_config_path`] before the existence check, as a pure function.
pub fn default_config_path_from(
    xdg_config_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    let base = match xdg_config_home.filter(|x| !x.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(home.filter(|h| !h.is_empty())?).join(".config"),
    };
    Some(base.join("mlxd").join("mlxd.toml"))
}

/// A bad flag value, named like a config field.
fn flag(name: &str, message: String) -> ConfigError {
    ConfigError::Setting {
        field: name.to_string(),
        message,
    }
}

fn parse_choice(s: &str, allowed: &[u32]) -> Result<u32, String> {
    s.parse::<u32>()
        .ok()
        .filter(|v| allowed.contains(v))
        .ok_or_else(|| {
            let list: Vec<String> = allowed.iter().map(u32::to_string).collect();
            format!("expected one of {}, got {s:?}", list.join(", "))
        })
}

fn parse_bits(s: &str) -> Result<u32, String> {
    parse_choice(s, mlxd_protocol::jobs::BITS)
}

fn parse_group_size(s: &str) -> Result<u32, String> {
    parse_choice(s, mlxd_protocol::jobs::GROUP_SIZES)
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

impl Cli {
    /// The effective serve flags (`mlxd` alone means `mlxd serve`); `None` for the
    /// client commands.
    pub fn serve_args(self) -> Option<ServeArgs> {
        match self.command {
            Some(Command::Serve(a)) => Some(*a),
            None => Some(self.serve),
            Some(_) => None,
        }
    }
}

impl ServeArgs {
    /// Defaults, then the config file, then these flags.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        // The file's text is kept to name lines in the engine options' errors, checked
        // last: `--engine-bin` may make them another engine's.
        let file = match self.config.clone().or_else(default_config_path) {
            Some(path) => Some((
                std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?,
                path.display().to_string(),
            )),
            None => None,
        };
        let source = file
            .as_ref()
            .map(|(text, name)| (text.as_str(), name.as_str()));
        let mut c = match source {
            Some((text, name)) => Config::from_toml_str(text, name)?,
            None => Config::default(),
        };
        for m in &self.model {
            let flag = ModelConfig::from_flag(m);
            if !c.models.iter().any(|x| x.id == flag.id) {
                c.models.push(flag);
            }
        }
        if let Some(d) = self.models_dir {
            c.pool.models_dir = Some(d);
        }
        if let Some(d) = self.default_model {
            c.pool.default_model = Some(d);
        }
        if let Some(n) = self.max_engines {
            c.pool.max_engines = n;
        }
        if let Some(b) = &self.memory_budget {
            c.pool.memory_budget = Some(parse_bytes(b).map_err(|m| flag("--memory-budget", m))?);
        }
        if let Some(t) = &self.ttl {
            c.pool.ttl = parse_duration(t).map_err(|m| flag("--ttl", m))?;
        }
        if self.standby {
            c.pool.standby = true;
            for m in &mut c.models {
                m.standby = Some(true);
            }
        }
        if let Some(h) = self.host {
            // `MLXD_HOST=127.0.0.1:8096` carries the port too (as the client verbs read it);
            // an explicit `--port`/`MLXD_PORT` still wins.
            let (host, port) =
                crate::client::split_host_port(&h).map_err(|m| flag("--host/MLXD_HOST", m))?;
            c.server.host = host;
            if let Some(p) = port {
                c.server.port = p;
            }
        }
        if let Some(p) = self.port {
            c.server.port = p;
        }
        if let Some(b) = self.engine_bin {
            c.server.engine_bin = Some(b);
        }
        c.server.engine_options.extend(self.engine_opts);
        c.server.engine_options.extend(self.engine.to_map());
        if let Some(n) = self.max_batch_size {
            c.server.limits.max_batch_size = Some(n);
        }
        if let Some(m) = self.max_body_bytes {
            c.server.max_body_bytes = m;
        }
        if let Some(g) = self.grace_ms {
            c.server.grace_ms = g;
        }
        if let Some(n) = self.max_connections {
            c.server.max_connections = Some(n);
        }
        if let Some(n) = self.max_connections_per_client {
            c.server.max_connections_per_client = Some(n);
        }
        if let Some(t) = self.header_timeout_ms {
            c.server.header_timeout_ms = t;
        }
        if let Some(t) = self.body_timeout_ms {
            c.server.body_timeout_ms = t;
        }
        if let Some(n) = self.max_in_flight_per_model {
            c.server.max_in_flight_per_model = n;
        }
        if let Some(n) = self.max_tokens_limit {
            c.server.max_tokens_limit = Some(n);
        }
        c.server
            .api_keys
            .extend(self.api_keys.into_iter().map(crate::config::Secret));
        if let Some(f) = self.api_key_file {
            c.server.api_key_file = Some(f);
        }
        if let Some(k) = self.admin_api_key {
            c.server.admin_api_key = Some(crate::config::Secret(k));
        }
        c.server.allowed_origins.extend(self.allowed_origins);
        c.server.allowed_hosts.extend(self.allowed_hosts);
        c.api_keys()?;
        c.validate_settings(None)?;
        c.validate_engine_options(source)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;

    fn config(args: &[&str]) -> Result<Config, ConfigError> {
        Cli::parse_from(args).serve_args().unwrap().into_config()
    }

    #[test]
    fn bare_mlxd_is_serve_with_defaults() {
        let c = config(&["mlxd"]).unwrap();
        let cat = Catalog::from_config(&c).unwrap();
        assert_eq!(cat.ids(), ["smollm2-135m"]);
        assert_eq!((c.server.host.as_str(), c.server.port), ("127.0.0.1", 8080));
    }

    /// Issue 22.2: the engine's options are `mlxd serve` flags of their own, checked at flag
    /// parsing (a value) or config load (a combination, `--engine-opt`), naming the option.
    #[test]
    fn engine_flags_are_first_class_and_checked() {
        let c = config(&[
            "mlxd",
            "--engine-opt",
            "kv_bits=8",
            "--kv-bits",
            "4",
            "--kv-group-size",
            "32",
            "--quantized-kv-start",
            "256",
            "--prompt-cache",
            "0.5",
            "--draft",
            "ngram",
            "--num-draft-tokens",
            "4",
            "--ngram-max",
            "5",
            "--ssd-cache",
            "/tmp/kv",
            "--ssd-cache-max",
            "2",
            "--ssd-demote-idle",
            "30",
            "--generation-checkpoint",
            "64",
            "--max-batch-size",
            "4",
        ])
        .unwrap();
        let options: Vec<(&str, &str)> = c
            .server
            .engine_options
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            options,
            [
                ("draft", "ngram"),
                ("generation_checkpoint", "64"),
                ("kv_bits", "4"),
                ("kv_group_size", "32"),
                ("ngram_max", "5"),
                ("num_draft_tokens", "4"),
                ("prompt_cache", "0.5"),
                ("quantized_kv_start", "256"),
                ("ssd_cache", "/tmp/kv"),
                ("ssd_cache_max", "2"),
                ("ssd_demote_idle", "30"),
            ]
        );
        assert_eq!(c.server.limits.max_batch_size, Some(4));
        let c = config(&["mlxd", "--draft-model", "smollm2-135m"]).unwrap();
        assert_eq!(c.server.engine_options["draft_model"], "smollm2-135m");

        for (args, needle) in [
            (&["--kv-bits", "3"][..], "expected 4 or 8"),
            (&["--num-draft-tokens", "17"][..], "from 1 to 16"),
            (&["--prompt-cache=-1"][..], "expected GiB between 0 and"),
            (&["--max-batch-size", "0"][..], "--max-batch-size"),
        ] {
            let argv: Vec<&str> = ["mlxd"].iter().chain(args).copied().collect();
            let e = Cli::try_parse_from(argv).unwrap_err().to_string();
            let flag = args[0].split('=').next().unwrap_or_default();
            assert!(e.contains(flag) && e.contains(needle), "{args:?}: {e}");
        }
        for (args, needle) in [
            (
                &["--kv-group-size", "32"][..],
                "server.engine_options.kv_group_size: needs kv_bits",
            ),
            (
                &["--draft", "ngram", "--draft-model", "m"][..],
                "draft_model: draft = \"ngram\" and draft_model exclude each other",
            ),
            (&["--generation-checkpoint", "8"][..], "needs ssd_cache"),
            (
                &["--engine-opt", "kv_bits=3"][..],
                "expected 4 or 8 (got \"3\")",
            ),
            (
                &["--engine-opt", "speculative=yes"][..],
                "server.engine_options.speculative: unknown option",
            ),
        ] {
            let argv: Vec<&str> = ["mlxd"].iter().chain(args).copied().collect();
            let e = config(&argv).unwrap_err().to_string();
            assert!(e.contains(needle), "{args:?}: {e}");
        }
        // A config file's options are checked with the engine the flags choose: a fake
        // engine's script options pass, a bad one for mlxd-engine names its line.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("mlxd.toml");
        std::fs::write(&file, "[server.engine_options]\nchunks = \"3\"\n").unwrap();
        let path = file.to_str().unwrap();
        assert!(config(&["mlxd", "--config", path, "--engine-bin", "/opt/fake-engine"]).is_ok());
        let e = config(&["mlxd", "--config", path]).unwrap_err().to_string();
        assert!(
            e.contains("mlxd.toml:2:1: server.engine_options.chunks: unknown option"),
            "{e}"
        );
        // A substitute engine takes its own options.
        let c = config(&[
            "mlxd",
            "--engine-bin",
            "/opt/fake-engine",
            "--engine-opt",
            "chunks=3",
        ]);
        assert_eq!(c.unwrap().server.engine_options["chunks"], "3");
    }

    #[test]
    fn serve_flags() {
        let c = config(&[
            "mlxd",
            "serve",
            "--model",
            "a",
            "--model",
            "org/b",
            "--port",
            "9",
            "--engine-opt",
            "kv_bits=8",
            "--max-engines",
            "1",
            "--memory-budget",
            "2GiB",
            "--ttl",
            "30s",
            "--default-model",
            "org/b",
        ])
        .unwrap();
        let ids: Vec<&str> = c.models.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["a", "org/b"]);
        assert_eq!(c.server.port, 9);
        assert_eq!(c.server.engine_options["kv_bits"], "8");
        assert_eq!(c.pool.max_engines, 1);
        assert_eq!(c.pool.memory_budget, Some(2 << 30));
        assert_eq!(c.pool.ttl, std::time::Duration::from_secs(30));
        assert_eq!(Catalog::from_config(&c).unwrap().default_model, "org/b");
        assert!(config(&["mlxd", "--model", "a", "--default-model", "zzz"]).is_err());
        assert!(config(&["mlxd", "--max-engines", "0"]).is_err());
        // --standby: every model keeps a spare engine.
        let c = config(&["mlxd", "--model", "a", "--standby"]).unwrap();
        assert!(c.pool.standby);
        assert!(Catalog::from_config(&c)
            .unwrap()
            .models
            .iter()
            .all(|m| m.standby));
        let c = config(&["mlxd", "--model", "a"]).unwrap();
        assert!(!Catalog::from_config(&c).unwrap().models[0].standby);
    }

    #[test]
    fn out_of_range_flags_are_config_errors_naming_the_flag() {
        let e = config(&["mlxd", "--ttl", "99999999999999999999h"]).unwrap_err();
        assert!(e.to_string().starts_with("--ttl: duration"), "{e}");
        let e = config(&["mlxd", "--memory-budget", "99999999999999999999GiB"]).unwrap_err();
        assert!(e.to_string().starts_with("--memory-budget: size"), "{e}");
        let e = config(&["mlxd", "--grace-ms", "18446744073709551615"]).unwrap_err();
        assert!(e.to_string().starts_with("server.grace_ms"), "{e}");
    }

    #[test]
    fn serve_takes_a_port_inside_the_host() {
        let c = config(&["mlxd", "--host", "127.0.0.1:8096"]).unwrap();
        assert_eq!((c.server.host.as_str(), c.server.port), ("127.0.0.1", 8096));
        let c = config(&["mlxd", "--host", "[::1]:9", "--port", "7"]).unwrap();
        assert_eq!((c.server.host.as_str(), c.server.port), ("[::1]", 7));
        let c = config(&["mlxd", "--host", "::1"]).unwrap();
        assert_eq!((c.server.host.as_str(), c.server.port), ("::1", 8080));
        let e = config(&["mlxd", "--host", "h:port"]).unwrap_err();
        assert!(e.to_string().contains("\"port\""), "{e}");
    }

    #[test]
    fn default_config_path_follows_xdg() {
        let p = default_config_path_from(Some("/x".into()), Some("/home/u".into()));
        assert_eq!(p, Some(PathBuf::from("/x/mlxd/mlxd.toml")));
        let p = default_config_path_from(Some("".into()), Some("/home/u".into()));
        assert_eq!(p, Some(PathBuf::from("/home/u/.config/mlxd/mlxd.toml")));
        assert_eq!(default_config_path_from(None, None), None);
    }

    #[test]
    fn every_verb_parses_and_every_flag_has_help() {
        use clap::CommandFactory;
        let cmd = Cli::command();
        cmd.clone().debug_assert();
        for sub in cmd.get_subcommands() {
            assert!(sub.get_about().is_some(), "{} has no help", sub.get_name());
            for arg in sub.get_arguments() {
                assert!(
                    arg.get_help().is_some() || arg.get_id() == "help",
                    "mlxd {} {} has no help",
                    sub.get_name(),
                    arg.get_id()
                );
            }
        }
        let cli = Cli::parse_from(["mlxd", "run", "m", "hi there", "--max-tokens", "5"]);
        assert!(
            matches!(&cli.command, Some(Command::Run(r)) if r.prompt.as_deref() == Some("hi there") && r.max_tokens == 5)
        );
        assert!(matches!(
            Cli::parse_from(["mlxd", "pull", "org/x"]).command,
            Some(Command::Pull(p)) if p.model == "org/x"
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "stop", "m", "--timeout", "3"]).command,
            Some(Command::Stop(s)) if s.client.timeout == 3
        ));
        assert!(Cli::try_parse_from(["mlxd", "ps", "--timeout", "0"]).is_err());
        assert!(matches!(
            Cli::parse_from(["mlxd", "bench", "m", "--requests", "4"]).command,
            Some(Command::Bench(b)) if b.requests == 4
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "adapter", "load", "m", "sql", "/d/sql"]).command,
            Some(Command::Adapter(AdapterArgs { action: AdapterAction::Load { model, name, dir }, .. }))
                if model == "m" && name == "sql" && dir == std::path::Path::new("/d/sql")
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "adapter", "unload", "m", "sql"]).command,
            Some(Command::Adapter(AdapterArgs {
                action: AdapterAction::Unload { .. },
                ..
            }))
        ));
        assert!(Cli::try_parse_from(["mlxd", "adapter", "ls"]).is_err());
        assert!(matches!(
            Cli::parse_from(["mlxd", "rm", "m"]).command,
            Some(Command::Rm(_))
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "--log-format", "json"])
                .serve
                .log_format,
            LogFormat::Json
        ));
    }

    #[test]
    fn client_commands() {
        let cli = Cli::parse_from(["mlxd", "ps", "--url", "http://h:1", "--api-key", "k"]);
        assert!(
            matches!(&cli.command, Some(Command::Ps(a)) if a.client.target().unwrap().url == "http://h:1")
        );
        assert!(cli.serve_args().is_none());
        assert!(matches!(
            Cli::parse_from(["mlxd", "ls"]).command,
            Some(Command::Ls(_))
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "list", "--server"]).command,
            Some(Command::Ls(a)) if a.server
        ));
        assert!(matches!(
            Cli::parse_from(["mlxd", "run"]).command,
            Some(Command::Run(r)) if r.model.is_none() && r.prompt.is_none()
        ));
        assert!(Cli::try_parse_from(["mlxd", "bench", "m", "--requests", "2"]).is_err());
    }

    #[test]
    fn flags_override_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mlxd.toml");
        std::fs::write(
            &path,
            "[server]\nport = 7000\nmax_body_bytes = 100\n[server.engine_options]\nkv_bits = \"8\"\n[[model]]\nid = \"from-file\"\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let c = config(&[
            "mlxd", "serve", "--config", p, "--port", "7001", "--model", "m2",
        ])
        .unwrap();
        let ids: Vec<&str> = c.models.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["from-file", "m2"]);
        assert_eq!(c.server.port, 7001);
        assert_eq!(c.server.max_body_bytes, 100);
        assert_eq!(c.server.engine_options["kv_bits"], "8");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[server]\nport = \"x\"").unwrap();
        let err = config(&["mlxd", "--config", bad.to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("bad.toml:2:"), "{err}");
    }
}
