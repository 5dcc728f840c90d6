//! A real `mlxd-engine` serving one model on a unix socket, without `mlxd`: what the engine's
//! end-to-end tests and the job tests' parity checks talk to. The engine keeps each streamed
//! chunk's token ids in its `: mlxd` meta line, which `mlxd` would strip.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::Value;

use crate::{built_engine_bin, smollm2_gguf_if_present, test_home};

/// The engine process; killed on drop. Its stderr goes to a file in its temp dir, shown when
/// it fails to start.
pub struct EngineProcess {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl EngineProcess {
    /// Starts the engine on `model` (a name in the test home, or a directory) with the test
    /// home as its store, and waits until its socket answers `/health` with 200, for up to
    /// five minutes (the first run converts the default model).
    pub async fn start(model: impl AsRef<OsStr>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("engine.sock");
        let log = dir.path().join("engine.log");
        let mut cmd = Command::new(built_engine_bin()?);
        cmd.arg("--model")
            .arg(model.as_ref())
            .arg("--unix")
            .arg(&socket)
            .arg("--home")
            .arg(test_home())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        if let Some(gguf) = smollm2_gguf_if_present() {
            cmd.env("MLXD_SMOLLM2_GGUF", gguf);
        }
        let mut engine = Self {
            child: cmd.spawn().context("spawn mlxd-engine")?,
            socket,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = engine.child.try_wait()? {
                bail!(
                    "mlxd-engine exited before serving ({status}); its log:\n{}",
                    engine.stderr()
                );
            }
            if engine.socket.exists() {
                if let Ok((200, _)) = engine.request("GET", "/health", None).await {
                    return Ok(engine);
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "mlxd-engine did not serve within 5 minutes; its log:\n{}",
                    engine.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What the engine wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// One request over the socket; the status and the whole body.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<(u16, Vec<u8>)> {
        let req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://engine{path}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = mlxd_ipc::uds::send(&self.socket, req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, body.to_vec()))
    }

    /// GETs `path`; the status and the body as JSON.
    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        let (status, body) = self.request("GET", path, None).await?;
        Ok((status, json(&body)?))
    }

    /// POSTs raw bytes; the status and the body as JSON.
    pub async fn post_raw(&self, path: &str, body: &str) -> Result<(u16, Value)> {
        let (status, body) = self.request("POST", path, Some(body.to_owned())).await?;
        Ok((status, json(&body)?))
    }

    /// POSTs JSON; the status and the body as JSON.
    pub async fn post(&self, path: &str, body: Value) -> Result<(u16, Value)> {
        self.post_raw(path, &body.to_string()).await
    }

    /// POSTs a streaming request that must answer 200; the `data:` payloads in order (a choice
    /// chunk's `: mlxd` meta line is skipped).
    pub async fn post_stream(&self, path: &str, body: Value) -> Result<Vec<String>> {
        let (status, body) = self.request("POST", path, Some(body.to_string())).await?;
        let text = String::from_utf8(body).context("the stream is not UTF-8")?;
        ensure!(status == 200, "{path}: {status} {text}");
        Ok(text
            .split("\n\n")
            .filter_map(|ev| {
                let ev = match mlxd_protocol::openai::EventMeta::split(ev.as_bytes()) {
                    Some((_, at)) => &ev[at..],
                    None => ev,
                };
                ev.strip_prefix("data: ").map(str::to_owned)
            })
            .collect())
    }
}

fn json(body: &[u8]) -> Result<Value> {
    serde_json::from_slice(body)
        .with_context(|| format!("not JSON: {}", String::from_utf8_lossy(body)))
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
