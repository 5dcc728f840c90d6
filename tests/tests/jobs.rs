//! Managed jobs end to end: `mlxd` with the real engine binary (`mlxd-engine __job`) and real
//! MLX. Quantizing a tiny random model and the default model's weights through the API
//! (progress events, the output served by mlxd, greedy parity with mlx-lm), cancelling
//! mid-way (no process, no partial directory), a job killed with `kill -9` (failed, serving
//! unaffected), memory admission (refused with the numbers, queued while it does not fit),
//! bad input (400 naming the field), `TaskClient` and `mlxd quantize` against the real server.
//!
//! Prerequisites (from `scripts/setup.sh --test` and `scripts/test.sh`): `target/test-models`,
//! the converted default model in `MLXD_TEST_HOME`, `.venv` with mlx-lm. A missing one fails
//! the test with the reason.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures::StreamExt;
use mlxd_client::{ClientError, JobRequest, JobState, JobUpdate, TaskClient};
use mlxd_tests::*;
use serde_json::{json, Value};

/// The default model as the store converted it (SmolLM2-135M, from its GGUF).
fn default_model_dir() -> Result<PathBuf> {
    let home = test_home();
    let dir = home.join("models/smollm2-135m");
    ensure!(
        dir.join("config.json").is_file(),
        "{} is missing: run scripts/test.sh (it converts the default model)",
        dir.display()
    );
    Ok(dir)
}

/// `mlxd serve` with the real engine, serving tiny-llama, with its own store (`home`).
struct Mlxd {
    process: MlxdProcess,
    addr: SocketAddr,
    home: PathBuf,
}

impl Mlxd {
    async fn start(models: &[&Path], args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let mut b = MlxdProcess::builder()
            .engine(built_engine_bin()?)
            .own_home()
            .args(args)
            .ready_within(Duration::from_secs(30));
        for m in models {
            b = b.model(m);
        }
        for (k, v) in env {
            b = b.env(k, v);
        }
        let process = b.start().await?;
        let home = process.home.clone().context("its own store")?;
        Ok(Self {
            addr: process.addr,
            home,
            process,
        })
    }

    fn log(&self) -> String {
        self.process.stderr()
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn post_job(&self, body: Value) -> Result<(u16, Value)> {
        let (status, _, v) = post_json(self.addr, "/v1/jobs", &body).await?;
        Ok((status.as_u16(), v))
    }

    async fn job(&self, id: &str) -> Result<Value> {
        let (status, _, v) =
            json_of(send(self.addr, "GET", &format!("/v1/jobs/{id}"), None).await?).await?;
        ensure!(status == 200, "GET job {id}: {status} {v}");
        Ok(v)
    }

    /// Polls job `id` until `done(job)` holds.
    async fn wait_job(&self, id: &str, done: impl Fn(&Value) -> bool) -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let job = self.job(id).await?;
            if done(&job) {
                return Ok(job);
            }
            if Instant::now() > deadline {
                bail!("job {id} never got there: {job}\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Posts a job that must fail once it runs; returns its error.
    async fn failure_of(&self, body: Value) -> Result<String> {
        let (status, job) = self.post_job(body).await?;
        ensure!(status == 201, "{status} {job}");
        let id = job["id"].as_str().context("id")?.to_string();
        let done = self
            .wait_job(&id, |j| j["state"] == "failed" || j["state"] == "succeeded")
            .await?;
        ensure!(done["state"] == "failed", "the job did not fail: {done}");
        Ok(done["error"].as_str().unwrap_or_default().to_string())
    }

    async fn chat(&self, model: &str, prompt: &str, max_tokens: u32) -> Result<(u16, Value)> {
        let body = json!({"model": model, "messages": [{"role": "user", "content": prompt}],
                          "max_tokens": max_tokens, "temperature": 0});
        let (status, _, v) = post_json(self.addr, "/v1/chat/completions", &body).await?;
        Ok((status.as_u16(), v))
    }
}

/// Entries of `dir` whose name marks a job's staging directory.
fn staging_dirs(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(".mlxd-job-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether any process is left in process group `pgid`.
fn group_alive(pgid: i32) -> bool {
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), None).is_ok() && !process_gone(pgid)
}

/// Greedy token ids for prompt `ids` from a standalone engine (`/v1/completions`, token
/// prompt; the engine keeps the ids that `mlxd` strips).
async fn greedy(engine: &EngineProcess, ids: &[u32], max_tokens: u32) -> Result<Vec<u32>> {
    let body = json!({"prompt": ids, "max_tokens": max_tokens, "temperature": 0});
    let (status, v) = engine.post("/v1/completions", body).await?;
    ensure!(status == 200, "completions: {status} {v}");
    v["choices"][0]["mlxd"]["token_ids"]
        .as_array()
        .context("no token_ids")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .context("a token id")
        })
        .collect()
}

/// The SSE events of `GET /v1/jobs/{id}?follow=1` as (name, data).
async fn follow(addr: SocketAddr, id: &str) -> Result<Vec<(String, Value)>> {
    let resp = send(addr, "GET", &format!("/v1/jobs/{id}?follow=1"), None).await?;
    ensure!(resp.status() == 200, "follow: {}", resp.status());
    let events = tokio::time::timeout(Duration::from_secs(300), read_events(resp))
        .await
        .context("the follow stream did not end")??;
    let mut out = Vec::new();
    for (_, ev) in events {
        let mut name = String::new();
        let mut data = None;
        for line in ev.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str(d)?);
            }
        }
        if let Some(d) = data {
            out.push((name, d));
        }
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantizing_a_tiny_model_streams_progress_and_the_output_serves_in_mlxd_and_mlx_lm(
) -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let mlxd = Mlxd::start(&[&tiny], &[], &[]).await?;
    let (status, job) = mlxd
        .post_job(json!({"kind": "quantize", "model": tiny, "bits": 4, "group_size": 64}))
        .await?;
    ensure!(status == 201, "{status} {job}");
    let id = job["id"].as_str().context("job id")?.to_string();
    let events = follow(mlxd.addr, &id).await?;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"job"), "{names:?}");
    assert_eq!(names.last(), Some(&"result"), "{names:?}");
    let progress: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "progress")
        .map(|(_, v)| v)
        .collect();
    assert!(
        progress
            .iter()
            .any(|p| p["phase"] == "quantizing" && p["unit"] == "tensors"),
        "{progress:?}"
    );
    let result = &events.last().expect("a result").1;
    assert_eq!(result["state"], "succeeded", "{result}");
    let out = PathBuf::from(result["result"]["dir"].as_str().context("result dir")?);
    assert_eq!(out, mlxd.home.join("models/tiny-llama-4bit-g64"));
    let config: Value = serde_json::from_slice(&std::fs::read(out.join("config.json"))?)?;
    assert_eq!(
        config["quantization"],
        json!({"group_size": 64, "bits": 4, "mode": "affine"})
    );
    assert_eq!(config["quantization_config"], config["quantization"]);
    assert!(staging_dirs(&mlxd.home.join("models")).is_empty());

    // Served by mlxd, and the same greedy tokens as mlx-lm.
    let served = Mlxd::start(&[&out], &[], &[]).await?;
    let (status, v) = served.chat("tiny-llama-4bit-g64", "Hello", 8).await?;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    let engine = EngineProcess::start(&out).await?;
    let prompt = [1u32, 40, 72, 101, 108, 108];
    let ours = greedy(&engine, &prompt, 8).await?;
    assert_eq!(ours, mlx_lm_greedy(&out, 8, &prompt)?, "greedy parity");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_models_weights_requantized_to_8_bit_answer_in_mlxd_with_mlx_lm_parity(
) -> Result<()> {
    let source = default_model_dir()?;
    let mlxd = Mlxd::start(&[&source], &[], &[]).await?;
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    let mut seen = 0;
    let done = tasks
        .run(
            &JobRequest::Quantize {
                model: source.display().to_string(),
                bits: Some(8),
                group_size: Some(64),
                out: None,
            },
            |_| seen += 1,
        )
        .await?;
    assert!(seen > 0, "progress reached the TaskClient");
    let out = done.result.context("a result")?.dir;
    assert_eq!(out, mlxd.home.join("models/smollm2-135m-8bit-g64"));
    let served = Mlxd::start(&[&out], &[], &[]).await?;
    let (status, v) = served
        .chat(
            "smollm2-135m-8bit-g64",
            "What is the capital of France?",
            12,
        )
        .await?;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(text.contains("Paris"), "{v}");
    let engine = EngineProcess::start(&out).await?;
    let prompt = [1u32, 504, 3458, 282, 4649, 314];
    let ours = greedy(&engine, &prompt, 6).await?;
    assert_eq!(ours, mlx_lm_greedy(&out, 6, &prompt)?, "greedy parity");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_way_kills_the_process_group_and_leaves_no_partial_directory() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let mlxd = Mlxd::start(
        &[&tiny],
        &[],
        &[("MLXD_ALLOW_FAULTS", "1"), ("MLXD_JOB_FAULT", "stall@3")],
    )
    .await?;
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    let job = tasks
        .submit(&JobRequest::Quantize {
            model: tiny.display().to_string(),
            bits: None,
            group_size: None,
            out: None,
        })
        .await?;
    // Follow until the job is mid-way (three tensors done; it stalls there).
    let mut updates = tasks.follow(&job.id).await?;
    while let Some(u) = updates.next().await {
        if let JobUpdate::Progress(p) = u? {
            if p.done >= 3 {
                break;
            }
        }
    }
    let running = tasks.get(&job.id).await?;
    let pid = running.pid.context("a running job has a pid")? as i32;
    let models = mlxd.home.join("models");
    let staging = staging_dirs(&models);
    assert_eq!(staging.len(), 1, "partial output exists before the cancel");
    let cancelled = tasks.cancel(&job.id).await?;
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert!(!group_alive(pid), "the job's process group is gone");
    assert!(
        staging_dirs(&models).is_empty(),
        "{:?}",
        staging_dirs(&models)
    );
    assert!(!models.join("tiny-llama-4bit-g64").exists());
    // Cancelling again is a conflict; an unknown job is 404.
    match tasks.cancel(&job.id).await {
        Err(ClientError::Api { status: 409, .. }) => {}
        other => bail!("expected 409, got {other:?}"),
    }
    match tasks.get("job-999").await {
        Err(ClientError::Api { status: 404, .. }) => {}
        other => bail!("expected 404, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_killed_with_sigkill_is_failed_and_serving_goes_on() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let mlxd = Mlxd::start(
        &[&tiny],
        &[],
        &[("MLXD_ALLOW_FAULTS", "1"), ("MLXD_JOB_FAULT", "stall@2")],
    )
    .await?;
    // A loaded engine.
    let (status, v) = mlxd.chat("tiny-llama", "Hello", 4).await?;
    assert_eq!(status, 200, "{v}");
    let (status, job) = mlxd
        .post_job(json!({"kind": "quantize", "model": tiny, "bits": 8}))
        .await?;
    ensure!(status == 201, "{status} {job}");
    let id = job["id"].as_str().context("id")?.to_string();
    let running = mlxd
        .wait_job(&id, |j| j["progress"]["done"].as_u64() >= Some(2))
        .await?;
    // Serving during the job.
    let (status, v) = mlxd.chat("tiny-llama", "During", 4).await?;
    assert_eq!(status, 200, "{v}");
    let pid = running["pid"].as_i64().context("pid")? as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let failed = mlxd.wait_job(&id, |j| j["state"] != "running").await?;
    assert_eq!(failed["state"], "failed", "{failed}");
    let error = failed["error"].as_str().unwrap_or_default();
    assert!(error.contains("signal 9"), "{error}");
    assert!(staging_dirs(&mlxd.home.join("models")).is_empty());
    // Serving after the job, on the same engine.
    let (status, v) = mlxd.chat("tiny-llama", "After", 4).await?;
    assert_eq!(status, 200, "{v}");
    let (_, _, engines) = json_of(send(mlxd.addr, "GET", "/engines", None).await?).await?;
    assert_eq!(engines["engines"][0]["restarts"], 0, "{engines}");
    // The TaskClient reports the failure typed.
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    match tasks.wait(&id, |_| {}).await {
        Err(ClientError::Job(job)) => assert_eq!(job.state, JobState::Failed),
        other => bail!("expected ClientError::Job, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_admitted_against_the_memory_budget() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    // A budget below one job's estimate: refused with the numbers.
    let small = Mlxd::start(&[&tiny], &["--memory-budget", "64MiB"], &[]).await?;
    let (status, v) = small
        .post_job(json!({"kind": "quantize", "model": tiny}))
        .await?;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "insufficient_memory", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("needs an estimated") && message.contains("67108864"),
        "{message}"
    );
    drop(small);

    // Room for one job at a time: the second waits, visible in GET, and starts once the first
    // is cancelled.
    let mlxd = Mlxd::start(
        &[&tiny],
        &["--memory-budget", "400MiB"],
        &[("MLXD_ALLOW_FAULTS", "1"), ("MLXD_JOB_FAULT", "stall@1")],
    )
    .await?;
    let out = |n: &str| mlxd.home.join(n).display().to_string();
    let (s1, first) = mlxd
        .post_job(json!({"kind": "quantize", "model": tiny, "out": out("a")}))
        .await?;
    let (s2, second) = mlxd
        .post_job(json!({"kind": "quantize", "model": tiny, "out": out("b")}))
        .await?;
    ensure!(s1 == 201 && s2 == 201, "{first} {second}");
    assert_eq!(first["state"], "running", "{first}");
    assert_eq!(second["state"], "queued", "{second}");
    let waiting = second["waiting_for"].as_str().unwrap_or_default();
    assert!(waiting.contains("memory: needs"), "{waiting}");
    let (_, _, list) = json_of(send(mlxd.addr, "GET", "/v1/jobs", None).await?).await?;
    assert_eq!(list["jobs"].as_array().map(Vec::len), Some(2), "{list}");
    let first_id = first["id"].as_str().context("id")?;
    let second_id = second["id"].as_str().context("id")?;
    let (status, _, v) =
        json_of(send(mlxd.addr, "DELETE", &format!("/v1/jobs/{first_id}"), None).await?).await?;
    assert_eq!(status, 200, "{v}");
    mlxd.wait_job(second_id, |j| j["state"] == "running")
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_job_requests_are_400s_naming_the_field() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let mlxd = Mlxd::start(&[&tiny], &[], &[]).await?;
    for (body, param) in [
        (json!({"model": tiny}), "kind"),
        (json!({"kind": "shrink"}), "kind"),
        (json!({"kind": "quantize"}), "model"),
        (
            json!({"kind": "quantize", "model": "/no/such/model"}),
            "model",
        ),
        (
            json!({"kind": "quantize", "model": tiny, "bits": 2}),
            "bits",
        ),
        (
            json!({"kind": "quantize", "model": tiny, "group_size": 100}),
            "group_size",
        ),
        (
            json!({"kind": "quantize", "model": tiny, "out": "relative/dir"}),
            "out",
        ),
        (
            json!({"kind": "quantize", "model": tiny, "out": tiny}),
            "out",
        ),
        (json!({"kind": "convert", "gguf": "/no/such.gguf"}), "gguf"),
        (json!({"kind": "fetch", "model": "not a repo id"}), "model"),
    ] {
        let (status, v) = mlxd.post_job(body.clone()).await?;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}: {v}");
    }
    // Through the TaskClient: the same 400, typed.
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    match tasks
        .submit(&JobRequest::Quantize {
            model: tiny.display().to_string(),
            bits: Some(3),
            group_size: None,
            out: None,
        })
        .await
    {
        Err(e @ ClientError::Api { status: 400, .. }) => {
            assert_eq!(
                e.body().and_then(|b| b.error.param.as_deref()),
                Some("bits")
            )
        }
        other => bail!("expected a 400, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlxd_quantize_and_mlxd_jobs_on_the_command_line() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let mlxd = Mlxd::start(&[&tiny], &[], &[]).await?;
    let out = Command::new(mlxd_bin()?)
        .args(["quantize"])
        .arg(&tiny)
        .args(["--bits", "8", "--group-size", "32", "--url", &mlxd.url()])
        .args(["--out", "tiny-q8"])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("tiny-q8 ready in"), "{stdout}");
    assert!(
        stderr.contains("quantizing"),
        "plain progress lines: {stderr}"
    );
    assert!(mlxd.home.join("models/tiny-q8/config.json").is_file());
    // The new model is in the store: the running server lists it and serves it by name,
    // with no config entry and no restart.
    let client = |args: &[&str]| -> Result<(bool, String, String)> {
        let out = Command::new(mlxd_bin()?)
            .args(args)
            .args(["--url", &mlxd.url()])
            .output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let (ok, listed, err) = client(&["ls", "--server"])?;
    assert!(ok && listed.contains("tiny-q8"), "{listed}\n{err}");
    let (ok, answer, err) = client(&["run", "tiny-q8", "Hello", "--max-tokens", "3"])?;
    assert!(
        ok && !answer.trim().is_empty(),
        "{answer}\n{err}\n{}",
        mlxd.log()
    );
    let list = Command::new(mlxd_bin()?)
        .args(["jobs", "--url", &mlxd.url()])
        .output()?;
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(
        list.status.success() && table.contains("succeeded"),
        "{table}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn convert_and_fetch_jobs_put_complete_models_in_the_store() -> Result<()> {
    let gguf = smollm2_gguf()?;
    let tiny = tiny_model("tiny-llama")?;
    let gguf_env = gguf.display().to_string();
    // The default model's fetch reads the local GGUF instead of PyPI.
    let mlxd = Mlxd::start(&[&tiny], &[], &[("MLXD_SMOLLM2_GGUF", &gguf_env)]).await?;
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    let converted = tasks
        .run(
            &JobRequest::Convert {
                gguf: gguf_env.clone(),
                out: None,
            },
            |_| {},
        )
        .await?;
    let dir = converted.result.context("a result")?.dir;
    assert_eq!(dir, mlxd.home.join("models/SmolLM2-135M-Instruct.Q4_1"));
    assert!(dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file());
    let fetched = tasks
        .run(&JobRequest::Fetch { model: None }, |_| {})
        .await?;
    let result = fetched.result.context("a result")?;
    assert_eq!(result.model_id, "smollm2-135m");
    assert_eq!(result.dir, mlxd.home.join("models/smollm2-135m"));
    assert!(staging_dirs(&mlxd.home.join("models")).is_empty());
    // The converted directory serves.
    let served = Mlxd::start(&[&dir], &[], &[]).await?;
    let (status, v) = served
        .chat(
            "SmolLM2-135M-Instruct.Q4_1",
            "What is the capital of France?",
            12,
        )
        .await?;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .contains("Paris"),
        "{v}"
    );
    Ok(())
}

/// A copy of the data of the tiny adapter fixture `name` (`scripts/gen_lora_adapter.py`
/// writes it beside the adapter: 8 training and 8 validation lines of text).
fn lora_data(name: &str) -> Result<tempfile::TempDir> {
    let from = test_models().join(name).join("data");
    ensure!(
        from.join("train.jsonl").is_file(),
        "{} is missing: scripts/test.sh generates it with scripts/gen_lora_adapter.py",
        from.display()
    );
    let dir = tempfile::tempdir()?;
    for f in ["train.jsonl", "valid.jsonl"] {
        std::fs::copy(from.join(f), dir.path().join(f))?;
    }
    Ok(dir)
}

/// A lora request's settings for the tiny data: one batch of all 8 examples, a few steps.
fn lora_body(model: &Path, data: &Path, out: &str, iters: u64) -> Value {
    json!({"kind": "lora", "model": model, "data": data, "out": out, "iters": iters,
           "batch_size": 8, "rank": 4, "scale": 10.0, "num_layers": -1,
           "learning_rate": 1e-3, "steps_per_eval": 2, "save_every": 2,
           "val_batches": 1, "max_seq_length": 64})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_job_reports_progress_is_cancelled_and_resumed_and_mlx_lm_loads_its_adapter(
) -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let data = lora_data("tiny-llama-lora-b")?;
    // A fresh run stalls after iteration 3 (the checkpoint of iteration 2 written).
    let mlxd = Mlxd::start(
        &[&tiny],
        &[],
        &[("MLXD_ALLOW_FAULTS", "1"), ("MLXD_JOB_FAULT", "stall@3")],
    )
    .await?;
    let (status, job) = mlxd
        .post_job(lora_body(&tiny, data.path(), "trained", 6))
        .await?;
    ensure!(status == 201, "{status} {job}");
    assert_eq!(
        job["request"]["optimizer"], "adam",
        "defaults filled in: {job}"
    );
    let id = job["id"].as_str().context("id")?.to_string();
    let running = mlxd
        .wait_job(&id, |j| {
            j["progress"]["training"]["iteration"].as_u64() >= Some(3)
        })
        .await?;
    let t = &running["progress"]["training"];
    assert_eq!(running["progress"]["unit"], "iterations", "{running}");
    assert!(t["train_loss"].as_f64().is_some_and(f64::is_finite), "{t}");
    // mlx-lm validates before iteration 2 (steps_per_eval 2): after 1 update.
    assert_eq!(t["val_iteration"], 1, "{t}");
    assert!(t["tokens_per_second"].as_f64() > Some(0.0), "{t}");
    assert!(t["peak_memory_bytes"].as_u64() > Some(0), "{t}");
    assert_eq!(t["checkpoint"], 2, "{t}");

    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    let cancelled = tasks.cancel(&id).await?;
    assert_eq!(cancelled.state, JobState::Cancelled);
    let adapters = mlxd.home.join("adapters");
    assert!(
        !adapters.join("trained").exists(),
        "no adapter after a cancel"
    );
    assert!(
        staging_dirs(&adapters).is_empty(),
        "{:?}",
        staging_dirs(&adapters)
    );
    assert!(adapters
        .join(".trained.checkpoints/checkpoint.safetensors")
        .is_file());

    // Resumed through the client library: it continues from iteration 2 and finishes.
    let mut request: JobRequest =
        serde_json::from_value(lora_body(&tiny, data.path(), "trained", 6))?;
    if let JobRequest::Lora { resume, .. } = &mut request {
        *resume = true;
    }
    let mut first_iteration = None;
    let done = tasks
        .run(&request, |p| {
            if let Some(t) = &p.training {
                first_iteration.get_or_insert(t.iteration);
            }
        })
        .await?;
    assert_eq!(done.state, JobState::Succeeded, "{done:?}");
    assert_eq!(
        first_iteration,
        Some(2),
        "the resumed run starts at the checkpoint"
    );
    let out = done.result.context("a result")?.dir;
    assert_eq!(out, adapters.join("trained"));
    assert!(!adapters.join(".trained.checkpoints").exists());
    // mlx-lm loads what mlxd wrote, and it changes the base's greedy tokens.
    let prompt = [1u32, 20, 31, 42, 53];
    let with = mlx_lm_greedy_with_adapter(&tiny, &out, 6, &prompt)?;
    assert_ne!(with, mlx_lm_greedy(&tiny, 6, &prompt)?);
    Ok(())
}

/// `grad_checkpoint`: the same losses as without, and a lower peak memory on long sequences
/// (each job runs in its own process, so MLX's peak counter is that run's alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradient_checkpointing_keeps_the_losses_and_lowers_the_peak_memory() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    // Two examples of about 400 tokens each: the activations dwarf the tiny model.
    let data = tempfile::tempdir()?;
    let words = [
        "red", "green", "blue", "cat", "dog", "bird", "runs", "sleeps", "river",
    ];
    for split in ["train", "valid"] {
        let mut text = String::new();
        for line in 0..2 {
            let words: Vec<&str> = (0..120)
                .map(|i| words[(i * 7 + line) % words.len()])
                .collect();
            text.push_str(&json!({ "text": words.join(" ") }).to_string());
            text.push('\n');
        }
        std::fs::write(data.path().join(format!("{split}.jsonl")), text)?;
    }
    let mlxd = Mlxd::start(&[&tiny], &[], &[]).await?;
    let tasks = TaskClient::new(mlxd_client::Client::builder().http(&mlxd.url())?);
    let mut figures = Vec::new();
    for (out, checkpointed) in [("plain", false), ("checkpointed", true)] {
        let mut body = lora_body(&tiny, data.path(), out, 2);
        body["batch_size"] = json!(2);
        body["max_seq_length"] = json!(1024);
        body["grad_checkpoint"] = json!(checkpointed);
        let request: JobRequest = serde_json::from_value(body)?;
        let done = tasks.run(&request, |_| {}).await?;
        assert_eq!(done.state, JobState::Succeeded, "{done:?}");
        let t = done.progress.and_then(|p| p.training).context("figures")?;
        figures.push(t);
    }
    let (plain, checkpointed) = (&figures[0], &figures[1]);
    eprintln!("without: {plain:?}\nwith:    {checkpointed:?}");
    let loss = |t: &mlxd_protocol::jobs::TrainingProgress| (t.train_loss, t.val_loss);
    let ((a, va), (b, vb)) = (loss(plain), loss(checkpointed));
    let close = |x: Option<f64>, y: Option<f64>| matches!((x, y), (Some(x), Some(y)) if (x - y).abs() <= 1e-5);
    // Iteration 2's loss and the validation before it come after an update: the gradients
    // through the recomputed layers are the same too.
    assert_eq!(plain.val_iteration, Some(1));
    assert!(
        close(a, b) && close(va, vb),
        "{plain:?} vs {checkpointed:?}"
    );
    assert!(plain.trained_tokens > 2 * 300, "long sequences: {plain:?}");
    assert!(
        checkpointed.peak_memory_bytes < plain.peak_memory_bytes,
        "peak memory {} with checkpointing, {} without",
        checkpointed.peak_memory_bytes,
        plain.peak_memory_bytes
    );
    Ok(())
}

/// `mlxd serve` passes `MLXD_TRAIN_COMPILE` on to its jobs (their environment is otherwise
/// cleared): a value the job refuses fails it, naming the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_training_step_switch_reaches_the_job_through_mlxd() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let data = lora_data("tiny-llama-lora-b")?;
    let mlxd = Mlxd::start(&[&tiny], &[], &[("MLXD_TRAIN_COMPILE", "2")]).await?;
    let error = mlxd
        .failure_of(lora_body(&tiny, data.path(), "switch", 2))
        .await?;
    assert!(error.contains("MLXD_TRAIN_COMPILE"), "{error}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlxd_train_on_the_command_line_and_bad_data_fails_with_its_line() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let data = lora_data("tiny-llama-lora-a")?;
    let mlxd = Mlxd::start(&[&tiny], &[], &[]).await?;
    let out = Command::new(mlxd_bin()?)
        .args(["train", "--model"])
        .arg(&tiny)
        .arg("--data")
        .arg(data.path())
        .args([
            "--iters",
            "2",
            "--batch-size",
            "8",
            "--rank",
            "4",
            "--num-layers",
            "-1",
            "--fine-tune-type",
            "dora",
            "--grad-checkpoint",
        ])
        .args([
            "--max-seq-length",
            "64",
            "--out",
            "cli-adapter",
            "--url",
            &mlxd.url(),
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}\n{}", mlxd.log());
    assert!(stdout.contains("adapter cli-adapter ready in"), "{stdout}");
    assert!(stderr.contains("training 2/2: train loss"), "{stderr}");
    let adapter = mlxd.home.join("adapters/cli-adapter");
    assert!(adapter.join("adapters.safetensors").is_file());
    let config: Value =
        serde_json::from_slice(&std::fs::read(adapter.join("adapter_config.json"))?)?;
    assert_eq!(config["lora_parameters"]["rank"], 4, "{config}");
    // A DoRA adapter (mlx-lm's config and its magnitudes), fused below.
    assert_eq!(config["fine_tune_type"], "dora", "{config}");
    let weights = std::fs::read(adapter.join("adapters.safetensors"))?;
    let header_len = u64::from_le_bytes(weights[..8].try_into()?) as usize;
    let header: Value = serde_json::from_slice(&weights[8..8 + header_len])?;
    assert!(
        header.get("model.layers.0.mlp.up_proj.m").is_some(),
        "{header}"
    );

    // Fused into its base: a new model in the store, served by its name at once.
    let out = Command::new(mlxd_bin()?)
        .args(["fuse", "--model"])
        .arg(&tiny)
        .args([
            "--adapter",
            "cli-adapter",
            "--out",
            "tiny-fused",
            "--url",
            &mlxd.url(),
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("tiny-fused ready in"), "{stdout}");
    let (status, v) = mlxd.chat("tiny-fused", "Hello", 3).await?;
    assert_eq!(status, 200, "{v}");

    // A malformed line: the job fails naming the file and line, and nothing is written.
    std::fs::write(
        data.path().join("train.jsonl"),
        "{\"text\": \"red cat\"}\n{\"text\": 7}\n",
    )?;
    let error = mlxd
        .failure_of(lora_body(&tiny, data.path(), "bad", 2))
        .await?;
    assert!(
        error.contains("train.jsonl:2: \"text\" must be a string"),
        "{error}"
    );
    let adapters = mlxd.home.join("adapters");
    assert!(!adapters.join("bad").exists());
    assert!(!adapters.join(".bad.checkpoints").exists());
    assert!(staging_dirs(&adapters).is_empty());

    // A full fine-tune is refused before anything starts.
    let mut body = lora_body(&tiny, data.path(), "full", 2);
    body["fine_tune_type"] = json!("full");
    let (status, v) = mlxd.post_job(body).await?;
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("full"), "{v}");
    Ok(())
}
