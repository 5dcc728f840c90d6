//! A job's progress for a person (`mlxd quantize`): an indicatif bar on a terminal, else plain
//! lines (each phase once, then at most one per tenth of the count), and the table of
//! `mlxd jobs`.
use std::io::IsTerminal;

use mlxd_protocol::jobs::{Job, JobProgress};

use crate::config::Bytes;

/// A training job's figures in one line: `training 12/100: train loss 2.345, val loss 2.567
/// (after 10), 1234 tok/s, peak 1.2 GiB, checkpoint 10`.
pub fn training_line(phase: &str, t: &mlxd_protocol::jobs::TrainingProgress) -> String {
    let mut line = format!("{phase} {}/{}", t.iteration, t.iters);
    let mut parts = Vec::new();
    if let Some(l) = t.train_loss {
        parts.push(format!("train loss {l:.4}"));
    }
    if let (Some(l), Some(at)) = (t.val_loss, t.val_iteration) {
        parts.push(format!("val loss {l:.4} (after {at})"));
    }
    if t.tokens_per_second > 0.0 {
        parts.push(format!("{:.0} tok/s", t.tokens_per_second));
    }
    if t.peak_memory_bytes > 0 {
        parts.push(format!("peak {}", Bytes(t.peak_memory_bytes)));
    }
    if let Some(c) = t.checkpoint {
        parts.push(format!("checkpoint {c}"));
    }
    if !parts.is_empty() {
        line.push_str(": ");
        line.push_str(&parts.join(", "));
    }
    line
}

/// Where a followed job's progress goes.
pub enum ProgressView {
    Bar(Option<indicatif::ProgressBar>),
    Lines(PlainJobLines),
}

impl ProgressView {
    /// Bars when stderr is a terminal, plain lines otherwise.
    pub fn for_stderr() -> Self {
        if std::io::stderr().is_terminal() {
            Self::Bar(None)
        } else {
            Self::Lines(PlainJobLines::default())
        }
    }

    pub fn show(&mut self, p: &JobProgress) {
        match self {
            // A training job: every report is a line (iteration, losses, speed, memory).
            Self::Lines(_) if p.training.is_some() => {
                if let Some(t) = &p.training {
                    eprintln!("mlxd: {}", training_line(&p.phase, t));
                }
            }
            Self::Lines(lines) => {
                if let Some(line) = lines.line(p) {
                    eprintln!("mlxd: {line}");
                }
            }
            Self::Bar(slot) => {
                use indicatif::{ProgressBar, ProgressStyle};
                let bar = slot.get_or_insert_with(|| {
                    let b = ProgressBar::new(p.total);
                    let template = if p.unit == "bytes" {
                        "{prefix:12} [{bar:30}] {bytes}/{total_bytes} eta {eta} {msg:40!}"
                    } else {
                        "{prefix:12} [{bar:30}] {pos}/{len} eta {eta} {msg:40!}"
                    };
                    if let Ok(style) = ProgressStyle::with_template(template) {
                        b.set_style(style.progress_chars("=> "));
                    }
                    b
                });
                bar.set_length(p.total.max(p.done));
                bar.set_position(p.done);
                bar.set_prefix(p.phase.clone());
                bar.set_message(match &p.training {
                    Some(t) => training_line(&p.phase, t),
                    None => p.detail.clone().unwrap_or_default(),
                });
            }
        }
    }

    pub fn finish(&mut self) {
        if let Self::Bar(Some(bar)) = self {
            bar.finish_and_clear();
        }
    }
}

/// Plain progress lines: a line when the phase changes and at each further tenth.
#[derive(Debug, Default)]
pub struct PlainJobLines {
    phase: Option<String>,
    tenth: u64,
}

impl PlainJobLines {
    pub fn line(&mut self, p: &JobProgress) -> Option<String> {
        let tenth = (p.done * 10).checked_div(p.total).unwrap_or(0).min(10);
        if self.phase.as_deref() == Some(p.phase.as_str()) && tenth <= self.tenth {
            return None;
        }
        self.phase = Some(p.phase.clone());
        self.tenth = tenth;
        let count = match (p.unit.as_str(), p.total) {
            (_, 0) => String::new(),
            ("bytes", t) => format!(" {}% ({} of {})", tenth * 10, Bytes(p.done), Bytes(t)),
            (unit, t) => format!(" {}% ({} of {t} {unit})", tenth * 10, p.done),
        };
        Some(format!("{}{count}", p.phase))
    }
}

/// `mlxd jobs`: one row per job.
pub fn jobs_table(jobs: &[Job]) -> String {
    let mut out = format!(
        "{:<10} {:<9} {:<10} {:>9} {:<22} {}\n",
        "ID", "KIND", "STATE", "MEMORY", "PROGRESS", "DETAIL"
    );
    for j in jobs {
        let progress = j.progress.as_ref().map_or(String::new(), |p| {
            match (p.done * 100).checked_div(p.total) {
                Some(pct) => format!("{} {pct}%", p.phase),
                None => p.phase.clone(),
            }
        });
        let detail = j
            .result
            .as_ref()
            .map(|r| r.dir.display().to_string())
            .or_else(|| j.error.clone())
            .or_else(|| j.waiting_for.clone())
            .unwrap_or_default();
        out.push_str(&format!(
            "{:<10} {:<9} {:<10} {:>9} {:<22} {}\n",
            j.id,
            j.kind.as_str(),
            j.state.as_str(),
            Bytes(j.memory_bytes).to_string(),
            progress,
            detail
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_show_each_phase_and_tenth_once() {
        let p = |phase: &str, done| JobProgress {
            phase: phase.into(),
            done,
            total: 20,
            unit: "tensors".into(),
            detail: None,
            training: None,
        };
        let mut l = PlainJobLines::default();
        assert_eq!(
            l.line(&p("quantizing", 0)).as_deref(),
            Some("quantizing 0% (0 of 20 tensors)")
        );
        assert_eq!(l.line(&p("quantizing", 1)), None);
        assert_eq!(
            l.line(&p("quantizing", 2)).as_deref(),
            Some("quantizing 10% (2 of 20 tensors)")
        );
        assert_eq!(
            l.line(&p("writing", 20)).as_deref(),
            Some("writing 100% (20 of 20 tensors)")
        );
    }
}
