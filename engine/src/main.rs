//! `mlxd-engine`: one model, served over HTTP on a unix socket.
//!
//! Standalone, for debugging and tests: `mlxd-engine --model <name|dir|file.gguf> --unix <path>`.
//! Under `mlxd`: `mlxd-engine --control` (the model and socket come in the `Launch` message).
use std::path::PathBuf;

use clap::Parser;
use mlxd_engine::{app, store, worker::WorkerLimits};

#[derive(Parser)]
#[command(
    name = "mlxd-engine",
    version,
    about = "Serves one model on MLX over a unix socket"
)]
struct Args {
    /// A known model name, a model directory, or a GGUF file.
    #[arg(long, default_value = store::DEFAULT_MODEL)]
    model: String,
    /// Serve on this unix socket (standalone mode).
    #[arg(long, required_unless_present = "control", conflicts_with = "control")]
    unix: Option<PathBuf>,
    /// Run under the mlxd supervisor: read Launch from stdin, report on stdout.
    #[arg(long)]
    control: bool,
    /// Model store directory (default: $MLXD_HOME, else ~/.cache/mlxd).
    #[arg(long)]
    home: Option<PathBuf>,
    /// Cap on prompt + generated tokens (default: the model's own).
    #[arg(long)]
    context_length: Option<usize>,
    /// Sequences generated at once; more wait in line.
    #[arg(long)]
    max_batch_size: Option<usize>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logging(args.control);
    let home = match args.home {
        Some(home) => home,
        None => store::default_home()?,
    };
    if args.control {
        return app::run_supervised(&home);
    }
    let limits = WorkerLimits {
        max_batch_size: args.max_batch_size,
        kv_budget_bytes: None,
        context_length: args.context_length,
    };
    let engine = app::load(&args.model, &home, limits, None)?;
    let socket = args.unix.expect("clap requires --unix without --control");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(app::serve_standalone(engine, &socket))
}

/// Logs go to stderr: JSON lines under the supervisor (it re-emits them), text otherwise.
fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
