//! A minimal HTTP/1.1 client for `mlxd ps` and `mlxd ls`, which talk to a running
//! server, and the tables they print.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Bytes as HumanBytes;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("unsupported URL {0:?}: expected http://HOST:PORT")]
    Url(String),
    #[error("cannot reach mlxd at {url}: {detail} (is `mlxd serve` running?)")]
    Connect { url: String, detail: String },
    #[error("GET {path} failed: {detail}")]
    Http { path: String, detail: String },
    #[error("GET {path} answered {status}: {body}")]
    Status {
        path: String,
        status: u16,
        body: String,
    },
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

/// `GET {url}{path}` as JSON.
/// `GET url+path` as JSON, with `api_key` as a bearer token when given.
pub async fn get_json(url: &str, path: &str, api_key: Option<&str>) -> Result<Value, ClientError> {
    let auth = authority(url)?;
    let stream = tokio::net::TcpStream::connect(&auth)
        .await
        .map_err(|e| ClientError::Connect {
            url: url.to_string(),
            detail: e.to_string(),
        })?;
    let http = |e: &dyn std::fmt::Display| ClientError::Http {
        path: path.to_string(),
        detail: e.to_string(),
    };
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| http(&e))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = http::Request::get(path).header(http::header::HOST, auth.as_str());
    if let Some(key) = api_key {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
    }
    let req = req.body(Empty::<Bytes>::new()).map_err(|e| http(&e))?;
    let resp = tx.send_request(req).await.map_err(|e| http(&e))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| http(&e))?
        .to_bytes();
    if !status.is_success() {
        return Err(ClientError::Status {
            path: path.to_string(),
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| http(&e))
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
                e["state"].as_str().unwrap_or("?").to_string(),
                HumanBytes(e["memory_bytes"].as_u64().unwrap_or(0)).to_string(),
                e["uptime_s"].as_f64().map_or("-".into(), duration),
                e["in_flight"].to_string(),
                e["queued_requests"].to_string(),
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
        ],
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
    fn tables() {
        let engines = json!({"engines": [
            {"model": "a", "pid": 42, "state": "ready", "availability": "loaded", "memory_bytes": 3u64 << 30,
             "uptime_s": 75.0, "in_flight": 2, "queued_requests": 0, "pinned": true, "aliases": ["x", "y"], "source": "/m/a"},
            {"model": "bb", "pid": null, "state": "failed", "availability": "failed", "failure": "boom",
             "memory_bytes": 0, "uptime_s": null, "in_flight": 0, "queued_requests": 0, "pinned": false, "aliases": [], "source": "bb"},
        ]});
        assert_eq!(
            ps_table(&engines),
            "MODEL  PID  STATE  MEMORY   UPTIME  IN-FLIGHT  QUEUED\n\
             a      42   ready  3.0 GiB  1m15s   2          0\n"
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
