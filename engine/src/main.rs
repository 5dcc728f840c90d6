//! `mlxd-engine`: one model, served over HTTP on a unix socket.
//!
//! Standalone, for debugging and tests: `mlxd-engine --model <name|dir|file.gguf> --unix <path>`.
//! Under `mlxd`: `mlxd-engine --control` (the model and socket come in the `Launch` message),
//! and `mlxd-engine __job <spec>` for one managed job (`mlxd_engine::job`).
use std::path::PathBuf;

use clap::Parser;
use mlxd_engine::app;
use mlxd_engine::runtime::RuntimeLimits;
use mlxd_protocol::engine_options::EngineOptions;
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
    /// Serve on this unix socket (standalone mode; in an engine group, rank 0's).
    #[arg(
        long,
        required_unless_present_any = ["control", "distributed"],
        conflicts_with = "control"
    )]
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
    /// Sequences decoded together in one forward pass; more wait in line [default: 128 on a
    /// GPU, 64 on the CPU].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    max_batch_size: Option<u64>,
    /// KV cache bytes that running sequences may reserve (prompt + max_tokens each);
    /// default: no limit.
    #[arg(long)]
    kv_budget_bytes: Option<u64>,
    /// In an engine group, a rank other than 0: exit when stdin reaches its end (rank 0
    /// starts the ranks on other machines through ssh with this: they end with the
    /// connection).
    #[arg(long, requires = "distributed")]
    until_stdin_closes: bool,
    /// In an engine group, a rank other than 0: load this copy of rank 0's model (a
    /// directory on this host) instead of the path rank 0 names.
    #[arg(long, requires = "distributed")]
    rank_model: Option<String>,
    /// The tuning options (`mlxd_protocol::engine_options`: the same flags as `mlxd serve`,
    /// the same checks as `Launch.options`).
    #[command(flatten)]
    options: EngineOptions,
}

fn main() -> anyhow::Result<()> {
    // First, before other threads start: freed memory goes back to the kernel
    // (`mlxd_ipc::heap`), for the supervised engine, standalone, and managed jobs alike.
    mlxd_ipc::heap::configure()?;
    mlxd_ipc::heap::spawn_trimmer()?;
    // The supervisor's private entry for managed jobs (`mlxd-engine __job <spec>`), kept out
    // of the flags and the help: only `mlxd` starts it.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(mlxd_protocol::jobs::JOB_ENTRY) {
        init_logging(true);
        let Some(spec) = argv.get(2) else {
            eprintln!(
                "mlxd-engine: {} needs a job spec",
                mlxd_protocol::jobs::JOB_ENTRY
            );
            std::process::exit(2);
        };
        std::process::exit(mlxd_engine::job::main(spec));
    }
    let args = Args::parse();
    init_logging(args.control);
    mlxd_engine::models::layers::unfused_attention_from_env().map_err(anyhow::Error::msg)?;
    mlxd_engine::models::stacked::stacked_projections_from_env().map_err(anyhow::Error::msg)?;
    let home = match args.home {
        Some(home) => home,
        None => store::default_home()?,
    };
    match mlxd_engine::kernel_cache::keep_in_store(&home) {
        Ok(dir) => tracing::debug!(dir = %dir.display(), "compiled GPU kernels kept here"),
        Err(e) => tracing::warn!(
            error = %e,
            "compiled GPU kernels stay in MLX's default directory (under /tmp: a reboot empties it)"
        ),
    }
    if args.control {
        return app::run_supervised(&home);
    }
    if let Some(backend) = args.options.distributed.clone() {
        // One rank of an engine group, as `mlx.launch` starts it: rank 0's model, limits and
        // options are every rank's.
        let given = app::group::Setup {
            model: args.model.clone(),
            max_batch_size: args.max_batch_size.map(|n| n as usize),
            kv_budget_bytes: args.kv_budget_bytes,
            context_length: args.context_length,
            options: args.options.to_map(),
        };
        if args.until_stdin_closes {
            app::exit_when_stdin_closes()?;
        }
        return app::group::run_standalone(
            &backend,
            &home,
            given,
            args.unix.as_deref(),
            args.rank_model,
        );
    }
    let limits = RuntimeLimits {
        max_batch_size: args.max_batch_size.map(|n| n as usize),
        kv_budget_bytes: args.kv_budget_bytes,
        context_length: args.context_length,
        ..RuntimeLimits::default()
    };
    let app::LaunchOptions { limits, draft } = app::runtime_options(&args.options, limits)?;
    if let Some(spec) = mlxd_engine::fault::from_env().map_err(anyhow::Error::msg)? {
        mlxd_engine::fault::arm(spec);
    }
    let engine = app::load(&args.model, &home, limits, draft, None)?;
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
