//! The SSD KV tier and generation checkpoints with the real engine, through `mlxd`: a new
//! engine process (after an unload, after `kill -9`) restores a long prefix from disk instead
//! of prefilling it and answers the same; unusable files found at start are deleted without
//! a crash; a stream whose engine is killed resumes from its generation checkpoint with the
//! same output (the default model, SmolLM2-135M: its tokens come slowly enough on the CPU for
//! the kill to land between checkpoints); stopping `mlxd` during streams lets them finish and
//! leaves only whole, valid files. The tests that do not race the model run on a generated
//! tiny Llama, whose tokens come in milliseconds.
//!
//! Needs what `scripts/test.sh` provides (the engine binary, `MLXD_TEST_HOME`, the SmolLM2
//! GGUF); a missing prerequisite fails the test with what is missing.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use http_body_util::BodyExt;
use mlxd_proxy::Config;
use mlxd_tests::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

const MODEL: &str = "smollm2-135m";

/// A proxy in this process serving the default model with the real engine and the given
/// engine options.
async fn start(options: &[(&str, &str)], tweak: impl FnOnce(&mut Config)) -> Result<Proxy> {
    default_model_proxy(options, tweak).await
}

/// The generated tiny Llama (context 512: its tokenizer makes ~50 tokens of a sentence).
const TINY: &str = "tiny-llama";

/// A proxy in this process serving [`TINY`] with the given engine options.
async fn start_tiny(options: &[(&str, &str)]) -> Result<Proxy> {
    tiny_model_proxy(TINY, options, |_| {}).await
}

/// A prompt of roughly `sentences` × 12 tokens that every request here shares.
fn long_prompt(sentences: usize) -> String {
    let mut p = String::new();
    for i in 0..sentences {
        p.push_str(&format!(
            "Note {i}: the lighthouse keeper wrote down the weather and the ships. "
        ));
    }
    p.push_str("Summary of the notes:");
    p
}

/// A greedy completion from [`TINY`]; returns its text and `usage`.
async fn complete(p: &Proxy, prompt: &str, max_tokens: u32) -> Result<(String, Value)> {
    let body = json!({"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let (status, _, v) = p.post_json("/v1/completions", &body).await?;
    ensure!(status == 200, "completion: {status} {v}");
    let text = v["choices"][0]["text"]
        .as_str()
        .context("no text")?
        .to_owned();
    Ok((text, v["usage"].clone()))
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// The model's directory of SSD files under `root` (one per model fingerprint).
fn model_dir(root: &Path) -> Result<PathBuf> {
    let dirs: Vec<PathBuf> = std::fs::read_dir(root)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    ensure!(
        dirs.len() == 1,
        "expected one model directory in {root:?}: {dirs:?}"
    );
    Ok(dirs[0].clone())
}

fn names(dir: &Path) -> Result<Vec<String>> {
    let mut v: Vec<String> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// Waits until `root` holds at least `n` whole entry files.
async fn wait_files(root: &Path, n: usize) -> Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(dir) = model_dir(root) {
            let kv: Vec<String> = names(&dir)?
                .into_iter()
                .filter(|n| n.ends_with(".kv"))
                .collect();
            if kv.len() >= n {
                return Ok(kv);
            }
        }
        if Instant::now() > deadline {
            bail!("fewer than {n} SSD files appeared in {root:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The engine row once its `stats.ssd` satisfies `pred`.
async fn wait_ssd(p: &Proxy, what: &str, pred: impl Fn(&Value) -> bool) -> Result<Value> {
    p.wait_engine(what, Duration::from_secs(120), |e| pred(&e["stats"]["ssd"]))
        .await
}

async fn ready_pid(p: &Proxy) -> Result<i32> {
    let e = p
        .wait_engine("ready", Duration::from_secs(180), |e| e["state"] == "ready")
        .await?;
    Ok(e["pid"].as_i64().context("no pid")? as i32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_engine_restores_a_long_prefix_from_ssd_and_answers_the_same() -> Result<()> {
    let ssd = tempfile::tempdir()?;
    let dir = ssd.path().display().to_string();
    let p = start_tiny(&[("ssd_cache", &dir)]).await?;
    let prompt = long_prompt(8);
    let (first, usage) = complete(&p, &prompt, 12).await?;
    let prompt_tokens = usage["prompt_tokens"].as_u64().context("prompt_tokens")?;
    ensure!(prompt_tokens > 300, "the prompt is too short: {usage}");
    ensure!(
        cached(&usage) == 0,
        "a cold engine had a cached prefix: {usage}"
    );
    wait_files(ssd.path(), 1).await?;

    // Unloading spills; the next engine of the model is a new process and starts warm.
    let resp = send(
        p.addr,
        "POST",
        &format!("/admin/models/{TINY}/unload"),
        None,
    )
    .await?;
    ensure!(resp.status() == 200, "unload: {}", resp.status());
    let e = p.engine().await?;
    let clean = e["last_exit"]["stderr_tail"].as_array().is_some_and(|t| {
        t.iter()
            .any(|l| l.as_str().is_some_and(|l| l.contains("shut down")))
    });
    ensure!(
        clean,
        "the engine did not stop by itself after the spill: {e}"
    );
    let mdir = model_dir(ssd.path())?;
    ensure!(
        names(&mdir)?.iter().all(|n| n.ends_with(".kv")),
        "temporary files after a spill: {:?}",
        names(&mdir)?
    );
    // Unusable files the next engine finds at start: garbage, a truncated entry, a file
    // a crash left half-written.
    let entry = names(&mdir)?[0].clone();
    let whole = std::fs::read(mdir.join(&entry))?;
    std::fs::write(
        mdir.join("0123456789abcdef0123456789abcdef.kv"),
        b"not a KV file",
    )?;
    std::fs::write(
        mdir.join("fedcba9876543210fedcba9876543210.kv"),
        &whole[..whole.len() / 2],
    )?;
    std::fs::write(mdir.join(format!(".tmp-{entry}")), &whole[..100])?;

    let (second, usage) = complete(&p, &prompt, 12).await?;
    ensure!(
        second == first,
        "restored from SSD: {second:?}, prefilled: {first:?}"
    );
    ensure!(
        cached(&usage) == prompt_tokens - 1,
        "the prefix was not restored: {usage}"
    );
    let e = wait_ssd(&p, "restored", |s| s["hits"].as_u64() >= Some(1)).await?;
    let s = &e["stats"]["ssd"];
    ensure!(
        s["restored_tokens"].as_u64() == Some(prompt_tokens - 1),
        "{e}"
    );
    ensure!(
        s["invalid"].as_u64() == Some(2),
        "two unusable files at start: {e}"
    );
    ensure!(names(&mdir)? == vec![entry.clone()], "{:?}", names(&mdir)?);
    prefix_hit_counted(&p, prompt_tokens - 1).await?;

    // kill -9: the restarted engine has nothing in memory and restores from disk again.
    let pid = ready_pid(&p).await?;
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;
    wait_gone(pid, Duration::from_secs(30)).await?;
    let (third, usage) = complete(&p, &prompt, 12).await?;
    ensure!(
        third == first,
        "after kill -9: {third:?}, prefilled: {first:?}"
    );
    ensure!(cached(&usage) == prompt_tokens - 1, "{usage}");
    let e = wait_ssd(&p, "restored", |s| s["hits"].as_u64() >= Some(1)).await?;
    ensure!(e["pid"].as_i64() != Some(i64::from(pid)), "{e}");
    prefix_hit_counted(&p, prompt_tokens - 1).await?;
    let text = send(p.addr, "GET", "/metrics", None)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    let text = String::from_utf8(text.to_vec())?;
    ensure!(
        text.lines()
            .any(|l| l.starts_with("mlxd_ssd_hits_total{") && !l.ends_with(" 0")),
        "no SSD hits in /metrics:\n{text}"
    );
    // One hit from each of the two engines that restored; /metrics sums the engines.
    let total = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
    };
    ensure!(
        total("mlxd_prefix_hits_total{") == Some(2)
            && total("mlxd_prefix_lookups_total{") >= Some(2)
            && total("mlxd_prefix_reused_tokens_total{") == Some(2 * (prompt_tokens - 1)),
        "prefix-cache counters in /metrics:\n{text}"
    );
    Ok(())
}

/// Waits for the ready engine's stats to show its one prefix lookup, a hit of `tokens`
/// (a restore from the SSD tier is a prefix-cache hit too).
async fn prefix_hit_counted(p: &Proxy, tokens: u64) -> Result<()> {
    let e = p
        .wait_engine("a prefix hit counted", Duration::from_secs(60), |e| {
            e["state"] == "ready" && e["stats"]["prefix"]["hits"].as_u64() >= Some(1)
        })
        .await?;
    let prefix = &e["stats"]["prefix"];
    ensure!(
        prefix["lookups"].as_u64() == Some(1)
            && prefix["hits"].as_u64() == Some(1)
            && prefix["reused_tokens"].as_u64() == Some(tokens)
            && prefix["entries"].as_u64() >= Some(1)
            && prefix["bytes"].as_u64() > Some(0),
        "{e}"
    );
    Ok(())
}

/// Streams `body` and returns the text of its content events in order, and whether it
/// ended with `[DONE]`; `on_chunk` sees the count of content events so far.
async fn stream_text(
    addr: std::net::SocketAddr,
    body: &Value,
    on_chunk: impl Fn(usize),
) -> Result<(String, bool)> {
    let resp = send(
        addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().into()),
    )
    .await?;
    ensure!(resp.status() == 200, "stream: {}", resp.status());
    let mut body = resp.into_body();
    let mut splitter = mlxd_ipc::sse::SseSplitter::new();
    let (mut text, mut done, mut chunks) = (String::new(), false, 0);
    let deadline = Instant::now() + Duration::from_secs(300);
    while let Some(frame) = tokio::time::timeout_at(deadline.into(), body.frame())
        .await
        .context("stream stalled")?
    {
        if let Some(data) = frame?.data_ref() {
            for ev in splitter.push(data) {
                let ev = String::from_utf8(ev.to_vec())?;
                if ev.contains("[DONE]") {
                    done = true;
                    continue;
                }
                let Some(v) = event_json(&ev) else { continue };
                ensure!(v.get("error").is_none(), "an error event: {v}");
                if let Some(t) = v["choices"][0]["text"].as_str() {
                    text.push_str(t);
                    chunks += 1;
                    on_chunk(chunks);
                }
            }
        }
    }
    Ok((text, done))
}

fn counting_request() -> Value {
    json!({"model": MODEL, "prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 96,
           "temperature": 0, "stream": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_stream_resumes_from_the_generation_checkpoint() -> Result<()> {
    let body = counting_request();
    let reference = {
        let mut p = start(&[("prompt_cache", "0")], |_| {}).await?;
        let (text, done) = stream_text(p.addr, &body, |_| {}).await?;
        ensure!(done, "the reference stream did not finish");
        p.stop().await?;
        text
    };

    let ssd = tempfile::tempdir()?;
    let dir = ssd.path().display().to_string();
    let p = start(
        &[("ssd_cache", &dir), ("generation_checkpoint", "16")],
        |_| {},
    )
    .await?;
    let addr = p.addr;
    let chunks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stream = {
        let (body, chunks) = (body.clone(), chunks.clone());
        tokio::spawn(async move {
            stream_text(addr, &body, move |n| {
                chunks.store(n, std::sync::atomic::Ordering::SeqCst)
            })
            .await
        })
    };
    // Kill the engine once two checkpoints are on disk.
    let pid = ready_pid(&p).await?;
    wait_ssd(&p, "checkpointed", |s| s["checkpoints"].as_u64() >= Some(2)).await?;
    let at_kill = chunks.load(std::sync::atomic::Ordering::SeqCst);
    kill(Pid::from_raw(pid), Signal::SIGKILL)?;
    let (text, done) = stream.await??;
    ensure!(done, "the resumed stream did not finish");
    ensure!(
        at_kill < 88,
        "the engine was killed after the stream had nearly finished ({at_kill} chunks)"
    );
    ensure!(
        text == reference,
        "resumed from a checkpoint:\n{text:?}\nuninterrupted:\n{reference:?}"
    );
    let e = wait_ssd(&p, "restored", |s| s["hits"].as_u64() >= Some(1)).await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    let prompt_tokens = 20; // "Count from 1 to 1000: 1, 2, 3, 4," is well under this
    ensure!(
        e["stats"]["ssd"]["restored_tokens"].as_u64() > Some(prompt_tokens + 16),
        "the resume did not restore the checkpoint (only the prompt or nothing): {e}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopping_mlxd_during_streams_finishes_them_and_leaves_valid_files() -> Result<()> {
    let ssd = tempfile::tempdir()?;
    let dir = ssd.path().display().to_string();
    let mut p = start_tiny(&[("ssd_cache", &dir)]).await?;
    let prompts: Vec<String> = (0..3)
        .map(|i| format!("Story {i}: once upon a time, in a village by the sea,"))
        .collect();
    let chunks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let streams: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            // Long enough that the stop comes mid-stream on the tiny model.
            let body = json!({"model": TINY, "prompt": prompt, "max_tokens": 400,
                              "temperature": 0, "stream": true});
            let (addr, chunks) = (p.addr, chunks.clone());
            tokio::spawn(async move {
                stream_text(addr, &body, move |_| {
                    chunks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                })
                .await
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    while chunks.load(std::sync::atomic::Ordering::SeqCst) < 6 {
        ensure!(Instant::now() < deadline, "tokens never flowed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What SIGTERM does to `mlxd`: graceful shutdown with the grace period.
    p.begin_stop();
    let mut texts = Vec::new();
    for s in streams {
        let (text, done) = s.await??;
        ensure!(done, "a stream was cut by the shutdown");
        texts.push(text);
    }
    p.stop().await?;
    let mdir = model_dir(ssd.path())?;
    let files = names(&mdir)?;
    ensure!(
        files.iter().all(|n| n.ends_with(".kv")) && files.len() == 3,
        "after the shutdown: {files:?}"
    );

    // Every file is whole: a new mlxd restores each prompt from it, with nothing invalid.
    let p = start_tiny(&[("ssd_cache", &dir)]).await?;
    for (prompt, text) in prompts.iter().zip(&texts) {
        let (again, usage) = complete(&p, prompt, 400).await?;
        ensure!(&again == text, "{again:?} after restore, {text:?} before");
        ensure!(cached(&usage) > 0, "not restored: {usage}");
    }
    let e = wait_ssd(&p, "restored", |s| s["hits"].as_u64() >= Some(3)).await?;
    ensure!(e["stats"]["ssd"]["invalid"].as_u64() == Some(0), "{e}");
    Ok(())
}
