//! `POST /v1/chat/completions`: tools and tool choice, structured output, thinking split
//! into `reasoning_content`, `n` choices (each its own sequence in the batch), JSON or SSE.
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxd_protocol::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatMessage, ChatTokenLogprob, FunctionCall,
    FunctionCallDelta, ResponseFormat, Role, ToolCall, ToolCallDelta, Usage,
    OBJECT_CHAT_COMPLETION, OBJECT_CHAT_COMPLETION_CHUNK,
};
use serde_json::{json, Map, Value};

use super::choices::{
    choice_events, merged_sse, total_usage, ChoiceEvent, ChoiceState, UsageFrame,
};
use super::conversation::{self, AgentGeneration, AgentStep, Conversation, Piece};
use super::error::ApiError;
use super::logprobs;
use super::request::{chat_logprobs, validate, OpenAiJson};
use super::routes::{
    blocking, job, log_finish, new_id, now_secs, refuse_impossible_prompt, sse_chunk_frame,
    sse_frame, start_with, Meta,
};
use super::tools::{self, ParsedCall};
use super::ServerState;
use crate::constraint::grammar::Grammar;
use crate::runtime::request::FinishReason;
use crate::tokenizer::Tokenizer;

/// The request's messages as chat templates take them. Checks that every tool result
/// answers a call made earlier in the conversation.
pub fn openai_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    let mut calls: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let mut obj = Map::new();
        obj.insert("role".into(), Value::from(m.role.as_str()));
        obj.insert(
            "content".into(),
            m.content
                .as_ref()
                .map_or(Value::Null, |c| Value::from(c.to_text())),
        );
        if let Some(name) = &m.name {
            obj.insert("name".into(), Value::from(name.as_str()));
        }
        if let Some(list) = &m.tool_calls {
            let mut converted = Vec::with_capacity(list.len());
            for (j, call) in list.iter().enumerate() {
                let at = format!("messages[{i}].tool_calls[{j}]");
                let id = call.get("id").and_then(Value::as_str);
                let function = call.get("function");
                let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(ApiError::invalid(
                        at,
                        "a tool call needs an `id` and a `function.name`",
                    ));
                };
                let arguments = match function.and_then(|f| f.get("arguments")) {
                    None | Some(Value::Null) => json!({}),
                    Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                        ApiError::invalid(
                            format!("{at}.function.arguments"),
                            format!("the arguments of a tool call must be a JSON object: {e}"),
                        )
                    })?,
                    Some(v) => v.clone(),
                };
                calls.push(id.to_owned());
                converted.push(json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }));
            }
            obj.insert("tool_calls".into(), Value::Array(converted));
        }
        if m.role == Role::Tool {
            let id = m.tool_call_id.as_deref().ok_or_else(|| {
                ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    "a tool message needs the `tool_call_id` of the call it answers",
                )
            })?;
            if !calls.iter().any(|c| c == id) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    format!(
                        "tool_call_id {id:?} answers no tool call of an earlier assistant message"
                    ),
                ));
            }
            obj.insert("tool_call_id".into(), Value::from(id));
        }
        out.push(Value::Object(obj));
    }
    Ok(out)
}

/// `response_format` as a grammar and the field it came from.
fn output_grammar(format: Option<&ResponseFormat>) -> Result<Option<(Grammar, String)>, ApiError> {
    match format {
        None | Some(ResponseFormat::Text) => Ok(None),
        Some(ResponseFormat::JsonObject) => Ok(Some((
            Grammar::JsonSchema(json!({"type": "object"})),
            "response_format".into(),
        ))),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = match &json_schema.schema {
                None => json!({}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(other) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema",
                        format!(
                            "invalid JSON schema: a schema is an object or a boolean, got {other}"
                        ),
                    ))
                }
            };
            Ok(Some((
                Grammar::JsonSchema(schema),
                "response_format.json_schema.schema".into(),
            )))
        }
    }
}

pub(super) async fn chat_completions(
    State(state): State<ServerState>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let mut settings = validate(&req.params, &state.tokenizer)?;
    settings.logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    settings.model = req.model.clone();
    if settings.n > 1 && !settings.resume.is_empty() {
        return Err(ApiError::invalid(
            "n",
            "a resumed request (mlxd.resume_token_ids) has one choice",
        ));
    }
    let tools = tools::openai_tools(req.tools.as_deref().unwrap_or_default())?;
    let choice = tools::openai_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let output = output_grammar(req.response_format.as_ref())?;
    let messages = openai_messages(&req.messages)?;
    let text_bytes: usize = req
        .messages
        .iter()
        .filter_map(|m| m.content.as_ref())
        .map(|c| c.to_text().len())
        .sum();
    refuse_impossible_prompt(&state, text_bytes, "messages")?;
    if let Some(user) = &req.params.user {
        tracing::debug!(user = %user, "chat request");
    }
    let conv = Conversation {
        messages,
        tools,
        choice: Some(choice),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        output,
        template_vars: req.chat_template_kwargs.clone().unwrap_or_default(),
        tool_schema_field: "function.parameters",
    };
    let n = settings.n;
    let prepared = {
        let state = state.clone();
        blocking(move || {
            (0..n)
                .map(|_| conversation::prepare(&state, conv.clone()))
                .collect::<Result<Vec<_>, _>>()
        })
        .await?
    };
    // Every choice goes to the MLX thread before any is awaited, so they share the batch.
    let mut started = Vec::with_capacity(n);
    for (i, p) in prepared.into_iter().enumerate() {
        let mut s = settings.clone();
        // Seeded choices differ from one another and repeat across requests.
        s.sampling.seed = s.sampling.seed.map(|seed| seed.wrapping_add(i as u64));
        let job = job(&state, p.prompt, s, "messages")?;
        let (generation, _) = start_with(&state, job, p.constraint, !p.keep_special)?;
        started.push((generation, p.parser));
    }
    let mut generations = Vec::with_capacity(n);
    for (mut generation, parser) in started {
        generation.started().await?;
        generations.push(AgentGeneration::new(generation, parser));
    }
    let (stream, include_usage) = (settings.stream, settings.include_usage);
    let opening = settings.resume.is_empty();
    let namer = settings.logprobs.map(|_| state.tokenizer.clone());
    let meta = Meta {
        id: new_id("chatcmpl"),
        created: now_secs(),
        model: state.model_id.clone(),
    };
    if stream {
        Ok(sse(meta, generations, include_usage, opening, namer))
    } else {
        whole(meta, generations, namer).await
    }
}

/// One choice collected.
#[derive(Default)]
struct Collected {
    reasoning: String,
    content: String,
    calls: Vec<ParsedCall>,
    ids: Vec<u32>,
    logprobs: Vec<ChatTokenLogprob>,
}

impl Collected {
    fn add(&mut self, pieces: Vec<Piece>, ids: Vec<u32>) {
        self.ids.extend(ids);
        for p in pieces {
            match p {
                Piece::Reasoning(t) => self.reasoning.push_str(&t),
                Piece::Content(t) => self.content.push_str(&t),
                Piece::Call(c) => self.calls.push(c),
            }
        }
    }
}

/// A call as OpenAI reports it, with a fresh `id`.
fn openai_call(c: &ParsedCall, id: String) -> ToolCall {
    ToolCall {
        id,
        kind: "function".into(),
        function: FunctionCall {
            name: c.name.clone(),
            arguments: c.arguments.to_string(),
        },
    }
}

fn finish_reason(reason: FinishReason, called: bool) -> String {
    if called && reason == FinishReason::Stop {
        "tool_calls".into()
    } else {
        reason.as_str().into()
    }
}

/// The log-probabilities of a step's `ids`, when the request asked (`namer`).
fn step_logprobs(
    namer: Option<&Tokenizer>,
    g: &mut AgentGeneration,
    ids: &[u32],
) -> Option<ChatLogprobs> {
    namer.map(|t| logprobs::chat(t, &g.generation.take_logprobs(ids)))
}

async fn whole(
    meta: Meta,
    mut generations: Vec<AgentGeneration>,
    namer: Option<Arc<Tokenizer>>,
) -> Result<Response, ApiError> {
    // Every choice is already in the batch; collecting them one after another loses nothing.
    let mut choices = Vec::with_capacity(generations.len());
    for (index, g) in generations.iter_mut().enumerate() {
        let mut c = Collected::default();
        let reason = loop {
            match g.next().await {
                Some(AgentStep::Pieces(pieces, ids)) => {
                    if let Some(lp) = step_logprobs(namer.as_deref(), g, &ids) {
                        c.logprobs.extend(lp.content);
                    }
                    c.add(pieces, ids)
                }
                Some(AgentStep::Finished {
                    pieces,
                    ids,
                    reason,
                }) => {
                    if let Some(lp) = step_logprobs(namer.as_deref(), g, &ids) {
                        c.logprobs.extend(lp.content);
                    }
                    c.add(pieces, ids);
                    break reason;
                }
                Some(AgentStep::Failed(e)) => return Err(e),
                None => {
                    return Err(ApiError::Internal(
                        "the generation ended without a finish".into(),
                    ))
                }
            }
        };
        let called = !c.calls.is_empty();
        choices.push(ChatChoice {
            index: index as u32,
            message: AssistantMessage {
                role: Role::Assistant,
                content: (!(called && c.content.trim().is_empty())).then_some(c.content),
                reasoning_content: (!c.reasoning.is_empty()).then_some(c.reasoning),
                tool_calls: called.then(|| {
                    c.calls
                        .iter()
                        .map(|call| openai_call(call, g.call_id("call")))
                        .collect()
                }),
            },
            finish_reason: Some(finish_reason(reason, called)),
            logprobs: namer.is_some().then(|| ChatLogprobs {
                content: std::mem::take(&mut c.logprobs),
            }),
            mlxd: Some(mlxd_protocol::openai::TokenIds { token_ids: c.ids }),
        });
        log_finish(&meta, reason, &g.generation.usage(), g.generation.drafts());
    }
    let usages: Vec<Usage> = generations.iter().map(|g| g.generation.usage()).collect();
    let usage = total_usage(&usages);
    Ok(Json(ChatCompletionResponse {
        id: meta.id,
        object: OBJECT_CHAT_COMPLETION.into(),
        created: meta.created,
        model: meta.model,
        choices,
        usage,
    })
    .into_response())
}

fn chunk(meta: &Meta, choice: ChatChunkChoice) -> Bytes {
    sse_frame(&chunk_of(meta, choice))
}

/// A chunk with the ids of the tokens behind its text, in the event's meta line.
fn token_chunk(meta: &Meta, ids: Vec<u32>, choice: ChatChunkChoice) -> Bytes {
    let finish = choice.finish_reason.is_some();
    sse_chunk_frame(ids, finish, &chunk_of(meta, choice))
}

fn chunk_of(meta: &Meta, choice: ChatChunkChoice) -> ChatCompletionChunk {
    ChatCompletionChunk {
        id: meta.id.clone(),
        object: OBJECT_CHAT_COMPLETION_CHUNK.into(),
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![choice],
        usage: None,
    }
}

/// One choice's stream state.
struct ChoiceStream {
    index: u32,
    generation: AgentGeneration,
    calls: u32,
    /// Names the tokens of log-probability reports, when the request asked for them.
    namer: Option<Arc<Tokenizer>>,
}

/// The frames of one step of one choice: a chunk per piece, the ids on the first.
fn step_frames(
    meta: &Meta,
    c: &mut ChoiceStream,
    pieces: Vec<Piece>,
    ids: Vec<u32>,
    finish: Option<FinishReason>,
) -> Vec<Bytes> {
    let mut lp = step_logprobs(c.namer.clone().as_deref(), &mut c.generation, &ids);
    let mut ids = Some(ids);
    let mut frames = Vec::new();
    for piece in pieces {
        let mut delta = ChatDelta::default();
        match piece {
            Piece::Reasoning(t) => delta.reasoning_content = Some(t),
            Piece::Content(t) => delta.content = Some(t),
            Piece::Call(call) => {
                let full = openai_call(&call, c.generation.call_id("call"));
                delta.tool_calls = Some(vec![ToolCallDelta {
                    index: c.calls,
                    id: Some(full.id),
                    kind: Some("function".into()),
                    function: FunctionCallDelta {
                        name: Some(full.function.name),
                        arguments: Some(full.function.arguments),
                    },
                }]);
                c.calls += 1;
            }
        }
        frames.push(token_chunk(
            meta,
            ids.take().unwrap_or_default(),
            ChatChunkChoice {
                index: c.index,
                delta,
                finish_reason: None,
                logprobs: lp.take(),
                mlxd: None,
            },
        ));
    }
    if let Some(reason) = finish {
        frames.push(token_chunk(
            meta,
            ids.take().unwrap_or_default(),
            ChatChunkChoice {
                index: c.index,
                delta: ChatDelta::default(),
                finish_reason: Some(finish_reason(reason, c.calls > 0)),
                logprobs: lp.take(),
                mlxd: None,
            },
        ));
    }
    frames
}

fn sse(
    meta: Meta,
    generations: Vec<AgentGeneration>,
    include_usage: bool,
    opening: bool,
    namer: Option<Arc<Tokenizer>>,
) -> Response {
    let meta = Arc::new(meta);
    let mut first = Vec::new();
    let choice_streams = generations.into_iter().enumerate().map(|(index, generation)| {
        if opening {
            first.push(chunk(
                &meta,
                ChatChunkChoice {
                    index: index as u32,
                    delta: ChatDelta {
                        role: Some(Role::Assistant),
                        content: Some(String::new()),
                        ..Default::default()
                    },
                    finish_reason: None,
                    logprobs: None,
                    mlxd: None,
                },
            ));
        }
        let c = ChoiceStream {
            index: index as u32,
            generation,
            calls: 0,
            namer: namer.clone(),
        };
        let meta = meta.clone();
        choice_events(c, move |mut c| {
            let meta = meta.clone();
            async move {
                match c.generation.next().await {
                    Some(AgentStep::Pieces(pieces, ids)) => {
                        let frames = step_frames(&meta, &mut c, pieces, ids, None);
                        Some((ChoiceEvent::Frames(frames), ChoiceState::Running(c)))
                    }
                    Some(AgentStep::Finished { pieces, ids, reason }) => {
                        let frames = step_frames(&meta, &mut c, pieces, ids, Some(reason));
                        let usage = c.generation.generation.usage();
                        log_finish(&meta, reason, &usage, c.generation.generation.drafts());
                        Some((ChoiceEvent::Frames(frames), ChoiceState::Ending(usage)))
                    }
                    Some(AgentStep::Failed(e)) => {
                        tracing::warn!(request_id = %meta.id, error = %e, "generation failed mid-stream");
                        Some((ChoiceEvent::Failed(sse_frame(&e.body())), ChoiceState::Over))
                    }
                    None => None,
                }
            }
        })
    });
    let choice_streams: Vec<_> = choice_streams.collect();
    let usage_frame = include_usage.then(|| {
        Box::new(move |usage: Usage| {
            sse_frame(&ChatCompletionChunk {
                id: meta.id.clone(),
                object: OBJECT_CHAT_COMPLETION_CHUNK.into(),
                created: meta.created,
                model: meta.model.clone(),
                choices: vec![],
                usage: Some(usage),
            })
        }) as UsageFrame
    });
    merged_sse(first, choice_streams, usage_frame)
}
