//! Transparent resumption with the scriptable fake engine (real processes, no MLX): a
//! crash mid-stream is spliced over without a token lost or repeated, a non-streaming
//! request is sent again, and a request that kills every engine stops at `max_resumes`.
//! `resume.rs` does the same end to end with the real engine and the default model.

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use mlxd_tests::*;
use serde_json::{json, Value};

fn body(path: &str, fake: Value, stream: bool) -> Value {
    if path == "/v1/chat/completions" {
        json!({"model": "fake-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}], "fake": fake})
    } else {
        json!({"model": "fake-model", "stream": stream, "prompt": "hi", "fake": fake})
    }
}

/// The text of a stream's content events, in order, and the events themselves.
async fn stream(p: &Proxy, path: &str, fake: Value) -> Result<(String, Vec<String>)> {
    let resp = send(
        p.addr,
        "POST",
        path,
        Some(body(path, fake, true).to_string().into()),
    )
    .await?;
    ensure!(resp.status() == 200, "{}", resp.status());
    let events: Vec<String> = read_events(resp).await?.into_iter().map(|e| e.1).collect();
    let mut text = String::new();
    for ev in &events {
        if let Some(v) = event_json(ev) {
            let c = &v["choices"][0];
            text.push_str(
                c["delta"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .unwrap_or_default(),
            );
        }
    }
    Ok((text, events))
}

fn expected(chunks: u64) -> String {
    (0..chunks).map(|i| format!("tok{i} ")).collect()
}

#[tokio::test]
async fn a_stream_is_spliced_across_an_engine_crash_without_loss_or_repeat() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let marker = p.dir.path().join(format!("once{}", path.len()));
        std::fs::write(&marker, b"")?;
        let fake = json!({"chunks": 10, "interval_ms": 10, "token_ids": true,
                          "then": "abort", "at": 4, "once": marker});
        let (text, events) = stream(&p, path, fake).await?;
        ensure!(!marker.exists(), "the scripted abort did not happen");
        ensure!(text == expected(10), "{path}: {text:?} from {events:?}");
        ensure!(
            events.last().map(String::as_str) == Some("data: [DONE]\n\n"),
            "{events:?}"
        );
        let all = events.concat();
        ensure!(
            !all.contains("\"mlxd\"") && !all.contains(": mlxd"),
            "the token ids' field or meta line reached the client: {all}"
        );
        ensure!(!all.contains("\"error\""), "{all}");
        let ids: BTreeSet<String> = events
            .iter()
            .filter_map(|e| event_json(e))
            .filter_map(|v| v["id"].as_str().map(String::from))
            .collect();
        ensure!(ids.len() == 1, "{ids:?}");
    }
    let e = p.engine().await?;
    ensure!(e["restarts"] == 2, "{e}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_non_streaming_request_is_sent_again_after_a_crash() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let marker = p.dir.path().join("once");
    std::fs::write(&marker, b"")?;
    let fake = json!({"chunks": 6, "token_ids": true, "then": "exit:7", "once": marker});
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &body("/v1/chat/completions", fake, false),
        )
        .await?;
    ensure!(s == 200, "{s} {v}");
    ensure!(!marker.exists(), "the scripted exit did not happen");
    ensure!(v["choices"][0]["message"]["content"] == expected(6), "{v}");
    ensure!(v["choices"][0].get("mlxd").is_none(), "{v}");
    let e = p.engine().await?;
    ensure!(e["restarts"] == 1, "{e}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_request_that_kills_every_engine_ends_at_max_resumes_with_an_error_event() -> Result<()> {
    let mut p = Proxy::start_with(&[], |c| c.server.max_resumes = 2).await?;
    let fake = json!({"chunks": 10, "interval_ms": 5, "token_ids": true, "then": "abort", "at": 3});
    let (text, events) = stream(&p, "/v1/chat/completions", fake).await?;
    // The first engine sent tok0..tok2; every later one dies at once.
    ensure!(text == expected(3), "{text:?}");
    let last = events.last().context("no events")?;
    let err = event_json(last).with_context(|| format!("not JSON: {last}"))?;
    ensure!(err["error"]["code"] == "resume_failed", "{err}");
    ensure!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_resumes") && m.contains("SIGABRT")),
        "{err}"
    );
    ensure!(!events.concat().contains("[DONE]"));
    // Two resumes, three crashes.
    p.wait_engine(
        "restarted three times",
        std::time::Duration::from_secs(10),
        |e| e["restarts"] == 3,
    )
    .await?;
    p.stop().await?;
    Ok(())
}
