//! A rank of an engine group on another machine, started by rank 0 through `ssh` as
//! `mlx.launch` starts its ranks: the remote shell writes the files MLX reads (the ring
//! hostfile, the jaccl devices matrix) into a temporary directory, sets the variables naming
//! them and the rest of MLX's environment (`MLX_RANK`, for jaccl `MLX_JACCL_COORDINATOR`),
//! runs `mlxd-engine --distributed <backend>`, and removes the directory when the shell exits
//! (the engine's exit, or a hang-up or termination of the shell).
//!
//! Assumptions (each overridable in the host's entry, `mlxd_protocol::group_hosts`):
//! `mlxd-engine` lies at the path of rank 0's own (`engine`), and the model at the path rank 0
//! was given (`model`: that host's own copy). `ssh` must log in without a prompt (keys or an
//! agent: it runs with `BatchMode=yes`) to a host whose key is already known.
//!
//! Lifetime: the `ssh` client is rank 0's child (its process group, a parent-death signal),
//! and holds a pipe as stdin that rank 0 never writes; the remote engine runs with
//! `--until-stdin-closes`, so when rank 0 or the `ssh` client ends, the connection closes, the
//! remote stdin reaches its end and the remote rank exits. A failed `ssh` (no answer, refused,
//! a login or host key refused: bounded by `ConnectTimeout`) or a remote rank that exits ends
//! `ssh` with a status, which rank 0's watch turns into the group's failure with the last lines
//! `ssh` and the remote engine wrote.
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Duration;

use mlxd_protocol::group_hosts::GroupHost;

use super::group_launch::RankFile;
use crate::distributed::replica::EXIT_GROUP_BROKEN;

/// How long `ssh` may take to connect before the load fails (`ConnectTimeout`).
pub const SSH_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Lines of a remote rank's output kept for the failure message.
const TAIL_LINES: usize = 8;

/// What rank 0 starts on another host.
pub struct RemoteRank<'a> {
    pub host: &'a GroupHost,
    /// The MLX distributed backend.
    pub backend: &'a str,
    /// The files MLX reads (the ring hostfile, the jaccl devices matrix).
    pub files: &'a [RankFile],
    /// `mlxd-engine` on that host.
    pub engine: &'a str,
    /// The model rank 0 loads (the remote rank loads `host.model` instead when set).
    pub model: &'a str,
    /// The remote engine's environment besides the files' variables: MLX's (`MLX_RANK`, ...)
    /// and rank 0's settings it shares (`MLXD_GROUP_INIT_TIMEOUT`, `RUST_LOG`).
    pub env: Vec<(&'static str, String)>,
    /// Variables the remote engine must not inherit from its login's environment.
    pub cleared: &'a [&'static str],
}

/// `s` as one word of a POSIX shell command line.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl RemoteRank<'_> {
    /// The `sh` script the remote host runs: the files into a temporary directory (removed
    /// when the shell exits, a hang-up or termination included), then the engine with MLX's
    /// environment.
    pub fn script(&self) -> String {
        let mut env: Vec<String> = self
            .env
            .iter()
            .chain(&[("NO_COLOR", "1".to_owned())])
            .map(|(k, v)| format!("{k}={}", quote(v)))
            .collect();
        let mut script = "d=$(mktemp -d) || exit 1; trap 'rm -rf \"$d\"' EXIT; \
                          trap 'exit 129' HUP; trap 'exit 130' INT; trap 'exit 143' TERM; "
            .to_owned();
        if !self.cleared.is_empty() {
            script.push_str(&format!("unset {}; ", self.cleared.join(" ")));
        }
        for file in self.files {
            script.push_str(&format!(
                "printf '%s\\n' {content} >\"$d/{name}\" || exit 1; ",
                content = quote(&file.content),
                name = file.name,
            ));
            env.push(format!("{}=\"$d/{}\"", file.var, file.name));
        }
        let mut engine = vec![
            quote(self.engine),
            "--distributed".to_owned(),
            quote(self.backend),
            "--until-stdin-closes --model".to_owned(),
            quote(self.model),
        ];
        if let Some(model) = &self.host.model {
            engine.push("--rank-model".into());
            engine.push(quote(model));
        }
        script.push_str(&format!("{} {}; exit $?", env.join(" "), engine.join(" ")));
        script
    }

    /// `ssh`'s arguments: the host's own options first (for each setting `ssh` keeps the
    /// first value it reads), then no prompts and a bounded connect, the host, and the script
    /// run by `sh` whatever the login shell is.
    pub fn ssh_args(&self) -> Vec<String> {
        let mut args = self.host.ssh_options.clone();
        for option in [
            "BatchMode=yes".to_owned(),
            format!("ConnectTimeout={}", SSH_CONNECT_TIMEOUT.as_secs()),
            // A silent peer (a machine that went away) ends the connection in 15 s.
            "ServerAliveInterval=5".to_owned(),
            "ServerAliveCountMax=3".to_owned(),
        ] {
            args.push("-o".into());
            args.push(option);
        }
        args.push("--".into());
        args.push(self.host.ssh.clone());
        args.push(format!("sh -c {}", quote(&self.script())));
        args
    }

    /// Starts `ssh` as rank 0's child; see the module's notes on its lifetime.
    pub fn spawn(&self) -> std::io::Result<Started> {
        let mut cmd = Command::new("ssh");
        cmd.args(self.ssh_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // `ssh` dies with rank 0, as the local ranks do.
        super::group_launch::die_with_this_thread(&mut cmd);
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let stderr = child.stderr.take();
        Ok(Started {
            child,
            _stdin: stdin,
            stderr,
        })
    }
}

/// A started `ssh`: the child, the stdin that keeps the remote rank alive, and its output.
pub struct Started {
    pub child: Child,
    /// Held, never written: its end (this struct dropped, or rank 0 gone) ends the remote
    /// rank.
    _stdin: Option<ChildStdin>,
    stderr: Option<std::process::ChildStderr>,
}

impl Started {
    /// Re-emits the remote rank's lines (and `ssh`'s) through this process's log, tagged
    /// with the rank and host; the returned thread ends at the output's end with its last
    /// lines.
    pub fn relay_output(
        &mut self,
        rank: usize,
        host: String,
    ) -> std::io::Result<std::thread::JoinHandle<Vec<String>>> {
        let stderr = self.stderr.take();
        std::thread::Builder::new()
            .name(format!("rank-{rank}-output"))
            .spawn(move || {
                let Some(stderr) = stderr else {
                    return Vec::new();
                };
                last_lines(stderr, |line| {
                    tracing::info!(rank, host = %host, "{line}");
                })
            })
    }
}

/// Reads `from` to its end, passing each line to `each`; returns the last [`TAIL_LINES`].
fn last_lines(from: impl Read, mut each: impl FnMut(&str)) -> Vec<String> {
    let mut tail = VecDeque::with_capacity(TAIL_LINES);
    for line in BufReader::new(from).split(b'\n') {
        let Ok(line) = line else { break };
        let line = String::from_utf8_lossy(&line).trim_end().to_owned();
        if line.is_empty() {
            continue;
        }
        each(&line);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
    tail.into()
}

/// Exits the process when stdin reaches its end (a rank started through `ssh`: the
/// connection to rank 0 closed).
pub fn exit_when_stdin_closes() -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("rank-stdin".into())
        .spawn(|| {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            loop {
                match stdin.read(&mut sink) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            tracing::warn!("the connection to rank 0 closed (stdin ended); exiting");
            std::process::exit(EXIT_GROUP_BROKEN)
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> GroupHost {
        let mut h = GroupHost::named("me@10.0.0.2");
        h.ssh_options = vec!["-p".into(), "2222".into()];
        h
    }

    fn ring_file(content: &str) -> Vec<RankFile> {
        vec![RankFile {
            var: "MLX_HOSTFILE",
            name: "hosts.json",
            content: content.into(),
        }]
    }

    #[test]
    fn the_command_line_runs_the_engine_with_mlxs_environment() {
        let h = host();
        let files = ring_file(r#"[["10.0.0.1:5000"],["10.0.0.2:32324"]]"#);
        let remote = RemoteRank {
            host: &h,
            backend: "ring",
            files: &files,
            engine: "/opt/mlxd/mlxd-engine",
            model: "/models/it's here",
            env: vec![
                ("MLX_RANK", "1".into()),
                ("MLXD_GROUP_INIT_TIMEOUT", "20".into()),
            ],
            cleared: &[],
        };
        let args = remote.ssh_args();
        // The host's options first, so that they win; the host after `--`.
        assert_eq!(&args[..2], ["-p", "2222"]);
        assert!(args.contains(&"BatchMode=yes".to_owned()), "{args:?}");
        assert!(args.contains(&"ConnectTimeout=10".to_owned()), "{args:?}");
        let at = args.iter().position(|a| a == "--").unwrap();
        assert_eq!(args[at + 1], "me@10.0.0.2");
        let script = remote.script();
        for part in [
            "d=$(mktemp -d) || exit 1; trap 'rm -rf \"$d\"' EXIT;",
            "MLX_RANK='1'",
            "MLXD_GROUP_INIT_TIMEOUT='20'",
            "MLX_HOSTFILE=\"$d/hosts.json\" '/opt/mlxd/mlxd-engine' --distributed 'ring' \
             --until-stdin-closes",
            r"--model '/models/it'\''s here'",
            r#"printf '%s\n' '[["10.0.0.1:5000"],["10.0.0.2:32324"]]' >"$d/hosts.json""#,
        ] {
            assert!(script.contains(part), "{part} not in {script}");
        }
        assert_eq!(args[at + 2], format!("sh -c {}", quote(&script)));
    }

    /// The script as `sh` runs it: the engine gets the environment and arguments, the files
    /// it names hold their text, and they are gone once the engine has exited.
    #[test]
    fn the_script_runs_under_sh_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("engine");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho \"$MLX_RANK${JACCL_RANK-} $MLX_JACCL_COORDINATOR $(cat \"$MLX_IBV_DEVICES\") $*\"\n\
             echo \"$MLX_IBV_DEVICES\" >&2\nexit 3\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let mut h = GroupHost::named("127.0.0.2");
        h.model = Some("/there".into());
        let files = vec![RankFile {
            var: "MLX_IBV_DEVICES",
            name: "ibv-devices.json",
            content: r#"[[null,"rdma_en3"],["rdma_en3",null]]"#.into(),
        }];
        let remote = RemoteRank {
            host: &h,
            backend: "jaccl",
            files: &files,
            engine: fake.to_str().unwrap(),
            model: "/here",
            env: vec![
                ("MLX_RANK", "1".into()),
                ("MLX_JACCL_COORDINATOR", "10.0.0.1:5000".into()),
            ],
            cleared: &["JACCL_RANK"],
        };
        let out = Command::new("sh")
            .arg("-c")
            .arg(remote.script())
            .env("TMPDIR", dir.path())
            .env("JACCL_RANK", "7")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            r#"1 10.0.0.1:5000 [[null,"rdma_en3"],["rdma_en3",null]] --distributed jaccl --until-stdin-closes --model /here --rank-model /there"#
        );
        let devices = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        assert!(
            devices.starts_with(dir.path().to_str().unwrap()),
            "{devices}"
        );
        let path = std::path::Path::new(&devices);
        assert!(
            !path.exists() && !path.parent().unwrap().exists(),
            "{devices} is left"
        );
    }

    #[test]
    fn the_last_lines_are_kept() {
        let text: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let mut seen = 0;
        let tail = last_lines(text.as_bytes(), |_| seen += 1);
        assert_eq!(seen, 20);
        assert_eq!(tail.len(), TAIL_LINES);
        assert_eq!(tail.last().unwrap(), "line 19");
    }
}
