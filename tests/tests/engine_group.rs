//! Engine groups (issue 26) with real processes: `mlxd-engine --distributed ring` ranks over
//! 127.0.0.1, as `mlx.launch` starts them (`MLX_RANK`, `MLX_HOSTFILE`), on tiny random
//! models (Llama, Qwen3, Qwen3-MoE). Two and four ranks serve the single engine's tokens,
//! alone and batched, and two give mlx-lm's own sharded tokens (`sharded_load`, tensor and
//! pipeline); a rank count that does not divide the heads, and a hostfile naming a rank that
//! never comes, fail the load with the reason; `kill -9` of rank 1 takes rank 0 down (the
//! supervisor restarts the group). jaccl (absent from Linux's MLX) fails the load at once,
//! and its ranks' environment is compared with `mlx.launch`'s own.
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use mlxd_tests::{built_engine_bin, tiny_model};
use serde_json::{json, Value};

#[path = "engine_group/remote.rs"]
mod remote;

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

/// How a group divides its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Tensor,
    Pipeline,
}

/// Ranks of one group (killed on drop), their socket and log directory.
struct Group {
    ranks: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Group {
    /// `hosts` ranks in the hostfile, `started` of them started (the rest never come).
    fn start(model: &Path, hosts: usize, started: usize) -> Result<Group> {
        Self::start_in(model, hosts, started, Mode::Tensor, &[])
    }

    /// [`Self::start`] with the model divided as `mode` says and rank 0 given `flags` (the
    /// other ranks take rank 0's options).
    fn start_in(
        model: &Path,
        hosts: usize,
        started: usize,
        mode: Mode,
        flags: &[&str],
    ) -> Result<Group> {
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
                if mode == Mode::Pipeline {
                    cmd.args(["--distributed-mode", "pipeline"]);
                }
                cmd.args(flags);
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

    /// Every started rank fails within `within` (each its own exit), and rank 0's log says
    /// `why`.
    fn all_fail_saying(&mut self, why: &str, within: Duration) -> Result<()> {
        for rank in 0..self.ranks.len() {
            let status = self.exit_of(rank, within)?;
            assert!(!status.success(), "rank {rank}: {status}");
        }
        let log = self.log(0);
        assert!(log.contains(why), "rank 0 does not say {why:?}: {log}");
        Ok(())
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

/// A child process killed when dropped (an assertion that fails leaves no engine behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A single engine serving `model` on a socket in `dir`, given `flags`.
fn single(model: &Path, dir: &Path, flags: &[&str]) -> Result<Child> {
    Ok(Command::new(built_engine_bin()?)
        .args(["--model", &model.display().to_string(), "--unix"])
        .arg(dir.join("single.sock"))
        .args(flags)
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
    Ok(completion(socket, body)?.0)
}

/// POSTs a completion to the engine at `socket`; its generated token ids and the prompt
/// tokens it took from the prefix cache.
fn completion(socket: &Path, body: &Value) -> Result<(Vec<u64>, u64)> {
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
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    Ok((ids.iter().filter_map(Value::as_u64).collect(), cached))
}

/// The token ids and cached prompt tokens of each body, all requests in flight together (one
/// batch).
fn batched(socket: &Path, bodies: &[Value]) -> Result<Vec<(Vec<u64>, u64)>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| s.spawn(move || completion(socket, b)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread"))
            .collect()
    })
}

/// Four requests: three greedy of different prompt and output lengths, one seeded sampling.
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
    for name in ["tiny-llama", "tiny-qwen3", "family-qwen3_moe"] {
        ranks_serve_the_single_engines_tokens(name, Mode::Tensor, 2)?;
    }
    Ok(())
}

/// [`bodies`] with half their output tokens (still of different lengths): for groups whose
/// every step is slow, four ranks on two cores taking a third of a second a token.
fn short_bodies() -> Vec<Value> {
    let mut bodies = bodies();
    for body in &mut bodies {
        body["max_tokens"] = json!(body["max_tokens"].as_u64().expect("max_tokens") / 2);
    }
    bodies
}

/// `ranks` ranks dividing `name` as `mode` says give the single engine's tokens for
/// [`bodies`], each alone and all in one batch, and rank 1 holds less than the whole model.
fn ranks_serve_the_single_engines_tokens(name: &str, mode: Mode, ranks: usize) -> Result<()> {
    ranks_serve_the_single_engines_tokens_with(name, mode, ranks, &[], &bodies())
}

/// [`ranks_serve_the_single_engines_tokens`] with `flags` given to rank 0 and to the single
/// engine, for `bodies`. The batch repeats the prompts the requests alone left in the prefix
/// cache: each takes as many prompt tokens from the cache as on the single engine.
fn ranks_serve_the_single_engines_tokens_with(
    name: &str,
    mode: Mode,
    ranks: usize,
    flags: &[&str],
    bodies: &[Value],
) -> Result<()> {
    let model = tiny_model(name)?;
    let mut group = Group::start_in(&model, ranks, ranks, mode, flags)?;
    let dir = tempfile::tempdir()?;
    let mut one = Killed(single(&model, dir.path(), flags)?);
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    wait_serving(
        &dir.path().join("single.sock"),
        &mut one.0,
        Duration::from_secs(60),
    )?;
    let single_socket = dir.path().join("single.sock");
    let expected: Vec<(Vec<u64>, u64)> = bodies
        .iter()
        .map(|b| completion(&single_socket, b))
        .collect::<Result<_>>()?;
    assert!(
        expected.iter().all(|(ids, _)| !ids.is_empty()),
        "{expected:?}"
    );
    for (body, want) in bodies.iter().zip(&expected) {
        assert_eq!(
            &completion(&socket, body)?,
            want,
            "{name} {mode:?} {flags:?} alone: {body}"
        );
    }
    let expected_batch = batched(&single_socket, bodies)?;
    assert!(
        expected_batch.iter().any(|(_, cached)| *cached > 0),
        "the batch took nothing from the prefix cache: {expected_batch:?}"
    );
    assert_eq!(
        batched(&socket, bodies)?,
        expected_batch,
        "{name} {mode:?} {flags:?} batched"
    );
    // Tensor: each rank holds half of every attention and MLP matrix; pipeline: its layers
    // only. Either way less than the whole.
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
        "{name} {mode:?}: rank 1 holds {shard:?} weight bytes, the whole model {whole:?}"
    );
    Ok(())
}

/// The bytes process `pid` has read through `read`-family calls (`rchar` in
/// `/proc/<pid>/io`). MLX reads safetensors tensors with `pread` and the loader reads a rank's
/// parts the same way, so this counts every checkpoint byte a process read (whether the page
/// cache held it or not), and a little more (config, tokenizer, `/proc` files).
fn bytes_read(pid: u32) -> Result<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io"))?;
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no rchar in /proc/{pid}/io: {io}"))
}

/// A safetensors file's tensor bytes: all of them, and those of the layers a Llama-shaped
/// tensor-parallel group divides (attention and MLP projections).
fn checkpoint_bytes(file: &Path) -> Result<(u64, u64)> {
    let bytes = std::fs::read(file)?;
    let length = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + length])?;
    let (mut whole, mut divided) = (0, 0);
    for (name, entry) in header.iter().filter(|(n, _)| *n != "__metadata__") {
        let offsets = &entry["data_offsets"];
        let size =
            offsets[1].as_u64().context("offsets")? - offsets[0].as_u64().context("offsets")?;
        whole += size;
        if [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
        .iter()
        .any(|p| name.contains(p))
        {
            divided += size;
        }
    }
    Ok((whole, divided))
}

/// The number after `key=` on the last log line that has it.
fn logged_number(log: &str, key: &str) -> Option<u64> {
    let at = log.rfind(&format!("{key}="))?;
    log[at + key.len() + 1..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

#[test]
fn each_of_two_ranks_reads_only_its_half_of_the_divided_weights() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let (whole, divided) = checkpoint_bytes(&model.join("model.safetensors"))?;
    assert!(
        divided > whole / 2,
        "{divided} of {whole}: too little divided to measure"
    );
    let dir = tempfile::tempdir()?;
    let mut one = Killed(single(&model, dir.path(), &[])?);
    wait_serving(
        &dir.path().join("single.sock"),
        &mut one.0,
        Duration::from_secs(60),
    )?;
    let single_read = bytes_read(one.0.id())?;
    let mut group = Group::start(&model, 2, 2)?;
    let socket = group.socket();
    // Rank 0 serves once every rank has loaded (their successes are gathered).
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    let single_log = plain(&std::fs::read_to_string(dir.path().join("single.log"))?);
    assert_eq!(
        logged_number(&single_log, "read_bytes"),
        Some(whole),
        "the single engine reads the whole checkpoint: {single_log}"
    );
    // Each rank: the undivided tensors whole and half of each divided one.
    let share = whole - divided / 2;
    for rank in 0..2 {
        let log = group.log(rank);
        assert_eq!(
            logged_number(&log, "read_bytes"),
            Some(share),
            "rank {rank}'s loader count: {log}"
        );
        // Measured by the kernel: at least its share, and less than the single engine by
        // about the other rank's half (an eighth of the divided bytes allowed for reads
        // that are not weights and differ between the processes).
        let read = bytes_read(group.ranks[rank].id())?;
        assert!(
            read >= share && read + divided / 2 <= single_read + divided / 8,
            "rank {rank} read {read} bytes; the single engine {single_read}, the checkpoint \
             {whole} of which {divided} divided"
        );
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
fn a_request_to_a_group_whose_rank_1_is_stopped_ends_rank_0_after_the_step_bound() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let mut group = Group::start_in(
        &model,
        2,
        2,
        Mode::Tensor,
        &["--distributed-step-timeout", "3"],
    )?;
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    assert!(!completion_ids(&socket, &bodies()[0])?.is_empty());
    // Stopped while the group is idle: nothing is bounded until a request starts a step.
    let rank1 = group.ranks[1].id().to_string();
    anyhow::ensure!(Command::new("kill")
        .args(["-STOP", &rank1])
        .status()?
        .success());
    let asked = Instant::now();
    let answer = completion_ids(&socket, &bodies()[1]);
    let status = group.exit_of(0, Duration::from_secs(60))?;
    let took = asked.elapsed();
    assert!(answer.is_err(), "a hung group answered: {answer:?}");
    assert_eq!(status.code(), Some(EXIT_GROUP_BROKEN), "{status}");
    assert!(
        took >= Duration::from_secs(3),
        "rank 0 gave up after {took:?}"
    );
    let log = group.log(0);
    assert!(
        log.contains("rank 0 made no progress") && log.contains("the bound is 3 s"),
        "{log}"
    );
    // Continued, rank 1 finds its peer gone and ends too.
    anyhow::ensure!(Command::new("kill")
        .args(["-CONT", &rank1])
        .status()?
        .success());
    let status = group.exit_of(1, Duration::from_secs(60))?;
    assert!(!status.success(), "rank 1: {status}");
    Ok(())
}

#[test]
fn four_ranks_in_tensor_mode_serve_the_single_engines_tokens_alone_and_batched() -> Result<()> {
    // Four KV heads (tiny-llama's and the Qwen3-MoE fixture's 2 divide among two ranks at
    // most): each rank one query and one KV head, a quarter of each MLP and of each expert.
    for name in ["tiny-llama-kv4", "family-qwen3_moe-kv4"] {
        ranks_serve_the_single_engines_tokens_with(name, Mode::Tensor, 4, &[], &short_bodies())?;
    }
    Ok(())
}

#[test]
fn three_ranks_cannot_share_two_kv_heads() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    Group::start(&model, 3, 3)?
        .all_fail_saying("4 query heads and 2 KV heads", Duration::from_secs(60))
}

#[test]
fn a_rank_that_never_comes_fails_the_load_in_bounded_time() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let started = Instant::now();
    Group::start(&model, 2, 1)?
        .all_fail_saying("did not form within 5 s", Duration::from_secs(30))?;
    assert!(started.elapsed() < Duration::from_secs(30));
    Ok(())
}

/// The pids whose parent is `parent` (from `/proc`).
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // `pid (comm) state ppid ...`: the fields after the last ')'.
                    let rest = stat.rsplit_once(')')?.1.to_owned();
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// A completion's text through `mlxd` at `addr`; with `stream`, `on_first` runs once the
/// first chunk has arrived and the chunks' texts are joined.
fn mlxd_completion(
    addr: std::net::SocketAddr,
    body: &Value,
    mut on_first: impl FnMut() -> Result<()>,
) -> Result<String> {
    use std::io::BufRead;
    let body = serde_json::to_vec(body)?;
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    // HTTP/1.0: the answer ends when the connection closes (no chunked framing to undo).
    write!(
        stream,
        "POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )?;
    stream.write_all(&body)?;
    let mut reader = std::io::BufReader::new(stream);
    let mut text = String::new();
    let mut whole = String::new();
    let mut first = true;
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 {
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            if data != "[DONE]" {
                let chunk: Value = serde_json::from_str(data)
                    .with_context(|| format!("not a JSON chunk: {data}"))?;
                if let Some(t) = chunk["choices"][0]["text"].as_str() {
                    text.push_str(t);
                }
                if first {
                    first = false;
                    on_first()?;
                }
            }
        }
        whole.push_str(&line);
        line.clear();
    }
    if first {
        // Not a stream: the body is one JSON completion.
        let (_, json_body) = whole.split_once("\r\n\r\n").context("no HTTP body")?;
        let v: Value = serde_json::from_str(json_body)
            .with_context(|| format!("not a JSON completion: {whole}"))?;
        return v["choices"][0]["text"]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("no text in {v}"));
    }
    Ok(text)
}

/// What befalls a rank once a stream flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// `kill -9`: the rank dies.
    Kill,
    /// `kill -STOP`: the rank hangs, its connections open, its collectives never answered.
    Stop,
    /// `kill -STOP` of rank 0 instead: rank 1 finds the step hung and must end rank 0, which
    /// cannot end itself.
    StopLeader,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mlxd_a_group_serves_and_kill_9_of_rank_1_restarts_it_with_the_stream_resumed(
) -> Result<()> {
    a_fault_mid_stream_restarts_the_group(Fault::Kill, Mode::Tensor).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mlxd_sigstop_of_rank_1_restarts_the_group_with_the_stream_resumed() -> Result<()> {
    a_fault_mid_stream_restarts_the_group(Fault::Stop, Mode::Tensor).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mlxd_sigstop_of_rank_0_restarts_the_group_with_the_stream_resumed() -> Result<()> {
    a_fault_mid_stream_restarts_the_group(Fault::StopLeader, Mode::Tensor).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mlxd_sigstop_of_rank_1_of_a_pipeline_restarts_it_with_the_stream_resumed(
) -> Result<()> {
    a_fault_mid_stream_restarts_the_group(Fault::Stop, Mode::Pipeline).await
}

/// Under `mlxd`, a two-rank group dividing the model as `mode` says serves the single engine's
/// text; `fault` strikes a rank once a stream flows: the group goes down, the pool restarts
/// it, the stream resumes on the new group to the same text, and no process of the old group
/// is left (a stopped rank is continued afterwards, and must be gone or go).
async fn a_fault_mid_stream_restarts_the_group(fault: Fault, mode: Mode) -> Result<()> {
    /// The step bound of the group that hangs: long beside a tiny model's steps on this
    /// loaded machine, short beside the test.
    const STEP_TIMEOUT_S: u64 = 5;
    let model = tiny_model("tiny-llama")?;
    let dir = tempfile::tempdir()?;
    let options = match fault {
        Fault::Kill => String::new(),
        Fault::Stop | Fault::StopLeader => {
            format!("options = {{ distributed_step_timeout = \"{STEP_TIMEOUT_S}\" }}\n")
        }
    };
    let more = match mode {
        Mode::Tensor => "",
        Mode::Pipeline => ", mode = \"pipeline\"",
    };
    let config = group_config(dir.path(), &model, LOCAL_PAIR, more, &options)?;
    let mlxd = start_mlxd(&config).await?;
    let addr = mlxd.addr;
    let log = mlxd.log.clone();
    tokio::task::spawn_blocking(move || -> Result<()> {
        let body = json!({"prompt": "hello world the", "max_tokens": 400, "temperature": 0});
        let with = |model: &str, stream: bool| {
            let mut b = body.clone();
            b["model"] = json!(model);
            b["stream"] = json!(stream);
            b
        };
        let expected = mlxd_completion(addr, &with("s", false), || Ok(()))?;
        assert!(!expected.is_empty());
        // The group serves the single engine's text.
        assert_eq!(
            mlxd_completion(addr, &with("g", false), || Ok(()))?,
            expected
        );
        let first = ready_group(addr, None, Duration::from_secs(60))?;
        let followers = children_of(first);
        assert_eq!(
            followers.len(),
            1,
            "rank 0 ({first}) runs one other rank: {followers:?}"
        );
        let (signal, struck) = match fault {
            Fault::Kill => ("-KILL", followers[0]),
            Fault::Stop => ("-STOP", followers[0]),
            Fault::StopLeader => ("-STOP", first),
        };
        let start = Instant::now();
        let streamed = mlxd_completion(addr, &with("g", true), || {
            let status = Command::new("kill")
                .args([signal, &struck.to_string()])
                .status()?;
            anyhow::ensure!(status.success(), "kill {signal} {struck}");
            Ok(())
        })?;
        let took = start.elapsed();
        assert_eq!(streamed, expected);
        // The pool's new group (the resumed stream already ran on it).
        ready_group(addr, Some(first), Duration::from_secs(60))
            .context("the group was not restarted")?;
        if fault != Fault::Kill {
            // Rank 0's step watch gave the group up after the bound, not before.
            assert!(
                took >= Duration::from_secs(STEP_TIMEOUT_S),
                "the stream finished after {took:?}, within the {STEP_TIMEOUT_S} s bound"
            );
            let said = plain(&std::fs::read_to_string(&log)?);
            assert!(
                said.contains("made no progress") && said.contains("distributed_step_timeout"),
                "mlxd's log does not say why the group ended:\n{said}"
            );
            // Continued, a stopped rank that survived would run on: it must be gone already
            // (its parent's death signal) or go.
            let _ = Command::new("kill")
                .args(["-CONT", &struck.to_string()])
                .status();
        }
        let old = [first, followers[0]];
        let deadline = Instant::now() + Duration::from_secs(10);
        while !old.iter().all(|&pid| mlxd_tests::process_gone(pid as i32)) {
            assert!(
                Instant::now() < deadline,
                "a process of the old group survives: {old:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    })
    .await??;
    drop(mlxd);
    Ok(())
}

/// Two ranks on this machine, as `hosts` in a model's `distributed` table.
const LOCAL_PAIR: &str = "\"127.0.0.1\", \"127.0.0.1\"";

/// `mlxd.toml` in `dir`: `model` served as `g`, an engine group over `hosts` (the TOML list's
/// items, rank 0 first) with `more` keys in its `distributed` table and `lines` in its model
/// entry, and as `s`, one engine.
fn group_config(dir: &Path, model: &Path, hosts: &str, more: &str, lines: &str) -> Result<PathBuf> {
    let config = dir.join("mlxd.toml");
    let path = serde_json::to_string(&model.display().to_string())?;
    std::fs::write(
        &config,
        format!(
            "[[model]]\nid = \"g\"\npath = {path}\n{lines}\
             distributed = {{ backend = \"ring\", hosts = [{hosts}]{more} }}\n\
             [[model]]\nid = \"s\"\npath = {path}\n"
        ),
    )?;
    Ok(config)
}

/// `mlxd` on `config`, with the engine built from this tree and a store of its own.
async fn start_mlxd(config: &Path) -> Result<mlxd_tests::MlxdProcess> {
    mlxd_tests::MlxdProcess::builder()
        .engine(built_engine_bin()?)
        .args(&["--config".as_ref(), config.as_os_str()])
        .own_home()
        .start()
        .await
}

/// Model `g`'s engine in `mlxd`'s `/engines`: its pid once its state is `ready` and the pid is
/// not `old`, waiting at most `within`.
fn ready_group(addr: std::net::SocketAddr, old: Option<u32>, within: Duration) -> Result<u32> {
    let deadline = Instant::now() + within;
    loop {
        let engines: Value = serde_json::from_str(&http_get(addr, "/engines")?)?;
        let ready = engines["engines"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["model"] == "g" && e["state"] == "ready")
            .filter_map(|e| e["pid"].as_u64().map(|p| p as u32))
            .find(|&p| Some(p) != old);
        if let Some(pid) = ready {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            bail!("no ready engine for g after {within:?}: {engines}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A GET's body from `mlxd` at `addr`.
fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_this_mlx_build_lacks_fails_the_load_naming_it() -> Result<()> {
    // The CPU build of MLX on Linux has no NCCL (no CUDA) and no JACCL (RDMA over
    // Thunderbolt, macOS only).
    let model = tiny_model("tiny-llama")?;
    for backend in ["nccl", "jaccl"] {
        let dir = tempfile::tempdir()?;
        let started = Instant::now();
        let output = Command::new(built_engine_bin()?)
            .args([
                "--model",
                &model.display().to_string(),
                "--distributed",
                backend,
            ])
            .arg("--unix")
            .arg(dir.path().join("s.sock"))
            .env("MLX_RANK", "0")
            .env("MLXD_HOME", dir.path().join("home"))
            .env("RUST_BACKTRACE", "0")
            .output()?;
        assert!(!output.status.success(), "{backend}");
        let log = plain(&String::from_utf8_lossy(&output.stderr));
        assert!(
            log.contains(&format!(
                "this MLX build has no \"{backend}\" distributed backend"
            )),
            "{backend}: {log}"
        );
        // At once: the group's init (and its timeout) is never reached.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{backend}: {:?}",
            started.elapsed()
        );
    }
    // Under mlxd, a valid jaccl entry (two ranks here, RDMA devices listed as mlx.launch's
    // hostfile lists them) passes the config load, and its load fails at once with the reason.
    if cfg!(target_os = "linux") {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("mlxd.toml");
        let path = serde_json::to_string(&model.display().to_string())?;
        std::fs::write(
            &config,
            format!(
                "[[model]]\nid = \"g\"\npath = {path}\ndistributed = {{ backend = \"jaccl\", \
                 hosts = [{{ ssh = \"127.0.0.1\", rdma = [\"\", \"rdma_en3\"] }}, \
                 {{ ssh = \"127.0.0.1\", rdma = [\"rdma_en3\", \"\"] }}] }}\n"
            ),
        )?;
        let mlxd = start_mlxd(&config).await?;
        let addr = mlxd.addr;
        let started = Instant::now();
        let answer = tokio::task::spawn_blocking(move || {
            let body = json!({"model": "g", "prompt": "hello", "max_tokens": 4, "temperature": 0});
            mlxd_completion(addr, &body, || Ok(()))
        })
        .await?;
        // The message as the error's JSON body quotes it, unescaped.
        let error = answer
            .expect_err("a jaccl group cannot load here")
            .to_string()
            .replace('\\', "");
        assert!(
            error.contains("this MLX build has no \"jaccl\" distributed backend")
                && error.contains("RDMA over Thunderbolt 5"),
            "{error}\nmlxd's log:\n{}",
            mlxd.stderr()
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }
    Ok(())
}

/// mlxd gives each rank of a jaccl group what `mlx.launch --backend jaccl` gives it for the
/// same hostfile (`scripts/mlx_launch_jaccl_env.py` runs mlx.launch's own `launch_jaccl`):
/// the same variables and the same devices matrix; and the hostfiles mlx.launch refuses,
/// mlxd refuses.
#[test]
fn jaccl_ranks_get_what_mlx_launch_gives_them() -> Result<()> {
    use mlxd_protocol::group_hosts::{jaccl, parse_hosts};
    const PORT: u16 = 32323;
    let host = |n: usize, rdma: Value| json!({"ssh": format!("m{n}"), "ips": [format!("10.0.0.{n}")], "rdma": rdma});
    let cases = json!([
        // Three Macs joined pairwise, two cables between m2 and m3.
        [
            host(1, json!([null, "rdma_en2", "rdma_en3"])),
            host(2, json!(["rdma_en2", null, ["rdma_en3", "rdma_en4"]])),
            host(3, json!([["rdma_en2"], ["rdma_en3", "rdma_en4"], null])),
        ],
        [
            host(1, json!([null, "rdma_en5"])),
            host(2, json!(["rdma_en5", null]))
        ],
        // Refused: a host without devices, a list of the wrong size, a host's own entry
        // naming a device, a pair not joined.
        [
            host(1, json!([null, "rdma_en5"])),
            json!({"ssh": "m2", "ips": ["10.0.0.2"]})
        ],
        [
            host(1, json!([null, "rdma_en5"])),
            host(2, json!(["rdma_en5"]))
        ],
        [
            host(1, json!(["rdma_en4", "rdma_en5"])),
            host(2, json!(["rdma_en5", null]))
        ],
        [
            host(1, json!([null, null])),
            host(2, json!(["rdma_en5", null]))
        ],
    ]);
    let mut python = Command::new(mlxd_tests::python()?)
        .arg(mlxd_tests::workspace_root().join("scripts/mlx_launch_jaccl_env.py"))
        .arg(PORT.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    python
        .stdin
        .take()
        .context("python's stdin")?
        .write_all(cases.to_string().as_bytes())?;
    let out = python.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "mlx_launch_jaccl_env.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let answers: Vec<Value> = serde_json::from_slice(&out.stdout)?;
    let cases = cases.as_array().context("cases")?;
    assert_eq!(answers.len(), cases.len());
    for (entries, answer) in cases.iter().zip(&answers) {
        let hosts = parse_hosts(&entries.to_string()).map_err(anyhow::Error::msg)?;
        let ours = jaccl::JacclGroup::new(&hosts, PORT);
        let Some(ranks) = answer["ranks"].as_array() else {
            let e = ours.err().with_context(|| {
                format!("mlx.launch refuses {entries} ({answer}), mlxd does not")
            })?;
            assert!(!e.is_empty());
            continue;
        };
        let ours = ours.map_err(|e| anyhow::anyhow!("mlxd refuses {entries}: {e}"))?;
        assert_eq!(ranks.len(), hosts.len());
        for (rank, theirs) in ranks.iter().enumerate() {
            let env: serde_json::Map<String, Value> = ours
                .env(rank)
                .into_iter()
                .map(|(k, v)| (k.to_owned(), Value::String(v)))
                .collect();
            assert_eq!(
                Value::Object(env),
                theirs["env"],
                "rank {rank} of {entries}"
            );
            let files = theirs["files"].as_object().context("files")?;
            let names: Vec<&String> = files.keys().collect();
            assert_eq!(names, [jaccl::DEVICES_ENV], "{theirs}");
            let matrix: Value =
                serde_json::from_str(files[jaccl::DEVICES_ENV].as_str().context("devices")?)?;
            assert_eq!(
                serde_json::from_str::<Value>(&ours.devices)?,
                matrix,
                "{entries}"
            );
        }
    }
    Ok(())
}

#[test]
fn two_ranks_in_pipeline_mode_serve_the_single_engines_tokens_alone_and_batched() -> Result<()> {
    // Llama: 2 layers, one per rank; Qwen3-MoE: 3 layers (a dense one between two sparse), two
    // on rank 0 and one on rank 1, so the ranks' caches differ in size.
    for name in ["tiny-llama", "family-qwen3_moe"] {
        ranks_serve_the_single_engines_tokens(name, Mode::Pipeline, 2)?;
    }
    Ok(())
}

#[test]
fn quantized_kv_in_a_group_gives_the_single_engines_tokens_in_both_modes() -> Result<()> {
    // Qwen3's 32-wide heads hold one 32-wide quantization group (tiny Llama's 16 hold none).
    for mode in [Mode::Tensor, Mode::Pipeline] {
        ranks_serve_the_single_engines_tokens_with(
            "tiny-qwen3",
            mode,
            2,
            &["--kv-bits", "8", "--kv-group-size", "32"],
            &bodies(),
        )?;
    }
    Ok(())
}

#[test]
fn options_a_group_cannot_honour_fail_the_load_naming_them() -> Result<()> {
    let model = tiny_model("tiny-llama")?;
    let cases: [(&[&str], &str); 5] = [
        (&["--warm-up", "true"], "warm_up"),
        (&["--adapters", "a=/nowhere"], "adapters"),
        (&["--draft", "ngram"], "draft"),
        (&["--draft-model", "/nowhere"], "draft_model"),
        (&["--ssd-cache", "/nowhere"], "ssd_cache"),
    ];
    for (flags, key) in cases {
        let dir = tempfile::tempdir()?;
        let output = Command::new(built_engine_bin()?)
            .args(["--model", &model.display().to_string()])
            .args(["--distributed", "ring", "--unix"])
            .arg(dir.path().join("s.sock"))
            .args(flags)
            .env("MLX_RANK", "0")
            .env("MLXD_HOME", dir.path().join("home"))
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .output()?;
        assert!(!output.status.success(), "{flags:?}");
        let log = plain(&String::from_utf8_lossy(&output.stderr));
        assert!(
            log.contains(&format!("engine option {key} ="))
                && log.contains("is not supported by an engine group (distributed) yet: "),
            "{flags:?}: {log}"
        );
    }
    Ok(())
}

#[test]
fn a_constrained_request_to_a_group_is_refused_naming_it() -> Result<()> {
    let model = tiny_model("tiny-qwen3")?;
    let mut group = Group::start(&model, 2, 2)?;
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    let body = serde_json::to_vec(&json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema":
            {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    }))?;
    let mut stream = UnixStream::connect(&socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(&body)?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    assert!(
        response.starts_with("HTTP/1.1 400")
            && response.contains("constrained decoding")
            && response.contains("engine group")
            && response.contains("\"unsupported\""),
        "{response}"
    );
    // The group still serves plain requests after it.
    assert!(!completion_ids(&socket, &bodies()[0])?.is_empty());
    Ok(())
}

#[test]
fn a_family_that_cannot_be_pipelined_is_refused_naming_it() -> Result<()> {
    let model = tiny_model("family-mixtral")?;
    Group::start_in(&model, 2, 2, Mode::Pipeline, &[])?.all_fail_saying(
        "MixtralForCausalLM cannot be divided into a pipeline of 2 ranks",
        Duration::from_secs(60),
    )
}

/// mlx-lm's greedy tokens for `prompt` with `model` divided among two ranks as `mode` says
/// (`scripts/mlx_lm_sharded_greedy.py`: `sharded_load(..., tensor_group=...)` or
/// `pipeline_group=...`, ring over 127.0.0.1), as rank 0 prints them.
fn mlx_lm_sharded_greedy(
    model: &Path,
    mode: Mode,
    max_tokens: usize,
    prompt: &[u32],
) -> Result<Vec<u64>> {
    let dir = tempfile::tempdir()?;
    let hostfile = dir.path().join("hosts.json");
    let entries: Vec<Value> = free_ports(2)?
        .iter()
        .map(|p| json!([format!("127.0.0.1:{p}")]))
        .collect();
    std::fs::write(&hostfile, serde_json::to_vec(&entries)?)?;
    let script = mlxd_tests::workspace_root().join("scripts/mlx_lm_sharded_greedy.py");
    let mode = match mode {
        Mode::Tensor => "tensor",
        Mode::Pipeline => "pipeline",
    };
    let rank = |r: usize| -> Result<Killed> {
        let mut cmd = Command::new(mlxd_tests::python()?);
        cmd.arg(&script)
            .args(["--mode", mode])
            .arg(model)
            .arg(max_tokens.to_string())
            .args(prompt.iter().map(u32::to_string))
            .env("MLX_RANK", r.to_string())
            .env("MLX_HOSTFILE", &hostfile)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(
                dir.path().join(format!("py{r}.log")),
            )?);
        Ok(Killed(cmd.spawn()?))
    };
    let mut ranks = [rank(0)?, rank(1)?];
    let mut printed = String::new();
    ranks[0]
        .0
        .stdout
        .take()
        .context("rank 0's stdout")?
        .read_to_string(&mut printed)?;
    for (r, child) in ranks.iter_mut().enumerate() {
        let status = child.0.wait()?;
        let log = std::fs::read_to_string(dir.path().join(format!("py{r}.log")))?;
        anyhow::ensure!(
            status.success(),
            "mlx-lm {mode} rank {r} failed ({status}): {log}"
        );
    }
    printed
        .split_whitespace()
        .map(|t| t.parse().with_context(|| format!("mlx-lm printed {t:?}")))
        .collect()
}

/// Two ranks dividing `name` as `mode` says give mlx-lm's greedy tokens for the same division
/// of the same directory ([`mlx_lm_sharded_greedy`]).
fn ranks_give_mlx_lms_sharded_tokens(name: &str, mode: Mode) -> Result<()> {
    const MAX_TOKENS: usize = 8;
    let model = tiny_model(name)?;
    let prompt = [5u32, 17, 33, 8];
    let reference = mlx_lm_sharded_greedy(&model, mode, MAX_TOKENS, &prompt)?;
    assert_eq!(
        reference.len(),
        MAX_TOKENS,
        "{name} {mode:?}: {reference:?}"
    );
    let mut group = Group::start_in(&model, 2, 2, mode, &[])?;
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    let ours = completion_ids(
        &socket,
        &json!({"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}),
    )?;
    assert_eq!(ours, reference, "{name} {mode:?}");
    Ok(())
}

#[test]
fn pipeline_mode_gives_mlx_lms_pipelined_tokens() -> Result<()> {
    // mlx-lm's `sharded_load` pipelines Qwen3-MoE (its Llama file has no `pipeline`); the
    // checkpoint has the index file it needs.
    ranks_give_mlx_lms_sharded_tokens("family-qwen3_moe", Mode::Pipeline)
}

#[test]
fn tensor_mode_gives_mlx_lms_tensor_parallel_tokens() -> Result<()> {
    // mlx-lm's Llama and Qwen3-MoE files `shard()` as we do: q/k/v and gate/up by column, o and
    // down by row, each stacked expert's gate/up by column and down by row, the router whole.
    for name in ["tiny-llama", "family-qwen3_moe"] {
        ranks_give_mlx_lms_sharded_tokens(name, Mode::Tensor)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_mlxd_a_pipeline_group_serves_the_single_engines_text() -> Result<()> {
    // `mode = "pipeline"` in mlxd.toml reaches every rank (rank 0's options, broadcast).
    let model = tiny_model("family-qwen3_moe")?;
    let dir = tempfile::tempdir()?;
    let config = group_config(dir.path(), &model, LOCAL_PAIR, ", mode = \"pipeline\"", "")?;
    let mlxd = start_mlxd(&config).await?;
    let addr = mlxd.addr;
    tokio::task::spawn_blocking(move || -> Result<()> {
        let body = |model: &str| {
            json!({"model": model, "prompt": "hello world the", "max_tokens": 24,
                   "temperature": 0})
        };
        let expected = mlxd_completion(addr, &body("s"), || Ok(()))?;
        assert!(!expected.is_empty());
        assert_eq!(mlxd_completion(addr, &body("g"), || Ok(()))?, expected);
        Ok(())
    })
    .await??;
    // The hostfile rank 0 wrote beside its socket is gone once the group has formed.
    let left = files_under(mlxd.dir.path())?
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with(".hosts.json"))
        .collect::<Vec<_>>();
    assert!(left.is_empty(), "left behind: {left:?}");
    drop(mlxd);
    Ok(())
}

/// Every file under `dir`, at any depth.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    Ok(files)
}

/// Each tensor's bytes in a safetensors file, by name.
fn tensor_sizes(file: &Path) -> Result<Vec<(String, u64)>> {
    let bytes = std::fs::read(file)?;
    let length = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + length])?;
    header
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(name, entry)| {
            let at = |i: usize| entry["data_offsets"][i].as_u64().context("data_offsets");
            Ok((name.clone(), at(1)? - at(0)?))
        })
        .collect()
}

#[test]
fn each_pipeline_rank_reads_only_its_layers_and_the_ends_it_uses() -> Result<()> {
    // Qwen3-MoE, 3 layers, its own head: rank 0 runs layers 1-2 and does not embed; rank 1
    // runs layer 0 and embeds. Both apply the final norm and the head.
    let model = tiny_model("family-qwen3_moe")?;
    let sizes = tensor_sizes(&model.join("model.safetensors"))?;
    let bytes = |keep: &dyn Fn(&str) -> bool| -> u64 {
        sizes.iter().filter(|(n, _)| keep(n)).map(|(_, b)| b).sum()
    };
    let in_layers = |name: &str, layers: &[usize]| {
        layers
            .iter()
            .any(|l| name.starts_with(&format!("model.layers.{l}.")))
    };
    let ends = bytes(&|n| n.starts_with("lm_head.") || n.starts_with("model.norm."));
    let embedding = bytes(&|n| n.starts_with("model.embed_tokens."));
    assert!(ends > 0 && embedding > 0);
    let expected = [
        bytes(&|n| in_layers(n, &[1, 2])) + ends,
        bytes(&|n| in_layers(n, &[0])) + ends + embedding,
    ];
    let mut group = Group::start_in(&model, 2, 2, Mode::Pipeline, &[])?;
    let socket = group.socket();
    wait_serving(&socket, &mut group.ranks[0], Duration::from_secs(60))?;
    for (rank, want) in expected.iter().enumerate() {
        let log = group.log(rank);
        assert_eq!(
            logged_number(&log, "read_bytes"),
            Some(*want),
            "rank {rank}: {log}"
        );
        assert_eq!(
            logged_number(&log, "held_bytes"),
            Some(*want),
            "rank {rank}: {log}"
        );
    }
    Ok(())
}

#[test]
fn three_ranks_in_pipeline_mode_serve_the_single_engines_tokens() -> Result<()> {
    // One Qwen3-MoE layer per rank: rank 1 both receives (from rank 2) and sends (to rank 0).
    ranks_serve_the_single_engines_tokens("family-qwen3_moe", Mode::Pipeline, 3)
}
