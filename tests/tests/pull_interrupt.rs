//! `mlxd pull` stopped by SIGINT: what no later pull can use is removed at once (a
//! conversion's staging directory, partial files in `downloads/`), and a partial Hugging Face
//! download is kept for the next pull, which resumes it with a range request. Real `mlxd`
//! processes, the real SmolLM2 GGUF and a local server that answers like the Hub.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use mlxd_tests::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// `mlxd pull <spec>` with `env`, output captured.
fn pull(spec: &str, env: &[(&str, &Path)]) -> Result<Child> {
    let mut cmd = Command::new(mlxd_bin()?);
    cmd.args(["pull", spec])
        .env("HF_HUB_OFFLINE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ok(cmd.spawn()?)
}

/// Waits up to `limit` for `found` to name a path.
fn wait_for(what: &str, limit: Duration, found: impl Fn() -> Option<PathBuf>) -> Result<PathBuf> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(p) = found() {
            return Ok(p);
        }
        if Instant::now() > deadline {
            bail!("{what} never appeared");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// SIGINT, then the exit status and stderr (within 10 s).
fn interrupt(mut child: Child) -> Result<(Option<i32>, String)> {
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait()?.is_none() {
        ensure!(Instant::now() < deadline, "mlxd pull ignored SIGINT");
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = child.wait()?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        e.read_to_string(&mut err)?;
    }
    Ok((status.code(), err))
}

/// The names in `dir`.
fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn an_interrupted_conversion_leaves_no_staging_directory() -> Result<()> {
    let gguf = smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("store");
    let child = pull(
        "smollm2-135m",
        &[("MLXD_HOME", &home), ("MLXD_SMOLLM2_GGUF", &gguf)],
    )?;
    let models = home.join("models");
    let staging = wait_for("the staging directory", Duration::from_secs(120), || {
        names(&models)
            .into_iter()
            .find(|n| n.starts_with(".smollm2-135m.partial-"))
            .map(|n| models.join(n))
    })?;
    let (code, err) = interrupt(child)?;
    ensure!(code == Some(130), "exit {code:?}: {err}");
    ensure!(err.contains("interrupted; removed 1 partial file"), "{err}");
    ensure!(!staging.exists(), "{} is left", staging.display());
    ensure!(names(&models).is_empty(), "{:?}", names(&models));
    Ok(())
}

/// A stand-in for the Hub serving one repo, `org/tiny`, from a directory: the revision's
/// file list and each file with the headers `hf-hub` reads (`x-repo-commit`, `etag`,
/// `Content-Range`), honouring `Range: bytes=N-`. While `slow` is set, file bodies are
/// sent 1 KiB every 20 ms. Records the ranges asked for (not the one-byte probes).
struct SlowHub {
    url: String,
    slow: Arc<AtomicBool>,
    ranges: Arc<Mutex<Vec<String>>>,
}

const SHA: &str = "89abcdef0123456789abcdef0123456789abcdef";

impl SlowHub {
    fn start(repo: PathBuf) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let url = format!("http://{}", listener.local_addr()?);
        let slow = Arc::new(AtomicBool::new(true));
        let ranges = Arc::new(Mutex::new(Vec::new()));
        let (s, r) = (slow.clone(), ranges.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (repo, s, r) = (repo.clone(), s.clone(), r.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &repo, &s, &r);
                });
            }
        });
        Ok(Self { url, slow, ranges })
    }
}

fn serve(
    mut stream: TcpStream,
    repo: &Path,
    slow: &AtomicBool,
    ranges: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte)? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
    let range = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("range")
            .then(|| v.trim().to_string())
    });
    let (status, extra, body) = if path.starts_with("/api/models/org/tiny/revision/") {
        let files: Vec<_> = names(repo)
            .into_iter()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let v = serde_json::json!({"id": "org/tiny", "sha": SHA, "siblings": files});
        (200, String::new(), v.to_string().into_bytes())
    } else if let Some(file) = path
        .strip_prefix("/org/tiny/resolve/")
        .and_then(|p| p.split_once('/'))
        .map(|(_, f)| f.to_string())
    {
        match std::fs::read(repo.join(&file)) {
            Ok(all) => {
                let total = all.len();
                let probe = range.as_deref() == Some("bytes=0-0");
                let start: usize = range
                    .as_deref()
                    .and_then(|r| r.strip_prefix("bytes="))
                    .and_then(|r| r.split('-').next())
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let end = if probe { 0 } else { total - 1 };
                if !probe {
                    if let Some(r) = &range {
                        ranges.lock().unwrap().push(format!("{file} {r}"));
                    }
                }
                let extra = format!(
                    "x-repo-commit: {SHA}\r\netag: \"{file}-{total}\"\r\nContent-Range: bytes {start}-{end}/{total}\r\n"
                );
                (206, extra, all[start..=end].to_vec())
            }
            Err(_) => (404, String::new(), Vec::new()),
        }
    } else {
        (404, String::new(), Vec::new())
    };
    write!(
        stream,
        "HTTP/1.1 {status} X\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    for chunk in body.chunks(1024) {
        stream.write_all(chunk)?;
        if slow.load(Ordering::SeqCst) && body.len() > 1024 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

#[test]
fn an_interrupted_hub_download_is_kept_and_resumed() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let repo = tmp.path().join("served");
    std::fs::create_dir_all(&repo)?;
    for e in std::fs::read_dir(tiny_model("tiny-llama")?)? {
        let e = e?;
        if e.path().is_file() {
            std::fs::copy(e.path(), repo.join(e.file_name()))?;
        }
    }
    let hub = SlowHub::start(repo.clone())?;
    let (home, cache) = (tmp.path().join("store"), tmp.path().join("hub"));
    let endpoint = PathBuf::from(&hub.url);
    let env = [
        ("MLXD_HOME", home.as_path()),
        ("HF_HUB_CACHE", cache.as_path()),
        ("HF_ENDPOINT", endpoint.as_path()),
    ];
    let child = pull("org/tiny", &env)?;
    let blobs = cache.join("models--org--tiny/blobs");
    wait_for("a partial download", Duration::from_secs(60), || {
        names(&blobs).into_iter().map(|n| blobs.join(n)).find(|p| {
            p.extension().is_some_and(|e| e == "part")
                && std::fs::metadata(p).is_ok_and(|m| m.len() > 4096)
        })
    })?;
    let (code, err) = interrupt(child)?;
    ensure!(code == Some(130), "exit {code:?}: {err}");
    ensure!(err.contains("`mlxd pull org/tiny` resumes"), "{err}");
    ensure!(
        names(&home.join("downloads")).is_empty(),
        "{:?}",
        names(&home.join("downloads"))
    );

    hub.slow.store(false, Ordering::SeqCst);
    let out = pull("org/tiny", &env)?.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{err}");
    let snapshot = cache.join("models--org--tiny/snapshots").join(SHA);
    ensure!(
        std::fs::read(snapshot.join("model.safetensors"))?
            == std::fs::read(repo.join("model.safetensors"))?,
        "the resumed download differs"
    );
    // The file cut short was asked for again from where it stopped, not from 0.
    let ranges = hub.ranges.lock().unwrap().clone();
    let resumed = ranges
        .iter()
        .filter_map(|r| r.rsplit_once(" bytes="))
        .any(|(_, from)| from.split('-').next().is_some_and(|n| n != "0"));
    ensure!(resumed, "not resumed: {ranges:?}");
    Ok(())
}
