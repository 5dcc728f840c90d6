//! `SIGHUP` reloads the configuration of a running `mlxd` process (serving the fake engine):
//! an added model appears in `/v1/models`, a removed one drains (its in-flight stream
//! finishes) and disappears, a changed one takes its new options at its next load, and a
//! file that does not parse is refused with the reason while the running configuration stays.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use mlxd_tests::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

fn hup(p: &MlxdProcess) -> Result<()> {
    kill(Pid::from_raw(p.child.id() as i32), Signal::SIGHUP)?;
    Ok(())
}

async fn get(p: &MlxdProcess, path: &str) -> Result<Value> {
    let (status, _, v) = json_of(send(p.addr, "GET", path, None).await?).await?;
    ensure!(status.is_success(), "GET {path}: {status} {v}");
    Ok(v)
}

fn model_ids(models: &Value) -> Vec<String> {
    models["data"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(|m| m["id"].as_str().map(String::from))
        .collect()
}

fn engine_row(engines: &Value, id: &str) -> Option<Value> {
    engines["engines"]
        .as_array()?
        .iter()
        .find(|e| e["model"] == id)
        .cloned()
}

/// Polls `path` until `pred` holds (generous: a loaded 2-core machine).
async fn wait_for(
    p: &MlxdProcess,
    path: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = get(p, path).await?;
        if pred(&v) {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!(
                "{what} never happened; {path} says {v}\nmlxd's log:\n{}",
                p.stderr()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_log(p: &MlxdProcess, needle: &str, after: usize) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = p.stderr();
        if let Some(i) = log.get(after..).and_then(|rest| rest.find(needle)) {
            return Ok(log[after + i..]
                .lines()
                .next()
                .unwrap_or_default()
                .to_string());
        }
        if Instant::now() > deadline {
            bail!("no {needle:?} in mlxd's log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn chat(p: &MlxdProcess, model: &str) -> Result<(hyper::StatusCode, Value)> {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, v) = post_json(p.addr, "/v1/chat/completions", &body).await?;
    Ok((status, v))
}

fn write(path: &Path, text: &str) -> Result<()> {
    // Written whole and renamed, as editors do, so mlxd never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_adds_drains_changes_and_refuses_a_broken_file() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("mlxd.toml");
    write(&config, "[[model]]\nid = \"first\"\n")?;
    let p = MlxdProcess::start(&["--config", config.to_str().unwrap()]).await?;
    let models = get(&p, "/v1/models").await?;
    assert_eq!(model_ids(&models), ["fake-model", "first"]);

    // A stream on `first` that runs for about two seconds.
    let body = json!({"model": "first", "stream": true,
        "messages": [{"role": "user", "content": "x"}],
        "fake": {"chunks": 40, "interval_ms": 50}});
    let stream = send(
        p.addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().into()),
    )
    .await?;
    ensure!(stream.status().is_success(), "{}", stream.status());
    let reading = tokio::spawn(read_events(stream));
    wait_for(&p, "/engines", "first busy", |e| {
        engine_row(e, "first").is_some_and(|r| r["in_flight"] == 1)
    })
    .await?;

    // Remove `first`, add `second` with an option the fake engine reports back.
    write(
        &config,
        "[[model]]\nid = \"second\"\noptions = { weight_bytes = \"4242\" }\n",
    )?;
    hup(&p)?;
    let models = wait_for(&p, "/v1/models", "second listed", |m| {
        model_ids(m).contains(&"second".to_string())
    })
    .await?;
    assert_eq!(model_ids(&models), ["fake-model", "second"]);
    // `first` drains out of sight of /v1/models while its stream runs.
    let engines = get(&p, "/engines").await?;
    let first = engine_row(&engines, "first").expect("first still draining");
    assert_eq!(first["configured"], false, "{first}");
    assert_eq!(first["state"], "draining", "{first}");
    let (status, v) = chat(&p, "first").await?;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");

    // The stream finishes whole, then `first` is gone.
    let events = reading.await??;
    let chunks = events.iter().filter(|(_, e)| e.contains("tok")).count();
    assert_eq!(chunks, 40, "{events:?}");
    assert!(events.last().is_some_and(|(_, e)| e.contains("[DONE]")));
    wait_for(&p, "/engines", "first gone", |e| {
        engine_row(e, "first").is_none()
    })
    .await?;

    // `second` serves, with its options.
    let (status, v) = chat(&p, "second").await?;
    assert_eq!(status, 200, "{v}");
    let row = engine_row(&get(&p, "/engines").await?, "second").unwrap();
    assert_eq!(row["ready"]["weight_bytes"], 4242, "{row}");

    // Changed options apply at the next load, not to the running engine.
    write(
        &config,
        "[[model]]\nid = \"second\"\noptions = { weight_bytes = \"777\" }\n",
    )?;
    let mark = p.stderr().len();
    hup(&p)?;
    let line = wait_log(&p, "configuration reloaded", mark).await?;
    assert!(line.contains("second (options)"), "{line}");
    let row = engine_row(&get(&p, "/engines").await?, "second").unwrap();
    assert_eq!(row["ready"]["weight_bytes"], 4242, "{row}");
    let (status, _, v) =
        json_of(send(p.addr, "POST", "/admin/models/second/unload", None).await?).await?;
    assert_eq!(status, 200, "{v}");
    let (status, v) = chat(&p, "second").await?;
    assert_eq!(status, 200, "{v}");
    let row = engine_row(&get(&p, "/engines").await?, "second").unwrap();
    assert_eq!(row["ready"]["weight_bytes"], 777, "{row}");

    // A file that does not parse is refused with its line; nothing changes.
    write(
        &config,
        "[[model]]\nid = \"third\"\nttl = \"5 fortnights\"\n",
    )?;
    let mark = p.stderr().len();
    hup(&p)?;
    let line = wait_log(&p, "configuration reload refused", mark).await?;
    assert!(
        line.contains("mlxd.toml:3:") && line.contains("model[0].ttl"),
        "{line}"
    );
    let models = get(&p, "/v1/models").await?;
    assert_eq!(model_ids(&models), ["fake-model", "second"]);
    let (status, v) = chat(&p, "second").await?;
    assert_eq!(status, 200, "{v}");
    Ok(())
}

/// `status` of `path` with `key` as the bearer key.
async fn status_with_key(p: &MlxdProcess, path: &str, key: &str) -> Result<u16> {
    let auth = format!("Bearer {key}");
    let resp = send_with(p.addr, "GET", path, &[("authorization", &auth)], None).await?;
    Ok(resp.status().as_u16())
}

/// Issue 23, finding 11: a key removed from the key file (or the configuration) stopped
/// working only at the next restart. `SIGHUP` reads the keys again: a rotated key is refused
/// from the reload on, the new one works, and a key file that cannot be read refuses the
/// reload (the running keys stay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_revokes_rotated_api_keys() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    let config = dir.path().join("mlxd.toml");
    write(&keys, "old-key\n")?;
    write(&config, "[server]\nadmin_api_key = \"old-admin\"\n")?;
    let p = MlxdProcess::start(&[
        "--config",
        config.to_str().unwrap(),
        "--api-key-file",
        keys.to_str().unwrap(),
    ])
    .await?;
    assert_eq!(status_with_key(&p, "/v1/models", "old-key").await?, 200);
    assert_eq!(status_with_key(&p, "/v1/models", "new-key").await?, 401);

    write(&keys, "new-key\n")?;
    write(&config, "[server]\nadmin_api_key = \"new-admin\"\n")?;
    let mark = p.stderr().len();
    hup(&p)?;
    wait_log(&p, "configuration reloaded", mark).await?;
    assert_eq!(
        status_with_key(&p, "/v1/models", "old-key").await?,
        401,
        "{}",
        p.stderr()
    );
    assert_eq!(status_with_key(&p, "/v1/models", "new-key").await?, 200);
    assert_eq!(status_with_key(&p, "/v1/models", "old-admin").await?, 401);
    assert_eq!(status_with_key(&p, "/v1/models", "new-admin").await?, 200);

    // An unreadable key file: the reload is refused and the running keys stay.
    std::fs::remove_file(&keys)?;
    let mark = p.stderr().len();
    hup(&p)?;
    let line = wait_log(&p, "configuration reload refused", mark).await?;
    assert!(line.contains("api_key_file"), "{line}");
    assert_eq!(status_with_key(&p, "/v1/models", "new-key").await?, 200);
    Ok(())
}

/// Issue 23, finding 4: a memory budget smaller than a model was served at start (and then
/// refused at every request after an unload) and taken by `SIGHUP` as `changed=[]`. Both
/// refuse it, naming the model, its size and the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_larger_than_the_memory_budget_is_refused_at_start_and_reload() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("mlxd.toml");
    let too_small =
        "[pool]\nmemory_budget = \"1GiB\"\n[[model]]\nid = \"big\"\nmemory = \"2GiB\"\n";
    write(&config, too_small)?;
    let out = std::process::Command::new(mlxd_bin()?)
        .args(["serve", "--port", "0", "--config", config.to_str().unwrap()])
        .arg("--engine-bin")
        .arg(fake_engine())
        .env("XDG_RUNTIME_DIR", dir.path())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("model big needs 2147483648 bytes")
            && stderr.contains("memory budget of 1073741824 bytes"),
        "{stderr}"
    );

    write(
        &config,
        "[pool]\nmemory_budget = \"4GiB\"\n[[model]]\nid = \"big\"\nmemory = \"2GiB\"\n",
    )?;
    let p = MlxdProcess::start(&["--config", config.to_str().unwrap()]).await?;
    write(&config, too_small)?;
    let mark = p.stderr().len();
    hup(&p)?;
    let line = wait_log(&p, "configuration reload refused", mark).await?;
    assert!(line.contains("model big needs 2147483648 bytes"), "{line}");
    let (status, v) = chat(&p, "big").await?;
    assert_eq!(status, 200, "the running configuration serves on: {v}");
    Ok(())
}
