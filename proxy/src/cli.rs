//! Command line: `mlxd [serve] [--model ..] [--host ..] [--port ..] [--config ..]`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{Config, ConfigError};

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
    Serve(ServeArgs),
}

#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// Model name or directory [default: smollm2-135m].
    #[arg(long)]
    pub model: Option<String>,
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
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

impl Cli {
    /// The effective serve flags (`mlxd` alone means `mlxd serve`).
    pub fn serve_args(self) -> ServeArgs {
        match self.command {
            Some(Command::Serve(a)) => a,
            None => self.serve,
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
        if let Some(m) = self.model {
            c.model = m;
        }
        if let Some(h) = self.host {
            c.host = h;
        }
        if let Some(p) = self.port {
            c.port = p;
        }
        if let Some(b) = self.engine_bin {
            c.engine_bin = Some(b);
        }
        c.engine_options.extend(self.engine_opts);
        if let Some(m) = self.max_body_bytes {
            c.max_body_bytes = m;
        }
        if let Some(g) = self.grace_ms {
            c.grace_ms = g;
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_mlxd_is_serve_with_defaults() {
        let c = Cli::parse_from(["mlxd"])
            .serve_args()
            .into_config()
            .unwrap();
        assert_eq!(c.model, "smollm2-135m");
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 8080));
    }

    #[test]
    fn serve_flags() {
        let c = Cli::parse_from([
            "mlxd",
            "serve",
            "--model",
            "/m",
            "--port",
            "9",
            "--engine-opt",
            "a=b",
        ])
        .serve_args()
        .into_config()
        .unwrap();
        assert_eq!(c.model, "/m");
        assert_eq!(c.port, 9);
        assert_eq!(c.engine_options["a"], "b");
    }

    #[test]
    fn flags_override_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mlxd.toml");
        std::fs::write(
            &path,
            "model = \"from-file\"\nport = 7000\nmax_body_bytes = 100\n[engine_options]\nx = \"1\"\n",
        )
        .unwrap();
        let c = Cli::parse_from([
            "mlxd",
            "serve",
            "--config",
            path.to_str().unwrap(),
            "--port",
            "7001",
        ])
        .serve_args()
        .into_config()
        .unwrap();
        assert_eq!(c.model, "from-file");
        assert_eq!(c.port, 7001);
        assert_eq!(c.max_body_bytes, 100);
        assert_eq!(c.engine_options["x"], "1");
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "port = \"x\"").unwrap();
        let err = Cli::parse_from(["mlxd", "--config", bad.to_str().unwrap()])
            .serve_args()
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains("bad.toml"), "{err}");
    }
}
