//! [`TaskClient`]: managed jobs on `mlxd` (`/v1/jobs`): quantize a model, convert a GGUF,
//! fetch a repository, fine-tune a LoRA adapter (`JobRequest::Lora`, its figures in
//! `JobProgress::training`) or fuse one into its base (`JobRequest::Fuse`); follow their
//! progress, wait for the result, cancel.
//!
//! ```no_run
//! use mlxd_client::{Client, JobRequest, TaskClient};
//! # async fn run() -> Result<(), mlxd_client::ClientError> {
//! let tasks = TaskClient::new(Client::builder().http("http://127.0.0.1:8080")?);
//! let job = tasks
//!     .submit(&JobRequest::Quantize {
//!         model: "/models/llama".into(),
//!         bits: Some(4),
//!         group_size: Some(64),
//!         out: None,
//!     })
//!     .await?;
//! let done = tasks
//!     .wait(&job.id, |p| eprintln!("{} {}/{}", p.phase, p.done, p.total))
//!     .await?;
//! println!("{}", done.result.expect("a succeeded job has a result").dir.display());
//!
//! // A LoRA adapter, with mlx-lm's defaults but for the iterations.
//! let trained = tasks
//!     .run(
//!         &JobRequest::Lora {
//!             model: "/models/llama".into(),
//!             data: "/data/sql".into(),
//!             out: Some("sql".into()),
//!             resume: false,
//!             init_adapter: None,
//!             params: mlxd_client::TrainParams {
//!                 iters: 200,
//!                 ..Default::default()
//!             },
//!         },
//!         |p| {
//!             if let Some(t) = &p.training {
//!                 eprintln!("{}/{} loss {:?}", t.iteration, t.iters, t.train_loss);
//!             }
//!         },
//!     )
//!     .await?;
//! # let _ = trained;
//! # Ok(()) }
//! ```
use std::collections::VecDeque;
use std::pin::Pin;

use bytes::Bytes;
use futures::StreamExt;
use http::Method;
use http_body_util::BodyExt;
use mlxd_ipc::sse::SseSplitter;
use mlxd_protocol::jobs::{event, Job, JobList, JobProgress, JobRequest, JobState};

use crate::client::Client;
use crate::error::ClientError;
use crate::transport::Body;

/// What `GET /v1/jobs/{id}?follow=1` reports, in order: the job as it stands (and again on
/// each change of state), progress, and last the final job.
#[derive(Debug, Clone, PartialEq)]
pub enum JobUpdate {
    Job(Box<Job>),
    Progress(JobProgress),
    /// The job ended (succeeded, failed or cancelled); the stream ends after it.
    Finished(Box<Job>),
}

/// The updates of one followed job. It ends after [`JobUpdate::Finished`]; a connection that
/// fails or ends before it ends the stream with one `Err`.
pub type JobUpdates = Pin<Box<dyn futures::Stream<Item = Result<JobUpdate, ClientError>> + Send>>;

/// Managed jobs over HTTP to `mlxd` (the jobs API is `mlxd`'s, not an engine's). Submitting is
/// a POST and, like every POST of this crate, never retried.
#[derive(Clone)]
pub struct TaskClient {
    client: Client,
}

impl TaskClient {
    /// Jobs through `client`, which must be an HTTP client of `mlxd`
    /// ([`crate::ClientBuilder::http`]); its API key and timeouts apply (the timeout bounds each
    /// exchange and the wait for a followed job's response head, not the job).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// `POST /v1/jobs`: the job, queued or already running. A bad field is
    /// [`ClientError::Api`] with status 400 and the field in the body's `param`; a job that can
    /// never fit the memory budget is a 503 that says how much it needs and how much there is.
    pub async fn submit(&self, request: &JobRequest) -> Result<Job, ClientError> {
        let body = serde_json::to_vec(request).map_err(|e| ClientError::Encode(e.to_string()))?;
        self.client.json(Method::POST, "/v1/jobs", Some(body)).await
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn get(&self, id: &str) -> Result<Job, ClientError> {
        self.client
            .json(Method::GET, &format!("/v1/jobs/{id}"), None)
            .await
    }

    /// `GET /v1/jobs`: recent and running jobs.
    pub async fn list(&self) -> Result<Vec<Job>, ClientError> {
        let list: JobList = self.client.json(Method::GET, "/v1/jobs", None).await?;
        Ok(list.jobs)
    }

    /// `DELETE /v1/jobs/{id}`: answers once the job's processes are gone and its partial
    /// output removed. A job that has already ended is a 409.
    pub async fn cancel(&self, id: &str) -> Result<Job, ClientError> {
        self.client
            .json(Method::DELETE, &format!("/v1/jobs/{id}"), None)
            .await
    }

    /// `GET /v1/jobs/{id}?follow=1` as a stream of [`JobUpdate`]s.
    pub async fn follow(&self, id: &str) -> Result<JobUpdates, ClientError> {
        let resp = self
            .client
            .exchange_events(
                Method::GET,
                &format!("/v1/jobs/{id}?follow=1"),
                None,
                &format!("following job {id}"),
            )
            .await?;
        let reader = UpdateReader {
            body: Some(resp.into_body()),
            splitter: SseSplitter::new(),
            pending: VecDeque::new(),
            target: self.client.target(),
        };
        Ok(Box::pin(futures::stream::unfold(
            reader,
            |mut reader| async move { reader.next().await.map(|item| (item, reader)) },
        )))
    }

    /// Follows job `id` to its end, calling `on_progress` for each progress report. Returns the
    /// job once it succeeded; a job that failed or was cancelled is [`ClientError::Job`].
    pub async fn wait(
        &self,
        id: &str,
        mut on_progress: impl FnMut(&JobProgress) + Send,
    ) -> Result<Job, ClientError> {
        let mut updates = self.follow(id).await?;
        while let Some(update) = updates.next().await {
            match update? {
                JobUpdate::Progress(p) => on_progress(&p),
                JobUpdate::Job(_) => {}
                JobUpdate::Finished(job) if job.state == JobState::Succeeded => return Ok(*job),
                JobUpdate::Finished(job) => return Err(ClientError::Job(job)),
            }
        }
        Err(ClientError::Truncated)
    }

    /// Submits `request` and waits for its end ([`submit`](Self::submit), then
    /// [`wait`](Self::wait)).
    pub async fn run(
        &self,
        request: &JobRequest,
        on_progress: impl FnMut(&JobProgress) + Send,
    ) -> Result<Job, ClientError> {
        let job = self.submit(request).await?;
        self.wait(&job.id, on_progress).await
    }
}

struct UpdateReader {
    body: Option<Body>,
    splitter: SseSplitter,
    pending: VecDeque<Bytes>,
    target: String,
}

impl UpdateReader {
    async fn next(&mut self) -> Option<Result<JobUpdate, ClientError>> {
        loop {
            if let Some(raw) = self.pending.pop_front() {
                match parse_update(&raw) {
                    Ok(None) => continue,
                    Ok(Some(update)) => {
                        if matches!(update, JobUpdate::Finished(_)) {
                            self.body = None;
                        }
                        return Some(Ok(update));
                    }
                    Err(e) => return self.fail(e),
                }
            }
            let body = self.body.as_mut()?;
            match body.frame().await {
                None => {
                    if let Some(rest) = self.splitter.finish() {
                        self.pending.push_back(rest);
                        continue;
                    }
                    return self.fail(ClientError::Truncated);
                }
                Some(Err(e)) => {
                    let target = self.target.clone();
                    return self.fail(ClientError::Transport {
                        target,
                        detail: e.to_string(),
                    });
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.pending.extend(self.splitter.push(&data));
                    }
                }
            }
        }
    }

    fn fail(&mut self, e: ClientError) -> Option<Result<JobUpdate, ClientError>> {
        self.body = None;
        self.pending.clear();
        Some(Err(e))
    }
}

/// One SSE event of a followed job; `None` for comments and keep-alives.
fn parse_update(raw: &[u8]) -> Result<Option<JobUpdate>, ClientError> {
    let text = std::str::from_utf8(raw)
        .map_err(|_| ClientError::Decode("an SSE event is not UTF-8".into()))?;
    let mut name = None;
    let mut data = String::new();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    if data.is_empty() {
        return Ok(None);
    }
    let decode = |what: &str, e: serde_json::Error| {
        ClientError::Decode(format!("a job {what} event ({e}): {data}"))
    };
    Ok(Some(match name.as_deref() {
        Some(event::PROGRESS) => {
            JobUpdate::Progress(serde_json::from_str(&data).map_err(|e| decode("progress", e))?)
        }
        Some(event::RESULT) => {
            JobUpdate::Finished(serde_json::from_str(&data).map_err(|e| decode("result", e))?)
        }
        Some(event::JOB) | None => {
            JobUpdate::Job(serde_json::from_str(&data).map_err(|e| decode("job", e))?)
        }
        Some(other) => {
            return Err(ClientError::Decode(format!(
                "unknown job event {other:?}: {data}"
            )))
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse_by_name() {
        let p = parse_update(
            b"event: progress\ndata: {\"phase\":\"quantizing\",\"done\":1,\"total\":2,\"unit\":\"tensors\",\"detail\":null}",
        )
        .unwrap();
        assert!(matches!(p, Some(JobUpdate::Progress(p)) if p.done == 1));
        assert_eq!(parse_update(b": keep-alive").unwrap(), None);
        assert!(parse_update(b"event: progress\ndata: {}").is_err());
        assert!(parse_update(b"event: other\ndata: {}").is_err());
    }
}
