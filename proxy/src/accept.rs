//! Accept-loop back-off. When `accept` fails (out of file descriptors, out of memory),
//! retrying at once spins and floods the log; this waits longer after each consecutive
//! failure (10 ms doubling to 1 s) and logs one line per episode, then at most one
//! summary every 10 s, then one line when accepting works again. Pure; `server.rs` obeys.

use std::time::Duration;

use tokio::time::Instant;

const FIRST_DELAY: Duration = Duration::from_millis(10);
const MAX_DELAY: Duration = Duration::from_secs(1);
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub struct AcceptBackoff {
    /// Consecutive failures.
    failures: u32,
    /// Failures since the last log line.
    unlogged: u64,
    last_log: Option<Instant>,
}

/// What to do after a failed accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub delay: Duration,
    /// `Some(n)`: log now, covering `n` failures (this one included).
    pub log: Option<u64>,
}

impl AcceptBackoff {
    pub fn failure(&mut self, now: Instant) -> Failure {
        let delay = FIRST_DELAY
            .saturating_mul(1u32.checked_shl(self.failures.min(16)).unwrap_or(u32::MAX))
            .min(MAX_DELAY);
        self.failures = self.failures.saturating_add(1);
        self.unlogged += 1;
        let due = self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= LOG_EVERY);
        let log = due.then(|| {
            self.last_log = Some(now);
            std::mem::take(&mut self.unlogged)
        });
        Failure { delay, log }
    }

    /// An accept worked; returns the failures of the episode that just ended, if any.
    pub fn success(&mut self) -> Option<u32> {
        let n = std::mem::take(&mut self.failures);
        self.unlogged = 0;
        self.last_log = None;
        (n > 0).then_some(n)
    }
}

/// The default connection cap: 1024, or fewer when the open-file limit is low — each
/// proxied request holds a client socket and an engine socket, and 64 descriptors stay
/// free for engines, logs and the listener.
pub fn default_max_connections(open_files: u64) -> usize {
    let by_fds = open_files.saturating_sub(64) / 2;
    usize::try_from(by_fds)
        .unwrap_or(usize::MAX)
        .clamp(16, 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn backs_off_and_logs_once_per_ten_seconds() {
        let mut b = AcceptBackoff::default();
        let mut delays = Vec::new();
        let mut logs = Vec::new();
        for _ in 0..400 {
            let f = b.failure(Instant::now());
            delays.push(f.delay.as_millis() as u64);
            if let Some(n) = f.log {
                logs.push(n);
            }
            tokio::time::advance(f.delay).await;
        }
        assert_eq!(&delays[..8], &[10, 20, 40, 80, 160, 320, 640, 1000]);
        assert!(delays.iter().all(|d| *d <= 1000));
        // About 390 s of failures: a first line, then one summary every 10 s.
        assert!(logs.len() <= 41, "{}", logs.len());
        assert_eq!(logs[0], 1);
        assert_eq!(logs.iter().sum::<u64>() as usize, 400 - b.unlogged as usize);
        assert_eq!(b.success(), Some(400));
        assert_eq!(b.success(), None);
        assert_eq!(b.failure(Instant::now()).delay, Duration::from_millis(10));
    }

    #[test]
    fn the_connection_cap_follows_the_open_file_limit() {
        assert_eq!(default_max_connections(20_000), 1024);
        assert_eq!(default_max_connections(256), 96);
        assert_eq!(default_max_connections(10), 16);
    }
}
