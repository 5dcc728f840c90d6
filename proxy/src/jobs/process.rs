//! One job process: `mlxd-engine __job <spec>` in a process group of its own, with a cleared
//! environment (the engines' pass-through list), `PR_SET_PDEATHSIG`, its [`JobMsg`] frames read
//! from stdout and its stderr re-emitted through `tracing` (the last lines kept for the failure
//! message). Reports everything to the jobs actor as [`ProcessEvent`]s.
use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;

use mlxd_ipc::control::SUPERVISOR_PID_ENV;
use mlxd_ipc::frame::read_frame_async;
use mlxd_protocol::jobs::{JobMsg, JobProgress, JobResult, JobSpec, JOB_ENTRY};
use tokio::io::AsyncBufReadExt;
use tokio::process::Command;
use tokio::sync::mpsc;
use tracing::{info, warn};

/// Lines of stderr kept for a failure message.
const STDERR_TAIL: usize = 20;

/// What a job process tells the actor.
#[derive(Debug)]
pub enum ProcessEvent {
    Progress { id: String, progress: JobProgress },
    Exited { id: String, end: ProcessEnd },
}

/// How a job process ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessEnd {
    /// What it reported last: `Done` or `Failed`, if anything.
    pub result: Option<JobResult>,
    pub failure: Option<String>,
    /// The exit code, or the signal that killed it.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The last lines of stderr.
    pub stderr_tail: Vec<String>,
}

impl ProcessEnd {
    /// Succeeded: reported `Done` and exited 0.
    pub fn succeeded(&self) -> Option<&JobResult> {
        self.result.as_ref().filter(|_| self.code == Some(0))
    }

    /// Why it did not succeed, in one sentence.
    pub fn failure_message(&self) -> String {
        if let Some(f) = &self.failure {
            return f.clone();
        }
        let how = match (self.code, self.signal) {
            (_, Some(9)) => "the job process was killed (signal 9, SIGKILL)".to_string(),
            (_, Some(s)) => format!("the job process was killed by signal {s}"),
            (Some(0), _) => "the job process exited without reporting a result".to_string(),
            (Some(c), _) => format!("the job process exited with code {c}"),
            (None, None) => "the job process ended".to_string(),
        };
        match self.stderr_tail.last() {
            Some(line) => format!("{how}; its last log line: {line}"),
            None => how,
        }
    }
}

/// Starts the job process; returns its pid (also its process group id).
pub fn spawn(
    id: &str,
    bin: &Path,
    spec: &JobSpec,
    events: mpsc::UnboundedSender<ProcessEvent>,
) -> std::io::Result<u32> {
    let spec_json = serde_json::to_string(spec).map_err(std::io::Error::other)?;
    let mut cmd = Command::new(bin);
    cmd.arg(JOB_ENTRY)
        .arg(spec_json)
        .env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    for key in crate::engine::PASSTHROUGH_ENV {
        if let Some(v) = std::env::var_os(key) {
            cmd.env(key, v);
        }
    }
    // The jobs' test switch (`mlxd_engine::job::stall_after`), passed only when both are set.
    if std::env::var("MLXD_ALLOW_FAULTS").as_deref() == Ok("1") {
        if let Some(fault) = std::env::var_os("MLXD_JOB_FAULT") {
            cmd.env("MLXD_ALLOW_FAULTS", "1")
                .env("MLXD_JOB_FAULT", fault);
        }
    }
    cmd.env(SUPERVISOR_PID_ENV, std::process::id().to_string());
    // SAFETY: runs between fork and exec and only calls prctl, which is async-signal-safe.
    #[cfg(target_os = "linux")]
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn()?;
    let pid = child.id().unwrap_or(0);
    info!(job = %id, pid, bin = %bin.display(), "job process spawned");
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let id = id.to_string();
    tokio::spawn(async move {
        // Held until the end: the job exits when its stdin closes.
        let _stdin = child.stdin.take();
        let frames = {
            let (id, events) = (id.clone(), events.clone());
            async move {
                let (mut result, mut failure) = (None, None);
                let Some(mut out) = stdout else {
                    return (result, failure);
                };
                loop {
                    match read_frame_async::<JobMsg, _>(&mut out).await {
                        Ok(Some(JobMsg::Progress(progress))) => {
                            let _ = events.send(ProcessEvent::Progress {
                                id: id.clone(),
                                progress,
                            });
                        }
                        Ok(Some(JobMsg::Done(r))) => result = Some(r),
                        Ok(Some(JobMsg::Failed { message })) => failure = Some(message),
                        Ok(None) => return (result, failure),
                        Err(e) => {
                            warn!(job = %id, error = %e, "job channel broken");
                            return (result, failure);
                        }
                    }
                }
            }
        };
        let logs = {
            let id = id.clone();
            async move {
                let mut tail = VecDeque::new();
                let Some(err) = stderr else {
                    return tail;
                };
                let mut lines = tokio::io::BufReader::new(err).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    info!(target: "mlxd::job", job = %id, "{line}");
                    let message = serde_json::from_str::<serde_json::Value>(&line)
                        .ok()
                        .and_then(|v| {
                            let f = v.get("fields")?;
                            let m = f.get("message")?.as_str()?.to_string();
                            Some(match f.get("error").and_then(|e| e.as_str()) {
                                Some(e) => format!("{m}: {e}"),
                                None => m,
                            })
                        })
                        .unwrap_or(line);
                    if tail.len() == STDERR_TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(message);
                }
                tail
            }
        };
        let ((result, failure), tail, status) = tokio::join!(frames, logs, child.wait());
        let (code, signal) = match status {
            Ok(s) => (s.code(), s.signal()),
            Err(_) => (None, None),
        };
        let end = ProcessEnd {
            result,
            failure,
            code,
            signal,
            stderr_tail: tail.into_iter().collect(),
        };
        info!(job = %id, ?code, ?signal, "job process exited");
        let _ = events.send(ProcessEvent::Exited { id, end });
    });
    Ok(pid)
}

/// Kills the job's whole process group.
pub fn kill_group(pid: u32) {
    if pid == 0 {
        return;
    }
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}
