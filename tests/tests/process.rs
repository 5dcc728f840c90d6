//! The `mlxd` binary as a process: signals, orphans, and the no-MLX guarantee.

use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use mlxd_tests::*;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// `mlxd serve` with the fake engine serving `tiny-model`.
async fn start() -> Result<MlxdProcess> {
    MlxdProcess::builder().model("tiny-model").start().await
}

/// Starts the engine with one request; returns its pid.
async fn engine_pid(m: &MlxdProcess) -> Result<i32> {
    let body = json!({"prompt": "x"}).to_string();
    let (s, _, _) =
        json_of(send(m.addr, "POST", "/v1/completions", Some(body.into())).await?).await?;
    assert_eq!(s, 200);
    let (_, _, v): (_, _, Value) = json_of(send(m.addr, "GET", "/engines", None).await?).await?;
    Ok(v["engines"][0]["pid"].as_i64().unwrap() as i32)
}

#[tokio::test]
async fn sigterm_and_sigint_stop_everything_and_exit_zero() -> Result<()> {
    for sig in [Signal::SIGTERM, Signal::SIGINT] {
        let mut m = start().await?;
        let pid = engine_pid(&m).await?;
        // A stream in flight when the signal arrives still completes.
        let body = json!({"stream": true, "prompt": "x", "fake": {"chunks": 5, "interval_ms": 60}})
            .to_string();
        let resp = send(m.addr, "POST", "/v1/completions", Some(body.into())).await?;
        let reader = tokio::spawn(read_events(resp));
        tokio::time::sleep(Duration::from_millis(50)).await;
        m.signal(sig)?;
        let events = reader.await??;
        assert_eq!(
            events.last().unwrap().1,
            "data: [DONE]\n\n",
            "{sig}: {events:?}"
        );
        let status = m.wait(Duration::from_secs(10)).await?;
        assert_eq!(status.code(), Some(0), "{sig}");
        let runtime_dir = m.dir.path().join(format!("mlxd-{}", m.child.id()));
        assert!(!runtime_dir.exists(), "runtime dir left behind");
        wait_gone(pid, Duration::from_secs(1)).await?;
        // New connections are refused once it is down.
        assert!(send(m.addr, "GET", "/health", None).await.is_err());
        let log = std::fs::read_to_string(&m.log)?;
        // The engine's stderr was re-emitted, tagged with the model.
        assert!(
            log.lines()
                .any(|l| l.contains("fake engine ready") && l.contains("model=tiny-model")),
            "{log}"
        );
        assert!(log.contains("engine stopped"), "{log}");
    }
    Ok(())
}

#[tokio::test]
async fn engines_die_within_a_second_of_mlxd_being_sigkilled() -> Result<()> {
    let mut m = start().await?;
    let pid = engine_pid(&m).await?;
    m.signal(Signal::SIGKILL)?;
    m.wait(Duration::from_secs(5)).await?;
    let took = wait_gone(pid, Duration::from_secs(1)).await?;
    assert!(took < Duration::from_secs(1));
    Ok(())
}

#[test]
fn proxy_does_not_depend_on_or_load_mlx() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "-p",
            "mlxd-proxy",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8(out.stdout)?;
    assert!(tree.contains("mlxd-proxy"));
    let mlx: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("mlx-") || l.starts_with("mlx_"))
        .collect();
    assert!(mlx.is_empty(), "mlxd-proxy depends on {mlx:?}");

    let bin = mlxd_bin()?;
    let out = Command::new("readelf").arg("-d").arg(&bin).output()?;
    assert!(out.status.success());
    let dynamic = String::from_utf8(out.stdout)?;
    let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        !needed.is_empty(),
        "readelf found no NEEDED entries: {dynamic}"
    );
    assert!(
        !needed
            .iter()
            .any(|l| l.to_ascii_lowercase().contains("mlx")),
        "mlxd links MLX: {needed:?}"
    );
    let out = Command::new("ldd").arg(&bin).output()?;
    let resolved = String::from_utf8_lossy(&out.stdout);
    assert!(
        !resolved.to_ascii_lowercase().contains("libmlx"),
        "{resolved}"
    );
    Ok(())
}
