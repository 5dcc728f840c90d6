//! `mlxd-engine`: one model, served over HTTP on a unix socket.
//!
//! Standalone, for debugging and tests: `mlxd-engine --model <name|dir|file.gguf> --unix <path>`.
//! Under `mlxd`: `mlxd-engine --control` (the model and socket come in the `Launch` message),
//! and `mlxd-engine __job <spec>` for one managed job (`mlxd_engine::job`).
use std::path::PathBuf;

use clap::Parser;
use mlxd_engine::app::{self, DraftChoice, DraftOptions, SsdOptions};
use mlxd_engine::cache::KvQuant;
use mlxd_engine::runtime::draft::{NgramSizes, DEFAULT_NGRAM, DEFAULT_NUM_DRAFT, MAX_NUM_DRAFT};
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
    /// With `--kv-bits`: a sequence's KV stays in the model's dtype until it holds more than
    /// this many tokens, then converts (as mlx-lm's `--quantized-kv-start`); 0 quantizes from
    /// the first token.
    #[arg(long, default_value_t = 0, requires = "kv_bits")]
    quantized_kv_start: usize,
    /// Speculative decoding with prompt-lookup drafts: `ngram` proposes the tokens that
    /// followed the text's own ending where it occurred before (prompt or output).
    #[arg(long, value_parser = ["ngram"], conflicts_with = "draft_model")]
    draft: Option<String>,
    /// Speculative decoding with a smaller model (name, directory or GGUF) that has the same
    /// tokenizer; refused when the tokenizers differ.
    #[arg(long)]
    draft_model: Option<String>,
    /// Drafted tokens verified per forward pass of the model (default 3; with `--draft` or
    /// `--draft-model`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_NUM_DRAFT as u64))]
    num_draft_tokens: Option<u64>,
    /// Longest n-gram prompt lookup matches (with `--draft ngram`).
    #[arg(long, default_value_t = DEFAULT_NGRAM.max as u64, requires = "draft",
          value_parser = clap::value_parser!(u64).range(1..=64))]
    ngram_max: u64,
    /// Shortest n-gram prompt lookup matches (with `--draft ngram`).
    #[arg(long, default_value_t = DEFAULT_NGRAM.min as u64, requires = "draft",
          value_parser = clap::value_parser!(u64).range(1..=64))]
    ngram_min: u64,
    /// Write prefix-cache entries behind to this directory (one subdirectory per model), so
    /// that a restarted engine restores prefixes from disk instead of prefilling them.
    #[arg(long)]
    ssd_cache: Option<PathBuf>,
    /// GiB the model's SSD cache files may take; the oldest are deleted past it (0 =
    /// unlimited).
    #[arg(long, requires = "ssd_cache", value_parser = parse_gib)]
    ssd_cache_max: Option<f64>,
    /// Seconds after which an unused prefix leaves memory; it stays on disk.
    #[arg(long, requires = "ssd_cache", value_parser = parse_seconds)]
    ssd_demote_idle: Option<f64>,
    /// Every N generated tokens, write a running request's KV to the SSD cache, so a resume
    /// after a crash restores instead of prefilling.
    #[arg(long, requires = "ssd_cache", value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    generation_checkpoint: Option<u64>,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    if v.is_finite() && v > 0.0 && v <= 1e9 {
        Ok(v)
    } else {
        Err(format!("{s} s is not a duration > 0"))
    }
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
        quantized_kv_start: args.quantized_kv_start,
        ssd: SsdOptions {
            dir: args.ssd_cache,
            max_gib: args.ssd_cache_max,
            demote_idle_s: args.ssd_demote_idle,
            checkpoint_every: args.generation_checkpoint.map(|n| n as usize),
        }
        .config()
        .map_err(|(key, reason)| anyhow::anyhow!("{key}: {reason}"))?,
        ..RuntimeLimits::default()
    };
    if let Some(spec) = mlxd_engine::fault::from_env().map_err(anyhow::Error::msg)? {
        mlxd_engine::fault::arm(
            spec,
            Box::new(|message| {
                tracing::error!(%message, "out of memory; exiting");
                std::process::exit(3);
            }),
        );
    }
    let choice = match (args.draft, args.draft_model) {
        (Some(_), _) => Some(DraftChoice::Ngram(
            NgramSizes::new(args.ngram_min as usize, args.ngram_max as usize)
                .map_err(anyhow::Error::msg)?,
        )),
        (None, Some(spec)) => Some(DraftChoice::Model(spec)),
        (None, None) => None,
    };
    if choice.is_none() && args.num_draft_tokens.is_some() {
        anyhow::bail!("--num-draft-tokens needs --draft ngram or --draft-model");
    }
    let draft = choice.map(|choice| DraftOptions {
        choice,
        num_draft: args
            .num_draft_tokens
            .map_or(DEFAULT_NUM_DRAFT, |n| n as usize),
    });
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
