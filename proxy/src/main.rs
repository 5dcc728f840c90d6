//! `mlxd`: parse flags, set up logging, bind, and run [`mlxd_proxy::serve`] until
//! SIGINT or SIGTERM; or, for `mlxd ps` / `mlxd ls`, ask a running server.

use std::io::IsTerminal;

use anyhow::Context;
use clap::Parser;
use mlxd_proxy::catalog::Catalog;
use mlxd_proxy::cli::{Cli, Command};
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
        Some(Command::Ps(a)) => {
            let engines =
                rt.block_on(client::get_json(&a.url, "/engines", a.api_key.as_deref()))?;
            print!("{}", client::ps_table(&engines));
            return Ok(());
        }
        Some(Command::Ls(a)) => {
            let (engines, models) = rt.block_on(async {
                Ok::<_, client::ClientError>((
                    client::get_json(&a.url, "/engines", a.api_key.as_deref()).await?,
                    client::get_json(&a.url, "/v1/models", a.api_key.as_deref()).await?,
                ))
            })?;
            print!("{}", client::ls_table(&engines, &models));
            return Ok(());
        }
        _ => {}
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = cli.serve_args().context("serve arguments")?;
    // An unusable configuration exits with EX_USAGE and says where the problem is.
    let config = match args
        .into_config()
        .and_then(|c| Catalog::from_config(&c).map(|_| c))
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
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = int.recv() => tracing::info!("SIGINT received"),
            }
        };
        mlxd_proxy::serve(listener, config, shutdown).await?;
        Ok(())
    })
}
