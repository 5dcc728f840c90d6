//! Command line: `mlxd [serve] [flags]`, `mlxd ps`, `mlxd ls`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{parse_bytes, parse_duration, Config, ConfigError, ModelConfig};

#[derive(Debug, Parser)]
#[command(
    name = "mlxd",
    version,
    about = "Local LLM server: supervisor and proxy for MLX engines"
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
    /// Running engines of a running server: model, pid, state, memory, uptime, requests.
    Ps(ClientArgs),
    /// Configured models of a running server and their states.
    Ls(ClientArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The server to ask.
    #[arg(long, default_value = "http://127.0.0.1:8080", env = "MLXD_URL")]
    pub url: String,
    /// The API key, if the server requires one.
    #[arg(long, env = "MLXD_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
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
    /// Address to bind [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to bind [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// TOML config file; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Engine binary [default: mlxd-engine beside mlxd].
    #[arg(long)]
    pub engine_bin: Option<PathBuf>,
    /// Engine `Launch` option, `key=value` (repeatable).
    #[arg(long = "engine-opt", value_parser = parse_kv)]
    pub engine_opts: Vec<(String, String)>,
    /// Largest routed request body in bytes [default: 33554432].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Shutdown grace period in milliseconds [default: 10000].
    #[arg(long)]
    pub grace_ms: Option<u64>,
    /// Client connections served at once [default: 1024, fewer under a low ulimit -n].
    #[arg(long)]
    pub max_connections: Option<usize>,
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

/// A bad flag value, named like a config field.
fn flag(name: &str, message: String) -> ConfigError {
    ConfigError::Setting {
        field: name.to_string(),
        message,
    }
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
        let mut c = match &self.config {
            Some(path) => Config::from_toml_file(path)?,
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
        if let Some(h) = self.host {
            c.server.host = h;
        }
        if let Some(p) = self.port {
            c.server.port = p;
        }
        if let Some(b) = self.engine_bin {
            c.server.engine_bin = Some(b);
        }
        c.server.engine_options.extend(self.engine_opts);
        if let Some(m) = self.max_body_bytes {
            c.server.max_body_bytes = m;
        }
        if let Some(g) = self.grace_ms {
            c.server.grace_ms = g;
        }
        if let Some(n) = self.max_connections {
            c.server.max_connections = Some(n);
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
        c.validate(None)?;
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
            "a=b",
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
        assert_eq!(c.server.engine_options["a"], "b");
        assert_eq!(c.pool.max_engines, 1);
        assert_eq!(c.pool.memory_budget, Some(2 << 30));
        assert_eq!(c.pool.ttl, std::time::Duration::from_secs(30));
        assert_eq!(Catalog::from_config(&c).unwrap().default_model, "org/b");
        assert!(config(&["mlxd", "--model", "a", "--default-model", "zzz"]).is_err());
        assert!(config(&["mlxd", "--max-engines", "0"]).is_err());
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
    fn client_commands() {
        let cli = Cli::parse_from(["mlxd", "ps", "--url", "http://h:1"]);
        assert!(matches!(&cli.command, Some(Command::Ps(a)) if a.url == "http://h:1"));
        assert!(cli.serve_args().is_none());
        assert!(matches!(
            Cli::parse_from(["mlxd", "ls"]).command,
            Some(Command::Ls(_))
        ));
    }

    #[test]
    fn flags_override_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mlxd.toml");
        std::fs::write(
            &path,
            "[server]\nport = 7000\nmax_body_bytes = 100\n[server.engine_options]\nx = \"1\"\n[[model]]\nid = \"from-file\"\n",
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
        assert_eq!(c.server.engine_options["x"], "1");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[server]\nport = \"x\"").unwrap();
        let err = config(&["mlxd", "--config", bad.to_str().unwrap()]).unwrap_err();
        assert!(err.to_string().contains("bad.toml:2:"), "{err}");
    }
}
