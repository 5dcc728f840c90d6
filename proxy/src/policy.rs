//! Restart policy: exponential backoff and the crash-loop cap. Pure state machine; the
//! pool actor feeds it exits and obeys its decisions.

use std::collections::VecDeque;
use std::time::Duration;

use mlxd_protocol::control::Limits;
use tokio::time::Instant;

use crate::config::Config;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// This many crashes inside `window` mark the model failed.
    pub crash_limit: usize,
    pub window: Duration,
    /// An engine that stayed ready this long resets the backoff.
    pub stable_after: Duration,
}

impl RestartPolicy {
    pub fn from_config(c: &Config) -> Self {
        Self {
            backoff_initial: Duration::from_millis(c.server.backoff_initial_ms),
            backoff_max: Duration::from_millis(c.server.backoff_max_ms),
            crash_limit: c.server.crash_limit.max(1),
            window: Duration::from_millis(c.server.crash_window_ms),
            stable_after: Duration::from_secs(30),
        }
    }

    /// Delay before restart number `attempt` (0-based): initial · 2^attempt, capped.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.backoff_initial
            .saturating_mul(factor)
            .min(self.backoff_max)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Restart {
        delay: Duration,
        attempt: u32,
    },
    /// Too many crashes in the window: stop restarting.
    Fail {
        crashes: usize,
    },
}

/// Recent crashes of one model.
#[derive(Debug, Clone, Default)]
pub struct CrashHistory {
    recent: VecDeque<Instant>,
    consecutive: u32,
}

impl CrashHistory {
    /// Records an unrequested exit at `now`; `ready_for` is how long the engine had
    /// been ready (None if it never was).
    pub fn on_crash(
        &mut self,
        policy: &RestartPolicy,
        now: Instant,
        ready_for: Option<Duration>,
    ) -> Decision {
        if ready_for.is_some_and(|d| d >= policy.stable_after) {
            self.consecutive = 0;
        }
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) >= policy.window)
        {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
        if self.recent.len() >= policy.crash_limit {
            return Decision::Fail {
                crashes: self.recent.len(),
            };
        }
        let attempt = self.consecutive;
        self.consecutive += 1;
        Decision::Restart {
            delay: policy.backoff(attempt),
            attempt,
        }
    }

    /// Crashes counted in the current window.
    pub fn recent(&self) -> usize {
        self.recent.len()
    }

    /// Forget everything (admin reset, cool-down over).
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Limits for a restart after an out-of-memory exit: KV budget and batch size halved.
/// `None` when nothing is set that could shrink.
pub fn shrink_after_oom(l: &Limits) -> Option<Limits> {
    let kv = l.kv_budget_bytes.map(|b| (b / 2).max(1));
    let batch = l.max_batch_size.map(|b| (b / 2).max(1));
    if kv == l.kv_budget_bytes && batch == l.max_batch_size {
        return None;
    }
    Some(Limits {
        max_batch_size: batch,
        kv_budget_bytes: kv,
        context_length: l.context_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RestartPolicy {
        RestartPolicy::from_config(&Config::default())
    }

    #[test]
    fn backoff_doubles_to_cap() {
        let p = policy();
        let ms: Vec<u128> = (0..8).map(|a| p.backoff(a).as_millis()).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 4000, 8000, 8000, 8000]);
        assert_eq!(p.backoff(u32::MAX), Duration::from_secs(8));
    }

    #[tokio::test(start_paused = true)]
    async fn five_crashes_in_two_minutes_fail() {
        let p = policy();
        let mut h = CrashHistory::default();
        let mut delays = Vec::new();
        for _ in 0..4 {
            match h.on_crash(&p, Instant::now(), Some(Duration::from_secs(1))) {
                Decision::Restart { delay, .. } => delays.push(delay.as_millis()),
                d => panic!("{d:?}"),
            }
            tokio::time::advance(Duration::from_secs(10)).await;
        }
        assert_eq!(delays, [250, 500, 1000, 2000]);
        assert_eq!(
            h.on_crash(&p, Instant::now(), None),
            Decision::Fail { crashes: 5 }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn crashes_outside_the_window_are_forgotten() {
        let p = policy();
        let mut h = CrashHistory::default();
        for _ in 0..10 {
            assert!(matches!(
                h.on_crash(&p, Instant::now(), None),
                Decision::Restart { .. }
            ));
            tokio::time::advance(Duration::from_secs(31)).await;
        }
        assert!(h.recent() <= 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stable_run_resets_the_backoff() {
        let p = policy();
        let mut h = CrashHistory::default();
        h.on_crash(&p, Instant::now(), None);
        h.on_crash(&p, Instant::now(), None);
        tokio::time::advance(Duration::from_secs(200)).await;
        assert_eq!(
            h.on_crash(&p, Instant::now(), Some(Duration::from_secs(60))),
            Decision::Restart {
                delay: Duration::from_millis(250),
                attempt: 0
            }
        );
    }

    #[test]
    fn oom_shrinks_limits() {
        let l = Limits {
            max_batch_size: Some(8),
            kv_budget_bytes: Some(1 << 30),
            context_length: Some(4096),
        };
        let s = shrink_after_oom(&l).unwrap();
        assert_eq!(s.max_batch_size, Some(4));
        assert_eq!(s.kv_budget_bytes, Some(1 << 29));
        assert_eq!(s.context_length, Some(4096));
        assert_eq!(shrink_after_oom(&Limits::default()), None);
        let one = Limits {
            max_batch_size: Some(1),
            ..Limits::default()
        };
        assert_eq!(shrink_after_oom(&one), None);
    }
}
