//! The Ollama routes (`/api/*`) through the proxy with the fake engine: NDJSON lines as
//! the engine streams, the folded answer, errors in Ollama's shape, cancellation and
//! `keep_alive: 0`. (The official `ollama` package against the real engine is
//! `scripts/conformance/sdk_ollama.py`.)

use super::*;

/// The NDJSON objects of a whole response body.
async fn ndjson(resp: hyper::Response<hyper::body::Incoming>) -> Result<Vec<Value>> {
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await?
        .to_bytes();
    body.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| Ok(serde_json::from_slice(l)?))
        .collect()
}

#[tokio::test]
async fn ollama_chat_streams_ndjson_and_generate_folds_it() -> Result<()> {
    let mut p = Proxy::start(&[("chunks", "3")]).await?;
    let body =
        json!({"model": "fake-model:latest", "messages": [{"role": "user", "content": "hi"}]});
    let resp = send(p.addr, "POST", "/api/chat", Some(body.to_string().into())).await?;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let lines = ndjson(resp).await?;
    assert_eq!(lines.len(), 4, "{lines:?}");
    for (i, l) in lines[..3].iter().enumerate() {
        assert_eq!(l["model"], "fake-model");
        assert_eq!(l["message"]["role"], "assistant");
        assert_eq!(l["message"]["content"], format!("tok{i} "));
        assert_eq!(l["done"], false);
    }
    let done = &lines[3];
    assert_eq!(done["done"], true);
    assert_eq!(done["done_reason"], "stop");
    assert_eq!(done["message"]["content"], "");
    assert!(done["total_duration"].as_u64().unwrap() > 0, "{done}");
    for k in [
        "load_duration",
        "prompt_eval_duration",
        "eval_duration",
        "eval_count",
    ] {
        assert!(done[k].is_u64(), "{k}: {done}");
    }

    let (s, h, v) = p
        .post_json(
            "/api/generate",
            &json!({"model": "fake-model", "prompt": "x", "stream": false}),
        )
        .await?;
    assert_eq!(s, 200);
    assert!(h["content-type"].to_str()?.starts_with("application/json"));
    assert_eq!(v["response"], "tok0 tok1 tok2 ");
    assert_eq!(v["done"], true);

    let (s, _, v) = p.get("/api/ps").await?;
    assert_eq!(s, 200);
    assert_eq!(v["models"][0]["name"], "fake-model");
    assert!(v["models"][0]["expires_at"].is_string(), "{v}");
    let (s, _, v) = p.get("/api/tags").await?;
    assert_eq!(s, 200);
    assert_eq!(v["models"][0]["model"], "fake-model");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn ollama_errors_are_in_ollamas_shape() -> Result<()> {
    let mut p = Proxy::start(&[]).await?;
    let only_error = |v: &Value| {
        v.as_object()
            .is_some_and(|o| o.len() == 1 && o["error"].is_string())
    };
    for (path, body, status, needle) in [
        (
            "/api/chat",
            json!({"model": "nope", "messages": []}),
            404,
            "not found",
        ),
        (
            "/api/chat",
            json!({"messages": []}),
            400,
            "model is required",
        ),
        (
            "/api/chat",
            json!({"model": "fake-model", "messages": [], "options": {"top_k": "many"}}),
            400,
            "top_k",
        ),
        (
            "/api/generate",
            json!({"model": "fake-model", "prompt": "x", "format": "yaml"}),
            400,
            "invalid format",
        ),
        (
            "/api/embed",
            json!({"model": "fake-model", "input": "x"}),
            501,
            "embeddings",
        ),
        (
            "/api/embeddings",
            json!({"model": "fake-model", "prompt": "x"}),
            501,
            "embeddings",
        ),
        ("/api/create", json!({"model": "x"}), 501, "not supported"),
    ] {
        let (s, _, v) = p.post_json(path, &body).await?;
        assert_eq!(s.as_u16(), status, "{path} {body}: {v}");
        assert!(only_error(&v), "{v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{v}");
    }
    let (s, _, v) = p.get("/api/nothing").await?;
    assert_eq!(s, 404);
    assert!(only_error(&v), "{v}");
    // Nothing above reached an engine.
    assert_eq!(p.engine().await?["state"], "idle");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn ollama_client_disconnect_cancels_the_generation() -> Result<()> {
    let mut p = Proxy::start(&[("chunks", "100"), ("interval_ms", "50")]).await?;
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]});
    let resp = send(p.addr, "POST", "/api/chat", Some(body.to_string().into())).await?;
    assert_eq!(resp.status(), 200);
    let mut b = resp.into_body();
    let first = http_body_util::BodyExt::frame(&mut b).await.unwrap()?;
    assert!(first.data_ref().is_some());
    drop(b); // closes the client connection
    let line = wait_event(&p.events_file(), " req", Duration::from_secs(5)).await?;
    assert!(line.contains("cancelled req"), "{line}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn ollama_keep_alive_0_unloads() -> Result<()> {
    let mut p = Proxy::start(&[("chunks", "2")]).await?;
    // A generation with keep_alive 0: the engine goes once the answer is sent.
    let (s, _, v) = p
        .post_json(
            "/api/generate",
            &json!({"model": "fake-model", "prompt": "x", "stream": false, "keep_alive": "0s"}),
        )
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["response"], "tok0 tok1 ");
    p.wait_engine("unloaded", T, |e| e["pid"].is_null()).await?;
    // Loading without a prompt, then unloading with keep_alive 0 and no prompt.
    let (s, _, v) = p
        .post_json("/api/chat", &json!({"model": "fake-model", "messages": []}))
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["done_reason"], "load");
    assert_eq!(p.engine().await?["state"], "ready");
    let (s, _, v) = p
        .post_json(
            "/api/generate",
            &json!({"model": "fake-model", "keep_alive": 0}),
        )
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["done_reason"], "unload");
    assert!(p.engine().await?["pid"].is_null());
    let (_, _, v) = p.get("/api/ps").await?;
    assert_eq!(v["models"], json!([]));
    let (s, _, v) = p
        .post_json(
            "/api/chat",
            &json!({"model": "fake-model", "keep_alive": "soon"}),
        )
        .await?;
    assert_eq!(s, 400);
    assert!(v["error"].as_str().unwrap().contains("keep_alive"), "{v}");
    p.stop().await?;
    Ok(())
}

/// The year of an RFC 3339 timestamp, and its seconds from now (UTC, whole seconds).
fn expires_in(ts: &str) -> (i64, f64) {
    let year: i64 = ts[..4].parse().unwrap();
    if year > 2100 {
        return (year, f64::INFINITY);
    }
    let date = |s: &str| -> f64 {
        let (y, mo, d): (i64, i64, i64) = (
            s[..4].parse().unwrap(),
            s[5..7].parse().unwrap(),
            s[8..10].parse().unwrap(),
        );
        // Days from the civil date (Howard Hinnant's days_from_civil).
        let y = if mo <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * (if mo > 2 { mo - 3 } else { mo + 9 }) + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        let days = era * 146_097 + doe - 719_468;
        let secs: f64 = s[11..13].parse::<f64>().unwrap() * 3600.0
            + s[14..16].parse::<f64>().unwrap() * 60.0
            + s[17..s.len() - 1].parse::<f64>().unwrap();
        days as f64 * 86_400.0 + secs
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    (year, date(ts) - now)
}

#[tokio::test]
async fn ollama_keep_alive_sets_how_long_the_model_stays_loaded() -> Result<()> {
    let mut p = Proxy::start(&[("chunks", "2")]).await?;
    // The configured TTL (5 min) until a request says otherwise.
    let load = |keep: Value| json!({"model": "fake-model", "messages": [], "keep_alive": keep});
    let (s, _, v) = p.post_json("/api/chat", &load(json!("1h"))).await?;
    assert_eq!(
        (s.as_u16(), v["done_reason"].as_str()),
        (200, Some("load")),
        "{v}"
    );
    let e = p.engine().await?;
    assert_eq!(
        (e["ttl_s"].as_f64(), &e["ttl_from_request"]),
        (Some(3600.0), &json!(true)),
        "{e}"
    );
    let (_, _, ps) = p.get("/api/ps").await?;
    let (_, left) = expires_in(ps["models"][0]["expires_at"].as_str().unwrap());
    assert!(
        (3590.0..=3601.0).contains(&left),
        "expires in {left} s: {ps}"
    );

    // A later request without keep_alive leaves it (as Ollama's runner keeps its duration).
    let (s, _, v) = p
        .post_json(
            "/api/generate",
            &json!({"model": "fake-model", "prompt": "x", "stream": false}),
        )
        .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(p.engine().await?["ttl_s"], 3600.0);

    // Negative: never unloaded for idleness; /api/ps says so the way Ollama does.
    let (s, _, _) = p
        .post_json(
            "/api/generate",
            &json!({"model": "fake-model", "prompt": "x", "stream": false, "keep_alive": -1}),
        )
        .await?;
    assert_eq!(s, 200);
    assert!(p.engine().await?["ttl_s"].is_null());
    let (_, _, ps) = p.get("/api/ps").await?;
    let (year, _) = expires_in(ps["models"][0]["expires_at"].as_str().unwrap());
    assert!(year > 2200, "{ps}");

    // A short one (seconds as a number) unloads the idle model when it runs out.
    let t0 = Instant::now();
    let (s, _, _) = p.post_json("/api/chat", &load(json!(1))).await?;
    assert_eq!(s, 200);
    p.wait_engine("unloaded by its keep_alive", T, |e| e["pid"].is_null())
        .await?;
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    // Unloaded: the next load takes the configured TTL again.
    let (s, _, _) = p
        .post_json("/api/chat", &json!({"model": "fake-model", "messages": []}))
        .await?;
    assert_eq!(s, 200);
    let e = p.engine().await?;
    assert_eq!(
        (e["ttl_s"].as_f64(), &e["ttl_from_request"]),
        (Some(300.0), &json!(false)),
        "{e}"
    );
    p.stop().await?;
    Ok(())
}
