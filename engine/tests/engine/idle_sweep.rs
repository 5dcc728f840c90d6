//! The idle sweep of decode row counts (`mlxd_engine::runtime::idle_sweep`; on CUDA by
//! default, forced here on the CPU): an engine sweeps every row count once it serves, a
//! request that arrives meanwhile is served, and greedy output does not depend on the sweep.
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::{tiny_model, EngineProcess};

const SWEPT: &str = "swept the decode row counts while idle";

/// Greedy token ids of one chat completion.
async fn greedy_ids(engine: &EngineProcess) -> Vec<u64> {
    let (status, body) = engine
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "count with me"}],
                   "max_tokens": 8, "temperature": 0}),
        )
        .await
        .expect("request");
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["mlxd"]["token_ids"]
        .as_array()
        .expect("token ids")
        .iter()
        .map(|v| v.as_u64().expect("an id"))
        .collect()
}

/// `line` without its terminal colours.
fn plain(line: &str) -> String {
    let mut out = String::new();
    let mut escape = false;
    for c in line.chars() {
        match (escape, c) {
            (false, '\x1b') => escape = true,
            (true, 'm') => escape = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_sweeps_its_row_counts_while_idle_and_serves_meanwhile() {
    let model = tiny_model("tiny-llama");
    let engine = EngineProcess::start_with(
        &model,
        &["--max-batch-size", "48"],
        &[("MLXD_IDLE_SWEEP", "1")],
    )
    .await
    .expect("the engine starts");
    // Sent at once: it arrives while the sweep runs (48 passes) or after it.
    let during = greedy_ids(&engine).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let line = loop {
        if let Some(line) = engine.stderr().lines().find(|l| l.contains(SWEPT)) {
            break line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "no sweep within 2 minutes; the log:\n{}",
            engine.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        plain(&line).contains("passes=48"),
        "one pass per row count from 48 down to 1: {line}"
    );
    assert_eq!(
        greedy_ids(&engine).await,
        during,
        "the sweep changes no output"
    );
}
