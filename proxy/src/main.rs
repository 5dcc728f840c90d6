//! `mlxd`: parse flags, set up logging, bind, and run [`mlxd_proxy::serve`] until SIGINT or
//! SIGTERM; or run one of the store verbs (`pull`, `ls`, `rm`) on the local store, or one of
//! the client verbs (`run`, `ps`, `stop`, `bench`, `ls --server`) against a running server.

use std::io::{IsTerminal, Read};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use mlxd_client::{ChatCompletionRequest, ChatMessage, Role};
use mlxd_proxy::catalog::Catalog;
use mlxd_proxy::cli::{BenchArgs, Cli, Command, JobsAction, LogFormat, QuantizeArgs, RunArgs};
use mlxd_proxy::client::{self, exit_code, Target};
use mlxd_proxy::config::EXIT_CONFIG;
use mlxd_proxy::repl;
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

/// A client verb's failure: the exit code scripts see, and the line people read.
struct Failure {
    code: i32,
    message: String,
}

impl Failure {
    fn usage(message: impl Into<String>) -> Self {
        Self {
            code: exit_code::USAGE,
            message: message.into(),
        }
    }

    /// Classifies an error of the verbs: unreachable servers name the server tried and how it
    /// was chosen.
    fn of(e: anyhow::Error, target: Option<&Target>) -> Self {
        let server = target.map_or(String::new(), |t| format!(" ({})", t.from));
        if let Some(c) = e.downcast_ref::<mlxd_client::ClientError>() {
            if let mlxd_client::ClientError::Connect { target, detail } = c {
                return Self {
                    code: exit_code::UNREACHABLE,
                    message: format!(
                        "cannot reach mlxd at {target}{server}: {detail} (is `mlxd serve` \
                         running?)"
                    ),
                };
            }
            return Self {
                code: client::client_exit_code(c),
                message: format!("{e:#}"),
            };
        }
        if let Some(c) = e.downcast_ref::<client::ClientError>() {
            let message = match c {
                client::ClientError::Connect { url, detail } => format!(
                    "cannot reach mlxd at {url}{server}: {detail} (is `mlxd serve` running?)"
                ),
                client::ClientError::Timeout { .. } => format!("{c}{server}"),
                _ => format!("{e:#}"),
            };
            return Self {
                code: c.exit_code(),
                message,
            };
        }
        if e.downcast_ref::<mlxd_proxy::config::ConfigError>()
            .is_some()
        {
            return Self::usage(format!("{e:#}"));
        }
        Self {
            code: exit_code::SERVER,
            message: format!("{e:#}"),
        }
    }
}

fn main() -> anyhow::Result<()> {
    // First, before the runtime's threads start: freed memory (request bodies, connection
    // buffers) goes back to the kernel (`mlxd_ipc::heap`).
    mlxd_ipc::heap::configure()?;
    mlxd_ipc::heap::spawn_trimmer()?;
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match &cli.command {
        Some(Command::Serve(_)) | None => {}
        Some(verb) => {
            // One line that says what went wrong (and what to do), not a debug dump.
            if let Err(f) = rt.block_on(run_verb(verb)) {
                eprintln!("mlxd: {}", f.message);
                std::process::exit(f.code);
            }
            return Ok(());
        }
    }
    let args = cli.serve_args().context("serve arguments")?;
    // Kept to read the configuration again on SIGHUP (flags still override the file).
    let reload_args = args.clone();
    let json_logs = args.log_format == LogFormat::Json;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(mlxd_proxy::progress::LogWriter)
            .with_ansi(std::io::stderr().is_terminal())
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(mlxd_proxy::progress::LogWriter)
            .init(),
    }
    // An unusable configuration exits with EX_USAGE and says where the problem is.
    let config = match args
        .into_config()
        .and_then(|c| {
            // A configured model that can never fit the memory budget is refused here, not
            // served at start and refused at every request after.
            let catalog = Catalog::from_config(&c)?;
            match mlxd_proxy::server::oversized_models(&catalog, &c) {
                Some(why) => Err(mlxd_proxy::config::ConfigError::Setting {
                    field: "pool.memory_budget".into(),
                    message: why,
                }),
                None => Ok(c),
            }
        })
        .and_then(|c| c.api_keys().map(|_| c))
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mlxd: invalid configuration: {e}");
            std::process::exit(EXIT_CONFIG);
        }
    };
    rt.block_on(async move {
        let addr = format!("{}:{}", config.server.host, config.server.port);
        let listener = match tokio::net::TcpListener::bind(&addr).await {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                eprintln!(
                    "mlxd: {addr} is already in use{}; stop that process, or serve on another \
                     port with --port (or MLXD_PORT, or `port` in mlxd.toml)",
                    mlxd_proxy::port_owner::holder(config.server.port)
                        .map(|h| format!(" by {h}"))
                        .unwrap_or_default()
                );
                std::process::exit(1);
            }
            Err(e) => return Err(e).with_context(|| format!("binding {addr}")),
        };
        // Bound first (a taken port fails at once); the default model is fetched and
        // converted before serving, with progress, so no engine load timeout can cut a
        // download short. Connections meanwhile wait in the backlog. Then its engine loads
        // (with progress) while requests are served, and the URL line follows.
        // SIGHUP's default action ends the process: take it over before anything slow.
        let mut hup = signal(SignalKind::hangup())?;
        prepare_default_model(&config, json_logs).await;
        let (reload_tx, reloads) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP received: reading the configuration again");
                match reload_args.clone().into_config() {
                    Ok(c) => {
                        if reload_tx.send(c).is_err() {
                            return;
                        }
                    }
                    Err(e) => tracing::warn!(
                        error = %e,
                        "configuration reload refused; the running configuration stays"
                    ),
                }
            }
        });
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            }
        };
        let options = mlxd_proxy::ServeOptions {
            reloads: Some(reloads),
            preload: Some(mlxd_proxy::Preload { json_logs }),
        };
        mlxd_proxy::serve_with(listener, config, shutdown, options).await?;
        Ok(())
    })
}

/// Fetches and converts the default model into the store before serving, when it is a
/// known name, a `.gguf` file or a Hugging Face repo id (a model directory needs nothing; any
/// other name is the engine's to resolve). A failure is logged and serving goes on: the
/// engine reports it again, per request, with the same reason.
async fn prepare_default_model(config: &mlxd_proxy::Config, json_logs: bool) {
    let Ok(catalog) = Catalog::from_config(config) else {
        return;
    };
    let Ok(entry) = catalog.resolve(None) else {
        return;
    };
    let spec = entry.source.clone();
    let path = std::path::Path::new(&spec);
    let fetchable = mlxd_store::KNOWN_MODELS.iter().any(|k| k.name == spec)
        || (path.is_file() && path.extension().is_some_and(|e| e == "gguf"))
        || (!path.exists() && mlxd_store::HfRepoId::parse(&spec).is_some());
    if !fetchable {
        return;
    }
    let home = match mlxd_store::default_home() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(error = %e, "cannot prepare the default model");
            return;
        }
    };
    let mut opts = mlxd_store::StoreOptions::from_env(&home);
    opts.progress = mlxd_proxy::progress::to_stderr(json_logs);
    let start = Instant::now();
    let id = entry.id.clone();
    match tokio::task::spawn_blocking(move || mlxd_store::resolve_model_with(&spec, &opts)).await {
        Ok(Ok(resolved)) => {
            tracing::info!(
                model = %id,
                seconds = start.elapsed().as_secs_f64(),
                "default model ready in the store"
            );
            tracing::debug!(model = %id, dir = %resolved.dir.display(), "default model's directory");
        }
        Ok(Err(e)) => {
            tracing::warn!(model = %id, error = %e, "the default model could not be prepared")
        }
        Err(e) => tracing::warn!(model = %id, error = %e, "preparing the default model failed"),
    }
}

/// Every verb but `serve`.
async fn run_verb(verb: &Command) -> Result<(), Failure> {
    // The server the client verbs talk to; found before anything else, so every failure can
    // say which server was tried.
    let client_args = match verb {
        Command::Ps(a) => Some(&a.client),
        Command::Ls(a) if a.server || a.client.url.is_some() => Some(&a.client),
        Command::Stop(a) => Some(&a.client),
        Command::Run(a) => Some(&a.client),
        Command::Bench(a) => Some(&a.client),
        Command::Quantize(a) => Some(&a.client),
        Command::Train(a) => Some(&a.client),
        Command::Fuse(a) => Some(&a.client),
        Command::Jobs(a) => Some(&a.client),
        Command::Adapter(a) => Some(&a.client),
        Command::Serve(_)
        | Command::Ls(_)
        | Command::Pull(_)
        | Command::Rm(_)
        | Command::Show(_) => None,
    };
    let target = match client_args {
        Some(c) => Some(
            c.target()
                .map_err(|e| Failure::usage(format!("finding the server: {e}")))?,
        ),
        None => None,
    };
    let t = target.as_ref();
    let result = match (verb, t) {
        (Command::Run(a), Some(t)) => run_chat(a, t).await,
        (Command::Bench(a), Some(t)) => bench(a, t).await,
        (verb, t) => other_verb(verb, t).await,
    };
    result.map_err(|e| Failure::of(e, t))
}

/// The verbs other than `run` and `bench`; `target` is the server of the client verbs.
async fn other_verb(verb: &Command, target: Option<&Target>) -> anyhow::Result<()> {
    let target = || target.context("no server for a client verb");
    match verb {
        Command::Serve(_) => anyhow::bail!("serve is not a client verb"),
        Command::Run(_) | Command::Bench(_) => anyhow::bail!("run and bench have their own paths"),
        Command::Ps(a) => {
            let engines = target()?
                .server()
                .json("GET", "/engines", None)
                .await
                .context("listing the engines")?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&engines)?);
            } else {
                print!("{}", client::ps_table(&engines, a.verbose));
            }
        }
        Command::Ls(a) if a.server || a.client.url.is_some() => {
            let server = target()?.server();
            let engines = server
                .json("GET", "/engines", None)
                .await
                .context("listing the server's models")?;
            let models = server
                .json("GET", "/v1/models", None)
                .await
                .context("listing the server's models")?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&engines)?);
            } else {
                print!("{}", client::ls_table(&engines, &models, a.verbose));
            }
        }
        Command::Ls(a) => {
            let opts = a.store.options()?;
            let models = mlxd_store::inventory::list(&opts);
            if models.is_empty() {
                eprintln!(
                    "mlxd: no models in {} or the Hugging Face cache; `mlxd pull {}` fetches \
                     the default one",
                    opts.home.display(),
                    mlxd_store::DEFAULT_MODEL
                );
            } else {
                print!("{}", client::store_table(&models));
            }
        }
        Command::Pull(a) => pull(a).await?,
        Command::Rm(a) => {
            let opts = a.store.options()?;
            let removed = mlxd_store::inventory::remove(&a.model, &opts)?;
            for d in &removed.dirs {
                println!("removed {}", d.display());
            }
            println!("freed {}", mlxd_proxy::config::Bytes(removed.bytes));
        }
        Command::Show(a) => {
            let opts = a.store.options()?;
            let facts = mlxd_store::facts::show(&a.model, &opts)?;
            print!("{}", mlxd_proxy::show::render(&a.model, &facts, a.template));
        }
        Command::Stop(a) => {
            let path = format!("/admin/models/{}/unload", a.model);
            let v = target()?
                .server()
                .json("POST", &path, None)
                .await
                .with_context(|| format!("stopping {}", a.model))?;
            println!(
                "{}: {}",
                v["model"].as_str().unwrap_or(&a.model),
                v["state"].as_str().unwrap_or("stopped")
            );
        }
        Command::Quantize(a) => quantize(a, target()?).await?,
        Command::Train(a) => train(a, target()?).await?,
        Command::Fuse(a) => fuse(a, target()?).await?,
        Command::Jobs(a) => {
            let tasks = mlxd_client::TaskClient::new(target()?.client()?);
            match &a.action {
                None => print!(
                    "{}",
                    mlxd_proxy::jobs::display::jobs_table(&tasks.list().await?)
                ),
                Some(JobsAction::Cancel { id }) => {
                    let job = tasks
                        .cancel(id)
                        .await
                        .with_context(|| format!("cancelling job {id}"))?;
                    println!("{} {}", job.id, job.state.as_str());
                }
            }
        }
        Command::Adapter(a) => adapter(&a.action, target()?).await?,
    }
    Ok(())
}

/// `mlxd adapter load|unload|ls`: the admin routes `/admin/models/{id}/adapters`, through
/// `mlxd-client`.
async fn adapter(action: &mlxd_proxy::cli::AdapterAction, target: &Target) -> anyhow::Result<()> {
    use mlxd_proxy::cli::AdapterAction;
    let client = target.client()?;
    match action {
        AdapterAction::Load { model, name, dir } => {
            let dir = std::path::absolute(dir)
                .with_context(|| format!("making {} absolute", dir.display()))?;
            let a = client
                .load_adapter(model, name, &dir)
                .await
                .with_context(|| format!("loading adapter {name} into {model}"))?;
            println!(
                "{} loaded ({}, rank {}, {} layers)",
                a.id, a.fine_tune_type, a.rank, a.layers
            );
        }
        AdapterAction::Unload { model, name } => {
            let a = client
                .unload_adapter(model, name)
                .await
                .with_context(|| format!("unloading adapter {name} from {model}"))?;
            println!("{} unloaded", a.id);
        }
        AdapterAction::Ls { model } => {
            let list = client
                .adapters(model)
                .await
                .with_context(|| format!("listing the adapters of {model}"))?;
            if list.data.is_empty() {
                println!("{} has no adapters", list.model);
            }
            for a in list.data {
                let from = if a.runtime { "run time" } else { "configured" };
                println!("{}\t{from}\t{}", a.id, a.path);
            }
        }
    }
    Ok(())
}

/// `mlxd pull`: fetches into the store, with progress.
async fn pull(a: &mlxd_proxy::cli::PullArgs) -> anyhow::Result<()> {
    let mut opts = a.store.options()?;
    opts.progress = mlxd_proxy::progress::to_stderr(false);
    let spec = a.model.clone();
    eprintln!("mlxd: pulling {spec} (downloads and conversions can take minutes)");
    // What an earlier pull killed outright (SIGKILL, a crash) left behind.
    let (swept, _) = mlxd_store::sweep_stale_staging(&opts.home);
    for path in swept {
        tracing::info!(path = %path.display(), "removed the staging directory of an earlier, interrupted pull");
    }
    // Listened for before the work starts, so that an early Ctrl-C is ours too.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let start = Instant::now();
    let job_opts = opts.clone();
    // The store blocks (file locks, downloads, conversion): off the async threads.
    let job = tokio::task::spawn_blocking(move || mlxd_store::resolve_model_with(&spec, &job_opts));
    let resolved = tokio::select! {
        r = job => r??,
        _ = interrupt.recv() => interrupted(&a.model, &opts, 130),
        _ = terminate.recv() => interrupted(&a.model, &opts, 143),
    };
    if let Some(missing) = mlxd_store::inventory::incomplete(&resolved.dir) {
        anyhow::bail!(
            "{} is not a complete model: {missing}",
            resolved.dir.display()
        );
    }
    println!(
        "{} ready in {:.1} s: {} ({})",
        resolved.id,
        start.elapsed().as_secs_f64(),
        resolved.dir.display(),
        mlxd_store::inventory::format_of(&resolved.dir)
    );
    Ok(())
}

/// A pull stopped by SIGINT or SIGTERM: what it left that no later pull could use goes at
/// once ([`mlxd_store::interrupt::clean_up`]), and the process exits with `code` (128 plus
/// the signal) while the store's worker thread is still mid-way.
fn interrupted(spec: &str, opts: &mlxd_store::StoreOptions, code: i32) -> ! {
    let done = mlxd_store::interrupt::clean_up(spec, opts, std::process::id());
    eprintln!(
        "\nmlxd: pull of {spec} interrupted; removed {} partial file(s)",
        done.removed.len()
    );
    for (path, e) in &done.failed {
        eprintln!("mlxd: could not remove {}: {e}", path.display());
    }
    let kept: u64 = done.resumable.iter().map(|(_, n)| n).sum();
    if !done.resumable.is_empty() {
        eprintln!(
            "mlxd: kept {} already downloaded; `mlxd pull {spec}` resumes from there",
            mlxd_proxy::config::Bytes(kept)
        );
    }
    std::process::exit(code)
}

/// A model for a job as the server must see it: an existing local directory made absolute,
/// anything else (a configured id, a store name, a repo id) as given.
fn job_model(model: &str) -> String {
    match std::fs::canonicalize(model) {
        Ok(p) if p.is_dir() => p.display().to_string(),
        _ => model.to_owned(),
    }
}

/// Where a job writes (or what it reads from the store): a plain name is the server's store
/// entry; any other relative path is made absolute here, since the server resolves paths.
fn store_name_or_path(p: &std::path::Path) -> anyhow::Result<String> {
    Ok(match p.to_str() {
        Some(name) if mlxd_store::inventory::is_plain_name(name) => name.to_string(),
        _ if p.is_relative() => std::env::current_dir()?.join(p).display().to_string(),
        _ => p.display().to_string(),
    })
}

/// Says on stderr which job was submitted, its state and the memory it is counted for.
fn announce(job: &mlxd_client::Job) {
    eprintln!(
        "mlxd: {} {} (counted for {} of memory){}",
        job.id,
        job.state.as_str(),
        mlxd_proxy::config::Bytes(job.memory_bytes),
        job.waiting_for
            .as_deref()
            .map(|w| format!("; waiting for {w}"))
            .unwrap_or_default()
    );
}

/// Follows job `id` with a progress bar (plain lines when stderr is not a terminal) to its
/// result; on Ctrl-C cancels it and fails with `<id> <state>: <on_cancel>`.
async fn follow_job(
    tasks: &mlxd_client::TaskClient,
    id: &str,
    on_cancel: &str,
) -> anyhow::Result<mlxd_client::JobResult> {
    let mut view = mlxd_proxy::jobs::display::ProgressView::for_stderr();
    let outcome = tokio::select! {
        done = tasks.wait(id, |p| view.show(p)) => done,
        _ = tokio::signal::ctrl_c() => {
            view.finish();
            let cancelled = tasks.cancel(id).await?;
            anyhow::bail!("{} {}: {on_cancel}", cancelled.id, cancelled.state.as_str());
        }
    };
    view.finish();
    outcome?
        .result
        .context("the server reported success without a result")
}

/// `<model> ready in <s> s: <dir> (<size>)`, after `prefix`.
fn print_ready(prefix: &str, result: &mlxd_client::JobResult) {
    println!(
        "{prefix}{} ready in {:.1} s: {} ({})",
        result.model_id,
        result.seconds,
        result.dir.display(),
        mlxd_proxy::config::Bytes(result.bytes)
    );
}

/// `mlxd quantize`: submits the job, follows it with a progress bar (plain lines when stderr
/// is not a terminal), and cancels it on Ctrl-C.
async fn quantize(a: &QuantizeArgs, target: &Target) -> anyhow::Result<()> {
    let tasks = mlxd_client::TaskClient::new(target.client()?);
    let job = tasks
        .submit(&mlxd_client::JobRequest::Quantize {
            model: job_model(&a.model),
            bits: Some(a.bits),
            group_size: Some(a.group_size),
            out: a.out.as_deref().map(store_name_or_path).transpose()?,
        })
        .await?;
    if a.detach {
        println!("{}", job.id);
        return Ok(());
    }
    announce(&job);
    let result = follow_job(&tasks, &job.id, "nothing was written").await?;
    print_ready("", &result);
    Ok(())
}

/// `mlxd train`: submits a `lora` job, follows it (iteration, losses, tokens/s, peak memory),
/// and cancels it on Ctrl-C (its checkpoints stay for `--resume`).
async fn train(a: &mlxd_proxy::cli::TrainArgs, target: &Target) -> anyhow::Result<()> {
    let tasks = mlxd_client::TaskClient::new(target.client()?);
    let absolute = |p: &std::path::Path| -> anyhow::Result<String> {
        Ok(std::fs::canonicalize(p)
            .with_context(|| format!("{}", p.display()))?
            .display()
            .to_string())
    };
    let mut body = a.params_json();
    body.insert("kind".into(), "lora".into());
    body.insert("model".into(), job_model(&a.model).into());
    body.insert("data".into(), absolute(&a.data)?.into());
    if let Some(o) = &a.out {
        body.insert("out".into(), store_name_or_path(o)?.into());
    }
    if a.resume {
        body.insert("resume".into(), true.into());
    }
    if let Some(f) = &a.resume_adapter_file {
        body.insert("init_adapter".into(), absolute(f)?.into());
    }
    let request: mlxd_client::JobRequest =
        serde_json::from_value(body.into()).context("the train options do not make a lora job")?;
    let job = tasks.submit(&request).await?;
    if a.detach {
        println!("{}", job.id);
        return Ok(());
    }
    announce(&job);
    let result = follow_job(
        &tasks,
        &job.id,
        "no adapter written; `mlxd train ... --resume` continues from the last checkpoint",
    )
    .await?;
    print_ready("adapter ", &result);
    Ok(())
}

/// `mlxd fuse`: submits a `fuse` job and follows it.
async fn fuse(a: &mlxd_proxy::cli::FuseArgs, target: &Target) -> anyhow::Result<()> {
    let tasks = mlxd_client::TaskClient::new(target.client()?);
    let job = tasks
        .submit(&mlxd_client::JobRequest::Fuse {
            model: job_model(&a.model),
            adapter: store_name_or_path(&a.adapter)?,
            out: a.out.as_deref().map(store_name_or_path).transpose()?,
        })
        .await?;
    if a.detach {
        println!("{}", job.id);
        return Ok(());
    }
    let result = follow_job(&tasks, &job.id, "nothing was written").await?;
    print_ready("", &result);
    Ok(())
}

/// `mlxd run`: one streamed answer (to the prompt, piped stdin, or both), or a chat on the
/// terminal that keeps the conversation.
async fn run_chat(a: &RunArgs, target: &Target) -> anyhow::Result<()> {
    let client = target.client()?;
    let settings = repl::command::ChatSettings {
        system: a.system.clone(),
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_tokens: a.max_tokens,
        verbose: a.verbose,
    };
    let stdin_piped = !std::io::stdin().is_terminal();
    if a.prompt.is_some() || stdin_piped {
        let mut piped = String::new();
        if stdin_piped {
            std::io::stdin()
                .read_to_string(&mut piped)
                .context("reading the piped input")?;
        }
        let Some(prompt) = repl::input::piped_prompt(a.prompt.as_deref(), &piped) else {
            return Err(anyhow::Error::new(
                mlxd_proxy::config::ConfigError::Setting {
                    field: "mlxd run".into(),
                    message: "nothing to send: no prompt and the piped input is empty".into(),
                },
            ));
        };
        let chat = repl::Chat {
            client: &client,
            model: a.model.clone(),
            shown_model: a.model.clone().unwrap_or_default(),
            server: target.describe(),
        };
        return repl::one_shot(&chat, &settings, prompt)
            .await
            .map(|_| ())
            .map_err(chat_error);
    }
    // Ask for the models first: an unreachable server fails before the prompt appears, and
    // the default model gets its name.
    let models = target
        .server()
        .json("GET", "/v1/models", None)
        .await
        .context("listing the server's models")?;
    let shown_model = match &a.model {
        Some(m) => m.clone(),
        None => models["data"]
            .as_array()
            .and_then(|d| d.iter().find(|m| m["default"] == true).or(d.first()))
            .and_then(|m| m["id"].as_str())
            .unwrap_or("the default model")
            .to_string(),
    };
    let chat = repl::Chat {
        client: &client,
        model: a.model.clone(),
        shown_model,
        server: target.describe(),
    };
    repl::interactive(&chat, settings).await.map_err(chat_error)
}

/// A chat's error for [`Failure::of`]: a client error as itself, so it is classified.
fn chat_error(e: repl::ChatError) -> anyhow::Error {
    match e {
        repl::ChatError::Client(c) => anyhow::Error::new(c),
        other => anyhow::Error::new(other),
    }
}

/// `mlxd bench`: a warm-up request, then `requests` runs of the prompt cold (behind a prefix
/// no earlier request had, so the prompt cache cannot serve it) and again cached.
async fn bench(a: &BenchArgs, target: &Target) -> anyhow::Result<()> {
    let client = target.client()?;
    let request = |prefix: &str| {
        let mut r = ChatCompletionRequest {
            model: Some(a.model.clone()),
            messages: vec![ChatMessage::new(
                Role::User,
                format!("{prefix}{}", a.prompt),
            )],
            ..Default::default()
        };
        r.params.max_tokens = Some(i64::from(a.max_tokens));
        r.params.temperature = Some(0.0);
        r
    };
    // Different on every run of the command too, so no earlier bench warms the cache.
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let once = |r: ChatCompletionRequest| {
        let client = &client;
        async move {
            let mut painter = repl::answer::Painter::new(false);
            repl::answer::stream(client, r, &mut painter, false, std::future::pending()).await
        }
    };
    eprintln!("mlxd: warming up {} at {}", a.model, target.describe());
    once(request(&format!("[warm-up {nonce}] "))).await?;
    let mut runs = Vec::new();
    for i in 0..a.requests {
        eprintln!("mlxd: run {} of {}", i + 1, a.requests);
        let prompt = request(&format!("[run {} {nonce}] ", i + 1));
        let cold = once(prompt.clone()).await?;
        let cached = once(prompt).await?;
        runs.push(client::BenchRun { cold, cached });
    }
    print!("{}", client::bench_table(&runs));
    if runs
        .iter()
        .all(|r| r.cold.cached_tokens.is_none() && r.cached.cached_tokens.is_none())
    {
        eprintln!("mlxd: the server reported no prompt-cache counts; CACHE is what was sent");
    }
    Ok(())
}
