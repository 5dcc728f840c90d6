//! Shows the model store's progress (downloads, conversions) to a person: progress bars
//! (indicatif) when stderr is a terminal, otherwise plain lines, at most one per tenth of a
//! download, so logs and CI output stay short.
//!
//! Every bar is drawn through one [`MultiProgress`] ([`bars`]), and log lines and `mlxd:`
//! lines are written through it ([`LogWriter`], [`say`]): the bars are lifted, the line
//! written, the bars drawn again below it, so a line never lands inside a bar. A bar that
//! ends is cleared and leaves one text line saying how it ended.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};

use indicatif::{MultiProgress, ProgressBar};
use mlxd_store::{Progress, StoreEvent};

use crate::config::Bytes;

/// The bars on stderr (drawn only when stderr is a terminal).
pub fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(MultiProgress::new)
}

/// Writes `bytes` to stderr with the bars lifted.
fn write_above_bars(bytes: &[u8]) {
    bars().suspend(|| {
        let mut err = std::io::stderr().lock();
        // Nowhere to report a failed write to stderr.
        let _ = err.write_all(bytes);
        let _ = err.flush();
    });
}

/// Ends `bar`: clears it and writes `line` (`mlxd: LINE`, or a log event) in its place.
pub fn finish_bar(bar: &ProgressBar, json_logs: bool, line: &str) {
    bar.finish_and_clear();
    bars().remove(bar);
    say(json_logs, line);
}

/// The log's writer (`tracing_subscriber::fmt().with_writer(LogWriter)`): stderr, each
/// line written whole, above the progress bars.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

/// One log line being formatted; written when dropped.
#[derive(Debug, Default)]
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            write_above_bars(&self.0);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine::default()
    }
}

/// A progress sink for the store that writes to stderr: bars on a terminal, else plain
/// lines; with `json_logs`, the lines go through the log as JSON objects instead.
pub fn to_stderr(json_logs: bool) -> Progress {
    if std::io::stderr().is_terminal() && !json_logs {
        store_bars()
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
        write_above_bars(format!("mlxd: {line}\n").as_bytes());
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

/// Progress bars on a terminal: one per download, a spinner while converting; each leaves
/// a line when it ends.
fn store_bars() -> Progress {
    use indicatif::ProgressStyle;
    let bars: Mutex<HashMap<String, ProgressBar>> = Mutex::new(HashMap::new());
    let spinner: Mutex<Option<ProgressBar>> = Mutex::new(None);
    Progress::new(move |e| match e {
        StoreEvent::Download { what, done, total } => {
            let Ok(mut bars) = bars.lock() else { return };
            let bar = bars.entry(what.clone()).or_insert_with(|| {
                let b = self::bars().add(ProgressBar::new(*total));
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
                finish_bar(&b, false, &format!("downloaded {what}"));
            }
        }
        StoreEvent::Converting { source } => {
            let s = self::bars().add(ProgressBar::new_spinner());
            s.enable_steady_tick(std::time::Duration::from_millis(120));
            s.set_message(format!("converting {} to MLX", source.display()));
            if let Ok(mut slot) = spinner.lock() {
                *slot = Some(s);
            }
        }
        StoreEvent::Converted { dir, seconds } => {
            if let Some(s) = spinner.lock().ok().and_then(|mut s| s.take()) {
                finish_bar(
                    &s,
                    false,
                    &format!("converted in {seconds:.1} s into {}", dir.display()),
                );
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
