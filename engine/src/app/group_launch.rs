//! Rank 0 of an engine group under `mlxd` starts the other ranks itself, as `mlx.launch`
//! would, with the environment MLX reads for the backend: for `ring` each rank's address in
//! MLX's JSON hostfile (`MLX_RANK`, `MLX_HOSTFILE`); for `jaccl` the RDMA devices matrix and
//! rank 0's coordinator address (`MLX_RANK`, `MLX_IBV_DEVICES`, `MLX_JACCL_COORDINATOR`:
//! `mlxd_protocol::group_hosts::jaccl`); for `nccl` (one machine) a rendezvous port and one
//! GPU per rank (`MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT`,
//! `CUDA_VISIBLE_DEVICES`: the rank's entry of the visible devices). Ranks on this machine run
//! `mlxd-engine --distributed <backend>` as rank 0's children; ranks on other machines are
//! started through `ssh` ([`super::ssh_rank`]). Either way the child (the rank, or its `ssh`)
//! is in rank 0's process group with a parent-death signal: `mlxd` stopping or killing rank
//! 0's process group ends every rank, so the pool sees one engine. A rank that fails ends rank
//! 0 too, through the caller's `on_failure` with the reason ([`EXIT_GROUP_BROKEN`] after), so
//! the pool restarts the whole group, or fails its load naming the rank and what it said.
//!
//! The files MLX reads (the ring hostfile, the jaccl devices matrix) are read once, when a
//! rank joins: rank 0 writes this machine's copy beside its socket and removes it once every
//! rank has joined, or the group failed; a remote rank's shell writes its own and removes it
//! when the rank exits. A rank 0 killed before that leaves its copy in `mlxd`'s runtime
//! directory, which `mlxd` removes.
use std::net::TcpListener;
#[cfg(target_os = "linux")]
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use mlxd_protocol::control::Launch;
use mlxd_protocol::engine_options::EngineOptions;
use mlxd_protocol::group_hosts::{self, jaccl, GroupHost, RING_STARTING_PORT};

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
    let plan = rank_env(&backend, &hosts).map_err(refused)?;
    let files = LocalFiles::write(&plan.files, &launch.socket_path).map_err(refused)?;
    // MLX reads the rank and its peers from the environment at init; this runs on the main
    // thread before the MLX thread or the server start. The local ranks inherit what is
    // cleared here, and are given their own values over the rest.
    for key in plan.cleared {
        std::env::remove_var(key);
    }
    for (key, value) in (plan.env)(0).into_iter().chain(files.env()) {
        std::env::set_var(key, value);
    }
    let engine = std::env::current_exe()
        .map_err(|e| refused(format!("cannot find this engine's own path: {e}")))?;
    let engine = engine.display().to_string();
    for (rank, host) in hosts.iter().enumerate().skip(1) {
        let started = if host.is_local() {
            let env = (plan.env)(rank).into_iter().chain(files.env()).collect();
            spawn_rank(&backend, env, &launch.model, home).map(Rank::Local)
        } else {
            spawn_remote(rank, host, &backend, &plan, &engine, &launch.model)
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
    // The agreement is a collective of every rank, so every rank has read the files.
    drop(files);
    Ok(Some(group))
}

/// How each rank joins, as MLX's backend reads it.
struct RankPlan {
    /// The variables MLX reads, per rank, besides those naming its files.
    env: Box<dyn Fn(usize) -> Vec<(&'static str, String)>>,
    /// The files MLX reads, the same for every rank: written on this machine for rank 0 and
    /// its local children ([`LocalFiles`]), and by a remote rank's shell on its own host.
    files: Vec<RankFile>,
    /// Variables no rank may inherit from this process's environment (other spellings of the
    /// backend's settings).
    cleared: &'static [&'static str],
}

/// A file MLX reads: the variable that names it, its name beside rank 0's socket, its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RankFile {
    pub var: &'static str,
    pub name: &'static str,
    pub content: String,
}

/// What MLX's `backend` reads, per rank ([`RankPlan`]).
fn rank_env(backend: &str, hosts: &[GroupHost]) -> Result<RankPlan, String> {
    let ranks = hosts.len();
    match backend {
        "ring" => Ok(RankPlan {
            env: Box::new(move |rank| vec![("MLX_RANK", rank.to_string())]),
            files: vec![RankFile {
                var: "MLX_HOSTFILE",
                name: "hosts.json",
                content: ring_hostfile(hosts)?,
            }],
            cleared: &[],
        }),
        "jaccl" => {
            let group = jaccl::JacclGroup::new(hosts, coordinator_port(hosts)?)?;
            let devices = group.devices.clone();
            Ok(RankPlan {
                env: Box::new(move |rank| group.env(rank)),
                files: vec![RankFile {
                    var: jaccl::DEVICES_ENV,
                    name: "ibv-devices.json",
                    content: devices,
                }],
                cleared: jaccl::NOT_INHERITED,
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
                files: Vec::new(),
                cleared: &[],
            })
        }
        other => Err(format!(
            "mlxd starts ring, jaccl and nccl groups only; start {other} groups with mlx.launch \
             and `mlxd-engine --distributed {other}`"
        )),
    }
}

/// The jaccl coordinator's port on rank 0 (this machine): its entry's `port`, else a free
/// one. Either is listened on once here, which also proves the coordinator's address is one
/// of this machine's.
fn coordinator_port(hosts: &[GroupHost]) -> Result<u16, String> {
    let ip = jaccl::coordinator_ip(hosts)?;
    let port = hosts.first().and_then(|h| h.port).unwrap_or(0);
    TcpListener::bind((ip, port))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| {
            format!(
                "the jaccl coordinator (rank 0, this machine) cannot listen on {ip} port {port}: \
                 {e}; rank 0's address must be one of this machine's"
            )
        })
}

/// This machine's copies of a plan's files, beside rank 0's socket; removed when dropped.
struct LocalFiles(Vec<(&'static str, PathBuf)>);

impl LocalFiles {
    fn write(files: &[RankFile], socket: &Path) -> Result<Self, String> {
        let mut written = LocalFiles(Vec::new());
        for file in files {
            let path = socket.with_extension(file.name);
            std::fs::write(&path, &file.content)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            written.0.push((file.var, path));
        }
        Ok(written)
    }

    /// Each file's variable and path.
    fn env(&self) -> Vec<(&'static str, String)> {
        self.0
            .iter()
            .map(|(var, path)| (*var, path.display().to_string()))
            .collect()
    }
}

impl Drop for LocalFiles {
    fn drop(&mut self) {
        for (_, path) in &self.0 {
            if let Err(e) = std::fs::remove_file(path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a group file");
                }
            }
        }
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
    backend: &str,
    plan: &RankPlan,
    engine: &str,
    model: &str,
) -> std::io::Result<Rank> {
    // Rank 0's own settings that the remote rank needs as well.
    let mut env = (plan.env)(rank);
    env.extend(
        ["MLXD_GROUP_INIT_TIMEOUT", "RUST_LOG"]
            .into_iter()
            .filter_map(|key| std::env::var(key).ok().map(|v| (key, v))),
    );
    let remote = RemoteRank {
        host,
        backend,
        files: &plan.files,
        engine: host.engine.as_deref().unwrap_or(engine),
        model,
        env,
        cleared: plan.cleared,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks on this machine, as a jaccl group would name them (a test needs no cable).
    fn jaccl_pair(port: Option<u16>) -> Vec<GroupHost> {
        group_hosts::parse_hosts(&format!(
            r#"[{{"ssh": "127.0.0.1", "rdma": [null, "rdma_en3"]{}}},
                {{"ssh": "127.0.0.1", "rdma": ["rdma_en3", null]}}]"#,
            port.map(|p| format!(", \"port\": {p}")).unwrap_or_default()
        ))
        .unwrap()
    }

    /// Every rank gets what `mlx.launch --backend jaccl` gives it: its rank, rank 0's
    /// `ip:port`, and a file of the devices matrix that is gone once the group has formed.
    #[test]
    fn a_jaccl_rank_gets_mlx_launchs_environment_and_the_devices_file() {
        let plan = rank_env("jaccl", &jaccl_pair(None)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let files = LocalFiles::write(&plan.files, &dir.path().join("engine-0.sock")).unwrap();
        let path = dir.path().join("engine-0.ibv-devices.json");
        assert_eq!(
            files.env(),
            vec![("MLX_IBV_DEVICES", path.display().to_string())]
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            r#"[[null,"rdma_en3"],["rdma_en3",null]]"#
        );
        for rank in 0..2 {
            let env = (plan.env)(rank);
            let names: Vec<&str> = env.iter().map(|(k, _)| *k).collect();
            assert_eq!(names, ["MLX_RANK", "MLX_JACCL_COORDINATOR"]);
            assert_eq!(env[0].1, rank.to_string());
            let port = env[1].1.strip_prefix("127.0.0.1:").unwrap();
            assert!(port.parse::<u16>().unwrap() > 0, "{env:?}");
        }
        assert!(plan.cleared.contains(&"JACCL_RANK"));
        drop(files);
        assert!(!path.exists());
    }

    #[test]
    fn a_coordinator_port_in_use_is_refused_naming_it() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = rank_env("jaccl", &jaccl_pair(Some(port)))
            .err()
            .expect("the port is taken");
        assert!(
            e.contains(&format!("cannot listen on 127.0.0.1 port {port}")),
            "{e}"
        );
        let plan = rank_env("jaccl", &jaccl_pair(None)).unwrap();
        assert!((plan.env)(1)[1].1.starts_with("127.0.0.1:"));
        let e = rank_env(
            "jaccl",
            &group_hosts::parse_hosts("127.0.0.1,127.0.0.1").unwrap(),
        )
        .err()
        .expect("no rdma lists");
        assert!(e.contains("has no rdma list"), "{e}");
    }

    #[test]
    fn a_ring_rank_gets_its_rank_and_the_hostfile() {
        let plan = rank_env(
            "ring",
            &group_hosts::parse_hosts("127.0.0.1,127.0.0.1").unwrap(),
        )
        .unwrap();
        assert_eq!((plan.env)(1), vec![("MLX_RANK", "1".to_owned())]);
        assert_eq!(plan.files[0].var, "MLX_HOSTFILE");
        let hostfile: Vec<Vec<String>> = serde_json::from_str(&plan.files[0].content).unwrap();
        assert!(hostfile.iter().all(|r| r[0].starts_with("127.0.0.1:")));
    }
}
