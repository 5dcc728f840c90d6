//! The server over a real unix socket with a real HTTP client, a fake MLX worker that emits
//! canned token ids, and a real tokenizer (the qwen3 fixture).
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use mlxd_protocol::openai::{ChatMessage, Role};
use serde_json::{json, Value};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::runtime::request::{
    FinishReason, GenerateRequest, GenerationError, TokenEvent, TokenLogprobs,
};
use crate::runtime::sampling_params::SamplingParams;
use crate::tokenizer::tests::load_fixture;

const CANNED: &str = "Hello there! 🫠 How are you?";
const EOS: u32 = 151645;

/// What the fake worker does with the next request.
#[derive(Clone, Debug)]
enum Script {
    /// Emit the canned ids (up to `max_tokens`), then EOS.
    Canned,
    /// Fail before any output.
    FailAtOnce(GenerationError),
    /// Emit this many canned tokens, then fail.
    FailAfter(usize, GenerationError),
    /// Emit a token every 10 ms until the receiver is gone, then report on `closed`.
    Endless,
    /// Emit these ids, then EOS (a model that writes a given text).
    Ids(Vec<u32>),
}

/// What the worker saw of a request.
#[derive(Clone, Debug)]
struct Seen {
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
}

struct Harness {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    script: Arc<Mutex<Script>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    closed: mpsc::UnboundedReceiver<()>,
    canned: Vec<u32>,
    tokenizer: Arc<Tokenizer>,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<io::Result<()>>>,
}

impl Harness {
    async fn new(context_length: usize) -> Self {
        let tokenizer = load_fixture("qwen3");
        let canned = tokenizer.encode(CANNED, false).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("engine.sock");
        // A stale file from an earlier run is replaced.
        std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let listener = bind(&socket).unwrap();

        let (work_tx, mut work_rx) = mpsc::unbounded_channel::<GenerateRequest>();
        let script = Arc::new(Mutex::new(Script::Canned));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (closed_tx, closed) = mpsc::unbounded_channel();
        {
            let (script, seen, canned) = (script.clone(), seen.clone(), canned.clone());
            tokio::spawn(async move {
                while let Some(req) = work_rx.recv().await {
                    seen.lock().unwrap().push(Seen {
                        prompt: req.prompt.clone(),
                        sampling: req.sampling.clone(),
                        max_tokens: req.max_tokens,
                        stop_token_ids: req.stop_token_ids.clone(),
                    });
                    let script = script.lock().unwrap().clone();
                    tokio::spawn(run_script(req, script, canned.clone(), closed_tx.clone()));
                }
            });
        }

        let state = ServerState::new("test-model", tokenizer.clone(), context_length, work_tx);
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, state, async {
            let _ = shutdown_rx.await;
        }));
        Self {
            _dir: dir,
            socket,
            script,
            seen,
            closed,
            canned,
            tokenizer,
            shutdown: Some(shutdown_tx),
            server: Some(server),
        }
    }

    fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    fn last_seen(&self) -> Seen {
        self.seen.lock().unwrap().last().cloned().unwrap()
    }

    async fn request(&self, method: &str, uri: &str, body: Option<String>) -> Response<Incoming> {
        let stream = UnixStream::connect(&self.socket).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header("host", "engine");
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .unwrap();
        sender.send_request(req).await.unwrap()
    }

    async fn json(&self, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
        let resp = self.request(method, uri, body.map(|b| b.to_string())).await;
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!("{uri}: not JSON ({e}): {}", String::from_utf8_lossy(&bytes))
        });
        (status, value)
    }

    async fn post(&self, uri: &str, body: Value) -> (StatusCode, Value) {
        self.json("POST", uri, Some(body)).await
    }

    /// The SSE events of a streaming request, `[DONE]` as the string "[DONE]".
    async fn stream(&self, uri: &str, body: Value) -> Vec<Value> {
        let resp = self.request("POST", uri, Some(body.to_string())).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        parse_sse(std::str::from_utf8(&bytes).unwrap())
    }

    async fn stop(mut self) {
        let _ = self.shutdown.take().unwrap().send(());
        self.server.take().unwrap().await.unwrap().unwrap();
    }
}

/// The events of an OpenAI stream as JSON. A choice chunk's meta line (its token ids) is
/// checked against the chunk and folded back in as `choices[0].mlxd.token_ids`, where
/// whole responses carry them, so tests read ids the same way from both.
fn parse_sse(text: &str) -> Vec<Value> {
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split_terminator("\n\n")
        .map(|event| {
            let (meta, event) = match mlxd_protocol::openai::EventMeta::split(event.as_bytes()) {
                Some((meta, at)) => (Some(meta.expect("a readable meta line")), &event[at..]),
                None => (None, event),
            };
            let data = event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data line: {event:?}"));
            if data == "[DONE]" {
                assert!(meta.is_none());
                return Value::from("[DONE]");
            }
            let mut v: Value = serde_json::from_str(data).unwrap();
            let choices = v["choices"].as_array().map_or(0, Vec::len);
            if let Some(meta) = meta {
                assert_eq!(choices, 1, "a meta line belongs to one choice: {v}");
                let choice = &mut v["choices"][0];
                assert!(
                    choice.get("mlxd").is_none(),
                    "ids only in the meta line: {choice}"
                );
                assert_eq!(meta.finish, choice["finish_reason"].is_string(), "{choice}");
                if !meta.token_ids.is_empty() {
                    choice["mlxd"] = json!({"token_ids": meta.token_ids});
                }
            } else if let Some(cs) = v["choices"].as_array() {
                for c in cs {
                    assert!(c.get("mlxd").is_none(), "a chunk without a meta line: {c}");
                    assert!(
                        c["finish_reason"].is_null(),
                        "a last chunk without a meta line: {c}"
                    );
                }
            }
            v
        })
        .collect()
}

async fn run_script(
    mut req: GenerateRequest,
    script: Script,
    canned: Vec<u32>,
    closed: mpsc::UnboundedSender<()>,
) {
    if let Some(constraint) = req.constraint.take() {
        return drive_constraint(req, constraint).await;
    }
    let logprobs = req.logprobs;
    let events = req.events;
    let _ = events.send(TokenEvent::PromptDone {
        prompt_tokens: req.prompt.len(),
        cached: 1,
    });
    match script {
        Script::Canned => {
            // Like a deterministic model: a prompt that ends with the first k canned ids (a
            // resumed request) continues with the rest.
            let k = (0..=canned.len())
                .rev()
                .find(|&k| req.prompt.ends_with(&canned[..k]))
                .unwrap_or(0);
            for (i, &id) in canned[k..].iter().chain([EOS].iter()).enumerate() {
                if i == req.max_tokens {
                    let _ = events.send(TokenEvent::Finished(FinishReason::Length));
                    return;
                }
                if let Some(k) = logprobs {
                    // The token itself is the likeliest, then the ids after it.
                    let top = (0..k as u32).map(|j| (id + j, -(j as f32))).collect();
                    let _ = events.send(TokenEvent::Logprobs(TokenLogprobs { logprob: 0.0, top }));
                }
                if events.send(TokenEvent::Token(id)).is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
            let _ = events.send(TokenEvent::Finished(FinishReason::Stop));
        }
        Script::FailAtOnce(message) => {
            let _ = events.send(TokenEvent::Failed(message));
        }
        Script::FailAfter(n, message) => {
            for &id in &canned[..n] {
                let _ = events.send(TokenEvent::Token(id));
            }
            let _ = events.send(TokenEvent::Failed(message));
        }
        Script::Endless => {
            for i in 0.. {
                let id = canned[i % canned.len()];
                if events.send(TokenEvent::Token(id)).is_err() {
                    break;
                }
                tokio::select! {
                    _ = events.closed() => break,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            assert!(events.is_closed());
            let _ = closed.send(());
        }
        Script::Ids(ids) => {
            for (i, &id) in ids.iter().chain([EOS].iter()).enumerate() {
                if i == req.max_tokens {
                    let _ = events.send(TokenEvent::Finished(FinishReason::Length));
                    return;
                }
                if events.send(TokenEvent::Token(id)).is_err() {
                    return;
                }
            }
            let _ = events.send(TokenEvent::Finished(FinishReason::Stop));
        }
    }
}

/// A model under a constraint that always takes EOS when allowed, else the lowest allowed id
/// (the worst case for a grammar: it must still end well-formed).
async fn drive_constraint(
    req: GenerateRequest,
    mut constraint: Box<dyn crate::constraint::TokenConstraint>,
) {
    let events = req.events;
    let _ = events.send(TokenEvent::PromptDone {
        prompt_tokens: req.prompt.len(),
        cached: 0,
    });
    let mut row = vec![0.0f32; 151669];
    for _ in 0..req.max_tokens {
        row.fill(0.0);
        if let Err(e) = constraint.mask(&mut row) {
            let _ = events.send(TokenEvent::Failed(GenerationError::Constraint(
                e.to_string(),
            )));
            return;
        }
        if row[EOS as usize] == 0.0 {
            let _ = events.send(TokenEvent::Finished(FinishReason::Stop));
            return;
        }
        let id = row
            .iter()
            .position(|&x| x == 0.0)
            .expect("something is allowed") as u32;
        let _ = events.send(TokenEvent::Token(id));
        match constraint.commit(id) {
            Ok(true) => {
                let _ = events.send(TokenEvent::Finished(FinishReason::Stop));
                return;
            }
            Ok(false) => {}
            Err(e) => {
                let _ = events.send(TokenEvent::Failed(GenerationError::Constraint(
                    e.to_string(),
                )));
                return;
            }
        }
    }
    let _ = events.send(TokenEvent::Finished(FinishReason::Length));
}

fn chat(extra: Value) -> Value {
    let mut body = json!({
        "model": "test-model",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn chat_completion_whole_response() {
    let h = Harness::new(4096).await;
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"temperature": 0.5, "seed": 7})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "test-model");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], CANNED);
    assert_eq!(choice["finish_reason"], "stop");
    let mut want_ids = h.canned.clone();
    want_ids.push(EOS);
    assert_eq!(ids_of(&choice["mlxd"]["token_ids"]), want_ids);

    let seen = h.last_seen();
    let messages = vec![
        ChatMessage::new(Role::System, "Be brief."),
        ChatMessage::new(Role::User, "Hi!"),
    ];
    let (_, prompt) = h.tokenizer.encode_chat(&messages, None, true).unwrap();
    assert_eq!(seen.prompt, prompt);
    assert_eq!(
        seen.max_tokens,
        4096 - prompt.len(),
        "default: the rest of the context"
    );
    assert_eq!(seen.stop_token_ids, vec![EOS]);
    assert_eq!(seen.sampling.temperature, 0.5);
    assert_eq!(seen.sampling.seed, Some(7));

    let usage = &body["usage"];
    assert_eq!(usage["prompt_tokens"], prompt.len());
    assert_eq!(usage["completion_tokens"], h.canned.len() + 1);
    assert_eq!(usage["total_tokens"], prompt.len() + h.canned.len() + 1);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 1);
    h.stop().await;
}

#[tokio::test]
async fn chat_completion_stream_sends_each_token_with_its_ids() {
    let h = Harness::new(4096).await;
    let events = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let first = &events[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let id = first["id"].clone();

    let chunks = &events[1..events.len() - 1];
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"]["completion_tokens"],
        h.canned.len() + 1
    );
    let content_chunks = &chunks[..chunks.len() - 1];
    let mut text = String::new();
    let mut ids = Vec::new();
    for c in content_chunks {
        assert_eq!(c["id"], id);
        let choice = &c["choices"][0];
        let delta = choice["delta"]["content"].as_str().unwrap_or("");
        assert!(!delta.contains('\u{FFFD}'));
        text.push_str(delta);
        ids.extend(ids_of(&choice["mlxd"]["token_ids"]));
    }
    assert_eq!(text, CANNED);
    let mut want_ids = h.canned.clone();
    want_ids.push(EOS);
    assert_eq!(ids, want_ids);
    // One chunk per token that completes text: the emoji's byte tokens share one chunk.
    let emoji_tokens = h.tokenizer.encode(" 🫠", false).unwrap().len();
    assert_eq!(content_chunks.len(), h.canned.len() - emoji_tokens + 1 + 1);
    let last = &content_chunks[content_chunks.len() - 1]["choices"][0];
    assert_eq!(last["finish_reason"], "stop");
    assert_eq!(ids_of(&last["mlxd"]["token_ids"]), vec![EOS]);
    assert!(content_chunks[..content_chunks.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    h.stop().await;
}

#[tokio::test]
async fn stop_strings_cut_the_text_and_cancel_the_worker() {
    let mut h = Harness::new(4096).await;
    let (status, body) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"stop": ["How", "zzz"]})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "Hello there! 🫠 ");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");

    h.set_script(Script::Endless);
    let events = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"stream": true, "stop": "🫠"})),
        )
        .await;
    let text: String = events[1..events.len() - 1]
        .iter()
        .map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(text, "Hello there! ");
    assert_eq!(
        events[events.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );
    // The stop string closed the worker's sender.
    tokio::time::timeout(Duration::from_secs(5), h.closed.recv())
        .await
        .expect("the worker should see its events channel closed")
        .unwrap();
    h.stop().await;
}

#[tokio::test]
async fn max_tokens_ends_with_length() {
    let h = Harness::new(4096).await;
    let (status, body) = h
        .post("/v1/chat/completions", chat(json!({"max_tokens": 3})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(h.last_seen().max_tokens, 3);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 3);
    assert_eq!(
        body["choices"][0]["message"]["content"],
        h.tokenizer.decode(&h.canned[..3], true).unwrap()
    );
    // max_completion_tokens wins; a request beyond the context is clamped to it.
    let (_, body) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"max_tokens": 3, "max_completion_tokens": 100000})),
        )
        .await;
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(h.last_seen().max_tokens, 4096 - prompt_tokens);
    h.stop().await;
}

#[tokio::test]
async fn completions_whole_and_streamed() {
    let h = Harness::new(4096).await;
    let (status, body) = h
        .post(
            "/v1/completions",
            json!({"model": "m", "prompt": "Once upon", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(
        h.last_seen().prompt,
        h.tokenizer.encode("Once upon", true).unwrap()
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        ids_of(&body["choices"][0]["mlxd"]["token_ids"]),
        h.canned[..2].to_vec()
    );

    let (status, _) = h
        .post(
            "/v1/completions",
            json!({"prompt": [[9707, 11]], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h.last_seen().prompt, vec![9707, 11]);

    let events = h
        .stream(
            "/v1/completions",
            json!({"prompt": ["Once"], "stream": true, "stop": ["!"],
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage = &events[events.len() - 2];
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let text: String = events[..events.len() - 2]
        .iter()
        .map(|e| {
            assert_eq!(e["object"], "text_completion");
            e["choices"][0]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, "Hello there");
    assert_eq!(
        events[events.len() - 3]["choices"][0]["finish_reason"],
        "stop"
    );
    h.stop().await;
}

#[tokio::test]
async fn worker_failures_are_500_or_an_error_event() {
    let h = Harness::new(4096).await;
    h.set_script(Script::FailAtOnce(GenerationError::Mlx(
        "device lost".into(),
    )));
    let (status, body) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(
        body["error"]["message"],
        "generation failed: MLX failed: device lost"
    );
    assert_eq!(body["error"]["code"], "mlx_error");
    // Streaming, but the failure came before any output: still a 500.
    let (status, _) = h
        .post("/v1/chat/completions", chat(json!({"stream": true})))
        .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);

    h.set_script(Script::FailAfter(
        2,
        GenerationError::Mlx("device lost".into()),
    ));
    let events = h
        .stream("/v1/chat/completions", chat(json!({"stream": true})))
        .await;
    let last = events.last().unwrap();
    assert_eq!(
        last["error"]["message"],
        "generation failed: MLX failed: device lost"
    );
    assert!(!events.contains(&Value::from("[DONE]")));
    let (status, body) = h.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");

    // Failures that are the request's, or the engine's restart, are not 500s.
    let budget = GenerationError::KvBudget {
        needed: 2000,
        budget: 1000,
        prompt_tokens: 10,
        max_tokens: 90,
    };
    h.set_script(Script::FailAtOnce(budget));
    let (status, body) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "kv_budget_exceeded");
    assert_eq!(body["error"]["param"], "max_tokens");
    h.set_script(Script::FailAtOnce(GenerationError::OutOfMemory(
        "cuda".into(),
    )));
    let (status, body) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    h.stop().await;
}

#[tokio::test]
async fn disconnecting_a_stream_cancels_the_generation() {
    let mut h = Harness::new(4096).await;
    h.set_script(Script::Endless);
    let resp = h
        .request(
            "POST",
            "/v1/chat/completions",
            Some(chat(json!({"stream": true})).to_string()),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut got = 0;
    while got < 3 {
        let frame = body.frame().await.unwrap().unwrap();
        if frame.data_ref().is_some() {
            got += 1;
        }
    }
    drop(body); // closes the client's connection
    tokio::time::timeout(Duration::from_secs(5), h.closed.recv())
        .await
        .expect("the worker should see its events channel closed")
        .unwrap();
    h.stop().await;
}

#[tokio::test]
async fn bad_requests_are_400_naming_the_field_and_the_server_keeps_serving() {
    let h = Harness::new(64).await;
    let long = "word ".repeat(100);
    let cases: Vec<(&str, String, Option<&str>, &str)> = vec![
        (
            "/v1/chat/completions",
            "{\"messages\": [".into(),
            None,
            "not valid JSON",
        ),
        ("/v1/chat/completions", "[]".into(), None, "JSON object"),
        (
            "/v1/chat/completions",
            json!({"model": "m"}).to_string(),
            Some("messages"),
            "required",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            Some("messages"),
            "at least one",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": 1, "content": "x"}]}).to_string(),
            Some("messages[0].role"),
            "invalid",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": 0})).to_string(),
            Some("max_tokens"),
            "at least 1, got 0",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"max_tokens": "ten"})).to_string(),
            Some("max_tokens"),
            "invalid",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"n": 9})).to_string(),
            Some("n"),
            "n = 9",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}).to_string(),
            Some("n"),
            "n = 0",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"temperature": -1})).to_string(),
            Some("temperature"),
            "at least 0 and at most 3.4028235e38, got -1",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_p": 0})).to_string(),
            Some("top_p"),
            "(0, 1], got 0",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_p": 1.01})).to_string(),
            Some("top_p"),
            "got 1.01",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logit_bias": {"99999999": 5}})).to_string(),
            Some("logit_bias"),
            "99999999",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream": "yes"})).to_string(),
            Some("stream"),
            "invalid",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}]}).to_string(),
            Some("messages"),
            "context length is 64 tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": ["a", "b"]}).to_string(),
            Some("prompt"),
            "got 2",
        ),
        (
            "/v1/completions",
            json!({"prompt": [[1], [2]]}).to_string(),
            Some("prompt"),
            "got 2",
        ),
        (
            "/v1/completions",
            json!({"prompt": long}).to_string(),
            Some("prompt"),
            "64",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": -3}).to_string(),
            Some("max_tokens"),
            "got -3",
        ),
    ];
    for (uri, body, param, needle) in cases {
        let resp = h.request("POST", uri, Some(body.clone())).await;
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
        assert!(v["error"].as_object().unwrap().contains_key("code"));
    }
    // The prompt-length message quotes both numbers.
    let (_, v) = h
        .post("/v1/completions", json!({"prompt": vec![1; 64]}))
        .await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("64 tokens, and the model's context length is 64"),
        "{v}"
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // A prompt far over the context is refused from its size, without encoding 30 MB.
    let huge = "word ".repeat(6_000_000);
    let started = std::time::Instant::now();
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let (status, v) = h.post(path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("30000000 bytes"),
            "{v}"
        );
    }
    eprintln!("two 30 MB prompts refused in {:?}", started.elapsed());
    // Nothing reached the worker, and it still serves.
    assert!(h.seen.lock().unwrap().is_empty());
    let (status, body) = h
        .post("/v1/chat/completions", chat(json!({"max_tokens": 2})))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    h.stop().await;
}

#[tokio::test]
async fn unknown_routes_and_methods_models_and_health() {
    let h = Harness::new(4096).await;
    let (status, v) = h.json("GET", "/v1/nothing", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("GET /v1/nothing"));
    let (status, v) = h.json("GET", "/v1/chat/completions", None).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("GET"));

    let (status, v) = h.json("GET", "/v1/models", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "test-model");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["context_length"], 4096);
    let (status, _) = h.json("GET", "/v1/models/test-model", None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = h.json("GET", "/v1/models/other", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, v) = h.json("GET", "/health", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["status"], "ok");
    assert_eq!(v["model"], "test-model");
    h.stop().await;
}

#[tokio::test]
async fn a_stopped_worker_means_503() {
    let tokenizer = load_fixture("qwen3");
    let (work_tx, work_rx) = mpsc::unbounded_channel();
    drop(work_rx);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let listener = bind(&socket).unwrap();
    let state = ServerState::new("m", tokenizer, 4096, work_tx);
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, state, async {
        let _ = rx.await;
    }));
    let stream = UnixStream::connect(&socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/v1/completions")
        .header("host", "x")
        .body(Full::new(Bytes::from(json!({"prompt": "hi"}).to_string())))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(resp.headers()["retry-after"], "1");
    let req = Request::get("/health")
        .header("host", "x")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    drop(sender);
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
    // A regular file where the socket should go is not removed.
    let file = dir.path().join("file");
    std::fs::write(&file, "x").unwrap();
    assert_eq!(
        bind(&file).unwrap_err().kind(),
        io::ErrorKind::AlreadyExists
    );
}

#[tokio::test]
async fn disconnecting_a_whole_response_request_cancels_the_generation() {
    let mut h = Harness::new(4096).await;
    h.set_script(Script::Endless);
    let stream = UnixStream::connect(&h.socket).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = Request::post("/v1/chat/completions")
        .header("host", "x")
        .body(Full::new(Bytes::from(chat(json!({})).to_string())))
        .unwrap();
    let pending = tokio::spawn(async move { sender.send_request(req).await });
    while h.seen.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    pending.abort();
    conn.abort();
    tokio::time::timeout(Duration::from_secs(5), h.closed.recv())
        .await
        .expect("the worker should see its events channel closed")
        .unwrap();
    h.stop().await;
}

#[tokio::test]
async fn a_resumed_stream_continues_where_the_ids_end() {
    let h = Harness::new(4096).await;
    let body = chat(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let events = h.stream("/v1/chat/completions", body.clone()).await;
    let full_prompt = h.last_seen().prompt;
    // Pretend the engine died after the first four content chunks reached the client.
    let (mut sent_text, mut sent_ids) = (String::new(), Vec::new());
    for e in &events[1..5] {
        sent_text.push_str(e["choices"][0]["delta"]["content"].as_str().unwrap());
        sent_ids.extend(ids_of(&e["choices"][0]["mlxd"]["token_ids"]));
    }
    let mut resumed = body.clone();
    resumed["mlxd"] = json!({"resume_token_ids": sent_ids});
    resumed["max_tokens"] = json!(100);
    let events = h.stream("/v1/chat/completions", resumed).await;
    let seen = h.last_seen();
    assert_eq!(
        seen.prompt,
        [full_prompt.clone(), sent_ids.clone()].concat()
    );
    assert_eq!(seen.max_tokens, 100 - sent_ids.len());
    assert!(
        events[0]["choices"][0]["delta"].get("role").is_none(),
        "no opening chunk"
    );
    let mut text = sent_text;
    let mut ids = sent_ids;
    for e in &events[..events.len() - 2] {
        text.push_str(e["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        ids.extend(ids_of(&e["choices"][0]["mlxd"]["token_ids"]));
    }
    assert_eq!(text, CANNED);
    assert_eq!(ids, [h.canned.clone(), vec![EOS]].concat());
    let usage = &events[events.len() - 2]["usage"];
    assert_eq!(usage["prompt_tokens"], full_prompt.len());
    assert_eq!(usage["completion_tokens"], h.canned.len() + 1);

    // Bad resume ids are the client's fault.
    let mut bad = body.clone();
    bad["mlxd"] = json!({"resume_token_ids": [1, 2, 3]});
    bad["max_tokens"] = json!(3);
    let (status, v) = h.post("/v1/chat/completions", bad).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["param"], "mlxd.resume_token_ids");
    let mut bad = body;
    bad["mlxd"] = json!({"resume_token_ids": [999999999]});
    let (status, _) = h.post("/v1/chat/completions", bad).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Agents: Anthropic Messages, tool calls, structured output, reasoning
// ---------------------------------------------------------------------------------------------

/// `(event name, data)` of an Anthropic SSE body.
fn parse_named_sse(text: &str) -> Vec<(String, Value)> {
    text.split_terminator("\n\n")
        .map(|event| {
            let (name, data) = event.split_once('\n').expect("event and data lines");
            let name = name
                .strip_prefix("event: ")
                .expect("an event line")
                .to_owned();
            let data = data.strip_prefix("data: ").expect("a data line");
            (name, serde_json::from_str(data).unwrap())
        })
        .collect()
}

async fn raw_stream(h: &Harness, uri: &str, body: Value) -> String {
    let resp = h.request("POST", uri, Some(body.to_string())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": false}}})
}

#[tokio::test]
async fn anthropic_messages_whole_streamed_and_counted() {
    let h = Harness::new(4096).await;
    let body = json!({"model": "test-model", "max_tokens": 64, "system": "Be brief.",
                      "messages": [{"role": "user", "content": "Hi!"}]});
    let (status, v) = h.post("/v1/messages", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"], json!([{"type": "text", "text": CANNED}]));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["usage"]["output_tokens"], h.canned.len() + 1);
    let prompt = h.last_seen().prompt;

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = parse_named_sse(&raw_stream(&h, "/v1/messages", streamed).await);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..3],
        ["message_start", "ping", "content_block_start"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, CANNED);
    for (name, data) in &events {
        assert_eq!(&data["type"], name);
    }
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");

    let (status, v) = h
        .post(
            "/v1/messages/count_tokens",
            json!({"model": "test-model", "system": "Be brief.",
               "messages": [{"role": "user", "content": "Hi!"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["input_tokens"], prompt.len());

    // stop_sequences end the text and are reported.
    let mut stopped = body;
    stopped["stop_sequences"] = json!(["!"]);
    let (_, v) = h.post("/v1/messages", stopped).await;
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "!");
    assert_eq!(v["content"][0]["text"], "Hello there");
    h.stop().await;
}

#[tokio::test]
async fn anthropic_errors_are_in_anthropic_shape_and_name_the_field() {
    let h = Harness::new(4096).await;
    let cases = [
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]}),
            "messages[0].content[0].tool_use_id",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "w", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "v"}}),
            "tool_choice",
        ),
        (
            json!({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
            "max_tokens",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}]}),
            "max_tokens",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}),
            "output_config.format.schema",
        ),
    ];
    for (body, field) in cases {
        let (status, v) = h.post("/v1/messages", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {v}");
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{field} not in {message:?}");
    }
    h.stop().await;
}

#[tokio::test]
async fn tool_calls_in_the_output_become_structured_calls() {
    // The qwen3 fixture's template writes <tool_call> blocks (the Hermes format).
    let h = Harness::new(4096).await;
    let output = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    h.set_script(Script::Ids(h.tokenizer.encode(output, false).unwrap()));
    let (status, v) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"tools": [weather_tool()], "max_tokens": 64})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking.\n");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Oslo"})
    );
    // The tools reached the template.
    let prompt = h.tokenizer.decode(&h.last_seen().prompt, false).unwrap();
    assert!(prompt.contains("get_weather"), "{prompt}");

    let events = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"tools": [weather_tool()], "max_tokens": 64, "stream": true})),
        )
        .await;
    let deltas: Vec<&Value> = events
        .iter()
        .filter_map(|e| e.get("choices"))
        .filter_map(|c| c.get(0))
        .map(|c| &c["delta"])
        .collect();
    let calls: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).collect();
    assert_eq!(calls.len(), 1, "{events:?}");
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    assert_eq!(calls[0][0]["index"], 0);
    let finish = events.iter().rev().find_map(|e| {
        e["choices"]
            .get(0)
            .and_then(|c| c["finish_reason"].as_str())
    });
    assert_eq!(finish, Some("tool_calls"));

    // Anthropic: a tool_use block, streamed as input_json_delta.
    let body = json!({"max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": [{"name": "get_weather", "input_schema": weather_tool()["function"]["parameters"]}]});
    let (_, v) = h.post("/v1/messages", body.clone()).await;
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    assert_eq!(
        v["content"][0],
        json!({"type": "text", "text": "Checking.\n"})
    );
    assert_eq!(v["content"][1]["type"], "tool_use");
    assert_eq!(v["content"][1]["input"], json!({"city": "Oslo"}));
    assert!(v["content"][1]["id"]
        .as_str()
        .unwrap()
        .starts_with("toolu_"));
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = parse_named_sse(&raw_stream(&h, "/v1/messages", streamed).await);
    let json_delta = events
        .iter()
        .find(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .expect("an input_json_delta");
    assert_eq!(
        serde_json::from_str::<Value>(json_delta.1["delta"]["partial_json"].as_str().unwrap())
            .unwrap(),
        json!({"city": "Oslo"})
    );
    h.stop().await;
}

#[tokio::test]
async fn thinking_is_split_into_reasoning_content_and_thinking_blocks() {
    let h = Harness::new(4096).await;
    h.set_script(Script::Ids(
        h.tokenizer
            .encode("<think>\nTwo and two.\n</think>\n\nFour.", false)
            .unwrap(),
    ));
    let (_, v) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"chat_template_kwargs": {"enable_thinking": true}})),
        )
        .await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "\nTwo and two.\n");
    assert_eq!(message["content"], "Four.");
    let events = h
        .stream("/v1/chat/completions", chat(json!({"stream": true})))
        .await;
    let reasoning: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, "\nTwo and two.\n");
    let (_, v) = h.post("/v1/messages", json!({"max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 100},
                                                 "messages": [{"role": "user", "content": "2+2?"}]})).await;
    assert_eq!(v["content"][0]["type"], "thinking", "{v}");
    assert_eq!(v["content"][1], json!({"type": "text", "text": "Four."}));

    // enable_thinking = false reaches the template (Qwen3 then writes an empty think block).
    let _ = h
        .post(
            "/v1/chat/completions",
            chat(json!({"chat_template_kwargs": {"enable_thinking": false}})),
        )
        .await;
    let prompt = h.tokenizer.decode(&h.last_seen().prompt, false).unwrap();
    assert!(prompt.ends_with("<think>\n\n</think>\n\n"), "{prompt:?}");
    h.stop().await;
}

#[tokio::test]
async fn forced_calls_and_schemas_are_constrained_to_valid_json() {
    let h = Harness::new(4096).await;
    let person = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 3, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}},
        "required": ["name", "age", "tags"], "additionalProperties": false});
    let (status, v) = h.post("/v1/chat/completions", chat(json!({"max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": person, "strict": true}}}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let value: Value =
        serde_json::from_str(v["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    let age = value["age"].as_i64().unwrap();
    assert!((3..=9).contains(&age), "{value}");
    assert!(
        value["name"].as_str().unwrap().chars().count() <= 6,
        "{value}"
    );
    assert!(!value["tags"].as_array().unwrap().is_empty(), "{value}");

    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let (status, v) = h
            .post(
                "/v1/chat/completions",
                chat(json!({"max_tokens": 200, "tools": [weather_tool()], "tool_choice": choice})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert_eq!(
            c["message"]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        let args: Value = serde_json::from_str(
            c["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert!(args["city"].is_string(), "{args}");
    }

    let bad = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 3}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [weather_tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "1"}]}),
            "messages[1].tool_call_id",
        ),
    ];
    for (extra, param) in bad {
        let (status, v) = h.post("/v1/chat/completions", chat(extra.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {v}");
        assert!(
            v["error"]["param"]
                .as_str()
                .unwrap_or_default()
                .starts_with(param),
            "{extra}: {v}"
        );
    }
    h.stop().await;
}

#[tokio::test]
async fn n_choices_are_separate_sequences() {
    let h = Harness::new(4096).await;
    let (status, v) = h
        .post("/v1/chat/completions", chat(json!({"n": 3, "seed": 5})))
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], CANNED);
    }
    assert_eq!(v["usage"]["completion_tokens"], 3 * (h.canned.len() + 1));
    let seeds: Vec<Option<u64>> = h
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.sampling.seed)
        .collect();
    assert_eq!(seeds, vec![Some(5), Some(6), Some(7)]);
    let events = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}})),
        )
        .await;
    assert_eq!(events.last().unwrap(), &Value::from("[DONE]"));
    for i in 0..2 {
        let text: String = events
            .iter()
            .filter_map(|e| e["choices"].get(0))
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, CANNED);
    }
    assert_eq!(
        events[events.len() - 2]["usage"]["completion_tokens"],
        2 * (h.canned.len() + 1)
    );
    h.stop().await;
}

/// The bytes of a chat logprobs entry list, concatenated.
fn logprob_bytes(entries: &Value) -> Vec<u8> {
    entries
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test]
async fn chat_logprobs_whole_and_streamed() {
    let h = Harness::new(4096).await;
    let (status, v) = h
        .post(
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 2})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    let entries = &choice["logprobs"]["content"];
    let ids = ids_of(&choice["mlxd"]["token_ids"]);
    assert_eq!(entries.as_array().unwrap().len(), ids.len(), "{entries}");
    // The text the tokens spell (the emoji spans two byte-level tokens, so the bytes, not
    // the lossy token strings, add up), then the end-of-turn token's.
    let bytes = logprob_bytes(entries);
    assert!(
        bytes.starts_with(CANNED.as_bytes()),
        "{:?}",
        String::from_utf8_lossy(&bytes)
    );
    for (e, id) in entries.as_array().unwrap().iter().zip(&ids) {
        assert_eq!(e["logprob"], 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[1]["logprob"], -1.0);
        let first = h.tokenizer.token_bytes(*id);
        assert_eq!(top[0]["bytes"], json!(first));
    }
    // Without logprobs: null.
    let (_, v) = h.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);

    let events = h
        .stream(
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "stream": true})),
        )
        .await;
    let mut all = Vec::new();
    let mut count = 0;
    for e in &events[..events.len() - 1] {
        let c = &e["choices"][0];
        if let Some(entries) = c["logprobs"]["content"].as_array() {
            count += entries.len();
            for entry in entries {
                assert_eq!(entry["top_logprobs"], json!([]));
            }
            all.extend(logprob_bytes(&c["logprobs"]["content"]));
        }
    }
    assert_eq!(count, h.canned.len() + 1);
    assert!(all.starts_with(CANNED.as_bytes()));

    for (body, field) in [
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"logprobs": true, "top_logprobs": -1}),
            "top_logprobs",
        ),
    ] {
        let (status, v) = h.post("/v1/chat/completions", chat(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    h.stop().await;
}

#[tokio::test]
async fn completions_n_choices_and_logprobs() {
    let h = Harness::new(4096).await;
    let (status, v) = h
        .post(
            "/v1/completions",
            json!({"prompt": "Once", "n": 2, "logprobs": 3, "seed": 9}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert!(c["text"].as_str().unwrap().starts_with(CANNED), "{c}");
        let lp = &c["logprobs"];
        let n = ids_of(&c["mlxd"]["token_ids"]).len();
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
        let offsets: Vec<u64> = lp["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        // Three alternatives, keyed by their text.
        assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3, "{lp}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 2 * (h.canned.len() + 1));
    let seeds: Vec<Option<u64>> = h
        .seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.sampling.seed)
        .collect();
    assert_eq!(seeds, vec![Some(9), Some(10)]);

    let events = h
        .stream(
            "/v1/completions",
            json!({"prompt": "Once", "n": 2, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    for i in 0..2 {
        let text: String = events
            .iter()
            .filter_map(|e| e["choices"].get(0))
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert!(text.starts_with(CANNED), "{text:?}");
    }
    assert_eq!(
        events[events.len() - 2]["usage"]["completion_tokens"],
        2 * (h.canned.len() + 1)
    );

    for body in [
        json!({"prompt": "x", "logprobs": 21}),
        json!({"prompt": "x", "logprobs": -2}),
    ] {
        let (status, v) = h.post("/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], "logprobs", "{v}");
    }
    let (status, v) = h
        .post("/v1/completions", json!({"prompt": "x", "n": 9}))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "n");
    h.stop().await;
}
