//! The HTTP transport against a scripted TCP server (no engine, no MLX): requests are never
//! retried, error bodies come back typed with `Retry-After`, the API key is sent, a stream
//! cut short or failing mid-way ends with an error, and timeouts fire.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use mlxd_client::{
    ChatCompletionRequest, ChatMessage, Client, ClientError, CompletionClient, ErrorType, Role,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn request() -> ChatCompletionRequest {
    ChatCompletionRequest {
        messages: vec![ChatMessage::new(Role::User, "hi")],
        ..Default::default()
    }
}

/// Reads one request head and its `Content-Length` body; returns the head.
async fn read_request(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.unwrap_or(0) == 0 {
            return String::from_utf8_lossy(&buf).into_owned();
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let len = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    let _ = s.read_exact(&mut body).await;
    head
}

/// A server that answers every request with `respond(head)` (raw HTTP bytes; `None`: close
/// without answering). Counts the requests it read.
async fn server(
    respond: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let respond = Arc::new(respond);
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (respond, seen) = (respond.clone(), seen.clone());
            tokio::spawn(async move {
                let head = read_request(&mut s).await;
                if head.is_empty() {
                    return;
                }
                seen.fetch_add(1, Ordering::SeqCst);
                match respond(&head) {
                    Some(answer) => {
                        let _ = s.write_all(answer.as_bytes()).await;
                        let _ = s.shutdown().await;
                    }
                    None => drop(s),
                }
            });
        }
    });
    (url, count)
}

fn http(status: &str, headers: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\n{headers}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn a_post_the_server_dropped_is_not_sent_again() {
    let (url, count) = server(|_| None).await;
    let client = Client::builder().http(&url).unwrap();
    let err = client.complete(request()).await.unwrap_err();
    assert!(matches!(err, ClientError::Transport { .. }), "{err:?}");
    // No waiting: the server counts a request before it drops the connection, and the client
    // sees the drop only after that, so every attempt the call made is already counted.
    assert_eq!(count.load(Ordering::SeqCst), 1, "the POST was sent again");
}

#[tokio::test]
async fn an_error_status_carries_the_body_type_and_retry_after() {
    let body = r#"{"error":{"message":"model m is starting","type":"engine_unavailable","param":null,"code":"starting"}}"#;
    let (url, _) = server(move |head| {
        assert!(
            head.to_ascii_lowercase()
                .contains("authorization: bearer k1"),
            "{head}"
        );
        Some(http(
            "503 Service Unavailable",
            "retry-after: 3\r\ncontent-type: application/json\r\n",
            body,
        ))
    })
    .await;
    let client = Client::builder().api_key("k1").http(&url).unwrap();
    match client.complete(request()).await {
        Err(e @ ClientError::Api { .. }) => {
            assert_eq!(e.status(), Some(503));
            assert_eq!(e.error_type(), Some(ErrorType::EngineUnavailable));
            let ClientError::Api {
                body, retry_after, ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(body.error.code.as_deref(), Some("starting"));
            assert_eq!(retry_after, Some(Duration::from_secs(3)));
        }
        other => panic!("{other:?}"),
    }
    // Not an error body: the text is kept.
    let (url, _) = server(|_| Some(http("502 Bad Gateway", "", "upstream fell over"))).await;
    let client = Client::builder().http(&url).unwrap();
    match client.complete(request()).await {
        Err(ClientError::UnexpectedStatus { status, body }) => {
            assert_eq!((status, body.as_str()), (502, "upstream fell over"))
        }
        other => panic!("{other:?}"),
    }
}

const CHUNK: &str = r#"data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}"#;

fn sse(events: &[&str]) -> String {
    let body: String = events.iter().map(|e| format!("{e}\n\n")).collect();
    format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n{body}")
}

#[tokio::test]
async fn a_stream_cut_short_or_failing_ends_with_an_error() {
    async fn collect(url: &str) -> Vec<Result<String, String>> {
        let client = Client::builder().http(url).unwrap();
        let mut chunks = client.stream(request()).await.unwrap();
        let mut out = Vec::new();
        while let Some(c) = chunks.next().await {
            out.push(
                c.map(|c| c.choices[0].delta.content.clone().unwrap_or_default())
                    .map_err(|e| format!("{e:?}")),
            );
        }
        out
    }
    let (url, _) = server(|_| Some(sse(&[CHUNK, CHUNK, "data: [DONE]"]))).await;
    assert_eq!(collect(&url).await, vec![Ok("hi".into()), Ok("hi".into())]);

    let (url, _) = server(|_| Some(sse(&[CHUNK]))).await;
    let got = collect(&url).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        got[1].as_ref().unwrap_err().contains("Truncated"),
        "{got:?}"
    );

    let error = r#"data: {"error":{"message":"engine died","type":"engine_crashed","param":null,"code":null}}"#;
    let (url, _) = server(move |_| Some(sse(&[CHUNK, error, "data: [DONE]"]))).await;
    let got = collect(&url).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        got[1].as_ref().unwrap_err().contains("engine_crashed"),
        "{got:?}"
    );
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let client = Client::builder()
        .timeout(Duration::from_millis(200))
        .http(&url)
        .unwrap();
    let err = client.complete(request()).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
}

#[test]
fn bad_configuration_is_refused_with_the_reason() {
    for (url, needle) in [
        ("https://h:1", "scheme https"),
        ("127.0.0.1:8080", "scheme"),
        ("http://h:1/?a=b", "query"),
    ] {
        match Client::builder().http(url) {
            Err(ClientError::Config(m)) => assert!(m.contains(needle), "{url}: {m}"),
            other => panic!("{url}: {:?}", other.err()),
        }
    }
    assert!(matches!(
        Client::builder().api_key("k").unix("/tmp/x.sock"),
        Err(ClientError::Config(_))
    ));
}
