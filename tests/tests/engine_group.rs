//! Engine groups (issue 26) with real processes: `mlxd-engine --distributed ring` ranks over
//! 127.0.0.1, as `mlx.launch` starts them (`MLX_RANK`, `MLX_HOSTFILE`), on tiny random
//! models. Two ranks serve the single engine's greedy tokens, alone and batched; a rank
//! count that does not divide the heads, and a hostfile naming a rank that never comes, fail
//! the load with the reason; `kill -9` of rank 1 takes rank 0 down (the supervisor restarts
//! the group).
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mlxd_tests::{built_engine_bin, tiny_model};
use serde_json::{json, Value};

/// The status `mlxd_engine::distributed::replica::EXIT_GROUP_BROKEN` gives.
const EXIT_GROUP_BROKEN: i32 = 75;

/// Free TCP ports on 127.0.0.1, one per rank.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<_>>()?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// Ranks of one group (killed on drop), their socket and log directory.
struct Group {
    ranks: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Group {
    /// `hosts` ranks in the hostfile, `started` of them started (the rest never come).
    fn start(model: &Path, hosts: usize, started: usize) -> Result<Group> {
        let dir = tempfile::tempdir()?;
        let ports = free_ports(hosts)?;
        let hostfile = dir.path().join("hosts.json");
        let entries: Vec<Value> = ports
            .iter()
            .map(|p| json!([format!("127.0.0.1:{p}")]))
            .collect();
        std::fs::write(&hostfile, serde_json::to_vec(&entries)?)?;
        let mut ranks = Vec::new();
        for rank in 0..started {
            let mut cmd = Command::new(built_engine_bin()?);
            cmd.args([
                "--model",
                &model.display().to_string(),
                "--distributed",
                "ring",
            ])
            .env("MLX_RANK", rank.to_string())
            .env("MLX_HOSTFILE", &hostfile)
            .env("MLXD_HOME", dir.path().join("home"))
            .env("MLXD_GROUP_INIT_TIMEOUT", "5")
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(
                dir.path().join(format!("rank{rank}.log")),
            )?);
            if rank == 0 {
                cmd.arg("--unix").arg(dir.path().join("s.sock"));
            }
            ranks.push(cmd.spawn()?);
        }
        Ok(Group { ranks, dir })
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("s.sock")
    }

    fn log(&self, rank: usize) -> String {
        plain(
            &std::fs::read_to_string(self.dir.path().join(format!("rank{rank}.log")))
                .unwrap_or_default(),
        )
    }

    /// Rank `rank`'s exit status, waiting at most `within`.
    fn exit_of(&mut self, rank: usize, within: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.ranks[rank].try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "rank {rank} still runs after {within:?}; its log:\n{}",
                    self.log(rank)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for child in &mut self.ranks {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `text` without terminal colour sequences (`ESC [ ... m`).
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A single engine serving `model` on a socket in `dir`.
fn single(model: &Path, dir: &Path) -> Result<Child> {
    Ok(Command::new(built_engine_bin()?)
        .args(["--model", &model.display().to_string(), "--unix"])
        .arg(dir.join("single.sock"))
        .env("MLXD_HOME", dir.join("home"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("single.log"))?)
        .spawn()?)
}

/// Waits until `socket` accepts connections (the engine loaded and serves).
fn wait_serving(socket: &Path, child: &mut Child, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        if UnixStream::connect(socket).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "the engine exited ({status}) before serving {}",
                socket.display()
            );
        }
        if Instant::now() > deadline {
            bail!("{} does not serve after {within:?}", socket.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// POSTs a completion to the engine at `socket`; its generated token ids.
fn completion_ids(socket: &Path, body: &Value) -> Result<Vec<u64>> {
    let body = serde_json::to_vec(body)?;
    let mut stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(&body)?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (_, json_body) = response
        .split_once("\r\n\r\n")
        .context("no HTTP body in the answer")?;
    let v: Value = serde_json::from_str(json_body)
        .with_context(|| format!("not a JSON completion: {response}"))?;
    let ids = v["choices"][0]["mlxd"]["token_ids"]
        .as_array()
        .with_context(|| format!("no token ids in {v}"))?;
    Ok(ids.iter().filter_map(Value::as_u64).collect())
}

/// The token ids of each body, all requests in flight together (one batch).
fn batched(socket: &Path, bodies: &[Value]) -> Result<Vec<Vec<u64>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || completion_ids(socket, b)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    })
}

fn bodies() -> Vec<Value> {
    let greedy = |prompt: &str, n: u32| json!({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0});
    vec![
        greedy("hello world the", 12),
        greedy("the quick brown fox jumps", 8),
        greedy("a", 10),
        json!({"model": "m", "prompt": "zz top", "max_tokens": 10, "temperature": 0.9,
               "seed": 11}),
    ]
}

#[test]
fn two_ranks_serve_the_single_engines_tokens_alone_and_batched() -> Result<()> {
    for name in ["tiny-llama", "tiny-qwen3"] {
        let model = tiny_model(name)?;
        let mut group = Group::start(&model, 2, 2)?;
        let dir = tempfile::tempdir()?;
        let mut one = single(&model, dir.path())?;
        let socket = group.socket();
        wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
        wait_serving(
            &dir.path().join("single.sock"),
            &mut one,
            Duration::from_secs(60),
        )?;
        let bodies = bodies();
        let expected: Vec<Vec<u64>> = bodies
            .iter()
            .map(|b| completion_ids(&dir.path().join("single.sock"), b))
            .collect::<Result<_>>()?;
        assert!(expected.iter().all(|ids| !ids.is_empty()), "{expected:?}");
        for (body, want) in bodies.iter().zip(&expected) {
            assert_eq!(
                &completion_ids(&socket, body)?,
                want,
                "{name} alone: {body}"
            );
        }
        assert_eq!(batched(&socket, &bodies)?, expected, "{name} batched");
        // Each rank holds half of every attention and MLP matrix, so less than the whole.
        let weights = |log: &str| -> Option<u64> {
            let at = log.rfind("weight_bytes")?;
            let digits: String = log[at..]
                .chars()
                .skip_while(|c| !c.is_ascii_digit())
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        };
        let whole = weights(&plain(&std::fs::read_to_string(
            dir.path().join("single.log"),
        )?));
        let shard = weights(&group.log(1));
        assert!(
            matches!((whole, shard), (Some(w), Some(s)) if s < w),
            "{name}: rank 1 holds {shard:?} weight bytes, the whole model {whole:?}"
        );
        let _ = one.kill();
        let _ = one.wait();
    }
    Ok(())
}

#[test]
fn kill_9_of_rank_1_takes_rank_0_down() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let mut group = Group::start(&model, 2, 2)?;
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    assert!(!completion_ids(&socket, &bodies()[0])?.is_empty());
    group.ranks[1].kill()?;
    group.ranks[1].wait()?;
    // The next iteration's broadcast finds the peer gone: the request fails and rank 0 exits
    // with the status the supervisor restarts a group on.
    let _ = completion_ids(&socket, &bodies()[1]);
    let status = group.exit_of(0, Duration::from_secs(30))?;
    assert_eq!(status.code(), Some(EXIT_GROUP_BROKEN), "{}", group.log(0));
    assert!(
        group.log(0).contains("engine group broken"),
        "{}",
        group.log(0)
    );
    Ok(())
}

#[test]
fn three_ranks_cannot_share_two_kv_heads() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let mut group = Group::start(&model, 3, 3)?;
    for rank in 0..3 {
        let status = group.exit_of(rank, Duration::from_secs(60))?;
        assert!(!status.success(), "rank {rank}: {status}");
    }
    let log = group.log(0);
    assert!(
        log.contains("4 query heads and 2 KV heads"),
        "rank 0 does not say why: {log}"
    );
    Ok(())
}

#[test]
fn a_rank_that_never_comes_fails_the_load_in_bounded_time() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let started = Instant::now();
    let mut group = Group::start(&model, 2, 1)?;
    let status = group.exit_of(0, Duration::from_secs(30))?;
    assert!(!status.success());
    assert!(started.elapsed() < Duration::from_secs(30));
    let log = group.log(0);
    assert!(log.contains("did not form within 5 s"), "{log}");
    Ok(())
}
