//! Transparent resumption of generation requests after an engine dies: what the proxy
//! keeps about each request, how it rewrites the engine's output for the client, and the
//! body of the continuation it sends to the restarted engine. Pure functions over bytes,
//! no I/O; `forward.rs` drives them.
//!
//! The engine reports the ids of the tokens behind each streamed chunk in an SSE comment
//! line that opens the chunk's event (`: mlxd {"token_ids":[...],"finish":true}`, see
//! [`EventMeta`]), and those of a whole response in each choice's `"mlxd": {"token_ids"}`.
//! It accepts `"mlxd": {"resume_token_ids": [...]}` to continue a response whose first
//! tokens were already sent (their text is not sent again, they count towards `max_tokens`
//! and `usage`, seeded sampling continues at the same point of its random stream). The
//! proxy records the ids of every chunk it passes on, and, after a crash, resubmits the
//! request with those ids; the continuation's chunks get the first response's `id` and
//! `created`, so the client sees one response.
//!
//! A healthy stream passes as bytes: [`EngineEvent`] cuts the comment line off (a slice, no
//! copy), the record reads the ids from that line, and the chunk's JSON is neither parsed
//! nor rewritten. Chunks are parsed only where they must change or say something the line
//! does not: the first data event (it gives the response's identity), every event of a
//! continuation (its `id`/`created` are rewritten, a repeated opening chunk dropped), and
//! events without the line (opening, usage, errors). Those are read from the event's one
//! JSON parse, which the metrics tap shares, into the protocol's own types and serialized again only when changed; the engine serializes those same
//! types, so a rewritten chunk comes out as the engine would have written it. A chunk whose
//! JSON still carries `mlxd` (an engine from before the comment line) takes that slower
//! path and has the field removed, so an old engine binary still resumes correctly.

use bytes::Bytes;
use mlxd_protocol::openai::{
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, EventMeta, TokenIds, SSE_DONE,
};
use mlxd_protocol::request::{RequestFacts, Route};
use serde::Deserialize;
use serde_json::Value;

use crate::engine_event::EngineEvent;

/// The generation routes whose requests can be resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// Why a request cannot be continued after its engine died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotResumable {
    /// The engine died after the last token but before the usage chunk, which only
    /// the engine can compute.
    UsageLost,
    /// The stream carried an event the proxy could not read, so it does not know
    /// which tokens the client has.
    UnknownEvent,
    /// The per-request resume budget (`server.max_resumes`) is spent.
    TooManyResumes { limit: u32 },
}

impl std::fmt::Display for NotResumable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::UsageLost => {
                f.write_str("the engine died after the last token and before the usage report")
            }
            Self::UnknownEvent => f.write_str(
                "the stream carried an event without token ids, so what was sent is unknown",
            ),
            Self::TooManyResumes { limit } => write!(
                f,
                "the request was already resumed {limit} times (server.max_resumes)"
            ),
        }
    }
}

/// What to do once the engine serving a request has died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Send this body to a new engine and splice its response in.
    Continue(Bytes),
    /// Nothing is missing but the stream's end: send these bytes and finish.
    Finish(Bytes),
    Impossible(NotResumable),
}

/// A whole (non-streaming) response as the client gets it, and what it said about tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientBody {
    pub bytes: Bytes,
    /// `(prompt, completion)` tokens from the response's `usage`; `None` when it has none
    /// or was not read (the tap then reads the bytes itself).
    pub usage: Option<(u64, u64)>,
}

/// One in-flight request as the proxy tracks it for resumption.
#[derive(Debug, Clone)]
pub struct ResumeRecord {
    endpoint: Endpoint,
    /// The client's request object.
    request: serde_json::Map<String, Value>,
    /// Ids the client itself asked to continue from (its own `mlxd.resume_token_ids`).
    client_resume: Vec<u32>,
    pub stream: bool,
    include_usage: bool,
    /// Ids of every token whose text the client has received, in order.
    sent: Vec<u32>,
    /// `id` and `created` of the first response, given to every later chunk.
    identity: Option<(String, u64)>,
    /// The chat stream's opening (`role`) chunk was sent.
    opened: bool,
    /// A chunk with `finish_reason` was sent.
    finished: bool,
    /// `data: [DONE]` was sent.
    done: bool,
    /// An event that could not be read passed through.
    unknown: bool,
    /// The engine ended the stream with an error event of its own.
    errored: bool,
    resumes: u32,
    max_resumes: u32,
}

impl ResumeRecord {
    /// A record for a request with `facts` and the request object the engine gets; `None`
    /// when the request is not resumable (another route, several choices, or resumption
    /// disabled).
    pub fn new(
        facts: &RequestFacts,
        request: serde_json::Map<String, Value>,
        max_resumes: u32,
    ) -> Option<Self> {
        let endpoint = match facts.route {
            _ if !facts.resumable() || max_resumes == 0 => return None,
            Route::ChatCompletions => Endpoint::Chat,
            Route::Completions => Endpoint::Completion,
            Route::Messages | Route::Other => return None,
        };
        let g = &facts.generation;
        Some(Self {
            endpoint,
            request,
            // A client continuing its own generation already has the opening chunk.
            opened: !g.resume_token_ids.is_empty(),
            client_resume: g.resume_token_ids.clone(),
            stream: g.stream,
            include_usage: g.include_usage,
            sent: Vec::new(),
            identity: None,
            finished: false,
            done: false,
            unknown: false,
            errored: false,
            resumes: 0,
            max_resumes,
        })
    }

    /// Token ids the client has received so far.
    pub fn sent_ids(&self) -> &[u32] {
        &self.sent
    }

    pub fn resumes(&self) -> u32 {
        self.resumes
    }

    /// The stream has ended (`[DONE]` or the engine's own error event passed); nothing
    /// to resume.
    pub fn is_complete(&self) -> bool {
        self.done || self.errored
    }

    /// Rewrites one whole SSE event from the engine for the client (its meta line already
    /// cut off and read by [`EngineEvent`]): the `mlxd` field of an old engine's chunk
    /// removed, the first response's `id`/`created`, and a repeated opening chunk dropped
    /// (`None`). Records the token ids the event carries.
    pub fn client_event(&mut self, event: &EngineEvent) -> Option<Bytes> {
        let given = match event.meta() {
            Some(Ok(meta)) => {
                if self.identity.is_some() && self.resumes == 0 {
                    // The hot path: the first response, its identity known, nothing to
                    // rewrite; the chunk's bytes pass unread.
                    self.finished |= meta.finish;
                    self.sent.extend_from_slice(&meta.token_ids);
                    return Some(event.bytes().clone());
                }
                Some(meta)
            }
            Some(Err(())) => {
                // A meta line that does not parse: which tokens the client has is unknown.
                self.unknown = true;
                return Some(event.bytes().clone());
            }
            None => None,
        };
        self.parsed_event(event, given)
    }

    /// [`Self::client_event`] for an event whose chunk must be read: `given` is its meta
    /// line, if it had one.
    fn parsed_event(&mut self, event: &EngineEvent, given: Option<&EventMeta>) -> Option<Bytes> {
        let Some(data) = event.single_data() else {
            if given.is_some() {
                self.unknown = true;
            }
            return Some(event.bytes().clone());
        };
        if data == SSE_DONE {
            self.done = true;
            return Some(event.bytes().clone());
        }
        let json = event.json();
        // The meta line's ids belong to the event's single choice.
        let mut given = given.map(|m| {
            self.finished |= m.finish;
            TokenIds {
                token_ids: m.token_ids.clone(),
            }
        });
        let had_meta = given.is_some();
        let rewritten = match self.endpoint {
            Endpoint::Chat => match json.map(ChatCompletionChunk::deserialize) {
                Some(Ok(mut chunk)) => {
                    let opening = !had_meta
                        && chunk
                            .choices
                            .iter()
                            .any(|c| c.delta.role.is_some() && c.mlxd.is_none());
                    if opening && self.opened {
                        return None;
                    }
                    self.opened |= opening;
                    let mut changed = self.take_identity(&mut chunk.id, &mut chunk.created);
                    for c in &mut chunk.choices {
                        let text = c.delta.content.as_deref().unwrap_or_default();
                        let (ids, inline) = match c.mlxd.take() {
                            Some(ids) => (Some(ids), true),
                            None => (given.take(), false),
                        };
                        changed |= inline;
                        self.take_ids(ids, text, c.finish_reason.is_some());
                    }
                    Some(
                        changed
                            .then(|| serde_json::to_string(&chunk).ok())
                            .flatten(),
                    )
                }
                _ => None,
            },
            Endpoint::Completion => match json.map(CompletionResponse::deserialize) {
                Some(Ok(mut chunk)) => {
                    let mut changed = self.take_identity(&mut chunk.id, &mut chunk.created);
                    for c in &mut chunk.choices {
                        let (ids, inline) = match c.mlxd.take() {
                            Some(ids) => (Some(ids), true),
                            None => (given.take(), false),
                        };
                        changed |= inline;
                        self.take_ids(ids, &c.text, c.finish_reason.is_some());
                    }
                    Some(
                        changed
                            .then(|| serde_json::to_string(&chunk).ok())
                            .flatten(),
                    )
                }
                _ => None,
            },
        };
        let rewritten = match rewritten {
            // Read, and nothing to change: the engine's own bytes.
            Some(None) => return Some(event.bytes().clone()),
            Some(Some(json)) => Some(json),
            None => None,
        };
        match rewritten {
            Some(json) => Some(mlxd_ipc::sse::data_event(&json)),
            None => {
                // An error event (the engine failed the request itself) ends the stream;
                // anything else unreadable makes the record's view of the stream unsure.
                if !had_meta && json.is_some_and(|v| v.get("error").is_some()) {
                    self.errored = true;
                } else {
                    self.unknown = true;
                }
                Some(event.bytes().clone())
            }
        }
    }

    /// Rewrites a whole (non-streaming) JSON response: the `mlxd` field removed, and its
    /// usage read for the metrics tap from the same parse. A body that is not a response
    /// of this endpoint passes unchanged, unread.
    pub fn client_body(&self, body: Bytes) -> ClientBody {
        let read = match self.endpoint {
            Endpoint::Chat => serde_json::from_slice::<ChatCompletionResponse>(&body)
                .ok()
                .and_then(|mut r| {
                    r.choices.iter_mut().for_each(|c| c.mlxd = None);
                    let usage = Some((r.usage.prompt_tokens, r.usage.completion_tokens));
                    Some((serde_json::to_vec(&r).ok()?, usage))
                }),
            Endpoint::Completion => serde_json::from_slice::<CompletionResponse>(&body)
                .ok()
                .and_then(|mut r| {
                    r.choices.iter_mut().for_each(|c| c.mlxd = None);
                    let usage = r
                        .usage
                        .as_ref()
                        .map(|u| (u.prompt_tokens, u.completion_tokens));
                    Some((serde_json::to_vec(&r).ok()?, usage))
                }),
        };
        match read {
            Some((json, usage)) => ClientBody {
                bytes: Bytes::from(json),
                usage,
            },
            None => ClientBody {
                bytes: body,
                usage: None,
            },
        }
    }

    /// What to send to a new engine now that the one serving this request died; counts
    /// the attempt.
    pub fn resume(&mut self) -> Resume {
        if self.done || self.errored {
            return Resume::Finish(Bytes::new());
        }
        if self.finished {
            if self.include_usage {
                return Resume::Impossible(NotResumable::UsageLost);
            }
            return Resume::Finish(Bytes::from_static(mlxd_ipc::sse::DONE_EVENT));
        }
        if self.unknown {
            return Resume::Impossible(NotResumable::UnknownEvent);
        }
        if self.resumes >= self.max_resumes {
            return Resume::Impossible(NotResumable::TooManyResumes {
                limit: self.max_resumes,
            });
        }
        self.resumes += 1;
        Resume::Continue(self.continuation())
    }

    /// The request again, continuing after every token already sent.
    pub fn continuation(&self) -> Bytes {
        let mut request = self.request.clone();
        let ids: Vec<u32> = self
            .client_resume
            .iter()
            .chain(&self.sent)
            .copied()
            .collect();
        if ids.is_empty() {
            request.remove("mlxd");
        } else {
            let ext = request
                .entry("mlxd")
                .or_insert_with(|| Value::Object(Default::default()));
            if !ext.is_object() {
                *ext = Value::Object(Default::default());
            }
            ext["resume_token_ids"] = Value::from(ids);
        }
        Bytes::from(Value::Object(request).to_string())
    }

    /// Gives the chunk the first response's `id` and `created`; true if that changed it.
    fn take_identity(&mut self, id: &mut String, created: &mut u64) -> bool {
        let (first_id, first_created) = self
            .identity
            .get_or_insert_with(|| (id.clone(), *created))
            .clone();
        let changed = *id != first_id || *created != first_created;
        *id = first_id;
        *created = first_created;
        changed
    }

    /// Records one choice's token ids. Text without ids (an engine that does not report
    /// them) leaves the record unsure of what the client has, so the request is then not
    /// resumable.
    fn take_ids(&mut self, ids: Option<TokenIds>, text: &str, finish: bool) {
        self.finished |= finish;
        match ids {
            Some(ids) => self.sent.extend(ids.token_ids),
            None => {
                if !text.is_empty() {
                    self.unknown = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A record as the proxy makes one, from the request's bytes.
    fn new_record(path: &str, body: &[u8], max_resumes: u32) -> Option<ResumeRecord> {
        let value = mlxd_protocol::request::parse_object(body).ok()?;
        let facts = RequestFacts::read(Route::for_path(path), &value).ok()?;
        let Value::Object(request) = value else {
            return None;
        };
        ResumeRecord::new(&facts, request, max_resumes)
    }

    /// One event through the record as `forward.rs` passes it.
    fn pass(r: &mut ResumeRecord, event: Bytes) -> Option<Bytes> {
        r.client_event(&EngineEvent::new(event))
    }

    fn ev(v: Value) -> Bytes {
        mlxd_ipc::sse::data_event(&v.to_string())
    }

    fn chat_chunk(id: &str, content: Option<&str>, ids: &[u32], finish: Option<&str>) -> Value {
        let mut choice =
            json!({"index": 0, "delta": {}, "finish_reason": finish, "logprobs": null});
        if let Some(c) = content {
            choice["delta"]["content"] = json!(c);
        }
        if !ids.is_empty() {
            choice["mlxd"] = json!({"token_ids": ids});
        }
        json!({"id": id, "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]})
    }

    fn opening(id: &str) -> Value {
        json!({"id": id, "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}]})
    }

    fn record(body: Value) -> ResumeRecord {
        new_record("/v1/chat/completions", body.to_string().as_bytes(), 3).unwrap()
    }

    fn data(b: &Bytes) -> Value {
        let event = EngineEvent::new(b.clone());
        serde_json::from_str(event.single_data().unwrap()).unwrap()
    }

    #[test]
    fn only_generation_routes_with_object_bodies_are_resumable() {
        assert!(new_record("/v1/embeddings", b"{}", 3).is_none());
        assert!(new_record("/v1/completions", b"[1]", 3).is_none());
        assert!(new_record("/v1/completions", b"{}", 0).is_none());
        assert!(new_record("/v1/completions", b"{}", 1).is_some());
        assert!(new_record("/v1/completions", br#"{"n": 1}"#, 1).is_some());
        assert!(new_record("/v1/chat/completions", br#"{"n": 2}"#, 1).is_none());
    }

    #[test]
    fn strips_the_extension_and_records_ids() {
        let mut r = record(json!({"stream": true, "messages": []}));
        let out = pass(&mut r, ev(chat_chunk("a", Some("Hi"), &[5, 6], None)));
        let v = data(&out.unwrap());
        assert!(v["choices"][0].get("mlxd").is_none(), "{v}");
        assert_eq!(v["choices"][0]["delta"]["content"], "Hi");
        assert_eq!(r.sent_ids(), [5, 6]);
    }

    #[test]
    fn rewritten_chunk_is_what_the_engine_writes_without_the_field() {
        let mut r = record(json!({"stream": true, "messages": []}));
        let with = chat_chunk("a", Some("x\"y\u{e9}"), &[1], Some("stop"));
        let mut without = with.clone();
        without["choices"][0]
            .as_object_mut()
            .unwrap()
            .remove("mlxd");
        // Serialized in the engine's field order through the protocol type.
        let engine_bytes =
            serde_json::to_string(&serde_json::from_value::<ChatCompletionChunk>(without).unwrap())
                .unwrap();
        let out = pass(&mut r, ev(with)).unwrap();
        assert_eq!(out, mlxd_ipc::sse::data_event(&engine_bytes));
    }

    #[test]
    fn continuation_keeps_identity_drops_second_opening_and_counts_ids() {
        let mut r = record(
            json!({"stream": true, "messages": [{"role": "user", "content": "q"}], "seed": 3}),
        );
        assert!(pass(&mut r, ev(opening("first"))).is_some());
        pass(&mut r, ev(chat_chunk("first", Some("a"), &[10], None)));
        pass(&mut r, ev(chat_chunk("first", Some("b"), &[11, 12], None)));
        let Resume::Continue(body) = r.resume() else {
            panic!("expected a continuation")
        };
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["mlxd"]["resume_token_ids"], json!([10, 11, 12]));
        assert_eq!(body["seed"], 3);
        assert_eq!(body["messages"][0]["content"], "q");
        // The new engine's chunks carry its own id; the client sees the first one.
        let out = pass(&mut r, ev(chat_chunk("second", Some("c"), &[13], None)));
        assert_eq!(data(&out.unwrap())["id"], "first");
        assert_eq!(r.sent_ids(), [10, 11, 12, 13]);
    }

    #[test]
    fn a_crash_before_any_token_repeats_no_opening() {
        let mut r = record(json!({"stream": true, "messages": []}));
        pass(&mut r, ev(opening("first")));
        let Resume::Continue(body) = r.resume() else {
            panic!()
        };
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert!(body.get("mlxd").is_none(), "{body}");
        assert!(pass(&mut r, ev(opening("second"))).is_none());
    }

    #[test]
    fn client_resume_ids_come_first() {
        let mut r =
            record(json!({"stream": true, "messages": [], "mlxd": {"resume_token_ids": [1, 2]}}));
        // The engine sends no opening chunk for a resumed request, and none is expected.
        pass(&mut r, ev(chat_chunk("a", Some("x"), &[3], None)));
        let Resume::Continue(body) = r.resume() else {
            panic!()
        };
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["mlxd"]["resume_token_ids"], json!([1, 2, 3]));
        assert!(pass(&mut r, ev(opening("b"))).is_none());
    }

    #[test]
    fn end_of_stream_cases() {
        let mut r = record(json!({"stream": true, "messages": []}));
        pass(&mut r, ev(chat_chunk("a", Some("x"), &[3], Some("length"))));
        assert_eq!(
            r.resume(),
            Resume::Finish(Bytes::from_static(mlxd_ipc::sse::DONE_EVENT))
        );
        let mut r = record(
            json!({"stream": true, "messages": [], "stream_options": {"include_usage": true}}),
        );
        pass(&mut r, ev(chat_chunk("a", Some("x"), &[3], Some("length"))));
        assert_eq!(r.resume(), Resume::Impossible(NotResumable::UsageLost));
        let mut r = record(json!({"stream": true, "messages": []}));
        pass(&mut r, Bytes::from_static(b"data: [DONE]\n\n"));
        assert!(r.is_complete());
        assert_eq!(r.resume(), Resume::Finish(Bytes::new()));
    }

    #[test]
    fn resume_budget_and_unknown_events() {
        let mut r = new_record("/v1/completions", br#"{"prompt":"p"}"#, 2).unwrap();
        assert!(matches!(r.resume(), Resume::Continue(_)));
        assert!(matches!(r.resume(), Resume::Continue(_)));
        assert_eq!(
            r.resume(),
            Resume::Impossible(NotResumable::TooManyResumes { limit: 2 })
        );
        let mut r = new_record("/v1/completions", br#"{"prompt":"p"}"#, 2).unwrap();
        let odd = Bytes::from_static(b"data: {\"something\":1}\n\n");
        assert_eq!(pass(&mut r, odd.clone()), Some(odd));
        assert_eq!(r.resume(), Resume::Impossible(NotResumable::UnknownEvent));
        // Text without token ids: what the client has is unknown.
        let mut r = new_record("/v1/completions", br#"{"prompt":"p"}"#, 2).unwrap();
        let bare = Bytes::from(
            json!({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": "t", "finish_reason": null, "logprobs": null}]})
            .to_string(),
        );
        let bare = mlxd_ipc::sse::data_event(std::str::from_utf8(&bare).unwrap());
        assert_eq!(pass(&mut r, bare.clone()), Some(bare), "passed unchanged");
        assert_eq!(r.resume(), Resume::Impossible(NotResumable::UnknownEvent));
        // An engine error event passes unchanged and leaves the record sure.
        let mut r = new_record("/v1/completions", br#"{"prompt":"p"}"#, 2).unwrap();
        let err = Bytes::from_static(b"data: {\"error\":{\"message\":\"x\"}}\n\n");
        assert_eq!(pass(&mut r, err.clone()), Some(err));
        assert!(r.is_complete());
        assert_eq!(r.resume(), Resume::Finish(Bytes::new()));
        // Comments and multi-line events pass through untouched.
        let c = Bytes::from_static(b": ping\n\n");
        assert_eq!(pass(&mut r, c.clone()), Some(c));
    }

    /// An event as the engine writes it: the meta line, then the chunk without `mlxd`.
    fn meta_ev(v: Value, ids: &[u32], finish: bool) -> Bytes {
        let mut v = v;
        for c in v["choices"].as_array_mut().into_iter().flatten() {
            c.as_object_mut().unwrap().remove("mlxd");
        }
        let meta = EventMeta {
            token_ids: ids.to_vec(),
            finish,
        };
        Bytes::from(format!("{}data: {v}\n\n", meta.line()))
    }

    #[test]
    fn meta_line_is_cut_and_the_chunk_passes_as_its_own_bytes() {
        let mut r = record(json!({"stream": true, "messages": []}));
        assert!(pass(&mut r, ev(opening("a"))).is_some());
        let chunk = chat_chunk("a", Some("Hi \"\u{e9}"), &[], None);
        let out = pass(&mut r, meta_ev(chunk.clone(), &[5, 6], false)).unwrap();
        assert_eq!(
            out,
            ev(chunk),
            "the data line exactly as the engine wrote it"
        );
        assert_eq!(r.sent_ids(), [5, 6]);
        // The finish flag of the line ends the choice: a crash now only needs the end.
        let last = chat_chunk("a", Some("!"), &[], Some("stop"));
        pass(&mut r, meta_ev(last, &[7], true)).unwrap();
        assert_eq!(r.sent_ids(), [5, 6, 7]);
        assert_eq!(
            r.resume(),
            Resume::Finish(Bytes::from_static(mlxd_ipc::sse::DONE_EVENT))
        );
    }

    #[test]
    fn continuation_with_meta_lines_keeps_identity_and_ids() {
        let mut r = new_record("/v1/completions", br#"{"prompt":"p","stream":true}"#, 1).unwrap();
        let chunk = |id: &str, text: &str| {
            json!({"id": id, "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": null, "logprobs": null}]})
        };
        // The first event of a completion stream is read once, for its identity.
        let out = pass(&mut r, meta_ev(chunk("c1", "a"), &[4], false)).unwrap();
        assert_eq!(out, ev(chunk("c1", "a")));
        let Resume::Continue(body) = r.resume() else {
            panic!("expected a continuation")
        };
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["mlxd"]["resume_token_ids"], json!([4]));
        let out = pass(&mut r, meta_ev(chunk("c2", "b"), &[9], false)).unwrap();
        assert_eq!(data(&out)["id"], "c1");
        assert!(!out.starts_with(b":"), "no meta line reaches the client");
        assert_eq!(r.sent_ids(), [4, 9]);
    }

    #[test]
    fn a_broken_meta_line_makes_the_stream_unresumable() {
        let mut r = new_record("/v1/completions", br#"{"prompt":"p","stream":true}"#, 1).unwrap();
        let event = Bytes::from_static(b": mlxd {\"token_ids\":\"x\"}\ndata: {}\n\n");
        assert_eq!(
            pass(&mut r, event),
            Some(Bytes::from_static(b"data: {}\n\n"))
        );
        assert_eq!(r.resume(), Resume::Impossible(NotResumable::UnknownEvent));
    }

    /// Per-event cost of the resume bookkeeping and the metrics tap on a typical chunk,
    /// with its ids in the chunk's JSON (an old engine) and in the meta line. A measurement,
    /// not a check: `cargo test -p mlxd-proxy resume::tests::per_event_cost -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore]
    fn per_event_cost() {
        use crate::metrics::{Metrics, RequestTap};
        use tokio::time::Instant;
        const N: u32 = 20_000;
        let legacy = ev(chat_chunk(
            "chatcmpl-0123456789abcdef",
            Some(" token"),
            &[12345],
            None,
        ));
        let meta = mlxd_protocol::openai::EventMeta {
            token_ids: vec![12345],
            finish: false,
        };
        let mut bare = chat_chunk("chatcmpl-0123456789abcdef", Some(" token"), &[], None);
        bare["choices"][0].as_object_mut().unwrap().remove("mlxd");
        let with_line = Bytes::from(format!("{}data: {bare}\n\n", meta.line()));
        println!(
            "legacy event {} bytes, meta event {} bytes",
            legacy.len(),
            with_line.len()
        );
        for (name, event) in [
            ("ids in the chunk", legacy),
            ("ids in the meta line", with_line),
        ] {
            let metrics = std::sync::Arc::new(Metrics::new());
            let mut r = record(json!({"stream": true, "messages": []}));
            let mut tap = RequestTap::new(metrics, "m", 200, Instant::now(), true);
            pass(&mut r, ev(opening("chatcmpl-0123456789abcdef")));
            // Resume alone, then resume and tap together (as `forward.rs` runs them: the tap
            // reads what the record already parsed); each event dropped after use.
            let t = Instant::now();
            for _ in 0..N {
                r.client_event(&EngineEvent::new(event.clone())).unwrap();
            }
            let resume = t.elapsed() / N;
            let t = Instant::now();
            for _ in 0..N {
                let event = EngineEvent::new(event.clone());
                r.client_event(&event).unwrap();
                tap.event(&event);
            }
            let both = t.elapsed() / N;
            assert_eq!(r.sent_ids().len(), 2 * N as usize);
            println!("{name}: resume {resume:?}/event, resume and tap {both:?}/event");
        }
        // A whole (non-streaming) response: the record rewrites it and the tap takes its
        // usage from that parse, against the tap parsing the rewritten body again.
        let whole = Bytes::from(
            json!({"id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": 7,
                   "model": "m", "choices": [{"index": 0, "finish_reason": "stop", "logprobs": null,
                   "message": {"role": "assistant", "content": "word ".repeat(200)},
                   "mlxd": {"token_ids": (0..200).collect::<Vec<u32>>()}}],
                   "usage": {"prompt_tokens": 12, "completion_tokens": 200, "total_tokens": 212}})
            .to_string(),
        );
        let r = record(json!({"messages": []}));
        let metrics = std::sync::Arc::new(Metrics::new());
        const W: u32 = 2_000;
        for (name, shared) in [("tap parses again", false), ("usage shared", true)] {
            let t = Instant::now();
            for _ in 0..W {
                let mut tap = RequestTap::new(metrics.clone(), "m", 200, Instant::now(), false);
                let out = r.client_body(whole.clone());
                assert!(out.usage.is_some());
                tap.whole(&out.bytes, out.usage.filter(|_| shared));
            }
            println!(
                "whole response of {} bytes, {name}: {:?}/response",
                whole.len(),
                t.elapsed() / W
            );
        }
    }

    #[test]
    fn completion_chunks_and_whole_bodies() {
        let mut r = new_record("/v1/completions", br#"{"prompt":"p","stream":true}"#, 1).unwrap();
        let chunk = json!({"id": "c1", "object": "text_completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": "t", "finish_reason": null, "logprobs": null, "mlxd": {"token_ids": [4]}}]});
        let out = data(&pass(&mut r, ev(chunk)).unwrap());
        assert!(out["choices"][0].get("mlxd").is_none());
        assert_eq!(r.sent_ids(), [4]);
        let whole = json!({"id": "c1", "object": "text_completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": "t", "finish_reason": "length", "logprobs": null, "mlxd": {"token_ids": [4]}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
        let body = r.client_body(Bytes::from(whole.to_string()));
        assert_eq!(body.usage, Some((1, 1)), "read from the same parse");
        let v: Value = serde_json::from_slice(&body.bytes).unwrap();
        assert!(v["choices"][0].get("mlxd").is_none(), "{v}");
        assert_eq!(v["usage"]["total_tokens"], 2);
        // Not a response: unchanged, unread.
        let other = Bytes::from_static(b"{\"error\":{}}");
        assert_eq!(
            r.client_body(other.clone()),
            ClientBody {
                bytes: other,
                usage: None
            }
        );
    }
}
