//! The OpenAI routes: completions, models, health, and the fallbacks; the pieces every
//! generating route shares (jobs, starting a generation, SSE frames).
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxd_protocol::openai::{EventMeta, ModelList, ModelObject, Usage, OBJECT_LIST, OBJECT_MODEL};
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::generation::{Generation, Submission};
use super::request::{token_budget, Settings};
use super::ServerState;
use crate::runtime::request::{FinishReason, GenerateRequest};

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// Tokenized and validated: what both completion routes hand to [`respond`].
pub(super) struct Admitted {
    /// Ends with `settings.resume`.
    pub prompt: Vec<u32>,
    pub settings: Settings,
    pub max_tokens: usize,
}

pub(super) fn job(
    state: &ServerState,
    mut prompt: Vec<u32>,
    settings: Settings,
    param: &str,
) -> Result<Admitted, ApiError> {
    let resumed = settings.resume.len();
    prompt.extend_from_slice(&settings.resume);
    let max_tokens = token_budget(
        prompt.len(),
        settings.max_tokens.map(|m| m - resumed),
        state.context_length,
        param,
    )?;
    Ok(Admitted {
        prompt,
        settings,
        max_tokens,
    })
}

pub(super) fn start(
    state: &ServerState,
    job: Admitted,
) -> Result<(Generation, Settings), ApiError> {
    start_with(state, job, None, true)
}

/// Sends a job to the MLX thread, with its constraint; `skip_special`: leave special tokens
/// out of the text.
pub(super) fn start_with(
    state: &ServerState,
    job: Admitted,
    constraint: Option<Box<dyn crate::constraint::TokenConstraint>>,
    skip_special: bool,
) -> Result<(Generation, Settings), ApiError> {
    let adapter = state.adapter_for(job.settings.model.as_deref())?;
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let request = GenerateRequest {
        prompt: job.prompt,
        sampling: job.settings.sampling.clone(),
        max_tokens: job.max_tokens,
        stop_token_ids: state.tokenizer.stop_token_ids().to_vec(),
        sample_offset: job.settings.resume.len(),
        events: events_tx,
        constraint,
        logprobs: job.settings.logprobs,
        adapter,
    };
    let submission = Submission {
        request,
        events: events_rx,
        stops: job.settings.stops.clone(),
        resumed: job.settings.resume.clone(),
        skip_special,
    };
    let generation = Generation::start(&state.work, state.tokenizer.clone(), submission)?;
    Ok((generation, job.settings))
}

/// Runs tokenizer work (which takes milliseconds on long prompts) off the async threads.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
}

/// Refuses, before encoding, a prompt whose `bytes` of text cannot fit the context whatever
/// they encode to (the same error as a prompt found too long after encoding).
pub(super) fn refuse_impossible_prompt(
    state: &ServerState,
    bytes: usize,
    param: &str,
) -> Result<(), ApiError> {
    let at_least = state.tokenizer.min_tokens_for(bytes);
    if at_least + 1 > state.context_length {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is too long: {bytes} bytes of text are at least {at_least} tokens, \
                 and the model's context length is {} tokens",
                state.context_length
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

pub(super) fn log_finish(
    meta: &Meta,
    reason: FinishReason,
    usage: &Usage,
    drafts: Option<(usize, usize)>,
) {
    match drafts {
        Some((drafted, accepted)) => tracing::info!(
            request_id = %meta.id,
            model = %meta.model,
            finish_reason = reason.as_str(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            drafted_tokens = drafted,
            accepted_tokens = accepted,
            acceptance = format!("{:.3}", accepted as f64 / drafted.max(1) as f64),
            "request finished"
        ),
        None => tracing::info!(
            request_id = %meta.id,
            model = %meta.model,
            finish_reason = reason.as_str(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            "request finished"
        ),
    }
}

/// The fields every response and chunk of one request shares.
pub(super) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// One SSE event: `data: <json>\n\n`.
pub(super) fn sse_frame(json: &impl Serialize) -> Bytes {
    data_frame(Vec::new(), json)
}

/// One streamed choice chunk: the [`EventMeta`] comment line with the ids of the tokens
/// behind its text, then `data: <json>\n\n` (which then carries no `mlxd` field). The
/// proxy keeps the ids for resumption and forwards the data line unread.
pub(super) fn sse_chunk_frame(token_ids: Vec<u32>, finish: bool, json: &impl Serialize) -> Bytes {
    let line = EventMeta { token_ids, finish }.line();
    data_frame(line.into_bytes(), json)
}

/// `data: <json>\n\n` appended to `out`.
fn data_frame(mut out: Vec<u8>, json: &impl Serialize) -> Bytes {
    out.extend_from_slice(b"data: ");
    // Our response types always serialize.
    serde_json::to_writer(&mut out, json).unwrap_or_else(|e| {
        out.extend_from_slice(format!("{{\"error\":{{\"message\":\"{e}\"}}}}").as_bytes())
    });
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// An SSE response over `stream` (the one place the stream headers are set).
pub(super) fn event_stream<S>(stream: S) -> Response
where
    S: futures::Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    let mut response = Response::new(Body::from_stream(stream));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

fn model_object(state: &ServerState) -> ModelObject {
    ModelObject {
        id: state.model_id.clone(),
        object: OBJECT_MODEL.into(),
        created: state.created,
        owned_by: "mlxd".into(),
        context_length: Some(state.context_length as u64),
        parent: None,
    }
}

/// The model, then each of its adapters as `<model>:<adapter>` with the model as `parent`.
pub(super) async fn list_models(State(state): State<ServerState>) -> Json<ModelList> {
    let mut data = vec![model_object(&state)];
    for adapter in state.adapters.iter().flat_map(|t| t.list()) {
        data.push(ModelObject {
            id: format!("{}:{}", state.model_id, adapter.name),
            parent: Some(state.model_id.clone()),
            ..model_object(&state)
        });
    }
    Json(ModelList {
        object: OBJECT_LIST.into(),
        data,
    })
}

pub(super) async fn get_model(
    State(state): State<ServerState>,
    Path(id): Path<String>,
) -> Result<Json<ModelObject>, ApiError> {
    if id == state.model_id {
        Ok(Json(model_object(&state)))
    } else {
        Err(ApiError::NotFound {
            method: "GET".into(),
            path: format!("/v1/models/{id} (this engine serves {})", state.model_id),
        })
    }
}

#[derive(Serialize)]
struct Health<'a> {
    status: &'static str,
    model: &'a str,
    context_length: usize,
}

pub(super) async fn health(State(state): State<ServerState>) -> Response {
    let ready = !state.work.is_closed();
    let body = Health {
        status: if ready { "ok" } else { "unavailable" },
        model: &state.model_id,
        context_length: state.context_length,
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

pub(super) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}
