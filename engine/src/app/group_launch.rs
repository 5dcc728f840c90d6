//! Rank 0 of an engine group under `mlxd` starts the other ranks itself, as `mlx.launch`
//! would, with the environment MLX reads for the backend: for `ring` each rank's address in
//! MLX's JSON hostfile (`MLX_RANK`, `MLX_HOSTFILE`); for `nccl` (one machine) a rendezvous
//! port and one GPU per rank (`MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT`,
//! `CUDA_VISIBLE_DEVICES`: the rank's entry of the visible devices). Ranks on this machine run
//! `mlxd-engine --distributed <backend>` as rank 0's children; ranks on other machines are
//! started through `ssh` ([`super::ssh_rank`]). Either way the child (the rank, or its `ssh`)
//! is in rank 0's process group with a parent-death signal: `mlxd` stopping or killing rank
//! 0's process group ends every rank, so the pool sees one engine. A rank that fails ends rank
//! 0 too, through the caller's `on_failure` with the reason ([`EXIT_GROUP_BROKEN`] after), so
//! the pool restarts the whole group, or fails its load naming the rank and what it said.
use std::net::TcpListener;
#[cfg(target_os = "linux")]
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use mlxd_protocol::control::Launch;
use mlxd_protocol::engine_options::EngineOptions;
use mlxd_protocol::group_hosts::{self, GroupHost, RING_STARTING_PORT};

use super::group::{join, Setup};
use super::ssh_rank::RemoteRank;
use super::start_error::StartError;
use crate::distributed::replica::{EXIT_GROUP_BROKEN, LEADER_PID_ENV};
use crate::distributed::{Group, GroupError};

/// Told why the group failed (a rank exited, `ssh` could not start one); the process exits
/// after it returns.
pub type OnRankFailure = Arc<dyn Fn(String) + Send + Sync>;

/// The group `launch` asks for (`distributed`, `distributed_hosts` in its options), with the
/// other ranks started and joined; `None` for a single engine.
pub fn lead_group(
    launch: &Launch,
    home: &Path,
    on_failure: OnRankFailure,
) -> Result<Option<Group>, StartError> {
    let options = EngineOptions::from_map(&launch.options).map_err(|e| StartError::Option {
        key: e.key,
        value: e.value,
        reason: e.reason,
    })?;
    let Some(backend) = options.distributed else {
        return Ok(None);
    };
    let refused = |reason: String| {
        StartError::Group(GroupError::Init {
            backend: backend.clone(),
            reason,
        })
    };
    let hosts = match &options.distributed_hosts {
        Some(h) => group_hosts::parse_hosts(h).map_err(refused)?,
        None => {
            return Err(refused(
                "an engine group under mlxd needs its hosts (distributed_hosts)".into(),
            ))
        }
    };
    if !crate::distributed::group::is_available(&backend) {
        return Err(StartError::Group(GroupError::Unavailable(backend.clone())));
    }
    let plan = rank_env(&backend, &hosts, &launch.socket_path).map_err(refused)?;
    // MLX reads the rank and its peers from the environment at init; this runs on the main
    // thread before the MLX thread or the server start.
    for (key, value) in (plan.env)(0) {
        std::env::set_var(key, value);
    }
    let engine = std::env::current_exe()
        .map_err(|e| refused(format!("cannot find this engine's own path: {e}")))?;
    let engine = engine.display().to_string();
    for (rank, host) in hosts.iter().enumerate().skip(1) {
        let started = if host.is_local() {
            spawn_rank(&backend, (plan.env)(rank), &launch.model, home).map(Rank::Local)
        } else {
            spawn_remote(rank, host, &plan, &engine, &launch.model)
        };
        let started = started
            .map_err(|e| refused(format!("cannot start rank {rank} (host {}): {e}", host.ssh)))?;
        watch_rank(rank, host.ssh.clone(), started, on_failure.clone())
            .map_err(|e| refused(format!("cannot watch rank {rank}: {e}")))?;
    }
    let group = join(&backend)?;
    let setup = Setup {
        model: launch.model.clone(),
        max_batch_size: launch.limits.max_batch_size.map(|n| n as usize),
        kv_budget_bytes: launch.limits.kv_budget_bytes,
        context_length: launch.limits.context_length.map(|n| n as usize),
        options: launch.options.clone(),
    };
    Setup::agree(&group, Some(&setup))?;
    Ok(Some(group))
}

/// How each rank joins: the environment MLX reads, per rank, and for `ring` the hostfile's
/// JSON (what a remote rank writes on its own host).
struct RankPlan {
    env: Box<dyn Fn(usize) -> Vec<(&'static str, String)>>,
    hostfile: Option<String>,
}

/// What MLX's `backend` reads, per rank ([`RankPlan`]); `socket` names where files go.
fn rank_env(backend: &str, hosts: &[GroupHost], socket: &Path) -> Result<RankPlan, String> {
    let ranks = hosts.len();
    match backend {
        "ring" => {
            let json = ring_hostfile(hosts)?;
            let hostfile = socket.with_extension("hosts.json");
            std::fs::write(&hostfile, &json)
                .map_err(|e| format!("cannot write {}: {e}", hostfile.display()))?;
            let hostfile = hostfile.display().to_string();
            Ok(RankPlan {
                env: Box::new(move |rank| {
                    vec![
                        ("MLX_RANK", rank.to_string()),
                        ("MLX_HOSTFILE", hostfile.clone()),
                    ]
                }),
                hostfile: Some(json),
            })
        }
        "nccl" => {
            if let Some(h) = hosts.iter().skip(1).find(|h| !h.is_local()) {
                return Err(format!(
                    "host {}: mlxd starts nccl groups on this machine only (one GPU per rank); \
                     ranks on other machines need the ring backend",
                    h.ssh
                ));
            }
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("no free port for NCCL's rendezvous: {e}"))?
                .port();
            // One GPU per rank: the rank's entry of the devices this engine may see.
            let visible: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
                .ok()
                .filter(|v| !v.trim().is_empty())
                .map(|v| v.split(',').map(|d| d.trim().to_owned()).collect())
                .unwrap_or_else(|| (0..ranks).map(|d| d.to_string()).collect());
            if visible.len() < ranks {
                return Err(format!(
                    "{ranks} ranks need {ranks} GPUs, but CUDA_VISIBLE_DEVICES names {}",
                    visible.len()
                ));
            }
            Ok(RankPlan {
                env: Box::new(move |rank| {
                    vec![
                        ("MLX_RANK", rank.to_string()),
                        ("MLX_WORLD_SIZE", ranks.to_string()),
                        ("NCCL_HOST_IP", "127.0.0.1".to_owned()),
                        ("NCCL_PORT", port.to_string()),
                        ("CUDA_VISIBLE_DEVICES", visible[rank].clone()),
                    ]
                }),
                hostfile: None,
            })
        }
        other => Err(format!(
            "mlxd starts ring and nccl groups only; start {other} groups with mlx.launch and \
             `mlxd-engine --distributed {other}`"
        )),
    }
}

/// MLX's ring hostfile: one `["ip:port"]` per rank. A rank's port is its entry's `port`;
/// else one free now for rank 0 and the ranks on this machine, and [`RING_STARTING_PORT`]
/// plus the rank on other machines (`mlx.launch`'s numbering).
fn ring_hostfile(hosts: &[GroupHost]) -> Result<String, String> {
    group_hosts::check_ring(hosts)?;
    let mut held = Vec::new();
    let mut entries = Vec::new();
    for (rank, host) in hosts.iter().enumerate() {
        let ip = host.ring_ip()?;
        let port = match host.port {
            Some(port) => port,
            None if rank == 0 || host.is_local() => {
                let listener = TcpListener::bind((ip.as_str(), 0))
                    .map_err(|e| format!("no free port on {ip} for rank {rank}: {e}"))?;
                let port = listener.local_addr().map_err(|e| e.to_string())?.port();
                // Held until every port is chosen, so that two ranks do not get the same.
                held.push(listener);
                port
            }
            None => RING_STARTING_PORT + rank as u16,
        };
        let address = if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        };
        entries.push(serde_json::json!([address]));
    }
    drop(held);
    Ok(serde_json::Value::Array(entries).to_string())
}

/// A started rank: the local engine, or the `ssh` that runs it elsewhere.
enum Rank {
    Local(Child),
    Remote(super::ssh_rank::Started),
}

/// Starts rank `rank` on `host` through `ssh`.
fn spawn_remote(
    rank: usize,
    host: &GroupHost,
    plan: &RankPlan,
    engine: &str,
    model: &str,
) -> std::io::Result<Rank> {
    let hostfile = plan
        .hostfile
        .as_deref()
        .ok_or_else(|| std::io::Error::other("ranks on other machines need the ring backend"))?;
    // Rank 0's own settings that the remote rank needs as well.
    let env = ["MLXD_GROUP_INIT_TIMEOUT", "RUST_LOG"]
        .into_iter()
        .filter_map(|key| std::env::var(key).ok().map(|v| (key, v)))
        .collect();
    let remote = RemoteRank {
        rank,
        host,
        hostfile,
        engine: host.engine.as_deref().unwrap_or(engine),
        model,
        env,
    };
    tracing::info!(rank, host = %host.ssh, "starting a rank through ssh");
    remote.spawn().map(Rank::Remote)
}

fn spawn_rank(
    backend: &str,
    env: Vec<(&'static str, String)>,
    model: &str,
    home: &Path,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--distributed", backend, "--model", model])
        .arg("--home")
        .arg(home)
        .envs(env)
        // Its log lines reach mlxd through rank 0's stderr, as plain text.
        .env("NO_COLOR", "1")
        // A rank that finds the group hung ends rank 0 too (which may be the one stopped).
        .env(LEADER_PID_ENV, std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    die_with_this_thread(&mut cmd);
    cmd.spawn()
}

/// Makes the child `cmd` starts (a rank, or the `ssh` running one) die by SIGKILL when this
/// thread ends: the main thread, which lives as long as rank 0, so rank 0's end (a crash, a
/// kill, a hung step's `_exit`) ends it, stopped or not. Linux only, as the supervisor's own
/// (elsewhere a rank ends when its peers' connections close).
pub(super) fn die_with_this_thread(cmd: &mut Command) {
    // SAFETY: runs between fork and exec and only calls prctl (async-signal-safe).
    #[cfg(target_os = "linux")]
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// Ends rank 0, through `on_failure` with the reason, when rank `rank` fails; a rank that
/// exits cleanly was stopped by rank 0. A remote rank's lines (and `ssh`'s) are re-emitted in
/// rank 0's log meanwhile, and the last ones go into the reason.
fn watch_rank(
    rank: usize,
    host: String,
    started: Rank,
    on_failure: OnRankFailure,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(format!("rank-{rank}-watch"))
        .spawn(move || {
            let (status, said, place) = match started {
                Rank::Local(mut child) => (child.wait(), Vec::new(), "on this machine".to_owned()),
                // `started` holds the remote rank's stdin open until the thread ends.
                Rank::Remote(mut started) => {
                    let output = started.relay_output(rank, host.clone());
                    let status = started.child.wait();
                    let said = match output {
                        Ok(thread) => thread.join().unwrap_or_default(),
                        Err(_) => Vec::new(),
                    };
                    (status, said, format!("on {host} (through ssh)"))
                }
            };
            let mut message = match status {
                Ok(status) if status.success() => return,
                // `ssh` itself fails with 255: no answer, refused, or no login.
                Ok(status) if status.code() == Some(255) => {
                    format!("rank {rank} {place} did not start: ssh failed (exit status 255)")
                }
                Ok(status) => format!("rank {rank} {place} exited ({status})"),
                Err(e) => format!("cannot watch rank {rank} {place}: {e}"),
            };
            if !said.is_empty() {
                message.push_str(": ");
                message.push_str(&said.join(" | "));
            }
            tracing::error!(rank, "{message}; ending the engine group");
            on_failure(message);
            std::process::exit(EXIT_GROUP_BROKEN)
        })
        .map(drop)
}
