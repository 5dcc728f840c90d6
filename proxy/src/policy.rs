//! Restart policy: exponential backoff and the crash-loop cap. Pure state machine; the
//! pool actor feeds it exits and obeys its decisions.

use std::collections::VecDeque;
use std::time::Duration;

use mlxd_protocol::control::Limits;
use tokio::time::Instant;

use crate::config::Config;
use crate::exit::ExitCause;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// This many crashes inside `window` mark the model failed.
    pub crash_limit: usize,
    pub window: Duration,
    /// An engine that stayed ready this long resets the backoff.
    pub stable_after: Duration,
    /// Limits halved after an out-of-memory exit return to the configured ones after
    /// this long without another out-of-memory exit.
    pub limits_recovery: Duration,
}

impl RestartPolicy {
    pub fn from_config(c: &Config) -> Self {
        Self {
            backoff_initial: Duration::from_millis(c.server.backoff_initial_ms),
            backoff_max: Duration::from_millis(c.server.backoff_max_ms),
            crash_limit: c.server.crash_limit.max(1),
            window: Duration::from_millis(c.server.crash_window_ms),
            stable_after: Duration::from_secs(30),
            limits_recovery: Duration::from_millis(c.server.limits_recovery_ms),
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
    /// The exit says a restart would fail the same way (the model cannot be found, an
    /// option is refused, a download is impossible offline): fail the load now, once.
    DoNotRetry,
}

/// Recent crashes of one model.
#[derive(Debug, Clone, Default)]
pub struct CrashHistory {
    recent: VecDeque<Instant>,
    consecutive: u32,
}

impl CrashHistory {
    /// Decides about an unrequested exit with `cause` at `now`: a permanent cause is not
    /// retried (nor counted as a crash); anything else goes through [`Self::on_crash`].
    pub fn on_exit(
        &mut self,
        policy: &RestartPolicy,
        cause: &ExitCause,
        now: Instant,
        ready_for: Option<Duration>,
    ) -> Decision {
        if cause.is_permanent() {
            return Decision::DoNotRetry;
        }
        self.on_crash(policy, now, ready_for)
    }

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

/// The batch size and KV budget an engine launched with `launched` ran with, as it reported
/// them (`engine`): its own choice where the launch left one unset, the smaller where it cut
/// one (a KV budget above what the GPU holds). The context length stays the launch's (the
/// engine cuts it to its budget itself).
fn with_engine_choices(launched: &Limits, engine: &Limits) -> Limits {
    fn smaller<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
    Limits {
        max_batch_size: smaller(launched.max_batch_size, engine.max_batch_size),
        kv_budget_bytes: smaller(launched.kv_budget_bytes, engine.kv_budget_bytes),
        context_length: launched.context_length,
    }
}

/// One model's engine limits: the configured ones, and the ones the next engine gets.
/// Out-of-memory exits halve them; they come back after a stable period, on an admin
/// reset, or on an admin load/unload — so a burst of memory pressure does not leave a
/// model crippled for the life of the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLimits {
    configured: Limits,
    current: Limits,
    last_oom: Option<Instant>,
}

impl ModelLimits {
    pub fn new(configured: Limits) -> Self {
        Self {
            current: configured.clone(),
            configured,
            last_oom: None,
        }
    }

    /// What the next engine is launched with.
    pub fn current(&self) -> &Limits {
        &self.current
    }

    pub fn configured(&self) -> &Limits {
        &self.configured
    }

    pub fn reduced(&self) -> bool {
        self.current != self.configured
    }

    /// Records an out-of-memory exit at `now` of an engine that ran with `in_force` (what its
    /// `Ready` reported, `None` when it never was ready or did not say); returns the new
    /// limits if they shrank. The limits halved are the ones it ran with: a batch size or KV
    /// budget left unset here, which the engine chose itself, shrinks too.
    pub fn on_oom(&mut self, now: Instant, in_force: Option<&Limits>) -> Option<&Limits> {
        self.last_oom = Some(now);
        let ran_with = match in_force {
            Some(engine) => with_engine_choices(&self.current, engine),
            None => self.current.clone(),
        };
        let smaller = shrink_after_oom(&ran_with)?;
        self.current = smaller;
        Some(&self.current)
    }

    /// When reduced limits recover if no out-of-memory exit comes first.
    pub fn recovers_at(&self, policy: &RestartPolicy) -> Option<Instant> {
        if !self.reduced() {
            return None;
        }
        self.last_oom.map(|t| t + policy.limits_recovery)
    }

    /// Restores the configured limits if the stable period has passed; true if it did.
    pub fn recover_if_stable(&mut self, policy: &RestartPolicy, now: Instant) -> bool {
        match self.recovers_at(policy) {
            Some(at) if now >= at => self.restore(),
            _ => false,
        }
    }

    /// Restores the configured limits now; true if they were reduced.
    pub fn restore(&mut self) -> bool {
        let was = self.reduced();
        self.current = self.configured.clone();
        self.last_oom = None;
        was
    }
}

/// What an engine can hold, for refusing a request it could never serve before it is
/// sent (the engine would answer it with an error after tokenizing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCapacity {
    pub kv_bytes_per_token: u64,
    /// The recurrent states of one sequence, whatever its length (a hybrid model's).
    pub state_bytes_per_sequence: u64,
    /// 0 when the engine did not say.
    pub context_length: u32,
    /// The running engine's KV budget.
    pub budget: u64,
    /// The configured KV budget (`None`: unlimited), larger when the budget was halved
    /// after out-of-memory exits.
    pub configured_budget: Option<u64>,
    /// When the configured limits come back, if they are reduced.
    pub recovers_in: Option<Duration>,
}

/// Why a request cannot be served by the engine as it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unservable {
    /// Not even under the configured limits: the client must ask for less.
    TooLarge { needed: u64, budget: u64 },
    /// Only because the limits are reduced; it fits once they recover.
    LimitsReduced {
        needed: u64,
        budget: u64,
        configured: Option<u64>,
        retry_after: Duration,
    },
}

/// Checks a request's smallest possible KV reservation — the engine's own formula
/// (`mlxd_protocol::request::kv_reservation_tokens`) with the shortest prompt, one token —
/// against the engine's KV budget. `max_tokens` is the effective limit (`None`: to the end
/// of the context, which the engine then reserves whole); with neither it nor the context
/// length known, nothing is.
pub fn check_kv(max_tokens: Option<u64>, cap: &KvCapacity) -> Result<(), Unservable> {
    let context = match cap.context_length {
        0 if max_tokens.is_none() => return Ok(()),
        0 => u64::MAX,
        n => u64::from(n),
    };
    let tokens = mlxd_protocol::request::kv_reservation_tokens(1, max_tokens, context);
    let needed = tokens
        .saturating_mul(cap.kv_bytes_per_token)
        .saturating_add(cap.state_bytes_per_sequence);
    if needed <= cap.budget {
        return Ok(());
    }
    match cap.recovers_in {
        Some(retry_after) if cap.configured_budget.is_none_or(|c| needed <= c) => {
            Err(Unservable::LimitsReduced {
                needed,
                budget: cap.budget,
                configured: cap.configured_budget,
                retry_after,
            })
        }
        _ => Err(Unservable::TooLarge {
            needed,
            budget: cap.budget,
        }),
    }
}

/// Whether a ready engine still shows signs of life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Look again after this long.
    Alive { check_in: Duration },
    /// Silent for `silent`, at least the hang timeout.
    Hung { silent: Duration },
}

/// The hang rule: an engine whose last heartbeat (`Ready` or `Stats`) is `timeout` or
/// more ago is hung. With no heartbeat at all it is judged from now.
pub fn hang_verdict(heartbeat: Option<Instant>, now: Instant, timeout: Duration) -> Liveness {
    let last = heartbeat.unwrap_or(now);
    let silent = now.saturating_duration_since(last);
    if silent >= timeout {
        Liveness::Hung { silent }
    } else {
        // At least 10 ms, so a tiny timeout cannot spin the actor.
        Liveness::Alive {
            check_in: (timeout - silent).max(Duration::from_millis(10)),
        }
    }
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

    #[test]
    fn a_load_that_cannot_succeed_is_not_retried_nor_counted() {
        let p = policy();
        let mut h = CrashHistory::default();
        let cannot = ExitCause::CannotLoad {
            detail: "no such model".into(),
        };
        for _ in 0..10 {
            assert_eq!(
                h.on_exit(&p, &cannot, Instant::now(), None),
                Decision::DoNotRetry
            );
        }
        assert_eq!(h.recent(), 0);
        let failed = ExitCause::LoadFailed {
            detail: "exit code 2 before ready".into(),
        };
        assert_eq!(
            h.on_exit(&p, &failed, Instant::now(), None),
            Decision::Restart {
                delay: Duration::from_millis(250),
                attempt: 0
            }
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

    fn limits(kv: u64, batch: u32) -> Limits {
        Limits {
            max_batch_size: Some(batch),
            kv_budget_bytes: Some(kv),
            context_length: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reduced_limits_recover_after_a_stable_period() {
        let p = RestartPolicy {
            limits_recovery: Duration::from_secs(600),
            ..policy()
        };
        let mut l = ModelLimits::new(limits(1 << 20, 8));
        assert!(!l.reduced());
        assert_eq!(l.recovers_at(&p), None);
        l.on_oom(Instant::now(), None);
        l.on_oom(Instant::now(), None);
        assert_eq!(l.current(), &limits(1 << 18, 2));
        tokio::time::advance(Duration::from_secs(599)).await;
        assert!(!l.recover_if_stable(&p, Instant::now()));
        // Another OOM restarts the clock.
        l.on_oom(Instant::now(), None);
        tokio::time::advance(Duration::from_secs(599)).await;
        assert!(!l.recover_if_stable(&p, Instant::now()));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(l.recover_if_stable(&p, Instant::now()));
        assert_eq!(l.current(), &limits(1 << 20, 8));
        assert!(!l.reduced());
    }

    #[test]
    fn an_oom_halves_what_the_engine_ran_with_where_the_launch_left_limits_unset_or_too_large() {
        // Nothing configured: the engine chose 128 rows and a 40 GiB budget from the GPU.
        let mut l = ModelLimits::new(Limits::default());
        let reported = limits(40 << 30, 128);
        assert_eq!(
            l.on_oom(Instant::now(), Some(&reported)),
            Some(&limits(20 << 30, 64))
        );
        assert!(l.reduced());
        assert!(l.restore());
        assert_eq!(l.current(), &Limits::default());
        // Configured above what the GPU held (cut to 40 GiB), batch configured at 32: the
        // smaller of each is halved.
        let mut l = ModelLimits::new(limits(200 << 30, 32));
        assert_eq!(
            l.on_oom(Instant::now(), Some(&reported)),
            Some(&limits(20 << 30, 16))
        );
        // Without a report (an engine that never was ready) nothing unset can shrink.
        let mut l = ModelLimits::new(Limits::default());
        assert_eq!(l.on_oom(Instant::now(), None), None);
        assert!(!l.reduced());
    }

    #[test]
    fn restore_brings_back_the_configured_limits() {
        let mut l = ModelLimits::new(limits(1024, 4));
        assert!(!l.restore());
        l.on_oom(Instant::now(), None);
        assert!(l.reduced());
        assert!(l.restore());
        assert_eq!(l.current(), l.configured());
    }

    #[test]
    fn kv_check_tells_too_large_from_limits_reduced() {
        let cap = KvCapacity {
            kv_bytes_per_token: 10,
            state_bytes_per_sequence: 0,
            context_length: 2048,
            budget: 1000,
            configured_budget: Some(4000),
            recovers_in: Some(Duration::from_secs(60)),
        };
        assert_eq!(check_kv(Some(99), &cap), Ok(()));
        assert_eq!(
            check_kv(Some(100), &cap),
            Err(Unservable::LimitsReduced {
                needed: 1010,
                budget: 1000,
                configured: Some(4000),
                retry_after: Duration::from_secs(60)
            })
        );
        assert_eq!(
            check_kv(Some(1000), &cap),
            Err(Unservable::TooLarge {
                needed: 10010,
                budget: 1000
            })
        );
        let full = KvCapacity {
            recovers_in: None,
            budget: 4000,
            ..cap
        };
        assert_eq!(
            check_kv(Some(1000), &full),
            Err(Unservable::TooLarge {
                needed: 10010,
                budget: 4000
            })
        );
        // The context length caps the reservation.
        let big = KvCapacity {
            budget: 20480,
            ..full
        };
        assert_eq!(check_kv(Some(u64::MAX), &big), Ok(()));
        // Without a limit the engine reserves the whole context.
        assert_eq!(check_kv(None, &big), Ok(()));
        assert_eq!(
            check_kv(None, &full),
            Err(Unservable::TooLarge {
                needed: 20480,
                budget: 4000
            })
        );
        let unknown = KvCapacity {
            context_length: 0,
            ..full
        };
        assert_eq!(check_kv(None, &unknown), Ok(()));
        // A hybrid model's fixed state per sequence counts on top of its tokens.
        let hybrid = KvCapacity {
            state_bytes_per_sequence: 20480 - 10 * 1001 + 1,
            ..big
        };
        assert_eq!(
            check_kv(Some(1000), &hybrid),
            Err(Unservable::TooLarge {
                needed: 20481,
                budget: 20480
            })
        );
    }

    #[test]
    fn hang_verdict_counts_from_the_last_heartbeat() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(30);
        assert_eq!(
            hang_verdict(Some(t0), t0 + Duration::from_secs(10), timeout),
            Liveness::Alive {
                check_in: Duration::from_secs(20)
            }
        );
        assert_eq!(
            hang_verdict(Some(t0), t0 + Duration::from_secs(31), timeout),
            Liveness::Hung {
                silent: Duration::from_secs(31)
            }
        );
        assert_eq!(
            hang_verdict(None, t0, timeout),
            Liveness::Alive { check_in: timeout }
        );
        assert_eq!(
            hang_verdict(Some(t0), t0 + timeout - Duration::from_millis(1), timeout),
            Liveness::Alive {
                check_in: Duration::from_millis(10)
            }
        );
    }
}
