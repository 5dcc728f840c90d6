//! `POST /v1/completions`: a raw prompt, `n` choices (each its own sequence in the batch),
//! log-probabilities in the legacy shape, JSON or SSE.
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxd_protocol::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, TokenIds, Usage,
    OBJECT_TEXT_COMPLETION,
};

use super::choices::{
    choice_events, merged_sse, total_usage, ChoiceEvent, ChoiceState, UsageFrame,
};
use super::error::ApiError;
use super::generation::{Generation, Step};
use super::logprobs::{self, CompletionLogprobsBuilder};
use super::request::{completion_logprobs, completion_prompt, validate, OpenAiJson};
use super::routes::{
    blocking, job, log_finish, new_id, now_secs, refuse_impossible_prompt, sse_chunk_frame,
    sse_frame, start, Meta,
};
use super::ServerState;
use crate::detokenizer::Delta;
use crate::runtime::request::FinishReason;
use crate::tokenizer::Tokenizer;

pub(super) async fn completions(
    State(state): State<ServerState>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let mut settings = validate(&req.params, &state.tokenizer)?;
    settings.logprobs = completion_logprobs(req.logprobs)?;
    settings.model = req.model.clone();
    if settings.n > 1 && !settings.resume.is_empty() {
        return Err(ApiError::invalid(
            "n",
            "a resumed request (mlxd.resume_token_ids) has one choice",
        ));
    }
    if let mlxd_protocol::openai::Prompt::Text(text) = &req.prompt {
        refuse_impossible_prompt(&state, text.len(), "prompt")?;
    }
    let tokenizer = state.tokenizer.clone();
    let prompt = blocking(move || completion_prompt(&req.prompt, &tokenizer)).await?;
    // Every choice goes to the MLX thread before any is awaited, so they share the batch.
    let mut generations = Vec::with_capacity(settings.n);
    for i in 0..settings.n {
        let mut s = settings.clone();
        // Seeded choices differ from one another and repeat across requests.
        s.sampling.seed = s.sampling.seed.map(|seed| seed.wrapping_add(i as u64));
        let (generation, _) = start(&state, job(&state, prompt.clone(), s, "prompt")?)?;
        generations.push(generation);
    }
    // A failure before any output still gets a proper error status.
    for g in &mut generations {
        g.started().await?;
    }
    let meta = Meta {
        id: new_id("cmpl"),
        created: now_secs(),
        model: state.model_id.clone(),
    };
    let namer = settings.logprobs.map(|_| state.tokenizer.clone());
    if settings.stream {
        Ok(sse(meta, generations, settings.include_usage, namer))
    } else {
        whole(meta, generations, namer).await
    }
}

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

/// One choice's text so far, with what goes with it.
struct ChoiceText {
    index: u32,
    generation: Generation,
    /// Names and offsets the tokens of log-probability reports, when the request asked.
    logprobs: Option<(Arc<Tokenizer>, CompletionLogprobsBuilder)>,
}

impl ChoiceText {
    /// The log-probabilities of a delta's tokens, when the request asked.
    fn logprobs_of(&mut self, delta: &Delta) -> Option<CompletionLogprobs> {
        let (tokenizer, builder) = self.logprobs.as_mut()?;
        let tokens = self.generation.take_logprobs(&delta.ids);
        Some(builder.chunk(tokenizer, &tokens))
    }

    fn chunk(&mut self, meta: &Meta, delta: Delta, finish: Option<FinishReason>) -> Bytes {
        let logprobs = self.logprobs_of(&delta);
        let choice = CompletionChoice {
            index: self.index,
            text: delta.text,
            finish_reason: finish.map(|r| r.as_str().into()),
            logprobs,
            mlxd: None,
        };
        let finish = choice.finish_reason.is_some();
        sse_chunk_frame(delta.ids, finish, &response(meta, vec![choice], None))
    }
}

fn choice_texts(generations: Vec<Generation>, namer: Option<Arc<Tokenizer>>) -> Vec<ChoiceText> {
    generations
        .into_iter()
        .enumerate()
        .map(|(i, generation)| ChoiceText {
            index: i as u32,
            generation,
            logprobs: namer
                .clone()
                .map(|t| (t, CompletionLogprobsBuilder::default())),
        })
        .collect()
}

async fn whole(
    meta: Meta,
    generations: Vec<Generation>,
    namer: Option<Arc<Tokenizer>>,
) -> Result<Response, ApiError> {
    // Every choice is already in the batch; collecting them one after another loses nothing.
    let mut choices = Vec::new();
    let mut usages = Vec::new();
    for mut c in choice_texts(generations, namer) {
        let mut text = String::new();
        let mut ids = Vec::new();
        let mut all_logprobs = c.logprobs.as_ref().map(|_| CompletionLogprobs::default());
        let mut take = |c: &mut ChoiceText, delta: Delta| {
            if let (Some(all), Some(more)) = (all_logprobs.as_mut(), c.logprobs_of(&delta)) {
                logprobs::extend_completion(all, more);
            }
            text.push_str(&delta.text);
            ids.extend(delta.ids);
        };
        let reason = loop {
            match c.generation.next().await {
                Some(Step::Text(delta)) => take(&mut c, delta),
                Some(Step::Finished { last, reason }) => {
                    take(&mut c, last);
                    break reason;
                }
                Some(Step::Failed(error)) => return Err(error),
                None => {
                    return Err(ApiError::Internal(
                        "the generation ended without a finish".into(),
                    ))
                }
            }
        };
        let usage = c.generation.usage();
        log_finish(&meta, reason, &usage, c.generation.drafts());
        usages.push(usage);
        choices.push(CompletionChoice {
            index: c.index,
            text,
            finish_reason: Some(reason.as_str().into()),
            logprobs: all_logprobs,
            mlxd: Some(TokenIds { token_ids: ids }),
        });
    }
    let usage = total_usage(&usages);
    Ok(Json(response(&meta, choices, Some(usage))).into_response())
}

/// Streams every choice as SSE. Each step is written as soon as it is ready; dropping the
/// body (the client went away) drops the generations and so cancels them.
fn sse(
    meta: Meta,
    generations: Vec<Generation>,
    include_usage: bool,
    namer: Option<Arc<Tokenizer>>,
) -> Response {
    let meta = Arc::new(meta);
    let streams = choice_texts(generations, namer)
        .into_iter()
        .map(|c| {
            let meta = meta.clone();
            choice_events(c, move |mut c| {
                let meta = meta.clone();
                async move {
                    match c.generation.next().await? {
                        Step::Text(delta) => {
                            let frame = c.chunk(&meta, delta, None);
                            Some((ChoiceEvent::Frames(vec![frame]), ChoiceState::Running(c)))
                        }
                        Step::Finished { last, reason } => {
                            let frame = c.chunk(&meta, last, Some(reason));
                            let usage = c.generation.usage();
                            log_finish(&meta, reason, &usage, c.generation.drafts());
                            Some((ChoiceEvent::Frames(vec![frame]), ChoiceState::Ending(usage)))
                        }
                        Step::Failed(e) => {
                            tracing::warn!(request_id = %meta.id, error = %e, "generation failed mid-stream");
                            Some((ChoiceEvent::Failed(sse_frame(&e.body())), ChoiceState::Over))
                        }
                    }
                }
            })
        })
        .collect();
    let usage_frame = include_usage.then(|| {
        Box::new(move |usage: Usage| sse_frame(&response(&meta, Vec::new(), Some(usage))))
            as UsageFrame
    });
    merged_sse(Vec::new(), streams, usage_frame)
}
