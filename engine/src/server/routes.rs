//! The OpenAI routes: completions, models, health, and the fallbacks; the pieces every
//! generating route shares (jobs, starting a generation, SSE frames).
use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxd_protocol::openai::{
    CompletionChoice, CompletionRequest, CompletionResponse, ModelList, ModelObject, TokenIds,
    Usage, OBJECT_LIST, OBJECT_MODEL, OBJECT_TEXT_COMPLETION, SSE_DONE,
};
use serde::Serialize;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::generation::{Generation, Step, Submission};
use super::request::{completion_prompt, token_budget, validate, OpenAiJson, Settings};
use super::ServerState;
use crate::detokenizer::Delta;
use crate::runtime::request::{FinishReason, GenerateRequest};

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

pub(super) fn ids_ext(ids: Vec<u32>) -> Option<TokenIds> {
    (!ids.is_empty()).then_some(TokenIds { token_ids: ids })
}

/// Tokenized and validated: what both completion routes hand to [`respond`].
pub(super) struct Job {
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
) -> Result<Job, ApiError> {
    let resumed = settings.resume.len();
    prompt.extend_from_slice(&settings.resume);
    let max_tokens = token_budget(
        prompt.len(),
        settings.max_tokens.map(|m| m - resumed),
        state.context_length,
        param,
    )?;
    Ok(Job {
        prompt,
        settings,
        max_tokens,
    })
}

fn start(state: &ServerState, job: Job) -> Result<(Generation, Settings), ApiError> {
    start_with(state, job, None, true)
}

/// Sends a job to the MLX thread, with its constraint; `skip_special`: leave special tokens
/// out of the text.
pub(super) fn start_with(
    state: &ServerState,
    job: Job,
    constraint: Option<Box<dyn crate::constraint::TokenConstraint>>,
    skip_special: bool,
) -> Result<(Generation, Settings), ApiError> {
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let request = GenerateRequest {
        prompt: job.prompt,
        sampling: job.settings.sampling.clone(),
        max_tokens: job.max_tokens,
        stop_token_ids: state.tokenizer.stop_token_ids().to_vec(),
        sample_offset: job.settings.resume.len(),
        events: events_tx,
        constraint,
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

pub(super) async fn completions(
    State(state): State<ServerState>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let settings = validate(&req.params, &state.tokenizer)?;
    if settings.n > 1 {
        return Err(ApiError::invalid(
            "n",
            format!(
                "n > 1 is supported on /v1/chat/completions only, got n = {}",
                settings.n
            ),
        ));
    }
    if let mlxd_protocol::openai::Prompt::Text(text) = &req.prompt {
        refuse_impossible_prompt(&state, text.len(), "prompt")?;
    }
    let tokenizer = state.tokenizer.clone();
    let prompt = blocking(move || completion_prompt(&req.prompt, &tokenizer)).await?;
    let job = job(&state, prompt, settings, "prompt")?;
    respond::<CompletionFormat>(&state, job).await
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

/// Runs a job and answers with one JSON body or an SSE stream.
async fn respond<F: Format>(state: &ServerState, job: Job) -> Result<Response, ApiError> {
    let (mut generation, settings) = start(state, job)?;
    let meta = Meta {
        id: new_id(F::ID_PREFIX),
        created: now_secs(),
        model: state.model_id.clone(),
    };
    // A failure before any output still gets a proper error status.
    generation.started().await?;
    if settings.stream {
        let opening = settings.resume.is_empty();
        Ok(sse_response::<F>(
            meta,
            generation,
            settings.include_usage,
            opening,
        ))
    } else {
        let mut text = String::new();
        let mut ids = Vec::new();
        loop {
            match generation.next().await {
                Some(Step::Text(delta)) => {
                    text.push_str(&delta.text);
                    ids.extend(delta.ids);
                }
                Some(Step::Finished { last, reason }) => {
                    text.push_str(&last.text);
                    ids.extend(last.ids);
                    let usage = generation.usage();
                    log_finish(&meta, reason, &usage, generation.drafts());
                    let body = F::whole(&meta, text, ids, reason, usage);
                    return Ok(Json(body).into_response());
                }
                Some(Step::Failed(error)) => return Err(error),
                None => {
                    return Err(ApiError::Internal(
                        "the generation ended without a finish".into(),
                    ))
                }
            }
        }
    }
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

/// How one endpoint shapes its responses.
trait Format: Send + 'static {
    const ID_PREFIX: &'static str;
    type Whole: Serialize;
    type Chunk: Serialize;
    fn whole(
        meta: &Meta,
        text: String,
        ids: Vec<u32>,
        reason: FinishReason,
        usage: Usage,
    ) -> Self::Whole;
    /// The chunk sent before any text, if the endpoint has one.
    fn opening(meta: &Meta) -> Option<Self::Chunk>;
    fn text(meta: &Meta, delta: Delta, finish: Option<FinishReason>) -> Self::Chunk;
    fn usage(meta: &Meta, usage: Usage) -> Self::Chunk;
}

struct CompletionFormat;

impl CompletionFormat {
    fn response(
        meta: &Meta,
        choices: Vec<CompletionChoice>,
        usage: Option<Usage>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: meta.id.clone(),
            object: OBJECT_TEXT_COMPLETION.into(),
            created: meta.created,
            model: meta.model.clone(),
            choices,
            usage,
        }
    }
}

impl Format for CompletionFormat {
    const ID_PREFIX: &'static str = "cmpl";
    type Whole = CompletionResponse;
    type Chunk = CompletionResponse;

    fn whole(
        meta: &Meta,
        text: String,
        ids: Vec<u32>,
        reason: FinishReason,
        usage: Usage,
    ) -> CompletionResponse {
        let choice = CompletionChoice {
            index: 0,
            text,
            finish_reason: Some(reason.as_str().into()),
            logprobs: None,
            mlxd: Some(TokenIds { token_ids: ids }),
        };
        Self::response(meta, vec![choice], Some(usage))
    }

    fn opening(_meta: &Meta) -> Option<CompletionResponse> {
        None
    }

    fn text(meta: &Meta, delta: Delta, finish: Option<FinishReason>) -> CompletionResponse {
        let choice = CompletionChoice {
            index: 0,
            text: delta.text,
            finish_reason: finish.map(|r| r.as_str().into()),
            logprobs: None,
            mlxd: ids_ext(delta.ids),
        };
        Self::response(meta, vec![choice], None)
    }

    fn usage(meta: &Meta, usage: Usage) -> CompletionResponse {
        Self::response(meta, Vec::new(), Some(usage))
    }
}

/// One SSE event: `data: <json>\n\n`.
pub(super) fn sse_frame(json: &impl Serialize) -> Bytes {
    let mut out = b"data: ".to_vec();
    // Our response types always serialize.
    serde_json::to_writer(&mut out, json).unwrap_or_else(|e| {
        out.extend_from_slice(format!("{{\"error\":{{\"message\":\"{e}\"}}}}").as_bytes())
    });
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Streams the generation as SSE. Each step is written as soon as it is ready; dropping the
/// body (the client went away) drops the [`Generation`] and so cancels the request.
/// `opening`: send the endpoint's opening chunk (not when resuming a stream).
fn sse_response<F: Format>(
    meta: Meta,
    generation: Generation,
    include_usage: bool,
    opening: bool,
) -> Response {
    struct Sse {
        meta: Meta,
        generation: Option<Generation>,
        queue: VecDeque<Bytes>,
        include_usage: bool,
    }
    let mut queue = VecDeque::new();
    if let Some(chunk) = F::opening(&meta).filter(|_| opening) {
        queue.push_back(sse_frame(&chunk));
    }
    let state = Sse {
        meta,
        generation: Some(generation),
        queue,
        include_usage,
    };
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(frame) = s.queue.pop_front() {
                return Some((Ok::<_, Infallible>(frame), s));
            }
            let generation = s.generation.as_mut()?;
            match generation.next().await {
                Some(Step::Text(delta)) => {
                    s.queue.push_back(sse_frame(&F::text(&s.meta, delta, None)))
                }
                Some(Step::Finished { last, reason }) => {
                    s.queue
                        .push_back(sse_frame(&F::text(&s.meta, last, Some(reason))));
                    let usage = generation.usage();
                    log_finish(&s.meta, reason, &usage, generation.drafts());
                    if s.include_usage {
                        s.queue.push_back(sse_frame(&F::usage(&s.meta, usage)));
                    }
                    s.queue
                        .push_back(Bytes::from(format!("data: {SSE_DONE}\n\n")));
                    s.generation = None;
                }
                Some(Step::Failed(message)) => {
                    tracing::warn!(request_id = %s.meta.id, error = %message, "generation failed mid-stream");
                    s.queue.push_back(sse_frame(&message.body()));
                    s.generation = None;
                }
                None => s.generation = None,
            }
        }
    });
    event_stream(stream)
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
    }
}

pub(super) async fn list_models(State(state): State<ServerState>) -> Json<ModelList> {
    Json(ModelList {
        object: OBJECT_LIST.into(),
        data: vec![model_object(&state)],
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
