//! Model-switch benchmark, driven by `scripts/bench/model_switch.sh`.
//!
//! Starts `mlxd` with `max_engines = 1` and two or more models, then measures time to
//! first token (request sent → first content event of a streamed chat completion) when
//! the model:
//! - must be loaded and its weights are not in the page cache (`cold`: the weight files
//!   are dropped from the cache with `posix_fadvise(DONTNEED)` first),
//! - must be loaded and its weights are in the page cache (`warm`),
//! - is already loaded (`loaded`).
//!
//! Usage: `switch-bench <mlxd> <engine-bin> <iterations> <model-path> <model-path> [...]`
//! (engine environment such as `MLXD_HOME` is passed through by `mlxd`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::BodyExt;
use mlxd_tests::send;
use serde_json::json;

/// Drops `path` (a file, or every file in a directory) from the page cache.
fn drop_page_cache(path: &Path) -> Result<()> {
    let files: Vec<PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect()
    } else if path.is_file() {
        vec![path.to_path_buf()]
    } else {
        Vec::new()
    };
    for f in files {
        let file = std::fs::File::open(&f)?;
        // SAFETY: a valid open descriptor; DONTNEED only drops clean cached pages.
        let rc = unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            bail!("posix_fadvise({}) failed: {rc}", f.display());
        }
    }
    Ok(())
}

/// Streams one chat completion; returns the time to the first content event.
async fn ttft(addr: std::net::SocketAddr, model: &str) -> Result<Duration> {
    let body = json!({"model": model, "stream": true, "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hello"}]})
    .to_string();
    let t = Instant::now();
    let resp = send(addr, "POST", "/v1/chat/completions", Some(body.into())).await?;
    if resp.status() != 200 {
        let b = resp.into_body().collect().await?.to_bytes();
        bail!("{model}: {}", String::from_utf8_lossy(&b));
    }
    let mut body = resp.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if first.is_none() && frame.data_ref().is_some_and(|d| d.starts_with(b"data: {")) {
            first = Some(t.elapsed());
        }
    }
    first.context("no content event")
}

fn summary(name: &str, v: &mut [Duration]) {
    if v.is_empty() {
        return;
    }
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "  {name:<8} n={:<3} median {:>9.1} ms   min {:>9.1} ms   max {:>9.1} ms",
        v.len(),
        ms(v[v.len() / 2]),
        ms(v[0]),
        ms(v[v.len() - 1])
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 6 {
        bail!("usage: switch-bench <mlxd> <engine-bin> <iterations> <model> <model> [...]");
    }
    let (mlxd, engine) = (PathBuf::from(&args[1]), PathBuf::from(&args[2]));
    let iterations: usize = args[3].parse()?;
    let sources: Vec<PathBuf> = args[4..].iter().map(PathBuf::from).collect();
    let dir = tempfile::tempdir()?;
    let mut toml = format!(
        "[server]\nengine_bin = {:?}\nqueue_timeout_ms = 600000\n[pool]\nmax_engines = 1\nttl = 0\n",
        engine.display().to_string()
    );
    let ids: Vec<String> = (0..sources.len()).map(|i| format!("m{i}")).collect();
    for (id, src) in ids.iter().zip(&sources) {
        toml.push_str(&format!(
            "[[model]]\nid = {id:?}\npath = {:?}\n",
            src.display().to_string()
        ));
    }
    let config = dir.path().join("mlxd.toml");
    std::fs::write(&config, toml)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = Command::new(&mlxd)
        .arg("--config")
        .arg(&config)
        .args(["--port", &port.to_string()])
        .env("XDG_RUNTIME_DIR", dir.path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("mlxd.log"))?)
        .spawn()?;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let t = Instant::now();
    while send(addr, "GET", "/health", None).await.is_err() {
        if t.elapsed() > Duration::from_secs(10) {
            bail!("mlxd did not come up");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut cold = vec![Vec::new(); ids.len()];
    let mut warm = cold.clone();
    let mut loaded = cold.clone();
    let result: Result<()> = async {
        // Warm-up: every model once.
        for id in &ids {
            ttft(addr, id).await?;
        }
        for _ in 0..iterations {
            for (i, id) in ids.iter().enumerate() {
                // Another model is loaded now (max_engines = 1): this one must load.
                let other = &ids[(i + 1) % ids.len()];
                ttft(addr, other).await?;
                drop_page_cache(&sources[i])?;
                cold[i].push(ttft(addr, id).await?);
                loaded[i].push(ttft(addr, id).await?);
                ttft(addr, other).await?;
                warm[i].push(ttft(addr, id).await?);
            }
        }
        Ok(())
    }
    .await;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    result?;
    println!(
        "time to first token, max_engines = 1, engine {}:",
        engine.display()
    );
    for (i, src) in sources.iter().enumerate() {
        println!(" {}", src.display());
        summary("cold", &mut cold[i]);
        summary("warm", &mut warm[i]);
        summary("loaded", &mut loaded[i]);
    }
    Ok(())
}
