//! A 408 for a client that does not finish its request headers in time.
//!
//! hyper enforces `header_read_timeout` by ending the connection without a word. To answer
//! 408 as the body timeout does, the socket is shared: hyper reads and writes through a
//! [`SharedStream`], and the accept loop keeps a [`TimeoutReply`] on the same socket, which
//! writes the 408 once hyper has given up. A connection that sat idle between requests
//! (nothing received since the last response) is closed quietly instead, as keep-alive clients
//! expect: a 408 there could be read as the answer to a request sent at the same moment.
//!
//! The shared stream also tells the connection table when the server first finds the client
//! owing bytes (a read that would block), which makes a new connection replaceable
//! ([`crate::accept::ConnectionTable::waiting_for_client`]).

use std::io;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::error::ProxyError;

/// How long writing the 408 may take before the connection is simply closed.
const REPLY_WRITE_LIMIT: Duration = Duration::from_secs(1);

/// What a [`SharedStream`] calls once, at its first read that would block.
pub type OnWaiting = Box<dyn FnOnce() + Send + Sync>;

/// Splits an accepted connection into the stream hyper serves and the 408 writer;
/// `on_waiting` runs the first time a read finds nothing to read.
pub fn share(stream: TcpStream, on_waiting: OnWaiting) -> (SharedStream, TimeoutReply) {
    let tcp = Arc::new(stream);
    // A new connection owes a request: one that sends nothing at all also gets the 408.
    let request_begun = Arc::new(AtomicBool::new(true));
    (
        SharedStream {
            tcp: tcp.clone(),
            request_begun: request_begun.clone(),
            on_waiting: Some(on_waiting),
        },
        TimeoutReply { tcp, request_begun },
    )
}

/// The client connection as hyper sees it; records whether bytes arrived since the last
/// response bytes left.
pub struct SharedStream {
    tcp: Arc<TcpStream>,
    request_begun: Arc<AtomicBool>,
    /// Taken at the first read that would block.
    on_waiting: Option<OnWaiting>,
}

/// The accept loop's hold on the socket, for the 408.
pub struct TimeoutReply {
    tcp: Arc<TcpStream>,
    request_begun: Arc<AtomicBool>,
}

impl TimeoutReply {
    /// Makes the connection's close a reset (`SO_LINGER` 0) rather than a FIN: for a
    /// connection evicted to make room before it sent a request (nothing of it is owed an
    /// answer; a new connection refused past its client's share still gets a FIN, which a
    /// client reads as the close). A FIN would leave this side in TIME_WAIT for a minute; under a slowloris that
    /// reconnects at once, those pile up, and a new client whose port matches one has its SYN
    /// refused and retried a second later (seen as a 1 s `/health/live` in
    /// `tests/limits.rs`'s slowloris).
    pub fn reset_on_close(&self) {
        if let Err(e) = self.tcp.set_zero_linger() {
            tracing::debug!(error = %e, "could not make an evicted connection's close a reset");
        }
    }

    /// Called when hyper ended the connection on its header read timeout: writes the 408 in
    /// the OpenAI shape (the route is not known yet), unless the connection was idle between
    /// requests. Best effort: a client that stopped reading just loses the answer.
    pub async fn header_timed_out(self, limit_ms: u64) {
        if !self.request_begun.load(Ordering::Relaxed) {
            return;
        }
        let body = ProxyError::RequestTimeout {
            what: "request headers",
            limit_ms,
            setting: "header_timeout_ms",
        }
        .body_json();
        let response = format!(
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = tokio::time::timeout(REPLY_WRITE_LIMIT, write_all(&self.tcp, response.as_bytes()))
            .await;
        let _ = shutdown_write(&self.tcp);
    }
}

async fn write_all(tcp: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        tcp.writable().await?;
        match tcp.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn shutdown_write(tcp: &TcpStream) -> io::Result<()> {
    nix::sys::socket::shutdown(tcp.as_raw_fd(), nix::sys::socket::Shutdown::Write)
        .map_err(io::Error::from)
}

impl AsyncRead for SharedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.tcp.poll_read_ready(cx)?.is_pending() {
                if let Some(on_waiting) = this.on_waiting.take() {
                    on_waiting();
                }
                return Poll::Pending;
            }
            // `try_read` clears the readiness on WouldBlock, so the next poll waits.
            match this.tcp.try_read(buf.initialize_unfilled()) {
                Ok(n) => {
                    if n > 0 {
                        this.request_begun.store(true, Ordering::Relaxed);
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for SharedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |tcp| tcp.try_write(data))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_with(cx, |tcp| tcp.try_write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(shutdown_write(&self.tcp))
    }
}

impl SharedStream {
    fn poll_write_with(
        &self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&TcpStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.tcp.poll_write_ready(cx))?;
            match write(&self.tcp) {
                Ok(n) => {
                    // A response is leaving: the request it answers has been read.
                    self.request_begun.store(false, Ordering::Relaxed);
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}
