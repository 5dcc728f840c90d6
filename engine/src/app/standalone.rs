//! Standalone mode (`--unix`): an engine that serves its socket on its own, without `mlxd`.
use std::path::Path;

use super::load::Engine;
use crate::server;

/// Standalone mode (`--unix`): serve until SIGINT or SIGTERM.
pub async fn serve_standalone(engine: Engine, socket: &Path) -> anyhow::Result<()> {
    let listener = server::bind(socket)?;
    tracing::info!(socket = %socket.display(), "serving");
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    server::serve(listener, engine.state(), shutdown).await?;
    engine.runtime.join();
    Ok(())
}
