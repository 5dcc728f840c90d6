//! A supervised engine whose model thread stops making progress ends itself.
//!
//! A device that stops answering never returns an error: on an H100 driven past its free
//! memory (2026-12-05, BENCHMARKS-soak.md section 6) every request of the engine stopped and
//! stayed stopped, while the engine's other threads went on sending `Stats`, so the
//! supervisor's hang check (`hang_timeout_ms`, on `Stats`) saw a live engine. This watch looks
//! at the model thread itself: while the runtime has work (`active` or `queued`), its
//! iteration count ([`RuntimeStats::steps`]) must move at least once per bound
//! (`step_timeout`, default 300 s: the longest first prefill step, as for engine groups). When
//! it does not, the engine reports the stall to the supervisor and exits
//! ([`EXIT_STALLED`]); the supervisor restarts it and resumes its streams, as after a crash.
//! An idle runtime is never stalled, however long it waits.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::runtime::RuntimeStats;

/// The exit status of an engine that ended itself because its model thread stalled.
pub const EXIT_STALLED: i32 = 4;

/// What the watch last saw: the iteration count, and since when it has not moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub steps: u64,
    pub since: Instant,
}

/// One look at the runtime at `now`: the progress to remember and, when the model thread has
/// had work without finishing an iteration for `bound` or longer, how long.
pub fn look(
    prev: Progress,
    busy: bool,
    steps: u64,
    now: Instant,
    bound: Duration,
) -> (Progress, Option<Duration>) {
    if !busy || steps != prev.steps {
        return (Progress { steps, since: now }, None);
    }
    let still = now.saturating_duration_since(prev.since);
    (prev, (still >= bound).then_some(still))
}

/// Watches `stats` from a thread of its own for the life of the process; `on_stall` gets the
/// reason once, when the model thread has stalled past `bound`.
pub fn spawn(
    stats: Arc<RuntimeStats>,
    bound: Duration,
    on_stall: Box<dyn FnOnce(String) + Send>,
) -> std::io::Result<()> {
    let period = (bound / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    std::thread::Builder::new()
        .name("step-watch".into())
        .spawn(move || {
            let mut progress = Progress {
                steps: stats.steps.load(Ordering::Relaxed),
                since: Instant::now(),
            };
            loop {
                std::thread::sleep(period);
                let busy = stats.active.load(Ordering::Relaxed) > 0
                    || stats.queued.load(Ordering::Relaxed) > 0;
                let steps = stats.steps.load(Ordering::Relaxed);
                let (next, stalled) = look(progress, busy, steps, Instant::now(), bound);
                progress = next;
                if let Some(still) = stalled {
                    on_stall(format!(
                        "the model thread made no progress for {} s with work waiting (the \
                         bound is {} s, step_timeout): the device stopped answering",
                        still.as_secs(),
                        bound.as_secs()
                    ));
                    return;
                }
            }
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(300);

    #[test]
    fn idle_is_never_a_stall_and_progress_restarts_the_clock() {
        let t0 = Instant::now();
        let p = Progress {
            steps: 7,
            since: t0,
        };
        let late = t0 + Duration::from_secs(3600);
        let (q, stalled) = look(p, false, 7, late, BOUND);
        assert_eq!(
            (q, stalled),
            (
                Progress {
                    steps: 7,
                    since: late
                },
                None
            ),
            "idle"
        );
        let (q, stalled) = look(p, true, 8, late, BOUND);
        assert_eq!(
            (q, stalled),
            (
                Progress {
                    steps: 8,
                    since: late
                },
                None
            ),
            "it moved"
        );
    }

    #[test]
    fn work_without_an_iteration_for_the_bound_is_a_stall() {
        let t0 = Instant::now();
        let p = Progress {
            steps: 7,
            since: t0,
        };
        let (q, stalled) = look(p, true, 7, t0 + Duration::from_secs(299), BOUND);
        assert_eq!(
            (q, stalled),
            (p, None),
            "within the bound: the clock keeps running"
        );
        let (_, stalled) = look(p, true, 7, t0 + BOUND, BOUND);
        assert_eq!(stalled, Some(BOUND));
    }
}
