//! Runtime configuration: defaults, then `mlxd.toml`, then command-line flags.
//! `proxy/mlxd.example.toml` shows every section.
//!
//! ```toml
//! [server]                      # listener, engine binary, timeouts (durations in ms: *_ms)
//! port = 8080
//! [pool]
//! default_model = "small"       # default: the first model
//! max_engines = 2
//! memory_budget = "24GiB"       # default: physical memory minus memory_reserve
//! ttl = "5m"                    # idle unload; 0 = never
//! models_dir = "/srv/models"    # every subdirectory with config.json, every *.gguf
//! store_models = true           # serve the store's models (`mlxd ls`) by name
//! [[model]]
//! id = "small"
//! path = "/srv/models/SmolLM2"  # directory, .gguf, known name or Hugging Face repo id
//! aliases = ["gpt-3.5-turbo"]
//! pinned = true
//! context_length = 4096
//! [[model]]                     # a LoRA adapter served by "small"'s engine as "sql"
//! id = "sql"
//! base = "small"
//! adapter = "/srv/adapters/sql"
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mlxd_protocol::control::Limits;
use mlxd_protocol::engine_options::{EngineOptions, OptionError, DISTRIBUTED_BACKENDS};
use mlxd_protocol::group_hosts::{self, check_hosts, GroupHost};
use serde::de::{self, Deserializer};
use serde::Deserialize;

/// The model served when none is configured; the store defines it (and knows how to fetch it).
pub use mlxd_store::DEFAULT_MODEL;

/// The exit code for an unusable configuration (`EX_USAGE`).
pub const EXIT_CONFIG: i32 = 64;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A bad value or a broken file, with where it is.
    #[error("{file}:{line}:{column}: {field}: {message}")]
    Invalid {
        file: String,
        line: usize,
        column: usize,
        field: String,
        message: String,
    },
    /// A problem that is not tied to one line (flags, `models_dir`).
    #[error("{field}: {message}")]
    Setting { field: String, message: String },
}

/// Everything `serve` needs.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub pool: PoolConfig,
    /// `[[model]]` entries.
    #[serde(rename = "model")]
    pub models: Vec<ModelConfig>,
}

/// `[server]`: the listener, the engine binary and the supervisor's timing.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// The engine binary; default: `mlxd-engine` beside the running `mlxd`.
    pub engine_bin: Option<PathBuf>,
    /// Extra arguments after `--control` (tests; normally empty).
    pub engine_args: Vec<String>,
    /// Extra environment for engines, on top of the explicit base set.
    pub engine_env: BTreeMap<String, String>,
    /// `Launch.options` for every engine (a model's `options` add to them): mlxd-engine's
    /// options (`mlxd_protocol::engine_options::KEYS`), checked at load, or a substitute
    /// engine's own.
    pub engine_options: BTreeMap<String, String>,
    /// Engine limits for models that set none of their own.
    pub limits: LimitsConfig,
    /// Where engine sockets live; default `$XDG_RUNTIME_DIR/mlxd-<pid>` (created 0700).
    pub runtime_dir: Option<PathBuf>,
    /// Largest request body routed to an engine (413 above it).
    pub max_body_bytes: usize,
    /// Requests that may wait for one model's engine to start.
    pub queue_capacity: usize,
    /// How long a queued request waits before a 503 with `Retry-After`.
    pub queue_timeout_ms: u64,
    /// First restart delay; doubles per consecutive crash up to `backoff_max_ms`.
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// `crash_limit` crashes within `crash_window_ms` mark the model failed.
    pub crash_limit: usize,
    pub crash_window_ms: u64,
    /// A failed model is retried on the next request after this long.
    pub failed_cooldown_ms: u64,
    /// Limits halved after out-of-memory exits return to the configured ones after this
    /// long without another (default 10 minutes).
    pub limits_recovery_ms: u64,
    /// Shutdown: time for in-flight requests, then for engines after `Shutdown`, then
    /// after SIGTERM (SIGKILL follows).
    pub grace_ms: u64,
    /// Time to wait for the first request line and headers on a client connection
    /// (the connection is closed after it).
    pub header_timeout_ms: u64,
    /// Time to wait for a whole JSON request body once its headers are in (408 after).
    pub body_timeout_ms: u64,
    /// Client connections served at once; at the cap mlxd stops accepting (new clients
    /// wait in the kernel's backlog). Default: 1024, fewer under a low open-file limit.
    pub max_connections: Option<usize>,
    /// Connections one client (peer IP) may hold at once; past it, its own oldest
    /// connection still waiting for a request head is replaced, or the new one is closed.
    /// Default: half of `max_connections`. Behind a reverse proxy every client has the
    /// proxy's address: set it to `max_connections` there.
    pub max_connections_per_client: Option<usize>,
    /// Requests in flight to one model's engine at once; more get 429 with Retry-After.
    pub max_in_flight_per_model: u32,
    /// Largest `max_tokens` (or `max_completion_tokens`) a request may ask for (400 above).
    pub max_tokens_limit: Option<u64>,
    /// An engine not ready this long after spawning is killed (a load failure).
    pub load_timeout_ms: u64,
    /// A ready engine that sends no `Stats` (it sends one a second) for this long is
    /// hung: it is killed and treated as crashed. 0 disables the check.
    pub hang_timeout_ms: u64,
    /// How many times one generation request is continued on a restarted engine after
    /// its engine died (transparent resumption); 0 disables resumption.
    pub max_resumes: u32,
    /// API keys (any one opens every route but `/health*`, which is always open). Empty,
    /// with no `api_key_file` and no `admin_api_key`: no authentication.
    pub api_keys: Vec<Secret>,
    /// A file with one API key per line (`#` comments and blank lines ignored).
    pub api_key_file: Option<PathBuf>,
    /// The key for `/admin/*` and `/engines/reset` (API keys do not open them when set).
    pub admin_api_key: Option<Secret>,
    /// Origins (`http://host:port`) allowed cross-origin (CORS); any other `Origin` is
    /// refused with 403.
    pub allowed_origins: Vec<String>,
    /// Host names accepted in `Host` besides the loopback names and the bound address.
    pub allowed_hosts: Vec<String>,
}

/// A credential: deserialized like a string, never printed by `Debug`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// `[pool]`: which engines run, and for how long.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Where requests without a `model` go; default: the first model.
    pub default_model: Option<String>,
    /// Unknown model names go to the default model instead of a 404.
    pub route_unknown_to_default: bool,
    /// At most this many engine processes at once.
    pub max_engines: usize,
    /// Memory all engines together may use; default: physical memory minus the reserve.
    #[serde(deserialize_with = "de_opt_bytes")]
    pub memory_budget: Option<u64>,
    /// Kept free for everything else when the budget is derived from physical memory.
    #[serde(deserialize_with = "de_bytes")]
    pub memory_reserve: u64,
    /// Idle time after which an engine is stopped (a model's `ttl` overrides); 0 = never.
    #[serde(deserialize_with = "de_duration")]
    pub ttl: Duration,
    /// How long a request waits for busy engines to finish so that its model fits.
    #[serde(deserialize_with = "de_duration")]
    pub capacity_wait: Duration,
    /// Scanned at start: each subdirectory with a `config.json`, and each `*.gguf`.
    pub models_dir: Option<PathBuf>,
    /// Serve the models of the store (`mlxd ls`: pulled, quantized, converted, the Hugging
    /// Face cache) by name without a `[[model]]` entry; a configured model of the same name
    /// wins.
    pub store_models: bool,
    /// Every model keeps a standby engine (a model's `standby` overrides).
    pub standby: bool,
}

/// One `[[model]]` entry.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients send as `model`.
    pub id: String,
    /// A model directory, a `.gguf` file, a known name or a Hugging Face repo id, passed
    /// to the engine as `Launch.model`; default: the id.
    pub path: Option<String>,
    pub aliases: Vec<String>,
    /// Loaded at start and never evicted.
    pub pinned: bool,
    /// Keep a spare engine with the weights loaded beside the serving one, so that a crash
    /// is followed at once by the spare serving (the memory budget counts both).
    pub standby: Option<bool>,
    #[serde(deserialize_with = "de_opt_duration")]
    pub ttl: Option<Duration>,
    /// Memory to plan for before the engine reports its own; default: weights on disk.
    #[serde(deserialize_with = "de_opt_bytes")]
    pub memory: Option<u64>,
    pub max_batch_size: Option<u32>,
    #[serde(deserialize_with = "de_opt_bytes")]
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<u32>,
    /// Extra `Launch.options` for this model's engine.
    pub options: BTreeMap<String, String>,
    /// One model divided among several engine processes (an engine group, through MLX
    /// distributed): `distributed = { backend = "ring", hosts = ["127.0.0.1", "127.0.0.1"],
    /// mode = "tensor" }`, one host per rank.
    pub distributed: Option<DistributedConfig>,
    /// With `base`: this entry is a LoRA adapter (an mlx-lm adapter directory) served by the
    /// base model's engine under this entry's id, not a model of its own (see
    /// [`ModelConfig::is_adapter`]).
    pub adapter: Option<PathBuf>,
    /// The id or alias of the model whose engine serves `adapter`.
    pub base: Option<String>,
}

/// A model's `distributed` entry: its engine group.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedConfig {
    /// The MLX distributed backend: `ring`, `jaccl` or `nccl`.
    pub backend: String,
    /// One host per rank, rank 0 first (which serves, on this machine): `mlx.launch`
    /// hostfile entries, a name or `{ ssh, ips, rdma, port, engine, model, ssh_options }`
    /// (`mlxd_protocol::group_hosts`); ranks on other machines are started through `ssh`.
    #[serde(deserialize_with = "mlxd_protocol::group_hosts::deserialize_hosts")]
    pub hosts: Vec<GroupHost>,
    /// `tensor` (each layer divided among the ranks) or `pipeline` (layers divided).
    #[serde(default = "tensor_mode")]
    pub mode: String,
}

fn tensor_mode() -> String {
    "tensor".into()
}

impl DistributedConfig {
    /// What cannot work, as `(key, reason)`: an unknown backend or mode, fewer than two hosts,
    /// hosts the backend cannot reach (for jaccl, RDMA device lists that do not join every
    /// pair of ranks), and ranks mlxd cannot start.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !DISTRIBUTED_BACKENDS.contains(&self.backend.as_str()) {
            return Err((
                "backend",
                format!(
                    "unknown backend {:?}: expected one of {}",
                    self.backend,
                    DISTRIBUTED_BACKENDS.join(", ")
                ),
            ));
        }
        // Which families a mode can divide is the engine's to say, at load, naming the family.
        if !["tensor", "pipeline"].contains(&self.mode.as_str()) {
            return Err((
                "mode",
                format!(
                    "unknown mode {:?}: expected \"tensor\" or \"pipeline\"",
                    self.mode
                ),
            ));
        }
        check_hosts(&self.hosts).map_err(|e| ("hosts", e))?;
        match self.backend.as_str() {
            // Every rank needs an address the others reach it at.
            "ring" => group_hosts::check_ring(&self.hosts).map_err(|e| ("hosts", e))?,
            // Every host lists its RDMA device towards every other, and the others reach
            // rank 0, the coordinator.
            "jaccl" => group_hosts::jaccl::check(&self.hosts).map_err(|e| ("hosts", e))?,
            _ => {
                if let Some(h) = self.hosts.iter().skip(1).find(|h| !h.is_local()) {
                    return Err((
                        "hosts",
                        format!(
                            "{:?}: mlxd starts {} groups on this machine only (one GPU per \
                             rank); ranks on other machines need the ring backend",
                            h.ssh, self.backend
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    pub max_batch_size: Option<u32>,
    #[serde(deserialize_with = "de_opt_bytes")]
    pub kv_budget_bytes: Option<u64>,
    pub context_length: Option<u32>,
}

impl From<&LimitsConfig> for Limits {
    fn from(l: &LimitsConfig) -> Self {
        Limits {
            max_batch_size: l.max_batch_size,
            kv_budget_bytes: l.kv_budget_bytes,
            context_length: l.context_length,
        }
    }
}

impl ServerConfig {
    /// Whether engines are `mlxd-engine` (no `engine_bin`, or one of that name), whose
    /// options [`Config::validate`] checks.
    pub fn runs_mlxd_engine(&self) -> bool {
        self.engine_bin
            .as_deref()
            .is_none_or(|b| b.file_name().is_some_and(|n| n == "mlxd-engine"))
    }

    /// Every `*_ms` setting with its key, for range checks.
    fn durations_ms(&self) -> [(&'static str, u64); 11] {
        [
            ("queue_timeout_ms", self.queue_timeout_ms),
            ("backoff_initial_ms", self.backoff_initial_ms),
            ("backoff_max_ms", self.backoff_max_ms),
            ("crash_window_ms", self.crash_window_ms),
            ("failed_cooldown_ms", self.failed_cooldown_ms),
            ("limits_recovery_ms", self.limits_recovery_ms),
            ("grace_ms", self.grace_ms),
            ("header_timeout_ms", self.header_timeout_ms),
            ("body_timeout_ms", self.body_timeout_ms),
            ("load_timeout_ms", self.load_timeout_ms),
            ("hang_timeout_ms", self.hang_timeout_ms),
        ]
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            engine_bin: None,
            engine_args: Vec::new(),
            engine_env: BTreeMap::new(),
            engine_options: BTreeMap::new(),
            limits: LimitsConfig::default(),
            runtime_dir: None,
            max_body_bytes: 32 << 20,
            queue_capacity: 64,
            queue_timeout_ms: 30_000,
            backoff_initial_ms: 250,
            backoff_max_ms: 8_000,
            crash_limit: 5,
            crash_window_ms: 120_000,
            failed_cooldown_ms: 300_000,
            limits_recovery_ms: 600_000,
            grace_ms: 10_000,
            header_timeout_ms: 30_000,
            body_timeout_ms: 30_000,
            max_connections: None,
            max_connections_per_client: None,
            max_in_flight_per_model: 256,
            max_tokens_limit: Some(131_072),
            load_timeout_ms: 600_000,
            hang_timeout_ms: 30_000,
            max_resumes: 3,
            api_keys: Vec::new(),
            api_key_file: None,
            admin_api_key: None,
            allowed_origins: Vec::new(),
            allowed_hosts: Vec::new(),
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            default_model: None,
            route_unknown_to_default: false,
            max_engines: 4,
            memory_budget: None,
            memory_reserve: 2 << 30,
            ttl: Duration::from_secs(300),
            capacity_wait: Duration::from_secs(20),
            models_dir: None,
            store_models: true,
            standby: false,
        }
    }
}

impl ModelConfig {
    /// Whether this entry names a LoRA adapter on another model (`adapter` and `base`): its
    /// id routes to the base's engine, which loads the adapter under that id (the base's
    /// `adapters` option gains `<id>=<adapter>`); it has no engine, weights or settings of
    /// its own.
    pub fn is_adapter(&self) -> bool {
        self.adapter.is_some() || self.base.is_some()
    }

    /// The settings an adapter entry must not have (they belong to its base), by name.
    fn model_only_settings(&self) -> Vec<&'static str> {
        let set = [
            ("path", self.path.is_some()),
            ("aliases", !self.aliases.is_empty()),
            ("pinned", self.pinned),
            ("standby", self.standby.is_some()),
            ("ttl", self.ttl.is_some()),
            ("memory", self.memory.is_some()),
            ("max_batch_size", self.max_batch_size.is_some()),
            ("kv_budget_bytes", self.kv_budget_bytes.is_some()),
            ("context_length", self.context_length.is_some()),
            ("options", !self.options.is_empty()),
            ("distributed", self.distributed.is_some()),
        ];
        set.into_iter()
            .filter(|(_, present)| *present)
            .map(|(name, _)| name)
            .collect()
    }

    /// The engine options that make its engine an engine group's rank 0 (`distributed`,
    /// `distributed_hosts`, `distributed_mode`); none without a `distributed` entry.
    pub fn group_options(&self) -> BTreeMap<String, String> {
        self.distributed
            .iter()
            .flat_map(|d| {
                [
                    ("distributed".to_owned(), d.backend.clone()),
                    (
                        "distributed_hosts".to_owned(),
                        group_hosts::to_option(&d.hosts),
                    ),
                    ("distributed_mode".to_owned(), d.mode.clone()),
                ]
            })
            .collect()
    }

    /// A model served under `id`, loaded from `id` (a known name or a path).
    pub fn new(id: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            ..Self::default()
        }
    }

    /// A model from a `--model` flag: a directory is named after itself, a `.gguf`
    /// file after its stem, anything else (a known name, a repo id) by what was given.
    pub fn from_flag(arg: &str) -> Self {
        Self {
            // The id the engine will serve it under, by the store's one rule.
            id: mlxd_store::served_id(arg),
            path: Some(arg.to_string()),
            ..Self::default()
        }
    }

    /// What the engine is asked to load.
    pub fn source(&self) -> &str {
        self.path.as_deref().unwrap_or(&self.id)
    }

    /// This model's limits, falling back to `defaults` field by field.
    pub fn limits(&self, defaults: &LimitsConfig) -> Limits {
        Limits {
            max_batch_size: self.max_batch_size.or(defaults.max_batch_size),
            kv_budget_bytes: self.kv_budget_bytes.or(defaults.kv_budget_bytes),
            context_length: self.context_length.or(defaults.context_length),
        }
    }
}

/// The hint for a duration or size written without quotes (`ttl = 5m`), which TOML cannot
/// parse: such values are strings.
fn unquoted_unit(line: &str) -> Option<String> {
    let (key, value) = line.split_once('=')?;
    let (key, value) = (key.trim(), value.trim());
    let digits = value.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let unit = value[digits..].trim_start();
    (digits > 0 && unit.starts_with(|c: char| c.is_ascii_alphabetic()) && !value.contains('"'))
        .then(|| format!(" (a duration or size with a unit is a string: {key} = \"{value}\")"))
}

impl Config {
    /// One model, everything else default.
    pub fn single(model: impl Into<String>) -> Self {
        Self {
            models: vec![ModelConfig::new(model)],
            ..Self::default()
        }
    }

    /// Parses `mlxd.toml` text; `file` names it in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::new(text);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            let (line, column) = inner
                .span()
                .map(|s| line_col(text, s.start))
                .unwrap_or((1, 1));
            let mut message = inner.message().trim().to_string();
            if let Some(hint) = text
                .lines()
                .nth(line.saturating_sub(1))
                .and_then(unquoted_unit)
            {
                message.push_str(&hint);
            }
            ConfigError::Invalid {
                file: file.to_string(),
                line,
                column,
                field: if field == "." { "(file)".into() } else { field },
                message,
            }
        })?;
        // Engine options wait for the engine binary, which a flag may still set
        // (`ServeArgs::into_config` checks them with this text).
        config.validate_settings(Some((text, file)))?;
        Ok(config)
    }

    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Checks what the types cannot: ids unique and non-empty, aliases unambiguous,
    /// the default model known, at least one engine allowed. `source` (text, file name)
    /// lets errors name the line.
    pub fn validate_settings(&self, source: Option<(&str, &str)>) -> Result<(), ConfigError> {
        let fail = |table: Option<usize>, key: &str, field: String, message: String| {
            Err(match source {
                Some((text, file)) => {
                    let line = locate(text, table, key);
                    ConfigError::Invalid {
                        file: file.to_string(),
                        line,
                        column: 1,
                        field,
                        message,
                    }
                }
                None => ConfigError::Setting { field, message },
            })
        };
        for (key, ms) in self.server.durations_ms() {
            if Duration::from_millis(ms) > MAX_DURATION {
                return fail(
                    None,
                    key,
                    format!("server.{key}"),
                    format!(
                        "{ms} ms is out of range: at most {} ms (10 years)",
                        MAX_DURATION.as_millis()
                    ),
                );
            }
        }
        for (key, v) in [
            (
                "max_connections",
                self.server.max_connections.map_or(1, |n| n as u64),
            ),
            (
                "max_connections_per_client",
                self.server
                    .max_connections_per_client
                    .map_or(1, |n| n as u64),
            ),
            (
                "max_in_flight_per_model",
                u64::from(self.server.max_in_flight_per_model),
            ),
            ("queue_capacity", self.server.queue_capacity as u64),
        ] {
            if v == 0 {
                return fail(
                    None,
                    key,
                    format!("server.{key}"),
                    "must be at least 1, got 0".into(),
                );
            }
        }
        for (field, d) in [
            ("pool.ttl", self.pool.ttl),
            ("pool.capacity_wait", self.pool.capacity_wait),
        ] {
            if d > MAX_DURATION {
                return fail(
                    None,
                    field.trim_start_matches("pool."),
                    field.into(),
                    out_of_range(&format!("{} s", d.as_secs())),
                );
            }
        }
        if self.pool.max_engines == 0 {
            return fail(
                None,
                "max_engines",
                "pool.max_engines".into(),
                "must be at least 1, got 0".into(),
            );
        }
        let mut names: BTreeMap<&str, String> = BTreeMap::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.id.trim().is_empty() {
                return fail(
                    Some(i),
                    "id",
                    format!("model[{i}].id"),
                    "a model needs a non-empty id".into(),
                );
            }
            if let Some(prev) = names.insert(&m.id, format!("model {:?}", m.id)) {
                return fail(
                    Some(i),
                    "id",
                    format!("model[{i}].id"),
                    format!("duplicate model id {:?} (already used by {prev})", m.id),
                );
            }
        }
        for (i, m) in self.models.iter().enumerate() {
            for a in &m.aliases {
                if a.trim().is_empty() {
                    return fail(
                        Some(i),
                        "aliases",
                        format!("model[{i}].aliases"),
                        "an alias must not be empty".into(),
                    );
                }
                if let Some(prev) = names.insert(a, format!("model {:?}", m.id)) {
                    return fail(
                        Some(i),
                        "aliases",
                        format!("model[{i}].aliases"),
                        format!("alias {a:?} of model {:?} is already taken by {prev}", m.id),
                    );
                }
            }
        }
        if let Some(d) = &self.pool.default_model {
            if !self.models.is_empty() && !names.contains_key(d.as_str()) {
                let ids: Vec<&str> = self.models.iter().map(|m| m.id.as_str()).collect();
                return fail(
                    None,
                    "default_model",
                    "pool.default_model".into(),
                    format!("{d:?} is not a configured model or alias (models: {ids:?})"),
                );
            }
            if self.models.iter().any(|m| m.is_adapter() && m.id == *d) {
                return fail(
                    None,
                    "default_model",
                    "pool.default_model".into(),
                    format!("{d:?} is an adapter entry: the default must be a model"),
                );
            }
        }
        for (i, m) in self.models.iter().enumerate() {
            if let Err((key, message)) = self.check_adapter_entry(m) {
                return fail(Some(i), key, format!("model[{i}].{key}"), message);
            }
        }
        Ok(())
    }

    /// What is wrong with `m` as an adapter entry, as `(key, reason)`; nothing for a model.
    fn check_adapter_entry(&self, m: &ModelConfig) -> Result<(), (&'static str, String)> {
        if !m.is_adapter() {
            return Ok(());
        }
        let (Some(dir), Some(base)) = (&m.adapter, &m.base) else {
            let missing = if m.adapter.is_none() {
                "adapter"
            } else {
                "base"
            };
            return Err((
                missing,
                format!(
                    "an adapter entry needs both adapter (its directory) and base (the model \
                     that serves it); {missing} is missing"
                ),
            ));
        };
        if let Some(field) = m.model_only_settings().first() {
            return Err((
                field,
                format!(
                    "{:?} is an adapter entry (adapter, base): it takes only id, adapter and \
                     base; {field} belongs on its base model {base:?}",
                    m.id
                ),
            ));
        }
        if !mlxd_protocol::engine_options::valid_adapter_name(&m.id) {
            return Err((
                "id",
                format!(
                    "{:?} cannot name an adapter: use 1 to 128 of the characters A-Z a-z 0-9 - _ .",
                    m.id
                ),
            ));
        }
        let dir_text = dir.display().to_string();
        if dir_text.contains(',') || dir_text.contains('=') {
            return Err((
                "adapter",
                format!("{dir_text:?}: an adapter directory's path cannot hold ',' or '='"),
            ));
        }
        match self
            .models
            .iter()
            .find(|b| b.id == *base || b.aliases.contains(base))
        {
            None => Err((
                "base",
                format!("{base:?} is not a configured model or alias"),
            )),
            Some(b) if b.is_adapter() => Err((
                "base",
                format!("{base:?} is itself an adapter entry: the base must be a model"),
            )),
            Some(_) => Ok(()),
        }
    }

    /// The index of the model whose engine serves the adapter entry `m` (checked by
    /// [`Self::validate_settings`]).
    fn base_of(&self, m: &ModelConfig) -> Option<usize> {
        let base = m.base.as_ref()?;
        self.models
            .iter()
            .position(|b| !b.is_adapter() && (b.id == *base || b.aliases.contains(base)))
    }

    /// The adapter entries whose base is model `i`.
    pub fn adapter_entries_of(&self, i: usize) -> impl Iterator<Item = &ModelConfig> {
        self.models
            .iter()
            .filter(move |a| a.is_adapter() && self.base_of(a) == Some(i))
    }

    /// The engine options of model `i`: `[server] engine_options`, then its own, its engine
    /// group's, and the adapter entries it serves appended to its `adapters`.
    pub fn engine_options_of(&self, i: usize) -> BTreeMap<String, String> {
        let m = &self.models[i];
        let mut options = self.server.engine_options.clone();
        options.extend(m.options.clone());
        options.extend(m.group_options());
        let served: Vec<String> = self
            .adapter_entries_of(i)
            .filter_map(|a| Some(format!("{}={}", a.id, a.adapter.as_ref()?.display())))
            .collect();
        if !served.is_empty() {
            let mut list: Vec<String> = options.get("adapters").cloned().into_iter().collect();
            list.extend(served);
            options.insert("adapters".into(), list.join(","));
        }
        options
    }

    /// [`Self::validate_settings`] and [`Self::validate_engine_options`]: everything, once
    /// the engine binary is known (a flag may set it after the file is read).
    pub fn validate(&self, source: Option<(&str, &str)>) -> Result<(), ConfigError> {
        self.validate_settings(source)?;
        self.validate_distributed()?;
        self.validate_engine_options(source)
    }

    /// Each model's engine group, if it has one ([`DistributedConfig::check`]).
    fn validate_distributed(&self) -> Result<(), ConfigError> {
        // The group's options come from its entry, which also makes mlxd start the ranks.
        let by_hand = |options: &BTreeMap<String, String>| {
            ["distributed", "distributed_hosts", "distributed_mode"]
                .into_iter()
                .find(|k| options.contains_key(*k))
        };
        let refuse = |field: String| ConfigError::Setting {
            field,
            message: "an engine group is a model's distributed entry (distributed = { backend, \
                      hosts }), not an engine option"
                .into(),
        };
        if let Some(key) = by_hand(&self.server.engine_options) {
            return Err(refuse(format!("server.engine_options.{key}")));
        }
        for (i, m) in self.models.iter().enumerate() {
            if let Some(key) = by_hand(&m.options) {
                return Err(refuse(format!("model[{i}].options.{key}")));
            }
            if let Some(Err((key, message))) = m.distributed.as_ref().map(DistributedConfig::check)
            {
                return Err(ConfigError::Setting {
                    field: format!("model[{i}].distributed.{key}"),
                    message,
                });
            }
        }
        Ok(())
    }

    /// Engine options are mlxd-engine's: checked before any engine starts, by the rules the
    /// engine applies to `Launch.options` (`mlxd_protocol::engine_options`). A substitute
    /// engine (`engine_bin` naming another program, as the tests' scripted fake engine)
    /// defines its own options, and gets them as given.
    pub fn validate_engine_options(&self, source: Option<(&str, &str)>) -> Result<(), ConfigError> {
        if !self.server.runs_mlxd_engine() {
            return Ok(());
        }
        let refuse = |table: Option<usize>, field: String, e: OptionError| {
            let message = format!("{} (got {:?})", e.reason, e.value);
            match source {
                // An option from a flag, not the file, has no line.
                Some((text, file)) if text.contains(e.key.as_str()) => ConfigError::Invalid {
                    file: file.to_string(),
                    line: locate(text, table, &e.key),
                    column: 1,
                    field,
                    message,
                },
                _ => ConfigError::Setting { field, message },
            }
        };
        if let Err(e) = EngineOptions::from_map(&self.server.engine_options) {
            return Err(refuse(None, format!("server.engine_options.{}", e.key), e));
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.is_adapter() {
                continue;
            }
            if let Err(e) = EngineOptions::from_map(&self.engine_options_of(i)) {
                return Err(refuse(Some(i), format!("model[{i}].options.{}", e.key), e));
            }
        }
        Ok(())
    }

    /// Every API key: `api_keys` plus the lines of `api_key_file`.
    pub fn api_keys(&self) -> Result<Vec<String>, ConfigError> {
        let mut keys: Vec<String> = self.server.api_keys.iter().map(|k| k.0.clone()).collect();
        if let Some(path) = &self.server.api_key_file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Setting {
                field: "server.api_key_file".into(),
                message: format!("reading {}: {e}", path.display()),
            })?;
            let from_file = parse_key_file(&text);
            if from_file.is_empty() {
                return Err(ConfigError::Setting {
                    field: "server.api_key_file".into(),
                    message: format!("{} holds no keys", path.display()),
                });
            }
            keys.extend(from_file);
        }
        if let Some(i) = keys.iter().position(|k| k.trim().is_empty()) {
            return Err(ConfigError::Setting {
                field: format!("server.api_keys[{i}]"),
                message: "an API key must not be empty".into(),
            });
        }
        if self
            .server
            .admin_api_key
            .as_ref()
            .is_some_and(|k| k.0.trim().is_empty())
        {
            return Err(ConfigError::Setting {
                field: "server.admin_api_key".into(),
                message: "the admin API key must not be empty".into(),
            });
        }
        Ok(keys)
    }

    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.server.queue_timeout_ms)
    }

    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.server.grace_ms)
    }

    /// The engine binary: configured, or `mlxd-engine` in the directory of this executable.
    pub fn engine_bin(&self) -> PathBuf {
        if let Some(bin) = &self.server.engine_bin {
            return bin.clone();
        }
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("mlxd-engine")))
            .unwrap_or_else(|| PathBuf::from("mlxd-engine"))
    }
}

/// The keys of an API key file: one per line, trimmed; blank lines and `#` comments
/// skipped.
pub fn parse_key_file(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// 1-based line and column of byte `offset`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rfind('\n').map(|i| offset - i).unwrap_or(offset + 1);
    (line, column)
}

/// The line of `key = ...` inside the `table`-th `[[model]]` (or anywhere, for `None`);
/// the table header's line when the key is absent; 1 when nothing matches.
fn locate(text: &str, table: Option<usize>, key: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let is_key = |l: &str| {
        l.trim_start()
            .strip_prefix(key)
            .is_some_and(|r| r.trim_start().starts_with('='))
    };
    let Some(n) = table else {
        return lines.iter().position(|l| is_key(l)).map_or(1, |i| i + 1);
    };
    let headers: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.trim() == "[[model]]")
        .map(|(i, _)| i)
        .collect();
    let Some(&start) = headers.get(n) else {
        return 1;
    };
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .map_or(lines.len(), |p| start + 1 + p);
    (start..end).find(|&i| is_key(lines[i])).unwrap_or(start) + 1
}

/// A number, or a string with a unit.
#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

/// The longest duration any setting accepts: ten years. Far beyond any sensible TTL or
/// timeout, and far enough below `Instant`'s range that deadline arithmetic cannot
/// overflow; a larger value is a typo, refused rather than clamped.
pub const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Splits `"1.5GiB"` into `(1.5, "GiB")`; `what` names the kind of value in errors.
fn number_and_unit<'a>(s: &'a str, example: &str) -> Result<(f64, &'a str), String> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("expected {example}, got {s:?}"))?;
    Ok((n, unit.trim()))
}

/// `"512MiB"`, `"8GB"`, `"1.5GiB"`, or plain bytes. A size beyond `u64` bytes (16 EiB)
/// is an error, never clamped.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (n, unit) = number_and_unit(s, "a size like \"8GiB\" or a byte count")?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        "t" | "tb" => 1_000_000_000_000,
        "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let bytes = n * mult as f64;
    // `u64::MAX as f64` rounds up to 2^64, so `<` is the exact test.
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!(
            "size {s:?} is out of range: at most {} bytes (16 EiB)",
            u64::MAX
        ));
    }
    Ok(bytes as u64)
}

/// `"5m"`, `"300s"`, `"1h"`, `"250ms"`, `"0"`, or plain seconds; at most
/// [`MAX_DURATION`].
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (n, unit) = number_and_unit(s, "a duration like \"5m\" or seconds")?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} in {s:?}")),
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= MAX_DURATION => Ok(d),
        _ => Err(out_of_range(s)),
    }
}

fn out_of_range(value: &str) -> String {
    format!(
        "duration {value:?} is out of range: at most {} s (10 years)",
        MAX_DURATION.as_secs()
    )
}

/// Seconds as a duration, at most [`MAX_DURATION`].
fn secs_duration(n: u64) -> Result<Duration, String> {
    let d = Duration::from_secs(n);
    if d > MAX_DURATION {
        return Err(out_of_range(&format!("{n} s")));
    }
    Ok(d)
}

fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => Ok(n),
        NumOrStr::Str(s) => parse_bytes(&s).map_err(de::Error::custom),
    }
}

fn de_opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_bytes(d).map(Some)
}

fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Num(n) => secs_duration(n).map_err(de::Error::custom),
        NumOrStr::Str(s) => parse_duration(&s).map_err(de::Error::custom),
    }
}

fn de_opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    de_duration(d).map(Some)
}

/// Human-readable bytes for tables and messages.
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if b >= (1u64 << 30) as f64 {
            write!(f, "{:.1} GiB", b / (1u64 << 30) as f64)
        } else if b >= (1u64 << 20) as f64 {
            write!(f, "{:.1} MiB", b / (1u64 << 20) as f64)
        } else if b >= 1024.0 {
            write!(f, "{:.1} KiB", b / 1024.0)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Config::from_toml_str(text, "mlxd.toml")
            .and_then(|c| c.validate(Some((text, "mlxd.toml"))))
            .unwrap_err()
            .to_string()
    }

    /// Issue 26: a model's engine group is checked at load; what is not built is refused
    /// with the reason, and a valid group becomes its engine options.
    #[test]
    fn a_models_engine_group_is_checked_at_load() {
        let group = |fields: &str| {
            err(&format!(
                "[[model]]\nid = \"a\"\ndistributed = {{ {fields} }}\n"
            ))
        };
        let e = group(r#"backend = "mpi", hosts = ["127.0.0.1", "127.0.0.1"]"#);
        assert!(
            e.contains("model[0].distributed.backend: unknown backend \"mpi\""),
            "{e}"
        );
        // jaccl: every host lists its RDMA device towards each rank (mlx.launch's `rdma`).
        let e = group(r#"backend = "jaccl", hosts = ["127.0.0.1", "127.0.0.1"]"#);
        assert!(
            e.contains("model[0].distributed.hosts: host \"127.0.0.1\" (rank 0) has no rdma list"),
            "{e}"
        );
        let e = group(
            r#"backend = "jaccl", hosts = [{ ssh = "m1", ips = ["10.0.0.1"], rdma = ["", "rdma_en3"] },
               { ssh = "m2", ips = ["10.0.0.2"], rdma = ["rdma_en3"] }]"#,
        );
        assert!(
            e.contains("rdma has 1 entries, but a group of 2 ranks needs 2"),
            "{e}"
        );
        let e = group(
            r#"backend = "jaccl", hosts = [{ ssh = "m1.invalid", rdma = ["", "rdma_en3"] },
               { ssh = "m2", ips = ["10.0.0.2"], rdma = ["rdma_en3", ""] }]"#,
        );
        assert!(
            e.contains("\"m1.invalid\" (its ssh), which does not resolve"),
            "{e}"
        );
        let e = group(r#"backend = "ring", hosts = ["127.0.0.1", "127.0.0.1"], mode = "layers""#);
        assert!(
            e.contains("model[0].distributed.mode: unknown mode \"layers\""),
            "{e}"
        );
        let e = group(r#"backend = "ring", hosts = ["127.0.0.1"]"#);
        assert!(e.contains("two or more hosts"), "{e}");
        // The ring backend reaches a rank at an IP address, as mlx.launch requires.
        let e = group(r#"backend = "ring", hosts = ["127.0.0.1", "studio-2.local"]"#);
        assert!(
            e.contains("host \"studio-2.local\": the ring backend needs its IP address"),
            "{e}"
        );
        let e = group(r#"backend = "nccl", hosts = ["127.0.0.1", "10.0.0.2"]"#);
        assert!(e.contains("nccl groups on this machine only"), "{e}");
        let e = group(r#"backend = "ring", hosts = ["127.0.0.1", { ssh = "h", ip = "10.0.0.2" }]"#);
        assert!(e.contains("unknown field `ip`"), "{e}");
        let e = err("[server.engine_options]\ndistributed = \"ring\"\n");
        assert!(
            e.contains(
                "server.engine_options.distributed: an engine group is a model's distributed entry"
            ),
            "{e}"
        );
        let text = "[[model]]\nid = \"a\"\ndistributed = { backend = \"ring\", hosts = [\"127.0.0.1\", \"localhost\"] }\n";
        let config = Config::from_toml_str(text, "mlxd.toml").unwrap();
        config.validate(None).unwrap();
        let options = config.models[0].group_options();
        assert_eq!(options["distributed"], "ring");
        assert_eq!(options["distributed_hosts"], "127.0.0.1,localhost");
        assert_eq!(options["distributed_mode"], "tensor");
        // Pipeline mode passes to the engine, which refuses the families it cannot divide.
        let text = text.replace(" }", ", mode = \"pipeline\" }");
        let config = Config::from_toml_str(&text, "mlxd.toml").unwrap();
        config.validate(None).unwrap();
        assert_eq!(
            config.models[0].group_options()["distributed_mode"],
            "pipeline"
        );
        // A rank on another machine: its mlx.launch entry (and mlxd's keys) reach rank 0.
        let text = "[[model]]\nid = \"a\"\ndistributed = { backend = \"ring\", hosts = [\
                    { ssh = \"studio-1\", ips = [\"10.0.0.1\"] }, { ssh = \"me@studio-2\", \
                    ips = [\"10.0.0.2\"], engine = \"/opt/mlxd/mlxd-engine\" }] }\n";
        let config = Config::from_toml_str(text, "mlxd.toml").unwrap();
        config.validate(None).unwrap();
        let hosts =
            group_hosts::parse_hosts(&config.models[0].group_options()["distributed_hosts"])
                .unwrap();
        assert_eq!(hosts[1].ssh, "me@studio-2");
        assert_eq!(hosts[1].engine.as_deref(), Some("/opt/mlxd/mlxd-engine"));
        // Two Macs joined by Thunderbolt 5: each host's own entry is "" (TOML has no null).
        let text = "[[model]]\nid = \"a\"\ndistributed = { backend = \"jaccl\", hosts = [\
                    { ssh = \"studio-1\", ips = [\"10.0.0.1\"], rdma = [\"\", \"rdma_en3\"] }, \
                    { ssh = \"studio-2\", ips = [\"10.0.0.2\"], rdma = [\"rdma_en3\", \"\"] }] }\n";
        let config = Config::from_toml_str(text, "mlxd.toml").unwrap();
        config.validate(None).unwrap();
        let options = config.models[0].group_options();
        assert_eq!(options["distributed"], "jaccl");
        let hosts = group_hosts::parse_hosts(&options["distributed_hosts"]).unwrap();
        assert_eq!(
            group_hosts::jaccl::devices_matrix(&hosts),
            r#"[[null,"rdma_en3"],["rdma_en3",null]]"#
        );
    }

    /// Issue 22.2: a bad engine option fails the config load naming the field, before any
    /// engine starts (it used to surface as a failed load).
    #[test]
    fn engine_options_are_checked_at_load_naming_the_field() {
        let e = err("[server.engine_options]\nkv_bits = \"3\"\n");
        assert_eq!(
            e,
            "mlxd.toml:2:1: server.engine_options.kv_bits: expected 4 or 8 (got \"3\")"
        );
        let e = err("[server.engine_options]\nspeculative = \"yes\"\n");
        assert!(
            e.contains("server.engine_options.speculative: unknown option (known: prompt_cache"),
            "{e}"
        );
        let e =
            err("[[model]]\nid = \"a\"\noptions = { draft = \"ngram\", draft_model = \"b\" }\n");
        assert!(
            e.starts_with("mlxd.toml:1:1: model[0].options.draft_model: draft = \"ngram\" and draft_model exclude each other"),
            "{e}"
        );
        let e = err("[server.engine_options]\nkv_group_size = \"32\"\n");
        assert!(e.contains("kv_group_size: needs kv_bits"), "{e}");
        let ok = Config::from_toml_str(
            "[server.engine_options]\nkv_bits = \"8\"\nssd_cache = \"/tmp/kv\"\n[[model]]\nid = \"a\"\noptions = { prompt_cache = \"0\" }\n",
            "mlxd.toml",
        )
        .and_then(|c| c.validate(None));
        assert!(ok.is_ok(), "{ok:?}");
        // A substitute engine's options are its own.
        let fake = Config::from_toml_str(
            "[server]\nengine_bin = \"/opt/fake-engine\"\n[server.engine_options]\nchunks = \"3\"\n",
            "mlxd.toml",
        )
        .and_then(|c| c.validate(None));
        assert!(fake.is_ok(), "{fake:?}");
    }

    #[test]
    fn sections_and_units() {
        let c = Config::from_toml_str(
            r#"
[server]
port = 9000
[server.engine_options]
kv_bits = "8"
[pool]
default_model = "b"
max_engines = 2
memory_budget = "1.5GiB"
ttl = "10m"
route_unknown_to_default = true
[[model]]
id = "a"
path = "/models/a"
aliases = ["gpt-4"]
pinned = true
ttl = 0
[[model]]
id = "b"
context_length = 4096
kv_budget_bytes = "64MiB"
options = { prompt_cache = "0.5" }
"#,
            "mlxd.toml",
        )
        .unwrap();
        assert_eq!(c.server.port, 9000);
        assert_eq!(c.server.engine_options["kv_bits"], "8");
        assert_eq!(c.server.max_body_bytes, 32 << 20);
        assert_eq!(c.pool.max_engines, 2);
        assert_eq!(c.pool.memory_budget, Some(3 << 29));
        assert_eq!(c.pool.ttl, Duration::from_secs(600));
        assert!(c.pool.route_unknown_to_default);
        assert_eq!(c.models[0].source(), "/models/a");
        assert!(c.models[0].pinned);
        assert_eq!(c.models[0].ttl, Some(Duration::ZERO));
        assert_eq!(c.models[1].source(), "b");
        let l = c.models[1].limits(&c.server.limits);
        assert_eq!(l.context_length, Some(4096));
        assert_eq!(l.kv_budget_bytes, Some(64 << 20));
        assert_eq!(c.models[1].options["prompt_cache"], "0.5");
    }

    #[test]
    fn errors_name_the_line_and_field() {
        let e = err("[server]\nport = \"x\"\n");
        assert!(e.starts_with("mlxd.toml:2:"), "{e}");
        assert!(e.contains("server.port"), "{e}");

        let e = err("[pool]\nmax_engines = 2\n\n[[model]]\nid = \"a\"\n\n[[model]]\nid = \"b\"\nttl = \"5 fortnights\"\n");
        assert!(e.starts_with("mlxd.toml:9:"), "{e}");
        assert!(e.contains("model[1].ttl"), "{e}");
        assert!(e.contains("fortnights"), "{e}");

        let e = err("[pool]\nmax_engine = 2\n");
        assert!(e.starts_with("mlxd.toml:2:"), "{e}");
        assert!(e.contains("max_engine"), "{e}");

        let e = err("[[model]]\nid = \"a\"\n[[model]]\nid = \"a\"\n");
        assert_eq!(
            e,
            "mlxd.toml:4:1: model[1].id: duplicate model id \"a\" (already used by model \"a\")"
        );

        let e = err("[[model]]\nid = \"a\"\n[[model]]\nid = \"b\"\naliases = [\"x\", \"a\"]\n");
        assert!(e.starts_with("mlxd.toml:5:1: model[1].aliases"), "{e}");

        let e = err("[pool]\ndefault_model = \"zzz\"\n[[model]]\nid = \"a\"\n");
        assert!(e.starts_with("mlxd.toml:2:1: pool.default_model"), "{e}");

        let e = err("[pool]\nmax_engines = 0\n");
        assert!(e.starts_with("mlxd.toml:2:1: pool.max_engines"), "{e}");

        let e = err("[server\nport = 1\n");
        assert!(e.starts_with("mlxd.toml:1:"), "{e}");
    }

    #[test]
    fn the_example_file_parses() {
        let c = Config::from_toml_str(include_str!("../mlxd.example.toml"), "example").unwrap();
        assert_eq!(c.models.len(), 4);
        assert_eq!(c.pool.max_engines, 2);
        assert_eq!(c.models[2].source(), "Qwen/Qwen3-0.6B");
        assert_eq!(c.models[2].memory, Some(3 << 29));
        let cat = crate::catalog::Catalog::from_config(&c).unwrap();
        assert_eq!(cat.resolve(Some("gpt-3.5-turbo")).unwrap().id, "smollm2");
        assert_eq!(cat.resolve(Some("sql")).unwrap().id, "llama-1b");
    }

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("100").unwrap(), 100);
        assert!(parse_bytes("lots").is_err());
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn huge_durations_and_sizes_are_errors_naming_the_field() {
        for bad in [
            "99999999999999999999h",
            "1e400",
            "315360001",
            "99999999999999999999",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_duration("315360000").unwrap(), MAX_DURATION);
        let e = parse_duration("99999999999999999999h").unwrap_err();
        assert!(e.contains("out of range") && e.contains("315360000"), "{e}");
        let e = parse_bytes("99999999999999999999GiB").unwrap_err();
        assert!(
            e.contains("out of range") && e.contains("18446744073709551615"),
            "{e}"
        );
        assert!(parse_bytes("18446744073709551616").is_err());
        assert_eq!(parse_bytes("16EiB").ok(), None);

        let e = err("[pool]\nttl = 5m\n");
        assert!(
            e.starts_with("mlxd.toml:2:") && e.contains("a string: ttl = \"5m\""),
            "{e}"
        );
        let e = err("[pool]\nmemory_budget = 24 GiB\n");
        assert!(e.contains("memory_budget = \"24 GiB\""), "{e}");
        let e = err("[pool]\nttl = \"99999999999999999999h\"\n");
        assert!(
            e.starts_with("mlxd.toml:2:") && e.contains("pool.ttl"),
            "{e}"
        );
        let e = err("[pool]\ncapacity_wait = \"99999999999999999999h\"\n");
        assert!(
            e.contains("pool.capacity_wait") && e.contains("out of range"),
            "{e}"
        );
        let e = err("[pool]\nmemory_budget = \"99999999999999999999GiB\"\n");
        assert!(
            e.contains("pool.memory_budget") && e.contains("out of range"),
            "{e}"
        );
        let e = err("[[model]]\nid = \"a\"\nttl = \"99999999999999999999h\"\n");
        assert!(
            e.starts_with("mlxd.toml:3:") && e.contains("model[0].ttl"),
            "{e}"
        );
        let e = err("[[model]]\nid = \"a\"\nttl = 9223372036854775807\n");
        assert!(
            e.contains("model[0].ttl") && e.contains("out of range"),
            "{e}"
        );
        let e = err("[server]\ngrace_ms = 9223372036854775807\n");
        assert!(e.starts_with("mlxd.toml:2:1: server.grace_ms"), "{e}");
        let e = err("[server]\nlimits_recovery_ms = 9223372036854775807\n");
        assert!(e.contains("server.limits_recovery_ms"), "{e}");
    }

    #[test]
    fn model_flags_name_themselves() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("tiny-llama");
        std::fs::create_dir(&m).unwrap();
        let g = dir.path().join("small.gguf");
        std::fs::write(&g, b"GGUF").unwrap();
        assert_eq!(ModelConfig::from_flag(m.to_str().unwrap()).id, "tiny-llama");
        assert_eq!(ModelConfig::from_flag(g.to_str().unwrap()).id, "small");
        let hf = ModelConfig::from_flag("HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(hf.id, "HuggingFaceTB/SmolLM2-135M-Instruct");
        assert_eq!(hf.source(), "HuggingFaceTB/SmolLM2-135M-Instruct");
    }
}
