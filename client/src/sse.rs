//! Reading an OpenAI SSE response into typed chunks.
use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use mlxd_ipc::sse::SseSplitter;
use mlxd_protocol::error::ErrorBody;
use mlxd_protocol::openai::{ChatCompletionChunk, EventMeta, TokenIds, SSE_DONE};

use crate::error::ClientError;
use crate::transport::Body;

/// What one SSE event holds.
#[derive(Debug)]
pub(crate) enum Event {
    Chunk(Box<ChatCompletionChunk>),
    Error(ErrorBody),
    Done,
    /// A comment or an event without data (keep-alive).
    Nothing,
}

/// Parses one complete event (its `data:` lines joined by newlines, as the SSE spec says).
/// An engine's meta line (the token ids behind a chunk's text, `EventMeta`) becomes the
/// chunk's `mlxd` field, where a whole response carries them.
pub(crate) fn parse_event(event: &[u8]) -> Result<Event, ClientError> {
    let (meta, event) = match EventMeta::split(event) {
        Some((meta, at)) => {
            let meta = meta
                .map_err(|e| ClientError::Decode(format!("an SSE event's token-id line ({e})")))?;
            (Some(meta), &event[at..])
        }
        None => (None, event),
    };
    let text = std::str::from_utf8(event)
        .map_err(|_| ClientError::Decode("an SSE event is not UTF-8".into()))?;
    let mut data: Option<String> = None;
    for line in text.lines() {
        let Some(value) = line.strip_prefix("data:") else {
            continue;
        };
        let value = value.strip_prefix(' ').unwrap_or(value);
        match &mut data {
            Some(d) => {
                d.push('\n');
                d.push_str(value);
            }
            None => data = Some(value.to_owned()),
        }
    }
    let Some(data) = data else {
        return Ok(Event::Nothing);
    };
    if data == SSE_DONE {
        return Ok(Event::Done);
    }
    let value: serde_json::Value = serde_json::from_str(&data)
        .map_err(|e| ClientError::Decode(format!("an SSE event is not JSON ({e}): {data}")))?;
    if value.get("error").is_some() {
        let body = serde_json::from_value(value)
            .map_err(|e| ClientError::Decode(format!("an SSE error event ({e}): {data}")))?;
        return Ok(Event::Error(body));
    }
    let mut chunk: ChatCompletionChunk = serde_json::from_value(value)
        .map_err(|e| ClientError::Decode(format!("an SSE chunk ({e}): {data}")))?;
    if let (Some(meta), Some(choice)) = (meta, chunk.choices.first_mut()) {
        if !meta.token_ids.is_empty() {
            choice.mlxd = Some(TokenIds {
                token_ids: meta.token_ids,
            });
        }
    }
    Ok(Event::Chunk(Box::new(chunk)))
}

/// The chunks of one streaming response, in order; ends after `[DONE]`, or with the first
/// error (an error event, a timeout, a body that ended early), after which it yields nothing.
pub(crate) struct ChunkReader {
    /// Dropped once the stream has finished, so the connection (or, in-process, the engine's
    /// hold on the request) ends with the last chunk, not when the caller drops the stream.
    body: Option<Body>,
    splitter: SseSplitter,
    pending: VecDeque<Bytes>,
    /// The longest wait for the next bytes.
    idle: Duration,
    target: String,
    finished: bool,
}

impl ChunkReader {
    pub(crate) fn new(body: Body, idle: Duration, target: String) -> Self {
        Self {
            body: Some(body),
            splitter: SseSplitter::new(),
            pending: VecDeque::new(),
            idle,
            target,
            finished: false,
        }
    }

    pub(crate) async fn next(&mut self) -> Option<Result<ChatCompletionChunk, ClientError>> {
        while !self.finished {
            if let Some(event) = self.pending.pop_front() {
                match parse_event(&event) {
                    Ok(Event::Nothing) => continue,
                    Ok(Event::Chunk(chunk)) => return Some(Ok(*chunk)),
                    Ok(Event::Done) => {
                        self.finished = true;
                        self.body = None;
                    }
                    Ok(Event::Error(body)) => return self.fail(ClientError::Stream(body)),
                    Err(e) => return self.fail(e),
                }
                continue;
            }
            let Some(body) = self.body.as_mut() else {
                break;
            };
            match tokio::time::timeout(self.idle, body.frame()).await {
                Err(_) => {
                    return self.fail(ClientError::Timeout {
                        what: "waiting for the next stream chunk",
                        limit: self.idle,
                    })
                }
                Ok(None) => {
                    // An unterminated last event still counts if it is complete data.
                    if let Some(rest) = self.splitter.finish() {
                        self.pending.push_back(rest);
                        continue;
                    }
                    return self.fail(ClientError::Truncated);
                }
                Ok(Some(Err(e))) => {
                    let target = self.target.clone();
                    return self.fail(ClientError::Transport {
                        target,
                        detail: e.to_string(),
                    });
                }
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        self.pending.extend(self.splitter.push(&data));
                    }
                }
            }
        }
        None
    }

    fn fail(&mut self, e: ClientError) -> Option<Result<ChatCompletionChunk, ClientError>> {
        self.finished = true;
        self.body = None;
        Some(Err(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse_into_chunks_errors_done_and_nothing() {
        let chunk = br#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}

"#;
        match parse_event(chunk).unwrap() {
            Event::Chunk(c) => assert_eq!(c.choices[0].delta.content.as_deref(), Some("hi")),
            other => panic!("{other:?}"),
        }
        let error =
            b"data: {\"error\":{\"message\":\"engine died\",\"type\":\"engine_crashed\"}}\n\n";
        match parse_event(error).unwrap() {
            Event::Error(b) => assert_eq!(b.error.kind, "engine_crashed"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse_event(b"data: [DONE]\n\n").unwrap(),
            Event::Done
        ));
        assert!(matches!(
            parse_event(b": keep-alive\n\n").unwrap(),
            Event::Nothing
        ));
        assert!(matches!(
            parse_event(b"data: {not json\n\n"),
            Err(ClientError::Decode(_))
        ));
    }

    #[test]
    fn an_engines_meta_line_becomes_the_chunks_token_ids() {
        let chunk = br#": mlxd {"token_ids":[7,8],"finish":true}
data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}

"#;
        match parse_event(chunk).unwrap() {
            Event::Chunk(c) => assert_eq!(c.choices[0].mlxd.as_ref().unwrap().token_ids, [7, 8]),
            other => panic!("{other:?}"),
        }
        let broken = b": mlxd {\"token_ids\":1}\ndata: {}\n\n";
        assert!(matches!(parse_event(broken), Err(ClientError::Decode(_))));
    }
}
