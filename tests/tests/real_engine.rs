//! The supervisor with the real engine and the default model (SmolLM2-135M on MLX): a request
//! is served through `mlxd`; the engine is SIGKILLed in the middle of a stream; the stream is
//! resumed on the restarted engine and ends normally; the next request succeeds on it.
//! (`resume.rs` compares resumed answers byte for byte with uninterrupted ones.)

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::BodyExt;
use mlxd_tests::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// `mlxd serve` with the real engine on the default model, from the shared test store.
async fn start_mlxd() -> Result<MlxdProcess> {
    MlxdProcess::builder()
        .model("smollm2-135m")
        .engine(built_engine_bin()?)
        .home(test_home())
        .env("MLXD_SMOLLM2_GGUF", smollm2_gguf()?)
        .start()
        .await
}

async fn chat(addr: std::net::SocketAddr, max_tokens: u32) -> Result<(hyper::StatusCode, Value)> {
    let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": max_tokens, "temperature": 0});
    let (status, _, v) = post_json(addr, "/v1/chat/completions", &body).await?;
    Ok((status, v))
}

/// The pid and `/engines` entry of the first engine.
async fn first_engine(addr: std::net::SocketAddr) -> Result<(i32, Value)> {
    let (_, _, engines) = json_of(send(addr, "GET", "/engines", None).await?).await?;
    let engine = engines["engines"][0].clone();
    let pid = engine["pid"]
        .as_i64()
        .with_context(|| format!("no engine pid in {engines}"))? as i32;
    Ok((pid, engine))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_real_engine_mid_stream_is_resumed_then_the_engine_serves_on() -> Result<()>
{
    let mlxd = start_mlxd().await?;

    // Served through the proxy by the real engine (the first request starts it).
    let (status, v) = chat(mlxd.addr, 12).await?;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .contains("Paris"),
        "{v}"
    );
    let (pid, _) = first_engine(mlxd.addr).await?;

    // A long stream; kill -9 the engine once tokens are flowing.
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
                      "max_tokens": 40, "temperature": 0, "stream": true});
    let resp = send(
        mlxd.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().into()),
    )
    .await?;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut splitter = mlxd_ipc::sse::SseSplitter::new();
    let mut events: Vec<String> = Vec::new();
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Some(frame) = tokio::time::timeout_at(deadline.into(), body.frame())
        .await
        .context("stream stalled")?
    {
        if let Some(data) = frame?.data_ref() {
            events.extend(
                splitter
                    .push(data)
                    .iter()
                    .map(|e| String::from_utf8_lossy(e).into_owned()),
            );
        }
        let content_chunks = events.iter().filter(|e| e.contains("\"content\"")).count();
        if !killed && content_chunks >= 3 {
            kill(Pid::from_raw(pid), Signal::SIGKILL)?;
            killed = true;
        }
    }
    assert!(
        killed,
        "the stream ended before the engine could be killed: {events:?}"
    );
    let last = events.last().context("no events")?;
    assert_eq!(last, "data: [DONE]\n\n", "the resumed stream ends normally");
    assert!(
        !events.iter().any(|e| e.contains("\"error\"")),
        "no error event in a resumed stream: {events:?}"
    );
    let ids: std::collections::BTreeSet<String> = events
        .iter()
        .filter_map(|e| event_json(e))
        .filter_map(|v| v["id"].as_str().map(String::from))
        .collect();
    assert_eq!(ids.len(), 1, "one response id: {ids:?}");

    // The engine comes back; the next request succeeds.
    let t = Instant::now();
    loop {
        let (status, v) = chat(mlxd.addr, 8).await?;
        if status == 200 {
            assert!(
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("Paris"),
                "{v}"
            );
            break;
        }
        assert_eq!(status, 503, "while restarting: {v}");
        if t.elapsed() > Duration::from_secs(120) {
            bail!("the engine did not come back: {v}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (new_pid, engine) = first_engine(mlxd.addr).await?;
    assert_ne!(new_pid, pid, "a new engine process serves after the crash");
    assert!(engine["restarts"].as_u64().unwrap_or(0) >= 1, "{engine}");
    Ok(())
}
