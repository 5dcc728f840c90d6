//! `mlxd` gives back what a burst took (issue 23, finding 10): after 30 MB request bodies,
//! and after hundreds of slow connections, its resident memory returns to near where it was
//! (`mlxd_ipc::heap`: glibc's thresholds fixed, arenas capped, free pages trimmed).
//! The real `mlxd` binary with the fake engine; memory read from `/proc/<pid>/status`.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use mlxd_tests::*;
use tokio::io::AsyncWriteExt;

/// How far above its level before the burst mlxd may stay once the burst is over.
const SLACK_MIB: u64 = 8;

/// How long the memory may take to come back: a few periods of the heap trimmer.
const SETTLE: Duration = Duration::from_secs(20);

fn rss_kib(pid: i32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))
}

/// mlxd's settled level: a request that touches the routing, so that lazily built state
/// exists before the baseline, then the RSS once two reads 1 s apart agree within 1 MiB.
async fn settled_rss(m: &MlxdProcess) -> Result<u64> {
    let _ = send(m.addr, "GET", "/health", None).await?;
    let mut last = rss_kib(m.pid())?;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = rss_kib(m.pid())?;
        if now.abs_diff(last) < 1024 {
            return Ok(now);
        }
        last = now;
    }
    Ok(last)
}

/// Waits until mlxd's RSS is within [`SLACK_MIB`] of `before` (KiB), up to [`SETTLE`].
async fn returns_to(m: &MlxdProcess, before: u64, peak: u64, what: &str) -> Result<()> {
    returns_to_within(m, before, SLACK_MIB * 1024, peak, what).await
}

/// Waits until mlxd's RSS is at most `slack` KiB above `before` (KiB), up to [`SETTLE`].
async fn returns_to_within(
    m: &MlxdProcess,
    before: u64,
    slack: u64,
    peak: u64,
    what: &str,
) -> Result<()> {
    let t = Instant::now();
    loop {
        let now = rss_kib(m.pid())?;
        if now <= before + slack {
            return Ok(());
        }
        if t.elapsed() > SETTLE {
            bail!(
                "after {what}, mlxd holds {} MiB ({} MiB before, {} MiB allowed above it, {} MiB at the peak) {:?} later",
                now / 1024,
                before / 1024,
                slack / 1024,
                peak / 1024,
                SETTLE
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_30_mb_body_is_given_back() -> Result<()> {
    let m = MlxdProcess::start(&[]).await?;
    let before = settled_rss(&m).await?;
    let content = "x".repeat(30_000_000);
    let mut peak = before;
    // Refused at routing (no such model), then forwarded to the engine: the body's whole
    // life in mlxd. More than one: glibc's default let the first go back and kept the rest
    // (its threshold rises to the size of the first block freed).
    for (model, status) in [
        ("no-such-model", 404),
        ("no-such-model", 404),
        ("fake-model", 200),
    ] {
        let body = format!(
            r#"{{"model":"{model}","max_tokens":1,"messages":[{{"role":"user","content":"{content}"}}]}}"#
        );
        let resp = send(m.addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
        assert_eq!(resp.status(), status, "{model}");
        let _ = json_of(resp).await?;
        peak = peak.max(rss_kib(m.pid())?);
    }
    returns_to(&m, before, peak, "three 30 MB bodies").await
}

/// Opens 400 connections that each send half a request head with a 16 KiB header, holds them
/// until mlxd has read them all (3 s), then closes them; returns the peak RSS (KiB).
async fn slow_connection_burst(m: &MlxdProcess) -> Result<u64> {
    let mut conns = Vec::new();
    for _ in 0..400 {
        let mut s = tokio::net::TcpStream::connect(m.addr).await?;
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nX-Pad: {}",
            m.addr,
            "p".repeat(16 << 10)
        );
        s.write_all(head.as_bytes()).await?;
        conns.push(s);
    }
    let t = Instant::now();
    let mut peak = rss_kib(m.pid())?;
    while t.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(rss_kib(m.pid())?);
    }
    drop(conns);
    Ok(peak)
}

/// Slow connections leave nothing behind that grows: after each of three bursts, mlxd comes
/// back to within two thirds of the burst's growth of where it was before the first (glibc's
/// defaults kept a burst's whole growth; a leak of a few MiB per burst passes that bound by
/// the third).
/// A fixed slack does not do: what a burst leaves depends on the allocator's fragmentation
/// under load (CI kept 9 of 23 MiB once; here one burst came back to the baseline and the
/// next kept 9 MiB).
#[tokio::test]
async fn slow_connections_are_given_back() -> Result<()> {
    // Below the per-client cap, so that every connection is accepted and read.
    let m = MlxdProcess::start_limited(&["--header-timeout-ms", "60000"], Some(4096)).await?;
    let before = settled_rss(&m).await?;
    for round in 1..=3 {
        let peak = slow_connection_burst(&m).await?;
        let kept = (peak.saturating_sub(before) * 2 / 3).max(SLACK_MIB * 1024);
        returns_to_within(
            &m,
            before,
            kept,
            peak,
            &format!("burst {round} of 400 slow connections"),
        )
        .await?;
    }
    Ok(())
}

/// The engine gives back what tokenizing refused prompts took: each ~200 KB prompt is
/// tokenized (far more tokens than the context) and refused with 400. The probe saw an engine
/// grow 143 → 765 MiB over 600 of them and keep it.
#[tokio::test]
async fn an_engine_gives_back_refused_huge_prompts() -> Result<()> {
    let mut p = default_model_proxy(&[], |_| {}).await?;
    let chat = |content: String| serde_json::json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1});
    let (status, _, _) = p
        .post_json("/v1/chat/completions", &chat("Say hi.".into()))
        .await?;
    assert_eq!(status, 200);
    let pid = p.engine().await?["pid"]
        .as_i64()
        .ok_or_else(|| anyhow::anyhow!("no engine pid"))? as i32;
    let before = {
        let mut last = rss_kib(pid)?;
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let now = rss_kib(pid)?;
            if now.abs_diff(last) < 1024 {
                break;
            }
            last = now;
        }
        last
    };
    let words = "harbour lantern tide granite beacon keeper storm gull ";
    let mut peak = before;
    for i in 0..30 {
        let content = format!("{i} {}", words.repeat(3_700));
        let (status, _, body) = p.post_json("/v1/chat/completions", &chat(content)).await?;
        assert_eq!(status, 400, "{body}");
        peak = peak.max(rss_kib(pid)?);
    }
    let t = Instant::now();
    loop {
        let now = rss_kib(pid)?;
        // The engine's heap moves more than mlxd's between two reads: twice the slack.
        if now <= before + 2 * SLACK_MIB * 1024 {
            break;
        }
        if t.elapsed() > SETTLE {
            bail!(
                "after 30 refused 200 KB prompts the engine holds {} MiB ({} MiB before, {} MiB at the peak)",
                now / 1024,
                before / 1024,
                peak / 1024
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    p.stop().await?;
    Ok(())
}
