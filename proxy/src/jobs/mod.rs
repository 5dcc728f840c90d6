//! Managed jobs: the jobs actor owns the job table; everyone else sends it a [`Command`]
//! through a cloneable [`JobsHandle`].
//!
//! A submitted job is queued, admitted against the pool's memory budget (the pool counts it,
//! [`admission::admit`] decides), run as its own process (`mlxd-engine __job`, [`process`]),
//! and ends succeeded, failed or cancelled. A job that cannot fit waits in the queue (retried
//! each second and whenever a job ends); one that can never fit is refused at submission with
//! the numbers. Cancelling kills the process group and removes the job's staging directory
//! before it answers, so no partial output stays in the store.
pub mod admission;
pub mod api;
pub mod display;
pub mod process;
pub mod request;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlxd_protocol::jobs::{Job, JobProgress, JobState};
use tokio::sync::{broadcast, mpsc, oneshot};
use tracing::{info, warn};

use crate::error::ProxyError;
use crate::pool::PoolHandle;
use admission::Admission;
use process::{ProcessEnd, ProcessEvent};
use request::PreparedJob;

/// Finished jobs kept for `GET /v1/jobs` (oldest dropped first).
const KEEP_FINISHED: usize = 100;

/// How often queued jobs ask for memory again.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// What followers of a job receive.
#[derive(Debug, Clone)]
pub enum JobEvent {
    Progress(JobProgress),
    /// The job changed state (queued → running).
    State(Box<Job>),
    /// The job ended; nothing follows.
    Final(Box<Job>),
}

type Reply<T> = oneshot::Sender<T>;

#[derive(Debug)]
enum Command {
    Submit {
        job: Box<PreparedJob>,
        reply: Reply<Result<Job, ProxyError>>,
    },
    List {
        reply: Reply<Vec<Job>>,
    },
    Get {
        id: String,
        reply: Reply<Option<Job>>,
    },
    Follow {
        id: String,
        reply: Reply<Option<(Job, broadcast::Receiver<JobEvent>)>>,
    },
    Cancel {
        id: String,
        reply: Reply<Result<Job, ProxyError>>,
    },
    Shutdown {
        reply: Reply<()>,
    },
}

/// The HTTP side's handle on the jobs actor.
#[derive(Debug, Clone)]
pub struct JobsHandle {
    tx: mpsc::Sender<Command>,
}

impl JobsHandle {
    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, ProxyError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| ProxyError::ShuttingDown)?;
        rx.await.map_err(|_| ProxyError::ShuttingDown)
    }

    /// Queues a job; refused at once when it can never fit in the memory budget.
    pub async fn submit(&self, job: PreparedJob) -> Result<Job, ProxyError> {
        self.ask(|reply| Command::Submit {
            job: Box::new(job),
            reply,
        })
        .await?
    }

    pub async fn list(&self) -> Vec<Job> {
        self.ask(|reply| Command::List { reply })
            .await
            .unwrap_or_default()
    }

    pub async fn get(&self, id: &str) -> Result<Job, ProxyError> {
        self.ask(|reply| Command::Get {
            id: id.to_string(),
            reply,
        })
        .await?
        .ok_or_else(|| not_found(id))
    }

    /// The job as it stands and its events from now on.
    pub async fn follow(
        &self,
        id: &str,
    ) -> Result<(Job, broadcast::Receiver<JobEvent>), ProxyError> {
        self.ask(|reply| Command::Follow {
            id: id.to_string(),
            reply,
        })
        .await?
        .ok_or_else(|| not_found(id))
    }

    /// Cancels a queued or running job; answers once its process group is gone and its staging
    /// directory removed.
    pub async fn cancel(&self, id: &str) -> Result<Job, ProxyError> {
        self.ask(|reply| Command::Cancel {
            id: id.to_string(),
            reply,
        })
        .await?
    }

    /// Kills every running job and removes its staging directory.
    pub async fn shutdown(&self) {
        let _ = self.ask(|reply| Command::Shutdown { reply }).await;
    }
}

fn not_found(id: &str) -> ProxyError {
    ProxyError::NotFound(format!("no job {id:?} (GET /v1/jobs lists them)"))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

struct Entry {
    job: Job,
    prepared: PreparedJob,
    events: broadcast::Sender<JobEvent>,
    /// The last progress passed on to followers.
    sent: Option<JobProgress>,
    cancelling: bool,
    cancel_replies: Vec<Reply<Result<Job, ProxyError>>>,
}

struct Jobs {
    bin: PathBuf,
    pool: PoolHandle,
    /// The store's list of directories outside it where jobs stage their output
    /// ([`STAGING_DIRS`]), swept at the next start.
    staging_dirs: Option<PathBuf>,
    table: BTreeMap<String, Entry>,
    queue: VecDeque<String>,
    next_id: u64,
    process_tx: mpsc::UnboundedSender<ProcessEvent>,
    shutdown_replies: Vec<Reply<()>>,
    shutting_down: bool,
}

/// Starts the jobs actor. `bin` is the engine binary (`mlxd-engine`), `models_dir` the store's
/// model directory, swept once for staging directories that a previous `mlxd` left behind when
/// it died with jobs running.
pub fn start(bin: PathBuf, pool: PoolHandle, models_dir: Option<PathBuf>) -> JobsHandle {
    let staging_dirs = models_dir
        .as_deref()
        .and_then(std::path::Path::parent)
        .map(|home| home.join(STAGING_DIRS));
    if let Some(dir) = &models_dir {
        sweep_staging(dir);
    }
    if let Some(list) = &staging_dirs {
        sweep_listed(list);
    }
    let (tx, rx) = mpsc::channel(256);
    let (process_tx, process_rx) = mpsc::unbounded_channel();
    let jobs = Jobs {
        bin,
        pool,
        staging_dirs,
        table: BTreeMap::new(),
        queue: VecDeque::new(),
        next_id: 1,
        process_tx,
        shutdown_replies: Vec::new(),
        shutting_down: false,
    };
    tokio::spawn(jobs.run(rx, process_rx));
    JobsHandle { tx }
}

/// The file in the store's home listing the directories outside `<home>/models` where jobs
/// staged their output (a custom `out`), one per line: a job's staging directory there is
/// found and swept at the next start if `mlxd` died with the job running.
pub const STAGING_DIRS: &str = "job-staging-dirs";

/// Adds `dir` to the list at `list` (once).
fn remember_staging_dir(list: &std::path::Path, dir: &std::path::Path) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(list) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let line = dir.to_string_lossy();
    if text.lines().any(|l| l == line) {
        return Ok(());
    }
    if let Some(parent) = list.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(list)?;
    std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes())
}

/// Sweeps every directory the list at `list` names, then keeps only those that still hold a
/// staging directory (of a live `mlxd`).
fn sweep_listed(list: &std::path::Path) {
    let text = match std::fs::read_to_string(list) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            warn!(file = %list.display(), error = %e, "cannot read the list of job staging directories");
            return;
        }
    };
    let mut keep = String::new();
    for dir in text.lines().filter(|l| !l.is_empty()) {
        let dir = std::path::Path::new(dir);
        sweep_staging(dir);
        let staged = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .contains(request::STAGING_MARK)
            });
        if staged {
            keep.push_str(&format!("{}\n", dir.display()));
        }
    }
    if let Err(e) = std::fs::write(list, keep) {
        warn!(file = %list.display(), error = %e, "cannot rewrite the list of job staging directories");
    }
}

/// Removes the staging directories (`.<name>.mlxd-job-<pid>-<id>`) in `dir` whose `mlxd` is
/// gone; another `mlxd` sharing the store keeps its own.
fn sweep_staging(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') {
            continue;
        }
        let Some((_, rest)) = name.split_once(request::STAGING_MARK) else {
            continue;
        };
        let owner_alive = rest
            .split_once('-')
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
            .is_some_and(|pid| {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
            });
        if !owner_alive {
            warn!(dir = %entry.path().display(), "removing a job's staging directory left by an earlier mlxd");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Jobs {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut processes: mpsc::UnboundedReceiver<ProcessEvent>,
    ) {
        let mut tick = tokio::time::interval(RETRY_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut handles_gone = false;
        loop {
            tokio::select! {
                cmd = commands.recv(), if !handles_gone => match cmd {
                    Some(cmd) => self.command(cmd).await,
                    None => {
                        handles_gone = true;
                        self.begin_shutdown();
                    }
                },
                Some(event) = processes.recv() => self.process_event(event).await,
                _ = tick.tick(), if !self.queue.is_empty() => self.admit_queued().await,
            }
            if self.shutting_down && self.running() == 0 {
                for r in self.shutdown_replies.drain(..) {
                    let _ = r.send(());
                }
                if handles_gone {
                    return;
                }
            }
        }
    }

    fn running(&self) -> usize {
        self.table
            .values()
            .filter(|e| e.job.state == JobState::Running)
            .count()
    }

    async fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { job, reply } => {
                let r = self.submit(*job).await;
                let _ = reply.send(r);
            }
            Command::List { reply } => {
                let _ = reply.send(self.table.values().map(|e| e.job.clone()).collect());
            }
            Command::Get { id, reply } => {
                let _ = reply.send(self.table.get(&id).map(|e| e.job.clone()));
            }
            Command::Follow { id, reply } => {
                let _ = reply.send(
                    self.table
                        .get(&id)
                        .map(|e| (e.job.clone(), e.events.subscribe())),
                );
            }
            Command::Cancel { id, reply } => self.cancel(&id, reply).await,
            Command::Shutdown { reply } => {
                self.shutdown_replies.push(reply);
                self.begin_shutdown();
            }
        }
    }

    async fn submit(&mut self, prepared: PreparedJob) -> Result<Job, ProxyError> {
        if self.shutting_down {
            return Err(ProxyError::ShuttingDown);
        }
        let id = format!("job-{}", self.next_id);
        self.next_id += 1;
        let job = Job {
            id: id.clone(),
            kind: prepared.request.kind(),
            state: JobState::Queued,
            request: prepared.request.clone(),
            created: now_secs(),
            started: None,
            finished: None,
            memory_bytes: prepared.memory_bytes,
            waiting_for: None,
            pid: None,
            progress: None,
            result: None,
            error: None,
        };
        // Refused outright when it can never fit; otherwise queued behind earlier jobs.
        if self.queue.is_empty() {
            match self.pool.reserve_job(&id, prepared.memory_bytes).await {
                Admission::Refuse {
                    needed,
                    available,
                    budget,
                } => {
                    return Err(ProxyError::JobTooLarge {
                        kind: job.kind.as_str(),
                        needed,
                        available,
                        budget,
                    })
                }
                Admission::ShuttingDown => return Err(ProxyError::ShuttingDown),
                Admission::Start => {
                    self.insert(id.clone(), job, prepared);
                    self.launch(&id);
                    return Ok(self.table[&id].job.clone());
                }
                Admission::Wait { needed, available } => {
                    let mut job = job;
                    job.waiting_for = Some(wait_reason(needed, available));
                    self.insert(id.clone(), job, prepared);
                }
            }
        } else {
            let mut job = job;
            job.waiting_for = Some("earlier queued jobs".into());
            self.insert(id.clone(), job, prepared);
        }
        self.queue.push_back(id.clone());
        info!(job = %id, memory_bytes = self.table[&id].job.memory_bytes, "job queued");
        Ok(self.table[&id].job.clone())
    }

    fn insert(&mut self, id: String, job: Job, prepared: PreparedJob) {
        let (events, _) = broadcast::channel(256);
        self.table.insert(
            id,
            Entry {
                job,
                prepared,
                events,
                sent: None,
                cancelling: false,
                cancel_replies: Vec::new(),
            },
        );
        // Bounded history: the oldest finished jobs go.
        let finished: Vec<String> = self
            .table
            .iter()
            .filter(|(_, e)| e.job.state.is_final())
            .map(|(k, _)| k.clone())
            .collect();
        if finished.len() > KEEP_FINISHED {
            let mut by_age: Vec<(u64, String)> = finished
                .into_iter()
                .map(|k| (self.table[&k].job.finished.unwrap_or(0), k))
                .collect();
            by_age.sort();
            for (_, k) in by_age.into_iter().take(self.table.len() - KEEP_FINISHED) {
                self.table.remove(&k);
            }
        }
    }

    /// Admits queued jobs in order while they fit.
    async fn admit_queued(&mut self) {
        while let Some(id) = self.queue.front().cloned() {
            let Some(bytes) = self.table.get(&id).map(|e| e.job.memory_bytes) else {
                self.queue.pop_front();
                continue;
            };
            match self.pool.reserve_job(&id, bytes).await {
                Admission::Start => {
                    self.queue.pop_front();
                    self.launch(&id);
                }
                Admission::Wait { needed, available } => {
                    if let Some(e) = self.table.get_mut(&id) {
                        e.job.waiting_for = Some(wait_reason(needed, available));
                    }
                    return;
                }
                Admission::Refuse {
                    needed,
                    available,
                    budget,
                } => {
                    self.queue.pop_front();
                    let err = ProxyError::JobTooLarge {
                        kind: self.table[&id].job.kind.as_str(),
                        needed,
                        available,
                        budget,
                    };
                    self.finish(&id, JobState::Failed, None, Some(err.to_string()));
                }
                Admission::ShuttingDown => return,
            }
        }
    }

    /// Spawns the job's process (its memory is already counted).
    fn launch(&mut self, id: &str) {
        let bin = self.bin.clone();
        let Some(entry) = self.table.get_mut(id) else {
            return;
        };
        let spec = entry.prepared.work.spec(id);
        // A staging directory outside the store is listed first, so that a crash of mlxd
        // mid-job cannot leave it unknown to the next start.
        if let (Some(list), Some(parent)) = (
            &self.staging_dirs,
            entry
                .prepared
                .work
                .staging(id)
                .as_deref()
                .and_then(std::path::Path::parent),
        ) {
            if let Err(e) = remember_staging_dir(list, parent) {
                warn!(job = %id, file = %list.display(), error = %e, "cannot list the job's staging directory; a crash would leave it behind");
            }
        }
        match process::spawn(id, &bin, &spec, self.process_tx.clone()) {
            Ok(pid) => {
                entry.job.state = JobState::Running;
                entry.job.pid = Some(pid);
                entry.job.started = Some(now_secs());
                entry.job.waiting_for = None;
                let _ = entry
                    .events
                    .send(JobEvent::State(Box::new(entry.job.clone())));
            }
            Err(e) => {
                let message = format!("starting the job process {}: {e}", bin.display());
                warn!(job = %id, error = %message, "job failed to start");
                let pool = self.pool.clone();
                let job_id = id.to_string();
                tokio::spawn(async move { pool.release_job(&job_id).await });
                self.finish(id, JobState::Failed, None, Some(message));
            }
        }
    }

    async fn process_event(&mut self, event: ProcessEvent) {
        match event {
            ProcessEvent::Progress { id, progress } => {
                if let Some(e) = self.table.get_mut(&id) {
                    if worth_sending(e.sent.as_ref(), &progress) {
                        let _ = e.events.send(JobEvent::Progress(progress.clone()));
                        e.sent = Some(progress.clone());
                    }
                    e.job.progress = Some(progress);
                }
            }
            ProcessEvent::Exited { id, end } => {
                self.pool.release_job(&id).await;
                self.exited(&id, end);
                self.admit_queued().await;
            }
        }
    }

    fn exited(&mut self, id: &str, end: ProcessEnd) {
        let Some(entry) = self.table.get(id) else {
            return;
        };
        let (state, result, error) = if entry.cancelling {
            (JobState::Cancelled, None, Some("cancelled".to_string()))
        } else if let Some(result) = end.succeeded() {
            (JobState::Succeeded, Some(result.clone()), None)
        } else {
            (JobState::Failed, None, Some(end.failure_message()))
        };
        if state != JobState::Succeeded {
            if let Some(staging) = entry.prepared.work.staging(id) {
                if let Err(e) = std::fs::remove_dir_all(&staging) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        warn!(job = %id, dir = %staging.display(), error = %e, "removing the job's staging directory failed");
                    }
                }
            }
        }
        info!(job = %id, state = state.as_str(), error = ?error, "job ended");
        self.finish(id, state, result, error);
    }

    /// Records the end of a job, tells its followers and answers its cancellers.
    fn finish(
        &mut self,
        id: &str,
        state: JobState,
        result: Option<mlxd_protocol::jobs::JobResult>,
        error: Option<String>,
    ) {
        let Some(entry) = self.table.get_mut(id) else {
            return;
        };
        entry.job.state = state;
        entry.job.result = result;
        entry.job.error = error;
        entry.job.finished = Some(now_secs());
        entry.job.pid = None;
        entry.job.waiting_for = None;
        let job = entry.job.clone();
        let _ = entry.events.send(JobEvent::Final(Box::new(job.clone())));
        for r in entry.cancel_replies.drain(..) {
            let _ = r.send(Ok(job.clone()));
        }
    }

    async fn cancel(&mut self, id: &str, reply: Reply<Result<Job, ProxyError>>) {
        let Some(entry) = self.table.get_mut(id) else {
            let _ = reply.send(Err(not_found(id)));
            return;
        };
        match entry.job.state {
            JobState::Queued => {
                self.queue.retain(|q| q != id);
                info!(job = %id, "queued job cancelled");
                self.finish(id, JobState::Cancelled, None, Some("cancelled".into()));
                let _ = reply.send(Ok(self.table[id].job.clone()));
            }
            JobState::Running => {
                entry.cancelling = true;
                entry.cancel_replies.push(reply);
                if let Some(pid) = entry.job.pid {
                    info!(job = %id, pid, "cancelling: killing the job's process group");
                    process::kill_group(pid);
                }
            }
            state => {
                let _ = reply.send(Err(ProxyError::JobFinished {
                    id: id.to_string(),
                    state: state.as_str(),
                }));
            }
        }
    }

    fn begin_shutdown(&mut self) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        for id in std::mem::take(&mut self.queue) {
            self.finish(
                &id,
                JobState::Cancelled,
                None,
                Some("mlxd shut down".into()),
            );
        }
        for entry in self.table.values_mut() {
            if entry.job.state == JobState::Running {
                entry.cancelling = true;
                if let Some(pid) = entry.job.pid {
                    info!(job = %entry.job.id, pid, "shutting down: killing the job's process group");
                    process::kill_group(pid);
                }
            }
        }
    }
}

fn wait_reason(needed: u64, available: u64) -> String {
    format!(
        "memory: needs {needed} bytes ({}), {available} bytes ({}) free in the budget beside loaded models and running jobs",
        crate::config::Bytes(needed),
        crate::config::Bytes(available)
    )
}

/// Whether followers should hear of `next`: a new phase or item, the end of the count, or at
/// least 1% more of it.
fn worth_sending(sent: Option<&JobProgress>, next: &JobProgress) -> bool {
    let Some(sent) = sent else {
        return true;
    };
    if sent.phase != next.phase || sent.unit != next.unit || next.done >= next.total {
        return true;
    }
    if next.unit == "tensors" {
        return sent.detail != next.detail;
    }
    let step = (next.total / 100).max(1 << 20);
    next.done.saturating_sub(sent.done) >= step
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(phase: &str, done: u64, total: u64, unit: &str) -> JobProgress {
        JobProgress {
            phase: phase.into(),
            done,
            total,
            unit: unit.into(),
            detail: None,
            training: None,
        }
    }

    #[test]
    fn byte_progress_is_thinned_to_percent_steps() {
        let total = 1000 << 20;
        let first = p("downloading", 0, total, "bytes");
        assert!(worth_sending(None, &first));
        assert!(!worth_sending(
            Some(&first),
            &p("downloading", 5 << 20, total, "bytes")
        ));
        assert!(worth_sending(
            Some(&first),
            &p("downloading", 11 << 20, total, "bytes")
        ));
        assert!(worth_sending(
            Some(&first),
            &p("downloading", total, total, "bytes")
        ));
        assert!(worth_sending(Some(&first), &p("converting", 0, 1, "files")));
    }

    #[test]
    fn only_staging_directories_of_a_gone_mlxd_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let ours = format!(".m.mlxd-job-{}-job-1", std::process::id());
        // Beyond the kernel's pid range: no such process.
        let gone = ".m.mlxd-job-2147483646-job-1";
        for name in [ours.as_str(), gone, "kept-model"] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        sweep_staging(dir.path());
        assert!(dir.path().join(&ours).exists());
        assert!(!dir.path().join(gone).exists());
        assert!(dir.path().join("kept-model").exists());
    }

    /// Issue 23, finding 9: a job's staging directory beside a custom `out` (outside the
    /// store) was never swept after `mlxd` died mid-job. Its directory is listed when the job
    /// starts and swept at the next start.
    #[test]
    fn staging_beside_a_custom_out_is_swept_at_the_next_start() {
        let tmp = tempfile::tempdir().unwrap();
        let list = tmp.path().join("home").join(STAGING_DIRS);
        let out_dir = tmp.path().join("elsewhere");
        let other = tmp.path().join("other");
        for d in [&out_dir, &other] {
            std::fs::create_dir_all(d).unwrap();
            remember_staging_dir(&list, d).unwrap();
        }
        remember_staging_dir(&list, &out_dir).unwrap();
        assert_eq!(std::fs::read_to_string(&list).unwrap().lines().count(), 2);
        let gone = out_dir.join(".q4.mlxd-job-2147483646-job-1");
        let live = out_dir.join(format!(".q8.mlxd-job-{}-job-2", std::process::id()));
        for d in [&gone, &live] {
            std::fs::create_dir(d).unwrap();
        }
        sweep_listed(&list);
        assert!(!gone.exists() && live.exists());
        // `other` holds nothing staged: dropped from the list; `out_dir` stays listed.
        let listed = std::fs::read_to_string(&list).unwrap();
        assert_eq!(listed, format!("{}\n", out_dir.display()));
    }

    #[test]
    fn failure_messages_say_how_the_process_ended() {
        let end = ProcessEnd {
            result: None,
            failure: None,
            code: None,
            signal: Some(9),
            stderr_tail: vec!["quantizing".into()],
        };
        assert_eq!(
            end.failure_message(),
            "the job process was killed (signal 9, SIGKILL); its last log line: quantizing"
        );
        let end = ProcessEnd {
            failure: Some("bad config".into()),
            ..end
        };
        assert_eq!(end.failure_message(), "bad config");
    }
}
