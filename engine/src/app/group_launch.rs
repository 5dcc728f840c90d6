//! Rank 0 of an engine group under `mlxd` starts the other ranks itself, as `mlx.launch` would
//! on one machine, with the environment MLX reads for the backend: for `ring` a free port per
//! rank in MLX's JSON hostfile beside its socket (`MLX_RANK`, `MLX_HOSTFILE`); for `nccl` a
//! rendezvous port and one GPU per rank (`MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`,
//! `NCCL_PORT`, `CUDA_VISIBLE_DEVICES`: the rank's entry of the visible devices). It runs
//! `mlxd-engine --distributed <backend>` for ranks 1... They are its children, in its process group, with a parent-death
//! signal: `mlxd` stopping or killing rank 0's process group ends every rank, so the pool
//! sees one engine. A rank that fails ends rank 0 too ([`EXIT_GROUP_BROKEN`]), so the pool
//! restarts the whole group.
use std::net::TcpListener;
#[cfg(target_os = "linux")]
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use mlxd_protocol::control::Launch;
use mlxd_protocol::engine_options::EngineOptions;

use super::group::{join, Setup};
use super::start_error::StartError;
use crate::distributed::replica::EXIT_GROUP_BROKEN;
use crate::distributed::{Group, GroupError};

/// Host names that mean this machine.
const LOCAL_HOSTS: &[&str] = &["127.0.0.1", "localhost", "::1"];

/// The group `launch` asks for (`distributed`, `distributed_hosts` in its options), with the
/// other ranks started and joined; `None` for a single engine.
pub fn lead_local_group(launch: &Launch, home: &Path) -> Result<Option<Group>, StartError> {
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
    let hosts: Vec<String> = match &options.distributed_hosts {
        Some(h) => h.split(',').map(str::to_owned).collect(),
        None => {
            return Err(refused(
                "an engine group under mlxd needs its hosts (distributed_hosts)".into(),
            ))
        }
    };
    if !crate::distributed::group::is_available(&backend) {
        return Err(StartError::Group(GroupError::Unavailable(backend.clone())));
    }
    if let Some(host) = hosts.iter().find(|h| !LOCAL_HOSTS.contains(&h.as_str())) {
        return Err(refused(format!(
            "host {host}: ranks on other machines are not supported yet (local hosts only: {})",
            LOCAL_HOSTS.join(", ")
        )));
    }
    let env = rank_env(&backend, hosts.len(), &launch.socket_path)
        .map_err(|e| refused(format!("cannot prepare the group: {e}")))?;
    // MLX reads the rank and its peers from the environment at init; this runs on the main
    // thread before the MLX thread or the server start.
    for (key, value) in env(0) {
        std::env::set_var(key, value);
    }
    let followers = (1..hosts.len())
        .map(|rank| spawn_rank(&backend, env(rank), &launch.model, home))
        .collect::<std::io::Result<Vec<Child>>>()
        .map_err(|e| refused(format!("cannot start the other ranks: {e}")))?;
    watch_ranks(followers);
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

/// The environment of each rank of a `ranks`-rank group on this machine.
type RankEnv = Box<dyn Fn(usize) -> Vec<(&'static str, String)>>;

/// What MLX's `backend` reads, per rank ([`RankEnv`]); `socket` names where files go.
fn rank_env(backend: &str, ranks: usize, socket: &Path) -> std::io::Result<RankEnv> {
    match backend {
        "ring" => {
            let hostfile = socket.with_extension("hosts.json");
            write_hostfile(&hostfile, ranks)?;
            let hostfile = hostfile.display().to_string();
            Ok(Box::new(move |rank| {
                vec![
                    ("MLX_RANK", rank.to_string()),
                    ("MLX_HOSTFILE", hostfile.clone()),
                ]
            }))
        }
        "nccl" => {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            // One GPU per rank: the rank's entry of the devices this engine may see.
            let visible: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES")
                .ok()
                .filter(|v| !v.trim().is_empty())
                .map(|v| v.split(',').map(|d| d.trim().to_owned()).collect())
                .unwrap_or_else(|| (0..ranks).map(|d| d.to_string()).collect());
            if visible.len() < ranks {
                return Err(std::io::Error::other(format!(
                    "{ranks} ranks need {ranks} GPUs, but CUDA_VISIBLE_DEVICES names {}",
                    visible.len()
                )));
            }
            Ok(Box::new(move |rank| {
                vec![
                    ("MLX_RANK", rank.to_string()),
                    ("MLX_WORLD_SIZE", ranks.to_string()),
                    ("NCCL_HOST_IP", "127.0.0.1".to_owned()),
                    ("NCCL_PORT", port.to_string()),
                    ("CUDA_VISIBLE_DEVICES", visible[rank].clone()),
                ]
            }))
        }
        other => Err(std::io::Error::other(format!(
            "mlxd starts ring and nccl groups only; start {other} groups with mlx.launch and \
             `mlxd-engine --distributed {other}`"
        ))),
    }
}

/// MLX's hostfile for `ranks` ranks on 127.0.0.1, each on a port free now.
fn write_hostfile(path: &Path, ranks: usize) -> std::io::Result<()> {
    let listeners = (0..ranks)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let entries = listeners
        .iter()
        .map(|l| Ok(serde_json::json!([l.local_addr()?.to_string()])))
        .collect::<std::io::Result<Vec<_>>>()?;
    drop(listeners);
    std::fs::write(path, serde_json::to_vec(&entries)?)
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
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: runs between fork and exec and only calls prctl (async-signal-safe): the rank
    // dies with this thread (the main thread, which lives as long as rank 0). Linux only, as
    // the supervisor's own (elsewhere a rank ends when its peers' connections close).
    #[cfg(target_os = "linux")]
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Ends rank 0 when another rank fails; a rank that exits cleanly was stopped by rank 0.
fn watch_ranks(followers: Vec<Child>) {
    for (i, mut child) in followers.into_iter().enumerate() {
        let rank = i + 1;
        let spawned = std::thread::Builder::new()
            .name(format!("rank-{rank}-watch"))
            .spawn(move || match child.wait() {
                Ok(status) if status.success() => {}
                Ok(status) => {
                    tracing::error!(rank, %status, "an engine group rank died; ending the group");
                    std::process::exit(EXIT_GROUP_BROKEN)
                }
                Err(e) => {
                    tracing::error!(rank, error = %e, "cannot watch an engine group rank");
                    std::process::exit(EXIT_GROUP_BROKEN)
                }
            });
        if let Err(e) = spawned {
            tracing::error!(rank, error = %e, "cannot watch an engine group rank");
            std::process::exit(EXIT_GROUP_BROKEN)
        }
    }
}
