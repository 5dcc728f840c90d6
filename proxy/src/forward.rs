//! Forwarding one request to an engine over its unix socket, streaming both ways.
//!
//! Response bodies pass through unchanged, except those of the generation routes
//! (`resume.rs`). For `text/event-stream` responses the proxy releases bytes on SSE event
//! boundaries (each event as soon as it is complete), so it sees every event. A
//! generation stream whose engine dies is continued on the restarted engine and spliced
//! in; any other stream, or one that cannot be resumed, ends with one well-formed error
//! event.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use mlxd_ipc::sse::SseSplitter;
use mlxd_ipc::uds::Driver;
use tracing::{info, warn};

use crate::engine::DeathWatch;
use crate::engine_event::EngineEvent;
use crate::error::ProxyError;
use crate::exit::ExitReport;
use crate::metrics::{Metrics, RequestTap};
use crate::pool::{Lease, PoolHandle};
use crate::resume::{ClientBody, NotResumable, Resume, ResumeRecord};

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
/// right error: `EngineCrashed` with the cause if the engine died, else `Upstream`. The
/// report waited for carries the process's exit status (for the client's message).
pub async fn explain_failure(model: &str, death: DeathWatch, detail: String) -> ProxyError {
    crash_error(model, exit_report(death, true).await, detail)
}

/// [`explain_failure`] without waiting for the exit status: a stream resumed on a standby
/// goes on as soon as the engine is known to be gone.
async fn explain_failure_early(model: &str, death: DeathWatch, detail: String) -> ProxyError {
    crash_error(model, exit_report(death, false).await, detail)
}

/// The engine's exit report, once there is one (`reaped`: one with its exit status), within
/// [`DEATH_REPORT_WAIT`]; after it, whatever report there is.
async fn exit_report(mut death: DeathWatch, reaped: bool) -> Option<Arc<ExitReport>> {
    let wanted = |d: &Option<Arc<ExitReport>>| d.as_ref().is_some_and(|r| r.reaped || !reaped);
    let _ = tokio::time::timeout(DEATH_REPORT_WAIT, death.wait_for(wanted)).await;
    let report = death.borrow().clone();
    report
}

fn crash_error(model: &str, report: Option<Arc<ExitReport>>, detail: String) -> ProxyError {
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

/// True for an engine that died without being asked to: one whose successor the pool
/// starts, so that its requests can be resumed there.
pub fn is_crash(err: &ProxyError) -> bool {
    matches!(err, ProxyError::EngineCrashed { report, .. } if !report.cause.is_requested())
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

/// What a generation request needs to be continued on a restarted engine if its engine
/// dies: its record and how to send it again.
pub struct Resumption {
    pub record: ResumeRecord,
    pub pool: PoolHandle,
    /// The request head as the client sent it (credentials already stripped).
    pub parts: http::request::Parts,
    pub request_id: u64,
    pub max_body: usize,
    /// For the KV check against the new engine.
    pub max_tokens: Option<u64>,
}

/// Sends `parts` + `body` to the leased engine and returns the client's response. With
/// `resume`, the `mlxd` extension is stripped from what the client sees, and a stream
/// whose engine dies is continued on the restarted engine.
pub async fn forward(
    lease: Lease,
    parts: http::request::Parts,
    body: ProxyRequestBody,
    request_id: u64,
    max_body: usize,
    accounting: Option<Accounting>,
    resume: Option<Resumption>,
) -> Result<Response<ProxyBody>, ForwardError> {
    let (resp, mut driver) = send(&lease, parts, body, request_id, max_body).await?;
    let (mut parts, incoming) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let sse = is_sse(&parts.headers);
    let tap = |parts: &http::response::Parts| {
        accounting.map(|a| {
            RequestTap::new(
                a.metrics,
                &lease.model,
                parts.status.as_u16(),
                a.started,
                sse,
            )
        })
    };
    if let Some(resume) = resume {
        if !sse {
            // A whole JSON response: read it (it comes at once, at the end of the
            // generation), strip the extension, and answer with the rewritten bytes.
            let raw = match collect(incoming, &mut driver).await {
                Ok(b) => b,
                Err(e) => {
                    let err = explain_failure(&lease.model, lease.death.clone(), e).await;
                    return Err(ForwardError::Failed(err));
                }
            };
            let out = if parts.status.is_success() {
                resume.record.client_body(raw)
            } else {
                ClientBody {
                    bytes: raw,
                    usage: None,
                }
            };
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(out.bytes.len()));
            // Counted only now: a response lost with its engine is sent again, once.
            let tap = tap(&parts);
            return Ok(Response::from_parts(
                parts,
                ProxyBody::whole(out, lease, tap),
            ));
        }
        let tap = tap(&parts);
        return Ok(Response::from_parts(
            parts,
            ProxyBody::new(incoming, driver, true, lease, tap, Some(resume)),
        ));
    }
    let tap = tap(&parts);
    Ok(Response::from_parts(
        parts,
        ProxyBody::new(incoming, driver, sse, lease, tap, None),
    ))
}

fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// One request to the leased engine, up to its response head.
async fn send(
    lease: &Lease,
    mut parts: http::request::Parts,
    body: ProxyRequestBody,
    request_id: u64,
    max_body: usize,
) -> Result<(Response<Incoming>, Driver<ProxyRequestBody>), ForwardError> {
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
    // A buffered body (possibly a continuation, longer than what the client sent)
    // declares its own length.
    if let Some(len) = body.size_hint().exact() {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    let req = Request::from_parts(parts, body);
    match mlxd_ipc::uds::send_driven(&lease.socket, req).await {
        Ok(r) => Ok(r),
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
            let err = explain_failure(&lease.model, lease.death.clone(), e.to_string()).await;
            Err(if not_delivered {
                ForwardError::NotDelivered(err)
            } else {
                ForwardError::Failed(err)
            })
        }
    }
}

/// Reads a whole response body while driving its connection.
async fn collect(
    mut incoming: Incoming,
    driver: &mut Driver<ProxyRequestBody>,
) -> Result<Bytes, String> {
    let mut out = bytes::BytesMut::new();
    loop {
        let frame = std::future::poll_fn(|cx| {
            let _ = driver.poll_drive(cx);
            Pin::new(&mut incoming).poll_frame(cx)
        })
        .await;
        match frame {
            None => return Ok(out.freeze()),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    out.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => return Err(e.to_string()),
        }
    }
}

type ErrorEventFuture = Pin<Box<dyn Future<Output = Bytes> + Send>>;
type ReconnectFuture = Pin<Box<dyn Future<Output = (Resumption, Result<Upstream, Bytes>)> + Send>>;

/// A live engine response: its body, the connection that feeds it, and the lease.
struct Upstream {
    incoming: Incoming,
    /// The engine connection, polled from this body so no other task is involved.
    driver: Driver<ProxyRequestBody>,
    lease: Lease,
}

/// The client-facing response body.
pub struct ProxyBody {
    upstream: Option<Upstream>,
    /// Present for SSE responses.
    sse: Option<SseSplitter>,
    queued: VecDeque<Bytes>,
    failing: Option<ErrorEventFuture>,
    /// Present for resumable generation streams.
    resume: Option<Resumption>,
    /// The engine died; waiting for its successor to take the stream over.
    reconnecting: Option<ReconnectFuture>,
    /// A body read whole: holds its lease until the client has it.
    _held: Option<Lease>,
    /// Metrics for this response, recorded when the body is dropped.
    tap: Option<RequestTap>,
    done: bool,
}

impl ProxyBody {
    fn new(
        incoming: Incoming,
        driver: Driver<ProxyRequestBody>,
        sse: bool,
        lease: Lease,
        tap: Option<RequestTap>,
        resume: Option<Resumption>,
    ) -> Self {
        Self {
            upstream: Some(Upstream {
                incoming,
                driver,
                lease,
            }),
            sse: sse.then(SseSplitter::new),
            queued: VecDeque::new(),
            failing: None,
            resume,
            reconnecting: None,
            _held: None,
            tap,
            done: false,
        }
    }

    /// A body already read and rewritten; the tap takes its usage from that reading.
    fn whole(body: ClientBody, lease: Lease, mut tap: Option<RequestTap>) -> Self {
        let ClientBody { bytes: body, usage } = body;
        if let Some(tap) = tap.as_mut() {
            tap.whole(&body, usage);
        }
        Self {
            upstream: None,
            sse: None,
            queued: VecDeque::from([body]),
            failing: None,
            resume: None,
            reconnecting: None,
            _held: Some(lease),
            tap,
            done: true,
        }
    }

    /// One event from the engine on its way to the client. It is read once
    /// ([`EngineEvent`]: the meta line cut off and parsed, the chunk's JSON parsed at most
    /// once) and the resume record and the tap share that reading; neither parses the chunk
    /// on a healthy stream.
    fn pass_event(&mut self, ev: Bytes) {
        let event = EngineEvent::new(ev);
        let out = match self.resume.as_mut() {
            Some(r) => match r.record.client_event(&event) {
                Some(out) => out,
                None => return,
            },
            None => event.bytes().clone(),
        };
        if let Some(tap) = self.tap.as_mut() {
            tap.event(&event);
        }
        self.queued.push_back(out);
    }

    /// The engine connection broke mid-stream: continue elsewhere or end with an error.
    fn broke(&mut self, upstream: Upstream, detail: String) {
        let lease = upstream.lease;
        warn!(model = %lease.model, error = %detail, "engine connection broke mid-response");
        // Drop any half event: the client must only see whole events.
        if let Some(s) = self.sse.as_mut() {
            s.finish();
        }
        if let Some(resume) = self.resume.take() {
            self.reconnecting = Some(Box::pin(reconnect(resume, lease, detail)));
            return;
        }
        self.failing = Some(Box::pin(async move {
            explain_failure(&lease.model, lease.death, detail)
                .await
                .sse_event()
        }));
    }
}

/// After the engine behind `lease` died mid-stream: waits for its exit report, takes a
/// lease on its successor and sends the continuation. `Err` holds the bytes that end the
/// client's stream (an error event, or the missing `[DONE]`).
async fn reconnect(
    mut resume: Resumption,
    lease: Lease,
    detail: String,
) -> (Resumption, Result<Upstream, Bytes>) {
    let model = lease.model.clone();
    let mut dead = lease.generation;
    let mut crash = explain_failure_early(&model, lease.death.clone(), detail).await;
    // The watch of the engine behind `crash` while its report may still lack the exit status
    // (an error shown to the client waits for it: [`with_status`]).
    let mut crash_death = Some(lease.death.clone());
    drop(lease);
    loop {
        if !is_crash(&crash) {
            // The engine lives (it dropped the request), or mlxd stopped it on purpose
            // (shutdown, eviction): nothing restarts it for this request.
            let crash = with_status(&model, crash, crash_death.take()).await;
            return (resume, Err(crash.sse_event()));
        }
        let body = match resume.record.resume() {
            Resume::Continue(body) => body,
            Resume::Finish(tail) => return (resume, Err(tail)),
            // The engine never said which tokens it sent (one without the `mlxd`
            // extension): the request was never resumable, and the crash is the error.
            Resume::Impossible(NotResumable::UnknownEvent) => {
                let crash = with_status(&model, crash, crash_death.take()).await;
                return (resume, Err(crash.sse_event()));
            }
            Resume::Impossible(why) => {
                let crash = with_status(&model, crash, crash_death.take()).await;
                return (resume, Err(not_resumed(&model, &crash, why.to_string())));
            }
        };
        info!(
            model = %model,
            sent_tokens = resume.record.sent_ids().len(),
            attempt = resume.record.resumes(),
            "engine died mid-stream; resuming on its successor"
        );
        let lease = match resume
            .pool
            .lease_for(&model, Some(dead), resume.max_tokens)
            .await
        {
            Ok(l) => l,
            Err(e) => {
                let crash = with_status(&model, crash, crash_death.take()).await;
                return (resume, Err(not_resumed(&model, &crash, e.to_string())));
            }
        };
        let body: ProxyRequestBody = http_body_util::Full::new(body)
            .map_err(|e| match e {})
            .boxed();
        let sent = send(
            &lease,
            copy_head(&resume.parts),
            body,
            resume.request_id,
            resume.max_body,
        )
        .await;
        match sent {
            Ok((resp, mut driver)) => {
                let (parts, incoming) = resp.into_parts();
                if parts.status.is_success() && is_sse(&parts.headers) {
                    return (
                        resume,
                        Ok(Upstream {
                            incoming,
                            driver,
                            lease,
                        }),
                    );
                }
                let body = collect(incoming, &mut driver).await.unwrap_or_default();
                let e = ProxyError::Upstream {
                    model: model.clone(),
                    detail: format!(
                        "the continuation was answered {}: {}",
                        parts.status,
                        String::from_utf8_lossy(&body)
                    ),
                };
                let crash = with_status(&model, crash, crash_death.take()).await;
                return (resume, Err(not_resumed(&model, &crash, e.to_string())));
            }
            Err(ForwardError::NotDelivered(e) | ForwardError::Failed(e)) => {
                // Died again before answering: count it and go round (`send` waited for the
                // exit status).
                dead = lease.generation;
                crash = e;
                crash_death = None;
            }
        }
    }
}

/// `crash` as the client sees it: with the exit status of the engine behind `death` once it
/// is reaped (within [`DEATH_REPORT_WAIT`]), where its report was made before.
async fn with_status(model: &str, crash: ProxyError, death: Option<DeathWatch>) -> ProxyError {
    match (&crash, death) {
        (ProxyError::EngineCrashed { report, .. }, Some(death)) if !report.reaped => {
            crash_error(model, exit_report(death, true).await, crash.to_string())
        }
        _ => crash,
    }
}

/// The error event ending a stream that could not be resumed after `crash`.
fn not_resumed(model: &str, crash: &ProxyError, reason: String) -> Bytes {
    ProxyError::NotResumed {
        model: model.to_string(),
        crash: crash.to_string(),
        reason,
    }
    .sse_event()
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            // Move bytes from the engine socket into `incoming` (Pending is fine: the
            // connection has registered for wake-ups).
            if let Some(up) = this.upstream.as_mut() {
                let _ = up.driver.poll_drive(cx);
            }
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
            if let Some(f) = this.reconnecting.as_mut() {
                let (resume, result) = ready!(f.as_mut().poll(cx));
                this.reconnecting = None;
                this.resume = Some(resume);
                match result {
                    Ok(up) => {
                        this.sse = Some(SseSplitter::new());
                        this.upstream = Some(up);
                    }
                    Err(tail) => {
                        this.done = true;
                        if !tail.is_empty() {
                            this.queued.push_back(tail);
                        }
                    }
                }
                continue;
            }
            let Some(up) = this.upstream.as_mut() else {
                this.done = true;
                continue;
            };
            match ready!(Pin::new(&mut up.incoming).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let data = match frame.into_data() {
                        Ok(d) => d,
                        Err(other) => return Poll::Ready(Some(Ok(other))),
                    };
                    match this.sse.as_mut() {
                        Some(splitter) => {
                            for ev in splitter.push(&data) {
                                this.pass_event(ev);
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
                    let Some(up) = this.upstream.take() else {
                        return Poll::Ready(Some(Err(e.into())));
                    };
                    if this.sse.is_none() {
                        warn!(model = %up.lease.model, error = %e, "engine connection broke mid-response");
                        return Poll::Ready(Some(Err(e.into())));
                    }
                    this.broke(up, e.to_string());
                }
                None => {
                    let complete = this.resume.as_ref().is_none_or(|r| r.record.is_complete());
                    let up = this.upstream.take();
                    match up {
                        // The engine closed a resumable stream before its end: treat it
                        // as the break it is.
                        Some(up) if !complete => {
                            this.broke(up, "the engine ended the stream early".into());
                        }
                        _ => {
                            this.done = true;
                            if let Some(rest) = this.sse.as_mut().and_then(SseSplitter::finish) {
                                this.pass_event(rest);
                            }
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.queued.is_empty() && self.failing.is_none() && self.reconnecting.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.upstream {
            Some(up) if self.sse.is_none() && self.queued.is_empty() && !self.done => {
                up.incoming.size_hint()
            }
            _ => SizeHint::default(),
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
