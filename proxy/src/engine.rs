//! One engine child process: spawn it, speak the control channel, re-emit its stderr,
//! stop it on request (Shutdown → SIGTERM → SIGKILL), and report how it ended.

use std::collections::{BTreeMap, VecDeque};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mlxd_ipc::control::{CONTROL_FLAG, SUPERVISOR_PID_ENV};
use mlxd_ipc::frame::{read_frame_async, write_frame_async};
use mlxd_protocol::control::{
    ChildMsg, Fatal, FatalKind, Launch, Limits, LoadPhase, ParentMsg, Ready, Stats,
    PROTOCOL_VERSION,
};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, error, info, warn, Instrument};

use crate::exit::{classify, read_oom_kills, Evidence, ExitCause, ExitReport, OomKills, RawExit};
use crate::logs::ModelLog;

/// Lines of stderr kept for the crash report.
pub const STDERR_TAIL_LINES: usize = 200;

/// How long the exit report made when an engine's control channel closed waits for the
/// stderr pump to read what the engine wrote (its pipe may end only when it is reaped).
const STDERR_AFTER_CONTROL_WAIT: Duration = Duration::from_millis(20);

/// Longer stderr lines are split at this many bytes.
const STDERR_LINE_MAX: u64 = 16 * 1024;

/// Variables passed through from our environment when set; everything else is dropped.
pub(crate) const PASSTHROUGH_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "HF_TOKEN",
    "HF_HUB_CACHE",
    "XDG_CACHE_HOME",
    "MLXD_HOME",
    "MLXD_PYPI_URL",
    "MLXD_SMOLLM2_GGUF",
    "MLXD_DEVICE",
    // A LoRA job's training step op by op (`0`) instead of compiled, for comparing the two.
    "MLXD_TRAIN_COMPILE",
    // A LoRA job's cross-entropy through MLX's fused kernel or the plain ops, for comparing
    // their memory (`mlxd_engine::job::train`).
    "MLXD_TRAIN_CROSS_ENTROPY",
    // A LoRA job's bound on MLX's memory (`mlxd_engine::job::train`), for comparing runs
    // with and without it.
    "MLXD_TRAIN_MEMORY_LIMIT",
    // Which attention passes run unfused on CUDA (`mlxd_engine::models::layers`), for
    // measuring the fused and unfused paths against each other.
    "MLXD_CUDA_UNFUSED_ATTENTION",
    // Whether projections that read one input are one product (`mlxd_engine::models::stacked`),
    // for measuring both ways.
    "MLXD_STACKED_PROJECTIONS",
    // Whether decode attention over a quantized KV cache reads it packed on CUDA, and from how
    // many positions decode over a plain cache takes the same kernels
    // (`mlxd_engine::models::decode_attention`), and whether the gated delta recurrence runs as
    // its CUDA kernel (`mlxd_engine::models::delta_kernel`), and whether a served LoRA update
    // runs as two CUDA kernels (`mlxd_engine::adapters::lora_kernel`): `0` keeps the ops path
    // each replaces, for measuring both.
    "MLXD_QUANT_ATTENTION",
    "MLXD_PLAIN_DECODE_ATTENTION",
    "MLXD_DELTA_KERNEL",
    "MLXD_LORA_KERNEL",
    // Whether a served LoRA update takes `x @ A` from a base product widened by the adapters'
    // `A` (`mlxd_engine::adapters::widened`; on by default on CUDA, `0`: the two kernels),
    // for measuring both.
    "MLXD_LORA_WIDENED",
    // Whether a prompt's first token is sampled from its last prefill pass
    // (`mlxd_engine::runtime::first_token`; off by default), for measuring both orders served.
    "MLXD_FIRST_TOKEN_FROM_PREFILL",
    // Where MLX keeps the GPU kernels it compiles (engines default to the store,
    // `mlxd_engine::kernel_cache`); a directory the user chose reaches every engine.
    "MLX_PTX_CACHE_DIR",
    // MLX's own switches for its CUDA command buffers (graphs on or off, their size), for
    // measuring their cost (`scripts/bench/cuda_graphs_ab.sh`).
    "MLX_USE_CUDA_GRAPHS",
    "MLX_MAX_OPS_PER_BUFFER",
    "MLX_MAX_MB_PER_BUFFER",
    // CUDA's lazy or eager loading of the kernels of its libraries (cuBLAS's first use of a
    // kernel variant loads it), for measuring what a new pass shape costs.
    "CUDA_MODULE_LOADING",
    // An engine group's rank 0 starts ranks on other machines through ssh, which may log in
    // with the agent's keys.
    "SSH_AUTH_SOCK",
];

/// What to run and how.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// The model id (what clients ask for; tags logs and events).
    pub model: String,
    /// What to load, sent as `Launch.model`: a directory, a `.gguf`, a known name or a
    /// Hugging Face repo id.
    pub source: String,
    pub bin: PathBuf,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub socket_path: PathBuf,
    pub limits: Limits,
    pub options: BTreeMap<String, String>,
    /// Wait this long after `Shutdown`, and again after SIGTERM.
    pub stop_timeout: Duration,
    /// Restarts so far (for the log span).
    pub restarts: u32,
    /// Where the engine's stderr lines go besides tracing (for `GET /logs/{model}`).
    pub log: Option<Arc<ModelLog>>,
}

/// What an engine reports to the pool.
#[derive(Debug)]
pub enum EngineEvent {
    Loading {
        phase: LoadPhase,
        progress: f32,
    },
    Ready(Ready),
    Stats(Stats),
    Exited(Arc<ExitReport>),
    /// An engine whose exit was reported when its control channel closed has been reaped:
    /// `reaped` is `early` with the exit status.
    Reaped {
        early: Arc<ExitReport>,
        reaped: Arc<ExitReport>,
    },
}

/// An [`EngineEvent`] tagged with its engine.
#[derive(Debug)]
pub struct EngineMsg {
    pub model: String,
    pub generation: u64,
    pub event: EngineEvent,
}

/// What the pool can ask of a running engine's supervising task.
#[derive(Debug)]
pub(crate) enum RunnerCmd {
    /// Forward a control message (e.g. `Drain`).
    Control(ParentMsg),
    /// SIGKILL the engine now; `reason` becomes the exit cause.
    Kill(String),
}

/// Resolves once with the engine's exit report.
pub type DeathWatch = watch::Receiver<Option<Arc<ExitReport>>>;

/// The pool's handle on a running engine. Dropping it stops the engine.
#[derive(Debug)]
pub struct EngineHandle {
    pub pid: u32,
    pub generation: u64,
    control: mpsc::UnboundedSender<RunnerCmd>,
    stop: Option<oneshot::Sender<()>>,
    death: DeathWatch,
}

impl EngineHandle {
    /// Starts the stop sequence: `Shutdown`, then SIGTERM, then SIGKILL.
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Sends `Drain` (or any parent message).
    pub fn send(&self, msg: ParentMsg) {
        let _ = self.control.send(RunnerCmd::Control(msg));
    }

    /// Kills the engine at once (e.g. it hung while loading); `reason` is reported as
    /// the cause of the exit.
    pub fn kill(&self, reason: String) {
        let _ = self.control.send(RunnerCmd::Kill(reason));
    }

    pub fn death(&self) -> DeathWatch {
        self.death.clone()
    }
}

/// Spawns the engine and its supervising task.
pub fn spawn(
    spec: EngineSpec,
    generation: u64,
    events: mpsc::UnboundedSender<EngineMsg>,
) -> std::io::Result<EngineHandle> {
    mlxd_ipc::socket::remove_stale(&spec.socket_path)?;
    let mut cmd = Command::new(&spec.bin);
    cmd.arg(CONTROL_FLAG)
        .args(&spec.args)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    for key in PASSTHROUGH_ENV {
        if let Some(v) = std::env::var_os(key) {
            cmd.env(key, v);
        }
    }
    cmd.env(SUPERVISOR_PID_ENV, std::process::id().to_string())
        .env("MLXD_MODEL", &spec.model)
        .env("MLXD_MODEL_SOURCE", &spec.source)
        .envs(&spec.env);
    // SAFETY: the closure runs between fork and exec and only calls prctl, which is
    // async-signal-safe. Engines arm this themselves too; doing it here as well covers
    // the window before the engine's `main` runs. (Linux only: elsewhere engines rely on
    // stdin reaching end of file when the supervisor dies.)
    #[cfg(target_os = "linux")]
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
    // Read before the spawn: a kill during loading must show as a rise.
    let oom_kills_before = read_oom_kills();
    let child = cmd.spawn()?;
    let pid = child.id().unwrap_or(0);
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = oneshot::channel();
    let (death_tx, death_rx) = watch::channel(None);
    let span = tracing::info_span!(
        "engine",
        model = %spec.model,
        pid,
        generation,
        restarts = spec.restarts
    );
    debug!(parent: &span, bin = %spec.bin.display(), socket = %spec.socket_path.display(), "engine spawned");
    let sup = Supervised {
        spec,
        generation,
        pid,
        events,
        oom_kills_before,
    };
    tokio::spawn(
        sup.run(child, control_rx, stop_rx, death_tx)
            .instrument(span),
    );
    Ok(EngineHandle {
        pid,
        generation,
        control: control_tx,
        stop: Some(stop_tx),
        death: death_rx,
    })
}

/// Reports an engine that could not even be spawned, as an exit.
pub fn spawn_failure_report(spec: &EngineSpec, err: &std::io::Error) -> ExitReport {
    ExitReport::new(
        ExitCause::LoadFailed {
            detail: format!("cannot start {}: {err}", spec.bin.display()),
        },
        Vec::new(),
    )
}

struct Supervised {
    spec: EngineSpec,
    generation: u64,
    pid: u32,
    events: mpsc::UnboundedSender<EngineMsg>,
    /// The cgroup's `oom_kill` counter when the engine was spawned.
    oom_kills_before: Option<u64>,
}

#[derive(Default)]
struct ReaderOutcome {
    fatal: Option<Fatal>,
    ready: bool,
}

type Tail = Arc<Mutex<VecDeque<String>>>;

impl Supervised {
    fn emit(&self, event: EngineEvent) {
        // The pool only goes away at shutdown; nothing to do then.
        let _ = self.events.send(EngineMsg {
            model: self.spec.model.clone(),
            generation: self.generation,
            event,
        });
    }

    async fn run(
        self,
        mut child: Child,
        mut control: mpsc::UnboundedReceiver<RunnerCmd>,
        mut stop: oneshot::Receiver<()>,
        death: watch::Sender<Option<Arc<ExitReport>>>,
    ) {
        let mut stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();

        let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL_LINES)));
        let stderr_task = stderr.map(|s| {
            tokio::spawn(pump_stderr(s, tail.clone(), self.spec.log.clone()).in_current_span())
        });
        let reader_task = stdout.map(|s| {
            let events = self.events.clone();
            let (model, generation) = (self.spec.model.clone(), self.generation);
            tokio::spawn(
                read_control(s, move |event| {
                    let _ = events.send(EngineMsg {
                        model: model.clone(),
                        generation,
                        event,
                    });
                })
                .in_current_span(),
            )
        });

        let launch = ParentMsg::Launch(Launch {
            version: PROTOCOL_VERSION,
            model: self.spec.source.clone(),
            socket_path: self.spec.socket_path.clone(),
            limits: self.spec.limits.clone(),
            options: self.spec.options.clone(),
        });
        write_control(&mut stdin, &launch).await;

        let mut stop_requested = false;
        let mut killed_for: Option<String> = None;
        let mut control_open = true;
        let mut reader_task = reader_task;
        let mut outcome: Option<ReaderOutcome> = None;
        let status = loop {
            tokio::select! {
                // In this order: a `Drain` sent just before a stop goes out first.
                biased;
                status = child.wait() => break Some(status),
                done = async { reader_task.as_mut().expect("guarded").await },
                    if reader_task.is_some() && outcome.is_none() =>
                {
                    let done = done.unwrap_or_default();
                    let was_ready = done.ready;
                    outcome = Some(done);
                    reader_task = None;
                    // A live engine never closes its control channel: it is exiting (or
                    // broken), and goes at once.
                    let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
                    // A serving engine's descriptors close before its GPU context is torn
                    // down, ~100 ms before it can be reaped (`scripts/bench/exit_order.py`):
                    // its exit is reported now, for a standby and the resumed streams, and
                    // the process reaped after. Before `Ready` nothing waits that long for it
                    // (no stream, no takeover of a load): its exit is reported once reaped,
                    // with the status its load failure is explained by.
                    if was_ready {
                        break None;
                    }
                }
                msg = control.recv(), if control_open => match msg {
                    Some(RunnerCmd::Control(m)) => write_control(&mut stdin, &m).await,
                    Some(RunnerCmd::Kill(reason)) => {
                        warn!(%reason, "killing engine");
                        killed_for = Some(reason);
                        let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
                    }
                    None => control_open = false,
                },
                _ = &mut stop => {
                    // Sent or dropped: either way the pool wants this engine gone.
                    stop_requested = true;
                    break Some(self.stop_sequence(&mut child, &mut stdin).await);
                }
            }
        };
        // Anything the engine left behind in its process group goes too (and an engine that
        // closed its control channel goes at once).
        let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
        drop(stdin);

        let outcome = match (outcome, reader_task) {
            (Some(o), _) => o,
            (None, Some(t)) => match tokio::time::timeout(Duration::from_secs(1), t).await {
                Ok(Ok(o)) => o,
                _ => ReaderOutcome::default(),
            },
            (None, None) => ReaderOutcome::default(),
        };
        // Reaped: its stderr has ended or ends at once (the bound covers a grandchild that
        // keeps it open). Not yet reaped: what it wrote is in the pipe already, and the pipe's
        // end may come only with the reaping (stderr was opened before the GPU context), so the
        // pump gets a moment to read it, and the rest is read after the reaping.
        let wait = if status.is_some() {
            Duration::from_secs(1)
        } else {
            STDERR_AFTER_CONTROL_WAIT
        };
        let mut stderr_task = stderr_task;
        let stderr_ended = match stderr_task.as_mut() {
            Some(t) => tokio::time::timeout(wait, t).await.is_ok(),
            None => true,
        };
        if stderr_ended {
            // A finished task must not be awaited again.
            stderr_task = None;
        }
        let tail_now = || -> Vec<String> {
            tail.lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect()
        };
        let tail: Vec<String> = tail_now();

        // Unknown while the exit is reported at the control channel's close (reaped below).
        let raw = status.as_ref().map_or(RawExit::UNKNOWN, raw_exit);
        let evidence = Evidence {
            exit: raw,
            fatal: outcome.fatal.as_ref(),
            stderr_tail: &tail,
            was_ready: outcome.ready,
            stop_requested,
            killed_for: killed_for.as_deref(),
            kernel_oom: self
                .oom_kills_before
                .zip(read_oom_kills())
                .map(|(before, after)| OomKills { before, after }),
        };
        let cause = classify(evidence);
        if cause.is_requested() {
            info!(exit_code = raw.code, signal = raw.signal, "engine stopped");
        } else if cause.is_permanent() {
            // The pool reports it once, with the engine's own explanation; the stderr tail
            // would only repeat it.
            debug!(cause = %cause, ?raw, stderr_tail = %tail.join("\n"), "engine exited");
        } else {
            error!(
                cause = %cause,
                ?raw,
                stderr_tail = %tail.join("\n"),
                "engine exited"
            );
        }
        if status.is_none() {
            // Reported now for the pool (a standby takes over) and for resumed streams; the
            // status follows once the process is reaped, for error messages.
            let early = Arc::new(ExitReport::before_reaping(cause, tail.clone()));
            let _ = death.send(Some(early.clone()));
            self.emit(EngineEvent::Exited(early.clone()));
            let reported = std::time::Instant::now();
            let status = child.wait().await;
            if let Some(t) = stderr_task {
                let _ = tokio::time::timeout(Duration::from_secs(1), t).await;
            }
            let tail = tail_now();
            let raw = raw_exit(&status);
            info!(
                exit_code = raw.code,
                signal = raw.signal,
                after_report_ms = reported.elapsed().as_millis() as u64,
                "engine process reaped (its exit was reported when its control channel closed)"
            );
            let cause = classify(Evidence {
                exit: raw,
                stderr_tail: &tail,
                ..evidence
            });
            let reaped = Arc::new(ExitReport::new(cause, tail));
            let _ = death.send(Some(reaped.clone()));
            self.emit(EngineEvent::Reaped { early, reaped });
            return;
        }
        let report = Arc::new(ExitReport::new(cause, tail));
        let _ = death.send(Some(report.clone()));
        self.emit(EngineEvent::Exited(report));
    }

    /// Shutdown frame, wait; SIGTERM to the group, wait; SIGKILL.
    async fn stop_sequence(
        &self,
        child: &mut Child,
        stdin: &mut Option<ChildStdin>,
    ) -> std::io::Result<std::process::ExitStatus> {
        let grace = self.spec.stop_timeout;
        write_control(stdin, &ParentMsg::Shutdown).await;
        if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
            return status;
        }
        warn!(
            grace_ms = grace.as_millis() as u64,
            "engine ignored Shutdown; sending SIGTERM"
        );
        let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGTERM);
        if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
            return status;
        }
        warn!(
            grace_ms = grace.as_millis() as u64,
            "engine ignored SIGTERM; sending SIGKILL"
        );
        let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
        child.wait().await
    }
}

/// The status of a reaped process, as the OS gives it.
fn raw_exit(status: &std::io::Result<std::process::ExitStatus>) -> RawExit {
    match status {
        Ok(s) => RawExit {
            code: s.code(),
            signal: s.signal(),
        },
        Err(_) => RawExit::UNKNOWN,
    }
}

async fn write_control(stdin: &mut Option<ChildStdin>, msg: &ParentMsg) {
    if let Some(w) = stdin {
        if let Err(e) = write_frame_async(w, msg).await {
            // The engine has gone or closed stdin; its exit will be reported.
            warn!(error = %e, "control write failed");
            *stdin = None;
        }
    }
}

/// Reads child → parent frames until EOF, forwarding all but `Fatal`, which is kept
/// for classifying the exit.
async fn read_control(mut stdout: ChildStdout, emit: impl Fn(EngineEvent)) -> ReaderOutcome {
    let mut out = ReaderOutcome::default();
    let mut load_log = crate::logs::LoadLog::default();
    loop {
        match read_frame_async::<ChildMsg, _>(&mut stdout).await {
            Ok(Some(ChildMsg::Loading { phase, progress })) => {
                if let Some(line) = load_log.line(phase.name(), progress) {
                    info!("{line}");
                }
                emit(EngineEvent::Loading { phase, progress })
            }
            Ok(Some(ChildMsg::Ready(r))) => {
                if let Some(line) = load_log.done() {
                    info!("{line}");
                }
                if r.version != PROTOCOL_VERSION {
                    warn!(
                        engine = r.version,
                        ours = PROTOCOL_VERSION,
                        "engine protocol version differs"
                    );
                }
                out.ready = true;
                emit(EngineEvent::Ready(r));
            }
            Ok(Some(ChildMsg::Stats(s))) => emit(EngineEvent::Stats(s)),
            // Without an SSD tier the engine answers with an empty, complete spill.
            Ok(Some(ChildMsg::Spilled(s))) if s.files > 0 || !s.complete => {
                info!(
                    files = s.files,
                    bytes = s.bytes,
                    complete = s.complete,
                    "engine spilled its prefix cache to the SSD tier"
                );
            }
            Ok(Some(ChildMsg::Spilled(_))) => {}
            Ok(Some(ChildMsg::Fatal(f))) => {
                if f.kind == FatalKind::CannotLoad {
                    debug!(message = %f.message, "engine cannot load its model");
                } else {
                    error!(kind = ?f.kind, message = %f.message, "engine reported a fatal error");
                }
                out.fatal = Some(f);
            }
            Ok(None) => return out,
            Err(e) => {
                error!(error = %e, "control channel from engine is corrupt; ignoring the rest");
                // Drain so the child never blocks on a full pipe.
                let _ = tokio::io::copy(&mut stdout, &mut tokio::io::sink()).await;
                return out;
            }
        }
    }
}

/// Re-emits each stderr line through tracing and keeps the last ones.
async fn pump_stderr<R: tokio::io::AsyncRead + Unpin>(
    stderr: R,
    tail: Tail,
    log: Option<Arc<ModelLog>>,
) {
    let mut reader = BufReader::new(stderr);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut reader)
            .take(STDERR_LINE_MAX)
            .read_until(b'\n', &mut buf)
            .await
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end_matches(['\n', '\r']);
                crate::logs::reemit(line);
                if let Some(log) = &log {
                    log.push(line);
                }
                let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
                if t.len() == STDERR_TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line.to_string());
            }
        }
    }
}

/// The ends of an [`EngineHandle`] that a simulated engine (pool unit tests) holds.
#[cfg(test)]
pub(crate) struct SimulatedEnds {
    pub control: mpsc::UnboundedReceiver<RunnerCmd>,
    pub stop: oneshot::Receiver<()>,
    pub death: watch::Sender<Option<Arc<ExitReport>>>,
}

#[cfg(test)]
impl EngineHandle {
    /// A handle backed by no process: the test drives the other ends.
    pub(crate) fn simulated(pid: u32, generation: u64) -> (Self, SimulatedEnds) {
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let (death_tx, death_rx) = watch::channel(None);
        (
            Self {
                pid,
                generation,
                control: control_tx,
                stop: Some(stop_tx),
                death: death_rx,
            },
            SimulatedEnds {
                control: control_rx,
                stop: stop_rx,
                death: death_tx,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t_last(tail: &Tail) -> String {
        tail.lock().unwrap().back().cloned().unwrap()
    }

    #[tokio::test]
    async fn stderr_tail_keeps_the_last_lines_and_splits_long_ones() {
        let mut input = String::new();
        for i in 0..500 {
            input.push_str(&format!("line {i}\n"));
        }
        input.push_str(&"x".repeat(STDERR_LINE_MAX as usize + 10));
        input.push_str("\n#-invalid-utf8?\r\n");
        let mut bytes = input.into_bytes();
        let n = bytes.len();
        bytes[n - 17] = 0xff; // the "#"
        let tail: Tail = Arc::default();
        let log = Arc::new(ModelLog::default());
        pump_stderr(&bytes[..], tail.clone(), Some(log.clone())).await;
        assert_eq!(log.recent(1)[0], *t_last(&tail));
        let t = tail.lock().unwrap();
        assert_eq!(t.len(), STDERR_TAIL_LINES);
        let last: Vec<&String> = t.iter().rev().take(4).collect();
        assert!(
            last[0].contains("invalid-utf8?") && !last[0].ends_with('\r'),
            "{:?}",
            last[0]
        );
        assert_eq!(last[1].len(), 10);
        assert_eq!(last[2].len(), STDERR_LINE_MAX as usize);
        assert_eq!(last[3], "line 499");
    }

    /// A child running `script` (its control channel's output on stdout) as the engine.
    fn spawn_script(dir: &std::path::Path, script: &str) -> (EngineHandle, EngineEvents) {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("engine.sh");
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let spec = EngineSpec {
            model: "m".into(),
            source: "m".into(),
            bin,
            args: Vec::new(),
            env: BTreeMap::new(),
            socket_path: dir.join("engine.sock"),
            limits: Limits::default(),
            options: BTreeMap::new(),
            stop_timeout: Duration::from_secs(5),
            restarts: 0,
            log: None,
        };
        let (events, events_rx) = mpsc::unbounded_channel();
        (spawn(spec, 1, events).unwrap(), events_rx)
    }

    type EngineEvents = mpsc::UnboundedReceiver<EngineMsg>;

    /// The next event `pick` takes, within 10 s (the scripts below would live 30 s).
    async fn next<T>(events: &mut EngineEvents, pick: impl Fn(EngineEvent) -> Option<T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let msg = events.recv().await.expect("the runner emits it");
                if let Some(t) = pick(msg.event) {
                    return t;
                }
            }
        })
        .await
        .expect("it comes long before the child's sleep ends")
    }

    /// The pid goes away: killed and reaped.
    async fn gone(handle: &EngineHandle) {
        let pid = Pid::from_raw(handle.pid as i32);
        let gone = async {
            while nix::sys::signal::kill(pid, None).is_ok() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the child is killed and reaped");
    }

    /// A serving engine that closes its control channel is reported gone before it is reaped,
    /// killed, then reported again with its status: here it would otherwise live 30 s.
    #[tokio::test]
    async fn a_serving_engine_that_closes_its_control_channel_is_reported_before_its_reaping() {
        use mlxd_protocol::control::{Backend, Device, DeviceKind};
        let dir = tempfile::tempdir().unwrap();
        let ready = ChildMsg::Ready(Ready {
            version: PROTOCOL_VERSION,
            model_id: "m".into(),
            weight_bytes: 1,
            kv_bytes_per_token: 1,
            state_bytes_per_sequence: 0,
            context_length: 8,
            capabilities: vec![],
            device: Device {
                kind: DeviceKind::Cpu,
                backend: Backend::Cpu,
            },
            limits: None,
        });
        let frame = dir.path().join("ready.frame");
        std::fs::write(&frame, mlxd_ipc::frame::encode(&ready).unwrap()).unwrap();
        let script = format!(
            "#!/bin/sh\ncat '{}'\necho going >&2\nexec 1>&-\nexec sleep 30\n",
            frame.display()
        );
        let (handle, mut events) = spawn_script(dir.path(), &script);
        let mut death = handle.death();
        next(&mut events, |e| {
            matches!(e, EngineEvent::Ready(_)).then_some(())
        })
        .await;
        let report = next(&mut events, |e| match e {
            EngineEvent::Exited(r) => Some(r),
            _ => None,
        })
        .await;
        assert!(
            !report.reaped,
            "reported before the process could be reaped"
        );
        assert_eq!(report.cause.code(), "crash", "{:?}", report.cause);
        assert!(
            report.stderr_tail.iter().any(|l| l == "going"),
            "{:?}",
            report.stderr_tail
        );
        // Then reaped: the pool hears of it with the same early report and the status.
        let (early, by_event) = next(&mut events, |e| match e {
            EngineEvent::Reaped { early, reaped } => Some((early, reaped)),
            _ => None,
        })
        .await;
        assert!(Arc::ptr_eq(&early, &report));
        assert!(by_event.reaped && by_event.cause.to_string().contains("signal 9"));
        // And the death watch carries it, for error messages: killed by us.
        tokio::time::timeout(
            Duration::from_secs(10),
            death.wait_for(|d| d.as_ref().is_some_and(|r| r.reaped)),
        )
        .await
        .expect("the reaped report follows")
        .unwrap();
        gone(&handle).await;
    }

    /// Before `Ready` the exit is reported once, reaped, with its status (a failed load is
    /// explained by it), and still at once: the child is killed.
    #[tokio::test]
    async fn a_loading_engine_that_closes_its_control_channel_is_killed_and_reported_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let (handle, mut events) = spawn_script(
            dir.path(),
            "#!/bin/sh\necho going >&2\nexec 1>&-\nexec sleep 30\n",
        );
        let report = next(&mut events, |e| match e {
            EngineEvent::Exited(r) => Some(r),
            _ => None,
        })
        .await;
        assert!(report.reaped, "{report:?}");
        assert_eq!(report.cause.code(), "load_failed", "{:?}", report.cause);
        assert!(
            report.cause.to_string().contains("signal 9"),
            "{}",
            report.cause
        );
        assert!(report.stderr_tail.iter().any(|l| l == "going"));
        gone(&handle).await;
    }
}
