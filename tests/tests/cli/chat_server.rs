//! A stand-in OpenAI server for the `mlxd run` tests: it records every chat request's body and
//! streams `tok0 tok1 …` with a usage chunk (10 prompt tokens, 4 of them cached), 3 pieces
//! fast, or 400 slowly when the last message says "slow"; at most `max_tokens` pieces, with
//! `finish_reason: "length"` then. A model named `absent` is a 404, as mlxd answers it. It
//! notices a client that leaves mid-stream.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

#[derive(Default)]
struct Seen {
    requests: Mutex<Vec<Value>>,
    left: Mutex<usize>,
    changed: Notify,
}

pub struct ChatServer {
    pub url: String,
    seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ChatServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ChatServer {
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let seen = Arc::new(Seen::default());
        let s = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let s = s.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| handle(s.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Self { url, seen, task })
    }

    /// The chat requests' bodies so far, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.seen.requests.lock().unwrap().clone()
    }

    /// Waits until `n` chat requests have come.
    pub async fn wait_requests(&self, n: usize, limit: Duration) -> Result<()> {
        self.wait(limit, || self.seen.requests.lock().unwrap().len() >= n)
            .await
            .with_context(|| format!("{n} requests expected: {:?}", self.requests()))
    }

    /// Waits until a client has left a stream before its end.
    pub async fn wait_left(&self, limit: Duration) -> Result<()> {
        self.wait(limit, || *self.seen.left.lock().unwrap() >= 1)
            .await
            .context("no stream was left before its end")
    }

    async fn wait(&self, limit: Duration, done: impl Fn() -> bool) -> Result<()> {
        tokio::time::timeout(limit, async {
            loop {
                let changed = self.seen.changed.notified();
                if done() {
                    return;
                }
                changed.await;
            }
        })
        .await
        .map_err(|_| anyhow::anyhow!("timed out after {limit:?}"))
    }
}

fn json_response(status: u16, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed())
        .expect("static response parts")
}

async fn handle(seen: Arc<Seen>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if req.uri().path() == "/v1/models" {
        return Ok(json_response(
            200,
            &json!({"object": "list", "data": [{"id": "chat-model", "object": "model", "created": 0, "owned_by": "test", "default": true}]}),
        ));
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(json_response(400, &json!({"error": {"message": "body"}}))),
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if v["model"] == "absent" {
        return Ok(json_response(
            404,
            &json!({"error": {"message": "model \"absent\" not found", "type": "not_found_error"}}),
        ));
    }
    seen.requests.lock().unwrap().push(v.clone());
    seen.changed.notify_waiters();
    let last = v["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let (pieces, interval) = if last.contains("slow") {
        (400, Duration::from_millis(50))
    } else {
        (3, Duration::ZERO)
    };
    let max = v["max_tokens"].as_u64().unwrap_or(u64::MAX);
    let n = pieces.min(max);
    let finish = if n < pieces { "length" } else { "stop" };
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let chunk = |delta: Value, finish: Value| {
            let c = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "chat-model",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
            Bytes::from(format!("data: {c}\n\n"))
        };
        let mut events = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        for i in 0..n {
            let f = if i + 1 == n {
                json!(finish)
            } else {
                Value::Null
            };
            events.push(chunk(json!({"content": format!("tok{i} ")}), f));
        }
        let usage = json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "chat-model", "choices": [],
                           "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
                                     "prompt_tokens_details": {"cached_tokens": 4}}});
        events.push(Bytes::from(format!("data: {usage}\n\n")));
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        for e in events {
            if tx.send(e).await.is_err() {
                *seen.left.lock().unwrap() += 1;
                seen.changed.notify_waiters();
                return;
            }
            if !interval.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = tx.closed() => {
                        *seen.left.lock().unwrap() += 1;
                        seen.changed.notify_waiters();
                        return;
                    }
                }
            }
        }
    });
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(ChannelBody(rx)))
        .expect("static response parts"))
}

/// A response body fed by a channel; dropping it (the client left) closes the channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}
