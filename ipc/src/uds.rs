//! HTTP/1.1 client over a unix socket: one connection per request, so dropping the
//! response body closes the connection and the engine sees the client go away.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

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

/// Opens a fresh HTTP/1.1 connection to the unix socket at `path`.
async fn connect<B>(
    path: &Path,
) -> Result<
    (
        http1::SendRequest<B>,
        http1::Connection<TokioIo<tokio::net::UnixStream>, B>,
    ),
    UdsError,
>
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
    http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await
        .map_err(UdsError::Handshake)
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
    let (mut sender, conn) = connect(path).await?;
    tokio::spawn(async move {
        // Errors here surface to the caller through the response or its body.
        let _ = conn.await;
    });
    sender.send_request(req).await.map_err(UdsError::Request)
}

/// The connection half of [`send_driven`]: it must be polled (alongside reading the
/// response body, in the same task) for the body to make progress. Dropping it closes
/// the connection.
pub struct Driver<B: Body + 'static> {
    conn: Pin<Box<http1::Connection<TokioIo<tokio::net::UnixStream>, B>>>,
    done: bool,
}

impl<B> Driver<B>
where
    B: Body + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Drives the connection; `Ready` once it has finished (errors surface through the
    /// response body).
    pub fn poll_drive(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.done {
            return Poll::Ready(());
        }
        match self.conn.as_mut().poll(cx) {
            Poll::Ready(_) => {
                self.done = true;
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Like [`send`], but instead of spawning the connection onto its own task, returns it
/// as a [`Driver`] for the caller to poll. A proxy polling it from the task that writes
/// the client's response saves a task wake-up per chunk.
pub async fn send_driven<B>(
    path: &Path,
    req: Request<B>,
) -> Result<(Response<Incoming>, Driver<B>), UdsError>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut sender, conn) = connect(path).await?;
    let mut driver = Driver {
        conn: Box::pin(conn),
        done: false,
    };
    let mut response = std::pin::pin!(sender.send_request(req));
    let resp = std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = response.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        // Keep the connection moving until the response head arrives; if it ends
        // first, the pending request resolves with the error on the next poll.
        let _ = driver.poll_drive(cx);
        response.as_mut().poll(cx)
    })
    .await
    .map_err(UdsError::Request)?;
    Ok((resp, driver))
}
