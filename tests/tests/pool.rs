//! The model pool with real processes: several fake engines behind one proxy.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use mlxd_proxy::config::ModelConfig;
use mlxd_proxy::Config;
use mlxd_tests::*;
use serde_json::{json, Value};

const T: Duration = Duration::from_secs(10);

/// A model served by the fake engine with the given per-model options.
fn model(id: &str, options: &[(&str, &str)]) -> ModelConfig {
    let mut m = ModelConfig::new(id);
    for (k, v) in options {
        m.options.insert(k.to_string(), v.to_string());
    }
    m
}

async fn start(models: Vec<ModelConfig>, tweak: impl FnOnce(&mut Config)) -> Result<Proxy> {
    Proxy::start_with(&[], |c| {
        c.models = models;
        tweak(c);
    })
    .await
}

async fn complete(p: &Proxy, model: &str) -> Result<(u16, Value)> {
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"model": model, "prompt": "x"}))
        .await?;
    Ok((s.as_u16(), v))
}

/// The `/engines` row of `model`.
async fn row(p: &Proxy, model: &str) -> Result<Value> {
    let (_, _, v) = p.get("/engines").await?;
    v["engines"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["model"] == model).cloned())
        .ok_or_else(|| anyhow::anyhow!("no row for {model}: {v}"))
}

/// `model` → `state` from `/v1/models`.
async fn model_states(p: &Proxy) -> Result<Vec<(String, String)>> {
    let (_, _, v) = p.get("/v1/models").await?;
    Ok(v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["state"].as_str().unwrap().to_string(),
            )
        })
        .collect())
}

/// Waits until `model`'s `/engines` row says `state`. Every change of a model's state puts
/// a line in its log (engine starting, ready, unloading, exited), so the row is read again
/// on each line of `GET /logs/{model}?follow=1`, followed before the first read: no change
/// can slip between the read and the wait.
async fn wait_state(p: &Proxy, model: &str, state: &str, timeout: Duration) -> Result<Value> {
    let deadline = Instant::now() + timeout;
    let resp = send(p.addr, "GET", &format!("/logs/{model}?follow=1"), None).await?;
    let mut lines = resp.into_body();
    loop {
        let r = row(p, model).await?;
        if r["availability"] == state {
            return Ok(r);
        }
        match tokio::time::timeout_at(deadline.into(), http_body_util::BodyExt::frame(&mut lines))
            .await
        {
            Ok(Some(frame)) => {
                frame?;
            }
            Ok(None) => bail!("the log of {model} ended before it became {state}: {r}"),
            Err(_) => bail!("{model} never became {state}: {r}"),
        }
    }
}

fn count_lines(file: &Path, needle: &str) -> usize {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// A sample's value from a Prometheus text scrape.
fn metric(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .and_then(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(*v),
            prometheus_parse::Value::Histogram(b) => b.last().map(|h| h.count),
            prometheus_parse::Value::Summary(_) => None,
        })
}

async fn scrape(p: &Proxy) -> Result<prometheus_parse::Scrape> {
    let resp = send(p.addr, "GET", "/metrics", None).await?;
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await?
        .to_bytes();
    let text = String::from_utf8(body.to_vec())?;
    Ok(prometheus_parse::Scrape::parse(
        text.lines().map(|l| Ok(l.to_string())),
    )?)
}

#[tokio::test]
async fn alternating_models_under_one_engine_evict_each_time() -> Result<()> {
    let mut p = start(vec![model("a", &[]), model("b", &[])], |c| {
        c.pool.max_engines = 1;
    })
    .await?;
    for round in 0..3 {
        for m in ["a", "b"] {
            let (s, v) = complete(&p, m).await?;
            assert_eq!(s, 200, "{v}");
            assert_eq!(v["model"], m, "round {round}: answered by the wrong engine");
        }
    }
    let events = p.events_file();
    assert_eq!(count_lines(&events, "start model=a"), 3);
    assert_eq!(count_lines(&events, "start model=b"), 3);
    // Every switch drained the other engine, then stopped it.
    assert_eq!(count_lines(&events, " drain"), 5);
    assert_eq!(count_lines(&events, "shutdown requested"), 5);
    let m = scrape(&p).await?;
    let evicted = |model| {
        metric(
            &m,
            "mlxd_engine_evictions_total",
            &[("model", model), ("reason", "lru")],
        )
    };
    assert_eq!(evicted("a"), Some(3.0));
    assert_eq!(evicted("b"), Some(2.0));
    assert_eq!(
        metric(&m, "mlxd_engine_loads_total", &[("model", "a")]),
        Some(3.0)
    );
    // Only one engine at a time.
    let (_, _, e) = p.get("/engines").await?;
    let running = e["engines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["pid"].is_u64())
        .count();
    assert_eq!(running, 1);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn idle_engines_are_unloaded_after_the_ttl() -> Result<()> {
    let mut p = start(vec![model("a", &[]), model("b", &[])], |c| {
        c.pool.ttl = Duration::from_millis(1500);
        c.models[1].ttl = Some(Duration::ZERO);
    })
    .await?;
    assert_eq!(complete(&p, "b").await?.0, 200);
    // The TTL runs from a's last response: the clock starts just after it.
    assert_eq!(complete(&p, "a").await?.0, 200);
    let t = Instant::now();
    let pid = row(&p, "a").await?["pid"].as_i64().unwrap() as i32;
    wait_state(&p, "a", "unloaded", T).await?;
    assert!(
        t.elapsed() >= Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    wait_gone(pid, T).await?;
    // ttl = 0: never unloaded. b has been idle longer than a's TTL (its last request came
    // before a's), so with a TTL it would have gone first.
    assert_eq!(row(&p, "b").await?["availability"], "loaded");
    let m = scrape(&p).await?;
    assert_eq!(
        metric(
            &m,
            "mlxd_engine_evictions_total",
            &[("model", "a"), ("reason", "ttl")]
        ),
        Some(1.0)
    );
    // The next request loads it again.
    assert_eq!(complete(&p, "a").await?.0, 200);
    assert_eq!(count_lines(&p.events_file(), "start model=a"), 2);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_pinned_model_survives_the_churn() -> Result<()> {
    let mut pinned = model("pinned", &[]);
    pinned.pinned = true;
    let mut p = start(vec![pinned, model("a", &[]), model("b", &[])], |c| {
        c.pool.max_engines = 2;
        c.pool.ttl = Duration::from_millis(300);
    })
    .await?;
    // Loaded at start, without a request.
    let r = wait_state(&p, "pinned", "loaded", T).await?;
    let pid = r["pid"].as_i64().unwrap();
    for _ in 0..2 {
        for m in ["a", "b", "pinned"] {
            let (s, v) = complete(&p, m).await?;
            assert_eq!((s, v["model"].as_str()), (200, Some(m)));
        }
    }
    // b, used just before it, goes at its TTL; the pinned model, idle as long, stays.
    let t = Instant::now();
    wait_state(&p, "b", "unloaded", T).await?;
    assert!(
        t.elapsed() >= Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    let r = row(&p, "pinned").await?;
    assert_eq!(
        r["pid"].as_i64(),
        Some(pid),
        "the pinned engine was replaced"
    );
    assert_eq!(r["availability"], "loaded");
    assert_eq!(count_lines(&p.events_file(), "start model=pinned"), 1);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn ten_concurrent_requests_to_a_cold_model_spawn_one_engine() -> Result<()> {
    let mut p = start(vec![model("a", &[("ready_delay_ms", "400")])], |_| {}).await?;
    let addr = p.addr;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            tokio::spawn(async move {
                let body = json!({"model": "a", "prompt": format!("p{i}")}).to_string();
                json_of(send(addr, "POST", "/v1/completions", Some(body.into())).await?).await
            })
        })
        .collect();
    for t in tasks {
        let (s, _, v) = t.await??;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["model"], "a");
    }
    assert_eq!(count_lines(&p.events_file(), "start model=a"), 1);
    let m = scrape(&p).await?;
    assert_eq!(
        metric(&m, "mlxd_engine_loads_total", &[("model", "a")]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "mlxd_requests_total",
            &[("model", "a"), ("status", "200")]
        ),
        Some(10.0)
    );
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn memory_budget_refuses_with_numbers_and_evicts_by_reported_memory() -> Result<()> {
    // "big" has 2 GiB of weights on disk (a sparse file) against a 1 GiB budget.
    let weights = tempfile::tempdir()?;
    let big = weights.path().join("big");
    std::fs::create_dir(&big)?;
    std::fs::write(big.join("config.json"), "{}")?;
    std::fs::File::create(big.join("model.safetensors"))?.set_len(2 << 30)?;
    let mut big_model = model("big", &[]);
    big_model.path = Some(big.display().to_string());
    // "hungry" reports 900 MiB once running; "small" plans for 200 MiB.
    let hungry = model("hungry", &[("memory_bytes", "943718400")]);
    let mut small = model("small", &[("memory_bytes", "1000")]);
    small.memory = Some(200 << 20);
    let mut p = start(vec![big_model, hungry, small], |c| {
        c.pool.memory_budget = Some(1 << 30);
    })
    .await?;
    let (s, h, v) = p
        .post_json("/v1/completions", &json!({"model": "big", "prompt": "x"}))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert!(!h.contains_key("retry-after"), "waiting cannot help: {h:?}");
    assert_eq!(v["error"]["code"], "insufficient_memory");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("needs 2147483648 bytes") && msg.contains("only 1073741824 bytes"),
        "{msg}"
    );
    assert_eq!(count_lines(&p.events_file(), "start model=big"), 0);

    assert_eq!(complete(&p, "hungry").await?.0, 200);
    let deadline = Instant::now() + T;
    while row(&p, "hungry").await?["memory_bytes"] != 943718400u64 {
        if Instant::now() > deadline {
            bail!("no memory report: {}", row(&p, "hungry").await?);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 900 MiB + 200 MiB > 1 GiB: hungry (idle) goes so that small fits.
    assert_eq!(complete(&p, "small").await?.0, 200);
    assert_eq!(row(&p, "hungry").await?["availability"], "unloaded");
    let m = scrape(&p).await?;
    assert_eq!(
        metric(
            &m,
            "mlxd_engine_evictions_total",
            &[("model", "hungry"), ("reason", "lru")]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&m, "mlxd_memory_budget_bytes", &[]),
        Some((1u64 << 30) as f64)
    );
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_busy_engine_is_not_evicted_the_request_waits_for_it() -> Result<()> {
    let mut p = start(vec![model("a", &[]), model("b", &[])], |c| {
        c.pool.max_engines = 1;
    })
    .await?;
    // A stream on a, 2.4 s long.
    let body = json!({"model": "a", "stream": true, "prompt": "x", "fake": {"chunks": 6, "interval_ms": 400}});
    let resp = send(
        p.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().into()),
    )
    .await?;
    let reader = tokio::spawn(read_events(resp));
    let t = Instant::now();
    let (s, v) = complete(&p, "b").await?;
    assert_eq!((s, v["model"].as_str()), (200, Some("b")));
    assert!(
        t.elapsed() >= Duration::from_millis(1200),
        "{:?}",
        t.elapsed()
    );
    let events = reader.await??;
    assert_eq!(
        events.last().unwrap().1,
        "data: [DONE]\n\n",
        "stream cut: {events:?}"
    );
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn models_list_states_and_admin_load_unload() -> Result<()> {
    let mut broken = model("broken", &[("fatal_before_ready", "weights are corrupt")]);
    broken.aliases = vec!["kaput".into()];
    // Slow enough that `loading` is seen even on a loaded machine.
    let slow = model("slow", &[("ready_delay_ms", "4000")]);
    let mut p = start(vec![model("a", &[]), broken, slow], |c| {
        c.server.crash_limit = 1;
    })
    .await?;
    let all = |s: &str| {
        ["a", "broken", "slow"]
            .iter()
            .map(|m| (m.to_string(), s.to_string()))
            .collect::<Vec<_>>()
    };
    assert_eq!(model_states(&p).await?, all("unloaded"));

    let resp = send(p.addr, "POST", "/admin/models/a/load", None).await?;
    let (s, _, v) = json_of(resp).await?;
    assert_eq!(
        (s.as_u16(), v["state"].as_str()),
        (200, Some("loaded")),
        "{v}"
    );

    let (s, v) = complete(&p, "kaput").await?;
    assert_eq!(s, 503, "{v}");
    let load_slow = tokio::spawn({
        let addr = p.addr;
        async move { json_of(send(addr, "POST", "/admin/models/slow/load", None).await?).await }
    });
    wait_state(&p, "slow", "loading", T).await?;
    let (_, _, v) = p.get("/v1/models").await?;
    let by_id = |id: &str| {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .cloned()
            .unwrap()
    };
    assert_eq!(by_id("a")["state"], "loaded");
    assert_eq!(by_id("a")["default"], true);
    assert_eq!(by_id("broken")["state"], "failed");
    assert!(by_id("broken")["failure"]
        .as_str()
        .unwrap()
        .contains("weights are corrupt"));
    assert_eq!(by_id("broken")["aliases"], json!(["kaput"]));
    assert_eq!(by_id("slow")["state"], "loading");
    let (s, _, _) = load_slow.await??;
    assert_eq!(s, 200);

    let resp = send(p.addr, "POST", "/admin/models/a/unload", None).await?;
    let (s, _, v) = json_of(resp).await?;
    assert_eq!(
        (s.as_u16(), v["state"].as_str()),
        (200, Some("unloaded")),
        "{v}"
    );
    let (s, _, v) = json_of(send(p.addr, "POST", "/admin/models/nope/load", None).await?).await?;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn routing_by_alias_default_and_unknown_names() -> Result<()> {
    let mut a = model("a", &[]);
    a.aliases = vec!["gpt-4o".into()];
    let mut p = start(vec![a, model("b", &[])], |c| {
        c.pool.default_model = Some("b".into());
    })
    .await?;
    assert_eq!(complete(&p, "gpt-4o").await?.1["model"], "a");
    for body in [json!({"prompt": "x"}), json!({"model": "", "prompt": "x"})] {
        let (s, _, v) = p.post_json("/v1/completions", &body).await?;
        assert_eq!((s.as_u16(), v["model"].as_str()), (200, Some("b")));
    }
    let (s, v) = complete(&p, "llama-9000").await?;
    assert_eq!(s, 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(
        v["error"]["message"],
        "model \"llama-9000\" not found; available models: a, b"
    );
    p.stop().await?;

    let mut p = start(vec![model("a", &[]), model("b", &[])], |c| {
        c.pool.route_unknown_to_default = true;
    })
    .await?;
    assert_eq!(complete(&p, "llama-9000").await?.1["model"], "a");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn logs_recent_and_followed() -> Result<()> {
    let mut p = start(
        vec![model("a", &[]), model("b", &[("ready_delay_ms", "300")])],
        |_| {},
    )
    .await?;
    assert_eq!(complete(&p, "a").await?.0, 200);
    let resp = send(p.addr, "GET", "/logs/a", None).await?;
    assert_eq!(resp.status(), 200);
    let text = http_body_util::BodyExt::collect(resp.into_body())
        .await?
        .to_bytes();
    let text = String::from_utf8(text.to_vec())?;
    assert!(text.contains("[mlxd] engine starting"), "{text}");
    assert!(text.contains("fake engine ready"), "{text}");

    // Follow b before it starts; its start-up lines arrive as they happen.
    let resp = send(p.addr, "GET", "/logs/b?follow=1", None).await?;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let loader = tokio::spawn({
        let addr = p.addr;
        async move {
            let body = json!({"model": "b", "prompt": "x"}).to_string();
            json_of(send(addr, "POST", "/v1/completions", Some(body.into())).await?).await
        }
    });
    let mut seen = String::new();
    let deadline = Instant::now() + T;
    while !seen.contains("data: {\"level\":\"info\",\"msg\":\"fake engine ready\"}") {
        let frame =
            tokio::time::timeout_at(deadline.into(), http_body_util::BodyExt::frame(&mut body))
                .await?
                .unwrap()?;
        if let Some(d) = frame.data_ref() {
            seen.push_str(&String::from_utf8_lossy(d));
        }
    }
    assert!(seen.contains("data: [mlxd] engine starting"), "{seen}");
    assert_eq!(loader.await??.0, 200);
    let (s, _, _) = json_of(send(p.addr, "GET", "/logs/nope", None).await?).await?;
    assert_eq!(s, 404);
    drop(body);
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn metrics_parse_as_prometheus_text() -> Result<()> {
    let mut p = start(vec![model("a", &[]), model("b", &[])], |_| {}).await?;
    let (s, _, _) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "a", "messages": [], "fake": {"chunks": 5}}),
        )
        .await?;
    assert_eq!(s, 200);
    let body = json!({"model": "a", "stream": true, "prompt": "x", "fake": {"chunks": 4}});
    let resp = send(
        p.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().into()),
    )
    .await?;
    read_events(resp).await?;
    assert_eq!(complete(&p, "zzz").await?.0, 404);
    let deadline = Instant::now() + T;
    while row(&p, "a").await?["stats"].is_null() {
        if Instant::now() > deadline {
            bail!("no stats");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = scrape(&p).await?;
    let a = [("model", "a")];
    assert_eq!(
        metric(
            &m,
            "mlxd_requests_total",
            &[("model", "a"), ("status", "200")]
        ),
        Some(2.0)
    );
    // Usage from the JSON response (1 prompt + 5 completion), 4 counted stream chunks.
    assert_eq!(metric(&m, "mlxd_prompt_tokens_total", &a), Some(1.0));
    assert_eq!(metric(&m, "mlxd_completion_tokens_total", &a), Some(9.0));
    assert_eq!(
        metric(&m, "mlxd_time_to_first_token_seconds", &a),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "mlxd_request_duration_seconds_count", &a),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, "mlxd_engine_load_duration_seconds_count", &a),
        Some(1.0)
    );
    assert_eq!(metric(&m, "mlxd_engine_loads_total", &a), Some(1.0));
    assert_eq!(metric(&m, "mlxd_engine_loaded", &a), Some(1.0));
    assert_eq!(
        metric(&m, "mlxd_engine_loaded", &[("model", "b")]),
        Some(0.0)
    );
    assert_eq!(metric(&m, "mlxd_queue_depth", &a), Some(0.0));
    assert_eq!(metric(&m, "mlxd_requests_in_flight", &a), Some(0.0));
    assert_eq!(
        metric(&m, "mlxd_engine_memory_bytes", &a),
        Some(123456789.0)
    );
    assert!(m.docs.contains_key("mlxd_engine_evictions"));
    assert!(m.docs.contains_key("mlxd_engine_restarts"));
    p.stop().await?;
    Ok(())
}

fn run_mlxd(args: &[&str]) -> Result<std::process::Output> {
    Ok(std::process::Command::new(mlxd_bin()?)
        .args(args)
        .output()?)
}

#[tokio::test]
async fn mlxd_ps_and_ls_talk_to_a_running_server() -> Result<()> {
    let mut a = model("a", &[("memory_bytes", "2097152")]);
    a.aliases = vec!["alpha".into()];
    let mut p = start(vec![a, model("b", &[])], |c| {
        c.models[1].pinned = true;
    })
    .await?;
    assert_eq!(complete(&p, "a").await?.0, 200);
    wait_state(&p, "b", "loaded", T).await?;
    let deadline = Instant::now() + T;
    while row(&p, "a").await?["memory_bytes"] != 2097152 {
        if Instant::now() > deadline {
            bail!("no memory report");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("http://{}", p.addr);
    let out = tokio::task::spawn_blocking({
        let url = url.clone();
        move || run_mlxd(&["ps", "--url", &url])
    })
    .await??;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("MODEL"), "{text}");
    assert_eq!(lines.len(), 3, "{text}");
    let pid_a = row(&p, "a").await?["pid"].to_string();
    let a_line = lines.iter().find(|l| l.starts_with("a ")).unwrap();
    let cols: Vec<&str> = a_line.split_whitespace().collect();
    assert_eq!(
        &cols[..5],
        ["a", pid_a.as_str(), "ready", "2.0", "MiB"],
        "{text}"
    );

    let out = tokio::task::spawn_blocking(move || run_mlxd(&["ls", "--url", &url])).await??;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout)?;
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["a", "loaded", "default", "alpha", "a"]),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["b", "loaded", "pinned", "b"]),
        "{text}"
    );

    // Nothing listening: a clear error, non-zero exit.
    let out = run_mlxd(&["ps", "--url", "http://127.0.0.1:1"])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach mlxd"));
    p.stop().await?;
    Ok(())
}

#[test]
fn invalid_config_exits_64_naming_line_and_field() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("mlxd.toml");
    std::fs::write(
        &path,
        "[pool]\nmax_engines = 2\n\n[[model]]\nid = \"a\"\nttl = \"soon\"\n",
    )?;
    let out = run_mlxd(&["serve", "--config", path.to_str().unwrap()])?;
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mlxd.toml:6:") && err.contains("model[0].ttl"),
        "{err}"
    );

    std::fs::write(&path, "[[model]]\nid = \"a\"\n[[model]]\nid = \"a\"\n")?;
    let out = run_mlxd(&["--config", path.to_str().unwrap()])?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("duplicate model id"));
    Ok(())
}

/// Issue 12, finding 4: these used to panic (exit 101) or be clamped silently.
#[test]
fn out_of_range_durations_and_sizes_exit_64_naming_the_field() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("mlxd.toml");
    let cases = [
        ("[pool]\nttl = \"99999999999999999999h\"\n", "pool.ttl"),
        (
            "[pool]\ncapacity_wait = \"99999999999999999999h\"\n",
            "pool.capacity_wait",
        ),
        (
            "[pool]\nmemory_budget = \"99999999999999999999GiB\"\n",
            "pool.memory_budget",
        ),
        (
            "[[model]]\nid = \"a\"\nttl = \"99999999999999999999h\"\n",
            "model[0].ttl",
        ),
    ];
    for (text, field) in cases {
        std::fs::write(&path, text)?;
        let out = run_mlxd(&["--config", path.to_str().unwrap()])?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{text}: {err}");
        assert!(err.contains(field) && err.contains("out of range"), "{err}");
    }
    for (flag, value) in [
        ("--ttl", "99999999999999999999h"),
        ("--memory-budget", "99999999999999999999GiB"),
    ] {
        let out = run_mlxd(&[flag, value])?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{flag}: {err}");
        assert!(err.contains(flag) && err.contains("out of range"), "{err}");
    }
    Ok(())
}

#[tokio::test]
async fn models_dir_and_repo_ids_reach_the_engine_as_launch_model() -> Result<()> {
    let models = tempfile::tempdir()?;
    for name in ["tiny-one", "tiny-two"] {
        let d = models.path().join(name);
        std::fs::create_dir(&d)?;
        std::fs::write(d.join("config.json"), "{}")?;
    }
    std::fs::write(models.path().join("small.gguf"), b"GGUF")?;
    let mut hf = model("hf", &[]);
    hf.path = Some("HuggingFaceTB/SmolLM2-135M-Instruct".into());
    let dir = models.path().to_path_buf();
    let mut p = start(vec![hf], |c| c.pool.models_dir = Some(dir)).await?;
    let ids: Vec<String> = model_states(&p)
        .await?
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(ids, ["hf", "small", "tiny-one", "tiny-two"]);
    for id in ["hf", "tiny-two", "small"] {
        let (s, v) = complete(&p, id).await?;
        assert_eq!((s, v["model"].as_str()), (200, Some(id)));
    }
    let events = p.events_file();
    let source = |id: &str| {
        std::fs::read_to_string(&events)
            .unwrap_or_default()
            .lines()
            .find_map(|l| {
                l.split_once(&format!("start model={id} source="))
                    .map(|(_, s)| s.to_string())
            })
    };
    assert_eq!(
        source("hf").as_deref(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    let two = models.path().join("tiny-two").display().to_string();
    assert_eq!(source("tiny-two"), Some(two));
    let gguf = models.path().join("small.gguf").display().to_string();
    assert_eq!(source("small"), Some(gguf));
    p.stop().await?;
    Ok(())
}

/// A load the engine says cannot succeed (`Fatal(CannotLoad)`: a typo'd model name, a bad
/// path, a refused option, offline) fails once with the engine's explanation, and the
/// pool does not restart into the same error: one start, the model failed at once, later
/// requests answered from the failed state until an admin reset lets one try again.
#[tokio::test]
async fn a_load_that_cannot_succeed_fails_once_and_is_not_retried() -> Result<()> {
    let why = "\"smolm2-135m\" is not a known model; did you mean smollm2-135m?";
    let p = Proxy::start_with(&[("cannot_load", why)], |c| {
        c.server.failed_cooldown_ms = 120_000;
        for m in &mut c.models {
            // As `mlxd serve --model smolm2-135m` preloads it.
            m.pinned = true;
        }
    })
    .await?;
    let e = p
        .wait_engine("failed", T, |e| e["state"] == "failed")
        .await?;
    assert_eq!(e["generation"], 1, "restarted: {e}");
    assert_eq!(e["restarts"], 0, "{e}");
    assert_eq!(e["crashes_in_window"], 0, "{e}");
    assert_eq!(e["failure"], why, "{e}");
    assert_eq!(e["last_exit"]["code"], "load_failed", "{e}");
    for _ in 0..2 {
        let (s, h, v) = p
            .post_json("/v1/completions", &json!({"prompt": "x"}))
            .await?;
        assert_eq!(s, 503, "{v}");
        assert_eq!(v["error"]["code"], "load_failed", "{v}");
        assert_eq!(
            v["error"]["message"],
            format!("model fake-model cannot be loaded: {why}"),
            "{v}"
        );
        let retry: u64 = h["retry-after"].to_str()?.parse()?;
        assert!((100..=120).contains(&retry), "{h:?}");
    }
    assert_eq!(count_lines(&p.events_file(), " start model="), 1);
    assert_eq!(p.engine().await?["generation"], 1);

    // An admin reset lets the next request try again: one more start, the same answer.
    let (s, _, v) = send(p.addr, "POST", "/engines/reset", None)
        .await
        .map(json_of)?
        .await?;
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = p
        .post_json("/v1/completions", &json!({"prompt": "x"}))
        .await?;
    assert_eq!(s, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .ends_with("did you mean smollm2-135m?"),
        "{v}"
    );
    assert_eq!(p.engine().await?["generation"], 2);
    assert_eq!(count_lines(&p.events_file(), " start model="), 2);
    Ok(())
}

/// A prompt being prefilled shows in `/engines` (`stats.prefilling`, with its tokens left)
/// beside `active`, so a long prefill never reads as an idle engine.
#[tokio::test]
async fn engines_show_a_prompt_in_prefill() -> Result<()> {
    let mut p = start(vec![model("a", &[("stats_interval_ms", "20")])], |_| {}).await?;
    let body = json!({"model": "a", "prompt": "x",
        "fake": {"delay_ms": 60_000, "prompt_tokens": 2530}});
    let pending = tokio::spawn(send(
        p.addr,
        "POST",
        "/v1/completions",
        Some(body.to_string().into()),
    ));
    let deadline = Instant::now() + T;
    let stats = loop {
        let stats = row(&p, "a").await?["stats"].clone();
        if stats["prefilling"] == 1 {
            break stats;
        }
        if Instant::now() > deadline {
            bail!("no prefill in /engines: {stats}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(stats["prefill_tokens_left"], 2530, "{stats}");
    // The client leaves: the prefill is gone from the figures.
    pending.abort();
    let deadline = Instant::now() + T;
    while row(&p, "a").await?["stats"]["prefilling"] != 0 {
        if Instant::now() > deadline {
            bail!("the abandoned prefill is still reported");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(row(&p, "a").await?["stats"]["prefill_tokens_left"], 0);
    p.stop().await?;
    Ok(())
}
