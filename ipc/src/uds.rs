//! HTTP/1.1 client over a unix socket: one connection per request, so dropping the
//! response body closes the connection and the engine sees the client go away.

use std::path::Path;

use hyper::body::{Body, Incoming};
use hyper::client::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    #[error("connecting to engine socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("HTTP handshake with the engine: {0}")]
    Handshake(hyper::Error),
    #[error("engine request: {0}")]
    Request(hyper::Error),
}

/// Sends one request on a fresh connection to the unix socket at `path`.
///
/// The connection task ends when the response body is finished or dropped.
pub async fn send<B>(path: &Path, req: Request<B>) -> Result<Response<Incoming>, UdsError>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::UnixStream::connect(path)
        .await
        .map_err(|source| UdsError::Connect {
            path: path.display().to_string(),
            source,
        })?;
    let (mut sender, conn) = http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await
        .map_err(UdsError::Handshake)?;
    tokio::spawn(async move {
        // Errors here surface to the caller through the response or its body.
        let _ = conn.await;
    });
    sender.send_request(req).await.map_err(UdsError::Request)
}
