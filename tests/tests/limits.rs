//! Limits and timeouts: stalled clients, connection caps, per-model queues, max_tokens.

use std::time::{Duration, Instant};

use anyhow::Result;
use mlxd_tests::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `head` + `partial` and reads until the server answers or closes (bounded).
async fn stall(addr: std::net::SocketAddr, bytes: &[u8], wait: Duration) -> Result<String> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(bytes).await?;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn body_json(resp: &str) -> Value {
    let body = resp.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or(Value::Null)
}

const HALF_BODY: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n\
Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":";

/// Issue 12, finding 3: a client that sent half a body kept its connection forever.
#[tokio::test]
async fn a_stalled_body_gets_408_in_the_routes_shape() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.body_timeout_ms = 300).await?;
    let t = Instant::now();
    let resp = stall(p.addr, HALF_BODY, Duration::from_secs(10)).await?;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(t.elapsed() < Duration::from_secs(9));
    let v = body_json(&resp);
    assert_eq!(v["error"]["code"], "request_timeout", "{resp}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("300 ms"),
        "{v}"
    );

    let messages = b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\n\
Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{";
    let resp = stall(p.addr, messages, Duration::from_secs(10)).await?;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    let v = body_json(&resp);
    assert_eq!(v["type"], "error", "{resp}");
    assert_eq!(v["error"]["type"], "timeout_error");
    // Nothing woke the engine.
    assert_eq!(p.engine().await?["state"], "idle");
    p.stop().await?;
    Ok(())
}

/// A client that stops halfway through its request headers gets a 408 naming the limit (hyper
/// alone closes the connection without a word); one that sends nothing at all gets it too;
/// an idle keep-alive connection after a complete exchange is closed without one.
#[tokio::test]
async fn stalled_headers_get_408_and_idle_keep_alive_closes_quietly() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.header_timeout_ms = 500).await?;
    let wait = Duration::from_secs(30);
    let resp = stall(
        p.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: loc",
        wait,
    )
    .await?;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp:?}");
    let v = body_json(&resp);
    assert_eq!(v["error"]["code"], "request_timeout", "{resp}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{resp}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("500 ms") && message.contains("header_timeout_ms"),
        "{v}"
    );

    let resp = stall(p.addr, b"", wait).await?;
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp:?}");

    let resp = stall(
        p.addr,
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
        wait,
    )
    .await?;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp:?}");
    // (The status line, not the digits: the body holds a pid and an uptime.)
    assert!(
        !resp.contains("HTTP/1.1 408"),
        "an idle keep-alive got a 408: {resp:?}"
    );
    p.stop().await?;
    Ok(())
}

/// 500 clients that stall mid-headers or mid-body do not stop `/health` or chat.
#[tokio::test]
async fn five_hundred_stalled_clients_do_not_stop_health_or_chat() -> Result<()> {
    let m =
        MlxdProcess::start(&["--body-timeout-ms", "60000", "--header-timeout-ms", "60000"]).await?;
    let mut stalled = Vec::new();
    for i in 0..500 {
        let mut s = TcpStream::connect(m.addr).await?;
        let bytes: &[u8] = if i % 2 == 0 {
            HALF_BODY
        } else {
            b"GET /v1/models HTTP/1.1\r\nHost: loc"
        };
        s.write_all(bytes).await?;
        stalled.push(s);
    }
    let t = Instant::now();
    let (s, _, v) = json_of(send(m.addr, "GET", "/health", None).await?).await?;
    assert_eq!(s, 200, "{v}");
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]});
    let (s, _, _) = post_json(m.addr, "/v1/chat/completions", &body).await?;
    assert_eq!(s, 200);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    drop(stalled);
    Ok(())
}

/// At the descriptor limit, mlxd backs off instead of logging an accept error every 50 ms,
/// and serves again once clients leave.
#[tokio::test]
async fn out_of_file_descriptors_backs_off_quietly_and_recovers() -> Result<()> {
    let m = MlxdProcess::start_limited(
        &["--max-connections", "1000", "--header-timeout-ms", "60000"],
        Some(64),
    )
    .await?;
    let mut clients = Vec::new();
    for _ in 0..120 {
        match TcpStream::connect(m.addr).await {
            Ok(s) => clients.push(s),
            Err(_) => break,
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = m.stderr();
    let lines = log.lines().filter(|l| l.contains("accept failed")).count();
    assert!(
        lines >= 1,
        "expected the descriptor limit to be hit:\n{log}"
    );
    assert!(lines <= 3, "{lines} accept-error lines in 3 s:\n{log}");
    drop(clients);
    let t = Instant::now();
    loop {
        if let Ok(r) = send(m.addr, "GET", "/health/live", None).await {
            if r.status() == 200 {
                break;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "mlxd did not recover:\n{}",
            m.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_full_model_queue_gives_429_with_retry_after() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.max_in_flight_per_model = 2).await?;
    let slow = json!({"model": "fake-model", "stream": true, "messages": [], "fake": {"chunks": 30, "interval_ms": 100}});
    let mut streams = Vec::new();
    for _ in 0..2 {
        let resp = send(
            p.addr,
            "POST",
            "/v1/chat/completions",
            Some(slow.to_string().into()),
        )
        .await?;
        assert_eq!(resp.status(), 200);
        streams.push(resp);
    }
    let (s, h, v) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "fake-model", "messages": []}),
        )
        .await?;
    assert_eq!(s, 429, "{v}");
    assert!(h["retry-after"].to_str()?.parse::<u64>()? >= 1);
    assert_eq!(v["error"]["code"], "too_many_requests");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 requests in flight"),
        "{v}"
    );
    drop(streams);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn max_tokens_above_the_ceiling_is_400_naming_the_limit() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.max_tokens_limit = Some(100)).await?;
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "fake-model", "messages": [], "max_tokens": 101}),
        )
        .await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "max_tokens_exceeded");
    assert_eq!(
        v["error"]["message"],
        "max_tokens 101 exceeds the limit of 100 (server.max_tokens_limit)"
    );
    assert_eq!(
        p.engine().await?["state"],
        "idle",
        "refused without waking the engine"
    );
    let (s, _, _) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "fake-model", "messages": [], "max_completion_tokens": 100}),
        )
        .await?;
    assert_eq!(s, 200);
    p.stop().await?;
    Ok(())
}
