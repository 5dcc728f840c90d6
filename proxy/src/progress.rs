//! Shows the model store's progress (downloads, conversions) to a person: progress bars
//! (indicatif) when stderr is a terminal, otherwise plain lines, at most one per tenth of a
//! download, so logs and CI output stay short.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;

use mlxd_store::{Progress, StoreEvent};

use crate::config::Bytes;

/// A progress sink for the store that writes to stderr: bars on a terminal, else plain
/// lines; with `json_logs`, the lines go through the log as JSON objects instead.
pub fn to_stderr(json_logs: bool) -> Progress {
    if std::io::stderr().is_terminal() && !json_logs {
        bars()
    } else {
        let lines = Mutex::new(PlainLines::default());
        Progress::new(move |e| {
            let line = lines.lock().map(|mut l| l.line(e)).unwrap_or(None);
            if let Some(line) = line {
                say(json_logs, &line);
            }
        })
    }
}

/// One line for the person at the terminal: `mlxd: LINE` on stderr, or, when the log is
/// JSON (`--log-format json`), an info event, so that every line stays a JSON object.
pub fn say(json_logs: bool, line: &str) {
    if json_logs {
        tracing::info!("{line}");
    } else {
        eprintln!("mlxd: {line}");
    }
}

/// Plain-text progress: which tenth of each download was last reported.
#[derive(Debug, Default)]
pub struct PlainLines {
    tenths: HashMap<String, u64>,
}

impl PlainLines {
    /// The line to print for `e`, if any.
    pub fn line(&mut self, e: &StoreEvent) -> Option<String> {
        match e {
            StoreEvent::Download { what, done, total } => {
                if *total == 0 {
                    return None;
                }
                let tenth = (done * 10 / total).min(10);
                let last = self.tenths.entry(what.clone()).or_insert(0);
                if tenth <= *last {
                    return None;
                }
                *last = tenth;
                Some(format!(
                    "downloading {what}: {}% ({} of {})",
                    tenth * 10,
                    Bytes(*done),
                    Bytes(*total)
                ))
            }
            StoreEvent::Downloaded { what } => {
                self.tenths.remove(what);
                Some(format!("downloaded {what}"))
            }
            StoreEvent::Converting { source } => Some(format!(
                "converting {} to MLX",
                source
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| source.display().to_string())
            )),
            StoreEvent::Converted { dir, seconds } => Some(format!(
                "converted in {seconds:.1} s into {}",
                dir.display()
            )),
        }
    }
}

/// Progress bars on a terminal: one per download, a spinner while converting.
fn bars() -> Progress {
    use indicatif::{ProgressBar, ProgressStyle};
    let bars: Mutex<HashMap<String, ProgressBar>> = Mutex::new(HashMap::new());
    let spinner: Mutex<Option<ProgressBar>> = Mutex::new(None);
    Progress::new(move |e| match e {
        StoreEvent::Download { what, done, total } => {
            let Ok(mut bars) = bars.lock() else { return };
            let bar = bars.entry(what.clone()).or_insert_with(|| {
                let b = ProgressBar::new(*total);
                if let Ok(style) = ProgressStyle::with_template(
                    "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                ) {
                    b.set_style(style.progress_chars("=> "));
                }
                b.set_message(what.clone());
                b
            });
            bar.set_position(*done);
        }
        StoreEvent::Downloaded { what } => {
            if let Some(b) = bars.lock().ok().and_then(|mut b| b.remove(what)) {
                b.finish();
            }
        }
        StoreEvent::Converting { source } => {
            let s = ProgressBar::new_spinner();
            s.enable_steady_tick(std::time::Duration::from_millis(120));
            s.set_message(format!("converting {} to MLX", source.display()));
            if let Ok(mut slot) = spinner.lock() {
                *slot = Some(s);
            }
        }
        StoreEvent::Converted { dir, seconds } => {
            if let Some(s) = spinner.lock().ok().and_then(|mut s| s.take()) {
                s.finish_with_message(format!(
                    "converted in {seconds:.1} s into {}",
                    dir.display()
                ));
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_report_each_tenth_once() {
        let mut p = PlainLines::default();
        let dl = |done| StoreEvent::Download {
            what: "w.whl".into(),
            done,
            total: 1000,
        };
        let lines: Vec<String> = [0, 50, 100, 150, 990, 1000]
            .into_iter()
            .filter_map(|d| p.line(&dl(d)))
            .collect();
        assert_eq!(
            lines,
            [
                "downloading w.whl: 10% (100 B of 1000 B)",
                "downloading w.whl: 90% (990 B of 1000 B)",
                "downloading w.whl: 100% (1000 B of 1000 B)",
            ]
        );
        assert_eq!(
            p.line(&StoreEvent::Downloaded {
                what: "w.whl".into()
            })
            .as_deref(),
            Some("downloaded w.whl")
        );
        // Unknown totals print nothing until done.
        let unknown = StoreEvent::Download {
            what: "x".into(),
            done: 5,
            total: 0,
        };
        assert_eq!(p.line(&unknown), None);
        let conv = StoreEvent::Converting {
            source: "/m/a.gguf".into(),
        };
        assert_eq!(p.line(&conv).as_deref(), Some("converting a.gguf to MLX"));
    }
}
