//! The jobs routes: `POST /v1/jobs`, `GET /v1/jobs`, `GET /v1/jobs/{id}` (`?follow=1`: SSE),
//! `DELETE /v1/jobs/{id}`. Errors go back to `server.rs`, the one place they become responses.
use std::path::Path;

use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderValue, Method, Response, StatusCode};
use http_body_util::BodyExt;
use mlxd_protocol::jobs::{event, Job, JobList};
use tokio::sync::broadcast::error::RecvError;

use super::{request, JobEvent, JobsHandle};
use crate::catalog::Catalog;
use crate::error::ProxyError;
use crate::forward::BoxError;
use crate::response_body::{self, ResponseBody};

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<ResponseBody> {
    let body = serde_json::to_vec(v).unwrap_or_default();
    let mut r = Response::new(response_body::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// Whether `path` is one of the jobs routes.
pub fn is_jobs_path(path: &str) -> bool {
    path == "/v1/jobs" || path.starts_with("/v1/jobs/")
}

/// Answers one jobs request; `body` is the request body (read by the caller, bounded).
pub async fn handle(
    jobs: &JobsHandle,
    catalog: &Catalog,
    home: &Path,
    method: &Method,
    path: &str,
    query: &str,
    body: Bytes,
) -> Result<Response<ResponseBody>, ProxyError> {
    let id = path
        .strip_prefix("/v1/jobs")
        .map(|rest| rest.trim_start_matches('/'))
        .unwrap_or("");
    if id.contains('/') {
        return Err(ProxyError::NotFound(format!("no route {path}")));
    }
    match (method, id) {
        (&Method::POST, "") => {
            let prepared = {
                let (catalog, home) = (catalog.clone(), home.to_path_buf());
                // Reads safetensors headers and stats paths: off the async threads.
                tokio::task::spawn_blocking(move || request::prepare(&body, &catalog, &home))
                    .await
                    .map_err(|e| ProxyError::Internal(format!("preparing the job: {e}")))??
            };
            let job = jobs.submit(prepared).await?;
            Ok(json(StatusCode::CREATED, &job))
        }
        (&Method::GET, "") => Ok(json(
            StatusCode::OK,
            &JobList {
                jobs: jobs.list().await,
            },
        )),
        (&Method::GET, id) => {
            let follow = query.split('&').any(|kv| kv == "follow=1" || kv == "follow=true");
            if follow {
                follow_response(jobs, id).await
            } else {
                Ok(json(StatusCode::OK, &jobs.get(id).await?))
            }
        }
        (&Method::DELETE, id) if !id.is_empty() => Ok(json(StatusCode::OK, &jobs.cancel(id).await?)),
        (m, _) => Err(ProxyError::NotFound(format!(
            "no route {m} {path}; the jobs API is POST /v1/jobs, GET /v1/jobs, GET /v1/jobs/{{id}}[?follow=1], DELETE /v1/jobs/{{id}}"
        ))),
    }
}

fn sse(name: &str, data: &impl serde::Serialize) -> Bytes {
    let data = serde_json::to_string(data).unwrap_or_default();
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// `?follow=1`: `job` (as it stands), then `progress` and `job` events, then `result`.
async fn follow_response(
    jobs: &JobsHandle,
    id: &str,
) -> Result<Response<ResponseBody>, ProxyError> {
    let (job, rx) = jobs.follow(id).await?;
    let first = if job.state.is_final() {
        vec![sse(event::JOB, &job), sse(event::RESULT, &job)]
    } else {
        vec![sse(event::JOB, &job)]
    };
    let done = job.state.is_final();
    let live = futures::stream::unfold((rx, done), |(mut rx, done)| async move {
        if done {
            return None;
        }
        let item = match rx.recv().await {
            Ok(JobEvent::Progress(p)) => (sse(event::PROGRESS, &p), false),
            Ok(JobEvent::State(job)) => (sse(event::JOB, &*job), false),
            Ok(JobEvent::Final(job)) => (sse(event::RESULT, &*job as &Job), true),
            Err(RecvError::Lagged(n)) => (
                Bytes::from(format!(": {n} progress events skipped (slow reader)\n\n")),
                false,
            ),
            Err(RecvError::Closed) => return None,
        };
        Some((item.0, (rx, item.1)))
    });
    let events = futures::stream::iter(first)
        .chain(live)
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
