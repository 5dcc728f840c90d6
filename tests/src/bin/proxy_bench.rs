//! Proxy overhead benchmark, driven by `scripts/bench/proxy_overhead.sh`.
//!
//! Starts `mlxd` with the fake engine, then streams the same requests alternately
//! through the proxy (TCP) and straight to the engine's unix socket, in one run.
//! The fake engine stamps each chunk with `CLOCK_MONOTONIC` (`t_ns`); the client
//! stamps arrival with the same clock, so per-chunk latency is comparable across paths.
//!
//! Usage: `proxy-bench <mlxd> <fake-engine> [streams] [chunks]`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use mlxd_ipc::sse::SseSplitter;

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

enum Target<'a> {
    Proxy(std::net::SocketAddr),
    Engine(&'a Path),
}

async fn post(target: &Target<'_>, body: String) -> Result<Response<Incoming>> {
    let req = Request::post("/v1/chat/completions")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    match target {
        Target::Proxy(addr) => {
            let s = tokio::net::TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
            tokio::spawn(conn);
            Ok(tx.send_request(req).await?)
        }
        Target::Engine(path) => Ok(mlxd_ipc::uds::send(path, req).await?),
    }
}

/// Streams one response; pushes per-chunk latencies (µs); returns (chunks, seconds).
async fn one_stream(
    target: &Target<'_>,
    chunks: u64,
    interval_ms: u64,
    lat: &mut Vec<f64>,
) -> Result<(u64, f64)> {
    let body = format!(
        "{{\"model\":\"bench\",\"stream\":true,\"messages\":[],\"fake\":{{\"chunks\":{chunks},\"interval_ms\":{interval_ms}}}}}"
    );
    let t0 = Instant::now();
    let resp = post(target, body).await?;
    if !resp.status().is_success() {
        bail!("status {}", resp.status());
    }
    let mut body = resp.into_body();
    let mut split = SseSplitter::new();
    let mut n = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = monotonic_ns();
        for ev in split.push(data) {
            if let Some(t) = t_ns(&ev) {
                lat.push(now.saturating_sub(t) as f64 / 1000.0);
                n += 1;
            }
        }
    }
    Ok((n, t0.elapsed().as_secs_f64()))
}

fn t_ns(ev: &[u8]) -> Option<u64> {
    let key = b"\"t_ns\":";
    let at = ev.windows(key.len()).position(|w| w == key)? + key.len();
    let digits: Vec<u8> = ev[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

struct Run {
    lat: Vec<f64>,
    chunks: u64,
    secs: f64,
}

impl Run {
    fn new() -> Self {
        Self {
            lat: Vec::new(),
            chunks: 0,
            secs: 0.0,
        }
    }
    fn report(&mut self, name: &str) -> (f64, f64) {
        self.lat.sort_by(|a, b| a.total_cmp(b));
        let (p50, p99) = (pct(&self.lat, 0.5), pct(&self.lat, 0.99));
        println!(
            "  {name:<7} chunks/s {:>10.0}   latency p50 {:>8.1} µs   p99 {:>8.1} µs   (n={})",
            self.chunks as f64 / self.secs,
            p50,
            p99,
            self.lat.len()
        );
        (p50, p99)
    }
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: proxy-bench <mlxd> <fake-engine> [streams] [chunks]");
    }
    let (mlxd, engine) = (PathBuf::from(&args[1]), PathBuf::from(&args[2]));
    let streams: u32 = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let chunks: u64 = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(2000);

    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = Command::new(&mlxd)
        .args(["serve", "--model", "bench", "--port", &port.to_string()])
        .arg("--engine-bin")
        .arg(&engine)
        .env("RUST_LOG", "warn")
        .env("XDG_RUNTIME_DIR", dir.path())
        .stdin(Stdio::null())
        .spawn()
        .context("starting mlxd")?;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let socket = dir
        .path()
        .join(format!("mlxd-{}", child.id()))
        .join("engine-0.sock");
    let proxy = Target::Proxy(addr);
    let direct = Target::Engine(&socket);

    let t = Instant::now();
    loop {
        let mut sink = Vec::new();
        match one_stream(&proxy, 1, 0, &mut sink).await {
            Ok(_) => break,
            Err(_) if t.elapsed() < Duration::from_secs(15) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => bail!("mlxd never served: {e}"),
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle_rss = rss_kib(child.id());

    println!("proxy overhead: {streams} streams x {chunks} chunks per path, alternating");
    for (label, n_chunks, interval) in [
        ("as fast as the engine can stream", chunks, 0u64),
        ("paced, 1 chunk per ms", chunks.min(500), 1),
    ] {
        let (mut d, mut p) = (Run::new(), Run::new());
        // Warm-up on both paths.
        one_stream(&direct, 100, 0, &mut Vec::new()).await?;
        one_stream(&proxy, 100, 0, &mut Vec::new()).await?;
        for _ in 0..streams {
            let (n, s) = one_stream(&direct, n_chunks, interval, &mut d.lat).await?;
            d.chunks += n;
            d.secs += s;
            let (n, s) = one_stream(&proxy, n_chunks, interval, &mut p.lat).await?;
            p.chunks += n;
            p.secs += s;
        }
        println!("{label}:");
        let (d50, d99) = d.report("direct");
        let (p50, p99) = p.report("proxy");
        println!(
            "  added by proxy: p50 {:.1} µs, p99 {:.1} µs per chunk; throughput {:.1}% of direct",
            p50 - d50,
            p99 - d99,
            100.0 * (p.chunks as f64 / p.secs) / (d.chunks as f64 / d.secs)
        );
    }
    match idle_rss {
        Some(kib) => println!("mlxd idle RSS: {:.1} MiB", kib as f64 / 1024.0),
        None => println!("mlxd idle RSS: unavailable"),
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let status = child.wait()?;
    if !status.success() {
        bail!("mlxd exited with {status}");
    }
    Ok(())
}
