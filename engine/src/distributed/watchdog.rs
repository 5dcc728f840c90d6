//! A rank that hangs: a collective that never returns (a peer stopped with SIGSTOP, a network
//! that stalls without closing the connection) blocks every other rank inside MLX, where no
//! error ever comes. Each rank therefore watches its own progress from a thread of its own and
//! gives the group up when one step runs past a bound, exiting as for a broken group so that
//! the supervisor restarts the whole group.
//!
//! What "progress" means: a rank alternates between **waiting** for the next step's inputs
//! and **stepping**. Every rank's executor holds the same work (the lockstep), so every rank
//! knows whether the group is idle. While it is, rank 0 waits for a request and the others
//! wait in the broadcast's first collective for rank 0's next turn — however long (an idle
//! group may wait forever) — until the turn's length arrives. Otherwise the rank is stepping,
//! from the moment it asks for the next turn (rank 0 broadcasts it at once) until it asks for
//! the one after: the broadcast, the forward passes and their collectives, sampling. Only a
//! step is bounded; each new step restarts the clock.
//!
//! The bound ([`STEP_TIMEOUT`], the engine option `distributed_step_timeout`) must exceed the
//! longest step a healthy group takes. After the first prefill the scheduler sizes a step's
//! prefill to about half a second at the measured speed (`runtime::PREFILL_UNIT_TARGET`);
//! before it, a step may prefill a whole `prefill_step_tokens` budget (2 048 tokens on the
//! CPU, 16 384 on a GPU). Five minutes lets that first step run at 7 (CPU) or 55 (GPU) tokens
//! a second, below any device a divided model is served on, at the cost of a hung group being
//! noticed within five minutes of its hang (a request arriving at an idle group whose rank
//! hung starts the clock). A slower set-up raises `distributed_step_timeout`.
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long one step may run before the rank gives the group up (see the module's text).
pub const STEP_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a rank stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the next turn: unbounded.
    Waiting,
    /// Running a step that began at `since`.
    Stepping { since: Instant },
    /// The lockstep ended; the watch ends too.
    Closed,
}

/// What the watch does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is bounded: sleep until the phase changes.
    Sleep,
    /// Look again at this instant (the running step's deadline) or when the phase changes.
    WakeAt(Instant),
    /// The step has run this long, past the bound: the group is hung.
    Stalled(Duration),
    /// The lockstep is over.
    Exit,
}

/// The watch's decision for `phase` at `now`, steps bounded by `bound`.
pub fn verdict(phase: Phase, now: Instant, bound: Duration) -> Verdict {
    match phase {
        Phase::Waiting => Verdict::Sleep,
        Phase::Closed => Verdict::Exit,
        Phase::Stepping { since } => {
            let ran = now.saturating_duration_since(since);
            if ran >= bound {
                Verdict::Stalled(ran)
            } else {
                Verdict::WakeAt(since + bound)
            }
        }
    }
}

struct Shared {
    phase: Mutex<Phase>,
    changed: Condvar,
}

/// A rank's progress, told to its watch thread; closing (or dropping) it ends the watch.
pub struct StepWatch {
    shared: Arc<Shared>,
}

/// Called once, from the watch thread, with the reason, when a step outruns the bound.
pub type OnStall = Box<dyn FnOnce(String) + Send>;

impl StepWatch {
    /// Starts watching rank `rank`'s steps against `bound`; `on_stall` ends the group.
    pub fn start(rank: usize, bound: Duration, on_stall: OnStall) -> std::io::Result<StepWatch> {
        let shared = Arc::new(Shared {
            phase: Mutex::new(Phase::Waiting),
            changed: Condvar::new(),
        });
        let watched = shared.clone();
        std::thread::Builder::new()
            .name(format!("rank-{rank}-step-watch"))
            .spawn(move || {
                if let Some(ran) = watch(&watched, bound) {
                    on_stall(format!(
                        "rank {rank} made no progress for {} s in one step of the engine group \
                         (the bound is {} s, distributed_step_timeout): a rank is stopped or \
                         its network stalls",
                        ran.as_secs(),
                        bound.as_secs()
                    ));
                }
            })?;
        Ok(StepWatch { shared })
    }

    /// A step begins now (the clock restarts if one was running).
    pub fn stepping(&self) {
        self.set(Phase::Stepping {
            since: Instant::now(),
        });
    }

    /// The rank waits for the next turn, for as long as it takes.
    pub fn waiting(&self) {
        self.set(Phase::Waiting);
    }

    fn set(&self, next: Phase) {
        let mut phase = self.shared.phase.lock().unwrap_or_else(|p| p.into_inner());
        let was = std::mem::replace(&mut *phase, next);
        // The watch sleeps without a deadline only while waiting: it needs a word when a
        // step begins then, or when the watch closes. A later step or a wait it finds itself
        // at the running step's deadline.
        if was == Phase::Waiting || next == Phase::Closed {
            self.shared.changed.notify_one();
        }
    }
}

impl Drop for StepWatch {
    fn drop(&mut self) {
        self.set(Phase::Closed);
    }
}

/// Follows the phase until it closes (`None`) or a step outruns `bound` (how long it ran).
fn watch(shared: &Shared, bound: Duration) -> Option<Duration> {
    let mut phase = shared.phase.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = Instant::now();
        phase = match verdict(*phase, now, bound) {
            Verdict::Exit => return None,
            Verdict::Stalled(ran) => return Some(ran),
            Verdict::Sleep => shared
                .changed
                .wait(phase)
                .unwrap_or_else(|p| p.into_inner()),
            Verdict::WakeAt(deadline) => {
                shared
                    .changed
                    .wait_timeout(phase, deadline.saturating_duration_since(now))
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(300);

    #[test]
    fn waiting_is_never_a_stall_however_long() {
        assert_eq!(
            verdict(Phase::Waiting, Instant::now(), BOUND),
            Verdict::Sleep
        );
    }

    #[test]
    fn a_step_within_the_bound_is_looked_at_again_at_its_deadline() {
        let since = Instant::now();
        let now = since + Duration::from_secs(299);
        assert_eq!(
            verdict(Phase::Stepping { since }, now, BOUND),
            Verdict::WakeAt(since + BOUND)
        );
    }

    #[test]
    fn a_step_past_the_bound_is_a_stall_and_says_how_long_it_ran() {
        let since = Instant::now();
        let now = since + Duration::from_secs(301);
        assert_eq!(
            verdict(Phase::Stepping { since }, now, BOUND),
            Verdict::Stalled(Duration::from_secs(301))
        );
        assert_eq!(
            verdict(Phase::Stepping { since }, since + BOUND, BOUND),
            Verdict::Stalled(BOUND)
        );
    }

    #[test]
    fn a_new_step_restarts_the_clock() {
        let first = Instant::now();
        let second = first + Duration::from_secs(200);
        let now = first + Duration::from_secs(400);
        // The first step alone would have stalled; the second has run 200 s.
        assert_eq!(
            verdict(Phase::Stepping { since: first }, now, BOUND),
            Verdict::Stalled(Duration::from_secs(400))
        );
        assert_eq!(
            verdict(Phase::Stepping { since: second }, now, BOUND),
            Verdict::WakeAt(second + BOUND)
        );
    }

    #[test]
    fn a_closed_watch_exits() {
        assert_eq!(verdict(Phase::Closed, Instant::now(), BOUND), Verdict::Exit);
    }

    #[test]
    fn the_watch_reports_a_step_that_outruns_its_bound_and_not_a_wait() {
        let (tx, rx) = std::sync::mpsc::channel();
        let watch = StepWatch::start(
            1,
            Duration::from_secs(1),
            Box::new(move |why| {
                let _ = tx.send(why);
            }),
        )
        .unwrap();
        // A wait two bounds long is not a stall.
        assert!(rx.recv_timeout(Duration::from_secs(2)).is_err());
        // Steps that each end in time are not either, though together they outlast the bound.
        for _ in 0..30 {
            watch.stepping();
            std::thread::sleep(Duration::from_millis(50));
        }
        watch.waiting();
        assert!(rx.recv_timeout(Duration::from_secs(2)).is_err());
        // A step that does not end is.
        watch.stepping();
        let why = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            why.contains("rank 1") && why.contains("distributed_step_timeout"),
            "{why}"
        );
    }

    #[test]
    fn a_closed_watch_reports_nothing() {
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let watch = StepWatch::start(
            0,
            Duration::from_secs(10),
            Box::new(move |why| {
                let _ = tx.send(why);
            }),
        )
        .unwrap();
        watch.stepping();
        drop(watch);
        // The thread ended without a report: the sender is dropped.
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(10)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        ));
    }
}
