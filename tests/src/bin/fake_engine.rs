//! A scriptable stand-in for `mlxd-engine`: same control protocol, same HTTP shape,
//! no model. Run as `fake-engine --control` by the supervisor.
//!
//! Start-up behaviour comes from `Launch.options` (see [`Script`]); per-request
//! behaviour from an optional `"fake"` object in the JSON body (see [`RequestScript`]).
//! Responses name the model id the supervisor gave it (`MLXD_MODEL`) in `"model"`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use mlxd_ipc::control::{
    set_parent_death_signal, ChildChannel, ControlSender, ParentEvent, CONTROL_FLAG,
};
use mlxd_ipc::socket::bind_unix;
use mlxd_protocol::control::{
    Backend, ChildMsg, Device, DeviceKind, FatalKind, Limits, LoadPhase, Ready, Stats,
    PROTOCOL_VERSION,
};
use mlxd_protocol::error::{ErrorBody, ErrorType};
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// The text MLX prints when a device allocation fails (Metal build; CUDA is similar).
const OOM_TEXT: &str = "libc++abi: terminating due to uncaught exception of type \
     std::runtime_error: [metal::malloc] Unable to allocate 17179869184 bytes.";

/// Start-up script, from `Launch.options`:
/// - `ready_delay_ms`: time spent "loading" (with `Loading` frames) before `Ready`;
/// - `load_gate=<path>`: after the first `Loading` frame, wait until that file exists (a
///   test that watches a load opens the gate once it has seen it, whatever its speed);
/// - `exit_before_ready=<code>`: exit with that code instead of becoming ready;
/// - `fatal_before_ready=<message>`: send `Fatal(LoadFailed)` then exit 1;
/// - `cannot_load=<message>`: send `Fatal(CannotLoad)` (a load no restart can fix) then
///   exit 2;
/// - `oom_before_ready=1`: print MLX's allocation-failure text and abort;
/// - `sigkill_before_ready=1`: SIGKILL itself while loading;
/// - `crash_once_marker=<path>`: if the file is absent, create it and exit 3 before ready;
/// - `events_file=<path>`: append one line per lifecycle event (for tests);
/// - `stats_interval_ms` (default 200), `memory_bytes` (default 123456789),
///   `weight_bytes` (default 1000, reported in `Ready`);
/// - `ignore_sigterm=1`, `ignore_shutdown=1`: to test the supervisor's escalation;
/// - `chunks`, `interval_ms`: defaults for streaming responses (8 chunks, 5 ms);
/// - `vanish_after_requests=<n>`: after n generation requests, remove the socket and
///   stop listening, then exit 5 after 200 ms (a death between lease and connect).
#[derive(Clone)]
struct Script {
    opts: BTreeMap<String, String>,
    events: Option<PathBuf>,
}

impl Script {
    fn get<T: std::str::FromStr>(&self, key: &str) -> Option<T> {
        self.opts.get(key).and_then(|v| v.parse().ok())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.opts.get(key).map(String::as_str), Some("1" | "true"))
    }

    fn event(&self, line: &str) {
        if let Some(path) = &self.events {
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
            {
                let _ = writeln!(f, "{} {line}", std::process::id());
            }
        }
    }
}

/// Per-request script: `"fake": {"chunks": 5, "interval_ms": 10, "delay_ms": 0,
/// "then": "abort" | "exit:<code>" | "sigkill" | "oom" | "fatal_oom" | "hang",
/// "at": <chunk index>, "prompt_tokens": 1}`. During `delay_ms` the request counts as
/// prefilling its `prompt_tokens` in `Stats`, as the real engine reports a prompt in prefill. `fatal_oom` sends `Fatal(OutOfMemory)` and exits 1, as the
/// real engine does when it catches an allocation failure.
///
/// Like the real engine, a request whose KV reservation — (1 prompt token +
/// `max_tokens`) · 10 bytes, capped at the 2048-token context — exceeds
/// `Launch.limits.kv_budget_bytes` is answered with a 500 at once. The option
/// `device_kv_budget_bytes` stands for a GPU's free memory: the budget where none is
/// launched, the cap of a larger one, reported in `Ready.limits` as the real engine does.
/// `then` happens after `at` chunks when streaming (default: all), or before the
/// response when not streaming; with `"once": "<path>"` only if that file exists (it is
/// removed), so a restarted engine serves the request cleanly.
///
/// With `"token_ids": true` the engine behaves as the real one for resumption: chunk i
/// opens with the meta line `: mlxd {"token_ids":[i]}` (a whole response carries
/// `"mlxd": {"token_ids": [...]}` with all of them), and a request
/// with `"mlxd": {"resume_token_ids": [...]}` of n ids continues at chunk n.
#[derive(Clone, Default)]
struct RequestScript {
    chunks: u64,
    interval: Duration,
    delay: Duration,
    /// Prompt tokens reported as left to prefill during `delay`.
    prompt_tokens: u64,
    then: Option<String>,
    at: Option<u64>,
    once: Option<PathBuf>,
    token_ids: bool,
    /// The first chunk to send (the number of resumed ids).
    from: u64,
}

impl RequestScript {
    /// The scripted action, if it should happen in this process.
    fn action(&self) -> Option<&str> {
        let a = self.then.as_deref()?;
        match &self.once {
            Some(path) => std::fs::remove_file(path).ok().map(|_| a),
            None => Some(a),
        }
    }

    /// Stream chunk `i` as an SSE event; with `token_ids`, opened by the meta line that
    /// carries its id, as the real engine writes it.
    fn event(&self, v: Value, i: u64, last: bool) -> Bytes {
        let data = mlxd_ipc::sse::data_event(&v.to_string());
        if !self.token_ids {
            return data;
        }
        let meta = mlxd_protocol::openai::EventMeta {
            token_ids: vec![i as u32],
            finish: last,
        };
        let mut out = meta.line().into_bytes();
        out.extend_from_slice(&data);
        Bytes::from(out)
    }

    /// Tags the first choice of `v` with the ids in `range`, when the script says so.
    fn tag(&self, mut v: Value, range: std::ops::Range<u64>) -> Value {
        if self.token_ids {
            v["choices"][0]["mlxd"] = json!({"token_ids": range.collect::<Vec<_>>()});
        }
        v
    }
}

struct Engine {
    script: Script,
    control: ControlSender,
    kv_budget: Option<u64>,
    model: String,
    active: AtomicU32,
    /// Requests in their `delay` (prefilling, as far as `Stats` tells), and their prompt tokens.
    prefilling: AtomicU32,
    prefill_tokens_left: AtomicU64,
    draining: AtomicBool,
    /// Generation requests served so far (for `vanish_after_requests`).
    served: AtomicU32,
    vanish: tokio::sync::Notify,
}

/// A request counted as prefilling until dropped (also when its client leaves mid-delay).
struct Prefill<'e> {
    engine: &'e Engine,
    tokens: u64,
}

impl<'e> Prefill<'e> {
    fn start(engine: &'e Engine, tokens: u64) -> Self {
        engine.prefilling.fetch_add(1, Ordering::Relaxed);
        engine
            .prefill_tokens_left
            .fetch_add(tokens, Ordering::Relaxed);
        Self { engine, tokens }
    }
}

impl Drop for Prefill<'_> {
    fn drop(&mut self) {
        self.engine.prefilling.fetch_sub(1, Ordering::Relaxed);
        self.engine
            .prefill_tokens_left
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

fn main() -> Result<()> {
    if !std::env::args().any(|a| a == CONTROL_FLAG) {
        bail!("fake-engine must be started by mlxd with {CONTROL_FLAG}");
    }
    set_parent_death_signal()?;
    let mut chan = ChildChannel::from_stdio()?;
    let launch = chan.read_launch()?;
    let script = Script {
        events: launch.options.get("events_file").map(PathBuf::from),
        opts: launch.options.clone(),
    };
    if script.flag("ignore_sigterm") {
        // SAFETY: installing SIG_IGN for SIGTERM has no memory-safety preconditions.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    }
    // The id the supervisor serves this engine under; `Launch.model` is what to load.
    let model_id = std::env::var("MLXD_MODEL").unwrap_or_else(|_| launch.model.clone());
    script.event(&format!("start model={model_id} source={}", launch.model));
    let tx = chan.sender();

    let (parent_tx, parent_rx) = mpsc::unbounded_channel();
    chan.watch_parent(move |ev| {
        let _ = parent_tx.send(ev);
    });

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // `device_kv_budget_bytes`: what the "GPU" holds, as the real engine derives from its free
    // memory: the budget where none is configured, the cap of a larger one.
    let kv_budget = match (
        launch.limits.kv_budget_bytes,
        script.get::<u64>("device_kv_budget_bytes"),
    ) {
        (Some(configured), Some(device)) => Some(configured.min(device)),
        (configured, device) => configured.or(device),
    };
    let in_force = Limits {
        kv_budget_bytes: kv_budget,
        ..launch.limits.clone()
    };
    rt.block_on(run(
        script,
        model_id,
        launch.socket_path,
        in_force,
        tx,
        parent_rx,
    ))
}

async fn run(
    script: Script,
    model: String,
    socket: PathBuf,
    in_force: Limits,
    tx: ControlSender,
    mut parent: mpsc::UnboundedReceiver<ParentEvent>,
) -> Result<()> {
    let kv_budget = in_force.kv_budget_bytes;
    // Loading.
    let delay = Duration::from_millis(script.get("ready_delay_ms").unwrap_or(0));
    for step in 1..=4u8 {
        tokio::time::sleep(delay / 4).await;
        tx.send_loading(LoadPhase::Weights, f32::from(step) / 4.0)?;
        if step == 1 {
            if let Some(gate) = script.opts.get("load_gate") {
                while std::fs::metadata(gate).is_err() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    if let Some(code) = script.get::<i32>("exit_before_ready") {
        eprintln!("fake-engine: exiting with {code} before ready, as scripted");
        std::process::exit(code);
    }
    if let Some(msg) = script.opts.get("fatal_before_ready") {
        eprintln!("fake-engine: load failed: {msg}");
        tx.send_fatal(FatalKind::LoadFailed, msg.clone())?;
        std::process::exit(1);
    }
    if let Some(msg) = script.opts.get("cannot_load") {
        eprintln!("fake-engine: cannot load: {msg}");
        tx.send_fatal(FatalKind::CannotLoad, msg.clone())?;
        std::process::exit(2);
    }
    if let Some(marker) = script.opts.get("crash_once_marker") {
        if std::fs::metadata(marker).is_err() {
            std::fs::write(marker, b"crashed")?;
            eprintln!("fake-engine: first start, crashing as scripted");
            std::process::exit(3);
        }
    }
    if script.flag("oom_before_ready") {
        die_oom();
    }
    if script.flag("sigkill_before_ready") {
        sigkill_self();
    }

    let listener = bind_unix(&socket).with_context(|| format!("binding {}", socket.display()))?;
    let engine = Arc::new(Engine {
        script: script.clone(),
        control: tx.clone(),
        kv_budget,
        model: model.clone(),
        active: AtomicU32::new(0),
        prefilling: AtomicU32::new(0),
        prefill_tokens_left: AtomicU64::new(0),
        draining: AtomicBool::new(false),
        served: AtomicU32::new(0),
        vanish: tokio::sync::Notify::new(),
    });
    tx.send_ready(Ready {
        version: PROTOCOL_VERSION,
        model_id: model,
        weight_bytes: script.get("weight_bytes").unwrap_or(1000),
        kv_bytes_per_token: KV_BYTES_PER_TOKEN,
        state_bytes_per_sequence: 0,
        context_length: CONTEXT_LENGTH,
        capabilities: vec!["chat".into(), "completions".into()],
        device: Device {
            kind: DeviceKind::Cpu,
            backend: Backend::Cpu,
        },
        limits: Some(in_force),
    })?;
    script.event("ready");
    eprintln!("{{\"level\":\"info\",\"msg\":\"fake engine ready\"}}");

    let stats_every = Duration::from_millis(script.get("stats_interval_ms").unwrap_or(200));
    let memory = script.get("memory_bytes").unwrap_or(123_456_789u64);
    let mut stats_tick = tokio::time::interval(stats_every);
    let mut shutting_down = false;
    let mut listener = Some(listener);
    loop {
        tokio::select! {
            _ = engine.vanish.notified() => {
                script.event("vanishing");
                listener = None;
                let _ = std::fs::remove_file(&socket);
                tokio::spawn(async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    std::process::exit(5);
                });
            }
            accepted = async { listener.as_ref().expect("guarded").accept().await }, if !shutting_down && listener.is_some() => {
                let (stream, _) = accepted?;
                let engine = engine.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(engine.clone(), req));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
            _ = stats_tick.tick() => {
                let active = engine.active.load(Ordering::Relaxed);
                let _ = tx.send_stats(Stats {
                    active,
                    queued: 0,
                    kv_bytes: u64::from(active) * 1000,
                    memory_bytes: memory,
                    drafted_tokens: 0,
                    accepted_tokens: 0,
                    ssd: Default::default(),
                    prefilling: engine.prefilling.load(Ordering::Relaxed),
                    prefill_tokens_left: engine.prefill_tokens_left.load(Ordering::Relaxed),
                    memory: None,
                    prefix: Default::default(),
                });
                if shutting_down && active == 0 {
                    script.event("shutdown complete");
                    std::process::exit(0);
                }
            }
            ev = parent.recv() => match ev {
                Some(ParentEvent::Drain) => {
                    script.event("drain");
                    engine.draining.store(true, Ordering::Relaxed);
                }
                // No SSD tier: nothing to write.
                Some(ParentEvent::Spill) => {
                    let _ = tx.send(&ChildMsg::Spilled(Default::default()));
                }
                Some(ParentEvent::Shutdown) => {
                    script.event("shutdown requested");
                    if !script.flag("ignore_shutdown") {
                        engine.draining.store(true, Ordering::Relaxed);
                        shutting_down = true;
                        if engine.active.load(Ordering::Relaxed) == 0 {
                            script.event("shutdown complete");
                            std::process::exit(0);
                        }
                    }
                }
                Some(ParentEvent::Closed) | Some(ParentEvent::Broken(_)) | None => {
                    script.event("stdin closed");
                    std::process::exit(0);
                }
            }
        }
    }
}

fn die_oom() -> ! {
    eprintln!("{OOM_TEXT}");
    std::process::abort();
}

fn sigkill_self() -> ! {
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    unreachable!("SIGKILL returned")
}

const KV_BYTES_PER_TOKEN: u64 = 10;
const CONTEXT_LENGTH: u32 = 2048;

/// Performs a scripted fatal action; returns only for `hang` (never resolves).
async fn perform(engine: &Engine, action: &str) {
    match action {
        "fatal_oom" => {
            eprintln!("fake-engine: KV cache allocation failed, as scripted");
            let _ = engine.control.send_fatal(
                FatalKind::OutOfMemory,
                "KV cache allocation of 4096 bytes failed, as scripted",
            );
            std::process::exit(1);
        }
        "abort" => std::process::abort(),
        "sigkill" => sigkill_self(),
        "oom" => die_oom(),
        "hang" => std::future::pending::<()>().await,
        other => {
            if let Some(code) = other.strip_prefix("exit:").and_then(|c| c.parse().ok()) {
                eprintln!("fake-engine: exiting with {code} mid-request, as scripted");
                std::process::exit(code);
            }
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// An error in the shared shape and type vocabulary (`mlxd_protocol::error`).
fn error_response(
    status: StatusCode,
    kind: ErrorType,
    message: String,
    code: Option<&str>,
) -> Response<Body> {
    let mut body = ErrorBody::typed(kind, message);
    body.error.code = code.map(String::from);
    json_response(status, &serde_json::to_value(&body).unwrap_or(Value::Null))
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|e| match e {})
                .boxed(),
        )
        .expect("static response parts")
}

async fn handle(engine: Arc<Engine>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    Ok(match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => json_response(StatusCode::OK, &json!({"status": "ok"})),
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            &json!({"object": "list", "data": [{"id": engine.model, "object": "model", "owned_by": "fake"}]}),
        ),
        // The request's headers, as the engine received them (the proxy forwards this one
        // GET route of the real engine's, `/v1/models/{id}`).
        (Method::GET, "/v1/models/headers") => {
            let h: BTreeMap<String, String> = req
                .headers()
                .iter()
                .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                .collect();
            json_response(StatusCode::OK, &json!(h))
        }
        (Method::POST, "/v1/chat/completions" | "/v1/completions") => {
            if engine.draining.load(Ordering::Relaxed) {
                return Ok(error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorType::EngineUnavailable,
                    "draining".into(),
                    Some("draining"),
                ));
            }
            let chat = path == "/v1/chat/completions";
            let served = engine.served.fetch_add(1, Ordering::Relaxed) + 1;
            if engine.script.get::<u32>("vanish_after_requests") == Some(served) {
                engine.vanish.notify_one();
            }
            match req.into_body().collect().await {
                Ok(b) => generate(engine, chat, &b.to_bytes()).await,
                Err(_) => error_response(
                    StatusCode::BAD_REQUEST,
                    ErrorType::InvalidRequestError,
                    "body".into(),
                    None,
                ),
            }
        }
        _ => error_response(
            StatusCode::NOT_FOUND,
            ErrorType::NotFoundError,
            format!("no route {path}"),
            None,
        ),
    })
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

async fn generate(engine: Arc<Engine>, chat: bool, body: &[u8]) -> Response<Body> {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequestError,
                format!("engine: bad JSON: {e}"),
                None,
            )
        }
    };
    let f = req.get("fake").cloned().unwrap_or(Value::Null);
    let ms = |k: &str, d: u64| Duration::from_millis(f.get(k).and_then(Value::as_u64).unwrap_or(d));
    let rs = RequestScript {
        chunks: f
            .get("chunks")
            .and_then(Value::as_u64)
            .unwrap_or(engine.script.get("chunks").unwrap_or(8)),
        interval: ms("interval_ms", engine.script.get("interval_ms").unwrap_or(5)),
        delay: ms("delay_ms", 0),
        prompt_tokens: f.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(1),
        then: f.get("then").and_then(Value::as_str).map(String::from),
        at: f.get("at").and_then(Value::as_u64),
        once: f.get("once").and_then(Value::as_str).map(PathBuf::from),
        token_ids: f.get("token_ids").and_then(Value::as_bool).unwrap_or(false),
        from: req
            .get("mlxd")
            .and_then(|m| m.get("resume_token_ids"))
            .and_then(Value::as_array)
            .map_or(0, |a| a.len() as u64),
    };
    let id = req
        .get("fake")
        .and_then(|f| f.get("id"))
        .and_then(Value::as_str)
        .unwrap_or("req")
        .to_string();
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if let (Some(budget), Some(max_tokens)) = (
        engine.kv_budget,
        req.get("max_tokens").and_then(Value::as_u64),
    ) {
        let tokens = (1 + max_tokens).min(u64::from(CONTEXT_LENGTH));
        let reserved = tokens * KV_BYTES_PER_TOKEN;
        if reserved > budget {
            return error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorType::ServerError,
                format!("the request needs {reserved} bytes of KV cache (prompt 1 + max_tokens {max_tokens} tokens), more than the engine's KV budget of {budget} bytes"),
                None,
            );
        }
    }
    {
        let _prefill = Prefill::start(&engine, rs.prompt_tokens);
        tokio::time::sleep(rs.delay).await;
    }

    if !stream {
        if let Some(action) = rs.action() {
            engine.active.fetch_add(1, Ordering::Relaxed);
            perform(&engine, action).await;
            engine.active.fetch_sub(1, Ordering::Relaxed);
        }
        let text: String = (rs.from..rs.chunks).map(|i| format!("tok{i} ")).collect();
        engine.script.event(&format!("completed {id}"));
        let v = if chat {
            json!({"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": engine.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": rs.chunks, "total_tokens": rs.chunks + 1}})
        } else {
            json!({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": engine.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": rs.chunks, "total_tokens": rs.chunks + 1}})
        };
        return json_response(StatusCode::OK, &rs.tag(v, rs.from..rs.chunks));
    }

    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        engine.active.fetch_add(1, Ordering::Relaxed);
        let finished = stream_chunks(&engine, chat, &rs, &tx).await;
        engine.active.fetch_sub(1, Ordering::Relaxed);
        engine.script.event(&format!(
            "{} {id}",
            if finished { "completed" } else { "cancelled" }
        ));
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(ChannelBody(rx).boxed())
        .expect("static response parts")
}

/// Sends the chunks; false if the client went away first.
async fn stream_chunks(
    engine: &Engine,
    chat: bool,
    rs: &RequestScript,
    tx: &mpsc::Sender<Bytes>,
) -> bool {
    for i in rs.from..rs.chunks {
        if rs.at == Some(i) {
            if let Some(a) = rs.action() {
                perform(engine, a).await;
            }
        }
        let last = i + 1 == rs.chunks;
        let finish = if last { json!("stop") } else { Value::Null };
        let v = if chat {
            json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": engine.model,
                "choices": [{"index": 0, "delta": {"content": format!("tok{i} ")}, "finish_reason": finish}],
                "t_ns": monotonic_ns(), "seq": i})
        } else {
            json!({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": engine.model,
                "choices": [{"index": 0, "text": format!("tok{i} "), "finish_reason": finish}],
                "t_ns": monotonic_ns(), "seq": i})
        };
        let ev = rs.event(v, i, last);
        if tx.send(ev).await.is_err() {
            return false;
        }
        if rs.interval.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::select! {
                _ = tokio::time::sleep(rs.interval) => {}
                _ = tx.closed() => return false,
            }
        }
    }
    if rs.at.is_some_and(|a| a >= rs.chunks) {
        if let Some(a) = rs.action() {
            perform(engine, a).await;
        }
    }
    tx.send(Bytes::from_static(mlxd_ipc::sse::DONE_EVENT))
        .await
        .is_ok()
}

/// A response body fed by a channel; dropping it (client gone) closes the channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}
