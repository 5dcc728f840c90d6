//! What the client verbs share: which server they talk to ([`Target`], found as `mlxd serve`
//! finds its address), their exit codes ([`exit_code`]), a minimal HTTP/1.1 client for the
//! verbs that read a running server's own endpoints (`mlxd ps`, `ls --server`, `stop`), and
//! the tables they print (`run`, `bench`, `quantize` and `jobs` go through `mlxd-client`).
//! Every request has a deadline: connecting and a whole non-streaming exchange take at most
//! the client's timeout, and a stream may be silent for at most that long between two chunks.
//! Errors name what failed in a user's words, never an HTTP route.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::config::Bytes as HumanBytes;

/// The exit codes of the client verbs, for scripts (`mlxd --help` lists them).
pub mod exit_code {
    /// Done.
    pub const OK: i32 = 0;
    /// The server answered with an error: an unknown or failed model, a refused request, a
    /// stream that broke off.
    pub const SERVER: i32 = 1;
    /// Bad usage: flags, input (an empty piped prompt), the configuration. Clap's own.
    pub const USAGE: i32 = 2;
    /// No server answered: nothing listens there, or it did not answer in time.
    pub const UNREACHABLE: i32 = 3;
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("unsupported URL {0:?}: expected http://HOST:PORT")]
    Url(String),
    #[error("cannot reach mlxd at {url}: {detail} (is `mlxd serve` running?)")]
    Connect { url: String, detail: String },
    #[error("talking to the server failed: {detail}")]
    Http {
        method: &'static str,
        path: String,
        detail: String,
    },
    #[error("the server answered {status}: {body}")]
    Status {
        method: &'static str,
        path: String,
        status: u16,
        body: String,
    },
    #[error(
        "no answer from {url} within {} s (raise --timeout if the server is busy)",
        timeout.as_secs_f64()
    )]
    Timeout {
        method: &'static str,
        url: String,
        path: String,
        timeout: Duration,
    },
}

impl ClientError {
    /// The exit code this error ends a client verb with.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Url(_) => exit_code::USAGE,
            Self::Connect { .. } | Self::Timeout { .. } => exit_code::UNREACHABLE,
            Self::Http { .. } | Self::Status { .. } => exit_code::SERVER,
        }
    }
}

/// The exit code for an error of `mlxd-client` (used by `run`, `bench`, `quantize`, `jobs`).
pub fn client_exit_code(e: &mlxd_client::ClientError) -> i32 {
    use mlxd_client::ClientError as E;
    match e {
        E::Connect { .. } | E::Timeout { .. } => exit_code::UNREACHABLE,
        E::Config(_) => exit_code::USAGE,
        _ => exit_code::SERVER,
    }
}

/// The server a client verb talks to, and where its address came from (said on errors).
#[derive(Debug, Clone)]
pub struct Target {
    pub url: String,
    /// `--url or MLXD_URL`, `MLXD_HOST`, a config file, `the default`...
    pub from: String,
    pub api_key: Option<String>,
    pub timeout: Duration,
}

impl Target {
    /// `http://127.0.0.1:8096 (from /home/u/.config/mlxd/mlxd.toml)`.
    pub fn describe(&self) -> String {
        format!("{} ({})", self.url, self.from)
    }

    /// An `mlxd-client` HTTP client of the server, with the key and the timeout.
    pub fn client(&self) -> Result<mlxd_client::Client, mlxd_client::ClientError> {
        let mut builder = mlxd_client::Client::builder()
            .connect_timeout(self.timeout)
            .timeout(self.timeout);
        if let Some(key) = &self.api_key {
            builder = builder.api_key(key.clone());
        }
        builder.http(&self.url)
    }

    pub fn server(&self) -> Server {
        Server {
            url: self.url.clone(),
            api_key: self.api_key.clone(),
            timeout: self.timeout,
        }
    }
}

/// Splits `host[:port]` as `MLXD_HOST` and `--host` may give it: `127.0.0.1:8096`,
/// `[::1]:8096`, `box.lan`, `::1` (a bare IPv6 address has no port); an `http://` prefix is
/// dropped. The host comes back as it is written into a URL or a bind address (`[::1]`).
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    let s = s.trim();
    let s = s.strip_prefix("http://").unwrap_or(s).trim_end_matches('/');
    let port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("port {p:?} in host {s:?} is not a port number"))
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (addr, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("host {s:?} opens a bracket it does not close"))?;
        return match after {
            "" => Ok((format!("[{addr}]"), None)),
            a => match a.strip_prefix(':') {
                Some(p) => Ok((format!("[{addr}]"), Some(port(p)?))),
                None => Err(format!("host {s:?}: expected [ADDRESS]:PORT")),
            },
        };
    }
    match s.matches(':').count() {
        0 => Ok((s.to_string(), None)),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s, ""));
            Ok((h.to_string(), Some(port(p)?)))
        }
        _ => Ok((s.to_string(), None)),
    }
}

/// The server's URL and where it came from, as `mlxd serve` chooses its address: `url`
/// (`--url`/`MLXD_URL`) as given; else the host from `host` (`MLXD_HOST`, which may carry a
/// port), else the config file's; the port from `port` (`MLXD_PORT`), else `host`'s, else the
/// config file's, else 8080. A wildcard host means this machine.
pub fn resolve_url(
    url: Option<&str>,
    host: Option<&str>,
    port: Option<&str>,
    config: Option<(&std::path::Path, &str, u16)>,
) -> Result<(String, String), String> {
    if let Some(u) = url.map(str::trim).filter(|u| !u.is_empty()) {
        return Ok((u.to_string(), "from --url or MLXD_URL".into()));
    }
    let file = config.map(|(p, _, _)| p.display().to_string());
    let env_host = match host.map(str::trim).filter(|h| !h.is_empty()) {
        Some(h) => Some(split_host_port(h).map_err(|m| format!("MLXD_HOST: {m}"))?),
        None => None,
    };
    let env_port = match port.map(str::trim).filter(|p| !p.is_empty()) {
        Some(p) => Some(
            p.parse::<u16>()
                .map_err(|_| format!("MLXD_PORT {p:?} is not a port number"))?,
        ),
        None => None,
    };
    let (host, host_from) = match (&env_host, config) {
        (Some((h, _)), _) => (h.clone(), Some("MLXD_HOST".to_string())),
        (None, Some((_, h, _))) => (h.to_string(), file.clone()),
        (None, None) => ("127.0.0.1".to_string(), None),
    };
    let (port, port_from) = match (env_port, env_host.as_ref().and_then(|(_, p)| *p), config) {
        (Some(p), _, _) => (p, Some("MLXD_PORT".to_string())),
        (None, Some(p), _) => (p, Some("MLXD_HOST".to_string())),
        (None, None, Some((_, _, p))) => (p, file.clone()),
        (None, None, None) => (crate::cli::DEFAULT_PORT, None),
    };
    let mut from: Vec<String> = host_from.into_iter().collect();
    if let Some(p) = port_from.filter(|p| !from.contains(p)) {
        from.push(p);
    }
    let host = match host.as_str() {
        "0.0.0.0" | "" => "127.0.0.1".to_string(),
        "::" | "[::]" => "[::1]".to_string(),
        h if h.contains(':') && !h.starts_with('[') => format!("[{h}]"),
        h => h.to_string(),
    };
    let from = if from.is_empty() {
        "the default address".to_string()
    } else {
        format!("from {}", from.join(" and "))
    };
    Ok((format!("http://{host}:{port}"), from))
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
#[derive(Debug, Clone, Default)]
pub struct Streamed {
    pub text: String,
    /// The model's thinking, when it reports it apart (`reasoning_content`).
    pub reasoning: String,
    /// Time to the first piece of text or thinking.
    pub first_token: Option<Duration>,
    pub elapsed: Duration,
    /// From the final usage chunk.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the server took from its prompt cache.
    pub cached_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub finish_reason: Option<String>,
    /// Stopped by the user (Ctrl-C) before the server finished.
    pub interrupted: bool,
}

impl Streamed {
    /// Generated tokens per second after the first one.
    pub fn decode_rate(&self) -> Option<f64> {
        let n = self.completion_tokens? as f64;
        let decode = (self.elapsed.checked_sub(self.first_token?)?).as_secs_f64();
        (n > 1.0 && decode > 0.0).then(|| (n - 1.0) / decode)
    }

    /// Prompt tokens computed (not from the cache) per second until the first token.
    pub fn prefill_rate(&self) -> Option<f64> {
        let n = self
            .prompt_tokens?
            .saturating_sub(self.cached_tokens.unwrap_or(0)) as f64;
        let t = self.first_token?.as_secs_f64();
        (n > 0.0 && t > 0.0).then(|| n / t)
    }

    /// True when the answer stopped at the token limit.
    pub fn hit_max_tokens(&self) -> bool {
        self.finish_reason.as_deref() == Some("length")
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

/// A failed model's reason cut to its first line and at most this many characters for a
/// table column; `--verbose` and `--json` show it whole.
const SHORT_REASON: usize = 60;

/// The first line of `reason`, at most [`SHORT_REASON`] characters (an ellipsis says more
/// was cut). Log-shaped reasons (a JSON line) give their `message` or `fields.message`.
pub fn short_reason(reason: &str) -> String {
    let line = reason
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let line = serde_json::from_str::<Value>(line)
        .ok()
        .and_then(|v| {
            v["fields"]["message"]
                .as_str()
                .or(v["message"].as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| line.to_string());
    let more = reason.trim().lines().count() > 1;
    if line.chars().count() <= SHORT_REASON && !more {
        return line;
    }
    let cut: String = line.chars().take(SHORT_REASON - 1).collect();
    format!("{}…", cut.trim_end())
}

/// A row's state with its failure, short or whole.
fn state_cell(state: &str, failure: Option<&str>, verbose: bool) -> String {
    match failure {
        Some(f) if verbose => format!("{state}: {f}"),
        Some(f) => format!("{state}: {}", short_reason(f)),
        None => state.to_string(),
    }
}

/// A row's state, with the load's phase and percent while it loads:
/// `starting (weights 40%)`.
fn state_text(e: &Value) -> String {
    let state = e["state"].as_str().unwrap_or("?");
    let state = match (e["loading_phase"].as_str(), e["loading_progress"].as_f64()) {
        (Some(phase), Some(p)) if e["availability"] == "loading" => {
            format!("{state} ({phase} {:.0}%)", (p * 100.0).clamp(0.0, 100.0))
        }
        _ => state.to_string(),
    };
    // A spare engine: `+standby` once it can take over, `+standby starting` before.
    match e["standby"]["state"].as_str() {
        Some("ready") => format!("{state} +standby"),
        Some(s) => format!("{state} +standby {s}"),
        None => state,
    }
}

/// `mlxd ps`'s UNTIL column: when an idle engine is unloaded (its TTL less its idle time),
/// `busy` while requests run, `never` without a TTL (pinned, or `ttl = 0`).
fn until_cell(e: &Value) -> String {
    match (e["ttl_s"].as_f64(), e["idle_s"].as_f64()) {
        (None, _) => "never".into(),
        (Some(_), None) => "busy".into(),
        (Some(ttl), Some(idle)) => format!("in {}", duration((ttl - idle).max(0.0).ceil())),
    }
}

/// `mlxd ps`'s PREFIX HITS column: the running engine's prompt lookups that found a cached
/// prefix, of all its lookups, and the entries its budget evicted (many evictions with few hits,
/// where prompts repeat: `--prompt-cache` is too small for them); `-` before its first stats.
fn prefix_cell(e: &Value) -> String {
    let p = &e["stats"]["prefix"];
    let (Some(hits), Some(lookups)) = (p["hits"].as_u64(), p["lookups"].as_u64()) else {
        return "-".into();
    };
    match p["evictions"].as_u64().unwrap_or(0) {
        0 => format!("{hits}/{lookups}"),
        evicted => format!("{hits}/{lookups}, {evicted} evicted"),
    }
}

/// `mlxd ps`: running engines, from `GET /engines`; with `verbose`, every configured model
/// and whole failure reasons.
pub fn ps_table(engines: &Value, verbose: bool) -> String {
    let rows: Vec<Vec<String>> = engines["engines"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|e| verbose || e["pid"].is_u64() || e["failure"].is_string())
        .map(|e| {
            vec![
                e["model"].as_str().unwrap_or("?").to_string(),
                e["pid"].as_u64().map_or("-".into(), |p| p.to_string()),
                state_cell(&state_text(e), e["failure"].as_str(), verbose),
                HumanBytes(e["memory_bytes"].as_u64().unwrap_or(0)).to_string(),
                e["uptime_s"].as_f64().map_or("-".into(), duration),
                if e["pid"].is_u64() {
                    until_cell(e)
                } else {
                    "-".into()
                },
                e["in_flight"].to_string(),
                e["queued_requests"].to_string(),
                e["restarts"].as_u64().map_or("-".into(), |n| n.to_string()),
                prefix_cell(e),
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
            "UNTIL",
            "IN-FLIGHT",
            "QUEUED",
            "RESTARTS",
            "PREFIX HITS",
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

/// The median: the middle value, or the mean of the two middle ones for an even count.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// One timed bench run: the prompt cold (a new prefix the prompt cache cannot have), then the
/// same prompt again (its prefix cached by the first).
#[derive(Debug, Clone)]
pub struct BenchRun {
    pub cold: Streamed,
    pub cached: Streamed,
}

/// `mlxd bench`: a line per request (cache state, prompt and cached tokens, time to first
/// token, prefill and decode rates) and the medians of each state.
pub fn bench_table(runs: &[BenchRun]) -> String {
    let ms = |d: Option<f64>| d.map_or("-".into(), |d| format!("{:.0}", d * 1e3));
    let rate = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.1}"));
    let count = |n: Option<u64>| n.map_or("-".into(), |n| n.to_string());
    // A median of counts is a count, or half-way between two.
    let counts = |v: Option<f64>| {
        v.map_or("-".into(), |v| {
            if v.fract() == 0.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        })
    };
    let row = |run: String, state: &str, r: &Streamed| {
        vec![
            run,
            state.to_string(),
            count(r.prompt_tokens),
            count(r.cached_tokens),
            ms(r.first_token.map(|d| d.as_secs_f64())),
            rate(r.prefill_rate()),
            count(r.completion_tokens),
            rate(r.decode_rate()),
            ms(Some(r.elapsed.as_secs_f64())),
        ]
    };
    let mut rows = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        rows.push(row((i + 1).to_string(), "cold", &r.cold));
        rows.push(row((i + 1).to_string(), "cached", &r.cached));
    }
    for (state, pick) in [
        (
            "cold",
            (|r: &BenchRun| &r.cold) as fn(&BenchRun) -> &Streamed,
        ),
        ("cached", |r: &BenchRun| &r.cached),
    ] {
        let all: Vec<&Streamed> = runs.iter().map(pick).collect();
        let of = |f: &dyn Fn(&Streamed) -> Option<f64>| {
            median(all.iter().filter_map(|r| f(r)).collect())
        };
        rows.push(vec![
            "median".into(),
            state.into(),
            counts(of(&|r| r.prompt_tokens.map(|n| n as f64))),
            counts(of(&|r| r.cached_tokens.map(|n| n as f64))),
            ms(of(&|r| r.first_token.map(|d| d.as_secs_f64()))),
            rate(of(&Streamed::prefill_rate)),
            counts(of(&|r| r.completion_tokens.map(|n| n as f64))),
            rate(of(&Streamed::decode_rate)),
            ms(of(&|r| Some(r.elapsed.as_secs_f64()))),
        ]);
    }
    table(
        &[
            "RUN",
            "CACHE",
            "PROMPT",
            "CACHED",
            "TTFT-MS",
            "PREFILL-TOK/S",
            "TOKENS",
            "DECODE-TOK/S",
            "TOTAL-MS",
        ],
        &rows,
    )
}

/// `mlxd ls`: every configured model, from `GET /engines` (and `/v1/models` for the
/// default marker).
pub fn ls_table(engines: &Value, models: &Value, verbose: bool) -> String {
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
            let state = state_cell(
                e["availability"].as_str().unwrap_or("?"),
                e["failure"].as_str(),
                verbose,
            );
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
        let spare = serde_json::json!({"state": "ready", "standby": {"state": "ready"}});
        assert_eq!(state_text(&spare), "ready +standby");
        let loading = serde_json::json!({"state": "ready", "standby": {"state": "starting"}});
        assert_eq!(state_text(&loading), "ready +standby starting");
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

    fn run(ttft: u64, total: u64, prompt: u64, cached: u64, n: u64) -> Streamed {
        Streamed {
            first_token: Some(Duration::from_millis(ttft)),
            elapsed: Duration::from_millis(total),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            completion_tokens: Some(n),
            finish_reason: Some("length".into()),
            ..Default::default()
        }
    }

    #[test]
    fn medians_are_real_medians() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(vec![1.0, 9.0]), Some(5.0));
    }

    #[test]
    fn bench_rows_and_medians() {
        let r = run(100, 1100, 41, 1, 11);
        assert_eq!(r.decode_rate(), Some(10.0));
        assert_eq!(r.prefill_rate(), Some(400.0));
        let runs = [
            BenchRun {
                cold: run(100, 1100, 41, 1, 11),
                cached: run(20, 1020, 41, 40, 11),
            },
            BenchRun {
                cold: run(300, 2300, 41, 1, 21),
                cached: run(40, 2040, 41, 40, 21),
            },
            BenchRun {
                cold: run(200, 700, 41, 1, 6),
                cached: run(10, 510, 41, 40, 6),
            },
        ];
        let t = bench_table(&runs);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 1 + 6 + 2, "{t}");
        assert_eq!(
            lines[0],
            "RUN     CACHE   PROMPT  CACHED  TTFT-MS  PREFILL-TOK/S  TOKENS  DECODE-TOK/S  TOTAL-MS"
        );
        let cells = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(
            cells(lines[1]),
            ["1", "cold", "41", "1", "100", "400.0", "11", "10.0", "1100"]
        );
        assert_eq!(
            cells(lines[2]),
            ["1", "cached", "41", "40", "20", "50.0", "11", "10.0", "1020"]
        );
        assert_eq!(
            cells(lines[7]),
            ["median", "cold", "41", "1", "200", "200.0", "11", "10.0", "1100"]
        );
        assert_eq!(
            cells(lines[8]),
            ["median", "cached", "41", "40", "20", "50.0", "11", "10.0", "1020"]
        );
    }

    #[test]
    fn hosts_with_and_without_ports() {
        let ok = |s: &str| split_host_port(s).unwrap();
        assert_eq!(ok("127.0.0.1:8096"), ("127.0.0.1".into(), Some(8096)));
        assert_eq!(ok("http://box.lan:9/"), ("box.lan".into(), Some(9)));
        assert_eq!(ok("box.lan"), ("box.lan".into(), None));
        assert_eq!(ok("::1"), ("::1".into(), None));
        assert_eq!(ok("[::1]"), ("[::1]".into(), None));
        assert_eq!(ok("[::1]:7"), ("[::1]".into(), Some(7)));
        assert!(split_host_port("h:x").unwrap_err().contains("\"x\""));
        assert!(split_host_port("[::1").is_err());
        assert!(split_host_port("h:99999").is_err());
    }

    #[test]
    fn servers_are_found_as_serve_finds_its_address() {
        let file = std::path::Path::new("/c/mlxd.toml");
        let r = |url, host, port, config| resolve_url(url, host, port, config).unwrap();
        assert_eq!(
            r(Some("http://h:1"), Some("x"), Some("2"), None),
            ("http://h:1".into(), "from --url or MLXD_URL".into())
        );
        assert_eq!(
            r(None, None, None, None),
            ("http://127.0.0.1:8080".into(), "the default address".into())
        );
        // The config file's port (issue 24: `port = 8096` was ignored).
        assert_eq!(
            r(None, None, None, Some((file, "0.0.0.0", 8096))),
            ("http://127.0.0.1:8096".into(), "from /c/mlxd.toml".into())
        );
        // MLXD_HOST with a port is a host and a port, not `[127.0.0.1:8096]:8080`.
        assert_eq!(
            r(None, Some("127.0.0.1:8096"), None, None),
            ("http://127.0.0.1:8096".into(), "from MLXD_HOST".into())
        );
        assert_eq!(
            r(
                None,
                Some("127.0.0.1:8096"),
                Some("9"),
                Some((file, "h", 1))
            ),
            (
                "http://127.0.0.1:9".into(),
                "from MLXD_HOST and MLXD_PORT".into()
            )
        );
        assert_eq!(
            r(None, Some("box.lan"), None, Some((file, "h", 7000))),
            (
                "http://box.lan:7000".into(),
                "from MLXD_HOST and /c/mlxd.toml".into()
            )
        );
        assert_eq!(r(None, Some("::"), None, None).0, "http://[::1]:8080");
        assert_eq!(r(None, Some("::1"), Some("1"), None).0, "http://[::1]:1");
        assert_eq!(
            r(Some(""), Some(""), Some(""), None).0,
            "http://127.0.0.1:8080"
        );
        assert!(resolve_url(None, None, Some("http"), None)
            .unwrap_err()
            .contains("MLXD_PORT"));
    }

    #[test]
    fn failure_reasons_are_short_in_tables() {
        assert_eq!(short_reason("boom"), "boom");
        let long = "x".repeat(200);
        let s = short_reason(&long);
        assert_eq!(s.chars().count(), SHORT_REASON);
        assert!(s.ends_with('…'));
        assert_eq!(short_reason("first line\nsecond"), "first line…");
        let json_line = r#"{"level":"ERROR","fields":{"message":"model not found"},"target":"x"}"#;
        assert_eq!(short_reason(json_line), "model not found");
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
            ps_table(&engines, false),
            "MODEL  PID  STATE         MEMORY   UPTIME  UNTIL  IN-FLIGHT  QUEUED  RESTARTS  PREFIX HITS  DEVICE\n\
             a      42   ready         3.0 GiB  1m15s   never  2          0       -         -            -\n\
             bb     -    failed: boom  0 B      -       -      0          0       -         -            -\n"
        );
        let cached = |prefix: Value| json!({"stats": {"prefix": prefix}});
        assert_eq!(
            prefix_cell(&cached(json!({"lookups": 40, "hits": 12, "evictions": 0}))),
            "12/40"
        );
        assert_eq!(
            prefix_cell(&cached(json!({"lookups": 40, "hits": 2, "evictions": 31}))),
            "2/40, 31 evicted"
        );
        let idle = json!({"engines": [
            {"model": "a", "pid": 1, "state": "ready", "ttl_s": 300.0, "idle_s": 10.2},
            {"model": "b", "pid": 2, "state": "ready", "ttl_s": 300.0, "idle_s": null},
        ]});
        let t = ps_table(&idle, false);
        assert!(t.lines().nth(1).unwrap().contains(" in 4m50s "), "{t}");
        assert!(t.lines().nth(2).unwrap().contains(" busy "), "{t}");
        let models = json!({"data": [{"id": "bb", "default": true}]});
        assert_eq!(
            ls_table(&engines, &models, false),
            "MODEL  STATE         FLAGS    ALIASES  SOURCE\n\
             a      loaded        pinned   x,y      /m/a\n\
             bb     failed: boom  default           bb\n"
        );
    }
}
