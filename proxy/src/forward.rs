//! Forwarding one request to an engine over its unix socket, streaming both ways.
//!
//! Response bodies pass through unchanged. For `text/event-stream` responses the
//! proxy releases bytes on SSE event boundaries (each event as soon as it is complete),
//! so it sees every event — the hook for splicing a resumed stream later — and, if the
//! engine dies mid-stream, it can end the stream with one well-formed error event.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use mlxd_ipc::sse::SseSplitter;
use mlxd_ipc::uds::Driver;
use tracing::warn;

use crate::engine::DeathWatch;
use crate::error::ProxyError;
use crate::metrics::{Metrics, RequestTap};
use crate::pool::Lease;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type ProxyRequestBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// How long to wait, after the engine connection broke, for the engine's exit report.
const DEATH_REPORT_WAIT: Duration = Duration::from_secs(3);

/// Hop-by-hop headers (RFC 9110 §7.6.1), never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers, including those named in `Connection`.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(*n);
    }
}

/// Waits briefly for the engine's exit report and turns a broken connection into the
/// right error: `EngineCrashed` with the cause if the engine died, else `Upstream`.
pub async fn explain_failure(model: &str, mut death: DeathWatch, detail: String) -> ProxyError {
    let report = tokio::time::timeout(DEATH_REPORT_WAIT, death.wait_for(|d| d.is_some()))
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|d| d.clone()));
    match report {
        Some(report) => ProxyError::EngineCrashed {
            model: model.to_string(),
            report: (*report).clone(),
        },
        None => ProxyError::Upstream {
            model: model.to_string(),
            detail,
        },
    }
}

/// True when `err` (or anything in its source chain) is the request-body length limit.
fn is_body_limit(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Why forwarding failed, and whether the engine could have seen the request.
#[derive(Debug)]
pub enum ForwardError {
    /// No connection to the engine: the request was never sent, so it may be retried.
    NotDelivered(ProxyError),
    Failed(ProxyError),
}

impl From<ForwardError> for ProxyError {
    fn from(e: ForwardError) -> Self {
        match e {
            ForwardError::NotDelivered(e) | ForwardError::Failed(e) => e,
        }
    }
}

/// A copy of a request head (method, URI, version, headers) for a retry.
pub fn copy_head(p: &http::request::Parts) -> http::request::Parts {
    let mut r = Request::new(());
    *r.method_mut() = p.method.clone();
    *r.uri_mut() = p.uri.clone();
    *r.version_mut() = p.version;
    *r.headers_mut() = p.headers.clone();
    r.into_parts().0
}

/// Where a forwarded response's metrics go.
#[derive(Clone)]
pub struct Accounting {
    pub metrics: std::sync::Arc<Metrics>,
    /// When the request arrived.
    pub started: tokio::time::Instant,
}

/// Sends `parts` + `body` to the leased engine and returns the client's response.
pub async fn forward(
    lease: Lease,
    mut parts: http::request::Parts,
    body: ProxyRequestBody,
    request_id: u64,
    max_body: usize,
    accounting: Option<Accounting>,
) -> Result<Response<ProxyBody>, ForwardError> {
    strip_hop_by_hop(&mut parts.headers);
    parts
        .headers
        .insert(header::HOST, HeaderValue::from_static("localhost"));
    parts
        .headers
        .insert("x-request-id", HeaderValue::from(request_id));
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    parts.uri = match path.parse() {
        Ok(u) => u,
        Err(_) => {
            return Err(ForwardError::Failed(ProxyError::BadRequest(format!(
                "unroutable path {path:?}"
            ))))
        }
    };
    parts.version = http::Version::HTTP_11;
    let req = Request::from_parts(parts, body);

    let (resp, driver) = match mlxd_ipc::uds::send_driven(&lease.socket, req).await {
        Ok(r) => r,
        Err(e) => {
            if let mlxd_ipc::uds::UdsError::Request(he) = &e {
                if is_body_limit(he) {
                    return Err(ForwardError::Failed(ProxyError::BodyTooLarge {
                        limit: max_body,
                        got: None,
                    }));
                }
            }
            let not_delivered = matches!(e, mlxd_ipc::uds::UdsError::Connect { .. });
            let err = explain_failure(&lease.model, lease.death, e.to_string()).await;
            return Err(if not_delivered {
                ForwardError::NotDelivered(err)
            } else {
                ForwardError::Failed(err)
            });
        }
    };
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let tap = accounting.map(|a| {
        RequestTap::new(
            a.metrics,
            &lease.model,
            parts.status.as_u16(),
            a.started,
            sse,
        )
    });
    Ok(Response::from_parts(
        parts,
        ProxyBody::new(incoming, driver, sse, lease, tap),
    ))
}

type ErrorEventFuture = Pin<Box<dyn Future<Output = Bytes> + Send>>;

/// The client-facing response body.
pub struct ProxyBody {
    upstream: Incoming,
    /// The engine connection, polled from this body so no other task is involved.
    driver: Driver<ProxyRequestBody>,
    /// Present for SSE responses.
    sse: Option<SseSplitter>,
    queued: VecDeque<Bytes>,
    failing: Option<ErrorEventFuture>,
    lease: Option<Lease>,
    /// Metrics for this response, recorded when the body is dropped.
    tap: Option<RequestTap>,
    done: bool,
}

impl ProxyBody {
    fn new(
        upstream: Incoming,
        driver: Driver<ProxyRequestBody>,
        sse: bool,
        lease: Lease,
        tap: Option<RequestTap>,
    ) -> Self {
        Self {
            upstream,
            driver,
            sse: sse.then(SseSplitter::new),
            queued: VecDeque::new(),
            failing: None,
            lease: Some(lease),
            tap,
            done: false,
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        // Move bytes from the engine socket into `upstream` (Pending is fine: the
        // connection has registered for wake-ups).
        let _ = this.driver.poll_drive(cx);
        loop {
            if let Some(b) = this.queued.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(f) = this.failing.as_mut() {
                let event = ready!(f.as_mut().poll(cx));
                this.failing = None;
                this.done = true;
                this.queued.push_back(event);
                continue;
            }
            match ready!(Pin::new(&mut this.upstream).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    match this.sse.as_mut() {
                        Some(splitter) => {
                            for ev in splitter.push(&data) {
                                if let Some(tap) = this.tap.as_mut() {
                                    tap.event(&ev);
                                }
                                this.queued.push_back(ev);
                            }
                        }
                        None => {
                            if let Some(tap) = this.tap.as_mut() {
                                tap.data(&data);
                            }
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                    }
                }
                Some(Err(e)) => {
                    let Some(lease) = this.lease.take() else {
                        return Poll::Ready(Some(Err(e.into())));
                    };
                    warn!(model = %lease.model, error = %e, "engine connection broke mid-response");
                    if this.sse.is_none() {
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    // Drop any half event: the client must only see whole events.
                    if let Some(s) = this.sse.as_mut() {
                        s.finish();
                    }
                    let detail = e.to_string();
                    this.failing = Some(Box::pin(async move {
                        explain_failure(&lease.model, lease.death, detail)
                            .await
                            .sse_event()
                    }));
                }
                None => {
                    this.done = true;
                    if let Some(rest) = this.sse.as_mut().and_then(SseSplitter::finish) {
                        this.queued.push_back(rest);
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.queued.is_empty() && self.failing.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.sse.is_none() && self.queued.is_empty() && !self.done {
            self.upstream.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("authorization", HeaderValue::from_static("Bearer x"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["authorization", "content-type"]);
    }
}
