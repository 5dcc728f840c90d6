//! The chat page end to end: `mlxd` with the real engine and the default model, driven in
//! headless Chromium by `scripts/chat_page_test.cjs` (a question typed, the answer seen
//! streaming in, a screenshot saved to `target/chat-page.png`, the answer stopped). Chromium
//! and playwright-core come from `scripts/setup.sh --test`; without them this test fails
//! saying so.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use mlxd_proxy::config::ModelConfig;
use mlxd_tests::*;
use serde_json::json;

/// Headless Chromium and playwright-core, as `scripts/setup.sh --test` installs them, for
/// one browser test at a time.
struct Browser {
    node_modules: PathBuf,
    chromium: PathBuf,
    _turn: tokio::sync::MutexGuard<'static, ()>,
}

/// The browser tests take turns: on two cores, one test's Chromium and real engine slowed the
/// other's Chromium so much that its page first looked after the load it was to watch.
static BROWSER_TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Browser {
    /// Both, once no other browser test runs, or an error that says how to install what is
    /// missing.
    async fn find() -> Result<Self> {
        let node_modules = workspace_root().join(".deps/node/node_modules");
        ensure!(
            node_modules.join("playwright-core").is_dir(),
            "{} has no playwright-core: run scripts/setup.sh --test",
            node_modules.display()
        );
        let chromium = std::env::var_os("CHROMIUM")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
        ensure!(
            chromium.is_file(),
            "{} is absent: run scripts/setup.sh --test (it installs Debian's chromium) or set CHROMIUM",
            chromium.display()
        );
        Ok(Self {
            node_modules,
            chromium,
            _turn: BROWSER_TURN.lock().await,
        })
    }

    /// Runs `scripts/<script>` with `args` in node; its stdout when it succeeds, else an
    /// error with its output and `server_log()`.
    async fn run(
        &self,
        script: &str,
        args: &[&str],
        server_log: impl FnOnce() -> String,
    ) -> Result<String> {
        let mut cmd = Command::new("node");
        cmd.arg(workspace_root().join("scripts").join(script))
            .args(args)
            .env("NODE_PATH", &self.node_modules)
            .env("CHROMIUM", &self.chromium);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await?
            .context("running node (install Node.js 18 or newer)")?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{stdout}");
        ensure!(
            out.status.success(),
            "the browser test failed ({}):\n{stdout}\n{stderr}\nmlxd's log:\n{}",
            out.status,
            server_log()
        );
        Ok(stdout)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_page_streams_an_answer_in_headless_chromium() -> Result<()> {
    let root = workspace_root();
    let browser = Browser::find().await?;
    let engine = target_bin("mlxd-engine");
    ensure!(
        engine.is_file(),
        "{} is absent: run cargo build --workspace --bins",
        engine.display()
    );

    let mlxd = MlxdProcess::builder()
        .model("smollm2-135m")
        .engine(engine)
        .home(test_home())
        .env("MLXD_SMOLLM2_GGUF", smollm2_gguf()?)
        .ready_within(Duration::from_secs(30))
        .start()
        .await?;
    let addr = mlxd.addr;

    let shot = root.join("target/chat-page.png");
    let _ = std::fs::remove_file(&shot);
    let url = format!("http://{addr}/");
    let shot_arg = shot.display().to_string();
    let stdout = browser
        .run(
            "chat_page_test.cjs",
            &[&url, "smollm2-135m", &shot_arg],
            || mlxd.stderr(),
        )
        .await?;
    ensure!(stdout.contains("streamed answer"), "{stdout}");
    let png = std::fs::read(root.join("target/chat-page.png"))?;
    ensure!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
    Ok(())
}

/// While a model loads, the page says so with the load's phase and progress (the fake engine
/// here, preloaded by `mlxd serve`, holding its load at a quarter of the weights until the
/// page has shown it), and the notice clears once it is loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_page_shows_a_load_in_progress() -> Result<()> {
    let browser = Browser::find().await?;
    // The script opens the gate once it has seen the load: on a busy machine Chromium's
    // start alone outlasted a load of fixed length.
    let dir = tempfile::tempdir()?;
    let gate = dir.path().join("load-gate");
    let gate_opt = format!("load_gate={}", gate.display());
    let server = MlxdProcess::start(&[
        "--engine-opt",
        "ready_delay_ms=2000",
        "--engine-opt",
        &gate_opt,
    ])
    .await?;
    let url = format!("http://{}/", server.addr);
    let gate_arg = gate.display().to_string();
    let stdout = browser
        .run(
            "chat_page_loading_test.cjs",
            &[&url, "fake-model", &gate_arg],
            || server.stderr(),
        )
        .await?;
    ensure!(stdout.contains("reading weights"), "{stdout}");
    ensure!(gate.exists(), "the script never opened the load gate");
    Ok(())
}

/// What a person does with the page, against fake engines behind an in-process `mlxd`
/// (`scripts/chat_page_features_test.cjs`): the welcome and its example prompts, markdown
/// with a highlighted code block and its copy button, reasoning collapsed, a tool call, no
/// script injection from the model's output, settings checked and present in the request
/// body, conversations kept across a reload (rename, delete), regenerate, edit, stop (which
/// reaches the engine), and a failed model's reason in words. Screenshots are saved under
/// `target/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_page_features_in_headless_chromium() -> Result<()> {
    let browser = Browser::find().await?;
    let proxy = Proxy::start_with(&[("interval_ms", "20")], |c| {
        // One crash marks a model failed, so broken-model fails at once below.
        c.server.crash_limit = 1;
        let mut slow = ModelConfig::new("slow-model");
        slow.options.insert("chunks".into(), "3000".into());
        slow.options.insert("interval_ms".into(), "40".into());
        c.models.push(slow);
        c.models.push(ModelConfig::new("broken-model"));
    })
    .await?;
    // broken-model's engine is killed mid-request; its last log line is its JSON
    // "ready" line, the raw text the page must not show.
    let _ = proxy
        .post_json(
            "/v1/chat/completions",
            &json!({"model": "broken-model", "messages": [{"role": "user", "content": "hi"}],
                    "fake": {"then": "sigkill"}}),
        )
        .await?;
    let t = Instant::now();
    let failure = loop {
        let (_, _, v) = proxy.get("/v1/models").await?;
        let row = v["data"]
            .as_array()
            .and_then(|d| d.iter().find(|m| m["id"] == "broken-model").cloned())
            .context("broken-model is not listed")?;
        if row["state"] == "failed" {
            break row["failure"].as_str().unwrap_or_default().to_string();
        }
        ensure!(
            t.elapsed() < Duration::from_secs(30),
            "broken-model never failed: {row}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("broken-model's failure as mlxd reports it: {failure}");

    let shots = workspace_root().join("target");
    let url = format!("http://{}/", proxy.addr);
    let events = proxy.events_file();
    let stdout = browser
        .run(
            "chat_page_features_test.cjs",
            &[&url, &shots.display().to_string()],
            || std::fs::read_to_string(&events).unwrap_or_default(),
        )
        .await?;
    ensure!(stdout.contains("chat page features:"), "{stdout}");
    // Stop reached the engine: it saw its client go away mid-answer.
    wait_event(&events, "cancelled", Duration::from_secs(10)).await?;
    for name in [
        "chat-page-markdown.png",
        "chat-page-settings.png",
        "chat-page-failed.png",
    ] {
        let png = std::fs::read(shots.join(name)).with_context(|| name.to_string())?;
        ensure!(png.starts_with(b"\x89PNG"), "{name} is not a PNG");
    }
    Ok(())
}
