//! `mlxd serve` loads the default model's engine at start, shows the load's progress (a bar
//! on a terminal, plain lines otherwise) from the engine's `Loading` reports, and then prints
//! one line with the URL and the device the model runs on.

use std::io::IsTerminal;
use std::time::Duration;

use crate::pool::PoolHandle;
use crate::progress::say;

/// How often the load's progress is read from the pool.
const POLL: Duration = Duration::from_millis(200);

/// Plain-text load progress: a line when the phase changes and at each tenth of a phase.
#[derive(Debug, Default)]
pub struct LoadLines {
    last: Option<(&'static str, u32)>,
}

impl LoadLines {
    /// The line to print for `model` at `phase` and `progress` (`0.0..=1.0`), if any.
    pub fn line(&mut self, model: &str, phase: &'static str, progress: f32) -> Option<String> {
        let tenth = (progress.clamp(0.0, 1.0) * 10.0).floor() as u32;
        match self.last {
            Some((p, t)) if p == phase && t >= tenth => return None,
            _ => {}
        }
        self.last = Some((phase, tenth));
        Some(match phase {
            "starting" => format!("loading {model}: starting the engine"),
            "weights" => format!("loading {model}: weights {}%", tenth * 10),
            other => format!("loading {model}: {other} {}%", tenth * 10),
        })
    }
}

/// Where the progress goes: a bar on a terminal, lines (or JSON log events) otherwise.
enum Display {
    Bar(indicatif::ProgressBar),
    Lines { lines: LoadLines, json_logs: bool },
}

impl Display {
    fn new(json_logs: bool) -> Self {
        if std::io::stderr().is_terminal() && !json_logs {
            let bar = indicatif::ProgressBar::new(100);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{msg:30!} [{bar:30}] {pos:>3}%")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            Self::Bar(bar)
        } else {
            Self::Lines {
                lines: LoadLines::default(),
                json_logs,
            }
        }
    }

    fn update(&mut self, model: &str, phase: &'static str, progress: f32) {
        match self {
            Self::Bar(bar) => {
                bar.set_message(format!("loading {model}: {phase}"));
                bar.set_position((progress.clamp(0.0, 1.0) * 100.0) as u64);
            }
            Self::Lines { lines, json_logs } => {
                if let Some(line) = lines.line(model, phase, progress) {
                    say(*json_logs, &line);
                }
            }
        }
    }

    fn finish(self) {
        if let Self::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

/// Loads `model` through the pool (as a request would), showing its progress, then prints the
/// URL line; a failed load is printed with its reason, and serving goes on (the model is
/// retried on the next request).
pub async fn run(pool: PoolHandle, model: String, url: String, json_logs: bool) {
    let mut display = Display::new(json_logs);
    // Said at once: a fast load may end before the first report is read.
    display.update(&model, "starting", 0.0);
    let load = {
        let (pool, model) = (pool.clone(), model.clone());
        tokio::spawn(async move { pool.load(&model).await })
    };
    tokio::pin!(load);
    let mut tick = tokio::time::interval(POLL);
    let result = loop {
        tokio::select! {
            r = &mut load => break r,
            _ = tick.tick() => {
                let row = pool.status().await.into_iter().find(|e| e.model == model);
                if let Some((phase, progress)) = row.and_then(|r| Some((r.loading_phase?, r.loading_progress?))) {
                    display.update(&model, phase, progress);
                }
            }
        }
    };
    display.finish();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_per_phase_and_tenth() {
        let mut l = LoadLines::default();
        let lines: Vec<String> = [
            ("starting", 0.0),
            ("starting", 0.0),
            ("converting", 0.0),
            ("converting", 1.0),
            ("weights", 0.0),
            ("weights", 0.05),
            ("weights", 0.35),
            ("weights", 0.39),
            ("weights", 1.0),
        ]
        .into_iter()
        .filter_map(|(phase, p)| l.line("m", phase, p))
        .collect();
        assert_eq!(
            lines,
            [
                "loading m: starting the engine",
                "loading m: converting 0%",
                "loading m: converting 100%",
                "loading m: weights 0%",
                "loading m: weights 30%",
                "loading m: weights 100%",
            ]
        );
    }
}
