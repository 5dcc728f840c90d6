//! Requests that arrive together are admitted together.
//!
//! A burst of requests sent at once (a client's batch, many users at the top of a minute)
//! reaches the runtime's channel over some microseconds. An idle executor wakes on the first
//! and used to start its step with whatever had arrived by then, so a burst of 32 was
//! prefilled in two or three passes of shapes never run before (19 + 13, 25 + 7 in the H100
//! step trace of 2026-12-05); on CUDA each new pass shape costs 85-130 ms of host-side build,
//! a repeated one 7-14 ms. [`gather`] keeps receiving after that wake-up until the channel has
//! been quiet for [`GAP`] (at most [`MAX`]), so the burst is admitted whole. A request alone
//! waits [`GAP`] more, a fraction of any prefill.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

/// Silence on the channel that ends a burst: far longer than the time between two sends
/// of one sender's loop, far shorter than any prefill.
pub const GAP: Duration = Duration::from_micros(200);

/// The longest a wake-up waits for the rest of its burst, however steadily requests come.
pub const MAX: Duration = Duration::from_millis(2);

/// Receives into `waiting` the requests that follow a wake-up until none has come for `gap`
/// or `max` has passed; false once the channel is closed (what arrived is kept).
pub fn gather<T>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    waiting: &mut VecDeque<T>,
    gap: Duration,
    max: Duration,
) -> bool {
    let start = Instant::now();
    let mut last = start;
    loop {
        match rx.try_recv() {
            Ok(item) => {
                waiting.push_back(item);
                last = Instant::now();
            }
            Err(mpsc::error::TryRecvError::Empty) => {
                let now = Instant::now();
                if now.duration_since(last) >= gap || now.duration_since(start) >= max {
                    return true;
                }
                std::thread::yield_now();
            }
            Err(mpsc::error::TryRecvError::Disconnected) => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wide margins (a gap of 150 ms against sends 1 ms apart), so that a loaded machine's
    /// scheduling does not decide the outcome.
    #[test]
    fn a_burst_is_gathered_and_what_comes_after_the_gap_is_not() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        tx.send(0).unwrap();
        let sender = std::thread::spawn(move || {
            for i in 1..=5 {
                std::thread::sleep(Duration::from_millis(1));
                tx.send(i).unwrap();
            }
            std::thread::sleep(Duration::from_millis(800));
            tx.send(99).unwrap();
            tx
        });
        let mut waiting = VecDeque::new();
        assert!(gather(
            &mut rx,
            &mut waiting,
            Duration::from_millis(150),
            Duration::from_secs(5)
        ));
        assert_eq!(Vec::from(waiting), [0, 1, 2, 3, 4, 5]);
        let tx = sender.join().unwrap();
        drop(tx);
        let mut rest = VecDeque::new();
        assert!(!gather(
            &mut rx,
            &mut rest,
            Duration::from_millis(150),
            Duration::from_secs(5)
        ));
        assert_eq!(
            Vec::from(rest),
            [99],
            "kept, and the closed channel reported"
        );
    }

    #[test]
    fn a_steady_stream_is_cut_at_the_maximum() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sender = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = tx.send(());
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        let started = Instant::now();
        let mut waiting = VecDeque::new();
        assert!(gather(
            &mut rx,
            &mut waiting,
            Duration::from_millis(500),
            Duration::from_millis(100)
        ));
        let took = started.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sender.join().unwrap();
        assert!(
            took < Duration::from_millis(450),
            "cut at the maximum, not the gap: {took:?}"
        );
        assert!(!waiting.is_empty());
    }
}
