//! The HTTP front: accept loop, routing, local endpoints, graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body as _, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument};

use crate::catalog::{self, Catalog};
use crate::config::{Config, ConfigError};
use crate::error::{ErrorShape, ProxyError};
use crate::forward::{
    copy_head, forward, Accounting, BoxError, ForwardError, ProxyBody, ProxyRequestBody, Resumption,
};
use crate::logs::Logs;
use crate::metrics::Metrics;
use crate::pool::{self, PoolHandle, PoolParts};

pub use crate::response_body::ResponseBody;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Socket(#[from] mlxd_ipc::socket::SocketError),
    #[error("accepting connections: {0}")]
    Accept(std::io::Error),
}

/// The POST routes an engine serves (`engine/src/server/mod.rs`'s router): the only ones
/// forwarded. Each body must be a JSON object, checked here before any engine wakes. Any
/// other path is a 404 from the proxy itself, so a request no engine could answer never
/// loads or evicts a model, nor waits for its body.
const ENGINE_POST_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
];

/// The GET routes an engine serves beyond those the proxy answers itself (`/v1/models`,
/// `/health`): `/v1/models/{id}`.
fn is_engine_get_route(path: &str) -> bool {
    path.strip_prefix("/v1/models/")
        .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

struct App {
    config: Arc<Config>,
    /// The catalog requests are routed by, replaced by a configuration reload or a model
    /// found in the store.
    routing: crate::routing::Routing,
    pool: PoolHandle,
    metrics: Arc<Metrics>,
    logs: Logs,
    /// Who may talk to mlxd; replaced by a configuration reload (rotated keys).
    guard: std::sync::RwLock<Arc<crate::auth::Guard>>,
    started: Instant,
    next_id: AtomicU64,
    /// Flips to true when shutdown begins (ends `/logs` followers).
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Managed jobs (`/v1/jobs`).
    jobs: crate::jobs::JobsHandle,
    /// The model store jobs write into (`$MLXD_HOME`), or why there is none.
    home: Result<std::path::PathBuf, String>,
    /// The memory budget in force (`/health` judges whether a model can fit); a reload
    /// that the pool applied replaces it.
    memory_budget: AtomicU64,
}

impl App {
    /// The catalog requests are routed by now.
    fn catalog(&self) -> Arc<Catalog> {
        self.routing.catalog()
    }

    /// The access policy requests are checked against now.
    fn guard(&self) -> Arc<crate::auth::Guard> {
        self.guard.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The access policy of `config`: its keys (reading `api_key_file`), Host and Origin lists.
fn build_guard(config: &Config) -> Result<crate::auth::Guard, ConfigError> {
    let guard = crate::auth::Guard::new(crate::auth::GuardConfig {
        api_keys: &config.api_keys()?,
        admin_api_key: config.server.admin_api_key.as_ref().map(|k| k.0.as_str()),
        bind_host: &config.server.host,
        allowed_hosts: &config.server.allowed_hosts,
        allowed_origins: &config.server.allowed_origins,
    });
    if !crate::auth::is_loopback_bind(&config.server.host) && !guard.keys_required() {
        warn!(
            host = %config.server.host,
            "listening beyond loopback WITHOUT an API key: anyone who can reach this address can use and administer mlxd; set --api-key / server.api_keys"
        );
    }
    Ok(guard)
}

/// What `mlxd serve` adds to [`serve`].
#[derive(Debug, Default)]
pub struct ServeOptions {
    /// Configurations to switch to (read again on `SIGHUP`): each is merged with the running
    /// one ([`crate::reload::merge`]), applied by the pool, and then routed by.
    pub reloads: Option<tokio::sync::mpsc::UnboundedReceiver<Config>>,
    /// Load the default model at start, show its progress, then print the URL line
    /// ([`crate::preload`]); the flag says whether log lines are JSON.
    pub preload: Option<Preload>,
}

#[derive(Debug, Clone, Copy)]
pub struct Preload {
    pub json_logs: bool,
}

/// Runs the proxy on `listener` until `shutdown` resolves, then: stops accepting, lets
/// in-flight requests finish within the grace period, and stops every engine
/// (Shutdown, SIGTERM, SIGKILL). Returns once all engines have exited.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    serve_with(listener, config, shutdown, ServeOptions::default()).await
}

/// [`serve`], with configuration reloads and the default model's preload.
pub async fn serve_with(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
    options: ServeOptions,
) -> Result<(), ServeError> {
    let (runtime_dir, owned_dir) = match &config.server.runtime_dir {
        Some(d) => (d.clone(), false),
        None => (mlxd_ipc::socket::default_runtime_dir(), true),
    };
    let catalog = Arc::new(crate::routing::build_catalog(&config)?);
    if owned_dir {
        sweep_leftovers(
            "runtime directory",
            crate::leftovers::sweep_runtime_dirs(&runtime_dir),
        );
    }
    mlxd_ipc::socket::prepare_runtime_dir(&runtime_dir)?;
    let config = Arc::new(config);
    let metrics = Arc::new(Metrics::new());
    let logs = Logs::new(catalog.models.iter().map(|m| m.id.as_str()));
    let pool = pool::start(
        config.clone(),
        PoolParts {
            catalog: catalog.clone(),
            runtime_dir: runtime_dir.clone(),
            metrics: metrics.clone(),
            logs: logs.clone(),
            memory_budget: catalog::memory_budget(&config),
        },
    )?;
    let guard = build_guard(&config)?;
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let home = mlxd_store::default_home().map_err(|e| e.to_string());
    if let Ok(h) = &home {
        sweep_leftovers(
            "staging directory in the store",
            mlxd_store::sweep_stale_staging(h),
        );
    }
    let jobs = crate::jobs::start(
        config.engine_bin(),
        pool.clone(),
        home.as_ref().ok().map(|h| h.join("models")),
    );
    let app = Arc::new(App {
        config: config.clone(),
        routing: crate::routing::Routing::new(catalog.clone(), config.clone(), pool.clone()),
        pool: pool.clone(),
        metrics,
        logs,
        guard: std::sync::RwLock::new(Arc::new(guard)),
        started: Instant::now(),
        next_id: AtomicU64::new(1),
        stopping,
        jobs: jobs.clone(),
        home,
        memory_budget: AtomicU64::new(catalog::memory_budget(&config)),
    });
    info!(
        addr = %listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default(),
        models = ?catalog.ids(),
        default_model = %catalog.default_model,
        "mlxd listening"
    );
    debug!(
        engine_bin = %config.engine_bin().display(),
        runtime_dir = %runtime_dir.display(),
        "paths"
    );
    if let Some(reloads) = options.reloads {
        tokio::spawn(apply_reloads(app.clone(), reloads));
    }
    if let Some(preload) = options.preload {
        let local = listener.local_addr().map_err(ServeError::Accept)?;
        let host = match local.ip() {
            ip if ip.is_unspecified() => "127.0.0.1".to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        tokio::spawn(crate::preload::run(
            pool.clone(),
            catalog.default_model.clone(),
            format!("http://{host}:{}/", local.port()),
            preload.json_logs,
        ));
    }

    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(config.server.header_timeout_ms));
    let mut limits = crate::accept::Limits::for_cap(connection_cap(&config));
    if let Some(n) = config.server.max_connections_per_client {
        limits.per_client = n;
    }
    let connections = crate::accept::Connections::new(limits);
    let mut backoff = crate::accept::AcceptBackoff::default();
    tokio::pin!(shutdown);
    loop {
        // Back-pressure: with every slot busy and none to replace, stop accepting; clients
        // wait in the kernel backlog (`accept.rs`).
        tokio::select! {
            _ = connections.room() => {}
            _ = &mut shutdown => break,
        }
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => {
                    if let Some(n) = backoff.success() {
                        info!(failures = n, "accepting connections again");
                    }
                    a
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    let f = backoff.failure(Instant::now());
                    if let Some(n) = f.log {
                        warn!(error = %e, failures = n, retry_in_ms = f.delay.as_millis() as u64, "accept failed; backing off");
                    }
                    tokio::time::sleep(f.delay).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let admitted = tokio::select! {
            a = connections.admit(peer.ip()) => a,
            _ = &mut shutdown => break,
        };
        let Some((slot, evicted)) = admitted else {
            debug!(%peer, per_client = limits.per_client, "client at its connection limit; closed");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let slot = Arc::new(slot);
        let conn_slot = slot.clone();
        let waiting_slot = slot.clone();
        let svc = service_fn(move |req| serve_request(app.clone(), slot.clone(), limits, req));
        let (stream, timeout_reply) = crate::header_timeout::share(
            stream,
            Box::new(move || waiting_slot.waiting_for_client()),
        );
        let conn = builder.serve_connection(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn);
        let header_timeout_ms = config.server.header_timeout_ms;
        tokio::spawn(async move {
            let _slot = conn_slot;
            tokio::select! {
                ended = conn => if let Err(e) = ended {
                    debug!(%peer, error = %e, "client connection ended with an error");
                    if e.is_timeout() {
                        timeout_reply.header_timed_out(header_timeout_ms).await;
                    }
                },
                // Replaced by a newer connection while it waited for a request head.
                _ = evicted => {
                    timeout_reply.reset_on_close();
                    debug!(%peer, "connection waiting for its request closed to make room");
                }
            }
        });
    }
    drop(listener);
    let _ = stopping_tx.send(true);
    let grace = config.grace();
    info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: no new connections; waiting for in-flight requests"
    );
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        warn!("grace period over with requests still in flight; stopping engines anyway");
    }
    jobs.shutdown().await;
    pool.shutdown().await;
    if owned_dir {
        let _ = std::fs::remove_dir_all(&runtime_dir);
    }
    info!("mlxd stopped");
    Ok(())
}

/// The configured models of `catalog` larger than `config`'s memory budget, as a sentence
/// ([`crate::placement::oversized`]); models found in the store are not configured and are
/// left to `/health` and a 503 at their request.
pub fn oversized_models(catalog: &Catalog, config: &Config) -> Option<String> {
    crate::placement::oversized(
        catalog
            .models
            .iter()
            .filter(|m| !m.stored)
            .map(|m| (m.id.as_str(), m.planned_bytes)),
        catalog::memory_budget(config),
    )
}

/// Logs what a sweep of a crashed process's leftovers removed, and what it could not.
fn sweep_leftovers(
    what: &str,
    (removed, failed): (
        Vec<std::path::PathBuf>,
        Vec<(std::path::PathBuf, std::io::Error)>,
    ),
) {
    for dir in removed {
        info!(dir = %dir.display(), "removed a {what} left by an mlxd that is gone");
    }
    for (dir, e) in failed {
        warn!(dir = %dir.display(), error = %e, "cannot remove a {what} left by an mlxd that is gone");
    }
}

/// One request on a connection holding `slot`: marks the connection busy until the response
/// is done (so it is not replaced meanwhile), and on a reserve connection answers only
/// health, monitoring and admin routes.
async fn serve_request(
    app: Arc<App>,
    slot: Arc<crate::accept::Slot>,
    limits: crate::accept::Limits,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    slot.request_started();
    let finished = RequestFinished(slot.clone());
    let resp = if slot.reserve && !reserve_route(req.uri().path()) {
        connection_limit_response(limits)
    } else {
        handle(app, req).await?
    };
    Ok(resp.map(|body| {
        TrackedBody {
            inner: body,
            _finished: finished,
        }
        .boxed_unsync()
    }))
}

/// A response body that marks its connection's request finished when hyper is done with it
/// (drops it); it passes everything through, the size hint included (`content-length`).
struct TrackedBody {
    inner: ResponseBody,
    _finished: RequestFinished,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Marks its connection's request finished when dropped.
struct RequestFinished(Arc<crate::accept::Slot>);

impl Drop for RequestFinished {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// Routes a reserve connection serves: health, monitoring and admin.
fn reserve_route(path: &str) -> bool {
    use crate::auth::Access;
    matches!(crate::auth::access(path), Access::Open | Access::Admin)
        || path == "/engines"
        || path == "/metrics"
}

/// 503 for a request other than health or admin on a reserve connection.
fn connection_limit_response(limits: crate::accept::Limits) -> Response<ResponseBody> {
    let body = crate::error::error_json(
        &format!(
            "all {} connections (server.max_connections) are busy; this connection serves only /health, /metrics, /engines and admin routes; retry in 1s",
            limits.cap
        ),
        mlxd_protocol::error::ErrorType::EngineUnavailable,
        Some("connection_limit"),
        None,
    );
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

async fn handle(
    app: Arc<App>,
    mut req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let span = tracing::info_span!(
        "request",
        request_id = id,
        method = %req.method(),
        path = %req.uri().path(),
        model = tracing::field::Empty,
    );
    let shape = ErrorShape::for_path(req.uri().path());
    let guard = app.guard();
    let origin = match guard.check(req.method(), req.uri().path(), req.headers()) {
        Err(e) => return Ok(error_response(&span, e, shape, None)),
        Ok(Some(origin)) if req.method() == Method::OPTIONS => {
            // A CORS preflight from an allowed origin.
            let mut r = Response::new(
                Full::new(Bytes::new())
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            );
            *r.status_mut() = StatusCode::NO_CONTENT;
            crate::auth::cors_headers(r.headers_mut(), origin, true);
            return Ok(r);
        }
        Ok(origin) => origin,
    };
    guard.strip_credentials(req.headers_mut());
    let mut resp = match route(&app, req, id).instrument(span.clone()).await {
        Ok(r) => r,
        Err(e) => return Ok(error_response(&span, e, shape, origin)),
    };
    if let Some(origin) = origin {
        crate::auth::cors_headers(resp.headers_mut(), origin, false);
    }
    Ok(resp)
}

/// The configured connection cap, or the default for this process's open-file limit;
/// warns when a configured cap exceeds what the limit can hold.
fn connection_cap(config: &Config) -> usize {
    let open_files = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024);
    let fitting = crate::accept::default_max_connections(open_files);
    match config.server.max_connections {
        Some(n) => {
            if n > fitting {
                warn!(
                    max_connections = n,
                    open_file_limit = open_files,
                    fits = fitting,
                    "max_connections exceeds what the open-file limit can hold; expect accept errors (raise ulimit -n)"
                );
            }
            n
        }
        None => fitting,
    }
}

/// Logs a failed request and renders its error in the route's shape (with CORS
/// headers for an allowed cross-origin caller, so the browser lets it read the error).
fn error_response(
    span: &tracing::Span,
    e: ProxyError,
    shape: ErrorShape,
    origin: Option<HeaderValue>,
) -> Response<ResponseBody> {
    let _g = span.enter();
    if e.status().is_server_error() {
        warn!(status = e.status().as_u16(), error = %e, "request failed");
    } else {
        debug!(status = e.status().as_u16(), error = %e, "request rejected");
    }
    let mut r = e
        .into_response_shaped::<Full<Bytes>>(shape)
        .map(|b| b.map_err(|e| match e {}).boxed_unsync());
    if let Some(origin) = origin {
        crate::auth::cors_headers(r.headers_mut(), origin, false);
    }
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<ResponseBody> {
    json_typed(status, v, "application/json")
}

/// A whole JSON body with `status` and the `Content-Type` a route family sends (Ollama's
/// routes add a charset, as Ollama does).
pub(crate) fn json_typed(
    status: StatusCode,
    v: &Value,
    content_type: &'static str,
) -> Response<ResponseBody> {
    let mut r = Response::new(
        Full::new(Bytes::from(v.to_string()))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

async fn route(
    app: &App,
    req: Request<Incoming>,
    id: u64,
) -> Result<Response<ResponseBody>, ProxyError> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => return Ok(health(app, true).await),
        (&Method::GET, "/health/ready") => return Ok(health(app, false).await),
        // The process is up and its accept loop runs; nothing else is asked.
        (&Method::GET, "/health/live") => {
            return Ok(json_response(
                StatusCode::OK,
                &json!({ "status": "live", "pid": std::process::id() }),
            ))
        }
        (&Method::GET, "/v1/models") => return Ok(models(app).await),
        (&Method::GET, p) if crate::chat_page::asset(p).is_some() => {
            if let Some((body, content_type)) = crate::chat_page::asset(p) {
                return Ok(crate::chat_page::response(body, content_type));
            }
        }
        (&Method::GET, "/metrics") => {
            let mut r = Response::new(
                Full::new(Bytes::from(app.metrics.encode()))
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            );
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return Ok(r);
        }
        (&Method::GET, "/engines") => {
            app.routing.refresh(None).await;
            let status = app.pool.status().await;
            return Ok(json_response(StatusCode::OK, &json!({ "engines": status })));
        }
        (&Method::POST, "/engines/reset") => {
            let model = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("model=")))
                .map(String::from);
            let reset = app.pool.reset(model).await;
            return Ok(json_response(StatusCode::OK, &json!({ "reset": reset })));
        }
        (_, p) if adapters_route(p).is_some() => {
            let (model, name) = adapters_route(p).expect("matched");
            let (model, name) = (model.to_string(), name.map(str::to_string));
            return admin_adapters(app, req, &model, name.as_deref()).await;
        }
        (&Method::POST, p) if p.starts_with("/admin/models/") => {
            return admin(app, &p["/admin/models/".len()..]).await;
        }
        (_, p) if crate::jobs::api::is_jobs_path(p) => return jobs_route(app, req).await,
        (_, p) if crate::ollama::is_ollama_path(p) => {
            return Ok(crate::ollama::route(app, req, id).await)
        }
        (&Method::GET, p) if p.starts_with("/logs/") => {
            let query = req.uri().query().unwrap_or("").to_string();
            return logs(app, &p["/logs/".len()..], &query);
        }
        _ => {}
    }
    let started = Instant::now();
    let max = app.config.server.max_body_bytes;
    let engine_post = req.method() == Method::POST && ENGINE_POST_ROUTES.contains(&path.as_str());
    if !engine_post {
        if req.method() == Method::GET && is_engine_get_route(&path) {
            // No body; goes to the default model's engine, one attempt.
            let (parts, body) = req.into_parts();
            let body: ProxyRequestBody = Limited::new(body, max).boxed();
            let lease = app.pool.acquire(&app.catalog().default_model).await?;
            let resp = forward(lease, parts, body, id, max, None, None).await?;
            return Ok(resp.map(|b: ProxyBody| b.boxed_unsync()));
        }
        return Err(ProxyError::NotFound(format!(
            "no route for {} {path}",
            req.method()
        )));
    }
    if let Some(len) = content_length(&req) {
        if len > max as u64 {
            return Err(ProxyError::BodyTooLarge {
                limit: max,
                got: Some(len),
            });
        }
    }
    let (parts, body) = req.into_parts();
    let body_timeout = app.config.server.body_timeout_ms;
    let bytes = tokio::time::timeout(Duration::from_millis(body_timeout), read_bounded(body, max))
        .await
        .map_err(|_| ProxyError::RequestTimeout {
            what: "request body",
            limit_ms: body_timeout,
            setting: "body_timeout_ms",
        })??;
    dispatch(app, parts, &path, bytes, id, started).await
}

/// Sends a JSON request body to the engine route `path`: validation, routing by `model`,
/// limits, the KV check, retries and resumption, metrics. The OpenAI and Anthropic routes
/// come here, and the Ollama routes with their translated bodies (`crate::ollama`).
async fn dispatch(
    app: &App,
    parts: http::request::Parts,
    path: &str,
    bytes: Bytes,
    id: u64,
    started: Instant,
) -> Result<Response<ResponseBody>, ProxyError> {
    let max = app.config.server.max_body_bytes;
    // Read once, by the contract the engine applies too; the server's token ceiling
    // applies to the effective limit and is the default.
    let request =
        crate::request::ClientRequest::read(path, bytes, app.config.server.max_tokens_limit)?;
    let max_tokens = request.max_tokens;
    let model = app.routing.resolve(request.facts.model.as_deref()).await?;
    tracing::Span::current().record("model", model.as_str());
    let accounting = Accounting {
        metrics: app.metrics.clone(),
        started,
    };
    // A generation request is recorded so that it can be continued on a restarted
    // engine if its engine dies (`resume.rs`).
    let mut record = crate::resume::ResumeRecord::new(
        &request.facts,
        request.object,
        app.config.server.max_resumes,
    );
    // A buffered body can be sent again if the first engine was unreachable (it died
    // between handing out the lease and our connect): the request never reached it.
    let mut dead_generation = None;
    let mut retried_unreachable = false;
    let mut body_bytes = request.body;
    let result = loop {
        let lease = match app
            .pool
            .lease_for(&model, dead_generation, max_tokens)
            .await
        {
            Ok(l) => l,
            Err(e) => break Err(e),
        };
        let generation = lease.generation;
        let body: ProxyRequestBody = Full::new(body_bytes.clone())
            .map_err(|e| match e {})
            .boxed();
        let resumption = record.clone().map(|record| Resumption {
            record,
            pool: app.pool.clone(),
            parts: copy_head(&parts),
            request_id: id,
            max_body: max,
            max_tokens,
        });
        match forward(
            lease,
            copy_head(&parts),
            body,
            id,
            max,
            Some(accounting.clone()),
            resumption,
        )
        .await
        {
            Ok(resp) => break Ok(resp.map(|b: ProxyBody| b.boxed_unsync())),
            Err(ForwardError::NotDelivered(e)) if !retried_unreachable => {
                warn!(error = %e, "engine unreachable before the request was sent; retrying once");
                retried_unreachable = true;
                dead_generation = Some(generation);
            }
            // The engine died before answering (a non-streaming request, or a stream
            // still in its prompt): send it again to the restarted engine.
            Err(ForwardError::Failed(crash)) if crate::forward::is_crash(&crash) => {
                let Some(rec) = record.as_mut() else {
                    break Err(crash);
                };
                match rec.resume() {
                    crate::resume::Resume::Continue(b) => {
                        warn!(error = %crash, attempt = rec.resumes(), "engine died before answering; resuming the request on its successor");
                        body_bytes = b;
                        dead_generation = Some(generation);
                    }
                    crate::resume::Resume::Impossible(why) => {
                        break Err(ProxyError::NotResumed {
                            model: model.clone(),
                            crash: crash.to_string(),
                            reason: why.to_string(),
                        })
                    }
                    crate::resume::Resume::Finish(_) => break Err(crash),
                }
            }
            Err(e) => break Err(e.into()),
        }
    };
    if let Err(e) = &result {
        app.metrics
            .record_failure(&model, e.status().as_u16(), started);
    }
    result
}

/// The `/v1/jobs` routes (`crate::jobs::api`), with the body read within the limits.
async fn jobs_route(
    app: &App,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ProxyError> {
    let max = app.config.server.max_body_bytes;
    // Refused at once, as on the generation routes, instead of after the body timeout.
    if let Some(len) = content_length(&req).filter(|len| *len > max as u64) {
        return Err(ProxyError::BodyTooLarge {
            limit: max,
            got: Some(len),
        });
    }
    let home = app
        .home
        .as_ref()
        .map_err(|e| ProxyError::Internal(format!("jobs need a model store: {e}")))?;
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let query = req.uri().query().unwrap_or("").to_string();
    let body_timeout = app.config.server.body_timeout_ms;
    let body = tokio::time::timeout(
        Duration::from_millis(body_timeout),
        read_bounded(req.into_body(), max),
    )
    .await
    .map_err(|_| ProxyError::RequestTimeout {
        what: "request body",
        limit_ms: body_timeout,
        setting: "body_timeout_ms",
    })??;
    if method == Method::POST {
        // A job may name a model that reached the store since the catalog last looked.
        app.routing.refresh(None).await;
    }
    crate::jobs::api::handle(
        &app.jobs,
        &app.catalog(),
        home,
        &method,
        &path,
        &query,
        body,
    )
    .await
}

/// Applies each reloaded configuration in turn: first who may talk to mlxd (keys read again,
/// so a removed key is refused from here on; a key file that cannot be read refuses the
/// whole reload), then the models ([`crate::routing::Routing::reload`]).
async fn apply_reloads(app: Arc<App>, mut reloads: tokio::sync::mpsc::UnboundedReceiver<Config>) {
    while let Some(reloaded) = reloads.recv().await {
        // The access settings come whole from the reloaded file; the bind host stays.
        let (merged, _) = crate::reload::merge(&app.config, reloaded.clone());
        let guard = match build_guard(&merged) {
            Ok(g) => Arc::new(g),
            Err(e) => {
                warn!(error = %e, "configuration reload refused; the running configuration stays");
                continue;
            }
        };
        // A configured model that can never fit the reloaded budget refuses the reload.
        let catalog = {
            let merged = merged.clone();
            tokio::task::spawn_blocking(move || crate::routing::build_catalog(&merged)).await
        };
        if let Ok(Ok(catalog)) = &catalog {
            if let Some(why) = oversized_models(catalog, &merged) {
                warn!(error = %why, "configuration reload refused; the running configuration stays");
                continue;
            }
        }
        *app.guard.write().unwrap_or_else(|p| p.into_inner()) = guard;
        info!("access settings reloaded (API keys, allowed hosts and origins)");
        let before = app.catalog();
        app.routing.reload(reloaded).await;
        // Applied (the catalog was replaced): the reloaded `[pool]` budget is in force.
        if !Arc::ptr_eq(&before, &app.catalog()) {
            app.memory_budget
                .store(catalog::memory_budget(&merged), Ordering::Relaxed);
        }
    }
}

/// `/admin/models/{id}/adapters` (`None`) or `/admin/models/{id}/adapters/{name}`.
fn adapters_route(path: &str) -> Option<(&str, Option<&str>)> {
    let rest = path.strip_prefix("/admin/models/")?;
    if let Some(model) = rest.strip_suffix("/adapters") {
        return Some((model, None));
    }
    let (model, name) = rest.rsplit_once("/adapters/")?;
    Some((model, Some(name)))
}

/// The LoRA adapters of a model's engine, loaded and unloaded at run time:
/// `GET /admin/models/{id}/adapters` lists them (configured and loaded at run time), `POST`
/// `{"name", "path"}` loads one into the model's engine (loading the model first if it is
/// not running), `DELETE .../adapters/{name}` unloads one loaded at run time. Both are
/// forwarded to the engine (`/admin/adapters`), whose answer (or error) comes back as it is;
/// on success the routing and the model's later launches follow
/// ([`crate::routing::Routing::set_runtime_adapter`]).
async fn admin_adapters(
    app: &App,
    req: Request<Incoming>,
    model: &str,
    name: Option<&str>,
) -> Result<Response<ResponseBody>, ProxyError> {
    if model.is_empty() {
        return Err(ProxyError::BadRequest("a model id is required".into()));
    }
    let method = req.method().clone();
    let id = app.routing.resolve(Some(model)).await?;
    let entry = app
        .catalog()
        .get(&id)
        .cloned()
        .ok_or_else(|| ProxyError::NotFound(format!("model {id} is not configured")))?;
    match (&method, name) {
        (&Method::GET, None) => {
            let configured = entry
                .options
                .get("adapters")
                .and_then(|s| mlxd_protocol::engine_options::parse_adapter_list(s).ok())
                .unwrap_or_default();
            // Configured first, then those loaded at run time, in load order.
            let data = configured
                .into_iter()
                .map(|(name, dir)| (name, dir.display().to_string(), false))
                .chain(
                    entry
                        .runtime_adapters
                        .iter()
                        .map(|(n, d)| (n.clone(), d.clone(), true)),
                )
                .map(
                    |(name, path, runtime)| mlxd_protocol::adapters::ModelAdapter {
                        id: format!("{id}:{name}"),
                        name,
                        parent: id.clone(),
                        path,
                        runtime,
                    },
                )
                .collect();
            let list = mlxd_protocol::adapters::ModelAdapterList {
                object: mlxd_protocol::openai::OBJECT_LIST.into(),
                model: id.clone(),
                data,
            };
            let list =
                serde_json::to_value(list).map_err(|e| ProxyError::Internal(e.to_string()))?;
            Ok(json_response(StatusCode::OK, &list))
        }
        (&Method::POST, None) => {
            let max = app.config.server.max_body_bytes;
            let body = read_bounded(req.into_body(), max).await?;
            let load: mlxd_protocol::adapters::AdapterLoad = serde_json::from_slice(&body)
                .map_err(|e| {
                    ProxyError::BadRequest(format!(
                        "the body must be {{\"name\": ..., \"path\": ...}}: {e}"
                    ))
                })?;
            if !std::path::Path::new(&load.path).is_absolute() {
                return Err(ProxyError::BadRequest(format!(
                    "path {:?} must be absolute: the engine does not share the client's working directory",
                    load.path
                )));
            }
            // A name taken (configured or loaded at run time) is the engine's 409.
            let body =
                serde_json::to_vec(&load).map_err(|e| ProxyError::Internal(e.to_string()))?;
            let (status, answer) =
                to_engine(app, &id, Method::POST, "/admin/adapters", body).await?;
            if status.is_success() {
                app.routing
                    .set_runtime_adapter(&id, &load.name, Some(load.path))
                    .await?;
            }
            Ok(json_response(status, &answer))
        }
        (&Method::DELETE, Some(name)) => {
            if !entry.runtime_adapters.iter().any(|(n, _)| n == name) {
                if entry.adapters().iter().any(|n| n == name) {
                    return Err(ProxyError::BadRequest(format!(
                        "the adapter {name:?} of model {id} is configured (its `adapters` option or an adapter entry in mlxd.toml); remove it there and reload"
                    )));
                }
                return Err(ProxyError::NotFound(format!(
                    "model {id} has no adapter {name:?} loaded at run time"
                )));
            }
            let running = app
                .pool
                .status()
                .await
                .into_iter()
                .any(|s| s.model == id && s.state == "ready");
            let mut answer = json!({"object": "adapter", "id": format!("{id}:{name}"), "name": name, "parent": id});
            if running {
                let path = format!("/admin/adapters/{name}");
                let (status, body) = to_engine(app, &id, Method::DELETE, &path, Vec::new()).await?;
                // 404: the engine does not hold it (it restarted without it): nothing to undo.
                if !status.is_success() && status != StatusCode::NOT_FOUND {
                    return Ok(json_response(status, &body));
                }
                if status.is_success() {
                    answer = body;
                }
            }
            app.routing.set_runtime_adapter(&id, name, None).await?;
            Ok(json_response(StatusCode::OK, &answer))
        }
        _ => Err(ProxyError::NotFound(format!(
            "no admin route for {method} {}",
            if name.is_some() {
                "/admin/models/{id}/adapters/{name} (DELETE)"
            } else {
                "/admin/models/{id}/adapters (GET, POST)"
            }
        ))),
    }
}

/// Sends one admin request to `model`'s engine (loading it if needed) and returns its
/// status and JSON answer.
async fn to_engine(
    app: &App,
    model: &str,
    method: Method,
    path: &str,
    body: Vec<u8>,
) -> Result<(StatusCode, Value), ProxyError> {
    let lease = app.pool.acquire(model).await?;
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "localhost")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| ProxyError::Internal(e.to_string()))?;
    let resp = mlxd_ipc::uds::send(&lease.socket, req)
        .await
        .map_err(|e| ProxyError::Upstream {
            model: model.to_string(),
            detail: e.to_string(),
        })?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| ProxyError::Upstream {
            model: model.to_string(),
            detail: e.to_string(),
        })?
        .to_bytes();
    let value = serde_json::from_slice(&bytes).map_err(|e| ProxyError::Upstream {
        model: model.to_string(),
        detail: format!("the engine answered {status} with no JSON: {e}"),
    })?;
    Ok((status, value))
}

/// `POST /admin/models/{id}/load` and `/unload`.
async fn admin(app: &App, rest: &str) -> Result<Response<ResponseBody>, ProxyError> {
    let (name, action) = rest
        .rsplit_once('/')
        .ok_or_else(|| ProxyError::NotFound(format!("no admin route for {rest:?}")))?;
    if name.is_empty() {
        return Err(ProxyError::BadRequest("a model id is required".into()));
    }
    let id = app.routing.resolve(Some(name)).await?;
    if matches!(action, "load" | "unload") {
        // An explicit load or unload starts from the configuration: limits halved after
        // out-of-memory exits, and a failed state, are cleared.
        app.pool.reset(Some(id.clone())).await;
    }
    match action {
        "load" => app.pool.load(&id).await?,
        "unload" => app.pool.unload(&id).await?,
        other => {
            return Err(ProxyError::NotFound(format!(
                "unknown admin action {other:?}; expected load or unload"
            )))
        }
    }
    let row = app.pool.status().await.into_iter().find(|s| s.model == id);
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "model": id,
            "action": action,
            "state": row.as_ref().map(|r| r.availability),
            "engine": row,
        }),
    ))
}

/// `GET /logs/{model}`: recent lines as text; `?follow=1` streams them as SSE
/// (`lines=N` sets how many recent lines come first, default 200).
fn logs(app: &App, name: &str, query: &str) -> Result<Response<ResponseBody>, ProxyError> {
    let id = app.catalog().resolve(Some(name))?.id.clone();
    let log = app
        .logs
        .get(&id)
        .ok_or_else(|| ProxyError::Internal(format!("no log for model {id}")))?;
    let param = |k: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
    };
    let lines = param("lines").and_then(|v| v.parse().ok()).unwrap_or(200);
    let follow = matches!(param("follow"), Some("1" | "true"));
    if !follow {
        let mut text = log.recent(lines).join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        let mut r = Response::new(
            Full::new(Bytes::from(text))
                .map_err(|e| match e {})
                .boxed_unsync(),
        );
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        return Ok(r);
    }
    use futures::StreamExt;
    let (backlog, rx) = log.follow(lines);
    let mut stopping = app.stopping.clone();
    let stop = async move {
        let _ = stopping.wait_for(|s| *s).await;
    };
    let live = tokio_stream::wrappers::BroadcastStream::new(rx).map(|r| match r {
        Ok(line) => line_event(&line),
        Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
            Bytes::from(format!(": {n} lines skipped (slow reader)\n\n"))
        }
    });
    let events = futures::stream::iter(backlog.into_iter().map(|l| line_event(&l)))
        .chain(live)
        .take_until(Box::pin(stop))
        .map(|b| Ok::<_, BoxError>(hyper::body::Frame::data(b)));
    let mut r = Response::new(http_body_util::StreamBody::new(events).boxed_unsync());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(r)
}

/// One log line as an SSE event (a line never holds a newline).
fn line_event(line: &str) -> Bytes {
    Bytes::from(format!("data: {line}\n\n"))
}

fn content_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// The most bytes set aside for a body before its bytes arrive: a client that announces a
/// large body and sends little of it holds no more than this.
const BODY_RESERVE: usize = 64 << 10;

/// Reads the whole body into one buffer, refusing it as soon as more than `max` bytes have
/// come. The buffer grows as bytes arrive (a large one is a mapping of its own, which glibc
/// moves rather than copies as it grows): a body costs its size once, where collecting its
/// pieces and then joining them cost it twice, and it is all freed at once.
pub(crate) async fn read_bounded(mut body: Incoming, max: usize) -> Result<Bytes, ProxyError> {
    let announced = body.size_hint().exact().unwrap_or(0);
    let mut buf = bytes::BytesMut::with_capacity(announced.min(BODY_RESERVE as u64) as usize);
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ProxyError::BadRequest(format!("reading request body: {e}")))?;
        // Trailers carry nothing the routes read.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if buf.len() + data.len() > max {
            return Err(ProxyError::BodyTooLarge {
                limit: max,
                got: None,
            });
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// The Ollama routes' view of the server (`crate::ollama`).
impl crate::ollama::Backend for App {
    fn resolve<'a>(
        &'a self,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<String, ProxyError>> {
        Box::pin(self.routing.resolve(Some(name)))
    }
    fn refresh(&self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(self.routing.refresh(None))
    }
    fn pool(&self) -> &PoolHandle {
        &self.pool
    }
    fn config(&self) -> &Config {
        &self.config
    }
    fn home(&self) -> Result<&std::path::Path, &str> {
        self.home.as_deref().map_err(String::as_str)
    }
    fn dispatch<'a>(
        &'a self,
        parts: http::request::Parts,
        path: &'static str,
        body: Bytes,
        id: u64,
        arrived: Instant,
    ) -> futures::future::BoxFuture<'a, Result<Response<ResponseBody>, ProxyError>> {
        Box::pin(dispatch(self, parts, path, body, id, arrived))
    }
}

/// Asks a ready engine's own `/health` (1 s budget).
async fn engine_responds(socket: &std::path::Path) -> bool {
    let req = Request::get("/health")
        .header(header::HOST, "localhost")
        .body(http_body_util::Empty::<Bytes>::new());
    let Ok(req) = req else { return false };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), mlxd_ipc::uds::send(socket, req)).await,
        Ok(Ok(resp)) if resp.status().is_success()
    )
}

/// `GET /health` (and `/health/ready`, without the engine list): the verdict of
/// [`crate::health::assess`] as 200 or 503, with the reasons in the body.
async fn health(app: &App, detail: bool) -> Response<ResponseBody> {
    let engines = app.pool.status().await;
    let mut responding = Vec::with_capacity(engines.len());
    for e in &engines {
        responding.push(if e.state == "ready" {
            Some(engine_responds(&e.socket).await)
        } else {
            None
        });
    }
    let budget = app.memory_budget.load(Ordering::Relaxed);
    let models: Vec<crate::health::ModelHealth<'_>> = engines
        .iter()
        .zip(&responding)
        .map(|(e, r)| crate::health::ModelHealth {
            model: &e.model,
            state: e.state,
            responding: *r,
            failure: e.failure.as_deref(),
            too_large: (e.pid.is_none() && e.planned_bytes > budget)
                .then_some((e.planned_bytes, budget)),
        })
        .collect();
    let draining = *app.stopping.borrow();
    let verdict = crate::health::assess(draining, &models);
    let mut body = json!({
        "status": verdict.status,
        "reasons": verdict.reasons,
        "models_serving": verdict.serving,
        "models_loadable": verdict.loadable,
        "proxy": { "status": if draining { "draining" } else { "ok" }, "uptime_s": app.started.elapsed().as_secs_f64(), "pid": std::process::id() },
    });
    if detail {
        body["engines"] = engines
            .iter()
            .zip(&responding)
            .map(|(e, r)| {
                json!({
                    "model": e.model,
                    "state": e.state,
                    "pid": e.pid,
                    "responding": r,
                    "failure": e.failure,
                    "last_exit": e.last_exit.as_ref().map(|x| &x.cause),
                })
            })
            .collect();
    }
    json_response(verdict.http_status(), &body)
}

/// Every configured model, with its pool state in extension fields: `state` (loaded,
/// loading, unloaded, failed), `failure` (the reason, when failed), `aliases`, `pinned`.
async fn models(app: &App) -> Response<ResponseBody> {
    // Models quantized, converted or pulled since the last look are listed too.
    app.routing.refresh(None).await;
    let engines = app.pool.status().await;
    let catalog = app.catalog();
    let default_model = catalog.default_model.clone();
    let data: Vec<Value> = engines
        .iter()
        // A model a reload removed drains out of sight (`/engines` still shows it).
        .filter(|e| e.configured)
        .flat_map(|e| {
            let model = json!({
                "id": e.model,
                "object": "model",
                "created": 0,
                "owned_by": "mlxd",
                "state": e.availability,
                "loading_progress": e.loading_progress,
                "loading_phase": e.loading_phase,
                "failure": e.failure,
                "aliases": e.aliases,
                "pinned": e.pinned,
                "default": e.model == default_model,
            });
            // Its LoRA adapters, each `<model>:<adapter>` (an adapter entry by its own id)
            // with the model as `parent` (as vLLM lists them); they load and unload with it.
            let adapters = catalog
                .get(&e.model)
                .map(|m| m.listed_adapters())
                .unwrap_or_default();
            let adapters = adapters.into_iter().map(|id| {
                json!({
                    "id": id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "mlxd",
                    "parent": e.model,
                    "state": e.availability,
                    "default": false,
                })
            });
            std::iter::once(model).chain(adapters).collect::<Vec<_>>()
        })
        .collect();
    json_response(StatusCode::OK, &json!({ "object": "list", "data": data }))
}
