//! Ranks on other machines, started through `ssh` (issue 26): a private `sshd` for the test
//! user on 127.0.0.2 (its own host key, a client key in its authorized keys) stands in for the
//! other machine. Under `mlxd`, a group whose rank 1 is on "127.0.0.2" serves the single
//! engine's tokens; `kill -9` of the remote rank ends the whole group and the pool starts a
//! new one (through ssh again) that serves the same tokens; stopping `mlxd` ends the remote
//! rank; a host whose ssh port nothing answers fails the load naming ssh's reason.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mlxd_tests::tiny_model;
use serde_json::{json, Value};

use super::{children_of, mlxd_completion, ready_group, start_mlxd, Killed};

/// The address the "other machine" listens on (this machine's loopback, another address).
const REMOTE: &str = "127.0.0.2";

/// A free TCP port on `ip`.
fn free_port(ip: &str) -> Result<u16> {
    Ok(TcpListener::bind((ip, 0))?.local_addr()?.port())
}

/// The installed `sshd`, if any.
fn sshd_bin() -> Option<PathBuf> {
    ["/usr/sbin/sshd", "/usr/bin/sshd", "/usr/local/sbin/sshd"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// A private `sshd -D` on [`REMOTE`], killed on drop.
struct Sshd {
    _process: Killed,
    dir: tempfile::TempDir,
    port: u16,
}

impl Sshd {
    fn start() -> Result<Sshd> {
        let bin = sshd_bin().context(
            "no sshd: install openssh-server (scripts/setup.sh --test installs it) to test \
             ranks started through ssh",
        )?;
        let dir = tempfile::tempdir()?;
        let path = |name: &str| dir.path().join(name);
        for key in ["host_key", "client_key"] {
            let status = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(path(key))
                .status()
                .context("ssh-keygen (openssh-client)")?;
            anyhow::ensure!(status.success(), "ssh-keygen failed ({status})");
        }
        std::fs::copy(path("client_key.pub"), path("authorized_keys"))?;
        let port = free_port(REMOTE)?;
        std::fs::write(
            path("sshd_config"),
            format!(
                "ListenAddress {REMOTE}\nPort {port}\nHostKey {host}\nAuthorizedKeysFile {keys}\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\n\
                 UsePAM no\nPidFile none\n",
                host = path("host_key").display(),
                keys = path("authorized_keys").display(),
            ),
        )?;
        let host_key = std::fs::read_to_string(path("host_key.pub"))?;
        std::fs::write(path("known_hosts"), format!("[{REMOTE}]:{port} {host_key}"))?;
        // Run as root, sshd needs its privilege separation directory (the system's service
        // creates it at boot; a container without that service has none).
        if nix::unistd::Uid::effective().is_root() && !Path::new("/run/sshd").is_dir() {
            std::fs::create_dir_all("/run/sshd")?;
        }
        let process = Killed(
            Command::new(bin)
                .args(["-D", "-e", "-f"])
                .arg(path("sshd_config"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(path("sshd.log"))?)
                .spawn()?,
        );
        let mut sshd = Sshd {
            _process: process,
            dir,
            port,
        };
        sshd.wait_listening()?;
        Ok(sshd)
    }

    /// Waits until the port accepts connections, or sshd exits.
    fn wait_listening(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::net::TcpStream::connect((REMOTE, self.port)).is_ok() {
                return Ok(());
            }
            if let Some(status) = self._process.0.try_wait()? {
                bail!("sshd exited ({status}): {}", self.log());
            }
            if Instant::now() > deadline {
                bail!(
                    "sshd does not listen on {REMOTE}:{}: {}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sshd.log")).unwrap_or_default()
    }

    /// `ssh` options that log in to it with the test's key and know its host key.
    fn ssh_options(&self) -> Vec<String> {
        let path = |name: &str| self.dir.path().join(name).display().to_string();
        vec![
            "-p".into(),
            self.port.to_string(),
            "-i".into(),
            path("client_key"),
            "-o".into(),
            "IdentitiesOnly=yes".into(),
            "-o".into(),
            format!("UserKnownHostsFile={}", path("known_hosts")),
        ]
    }
}

/// `mlxd.toml` with model `g` a group of rank 0 here and rank 1 on `remote` (an inline
/// table), and model `s` the same model alone.
fn group_config(dir: &Path, model: &Path, remote: &Value) -> Result<PathBuf> {
    let hosts = format!("\"127.0.0.1\", {}", toml_inline(remote));
    super::group_config(dir, model, &hosts, "", "")
}

/// A JSON object of strings, numbers and string lists as a TOML inline table.
fn toml_inline(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{k} = {}", toml_inline(v)))
                .collect();
            format!("{{ {} }}", fields.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(toml_inline).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// The pids whose command line has `arg`.
fn pids_with_arg(arg: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == arg.as_bytes()))
        })
        .collect()
}

/// Whether `pid` is gone (or a zombie).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// Waits (at most `within`) until every pid of `pids` is gone.
fn wait_gone(pids: &[u32], what: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    while !pids.iter().all(|&p| gone(p)) {
        if Instant::now() > deadline {
            bail!("{what} {pids:?} still run after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_started_through_ssh_serves_the_single_engines_tokens() -> Result<()> {
    let sshd = Sshd::start()?;
    let model = tiny_model("tiny-llama")?;
    let dir = tempfile::tempdir()?;
    let remote = json!({
        "ssh": REMOTE,
        "port": free_port(REMOTE)?,
        "ssh_options": sshd.ssh_options(),
    });
    let config = group_config(dir.path(), &model, &remote)?;
    let mlxd = start_mlxd(&config).await?;
    let addr = mlxd.addr;
    let log = mlxd.log.clone();
    let last = tokio::task::spawn_blocking(move || -> Result<u32> {
        let body = |model: &str, prompt: &str| {
            json!({"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        };
        let mut expected = Vec::new();
        for prompt in ["hello world the", "a"] {
            let want = mlxd_completion(addr, &body("s", prompt), || Ok(()))?;
            assert!(!want.is_empty());
            assert_eq!(
                mlxd_completion(addr, &body("g", prompt), || Ok(()))?,
                want,
                "{prompt:?}"
            );
            expected.push(want);
        }
        let rank0 = ready_group(addr, None, Duration::from_secs(10))?;
        // Rank 0's only child is the ssh client; the rank itself runs under sshd.
        let children = children_of(rank0);
        let names: Vec<String> = children
            .iter()
            .map(|c| {
                std::fs::read_to_string(format!("/proc/{c}/comm"))
                    .unwrap_or_default()
                    .trim()
                    .to_owned()
            })
            .collect();
        assert_eq!(names, ["ssh"], "rank 0's children {children:?}");
        let remote = pids_with_arg("--until-stdin-closes");
        assert_eq!(remote.len(), 1, "remote ranks: {remote:?}");
        // kill -9 of the remote rank: ssh ends with its status, rank 0 reports the group
        // broken and exits, and the pool starts a new group, through ssh again.
        let status = Command::new("kill")
            .args(["-9", &remote[0].to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -9 {}", remote[0]);
        wait_gone(
            &[rank0, children[0], remote[0]],
            "the old group's rank 0, ssh and remote rank",
            Duration::from_secs(60),
        )?;
        let second = ready_group(addr, Some(rank0), Duration::from_secs(120))?;
        assert_eq!(
            mlxd_completion(addr, &body("g", "a"), || Ok(()))?,
            expected[1],
            "after the restart"
        );
        let log = std::fs::read_to_string(&log)?;
        assert!(
            log.contains("rank 1 on 127.0.0.2 (through ssh) exited"),
            "mlxd's log does not name the remote rank's end:\n{log}"
        );
        let remote_now = pids_with_arg("--until-stdin-closes");
        assert_eq!(remote_now.len(), 1, "remote ranks: {remote_now:?}");
        assert_ne!(second, rank0);
        Ok(remote_now[0])
    })
    .await??;
    assert!(
        sshd.log().contains("Accepted publickey"),
        "no ssh login: {}",
        sshd.log()
    );
    // Stopping mlxd ends rank 0, its ssh, and so the remote rank (its stdin closes).
    drop(mlxd);
    wait_gone(
        &[last],
        "the remote rank after mlxd stopped",
        Duration::from_secs(30),
    )
    .with_context(|| format!("sshd: {}", sshd.log()))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_ssh_port_nothing_answers_fails_the_load_naming_it() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let dir = tempfile::tempdir()?;
    let closed = free_port(REMOTE)?;
    let remote = json!({
        "ssh": REMOTE,
        "ssh_options": ["-p", closed.to_string(), "-o", "UserKnownHostsFile=/dev/null"],
    });
    let config = group_config(dir.path(), &model, &remote)?;
    let mlxd = start_mlxd(&config).await?;
    let addr = mlxd.addr;
    let answer = tokio::task::spawn_blocking(move || {
        let body = json!({"model": "g", "prompt": "hello", "max_tokens": 4, "temperature": 0});
        mlxd_completion(addr, &body, || Ok(()))
    })
    .await?;
    let error = answer.expect_err("the group cannot load").to_string();
    assert!(
        error.contains("ssh failed") && error.contains("Connection refused"),
        "{error}\nmlxd's log:\n{}",
        mlxd.stderr()
    );
    Ok(())
}
