//! The Ollama API subset (`/api/*`), for the tools that speak only Ollama: version, tags,
//! ps, show, chat, generate, pull; embeddings answered 501 until mlxd has embedding
//! models.
//!
//! Generation is not a second engine path: a request is translated into the engine's
//! OpenAI request ([`request`]) and sent through the proxy's one dispatch (routing, queue,
//! KV check, resumption, metrics: [`Backend::dispatch`]); the engine's SSE stream is
//! translated back into NDJSON ([`stream`]). Errors answer in Ollama's shape,
//! `{"error": "..."}`, with the status the proxy would give the OpenAI route.

pub mod clock;
pub mod models;
pub mod pull;
pub mod request;
pub mod stream;

use std::path::Path;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::StreamExt;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::{ErrorShape, ProxyError};
use crate::forward::BoxError;
use crate::pool::PoolHandle;
use crate::server::ResponseBody;
use clock::KeepAlive;
use request::Translated;
use stream::{Step, Timing, Translator};

/// What the Ollama routes need from the server.
pub trait Backend: Send + Sync {
    /// The catalog id of the model a request names, as the OpenAI routes resolve it (a
    /// name only the store knows is added to the catalog).
    fn resolve<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<String, ProxyError>>;
    /// Reads the store again, so that models pulled or built since are listed.
    fn refresh(&self) -> BoxFuture<'_, ()>;
    fn pool(&self) -> &PoolHandle;
    fn config(&self) -> &Config;
    /// The model store (`$MLXD_HOME`), or why there is none.
    fn home(&self) -> Result<&Path, &str>;
    /// Sends a JSON request body to an engine route exactly as the OpenAI routes are sent
    /// (validation, routing by `model`, limits, retries, resumption, metrics).
    fn dispatch<'a>(
        &'a self,
        parts: http::request::Parts,
        path: &'static str,
        body: Bytes,
        id: u64,
        arrived: Instant,
    ) -> BoxFuture<'a, Result<Response<ResponseBody>, ProxyError>>;
}

/// Whether `path` is one of ours.
pub fn is_ollama_path(path: &str) -> bool {
    path.starts_with("/api/")
}

/// Answers one `/api/*` request; every failure is an Ollama error object.
pub async fn route<B: Backend>(b: &B, req: Request<Incoming>, id: u64) -> Response<ResponseBody> {
    let arrived = Instant::now();
    match route_inner(b, req, id, arrived).await {
        Ok(r) => r,
        Err(e) => proxy_error(e),
    }
}

async fn route_inner<B: Backend>(
    b: &B,
    req: Request<Incoming>,
    id: u64,
    arrived: Instant,
) -> Result<Response<ResponseBody>, ProxyError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method.clone(), path.as_str()) {
        (Method::GET | Method::HEAD, "/api/version") => {
            return Ok(json_reply(
                StatusCode::OK,
                &json!({"version": env!("CARGO_PKG_VERSION")}),
            ))
        }
        (Method::GET | Method::HEAD, "/api/tags") => return Ok(tags(b).await),
        (Method::GET | Method::HEAD, "/api/ps") => return Ok(ps(b).await),
        (Method::POST, "/api/embed" | "/api/embeddings") => {
            return Ok(error_reply(
                StatusCode::NOT_IMPLEMENTED,
                "embeddings are not supported yet: mlxd serves no embedding models",
            ))
        }
        (_, p)
            if p.starts_with("/api/blobs/")
                || matches!(p, "/api/create" | "/api/copy" | "/api/delete" | "/api/push") =>
        {
            return Ok(error_reply(
                StatusCode::NOT_IMPLEMENTED,
                &format!(
                    "{p} is not supported by mlxd (supported: /api/version, /api/tags, /api/ps, /api/show, /api/chat, /api/generate, /api/pull)"
                ),
            ))
        }
        (Method::POST, "/api/show" | "/api/chat" | "/api/generate" | "/api/pull") => {}
        _ => {
            return Err(ProxyError::NotFound(format!(
                "no Ollama route for {method} {path}"
            )))
        }
    }
    let body = read_body(b.config(), req.into_body()).await?;
    match path.as_str() {
        "/api/show" => show(b, &body).await,
        "/api/pull" => pull(b, &body).await,
        "/api/chat" => generation(b, request::chat(&body)?, id, arrived).await,
        _ => generation(b, request::generate(&body)?, id, arrived).await,
    }
}

/// The request body, within the server's size and time limits.
async fn read_body(config: &Config, body: Incoming) -> Result<Bytes, ProxyError> {
    let limit_ms = config.server.body_timeout_ms;
    tokio::time::timeout(
        Duration::from_millis(limit_ms),
        crate::server::read_bounded(body, config.server.max_body_bytes),
    )
    .await
    .map_err(|_| ProxyError::RequestTimeout {
        what: "request body",
        limit_ms,
        setting: "body_timeout_ms",
    })?
}

/// The catalog id for an Ollama model name; `name:latest` is `name` (Ollama's default tag).
async fn resolve<B: Backend>(b: &B, name: &str) -> Result<String, ProxyError> {
    match b.resolve(name).await {
        Ok(id) => Ok(id),
        Err(e) => match name.strip_suffix(":latest") {
            Some(bare) => b.resolve(bare).await.map_err(|_| e),
            None => Err(e),
        },
    }
}

/// `/api/chat` and `/api/generate`.
async fn generation<B: Backend>(
    b: &B,
    mut t: Translated,
    id: u64,
    arrived: Instant,
) -> Result<Response<ResponseBody>, ProxyError> {
    let model = resolve(b, &t.model).await?;
    tracing::Span::current().record("model", model.as_str());
    t.body["model"] = Value::String(model.clone());
    let translator = Translator::new(t.route, model.clone(), t.thinking);
    if t.load_only {
        return load_only(b, &t, &model, translator, arrived).await;
    }
    // Waiting for the engine, timed apart from the generation (`load_duration`); the
    // dispatch below then finds it ready.
    let load_started = Instant::now();
    b.pool().load(&model).await?;
    keep_alive(b, &model, t.keep_alive).await?;
    let timing = Timing {
        arrived: arrived.into_std(),
        load: load_started.elapsed(),
        sent: Instant::now().into_std(),
    };
    let body = Bytes::from(t.body.to_string());
    let mut head = Request::post(t.path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(())
        .map_err(|e| ProxyError::Internal(format!("building the engine request: {e}")))?;
    head.headers_mut().insert(
        header::ACCEPT,
        HeaderValue::from_static("text/event-stream"),
    );
    let (parts, ()) = head.into_parts();
    let resp = b.dispatch(parts, t.path, body, id, arrived).await?;
    if !resp.status().is_success() {
        return Ok(engine_error(resp).await);
    }
    let unload = (t.keep_alive == KeepAlive::Unload).then(|| (b.pool().clone(), model.clone()));
    let (tx, rx) = mpsc::channel::<Value>(32);
    tokio::spawn(async move {
        pump(resp.into_body(), translator, timing, tx).await;
        if let Some((pool, model)) = unload {
            if let Err(e) = pool.unload(&model).await {
                tracing::warn!(%model, error = %e, "keep_alive 0: unloading the model failed");
            }
        }
    });
    if t.stream {
        return Ok(ndjson(rx));
    }
    let lines: Vec<Value> = tokio_stream::wrappers::ReceiverStream::new(rx)
        .collect()
        .await;
    if let Some(err) = lines.iter().find_map(|l| l.get("error")) {
        return Ok(json_reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            &json!({"error": err}),
        ));
    }
    Ok(json_reply(StatusCode::OK, &stream::fold(t.route, &lines)))
}

/// A request with nothing to generate: load the model (or, with `keep_alive: 0`, unload
/// it) and answer one `done` object, as Ollama does.
async fn load_only<B: Backend>(
    b: &B,
    t: &Translated,
    model: &str,
    translator: Translator,
    arrived: Instant,
) -> Result<Response<ResponseBody>, ProxyError> {
    let reason = if t.keep_alive == KeepAlive::Unload {
        b.pool().unload(model).await?;
        "unload"
    } else {
        b.pool().load(model).await?;
        keep_alive(b, model, t.keep_alive).await?;
        "load"
    };
    let mut o = translator.done_head(reason);
    if reason == "load" {
        o.insert(
            "load_duration".into(),
            json!(arrived.elapsed().as_nanos() as u64),
        );
    }
    Ok(json_reply(StatusCode::OK, &Value::Object(o)))
}

/// Applies a request's positive or negative `keep_alive` to the loaded model (the pool
/// keeps it until the model is unloaded); absent leaves whatever holds, and 0 unloads
/// once the request is answered (the callers do that).
async fn keep_alive<B: Backend>(b: &B, model: &str, k: KeepAlive) -> Result<(), ProxyError> {
    let keep = match k {
        KeepAlive::For(d) => crate::pool::KeepAlive::For(d),
        KeepAlive::Forever => crate::pool::KeepAlive::Forever,
        KeepAlive::Default | KeepAlive::Unload => return Ok(()),
    };
    b.pool().keep_alive(model, keep).await
}

/// Reads the engine's stream, translates it, and sends the objects to `tx` until the
/// stream ends, fails, or the client goes (dropping the engine stream, which cancels the
/// generation).
async fn pump(mut body: ResponseBody, mut tr: Translator, timing: Timing, tx: mpsc::Sender<Value>) {
    let mut sse = mlxd_ipc::sse::SseSplitter::new();
    let error = |message: String| json!({"error": message});
    loop {
        let (events, finished) = match body.frame().await {
            None => (sse.finish().into_iter().collect::<Vec<_>>(), true),
            Some(Err(e)) => {
                let _ = tx
                    .send(error(format!("the engine stream failed: {e}")))
                    .await;
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => (sse.push(&data), false),
                Err(_) => continue, // trailers
            },
        };
        for ev in events {
            match tr.event(&ev, std::time::Instant::now()) {
                Step::Lines(lines) => {
                    for l in lines {
                        if tx.send(l).await.is_err() {
                            return;
                        }
                    }
                }
                Step::Error(m) => {
                    let _ = tx.send(error(m)).await;
                    return;
                }
            }
        }
        if finished {
            break;
        }
    }
    drop(body);
    match tr.finish(timing, std::time::Instant::now()) {
        Ok(lines) => {
            for l in lines {
                if tx.send(l).await.is_err() {
                    return;
                }
            }
        }
        Err(m) => {
            let _ = tx.send(error(m)).await;
        }
    }
}

/// A streaming `application/x-ndjson` response of the objects `rx` yields.
fn ndjson(rx: mpsc::Receiver<Value>) -> Response<ResponseBody> {
    let lines = tokio_stream::wrappers::ReceiverStream::new(rx).map(|v| {
        let mut line = v.to_string();
        line.push('\n');
        Ok::<_, BoxError>(Frame::data(Bytes::from(line)))
    });
    let mut r = Response::new(http_body_util::StreamBody::new(lines).boxed_unsync());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    r
}

fn json_reply(status: StatusCode, v: &Value) -> Response<ResponseBody> {
    crate::server::json_typed(status, v, "application/json; charset=utf-8")
}

fn error_reply(status: StatusCode, message: &str) -> Response<ResponseBody> {
    json_reply(status, &json!({ "error": message }))
}

/// A proxy error in Ollama's shape (with its status and `Retry-After`).
fn proxy_error(e: ProxyError) -> Response<ResponseBody> {
    if e.status().is_server_error() {
        tracing::warn!(status = e.status().as_u16(), error = %e, "request failed");
    } else {
        tracing::debug!(status = e.status().as_u16(), error = %e, "request rejected");
    }
    e.into_response_shaped::<Full<Bytes>>(ErrorShape::Ollama)
        .map(|b| b.map_err(|e| match e {}).boxed_unsync())
}

/// The engine's (or the dispatch's) error response, OpenAI-shaped, in Ollama's shape.
async fn engine_error(resp: Response<ResponseBody>) -> Response<ResponseBody> {
    let (parts, mut body) = resp.into_parts();
    // An error body is small; whatever exceeds 64 KiB is not read.
    let mut raw = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        if let Ok(data) = frame.into_data() {
            raw.extend_from_slice(&data);
            if raw.len() > 64 << 10 {
                break;
            }
        }
    }
    let message = serde_json::from_slice::<Value>(&raw)
        .ok()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .or(v["error"].as_str())
                .map(String::from)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&raw).trim().to_string());
    let mut r = error_reply(parts.status, &message);
    if let Some(after) = parts.headers.get(header::RETRY_AFTER) {
        r.headers_mut().insert(header::RETRY_AFTER, after.clone());
    }
    r
}

/// The store's facts of each source (`None` for a model not on disk yet), read off the
/// async threads (it reads safetensors headers).
async fn facts_of(
    home: Option<&Path>,
    sources: Vec<String>,
) -> Vec<Option<mlxd_store::facts::ModelFacts>> {
    let Some(home) = home.map(Path::to_path_buf) else {
        return vec![None; sources.len()];
    };
    let n = sources.len();
    tokio::task::spawn_blocking(move || {
        let opts = mlxd_store::StoreOptions::from_env(&home);
        sources
            .iter()
            .map(|s| mlxd_store::facts::show(s, &opts).ok())
            .collect()
    })
    .await
    .unwrap_or_else(|_| vec![None; n])
}

/// `GET /api/tags`: the models this server serves (its catalog: configured, `--model`
/// and `models_dir` models, and those in the store).
async fn tags<B: Backend>(b: &B) -> Response<ResponseBody> {
    b.refresh().await;
    let rows: Vec<_> = b
        .pool()
        .status()
        .await
        .into_iter()
        .filter(|s| s.configured)
        .collect();
    let facts = facts_of(
        b.home().ok(),
        rows.iter().map(|s| s.source.clone()).collect(),
    )
    .await;
    let models: Vec<Value> = rows
        .iter()
        .zip(&facts)
        .map(|(status, facts)| {
            models::tag(
                &models::Described {
                    status,
                    facts: facts.as_ref(),
                },
                crate::catalog::weights_on_disk(&status.source),
            )
        })
        .collect();
    json_reply(StatusCode::OK, &json!({ "models": models }))
}

/// `GET /api/ps`: the models with a running engine.
async fn ps<B: Backend>(b: &B) -> Response<ResponseBody> {
    let rows: Vec<_> = b
        .pool()
        .status()
        .await
        .into_iter()
        .filter(models::is_running)
        .collect();
    let facts = facts_of(
        b.home().ok(),
        rows.iter().map(|s| s.source.clone()).collect(),
    )
    .await;
    let now = SystemTime::now();
    let models: Vec<Value> = rows
        .iter()
        .zip(&facts)
        .map(|(status, facts)| {
            models::running(
                &models::Described {
                    status,
                    facts: facts.as_ref(),
                },
                now,
            )
        })
        .collect();
    json_reply(StatusCode::OK, &json!({ "models": models }))
}

/// The model a `/api/show` or `/api/pull` body names (`model`, or the older `name`).
fn named_model(body: &[u8]) -> Result<(String, Value), ProxyError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ProxyError::BadRequest(format!("request body is not valid JSON: {e}")))?;
    let name = ["model", "name"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
        .ok_or_else(|| ProxyError::BadRequest("model is required".into()))?
        .to_string();
    Ok((name, v))
}

/// `POST /api/show`.
async fn show<B: Backend>(b: &B, body: &[u8]) -> Result<Response<ResponseBody>, ProxyError> {
    let (name, _) = named_model(body)?;
    let id = resolve(b, &name).await?;
    let status = b
        .pool()
        .status()
        .await
        .into_iter()
        .find(|s| s.model == id)
        .ok_or_else(|| ProxyError::NotFound(format!("model {id:?} not found")))?;
    let facts = facts_of(b.home().ok(), vec![status.source.clone()])
        .await
        .pop()
        .flatten();
    Ok(json_reply(
        StatusCode::OK,
        &models::show(&models::Described {
            status: &status,
            facts: facts.as_ref(),
        }),
    ))
}

/// `POST /api/pull`: fetches (and converts) a model into the store like `mlxd pull`,
/// with NDJSON progress unless `stream` is false.
async fn pull<B: Backend>(b: &B, body: &[u8]) -> Result<Response<ResponseBody>, ProxyError> {
    let (name, v) = named_model(body)?;
    let stream = match v.get("stream") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(s)) => *s,
        Some(other) => {
            return Err(ProxyError::BadRequest(format!(
                "stream must be a boolean, got {other}"
            )))
        }
    };
    let home = b
        .home()
        .map_err(|e| ProxyError::Internal(format!("pulling needs a model store: {e}")))?
        .to_path_buf();
    let spec = name.strip_suffix(":latest").unwrap_or(&name).to_string();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut opts = mlxd_store::StoreOptions::from_env(&home);
    opts.progress = mlxd_store::Progress::new(move |e| {
        let _ = events_tx.send(e.clone());
    });
    tracing::info!(model = %spec, "pulling into the store");
    let job = tokio::task::spawn_blocking(move || mlxd_store::resolve_model_with(&spec, &opts));
    let (tx, rx) = mpsc::channel::<Value>(32);
    let driver = async move {
        let _ = tx.send(json!({"status": "pulling manifest"})).await;
        let mut status = pull::PullStatus::default();
        while let Some(e) = events.recv().await {
            if let Some(line) = status.line(&e) {
                // A client that went away stops the lines, not the pull.
                let _ = tx.send(line).await;
            }
        }
        let (line, code) = match job.await {
            Ok(Ok(resolved)) => {
                tracing::info!(model = %resolved.id, dir = %resolved.dir.display(), "pulled");
                (json!({"status": "success"}), StatusCode::OK)
            }
            Ok(Err(e)) => (json!({"error": e.to_string()}), pull::failure_status(&e)),
            Err(e) => (
                json!({"error": format!("the pull stopped: {e}")}),
                StatusCode::INTERNAL_SERVER_ERROR,
            ),
        };
        let _ = tx.send(line.clone()).await;
        (line, code)
    };
    if stream {
        tokio::spawn(driver);
        return Ok(ndjson(rx));
    }
    drop(rx);
    let (line, code) = driver.await;
    Ok(json_reply(code, &line))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_model_reads_model_or_name() {
        assert_eq!(named_model(br#"{"model":"a"}"#).unwrap().0, "a");
        assert_eq!(named_model(br#"{"name":"b"}"#).unwrap().0, "b");
        let e = named_model(br#"{"model":""}"#).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(named_model(b"nope").is_err());
    }
}
