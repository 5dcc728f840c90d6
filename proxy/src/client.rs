//! A minimal HTTP/1.1 client for the verbs that read a running server's own endpoints (`mlxd
//! ps`, `ls --server`, `stop`), and the tables the client verbs print (`run`, `bench`,
//! `quantize` and `jobs` go through `mlxd-client`). Every request has a
//! deadline: connecting and a whole non-streaming exchange take at most the client's timeout,
//! and a stream may be silent for at most that long between two chunks.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Bytes as HumanBytes;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("unsupported URL {0:?}: expected http://HOST:PORT")]
    Url(String),
    #[error("cannot reach mlxd at {url}: {detail} (is `mlxd serve` running?)")]
    Connect { url: String, detail: String },
    #[error("{method} {path} failed: {detail}")]
    Http {
        method: &'static str,
        path: String,
        detail: String,
    },
    #[error("{method} {path} answered {status}: {body}")]
    Status {
        method: &'static str,
        path: String,
        status: u16,
        body: String,
    },
    #[error(
        "{method} {path}: no answer from {url} within {} s (raise --timeout if the server is \
         busy)", timeout.as_secs_f64()
    )]
    Timeout {
        method: &'static str,
        url: String,
        path: String,
        timeout: Duration,
    },
}

/// Where and how to reach a server.
#[derive(Debug, Clone)]
pub struct Server {
    pub url: String,
    pub api_key: Option<String>,
    pub timeout: Duration,
}

/// `host:port` from `http://host:port[/]`.
fn authority(url: &str) -> Result<String, ClientError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| ClientError::Url(url.to_string()))?;
    let auth = rest.trim_end_matches('/');
    if auth.is_empty() || auth.contains('/') {
        return Err(ClientError::Url(url.to_string()));
    }
    Ok(if auth.contains(':') {
        auth.to_string()
    } else {
        format!("{auth}:80")
    })
}

/// An error body's message (`{"error": {"message"}}`), else the body as text.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

impl Server {
    fn timeout_error(&self, method: &'static str, path: &str) -> ClientError {
        ClientError::Timeout {
            method,
            url: self.url.clone(),
            path: path.to_string(),
            timeout: self.timeout,
        }
    }

    /// Sends one request and returns the response head, once the status is 2xx; a non-2xx
    /// answer becomes [`ClientError::Status`] with the error body's message.
    async fn send(
        &self,
        method: &'static str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let auth = authority(&self.url)?;
        let stream = tokio::time::timeout(self.timeout, tokio::net::TcpStream::connect(&auth))
            .await
            .map_err(|_| self.timeout_error(method, path))?
            .map_err(|e| ClientError::Connect {
                url: self.url.clone(),
                detail: e.to_string(),
            })?;
        let http = |e: &dyn std::fmt::Display| ClientError::Http {
            method,
            path: path.to_string(),
            detail: e.to_string(),
        };
        let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(&e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, auth.as_str());
        if let Some(key) = &self.api_key {
            req = req.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let bytes = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                Bytes::from(v.to_string())
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(bytes)).map_err(|e| http(&e))?;
        let resp = tokio::time::timeout(self.timeout, tx.send_request(req))
            .await
            .map_err(|_| self.timeout_error(method, path))?
            .map_err(|e| http(&e))?;
        if !resp.status().is_success() {
            let status = resp.status().as_u16();
            let body = tokio::time::timeout(self.timeout, resp.into_body().collect())
                .await
                .map_err(|_| self.timeout_error(method, path))?
                .map_err(|e| http(&e))?
                .to_bytes();
            return Err(ClientError::Status {
                method,
                path: path.to_string(),
                status,
                body: error_message(&body),
            });
        }
        Ok(resp)
    }

    /// `method path` with an optional JSON body, answered with JSON.
    pub async fn json(
        &self,
        method: &'static str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        let resp = self.send(method, path, body).await?;
        let body = tokio::time::timeout(self.timeout, resp.into_body().collect())
            .await
            .map_err(|_| self.timeout_error(method, path))?
            .map_err(|e| ClientError::Http {
                method,
                path: path.to_string(),
                detail: e.to_string(),
            })?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| ClientError::Http {
            method,
            path: path.to_string(),
            detail: format!("the answer is not JSON: {e}"),
        })
    }
}

/// A streamed answer.
#[derive(Debug, Clone)]
pub struct Streamed {
    pub text: String,
    /// Time to the first piece of text.
    pub first_token: Option<Duration>,
    pub elapsed: Duration,
    /// From the final usage chunk.
    pub completion_tokens: Option<u64>,
    pub finish_reason: Option<String>,
}

impl Streamed {
    /// Generated tokens per second after the first one.
    pub fn decode_rate(&self) -> Option<f64> {
        let n = self.completion_tokens? as f64;
        let decode = (self.elapsed - self.first_token?).as_secs_f64();
        (n > 1.0 && decode > 0.0).then(|| (n - 1.0) / decode)
    }
}

/// `GET url+path` as JSON, with `api_key` as a bearer token when given, within `timeout`.
pub async fn get_json(
    url: &str,
    path: &str,
    api_key: Option<&str>,
    timeout: Duration,
) -> Result<Value, ClientError> {
    Server {
        url: url.to_string(),
        api_key: api_key.map(str::to_string),
        timeout,
    }
    .json("GET", path, None)
    .await
}

/// Left-aligned columns separated by two spaces.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

fn duration(secs: f64) -> String {
    let s = secs as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A row's state, with the load's phase and percent while it loads:
/// `starting (weights 40%)`.
fn state_text(e: &Value) -> String {
    let state = e["state"].as_str().unwrap_or("?");
    match (e["loading_phase"].as_str(), e["loading_progress"].as_f64()) {
        (Some(phase), Some(p)) if e["availability"] == "loading" => {
            format!("{state} ({phase} {:.0}%)", (p * 100.0).clamp(0.0, 100.0))
        }
        _ => state.to_string(),
    }
}

/// `mlxd ps`: running engines, from `GET /engines`.
pub fn ps_table(engines: &Value) -> String {
    let rows: Vec<Vec<String>> = engines["engines"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|e| e["pid"].is_u64())
        .map(|e| {
            vec![
                e["model"].as_str().unwrap_or("?").to_string(),
                e["pid"].to_string(),
                state_text(e),
                HumanBytes(e["memory_bytes"].as_u64().unwrap_or(0)).to_string(),
                e["uptime_s"].as_f64().map_or("-".into(), duration),
                e["in_flight"].to_string(),
                e["queued_requests"].to_string(),
                e["restarts"].as_u64().map_or("-".into(), |n| n.to_string()),
                e["device"]
                    .as_str()
                    .or_else(|| e["ready"]["device"].as_str())
                    .unwrap_or("-")
                    .to_string(),
            ]
        })
        .collect();
    table(
        &[
            "MODEL",
            "PID",
            "STATE",
            "MEMORY",
            "UPTIME",
            "IN-FLIGHT",
            "QUEUED",
            "RESTARTS",
            "DEVICE",
        ],
        &rows,
    )
}

/// `mlxd ls`: the models on disk.
pub fn store_table(models: &[mlxd_store::inventory::StoredModel]) -> String {
    use mlxd_store::inventory::StoredKind;
    let rows: Vec<Vec<String>> = models
        .iter()
        .map(|m| {
            let from = match &m.kind {
                StoredKind::Known => "known model".to_string(),
                StoredKind::Local => "store".to_string(),
                StoredKind::Gguf { source: Some(p) } => format!("gguf {}", p.display()),
                StoredKind::Gguf { source: None } => "gguf".to_string(),
                StoredKind::HuggingFace => "hugging face cache".to_string(),
            };
            vec![
                m.name.clone(),
                m.format.clone(),
                HumanBytes(m.size_bytes).to_string(),
                from,
            ]
        })
        .collect();
    table(&["NAME", "FORMAT", "SIZE", "FROM"], &rows)
}

/// `mlxd bench`: one line per timed request and the medians.
pub fn bench_table(runs: &[Streamed]) -> String {
    let ms =
        |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.0}", d.as_secs_f64() * 1e3));
    let rate = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.1}"));
    let mut rows: Vec<Vec<String>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            vec![
                (i + 1).to_string(),
                ms(r.first_token),
                ms(Some(r.elapsed)),
                r.completion_tokens.map_or("-".into(), |n| n.to_string()),
                rate(r.decode_rate()),
            ]
        })
        .collect();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    let ttft = median(
        runs.iter()
            .filter_map(|r| r.first_token)
            .map(|d| d.as_secs_f64())
            .collect(),
    );
    let total = median(runs.iter().map(|r| r.elapsed.as_secs_f64()).collect());
    let tps = median(runs.iter().filter_map(Streamed::decode_rate).collect());
    rows.push(vec![
        "median".into(),
        ms(ttft.map(Duration::from_secs_f64)),
        ms(total.map(Duration::from_secs_f64)),
        String::new(),
        rate(tps),
    ]);
    table(
        &["RUN", "TTFT-MS", "TOTAL-MS", "TOKENS", "DECODE-TOK/S"],
        &rows,
    )
}

/// `mlxd ls`: every configured model, from `GET /engines` (and `/v1/models` for the
/// default marker).
pub fn ls_table(engines: &Value, models: &Value) -> String {
    let default = models["data"]
        .as_array()
        .and_then(|d| d.iter().find(|m| m["default"] == true))
        .and_then(|m| m["id"].as_str())
        .unwrap_or("");
    let rows: Vec<Vec<String>> = engines["engines"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let id = e["model"].as_str().unwrap_or("?");
            let mut flags = Vec::new();
            if id == default {
                flags.push("default");
            }
            if e["pinned"] == true {
                flags.push("pinned");
            }
            let aliases: Vec<&str> = e["aliases"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut state = e["availability"].as_str().unwrap_or("?").to_string();
            if let Some(f) = e["failure"].as_str() {
                state = format!("{state}: {f}");
            }
            vec![
                id.to_string(),
                state,
                flags.join(","),
                aliases.join(","),
                e["source"].as_str().unwrap_or("").to_string(),
            ]
        })
        .collect();
    table(&["MODEL", "STATE", "FLAGS", "ALIASES", "SOURCE"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ps_shows_a_load_in_progress() {
        let loading = serde_json::json!({"state": "starting", "availability": "loading",
            "loading_phase": "weights", "loading_progress": 0.4});
        assert_eq!(state_text(&loading), "starting (weights 40%)");
        let ready = serde_json::json!({"state": "ready", "availability": "loaded",
            "loading_progress": 1.0});
        assert_eq!(state_text(&ready), "ready");
    }
    use serde_json::json;

    #[test]
    fn urls() {
        assert_eq!(
            authority("http://127.0.0.1:8080").unwrap(),
            "127.0.0.1:8080"
        );
        assert_eq!(authority("http://localhost/").unwrap(), "localhost:80");
        assert!(authority("https://x:1").is_err());
        assert!(authority("http://x:1/v1").is_err());
    }

    #[test]
    fn bench_rows_and_medians() {
        let run = |ttft: u64, total: u64, n: u64| Streamed {
            text: String::new(),
            first_token: Some(Duration::from_millis(ttft)),
            elapsed: Duration::from_millis(total),
            completion_tokens: Some(n),
            finish_reason: Some("length".into()),
        };
        let runs = [run(100, 1100, 11), run(300, 2300, 21), run(200, 700, 6)];
        assert_eq!(runs[0].decode_rate(), Some(10.0));
        assert_eq!(
            bench_table(&runs),
            "RUN     TTFT-MS  TOTAL-MS  TOKENS  DECODE-TOK/S\n\
             1       100      1100      11      10.0\n\
             2       300      2300      21      10.0\n\
             3       200      700       6       10.0\n\
             median  200      1100              10.0\n"
        );
    }

    #[test]
    fn error_bodies_show_their_message() {
        let body =
            br#"{"error": {"message": "model \"x\" not found", "type": "invalid_request_error"}}"#;
        assert_eq!(error_message(body), "model \"x\" not found");
        assert_eq!(error_message(b"plain"), "plain");
    }

    #[test]
    fn tables() {
        let engines = json!({"engines": [
            {"model": "a", "pid": 42, "state": "ready", "availability": "loaded", "memory_bytes": 3u64 << 30,
             "uptime_s": 75.0, "in_flight": 2, "queued_requests": 0, "pinned": true, "aliases": ["x", "y"], "source": "/m/a"},
            {"model": "bb", "pid": null, "state": "failed", "availability": "failed", "failure": "boom",
             "memory_bytes": 0, "uptime_s": null, "in_flight": 0, "queued_requests": 0, "pinned": false, "aliases": [], "source": "bb"},
        ]});
        assert_eq!(
            ps_table(&engines),
            "MODEL  PID  STATE  MEMORY   UPTIME  IN-FLIGHT  QUEUED  RESTARTS  DEVICE\n\
             a      42   ready  3.0 GiB  1m15s   2          0       -         -\n"
        );
        let models = json!({"data": [{"id": "bb", "default": true}]});
        assert_eq!(
            ls_table(&engines, &models),
            "MODEL  STATE         FLAGS    ALIASES  SOURCE\n\
             a      loaded        pinned   x,y      /m/a\n\
             bb     failed: boom  default           bb\n"
        );
    }
}
