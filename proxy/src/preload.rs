//! `mlxd serve` loads the default model's engine at start, shows the load's progress on a
//! terminal as a bar from the engine's `Loading` reports (the log says it in lines, as for
//! every load: [`crate::logs::LoadLog`]), and then prints one line with the URL and the
//! device the model runs on.

use std::io::IsTerminal;
use std::time::Duration;

use crate::pool::PoolHandle;
use crate::progress::{bars, finish_bar, say};

/// How often the load's progress is read from the pool.
const POLL: Duration = Duration::from_millis(200);

/// The load's bar: on a terminal with text logs; elsewhere the log's lines say it.
struct Bar(Option<indicatif::ProgressBar>);

impl Bar {
    fn new(json_logs: bool) -> Self {
        if !std::io::stderr().is_terminal() || json_logs {
            return Self(None);
        }
        let bar = bars().add(indicatif::ProgressBar::new(100));
        if let Ok(style) = indicatif::ProgressStyle::with_template("{msg:30!} [{bar:30}] {pos:>3}%")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        Self(Some(bar))
    }

    fn update(&self, model: &str, phase: &'static str, progress: f32) {
        if let Some(bar) = &self.0 {
            bar.set_message(format!("loading {model}: {phase}"));
            bar.set_position((progress.clamp(0.0, 1.0) * 100.0) as u64);
        }
    }

    /// Ends the bar with a line: at 100% when the load succeeded (the last report may come
    /// before the end), else where it stopped.
    fn finish(self, model: &str, loaded: bool) {
        let Some(bar) = self.0 else { return };
        let line = match loaded {
            true => format!("loading {model}: done, 100%"),
            false => format!("loading {model}: stopped at {}%", bar.position()),
        };
        finish_bar(&bar, false, &line);
    }
}

/// Loads `model` through the pool (as a request would, without taking a place of its
/// request queue), showing its progress, then prints the URL line; a failed load is printed
/// with its reason, and serving goes on (the model is retried on the next request).
pub async fn run(pool: PoolHandle, model: String, url: String, json_logs: bool) {
    let bar = Bar::new(json_logs);
    // Shown at once: a fast load may end before the first report is read.
    bar.update(&model, "starting", 0.0);
    let load = {
        let (pool, model) = (pool.clone(), model.clone());
        tokio::spawn(async move { pool.load_at_start_up(&model).await })
    };
    tokio::pin!(load);
    let mut tick = tokio::time::interval(POLL);
    let result = loop {
        tokio::select! {
            r = &mut load => break r,
            _ = tick.tick() => {
                let row = pool.status().await.into_iter().find(|e| e.model == model);
                if let Some((phase, progress)) = row.and_then(|r| Some((r.loading_phase?, r.loading_progress?))) {
                    bar.update(&model, phase, progress);
                }
            }
        }
    };
    bar.finish(&model, matches!(result, Ok(Ok(()))));
    let api = "chat page there, OpenAI API under /v1";
    match result {
        Ok(Ok(())) => {
            let device = pool
                .status()
                .await
                .into_iter()
                .find(|e| e.model == model)
                .and_then(|e| e.device)
                .unwrap_or_else(|| "an unknown device".into());
            say(
                json_logs,
                &format!("serving on {url} ({model} loaded on {device}; {api})"),
            );
        }
        Ok(Err(e)) => say(
            json_logs,
            &format!("serving on {url} ({api}); the default model {model} did not load: {e}"),
        ),
        Err(e) => say(
            json_logs,
            &format!("serving on {url} ({api}); loading the default model {model} failed: {e}"),
        ),
    }
}
