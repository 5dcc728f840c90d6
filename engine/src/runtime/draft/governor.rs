//! Whether a batch drafts at all, by measured throughput. Whether drafting pays depends on
//! more than acceptance: on the cost of a `1 + q`-wide verification pass against a one-token
//! pass on this device and model, on the draft model's passes, and on the pipelining a
//! synchronous step gives up. So the batch measures both: it runs a few steps each way, keeps
//! the faster for a while, and measures again. Each time the same way wins again, the next
//! measurement waits twice as long, so a steady loser costs less and less.
//!
//! While drafting is held, its rate is still watched, window by window: a held way can turn
//! slower than its measurement said (longer contexts, the text leaving a repetitive part, or
//! per-shape work on the device that the probe's steps did not meet), and a window slower
//! than the measured pipelined rate ends the hold at once.
//!
//! Pure: the batch reports each step's emitted tokens and time.
use std::time::Duration;

/// Steps measured each way.
pub const PROBE_STEPS: u32 = 6;
/// Steps the faster way runs before the first new measurement.
pub const FIRST_HOLD_STEPS: u32 = 64;
/// The longest wait between measurements.
pub const MAX_HOLD_STEPS: u32 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Pipelined,
    Speculative,
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Measuring `kind` for `left` more steps.
    Probing { kind: StepKind, left: u32 },
    /// Running `kind` for `left` more steps.
    Holding { kind: StepKind, left: u32 },
}

/// Tokens and time of the steps of one measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rate {
    tokens: u64,
    time: Duration,
}

impl Rate {
    fn per_second(&self) -> f64 {
        self.tokens as f64 / self.time.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DraftGovernor {
    phase: Phase,
    measured: [Rate; 2],
    hold: u32,
    last_winner: Option<StepKind>,
    /// The current window of a drafting hold, and its steps.
    window: Rate,
    window_steps: u32,
}

impl Default for DraftGovernor {
    fn default() -> Self {
        Self {
            // Drafting first: a row's acceptance record needs drafted passes.
            phase: Phase::Probing {
                kind: StepKind::Speculative,
                left: PROBE_STEPS,
            },
            measured: [Rate::default(); 2],
            hold: FIRST_HOLD_STEPS,
            last_winner: None,
            window: Rate::default(),
            window_steps: 0,
        }
    }
}

fn slot(kind: StepKind) -> usize {
    match kind {
        StepKind::Pipelined => 0,
        StepKind::Speculative => 1,
    }
}

impl DraftGovernor {
    /// The kind of step the batch should take next.
    pub fn next_kind(&self) -> StepKind {
        match self.phase {
            Phase::Probing { kind, .. } | Phase::Holding { kind, .. } => kind,
        }
    }

    /// The batch took a step of `kind` that emitted `tokens` in `time`. A step of another
    /// kind than asked (rows joining, no row able to draft) counts towards no measurement.
    pub fn record(&mut self, kind: StepKind, tokens: usize, time: Duration) {
        if kind != self.next_kind() {
            return;
        }
        match &mut self.phase {
            Phase::Probing { kind, left } => {
                let r = &mut self.measured[slot(*kind)];
                r.tokens += tokens as u64;
                r.time += time;
                *left -= 1;
                if *left > 0 {
                    return;
                }
                match *kind {
                    StepKind::Speculative => {
                        self.phase = Phase::Probing {
                            kind: StepKind::Pipelined,
                            left: PROBE_STEPS,
                        }
                    }
                    StepKind::Pipelined => self.settle(),
                }
            }
            Phase::Holding { kind, left } => {
                *left = left.saturating_sub(1);
                let (kind, left) = (*kind, *left);
                if kind == StepKind::Speculative && self.watch(tokens, time) {
                    return;
                }
                if left == 0 {
                    self.measured = [Rate::default(); 2];
                    self.phase = Phase::Probing {
                        kind: StepKind::Speculative,
                        left: PROBE_STEPS,
                    };
                }
            }
        }
    }

    /// Adds a held drafting step to the window; at the window's end, a rate below the measured
    /// pipelined one switches to pipelined steps (returns true).
    fn watch(&mut self, tokens: usize, time: Duration) -> bool {
        self.window.tokens += tokens as u64;
        self.window.time += time;
        self.window_steps += 1;
        if self.window_steps < PROBE_STEPS {
            return false;
        }
        let slower =
            self.window.per_second() < self.measured[slot(StepKind::Pipelined)].per_second();
        self.window = Rate::default();
        self.window_steps = 0;
        if slower {
            self.hold = FIRST_HOLD_STEPS;
            self.last_winner = Some(StepKind::Pipelined);
            self.phase = Phase::Holding {
                kind: StepKind::Pipelined,
                left: self.hold,
            };
        }
        slower
    }

    /// Both measured: hold the faster (drafting only when strictly faster).
    fn settle(&mut self) {
        let [pipelined, speculative] = self.measured;
        let winner = if speculative.per_second() > pipelined.per_second() {
            StepKind::Speculative
        } else {
            StepKind::Pipelined
        };
        if self.last_winner == Some(winner) {
            self.hold = (self.hold * 2).min(MAX_HOLD_STEPS);
        } else {
            self.hold = FIRST_HOLD_STEPS;
        }
        self.last_winner = Some(winner);
        self.window = Rate::default();
        self.window_steps = 0;
        self.phase = Phase::Holding {
            kind: winner,
            left: self.hold,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps where a speculative step emits `spec_tokens` in `spec_ms` and a
    /// pipelined one 1 token in 10 ms; returns how many were speculative.
    fn run(g: &mut DraftGovernor, steps: u32, spec_tokens: usize, spec_ms: u64) -> u32 {
        let mut speculative = 0;
        for _ in 0..steps {
            match g.next_kind() {
                StepKind::Speculative => {
                    speculative += 1;
                    g.record(
                        StepKind::Speculative,
                        spec_tokens,
                        Duration::from_millis(spec_ms),
                    )
                }
                StepKind::Pipelined => g.record(StepKind::Pipelined, 1, Duration::from_millis(10)),
            }
        }
        speculative
    }

    #[test]
    fn drafting_that_pays_is_kept() {
        let mut g = DraftGovernor::default();
        // 2.5 tokens per 15 ms beats 1 per 10 ms.
        let spec = run(&mut g, 1000, 5, 30);
        assert!(spec > 950, "{spec} of 1000 steps drafted");
    }

    #[test]
    fn drafting_that_costs_is_dropped_and_measured_ever_less_often() {
        let mut g = DraftGovernor::default();
        let first = run(&mut g, 200, 1, 30);
        let later = run(&mut g, 5000, 1, 30);
        assert!(first <= 3 * PROBE_STEPS, "{first} of 200");
        // Holds double each time: after 64, 128, 256, … only a few probes in 5000 steps.
        assert!(later <= 6 * PROBE_STEPS, "{later} of 5000");
        assert_eq!(g.next_kind(), StepKind::Pipelined);
    }

    #[test]
    fn a_change_of_winner_is_followed() {
        let mut g = DraftGovernor::default();
        run(&mut g, 300, 1, 30);
        assert_eq!(g.next_kind(), StepKind::Pipelined);
        // The text turns repetitive: drafting now pays; the next probe finds it.
        run(&mut g, 600, 4, 12);
        assert_eq!(g.next_kind(), StepKind::Speculative);
    }

    #[test]
    fn a_held_drafting_that_turns_slow_is_dropped_within_a_window() {
        let mut g = DraftGovernor::default();
        // Probes: drafting 3 tokens per 20 ms beats 1 per 10 ms.
        run(&mut g, 2 * PROBE_STEPS, 3, 20);
        assert_eq!(g.next_kind(), StepKind::Speculative);
        // Held drafting now takes 100 ms a step: one window later the batch pipelines.
        let spec = run(&mut g, 50, 3, 100);
        assert_eq!(spec, PROBE_STEPS, "{spec} slow drafting steps");
        assert_eq!(g.next_kind(), StepKind::Pipelined);
    }

    #[test]
    fn steps_of_another_kind_than_asked_do_not_count() {
        let mut g = DraftGovernor::default();
        for _ in 0..100 {
            g.record(StepKind::Pipelined, 1, Duration::from_millis(1));
        }
        assert_eq!(g, DraftGovernor::default());
    }
}
