//! Proxy behaviour with real processes and sockets: the in-process `serve` with the
//! fake engine as its child.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use anyhow::Result;
use mlxd_tests::*;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

#[path = "proxy/ollama.rs"]
mod ollama;

fn chat(fake: Value, stream: bool) -> Value {
    json!({"model": "fake-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}], "fake": fake})
}

async fn stream_events(p: &Proxy, fake: Value) -> Result<Vec<(Instant, String)>> {
    let body = chat(fake, true).to_string();
    let resp = send(p.addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    read_events(resp).await
}

#[tokio::test]
async fn sse_chunks_pass_through_as_they_arrive() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let t0 = Instant::now();
    let events = stream_events(&p, json!({"chunks": 5, "interval_ms": 300})).await?;
    assert_eq!(events.len(), 6, "{events:?}");
    assert_eq!(events[5].1, "data: [DONE]\n\n");
    for (i, (_, ev)) in events[..5].iter().enumerate() {
        let v = event_json(ev).unwrap();
        assert_eq!(v["seq"], i);
        assert_eq!(v["choices"][0]["delta"]["content"], format!("tok{i} "));
    }
    // The engine sends the five 300 ms apart: buffered, they would arrive together. On a
    // loaded machine one chunk may arrive late and the next on time, so only the spread from
    // the first to the last (1 200 ms when sent) is asserted, at half of it.
    let spread = events[4].0 - events[0].0;
    assert!(
        spread >= Duration::from_millis(600),
        "chunks coalesced: first to last {spread:?}"
    );
    assert!(events[0].0 > t0);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn non_streaming_models_health_engines() -> Result<()> {
    let mut p = Proxy::start(&[("memory_bytes", "4242")]).await?;
    // On demand: nothing runs before the first request.
    let e = p.engine().await?;
    assert_eq!(e["state"], "idle");
    assert!(e["pid"].is_null());

    let (s, _, v) = p
        .post_json(
            "/v1/completions",
            &json!({"prompt": "x", "fake": {"chunks": 3}}),
        )
        .await?;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 ");
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat(json!({"chunks": 2}), false))
        .await?;
    assert_eq!(s, 200);
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 ");

    let (s, _, v) = p.get("/v1/models").await?;
    assert_eq!(s, 200);
    assert_eq!(v["data"][0]["id"], "fake-model");
    assert_eq!(v["data"][0]["state"], "loaded");

    let (s, _, v) = p.get("/health").await?;
    assert_eq!(s, 200);
    assert_eq!(v["status"], "ok");
    assert_eq!(v["engines"][0]["state"], "ready");
    assert_eq!(v["engines"][0]["responding"], true);

    let e = p
        .wait_engine("reporting stats", T, |e| e["stats"]["memory_bytes"] == 4242)
        .await?;
    assert!(e["pid"].as_u64().unwrap() > 0);
    assert_eq!(e["restarts"], 0);
    assert!(e["uptime_s"].as_f64().unwrap() >= 0.0);
    assert_eq!(e["ready"]["context_length"], 2048);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn runtime_dir_and_socket_are_private_and_stale_socket_is_replaced() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let rt = dir.path().join("rt");
    std::fs::create_dir(&rt)?;
    std::fs::set_permissions(&rt, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(rt.join("engine-0.sock"), b"stale")?;
    let mut p = Proxy::start_with(&[], |c| c.server.runtime_dir = Some(rt.clone())).await?;
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200);
    assert_eq!(std::fs::metadata(&rt)?.permissions().mode() & 0o777, 0o700);
    let sock = std::fs::metadata(rt.join("engine-0.sock"))?;
    assert_eq!(sock.permissions().mode() & 0o777, 0o600);
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&sock.file_type()));
    p.stop().await?;
    Ok(())
}

/// Hop-by-hop headers stay with the proxy; the rest reach the engine.
#[tokio::test]
async fn hop_by_hop_headers_are_stripped() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let req =
        "GET /v1/models/headers HTTP/1.1\r\nHost: localhost\r\nConnection: close, x-drop-me\r\nX-Drop-Me: 1\r\n\
               Keep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: secret\r\n\
               Authorization: Bearer ok\r\nX-Custom: kept\r\n\r\n";
    let out = String::from_utf8(raw_exchange(p.addr, req.as_bytes(), false).await?)?;
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let v: Value = serde_json::from_str(body)?;
    assert_eq!(v["authorization"], "Bearer ok");
    assert_eq!(v["x-custom"], "kept");
    for h in ["x-drop-me", "keep-alive", "te", "proxy-authorization"] {
        assert!(v.get(h).is_none(), "{h} forwarded: {v}");
    }
    assert_eq!(v["host"], "localhost");
    assert!(v["x-request-id"].is_string());
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn client_disconnect_cancels_the_generation() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let body = chat(
        json!({"chunks": 100, "interval_ms": 50, "id": "gone"}),
        true,
    )
    .to_string();
    let resp = send(p.addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
    let mut b = resp.into_body();
    let first = http_body_util::BodyExt::frame(&mut b).await.unwrap()?;
    assert!(first.data_ref().is_some());
    drop(b); // closes the client connection
    let line = wait_event(&p.events_file(), "gone", Duration::from_secs(5)).await?;
    assert!(line.contains("cancelled gone"), "{line}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn requests_wait_while_the_engine_loads() -> Result<()> {
    // Long enough that the `starting` state is seen even on a loaded machine.
    let mut p = Proxy::start(&[("ready_delay_ms", "2000")]).await?;
    let t = Instant::now();
    let req = tokio::spawn({
        let addr = p.addr;
        async move {
            let body = json!({"prompt": "x"}).to_string();
            json_of(send(addr, "POST", "/v1/completions", Some(body.into())).await?).await
        }
    });
    let e = p
        .wait_engine("starting", T, |e| e["state"] == "starting")
        .await?;
    assert!(e["pid"].as_u64().is_some());
    let (s, _, _) = req.await??;
    assert_eq!(s, 200);
    assert!(t.elapsed() >= Duration::from_millis(1900));
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn queue_timeout_gives_503_and_queue_full_429_with_retry_after() -> Result<()> {
    // Model b waits for room (one engine, held by a busy fake-model) longer than the queue
    // timeout; the capacity wait (20 s) would answer later. The first request must still be
    // queued when the second arrives (3 s is ample on a loaded machine). A load in progress
    // is waited for past the queue timeout instead (`appliance.rs`).
    let mut p = Proxy::start_with(&[], |c| {
        c.server.queue_timeout_ms = 3000;
        c.server.queue_capacity = 1;
        c.pool.max_engines = 1;
        c.models.push(mlxd_proxy::config::ModelConfig::new("b"));
    })
    .await?;
    let busy = send(
        p.addr,
        "POST",
        "/v1/chat/completions",
        Some(
            chat(json!({"chunks": 100, "interval_ms": 100}), true)
                .to_string()
                .into(),
        ),
    )
    .await?;
    assert_eq!(busy.status(), 200);
    let waiting = tokio::spawn({
        let addr = p.addr;
        async move {
            let body = json!({"model": "b", "prompt": "x"}).to_string();
            json_of(send(addr, "POST", "/v1/completions", Some(body.into())).await?).await
        }
    });
    let deadline = Instant::now() + T;
    loop {
        let (_, _, e) = p.get("/engines").await?;
        let b = e["engines"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["model"] == "b").cloned());
        if b.is_some_and(|b| b["queued_requests"] == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "b never queued: {e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Queue of one is full: 429.
    let (s, h, v) = p
        .post_json("/v1/completions", &json!({"model": "b", "prompt": "y"}))
        .await?;
    assert_eq!(s, 429);
    assert!(h.contains_key("retry-after"));
    assert_eq!(v["error"]["code"], "queue_full");
    // The queued one times out.
    let (s, h, v) = waiting.await??;
    assert_eq!(s, 503);
    assert!(h["retry-after"].to_str()?.parse::<u64>()? >= 1);
    assert_eq!(v["error"]["type"], "engine_unavailable");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("waiting for room"),
        "{v}"
    );
    drop(busy);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn crash_mid_stream_sends_an_error_event_then_the_engine_comes_back() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let events = stream_events(
        &p,
        json!({"chunks": 10, "interval_ms": 20, "then": "abort", "at": 3}),
    )
    .await?;
    assert_eq!(events.len(), 4, "{events:?}");
    let err = event_json(&events[3].1).expect("error event is JSON");
    assert_eq!(err["error"]["type"], "engine_crashed");
    assert_eq!(err["error"]["code"], "crash");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("SIGABRT"),
        "{err}"
    );
    assert!(!events.iter().any(|(_, e)| e.contains("[DONE]")));

    // The next request waits for the restart and succeeds.
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200);
    let e = p.engine().await?;
    assert_eq!(e["restarts"], 1);
    assert_eq!(e["generation"], 2);
    assert_eq!(e["last_exit"]["code"], "crash");
    assert!(!e["last_exit"]["stderr_tail"].as_array().unwrap().is_empty());
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn crash_during_non_streaming_request_gives_502_with_cause() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &chat(json!({"delay_ms": 50, "then": "exit:7"}), false),
        )
        .await?;
    assert_eq!(s, 502);
    assert_eq!(v["error"]["type"], "engine_crashed");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exit code 7"), "{msg}");
    assert!(
        msg.contains("exiting with 7 mid-request"),
        "stderr tail quoted: {msg}"
    );
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn mlx_oom_text_is_out_of_memory_and_an_unsent_sigkill_is_a_crash() -> Result<()> {
    // The exit classification is under test: no resumption of the request on the restart.
    let mut p = Proxy::start_with(&[], |c| c.server.max_resumes = 0).await?;
    let events = stream_events(
        &p,
        json!({"chunks": 10, "interval_ms": 10, "then": "sigkill", "at": 2}),
    )
    .await?;
    let err = event_json(&events.last().unwrap().1).unwrap();
    // No OOM-killer record, no Fatal, no MLX text: somebody else's SIGKILL.
    assert_eq!(err["error"]["code"], "crash", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("SIGKILL"),
        "{err}"
    );

    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat(json!({"then": "oom"}), false))
        .await?;
    assert_eq!(s, 502);
    assert_eq!(v["error"]["code"], "out_of_memory");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[metal::malloc]"),
        "{v}"
    );
    p.stop().await?;
    Ok(())
}

/// Chat asking for `max_tokens` (the fake engine reserves (1 + max_tokens) · 10 bytes).
fn chat_tokens(max_tokens: u64) -> Value {
    json!({"model": "fake-model", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]})
}

/// Issue 12, finding 1: `kill -9` from outside, several times, used to count as
/// out-of-memory and halve the KV budget each time until every request failed with a 500.
#[tokio::test]
async fn external_sigkills_are_crashes_and_leave_the_limits_alone() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| {
        c.server.limits.kv_budget_bytes = Some(4096);
        c.server.limits.max_batch_size = Some(8);
        c.server.crash_limit = 100;
    })
    .await?;
    for round in 1..=4u64 {
        let (s, _, v) = p.post_json("/v1/chat/completions", &chat_tokens(1)).await?;
        assert_eq!(s, 200, "round {round}: {v}");
        let e = p
            .wait_engine("ready", T, |e| {
                e["state"] == "ready" && e["generation"] == round
            })
            .await?;
        let pid = e["pid"].as_i64().unwrap() as i32;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        wait_gone(pid, T).await?;
        p.wait_engine("restarted", T, |e| e["generation"] == round + 1)
            .await?;
    }
    let e = p.engine().await?;
    assert_eq!(e["last_exit"]["code"], "crash", "{e}");
    assert_eq!(e["limits"]["kv_budget_bytes"], 4096);
    assert_eq!(e["limits"]["max_batch_size"], 8);
    assert_eq!(e["limits"]["reduced"], false);
    // 201 tokens · 10 bytes: fits the configured 4096, not a budget halved twice.
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(200))
        .await?;
    assert_eq!(s, 200, "{v}");
    p.stop().await?;
    Ok(())
}

/// A real out-of-memory exit halves the limits; what no longer fits gets a 503 that says
/// so (not the engine's 500), what never fits a 400; a reset restores the limits.
#[tokio::test]
async fn reduced_limits_refuse_with_503_and_reset_restores_them() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| {
        c.server.limits.kv_budget_bytes = Some(4096);
        // The exit itself is under test: no resumption of the request on the restart.
        c.server.max_resumes = 0;
    })
    .await?;
    // With a token limit: without one the engine would reserve the whole context (20480
    // bytes), which the pre-check refuses.
    let mut oom = chat(json!({"then": "fatal_oom"}), false);
    oom["max_tokens"] = json!(100);
    let (s, _, v) = p.post_json("/v1/chat/completions", &oom).await?;
    assert_eq!(s, 502, "{v}");
    assert_eq!(v["error"]["code"], "out_of_memory");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV cache allocation"),
        "{v}"
    );

    // 301 tokens · 10 bytes = 3010: more than 2048 now, within the configured 4096.
    let (s, h, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(300))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "limits_reduced");
    assert!(h["retry-after"].to_str()?.parse::<u64>()? > 500, "{h:?}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("3010") && msg.contains("2048") && msg.contains("4096"),
        "{msg}"
    );
    // More than even the configured budget: the client's fault.
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(1000))
        .await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["reduced"], true);
    assert_eq!(e["limits"]["kv_budget_bytes"], 2048);

    let (s, _, v) = json_of(send(p.addr, "POST", "/engines/reset", None).await?).await?;
    assert_eq!(s, 200);
    assert_eq!(v["reset"][0], "fake-model");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["reduced"], false, "{e}");
    assert_eq!(e["limits"]["kv_budget_bytes"], 4096);
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(300))
        .await?;
    assert_eq!(s, 200, "{v}");
    p.stop().await?;
    Ok(())
}

/// An engine that chose its KV budget itself (from the GPU's free memory, as the fake engine's
/// `device_kv_budget_bytes` stands for) reports it; an out-of-memory exit halves that budget
/// although none is configured, and a reset gives the choice back to the engine.
#[tokio::test]
async fn an_out_of_memory_exit_halves_the_budget_the_engine_chose() -> Result<()> {
    let mut p = Proxy::start_with(&[("device_kv_budget_bytes", "4096")], |c| {
        c.server.max_resumes = 0;
    })
    .await?;
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(10))
        .await?;
    assert_eq!(s, 200, "{v}");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["kv_budget_bytes"], Value::Null, "{e}");
    assert_eq!(e["limits"]["in_force"]["kv_budget_bytes"], 4096, "{e}");
    // 1001 tokens · 10 bytes: more than the engine's own budget, refused before it is sent.
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(1000))
        .await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded");

    let mut oom = chat(json!({"then": "fatal_oom"}), false);
    oom["max_tokens"] = json!(100);
    let (s, _, v) = p.post_json("/v1/chat/completions", &oom).await?;
    assert_eq!(s, 502, "{v}");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["reduced"], true, "{e}");
    assert_eq!(e["limits"]["kv_budget_bytes"], 2048, "{e}");
    // 301 tokens · 10 bytes: within what the engine chose, not within half of it.
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(300))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "limits_reduced");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["in_force"]["kv_budget_bytes"], 2048, "{e}");

    let (s, _, _) = json_of(send(p.addr, "POST", "/engines/reset", None).await?).await?;
    assert_eq!(s, 200);
    let e = p.engine().await?;
    assert_eq!(e["limits"]["reduced"], false, "{e}");
    assert_eq!(e["limits"]["kv_budget_bytes"], Value::Null, "{e}");
    let (s, _, v) = p
        .post_json("/v1/chat/completions", &chat_tokens(300))
        .await?;
    assert_eq!(s, 200, "{v}");
    let e = p.engine().await?;
    assert_eq!(e["limits"]["in_force"]["kv_budget_bytes"], 4096, "{e}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn oom_restart_shrinks_limits() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| {
        c.server.limits.kv_budget_bytes = Some(1 << 30);
        c.server.limits.max_batch_size = Some(8);
        // One out-of-memory exit: no resumption of the request on the restart.
        c.server.max_resumes = 0;
    })
    .await?;
    let (s, _, _) = p
        .post_json("/v1/chat/completions", &chat(json!({"then": "oom"}), false))
        .await?;
    assert_eq!(s, 502);
    let e = p.engine().await?;
    assert_eq!(e["limits"]["kv_budget_bytes"], 1u64 << 29);
    assert_eq!(e["limits"]["max_batch_size"], 4);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn crash_loop_marks_the_model_failed_until_reset() -> Result<()> {
    let mut p = Proxy::start_with(&[("fatal_before_ready", "weights file missing")], |c| {
        c.server.crash_limit = 3;
    })
    .await?;
    let t = Instant::now();
    let (s, h, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert!(h.contains_key("retry-after"));
    assert_eq!(v["error"]["type"], "engine_failed");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("weights file missing"),
        "{v}"
    );
    assert_eq!(v["error"]["code"], "load_failed", "{v}");
    // The waiting request got the first load's error; the pool retries (backoff 20 ms,
    // 40 ms) until the third failure marks the model failed.
    let e = p
        .wait_engine("failed", T, |e| e["state"] == "failed")
        .await?;
    assert!(t.elapsed() >= Duration::from_millis(60));
    assert_eq!(e["restarts"], 2);
    assert_eq!(e["last_exit"]["code"], "load_failed");
    let (_, _, m) = p.get("/v1/models").await?;
    assert!(m["data"][0]["failure"]
        .as_str()
        .unwrap()
        .contains("weights file missing"));
    // The only model failed: nothing can serve.
    let (s, _, h) = p.get("/health").await?;
    assert_eq!(s, 503, "{h}");
    assert_eq!(h["status"], "unavailable");

    // Immediately again: no restart storm, same answer.
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    assert_eq!(p.engine().await?["generation"], 3);

    let (s, _, v) = send(p.addr, "POST", "/engines/reset", None)
        .await
        .map(json_of)?
        .await?;
    assert_eq!(s, 200);
    assert_eq!(v["reset"][0], "fake-model");
    assert_eq!(p.engine().await?["state"], "idle");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn failed_model_is_retried_after_the_cool_down() -> Result<()> {
    let mut p = Proxy::start_with(&[("exit_before_ready", "2")], |c| {
        c.server.crash_limit = 1;
        c.server.failed_cooldown_ms = 300;
    })
    .await?;
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exit code 2 before ready"),
        "{v}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    assert_eq!(
        p.engine().await?["generation"],
        2,
        "cool-down over: one more start"
    );
    p.stop().await?;
    Ok(())
}

/// A load that fails answers the request waiting for it with the load's error (waiting
/// through every retry of a slow failing load could take many minutes); the pool restarts
/// the engine, and the next request is served by it.
#[tokio::test]
async fn a_load_failure_answers_the_queued_request_and_the_restart_serves_the_next() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marker = dir.path().join("crashed-once");
    let mut p = Proxy::start(&[("crash_once_marker", marker.to_str().unwrap())]).await?;
    let (s, h, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "load_failed", "{v}");
    assert!(h.contains_key("retry-after"));
    p.wait_engine("ready", T, |e| e["state"] == "ready").await?;
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200, "{v}");
    let e = p.engine().await?;
    assert_eq!(e["restarts"], 1);
    assert_eq!(e["last_exit"]["code"], "load_failed");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish_then_stops_the_engine() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let body = chat(json!({"chunks": 8, "interval_ms": 60}), true).to_string();
    let resp = send(p.addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
    let pid = p.engine().await?["pid"].as_i64().unwrap() as i32;
    let reader = stream_in_flight(resp).await?;
    p.begin_stop();
    let events = reader.await??;
    assert_eq!(events.len(), 9, "stream cut short: {events:?}");
    assert_eq!(events[8].1, "data: [DONE]\n\n");
    let events_file = p.events_file();
    p.stop().await?;
    wait_gone(pid, Duration::from_secs(1)).await?;
    wait_event(&events_file, "shutdown requested", T).await?;
    Ok(())
}

#[tokio::test]
async fn shutdown_escalates_to_sigterm_then_sigkill() -> Result<()> {
    let mut p = Proxy::start_with(&[("ignore_shutdown", "1"), ("ignore_sigterm", "1")], |c| {
        c.server.grace_ms = 300;
    })
    .await?;
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200);
    let pid = p.engine().await?["pid"].as_i64().unwrap() as i32;
    let took = p.stop().await?;
    assert!(process_gone(pid));
    // Shutdown (300 ms) + SIGTERM (300 ms) + SIGKILL.
    assert!(took >= Duration::from_millis(550), "{took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    Ok(())
}

#[tokio::test]
async fn bad_input_is_rejected_without_waking_an_engine() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.max_body_bytes = 1024).await?;
    let post = |path: &str, body: &[u8]| {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        [head.as_bytes(), body].concat()
    };
    let status = |out: &[u8]| {
        String::from_utf8_lossy(out)
            .split(' ')
            .nth(1)
            .unwrap_or("")
            .to_string()
    };

    // Not JSON; invalid UTF-8; a JSON array; a truncated object; a non-string model.
    for body in [
        &b"hello"[..],
        b"{\"model\": \"\xff\xfe\"}",
        b"[1,2]",
        b"{\"model\":",
        b"{\"model\":3}",
    ] {
        let out = raw_exchange(p.addr, &post("/v1/chat/completions", body), false).await?;
        assert_eq!(status(&out), "400", "{}", String::from_utf8_lossy(&out));
        let text = String::from_utf8_lossy(&out);
        let json = text.split_once("\r\n\r\n").unwrap().1;
        let v: Value = serde_json::from_str(json)?;
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Too large by Content-Length, and by a chunked body with no length.
    let out = raw_exchange(p.addr, &post("/v1/chat/completions", &[b'x'; 2000]), false).await?;
    assert_eq!(status(&out), "413");
    let chunked = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n800\r\n{}\r\n0\r\n\r\n",
        "y".repeat(0x800)
    );
    let out = raw_exchange(p.addr, chunked.as_bytes(), false).await?;
    assert_eq!(status(&out), "413", "{}", String::from_utf8_lossy(&out));
    assert!(String::from_utf8_lossy(&out).contains("limit of 1024 bytes"));

    // Garbage, truncated requests and abrupt disconnects.
    let _ = raw_exchange(p.addr, b"\x00\xff\xfe garbage \r\n\r\n", true).await?;
    let _ = raw_exchange(p.addr, b"GET / HTTP/1.1\r\nHost", true).await?;
    let _ = raw_exchange(
        p.addr,
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"a\"",
        true,
    )
    .await?;
    let _ = raw_exchange(p.addr, b"GET /\xff\xfe HTTP/1.1\r\nX: \xff\r\n\r\n", true).await?;
    for _ in 0..5 {
        let s = tokio::net::TcpStream::connect(p.addr).await?;
        drop(s);
    }

    // Nothing above woke the engine, and the proxy is fine.
    let e = p.engine().await?;
    assert_eq!(e["state"], "idle", "{e}");
    assert!(e["pid"].is_null());
    let (s, _, _) = p.get("/health").await?;
    assert_eq!(s, 200);
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "ok"}))
        .await?;
    assert_eq!(s, 200);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_hung_request_at_shutdown_gets_an_error_event_and_the_engine_is_killed() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.grace_ms = 300).await?;
    let body = chat(
        json!({"chunks": 10, "interval_ms": 1, "then": "hang", "at": 2}),
        true,
    )
    .to_string();
    let resp = send(p.addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
    let pid = p.engine().await?["pid"].as_i64().unwrap() as i32;
    let reader = stream_in_flight(resp).await?;
    let took = p.stop().await?;
    // Grace for requests, then Shutdown (ignored: a request is active), then SIGTERM.
    assert!(took >= Duration::from_millis(550), "{took:?}");
    assert!(process_gone(pid));
    let events = reader.await??;
    assert_eq!(events.len(), 3, "{events:?}");
    let err = event_json(&events[2].1).unwrap();
    assert_eq!(err["error"]["type"], "engine_stopped", "{err}");
    assert_eq!(err["error"]["code"], "stopped");
    Ok(())
}

#[tokio::test]
async fn an_engine_stuck_loading_is_killed_at_the_load_timeout() -> Result<()> {
    let mut p = Proxy::start_with(&[("ready_delay_ms", "60000")], |c| {
        c.server.load_timeout_ms = 300;
        c.server.crash_limit = 1;
    })
    .await?;
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    assert_eq!(v["error"]["type"], "engine_failed");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("load timeout of 300 ms"),
        "{v}"
    );
    assert_eq!(p.engine().await?["last_exit"]["code"], "load_failed");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_request_that_never_reached_a_dead_engine_is_retried_on_the_new_one() -> Result<()> {
    let mut p = Proxy::start(&[("vanish_after_requests", "1")]).await?;
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200);
    wait_event(&p.events_file(), "vanishing", T).await?;
    // The pool still thinks the engine is ready; the connect fails; the request is
    // sent again once the engine has been restarted.
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 200, "{v}");
    let e = p.engine().await?;
    assert_eq!(e["generation"], 2);
    assert_eq!(e["last_exit"]["code"], "crash");
    p.stop().await?;
    Ok(())
}

/// Issue 12, finding 6: `/health` said 200 with the only model failed.
#[tokio::test]
async fn health_is_503_when_every_model_failed_and_says_why() -> Result<()> {
    let mut p = Proxy::start_with(&[("exit_before_ready", "2")], |c| {
        c.server.crash_limit = 1;
    })
    .await?;
    // Not loaded yet, but loadable on demand: healthy.
    let (s, _, h) = p.get("/health").await?;
    assert_eq!(s, 200, "{h}");
    assert_eq!(h["status"], "ok");
    assert_eq!(h["models_loadable"], 1);

    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    for path in ["/health", "/health/ready"] {
        let (s, _, h) = p.get(path).await?;
        assert_eq!(s, 503, "{path}: {h}");
        assert_eq!(h["status"], "unavailable");
        let why = h["reasons"][0].as_str().unwrap();
        assert!(
            why.contains("fake-model") && why.contains("exit code 2 before ready"),
            "{why}"
        );
    }
    let (s, _, h) = p.get("/health/live").await?;
    assert_eq!(s, 200);
    assert_eq!(h["status"], "live");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn health_is_degraded_but_200_while_one_model_still_serves() -> Result<()> {
    let mut bad = mlxd_proxy::config::ModelConfig::new("bad");
    bad.options.insert("exit_before_ready".into(), "2".into());
    let good = mlxd_proxy::config::ModelConfig::new("good");
    let mut p = Proxy::start_with(&[], |c| {
        c.models = vec![bad, good];
        c.server.crash_limit = 1;
    })
    .await?;
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"model": "bad", "prompt": "x"}))
        .await?;
    assert_eq!(s, 503);
    let (s, _, _) = p
        .post_json("/v1/completions", &json!({"model": "good", "prompt": "x"}))
        .await?;
    assert_eq!(s, 200);
    let (s, _, h) = p.get("/health").await?;
    assert_eq!(s, 200, "{h}");
    assert_eq!(h["status"], "degraded");
    assert_eq!(h["models_serving"], 1);
    assert!(
        h["reasons"][0].as_str().unwrap().contains("model bad"),
        "{h}"
    );
    p.stop().await?;
    Ok(())
}
