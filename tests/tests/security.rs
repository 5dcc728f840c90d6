//! Authentication, Host and Origin checks, against the real `mlxd` binary serving the
//! fake engine over loopback HTTP.

use anyhow::Result;
use bytes::Bytes;
use mlxd_tests::*;
use serde_json::{json, Value};

async fn req(
    m: &MlxdProcess,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> Result<(u16, hyper::HeaderMap, Value)> {
    let mut h: Vec<(&str, &str)> = headers.to_vec();
    if body.is_some() && !h.iter().any(|(k, _)| *k == "content-type") {
        h.push(("content-type", "application/json"));
    }
    let body = body.map(|b| Bytes::from(b.to_string()));
    let resp = send_with(m.addr, method, path, &h, body).await?;
    let (parts, body) = resp.into_parts();
    let bytes = http_body_util::BodyExt::collect(body).await?.to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((parts.status.as_u16(), parts.headers, v))
}

fn chat() -> Value {
    json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
}

#[tokio::test]
async fn api_keys_close_everything_but_health() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let key_file = dir.path().join("keys");
    std::fs::write(&key_file, "# team keys\nfile-key\n\n")?;
    let m = MlxdProcess::start(&[
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--api-key-file",
        key_file.to_str().unwrap(),
        "--admin-api-key",
        "adm",
    ])
    .await?;
    for path in ["/health", "/health/ready", "/health/live"] {
        assert_eq!(req(&m, "GET", path, &[], None).await?.0, 200, "{path}");
    }
    for path in ["/v1/models", "/metrics", "/engines", "/logs/fake-model"] {
        let (s, h, v) = req(&m, "GET", path, &[], None).await?;
        assert_eq!(s, 401, "{path}");
        assert_eq!(h["www-authenticate"], "Bearer");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let (s, _, v) = req(
        &m,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer nope")],
        Some(chat()),
    )
    .await?;
    assert_eq!(s, 401);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid"),
        "{v}"
    );
    // Anthropic's shape on /v1/messages.
    let (s, _, v) = req(
        &m,
        "POST",
        "/v1/messages",
        &[],
        Some(json!({"model": "fake-model"})),
    )
    .await?;
    assert_eq!(s, 401);
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "authentication_error");
    assert!(v["error"]["message"].is_string());

    for (h, v) in [
        ("authorization", "Bearer k1"),
        ("x-api-key", "k2"),
        ("authorization", "Bearer file-key"),
    ] {
        let (s, _, body) = req(&m, "POST", "/v1/chat/completions", &[(h, v)], Some(chat())).await?;
        assert_eq!(s, 200, "{h}: {v}: {body}");
    }
    assert_eq!(
        req(&m, "GET", "/metrics", &[("x-api-key", "k1")], None)
            .await?
            .0,
        200
    );
    // The engine never sees the client's key.
    let (s, _, v) = req(
        &m,
        "GET",
        "/v1/models/headers",
        &[("authorization", "Bearer k1")],
        None,
    )
    .await?;
    assert_eq!(s, 200);
    assert!(
        v.get("authorization").is_none() && v.get("x-api-key").is_none(),
        "{v}"
    );

    // Admin routes want the admin key.
    let (s, _, v) = req(
        &m,
        "POST",
        "/engines/reset",
        &[("authorization", "Bearer k1")],
        None,
    )
    .await?;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["error"]["code"], "admin_key_required");
    assert_eq!(
        req(&m, "POST", "/engines/reset", &[("x-api-key", "adm")], None)
            .await?
            .0,
        200
    );
    let (s, _, v) = req(
        &m,
        "POST",
        "/admin/models/fake-model/unload",
        &[("x-api-key", "adm")],
        None,
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    Ok(())
}

/// Issue 12, finding 2: a cross-origin form POST from a web page unloaded a model.
#[tokio::test]
async fn a_foreign_web_page_cannot_drive_a_loopback_server() -> Result<()> {
    let m = MlxdProcess::start(&["--allowed-origin", "http://localhost:3000"]).await?;
    let form = [
        ("origin", "http://evil.example"),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let resp = send_with(
        m.addr,
        "POST",
        "/admin/models/fake-model/unload",
        &form,
        Some(Bytes::from_static(b"a=b")),
    )
    .await?;
    let (s, _, v) = json_of(resp).await?;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["error"]["code"], "origin_not_allowed");
    let (s, _, v) = req(
        &m,
        "POST",
        "/v1/chat/completions",
        &[("origin", "http://evil.example")],
        Some(chat()),
    )
    .await?;
    assert_eq!(s, 403, "{v}");
    // DNS rebinding: a foreign name that resolves to 127.0.0.1.
    let (s, _, v) = req(
        &m,
        "GET",
        "/v1/models",
        &[("host", "evil.example:8080")],
        None,
    )
    .await?;
    assert_eq!(s, 403, "{v}");
    assert_eq!(v["error"]["code"], "host_not_allowed");
    assert_eq!(
        req(&m, "GET", "/v1/models", &[("host", "localhost")], None)
            .await?
            .0,
        200
    );

    // An allowed origin: the preflight is answered, and the response carries CORS headers.
    let (s, h, _) = req(
        &m,
        "OPTIONS",
        "/v1/chat/completions",
        &[
            ("origin", "http://localhost:3000"),
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "content-type, authorization",
            ),
        ],
        None,
    )
    .await?;
    assert_eq!(s, 204);
    assert_eq!(h["access-control-allow-origin"], "http://localhost:3000");
    assert!(h["access-control-allow-headers"]
        .to_str()?
        .contains("authorization"));
    let (s, h, v) = req(
        &m,
        "POST",
        "/v1/chat/completions",
        &[("origin", "http://localhost:3000")],
        Some(chat()),
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(h["access-control-allow-origin"], "http://localhost:3000");
    let (s, _, _) = req(
        &m,
        "OPTIONS",
        "/v1/chat/completions",
        &[("origin", "http://evil.example")],
        None,
    )
    .await?;
    assert_eq!(s, 403);
    Ok(())
}

#[tokio::test]
async fn binding_beyond_loopback_without_keys_warns() -> Result<()> {
    let m = MlxdProcess::start(&["--host", "0.0.0.0"]).await?;
    assert!(m.stderr().contains("WITHOUT an API key"), "{}", m.stderr());
    drop(m);
    let m = MlxdProcess::start(&["--host", "0.0.0.0", "--api-key", "k"]).await?;
    assert!(!m.stderr().contains("WITHOUT an API key"), "{}", m.stderr());
    Ok(())
}

#[test]
fn a_missing_key_file_exits_64() -> Result<()> {
    let out = std::process::Command::new(mlxd_bin()?)
        .args(["--api-key-file", "/nonexistent/keys"])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.api_key_file"));
    Ok(())
}

/// Issue 23, finding 2: with keys set, `/health/x` was forwarded to the default engine, so an
/// anonymous caller could load (and, at `max_engines`, evict) models. The open paths are
/// exactly the health endpoints; anything else under `/health` is a 404 that wakes nothing.
#[tokio::test]
async fn anonymous_paths_under_health_never_reach_an_engine() -> Result<()> {
    let m = MlxdProcess::start(&["--api-key", "k1"]).await?;
    // `mlxd serve` loads the default model at start: once it has, unload it, to see whether
    // anything below loads it again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (_, _, v) = req(&m, "GET", "/engines", &[("x-api-key", "k1")], None).await?;
        if v["engines"][0]["state"] == "ready" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never loaded: {v}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let (s, _, v) = req(
        &m,
        "POST",
        "/admin/models/fake-model/unload",
        &[("x-api-key", "k1")],
        None,
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    let (_, _, before) = req(&m, "GET", "/engines", &[("x-api-key", "k1")], None).await?;
    assert!(before["engines"][0]["pid"].is_null(), "{before}");
    for (method, path) in [
        ("GET", "/health/x"),
        ("GET", "/health/live/"),
        ("GET", "/health/../v1/models"),
        ("POST", "/health/x"),
        ("GET", "/healthz"),
    ] {
        let (s, _, v) = req(&m, method, path, &[], None).await?;
        assert!(s == 404 || s == 401, "{method} {path}: {s} {v}");
        assert!(v["error"]["message"].is_string(), "{method} {path}: {v}");
    }
    // With the key, an unknown path is a 404 too, not a trip to the engine.
    let (s, _, v) = req(&m, "GET", "/health/x", &[("x-api-key", "k1")], None).await?;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    let (s, _, v) = req(&m, "GET", "/engines", &[("x-api-key", "k1")], None).await?;
    assert_eq!(s, 200, "{v}");
    let e = &v["engines"][0];
    assert!(e["pid"].is_null(), "nothing was loaded: {v}");
    assert_eq!(e["generation"], before["engines"][0]["generation"], "{v}");
    Ok(())
}
