//! LoRA adapters at run time, end to end with a real `mlxd` and the real engine on the tiny
//! Llama (issue 25):
//!
//! - through the client library: `TaskClient` trains an adapter (a typed `lora` job, its
//!   progress followed), `Client::load_adapter` serves it as `<model>:<name>` to the ordinary
//!   chat methods, errors come back as 404s and 409s that say so, `mlxd adapter` (which goes
//!   through the same methods) lists, loads and unloads, and a typed `fuse` job makes a model
//!   that answers as the base with the adapter does;
//! - the overlay of adapters loaded at run time, kept across a `SIGHUP` reload (unchanged,
//!   then changed) and a standby engine's takeover after kill -9 of the serving one, with a
//!   stream in flight on the adapter resumed byte for byte.
//!
//! Needs what `scripts/test.sh` provides: the engine binary, the tiny models and the tiny
//! adapter fixtures (`scripts/gen_lora_adapter.py`) in `$MLXD_TEST_MODELS`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use futures::StreamExt;
use http_body_util::BodyExt;
use mlxd_client::{
    ChatCompletionRequest, ChatMessage, Client, CompletionClient, GenerationParams, JobRequest,
    JobState, Role, TaskClient, TrainParams,
};
use mlxd_tests::*;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// The tiny adapter fixture `name` (an mlx-lm adapter directory).
fn fixture(name: &str) -> Result<PathBuf> {
    let dir = test_models().join(name);
    ensure!(
        dir.join("adapters.safetensors").is_file(),
        "test adapter {} is missing (scripts/test.sh generates it)",
        dir.display()
    );
    Ok(dir)
}

/// A greedy chat request of `max_tokens` to `model`.
fn greedy(model: &str, content: &str, max_tokens: i64) -> ChatCompletionRequest {
    ChatCompletionRequest {
        model: Some(model.to_owned()),
        messages: vec![ChatMessage::new(Role::User, content)],
        params: GenerationParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The text of a greedy answer of 12 tokens.
async fn answer(client: &Client, model: &str) -> Result<String> {
    let r = client
        .complete(greedy(model, "red green blue cat", 12))
        .await
        .with_context(|| format!("chat with {model}"))?;
    r.choices[0]
        .message
        .content
        .clone()
        .context("an answer without content")
}

/// `mlxd` with the real engine and its own store, serving `model` (a path; `None`: the
/// configuration's models, with the harness's `fake-model` beside them) with `args`.
async fn mlxd(model: Option<&Path>, args: &[&str]) -> Result<MlxdProcess> {
    let mut b = MlxdProcess::builder()
        .engine(built_engine_bin()?)
        .own_home()
        .args(args)
        .ready_within(Duration::from_secs(30));
    if let Some(m) = model {
        b = b.model(m);
    }
    b.start().await
}

/// Runs `mlxd adapter --url URL ARGS` and returns its stdout; fails with its stderr.
fn adapter_verb(p: &MlxdProcess, args: &[&str]) -> Result<String> {
    let out = Command::new(mlxd_bin()?)
        .args(["adapter", "--url", &p.url()])
        .args(args)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "mlxd adapter {args:?}: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_library_trains_serves_unloads_and_fuses_an_adapter() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let p = mlxd(Some(&tiny), &[]).await?;
    let home = p.home.clone().context("its own store")?;
    let client = Client::builder().http(&p.url())?;
    let tasks = TaskClient::new(client.clone());
    let model = client.models().await?.data[0].id.clone();

    // A typed lora job on the fixture's data, followed to its result.
    let data = tempfile::tempdir()?;
    for f in ["train.jsonl", "valid.jsonl"] {
        std::fs::copy(
            fixture("tiny-llama-lora-a")?.join("data").join(f),
            data.path().join(f),
        )?;
    }
    let lora = JobRequest::Lora {
        model: tiny.display().to_string(),
        data: data.path().display().to_string(),
        out: Some("client-lora".into()),
        resume: false,
        init_adapter: None,
        params: TrainParams {
            iters: 4,
            batch_size: 8,
            rank: 4,
            scale: 10.0,
            num_layers: -1,
            learning_rate: 1e-3,
            steps_per_eval: 2,
            save_every: 2,
            val_batches: 1,
            max_seq_length: 64,
            ..Default::default()
        },
    };
    let mut seen = Vec::new();
    let trained = tasks
        .run(&lora, |progress| {
            if let Some(t) = &progress.training {
                seen.push((t.iteration, t.train_loss, t.val_loss));
            }
        })
        .await?;
    assert_eq!(trained.state, JobState::Succeeded, "{trained:?}");
    let last = *seen
        .last()
        .context("no training progress reached the client")?;
    assert_eq!(last.0, 4, "{seen:?}");
    assert!(
        last.1.is_some_and(f64::is_finite) && last.2.is_some_and(f64::is_finite),
        "{seen:?}"
    );
    let dir = trained.result.context("a result")?.dir;
    assert_eq!(dir, home.join("adapters/client-lora"));

    // Loaded at run time: listed, and a model name for the ordinary chat methods.
    let base_text = answer(&client, &model).await?;
    let loaded = client.load_adapter(&model, "mine", &dir).await?;
    assert_eq!(
        (loaded.id.as_str(), loaded.parent.as_str(), loaded.rank),
        (format!("{model}:mine").as_str(), model.as_str(), 4)
    );
    let listed = client.adapters(&model).await?;
    assert_eq!(listed.model, model);
    let names: Vec<(&str, bool)> = listed
        .data
        .iter()
        .map(|a| (a.name.as_str(), a.runtime))
        .collect();
    assert_eq!(names, [("mine", true)]);
    let mine = format!("{model}:mine");
    let adapter_text = answer(&client, &mine).await?;
    assert_ne!(adapter_text, base_text, "the adapter changes the answer");
    // Streamed, the same text.
    let mut stream = client
        .stream(greedy(&mine, "red green blue cat", 12))
        .await?;
    let mut streamed = String::new();
    while let Some(chunk) = stream.next().await {
        if let Some(c) = chunk?.choices.first().and_then(|c| c.delta.content.clone()) {
            streamed.push_str(&c);
        }
    }
    assert_eq!(streamed, adapter_text);

    // 409 and 404, told apart with their codes.
    let taken = client.load_adapter(&model, "mine", &dir).await.unwrap_err();
    assert!(taken.is_conflict(), "{taken}");
    assert_eq!(taken.code(), Some("adapter_exists"), "{taken}");
    let absent = client.unload_adapter(&model, "nope").await.unwrap_err();
    assert!(absent.is_not_found() && !absent.is_conflict(), "{absent}");
    let unknown = client.adapters("no-such-model").await.unwrap_err();
    assert!(unknown.is_not_found(), "{unknown}");
    // In use by a stream in flight: refused with a 409 until it ends.
    let mut long = client.stream(greedy(&mine, "one two three", 400)).await?;
    long.next().await.context("no first chunk")??;
    let busy = client.unload_adapter(&model, "mine").await.unwrap_err();
    assert!(busy.is_conflict(), "{busy}");
    assert_eq!(busy.code(), Some("adapter_in_use"), "{busy}");
    while let Some(chunk) = long.next().await {
        chunk?;
    }
    let gone = client.unload_adapter(&model, "mine").await?;
    assert_eq!(gone.id, mine);
    let refused = client.complete(greedy(&mine, "hi", 2)).await.unwrap_err();
    assert!(refused.is_not_found(), "{refused}");
    assert_eq!(refused.code(), Some("model_not_found"), "{refused}");

    // `mlxd adapter`, the same methods on the command line.
    let out = adapter_verb(&p, &["load", &model, "cli", dir.to_str().context("path")?])?;
    assert_eq!(
        out,
        format!(
            "{model}:cli loaded (lora, rank 4, {} layers)\n",
            loaded.layers
        )
    );
    let out = adapter_verb(&p, &["ls", &model])?;
    assert_eq!(out, format!("{model}:cli\trun time\t{}\n", dir.display()));
    assert_eq!(
        answer(&client, &format!("{model}:cli")).await?,
        adapter_text
    );
    let out = adapter_verb(&p, &["unload", &model, "cli"])?;
    assert_eq!(out, format!("{model}:cli unloaded\n"));
    assert_eq!(
        adapter_verb(&p, &["ls", &model])?,
        format!("{model} has no adapters\n")
    );

    // A typed fuse job: a model of its own that answers as the base with the adapter.
    let fused = tasks
        .run(
            &JobRequest::Fuse {
                model: tiny.display().to_string(),
                adapter: "client-lora".into(),
                out: Some("client-fused".into()),
            },
            |_| {},
        )
        .await?;
    let fused = fused.result.context("a result")?;
    assert_eq!(fused.dir, home.join("models/client-fused"));
    assert_eq!(answer(&client, &fused.model_id).await?, adapter_text);
    Ok(())
}

/// tiny-llama's row of `/engines`.
async fn engine_row(p: &MlxdProcess) -> Result<Value> {
    let (status, _, v) = json_of(send(p.addr, "GET", "/engines", None).await?).await?;
    ensure!(status == 200, "/engines: {status} {v}");
    v["engines"]
        .as_array()
        .and_then(|rows| rows.iter().find(|e| e["model"] == "tiny-llama").cloned())
        .with_context(|| format!("no row for tiny-llama: {v}"))
}

/// Polls `/engines` until `pred` holds for tiny-llama's row.
async fn wait_row(p: &MlxdProcess, what: &str, pred: impl Fn(&Value) -> bool) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let row = engine_row(p).await?;
        if pred(&row) {
            return Ok(row);
        }
        if Instant::now() > deadline {
            bail!("never {what}: {row}\nmlxd's log:\n{}", p.stderr());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits for `needle` in mlxd's log past byte `after`.
async fn wait_log(p: &MlxdProcess, needle: &str, after: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !p.stderr().get(after..).is_some_and(|l| l.contains(needle)) {
        if Instant::now() > deadline {
            bail!("no {needle:?} in mlxd's log:\n{}", p.stderr());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Writes the configuration whole and renames it into place, as editors do.
fn write_config(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// A greedy stream of 300 tokens on `model`, as raw SSE events; with `kill`, the engine of
/// that pid is killed (-9) once 20 content events have arrived.
async fn stream_events(p: &MlxdProcess, model: &str, kill: Option<i32>) -> Result<String> {
    let body = json!({"model": model, "stream": true, "max_tokens": 300, "temperature": 0,
                      "messages": [{"role": "user", "content": "one two three"}]});
    let resp = send(
        p.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().into()),
    )
    .await?;
    ensure!(resp.status() == 200, "stream on {model}: {}", resp.status());
    let mut body = resp.into_body();
    let mut splitter = mlxd_ipc::sse::SseSplitter::new();
    let (mut out, mut content, mut kill) = (String::new(), 0, kill);
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame?.data_ref() {
            for ev in splitter.push(data) {
                let ev = String::from_utf8(ev.to_vec())?;
                content += usize::from(ev.contains("\"content\":\""));
                out.push_str(&ev);
            }
        }
        if content >= 20 {
            if let Some(pid) = kill.take() {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL)?;
            }
        }
    }
    ensure!(
        kill.is_none(),
        "the stream ended before 20 content events: {out}"
    );
    ensure!(out.ends_with("data: [DONE]\n\n"), "no [DONE]: {out}");
    Ok(out)
}

/// The stream with its one `id` and `created` replaced (they differ between requests).
fn normalized(stream: &str) -> Result<String> {
    let first = stream
        .split("\n\n")
        .find_map(event_json)
        .context("an empty stream")?;
    let id = first["id"].as_str().context("no id")?;
    Ok(stream.replace(id, "ID").replace(
        &format!("\"created\":{}", first["created"]),
        "\"created\":0",
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_time_adapter_survives_reloads_and_a_standby_takeover() -> Result<()> {
    let tiny = tiny_model("tiny-llama")?;
    let lora = fixture("tiny-llama-lora-a")?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("mlxd.toml");
    // Pinned with a standby; the prefix cache off, so that a resumed stream's bytes equal an
    // uninterrupted one's.
    let model = |extra: &str| {
        format!(
            "[[model]]\nid = \"tiny-llama\"\npath = \"{}\"\npinned = true\nstandby = true\n\
             options = {{ prompt_cache = \"0\" }}\n{extra}",
            tiny.display()
        )
    };
    write_config(&config, &model(""))?;
    let p = mlxd(None, &["--config", config.to_str().context("path")?]).await?;
    let client = Client::builder().http(&p.url())?;
    let first = wait_row(&p, "ready with a standby", |e| {
        e["state"] == "ready" && e["standby"]["state"] == "ready"
    })
    .await?;
    let spare_before = first["standby"]["pid"].as_i64().context("standby pid")?;

    let base_text = answer(&client, "tiny-llama").await?;
    client.load_adapter("tiny-llama", "rt", &lora).await?;
    let rt_text = answer(&client, "tiny-llama:rt").await?;
    assert_ne!(rt_text, base_text, "the adapter changes the answer");
    let reference = normalized(&stream_events(&p, "tiny-llama:rt", None).await?)?;
    // The spare started before the load lacks the adapter: it is replaced.
    wait_row(&p, "a new standby after the load", |e| {
        e["standby"]["state"] == "ready" && e["standby"]["pid"].as_i64() != Some(spare_before)
    })
    .await?;

    // SIGHUP, the file unchanged, then changed (an alias for the model): still served.
    let mark = p.stderr().len();
    p.signal(Signal::SIGHUP)?;
    wait_log(&p, "configuration reloaded", mark).await?;
    assert_eq!(answer(&client, "tiny-llama:rt").await?, rt_text);
    write_config(&config, &model("aliases = [\"tiny\"]\n"))?;
    let mark = p.stderr().len();
    p.signal(Signal::SIGHUP)?;
    wait_log(&p, "configuration reloaded", mark).await?;
    assert_eq!(answer(&client, "tiny:rt").await?, rt_text);
    assert_eq!(answer(&client, "tiny-llama:rt").await?, rt_text);
    let listed = client.adapters("tiny").await?;
    assert_eq!(
        listed
            .data
            .iter()
            .map(|a| (a.id.as_str(), a.runtime))
            .collect::<Vec<_>>(),
        [("tiny-llama:rt", true)]
    );

    // kill -9 of the serving engine mid-stream on the adapter: the spare takes over, the
    // stream resumes on it byte for byte, and the spare serves the adapter.
    let row = wait_row(&p, "ready with a standby", |e| {
        e["state"] == "ready" && e["standby"]["state"] == "ready"
    })
    .await?;
    let (serving, spare) = (
        row["pid"].as_i64().context("pid")?,
        row["standby"]["pid"].as_i64().context("standby pid")?,
    );
    let mark = p.stderr().len();
    let resumed = stream_events(&p, "tiny-llama:rt", Some(serving as i32)).await?;
    assert_eq!(normalized(&resumed)?, reference);
    wait_log(
        &p,
        "engine died mid-stream; resuming on its successor",
        mark,
    )
    .await?;
    let row = engine_row(&p).await?;
    assert_eq!(
        row["pid"].as_i64(),
        Some(spare),
        "the spare took over: {row}"
    );
    assert_eq!(answer(&client, "tiny-llama:rt").await?, rt_text);
    assert_eq!(answer(&client, "tiny-llama").await?, base_text);
    Ok(())
}
