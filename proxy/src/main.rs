//! `mlxd`: parse flags, set up logging, bind, and run [`mlxd_proxy::serve`] until
//! SIGINT or SIGTERM.

use std::io::IsTerminal;

use anyhow::Context;
use clap::Parser;
use mlxd_proxy::cli::Cli;
use tokio::signal::unix::{signal, SignalKind};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let config = Cli::parse().serve_args().into_config()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", config.host, config.port);
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
