//! Runtime configuration: defaults, then `mlxd.toml`, then command-line flags.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mlxd_protocol::control::Limits;
use serde::Deserialize;

pub const DEFAULT_MODEL: &str = "smollm2-135m";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing config {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
}

/// Everything `serve` needs. Field names double as `mlxd.toml` keys; durations are
/// given in milliseconds there (`*_ms`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The model to serve (a name or a directory), passed to the engine's `Launch`.
    pub model: String,
    pub host: String,
    pub port: u16,
    /// The engine binary; default: `mlxd-engine` beside the running `mlxd`.
    pub engine_bin: Option<PathBuf>,
    /// Extra arguments after `--control` (tests; normally empty).
    pub engine_args: Vec<String>,
    /// Extra environment for engines, on top of the explicit base set.
    pub engine_env: BTreeMap<String, String>,
    /// Free-form `Launch.options`.
    pub engine_options: BTreeMap<String, String>,
    pub limits: LimitsConfig,
    /// Where engine sockets live; default `$XDG_RUNTIME_DIR/mlxd-<pid>` (created 0700).
    pub runtime_dir: Option<PathBuf>,
    /// Largest request body routed to an engine (413 above it).
    pub max_body_bytes: usize,
    /// Requests that may wait for an engine that is starting.
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
    /// Shutdown: time for in-flight requests, then for engines after `Shutdown`, then
    /// after SIGTERM (SIGKILL follows).
    pub grace_ms: u64,
    /// Time to wait for the first request line and headers on a client connection.
    pub header_timeout_ms: u64,
    /// An engine not ready this long after spawning is killed (a load failure).
    pub load_timeout_ms: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    pub max_batch_size: Option<u32>,
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

impl Default for Config {
    fn default() -> Self {
        Self {
            model: DEFAULT_MODEL.into(),
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
            grace_ms: 10_000,
            header_timeout_ms: 30_000,
            load_timeout_ms: 600_000,
        }
    }
}

impl Config {
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.queue_timeout_ms)
    }

    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms)
    }

    /// The engine binary: configured, or `mlxd-engine` in the directory of this executable.
    pub fn engine_bin(&self) -> PathBuf {
        if let Some(bin) = &self.engine_bin {
            return bin.clone();
        }
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("mlxd-engine")))
            .unwrap_or_else(|| PathBuf::from("mlxd-engine"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_overrides_defaults() {
        let c: Config = toml::from_str(
            "model = \"m\"\nport = 9000\n[limits]\nmax_batch_size = 4\n[engine_options]\na = \"b\"\n",
        )
        .unwrap();
        assert_eq!(c.model, "m");
        assert_eq!(c.port, 9000);
        assert_eq!(c.limits.max_batch_size, Some(4));
        assert_eq!(c.engine_options["a"], "b");
        assert_eq!(c.max_body_bytes, 32 << 20);
        assert!(toml::from_str::<Config>("nope = 1").is_err());
    }
}
