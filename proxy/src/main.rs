//! `mlxd`: parse flags, set up logging, bind, and run [`mlxd_proxy::serve`] until SIGINT or
//! SIGTERM; or run one of the store verbs (`pull`, `ls`, `rm`) on the local store, or one of
//! the client verbs (`run`, `ps`, `stop`, `bench`, `ls --server`) against a running server.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use mlxd_client::{ChatCompletionRequest, ChatMessage, CompletionClient, Role};
use mlxd_proxy::catalog::Catalog;
use mlxd_proxy::cli::{BenchArgs, Cli, Command, JobsAction, LogFormat, QuantizeArgs, RunArgs};
use mlxd_proxy::client;
use mlxd_proxy::config::EXIT_CONFIG;
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match &cli.command {
        Some(Command::Serve(_)) | None => {}
        Some(verb) => {
            // One line that says what went wrong (and what to do), not a debug dump.
            if let Err(e) = rt.block_on(run_verb(verb)) {
                // The client crate's connect error, in the words of the other client verbs.
                if let Some(mlxd_client::ClientError::Connect { target, detail }) = e.downcast_ref()
                {
                    eprintln!(
                        "mlxd: cannot reach mlxd at {target}: {detail} (is `mlxd serve` running?)"
                    );
                    std::process::exit(1);
                }
                eprintln!("mlxd: {e:#}");
                std::process::exit(1);
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
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
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
async fn run_verb(verb: &Command) -> anyhow::Result<()> {
    match verb {
        Command::Serve(_) => anyhow::bail!("serve is not a client verb"),
        Command::Ps(a) => {
            let engines = a.server().json("GET", "/engines", None).await?;
            print!("{}", client::ps_table(&engines));
        }
        Command::Ls(a) if a.server || a.client.url.is_some() => {
            let server = a.client.server();
            let engines = server.json("GET", "/engines", None).await?;
            let models = server.json("GET", "/v1/models", None).await?;
            print!("{}", client::ls_table(&engines, &models));
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
        Command::Pull(a) => {
            let mut opts = a.store.options()?;
            opts.progress = mlxd_proxy::progress::to_stderr(false);
            let spec = a.model.clone();
            eprintln!("mlxd: pulling {spec} (downloads and conversions can take minutes)");
            let start = Instant::now();
            // The store blocks (file locks, downloads, conversion): off the async threads.
            let resolved =
                tokio::task::spawn_blocking(move || mlxd_store::resolve_model_with(&spec, &opts))
                    .await??;
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
        }
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
            let v = a.client.server().json("POST", &path, None).await?;
            println!(
                "{}: {}",
                v["model"].as_str().unwrap_or(&a.model),
                v["state"].as_str().unwrap_or("stopped")
            );
        }
        Command::Run(a) => run_chat(a).await?,
        Command::Bench(a) => bench(a).await?,
        Command::Quantize(a) => quantize(a).await?,
        Command::Jobs(a) => {
            let tasks = mlxd_client::TaskClient::new(a.client.client()?);
            match &a.action {
                None => print!(
                    "{}",
                    mlxd_proxy::jobs::display::jobs_table(&tasks.list().await?)
                ),
                Some(JobsAction::Cancel { id }) => {
                    let job = tasks.cancel(id).await?;
                    println!("{} {}", job.id, job.state.as_str());
                }
            }
        }
    }
    Ok(())
}

/// `mlxd quantize`: submits the job, follows it with a progress bar (plain lines when stderr
/// is not a terminal), and cancels it on Ctrl-C.
async fn quantize(a: &QuantizeArgs) -> anyhow::Result<()> {
    let tasks = mlxd_client::TaskClient::new(a.client.client()?);
    // The server resolves paths: send an existing local path absolute.
    let model = match std::fs::canonicalize(&a.model) {
        Ok(p) if p.is_dir() => p.display().to_string(),
        _ => a.model.clone(),
    };
    // A plain name is a model in the server's store; any other relative path is made
    // absolute here.
    let out = match &a.out {
        Some(o) if o.to_str().is_some_and(mlxd_store::inventory::is_plain_name) => Some(o.clone()),
        Some(o) if o.is_relative() => Some(std::env::current_dir()?.join(o)),
        o => o.clone(),
    };
    let job = tasks
        .submit(&mlxd_client::JobRequest::Quantize {
            model,
            bits: Some(a.bits),
            group_size: Some(a.group_size),
            out: out.map(|o| o.display().to_string()),
        })
        .await?;
    if a.detach {
        println!("{}", job.id);
        return Ok(());
    }
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
    let mut view = mlxd_proxy::jobs::display::ProgressView::for_stderr();
    let outcome = tokio::select! {
        done = tasks.wait(&job.id, |p| view.show(p)) => done,
        _ = tokio::signal::ctrl_c() => {
            view.finish();
            let cancelled = tasks.cancel(&job.id).await?;
            anyhow::bail!("{} {}: nothing was written", cancelled.id, cancelled.state.as_str());
        }
    };
    view.finish();
    let done = outcome?;
    let result = done
        .result
        .context("the server reported success without a result")?;
    println!(
        "{} ready in {:.1} s: {} ({})",
        result.model_id,
        result.seconds,
        result.dir.display(),
        mlxd_proxy::config::Bytes(result.bytes)
    );
    Ok(())
}

/// A chat request of `mlxd run`'s flags for `messages`.
fn chat_request(a: &RunArgs, messages: &[ChatMessage]) -> ChatCompletionRequest {
    let mut request = ChatCompletionRequest {
        model: Some(a.model.clone()),
        messages: messages.to_vec(),
        ..Default::default()
    };
    request.params.max_tokens = Some(i64::from(a.max_tokens));
    request.params.temperature = a.temperature.map(f64::from);
    request
}

/// Streams one answer through `mlxd-client`, calling `on_text` with each piece, and returns it
/// with its timings (usage asked for, so the token count is the server's).
async fn chat_stream(
    client: &mlxd_client::Client,
    mut request: ChatCompletionRequest,
    mut on_text: impl FnMut(&str),
) -> anyhow::Result<client::Streamed> {
    request.params.stream_options = Some(mlxd_protocol::openai::StreamOptions {
        include_usage: Some(true),
    });
    let start = Instant::now();
    let mut out = client::Streamed {
        text: String::new(),
        first_token: None,
        elapsed: std::time::Duration::ZERO,
        completion_tokens: None,
        finish_reason: None,
    };
    let mut chunks = client.stream(request).await?;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        if let Some(usage) = &chunk.usage {
            out.completion_tokens = Some(usage.completion_tokens);
        }
        for choice in chunk.choices {
            if let Some(r) = choice.finish_reason {
                out.finish_reason = Some(r);
            }
            if let Some(piece) = choice.delta.content.filter(|p| !p.is_empty()) {
                out.first_token.get_or_insert_with(|| start.elapsed());
                out.text.push_str(&piece);
                on_text(&piece);
            }
        }
    }
    out.elapsed = start.elapsed();
    Ok(out)
}

/// `mlxd run`: one streamed answer, or a chat that keeps the conversation.
async fn run_chat(a: &RunArgs) -> anyhow::Result<()> {
    let client = a.client.client()?;
    let mut messages: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage::new(Role::System, s.clone()));
    }
    let print = |piece: &str| {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
    };
    if let Some(prompt) = &a.prompt {
        messages.push(ChatMessage::new(Role::User, prompt.clone()));
        let answer = chat_stream(&client, chat_request(a, &messages), print).await?;
        println!();
        if answer.finish_reason.as_deref() == Some("length") {
            eprintln!("mlxd: the answer reached --max-tokens {}", a.max_tokens);
        }
        return Ok(());
    }
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!(
            "Chatting with {} at {}. An empty line or Ctrl-D ends the chat.",
            a.model,
            a.client.url()
        );
    }
    let (lines_tx, mut lines) = tokio::sync::mpsc::channel::<std::io::Result<String>>(1);
    // Stdin is read on its own thread; a line is only asked for after the previous answer.
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if lines_tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    loop {
        if interactive {
            eprint!(">>> ");
        }
        let Some(line) = lines.recv().await else {
            break;
        };
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            break;
        }
        messages.push(ChatMessage::new(Role::User, line));
        let answer = chat_stream(&client, chat_request(a, &messages), print).await?;
        println!();
        messages.push(ChatMessage::new(Role::Assistant, answer.text));
    }
    Ok(())
}

/// `mlxd bench`: a warm-up request, then `requests` timed streamed ones.
async fn bench(a: &BenchArgs) -> anyhow::Result<()> {
    let client = a.client.client()?;
    let mut request = ChatCompletionRequest {
        model: Some(a.model.clone()),
        messages: vec![ChatMessage::new(Role::User, a.prompt.clone())],
        ..Default::default()
    };
    request.params.max_tokens = Some(i64::from(a.max_tokens));
    request.params.temperature = Some(0.0);
    eprintln!("mlxd: warming up {} at {}", a.model, a.client.url());
    chat_stream(&client, request.clone(), |_| {}).await?;
    let mut runs = Vec::new();
    for i in 0..a.requests {
        eprintln!("mlxd: request {} of {}", i + 1, a.requests);
        runs.push(chat_stream(&client, request.clone(), |_| {}).await?);
    }
    print!("{}", client::bench_table(&runs));
    Ok(())
}
