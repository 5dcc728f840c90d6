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

/// Issue 23, finding 8: HTTP hygiene. Two `Host` headers are a 400 (RFC 9112 §3.2); a
/// `/v1/jobs` body announced at 1 GB is a 413 at once, as on the chat routes, instead of a
/// 408 after the body timeout; a large POST to a route no engine serves is a 404 at once,
/// and none of these wakes the engine.
#[tokio::test]
async fn bad_hosts_huge_job_bodies_and_unknown_routes_are_refused_at_once() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.body_timeout_ms = 20_000).await?;
    let wait = Duration::from_secs(10);
    let two_hosts = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\
Connection: close\r\n\r\n";
    let resp = stall(p.addr, two_hosts, wait).await?;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(
        body_json(&resp)["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("Host"),
        "{resp}"
    );

    let t = Instant::now();
    let huge_job = b"POST /v1/jobs HTTP/1.1\r\nHost: localhost\r\n\
Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{";
    let resp = stall(p.addr, huge_job, wait).await?;
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

    for (path, ct) in [
        ("/v1/unknown", "text/plain"),
        ("/upload", "application/octet-stream"),
        ("/v1/chat/completions/x", "text/plain"),
    ] {
        let t = Instant::now();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {ct}\r\n\
Content-Length: 50000000\r\n\r\nxxxx"
        );
        let resp = stall(p.addr, head.as_bytes(), wait).await?;
        assert!(resp.starts_with("HTTP/1.1 404"), "{path}: {resp}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            body_json(&resp)["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(path),
            "{resp}"
        );
    }
    let e = p.engine().await?;
    assert_eq!(e["state"], "idle", "nothing woke the engine: {e}");
    assert!(e["pid"].is_null(), "{e}");
    p.stop().await?;
    Ok(())
}

/// One slow client: connects from `ip` and sends a request head one byte at a time.
async fn dribbler(ip: std::net::Ipv4Addr, addr: std::net::SocketAddr) -> Option<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().ok()?;
    socket.bind((ip, 0).into()).ok()?;
    let mut s = socket.connect(addr).await.ok()?;
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHo").await.ok()?;
    Some(s)
}

/// Issue 23, finding 3: 1 030 connections sending headers at 1 byte/s filled the connection
/// cap and held `/health/live` for 29.5 s (p99). With a low cap, 600 slow connections from
/// 30 addresses (the prober's among them), which reconnect when closed and each send a
/// byte every 200 ms, do not slow `/health/live` past a fraction of a second, nor stop a
/// chat request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_over_the_cap_does_not_hold_health() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| {
        c.server.max_connections = Some(64);
        c.server.header_timeout_ms = 60_000;
    })
    .await?;
    let addr = p.addr;
    let attack = tokio::spawn(async move {
        let ips: Vec<std::net::Ipv4Addr> = (1..=30).map(|i| [127, 0, 0, i].into()).collect();
        let mut conns: Vec<(std::net::Ipv4Addr, Option<TcpStream>)> = Vec::new();
        for i in 0..600 {
            let ip = ips[i % ips.len()];
            conns.push((ip, dribbler(ip, addr).await));
        }
        loop {
            for (ip, conn) in conns.iter_mut() {
                let alive = match conn {
                    Some(s) => s.write_all(b"s").await.is_ok(),
                    None => false,
                };
                if !alive {
                    *conn = dribbler(*ip, addr).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    // Let the attack fill the cap and the reserve.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut latencies = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let resp = tokio::time::timeout(
            Duration::from_secs(10),
            send(addr, "GET", "/health/live", None),
        )
        .await??;
        assert_eq!(resp.status(), 200);
        latencies.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    latencies.sort();
    let worst = *latencies.last().unwrap();
    assert!(worst < Duration::from_millis(500), "{latencies:?}");
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]});
    let (s, _, v) = tokio::time::timeout(
        Duration::from_secs(20),
        post_json(addr, "/v1/chat/completions", &body),
    )
    .await??;
    assert_eq!(s, 200, "{v}");
    eprintln!(
        "health/live under a 600-connection slowloris: median {:?}, worst {worst:?}",
        latencies[latencies.len() / 2]
    );
    attack.abort();
    p.stop().await?;
    Ok(())
}

/// POSTs `body` exactly as written (field order kept) and reads the JSON answer.
async fn post_raw(p: &Proxy, path: &str, body: &str) -> Result<(u16, Value)> {
    let (s, _, v) =
        json_of(send(p.addr, "POST", path, Some(body.to_owned().into())).await?).await?;
    Ok((s.as_u16(), v))
}

/// Issues 22 and 23.1: with both token fields, `max_completion_tokens` is the request's limit
/// (as OpenAI and the engine read it), whichever comes first in the body. The proxy used to
/// read `max_tokens` first: `1` passed the limit and the engine generated up to 400.
#[tokio::test]
async fn both_token_fields_are_judged_by_max_completion_tokens_in_either_order() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.max_tokens_limit = Some(8)).await?;
    for body in [
        r#"{"model": "fake-model", "messages": [], "max_tokens": 1, "max_completion_tokens": 400}"#,
        r#"{"model": "fake-model", "messages": [], "max_completion_tokens": 400, "max_tokens": 1}"#,
    ] {
        let (s, v) = post_raw(&p, "/v1/chat/completions", body).await?;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], "max_tokens_exceeded", "{v}");
        assert_eq!(v["error"]["param"], "max_completion_tokens", "{v}");
        assert_eq!(
            v["error"]["message"],
            "max_completion_tokens 400 exceeds the limit of 8 (server.max_tokens_limit)"
        );
    }
    assert_eq!(
        p.engine().await?["state"],
        "idle",
        "refused before any engine woke"
    );
    for body in [
        r#"{"model": "fake-model", "messages": [], "max_tokens": 400, "max_completion_tokens": 1}"#,
        r#"{"model": "fake-model", "messages": [], "max_completion_tokens": 1, "max_tokens": 400}"#,
    ] {
        let (s, v) = post_raw(&p, "/v1/chat/completions", body).await?;
        assert_eq!(s, 200, "{body}: {v}");
    }
    // A bad value is refused as the engine refuses it: the field and the rule.
    let (s, v) = post_raw(
        &p,
        "/v1/completions",
        r#"{"prompt": "p", "max_tokens": 5, "max_completion_tokens": 0}"#,
    )
    .await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_completion_tokens");
    assert_eq!(
        v["error"]["message"],
        "max_completion_tokens must be at least 1, got 0"
    );
    // Anthropic's route: its required `max_tokens`, in its error shape.
    let (s, v) = post_raw(&p, "/v1/messages", r#"{"messages": [], "max_tokens": 9}"#).await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["type"], "error");
    assert_eq!(
        v["error"]["message"],
        "max_tokens 9 exceeds the limit of 8 (server.max_tokens_limit)"
    );
    let (s, v) = post_raw(&p, "/v1/messages", r#"{"messages": []}"#).await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["message"], "`max_tokens` is required");
    p.stop().await?;
    Ok(())
}

/// Issue 23.1: the KV pre-check admits on the effective limit: `max_completion_tokens` over
/// `max_tokens`, and `max_tokens_limit` for a request without either (the engine reserves
/// the prompt plus that many tokens). It used to count `max_tokens`, or nothing.
#[tokio::test]
async fn the_kv_pre_check_counts_the_effective_token_limit() -> Result<()> {
    // The fake engine's KV is 10 bytes a token: 1000 bytes hold a 1-token prompt and 99 more.
    let mut p = Proxy::start_with(&[], |c| {
        c.server.limits.kv_budget_bytes = Some(1000);
        c.server.max_tokens_limit = Some(500);
    })
    .await?;
    let (s, v) = post_raw(
        &p,
        "/v1/chat/completions",
        r#"{"messages": [], "max_tokens": 5}"#,
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    for body in [
        r#"{"messages": [], "max_tokens": 1, "max_completion_tokens": 300}"#,
        r#"{"messages": []}"#,
    ] {
        let (s, v) = post_raw(&p, "/v1/chat/completions", body).await?;
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["error"]["code"], "kv_budget_exceeded", "{v}");
    }
    let (s, v) = post_raw(
        &p,
        "/v1/chat/completions",
        r#"{"messages": [], "max_completion_tokens": 99}"#,
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    p.stop().await?;
    Ok(())
}

/// Issue 23.1 with the real engine: a request without a token field gets at most
/// `max_tokens_limit` tokens (it used to run to the end of the context), on the chat and
/// completions routes, whole and streamed; Anthropic's route keeps its own `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_token_field_gets_at_most_the_limit() -> Result<()> {
    let mut p = default_model_proxy(&[("prompt_cache", "0")], |c| {
        c.server.max_tokens_limit = Some(3)
    })
    .await?;
    let ask = json!([{"role": "user", "content": "Count from 1 to 100, separated by commas."}]);
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &json!({"messages": ask}))
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "1, 2, 3, 4, 5,"}))
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    let resp = send(
        p.addr,
        "POST",
        "/v1/chat/completions",
        Some(
            json!({"messages": ask, "stream": true, "stream_options": {"include_usage": true}})
                .to_string()
                .into(),
        ),
    )
    .await?;
    let events = read_events(resp).await?;
    let usage = events
        .iter()
        .filter_map(|(_, e)| event_json(e))
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned());
    assert_eq!(
        usage.map(|u| u["completion_tokens"].clone()),
        Some(json!(3))
    );
    let (s, _, v) = p
        .post_json("/v1/messages", &json!({"messages": ask, "max_tokens": 2}))
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["output_tokens"], 2, "{v}");
    assert_eq!(v["stop_reason"], "max_tokens", "{v}");
    p.stop().await?;
    Ok(())
}

/// Opens a connection from `ip` and sends `request` whole.
async fn connect_from(
    ip: [u8; 4],
    addr: std::net::SocketAddr,
    request: &[u8],
) -> Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind((std::net::Ipv4Addr::from(ip), 0).into())?;
    let mut s = socket.connect(addr).await?;
    s.write_all(request).await?;
    Ok(s)
}

/// Issue 23, finding 3: one client holds at most `max_connections_per_client` connections;
/// past it, with all of its connections busy, a new one is closed at once, while other
/// clients are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_holds_at_most_its_share_of_connections() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| {
        c.server.max_connections = Some(16);
        c.server.max_connections_per_client = Some(2);
    })
    .await?;
    let body = json!({"model": "fake-model", "stream": true, "messages": [],
        "fake": {"chunks": 100, "interval_ms": 100}})
    .to_string();
    let slow = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from([127, 0, 0, 7], p.addr, slow.as_bytes()).await?;
        let mut first = [0u8; 12];
        s.read_exact(&mut first).await?;
        assert_eq!(&first, b"HTTP/1.1 200");
        busy.push(s);
    }
    let get = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let mut third = connect_from([127, 0, 0, 7], p.addr, get).await?;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut out)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "closed without an answer: {read:?} {:?}",
        String::from_utf8_lossy(&out)
    );
    let mut other = connect_from([127, 0, 0, 8], p.addr, get).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), other.read_to_end(&mut out)).await??;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    drop(busy);
    p.stop().await?;
    Ok(())
}
