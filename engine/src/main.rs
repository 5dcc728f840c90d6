//! `mlxd-engine`: one model, served over HTTP on a unix socket.
//!
//! Standalone, for debugging and tests: `mlxd-engine --model <name|dir|file.gguf> --unix <path>`.
//! Under `mlxd`: `mlxd-engine --control` (the model and socket come in the `Launch` message).
use std::path::PathBuf;

use clap::Parser;
use mlxd_engine::app;
use mlxd_engine::cache::KvQuant;
use mlxd_engine::runtime::{RuntimeLimits, DEFAULT_MAX_BATCH_SIZE};
use mlxd_store as store;

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
    /// Sequences decoded together in one forward pass; more wait in line.
    #[arg(long, default_value_t = DEFAULT_MAX_BATCH_SIZE as u64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_batch_size: u64,
    /// KV cache bytes that running sequences may reserve (prompt + max_tokens each);
    /// default: no limit.
    #[arg(long)]
    kv_budget_bytes: Option<u64>,
    /// GiB of KV the prefix cache keeps between requests, reused by prompts that share a
    /// prefix (multi-turn chats, system prompts); 0 disables it.
    #[arg(long, default_value_t = 1.0, value_parser = parse_gib)]
    prompt_cache: f64,
    /// Quantize the KV cache to 4 or 8 bits (attention then runs on MLX's quantized matmuls);
    /// default: keep the model's dtype.
    #[arg(long, value_parser = clap::value_parser!(i32).range(4..=8))]
    kv_bits: Option<i32>,
    /// Elements of a head that share one scale and bias when the KV cache is quantized.
    #[arg(long, default_value_t = 64, requires = "kv_bits")]
    kv_group_size: i32,
}

fn parse_gib(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of GiB: {e}"))?;
    if v.is_finite() && (0.0..=1024.0 * 1024.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} GiB is outside 0..=1048576"))
    }
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
    let limits = RuntimeLimits {
        max_batch_size: args.max_batch_size as usize,
        kv_budget_bytes: args.kv_budget_bytes,
        context_length: args.context_length,
        prompt_cache_bytes: (args.prompt_cache * (1u64 << 30) as f64) as u64,
        kv_quant: args.kv_bits.map(|bits| KvQuant {
            bits,
            group_size: args.kv_group_size,
        }),
        ..RuntimeLimits::default()
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
