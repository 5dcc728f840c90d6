//! A supervised engine whose GPU is full and whose steps crawl ends itself as out of memory.
//!
//! On CUDA, MLX serves buffers created on the host from managed memory, which the driver pages
//! out to the host instead of failing an allocation. On an H100 whose memory another process
//! took (BENCHMARKS-soak.md section 6a) the engine therefore never saw an allocation error: the
//! device showed 0 MiB free, and its steps went on finishing, tens of times slower, for minutes
//! (too slowly to serve, too often for the step watch, `super::step_watch`), while every other
//! engine on the GPU slowed down too. This watch takes that state for what it is, out of
//! memory: it reports `FatalKind::OutOfMemory` and exits, so that the supervisor halves the
//! limits, restarts the engine (whose KV budget then comes from what is free) and resumes its
//! streams.
//!
//! It fires only when three signals hold together for a whole window (`memory_watch`, default
//! [`DEFAULT_MEMORY_WATCH`](crate::runtime::DEFAULT_MEMORY_WATCH)), and a fourth at its end:
//! - the device's free memory is under [`low_free_bound`]: near zero. Alone it is no fault: an
//!   engine whose own buffers fill the device is healthy, and its steps keep their speed;
//! - the decode steps ([`RuntimeStats::decode_steps`], the batch's forward pass without the
//!   prefill that may follow it, timed per square root of its rows) take on average at least
//!   `memory_watch_slowdown` times
//!   (default [`DEFAULT_MEMORY_WATCH_SLOWDOWN`](crate::runtime::DEFAULT_MEMORY_WATCH_SLOWDOWN))
//!   their usual time, learned while the device had memory free. Alone it is no fault either:
//!   a large batch of long contexts is slower, but not by that much;
//! - this engine presses on the memory: the tokens its admitted sequences hold, their KV
//!   positions ([`RuntimeStats::running_tokens`]), grew over the window and never fell
//!   between two looks. Every engine on a thrashing GPU crawls (the H100 run's bystander
//!   engine, with a small budget, took 7.6 s for requests of 0.04-0.2 s), but restarting
//!   smaller helps only the one whose demand outgrew the device: a bystander restarted while
//!   nothing is free would fail its load. A bystander's requests come and go, so its tokens
//!   fall at each one's end; the crawling engine's long streams only grow. (An engine whose
//!   streams end within every window while it crawls is therefore not caught; the H100 run's
//!   streams lasted minutes.)
//! - this engine holds memory that a smaller restart gives back: its KV
//!   ([`RuntimeStats::kv_bytes`]: the batch, prefills in progress and the prefix cache) is at
//!   least [`held_bound`], a [`HELD_SHARE`]th of the device, when the watch fires. The third
//!   signal alone did not tell a bystander from the engine that fills the device: in the
//!   H100 run of 2026-12-05 (`scripts/soak/gpu_oom.py`) one of the bystander's 16-token
//!   requests crawled for 34 s, its tokens grew the whole window, and the watch restarted it,
//!   which freed nothing, while the victim beside it held 5.5 GiB of KV. See [`HELD_SHARE`]
//!   for the figures.
//!
//! Until it has learned the usual time (from [`MIN_USUAL_STEPS`] decode steps with memory
//! free) it never fires; an idle engine, which finishes no step, never fires.
//!
//! Only where the device reports its free memory: CUDA. The CPU's memory is the system's (the
//! kernel's OOM killer, or an allocation error, ends an engine that runs out of it) and so is
//! Metal's, which MLX reports without a free figure; the watch is off there.
//!
//! The free memory is read on the watch's own thread, not the model thread's (which, crawling,
//! may not be back for seconds): MLX's CUDA `device_info` (ml-explore/mlx,
//! `mlx/backend/cuda/device_info.cpp`, read for this) keeps the device's properties in a
//! function-local static (initialised once, thread-safe), initialises NVML once, fills a
//! `thread_local` copy for each call and reads the memory through NVML, whose calls are
//! thread-safe (its fallback, `cudaMemGetInfo`, is too); MLX's default device, which
//! [`crate::device::device_memory`] asks for, is set once before the model loads.
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cache::DeviceMemory;
use crate::runtime::RuntimeStats;

/// The least free memory [`low_free_bound`] takes for near zero: a CUDA device the driver is
/// paging for shows tens of MiB free at most (`nvidia-smi` showed 0.0 GiB throughout the
/// H100 run), while one step's activations of even a small model need more.
pub const LOW_FREE_FLOOR: u64 = 256 << 20;

/// Below this much free memory a device of `total` bytes is full: 1 % of it (800 MiB of an
/// H100's 80 GB), at least [`LOW_FREE_FLOOR`]. A healthy engine leaves far more: its KV
/// budget keeps a tenth of the device as headroom (`crate::cache::device_headroom`).
pub fn low_free_bound(total: u64) -> u64 {
    (total / 100).max(LOW_FREE_FLOOR)
}

/// Decode steps with memory free before the usual step time counts: a few, since an engine
/// handed many long prompts at once decodes its first streams beside the others' prefill for
/// only seconds before a full device would slow it. The first steps of a GPU compile kernels
/// and are slower, which only makes the watch less eager.
pub const MIN_USUAL_STEPS: u64 = 8;

/// How much of the usual step time each look with new decode steps replaces, once learned: it
/// follows the batch and the contexts as they grow, over tens of seconds.
pub const USUAL_WEIGHT: f64 = 0.05;

/// Decode steps a window must hold before its average is judged: one slow step is no crawl.
pub const MIN_SLOW_STEPS: u64 = 2;

/// The share of the device's memory an engine's KV must hold for the watch to end it: a
/// 32nd (2.49 GiB of an H100's 79.6 GiB). In the H100 run the victim, whose 64 long streams
/// filled the device, held 5.5 GiB of KV (more than twice the bound), 4.5-5.2 GiB once
/// restarted with halved limits and mostly 3.4 GiB after a second halving, while the
/// bystander (16-token requests, at most 4 rows) held tens of MiB. Its whole KV budget,
/// 2 GiB, is under the bound: an engine whose budget is a 32nd of the device or less is never
/// ended by the watch, and an engine the watch ends is ended at most a few times in a row, as
/// each restart halves its budget until it holds less than the bound. KV rather than MLX's
/// active memory less the weights: the KV is what the halved limits bound (the budget and the
/// batch); it changes only as sequences come and go, where a prefill's activations come and go
/// within a step (the victim's active memory went from 8.3 to 5.4 GiB in a second while its
/// KV stayed at 3.4 GiB); and the model thread publishes it in an atomic counter.
pub const HELD_SHARE: u64 = 32;

/// The least KV an engine on a device of `total` bytes must hold for the watch to end it.
pub fn held_bound(total: u64) -> u64 {
    total / HELD_SHARE
}

/// The exit status of an engine the watch ended (as for MLX's own out-of-memory error).
pub const EXIT_OUT_OF_MEMORY: i32 = 3;

/// What the watch is asked to hold to (`memory_watch`, `memory_watch_slowdown`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// How long the signals must hold.
    pub window: Duration,
    /// How many times its usual time a decode step must take on average.
    pub slowdown: f64,
}

/// One look at the engine: the device's memory, the decode steps' counters, the running
/// sequences' tokens and the KV it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at: Instant,
    pub memory: DeviceMemory,
    pub decode_steps: u64,
    pub decode_nanos: u64,
    pub running_tokens: u64,
    /// KV bytes held ([`RuntimeStats::kv_bytes`]).
    pub kv_bytes: u64,
}

impl Sample {
    fn low(&self) -> bool {
        self.memory.free < low_free_bound(self.memory.total)
    }

    /// The decode steps since `earlier`, and their average time (`None` without one).
    fn steps_since(&self, earlier: &Sample) -> (u64, Option<Duration>) {
        let steps = self.decode_steps.saturating_sub(earlier.decode_steps);
        let nanos = self.decode_nanos.saturating_sub(earlier.decode_nanos);
        (
            steps,
            (steps > 0).then(|| Duration::from_nanos(nanos / steps)),
        )
    }
}

/// A decode step's usual time, learned while the device had memory free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usual {
    steps: u64,
    seconds: f64,
}

impl Usual {
    const NONE: Usual = Usual {
        steps: 0,
        seconds: 0.0,
    };

    /// The usual time with `steps` more steps that took `each` on average: their mean until
    /// [`MIN_USUAL_STEPS`], then a moving average ([`USUAL_WEIGHT`] per look).
    fn learn(self, steps: u64, each: Option<Duration>) -> Usual {
        let Some(each) = each else {
            return self;
        };
        let each = each.as_secs_f64();
        let seconds = if self.steps < MIN_USUAL_STEPS {
            (self.seconds * self.steps as f64 + each * steps as f64) / (self.steps + steps) as f64
        } else {
            self.seconds + USUAL_WEIGHT * (each - self.seconds)
        };
        Usual {
            steps: self.steps + steps,
            seconds,
        }
    }

    fn learned(&self) -> Option<Duration> {
        (self.steps >= MIN_USUAL_STEPS).then(|| Duration::from_secs_f64(self.seconds))
    }
}

/// What the watch remembers between looks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watch {
    last: Sample,
    usual: Usual,
    /// The first look of the current run of looks with the device full, once the usual time
    /// is known; moved up when the steps since were of normal speed or the running tokens fell.
    full_since: Option<Sample>,
}

impl Watch {
    pub fn new(first: Sample) -> Watch {
        Watch {
            last: first,
            usual: Usual::NONE,
            full_since: None,
        }
    }

    /// The usual decode step time, once learned.
    pub fn usual(&self) -> Option<Duration> {
        self.usual.learned()
    }
}

/// Why the watch fired: the figures its message names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    pub free: u64,
    pub bound: u64,
    /// The decode steps' average time over the window, and the usual one.
    pub step: Duration,
    pub usual: Duration,
    pub steps: u64,
    pub lasted: Duration,
    /// How many tokens the running sequences gained over the window.
    pub tokens_gained: u64,
    /// The KV the engine holds, and the least it must hold ([`held_bound`]).
    pub held: u64,
    pub held_bound: u64,
}

impl Pressure {
    /// The fatal report's message.
    pub fn message(&self) -> String {
        let times = self.step.as_secs_f64() / self.usual.as_secs_f64().max(1e-9);
        format!(
            "out of memory: the device has {} MiB free (under {} MiB for {} s) and its decode \
             steps take {times:.0}× their usual time ({:.1} ms against {:.1} ms per √row, {} \
             steps; memory_watch) while its sequences gained {} tokens of KV and it holds {} \
             MiB of KV (at least {} MiB, 1/{HELD_SHARE} of the device, which a smaller restart \
             gives back): most likely another process holds the GPU's memory and the driver \
             pages this engine's buffers out instead of failing an allocation",
            self.free >> 20,
            self.bound >> 20,
            self.lasted.as_secs(),
            self.step.as_secs_f64() * 1e3,
            self.usual.as_secs_f64() * 1e3,
            self.steps,
            self.tokens_gained,
            self.held >> 20,
            self.held_bound >> 20,
        )
    }
}

/// One look at `now`: what to remember, and the pressure when the device has been full, the
/// decode steps `bounds.slowdown` times their usual time and the running tokens growing for
/// `bounds.window`, and the engine now holds at least [`held_bound`] of KV.
pub fn look(watch: Watch, now: Sample, bounds: Bounds) -> (Watch, Option<Pressure>) {
    let mut next = Watch { last: now, ..watch };
    if !now.low() {
        next.full_since = None;
        // Only steps between two looks with memory free teach the usual time.
        if !watch.last.low() {
            let (steps, each) = now.steps_since(&watch.last);
            next.usual = watch.usual.learn(steps, each);
        }
        return (next, None);
    }
    let (Some(usual), Some(since)) = (watch.usual.learned(), watch.full_since) else {
        // Without a usual time, never; else the window starts now.
        next.full_since = watch.usual.learned().map(|_| now);
        return (next, None);
    };
    if now.running_tokens < watch.last.running_tokens {
        // Sequences ended: not an engine whose demand outgrows the device (or not only).
        next.full_since = Some(now);
        return (next, None);
    }
    let lasted = now.at.saturating_duration_since(since.at);
    let (steps, each) = now.steps_since(&since);
    let Some(step) = each.filter(|_| lasted >= bounds.window && steps >= MIN_SLOW_STEPS) else {
        return (next, None);
    };
    if step.as_secs_f64() < usual.as_secs_f64() * bounds.slowdown {
        // Full, but the steps keep their speed: the window starts over.
        next.full_since = Some(now);
        return (next, None);
    }
    if now.running_tokens <= since.running_tokens {
        // Not grown yet: waits for it, or for a look that ends the window.
        return (next, None);
    }
    let held_bound = held_bound(now.memory.total);
    if now.kv_bytes < held_bound {
        // A bystander of the engine that fills the device: restarting it smaller frees next
        // to nothing. Waits, as above, in case it comes to hold more.
        return (next, None);
    }
    let pressure = Pressure {
        free: now.memory.free,
        bound: low_free_bound(now.memory.total),
        step,
        usual,
        steps,
        lasted,
        tokens_gained: now.running_tokens - since.running_tokens,
        held: now.kv_bytes,
        held_bound,
    };
    (next, Some(pressure))
}

/// Says when the device fills up or has memory free again, so that a log shows what the
/// watch judged (once per change: a device at the bound says it at most once a look).
fn log_transition(now: &Sample, usual: Option<Duration>) {
    let free_mib = now.memory.free >> 20;
    if !now.low() {
        tracing::info!(free_mib, "the device has memory free again");
        return;
    }
    match usual {
        Some(usual) => tracing::warn!(
            free_mib,
            usual_step_ms = usual.as_secs_f64() * 1e3,
            "the device's memory is full: watching this engine's decode steps and tokens"
        ),
        None => tracing::warn!(
            free_mib,
            "the device's memory is full before this engine's usual decode step time was \
             learned: the memory-pressure watch cannot judge its steps"
        ),
    }
}

/// Watches `stats` and the device's memory from a thread of its own for the life of the
/// process; `on_pressure` gets the message once, when the watch fires. Returns false, starting
/// nothing, where the device does not report its free memory.
pub fn spawn(
    stats: Arc<RuntimeStats>,
    bounds: Bounds,
    on_pressure: Box<dyn FnOnce(String) + Send>,
) -> std::io::Result<bool> {
    let stand_in = match crate::fault::device_memory_override() {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "the memory-pressure watch is off");
            return Ok(false);
        }
    };
    let kv_scale = match crate::fault::kv_scale() {
        Ok(scale) => scale,
        Err(e) => {
            tracing::warn!(error = %e, "the memory-pressure watch is off");
            return Ok(false);
        }
    };
    let first = match crate::fault::observed_memory(stand_in) {
        Ok(Some(memory)) => memory,
        Ok(None) => return Ok(false),
        Err(e) => {
            tracing::warn!(error = %e, "the memory-pressure watch is off");
            return Ok(false);
        }
    };
    let sample = move |memory| Sample {
        at: Instant::now(),
        memory,
        decode_steps: stats.decode_steps.load(Ordering::Relaxed),
        decode_nanos: stats.decode_nanos.load(Ordering::Relaxed),
        running_tokens: stats.running_tokens.load(Ordering::Relaxed),
        kv_bytes: stats
            .kv_bytes
            .load(Ordering::Relaxed)
            .saturating_mul(kv_scale),
    };
    let period = (bounds.window / 4).clamp(Duration::from_millis(100), Duration::from_secs(1));
    tracing::info!(
        window_s = bounds.window.as_secs_f64(),
        slowdown = bounds.slowdown,
        low_free_mib = low_free_bound(first.total) >> 20,
        held_kv_mib = held_bound(first.total) >> 20,
        "memory-pressure watch on"
    );
    std::thread::Builder::new()
        .name("memory-watch".into())
        .spawn(move || {
            let mut watch = Watch::new(sample(first));
            let mut unreadable = false;
            loop {
                std::thread::sleep(period);
                let memory = match crate::fault::observed_memory(stand_in) {
                    Ok(Some(memory)) => memory,
                    // A device that stops reporting is judged when it reports again.
                    Ok(None) => continue,
                    Err(e) => {
                        if !std::mem::replace(&mut unreadable, true) {
                            tracing::warn!(error = %e, "the memory-pressure watch cannot read the device's memory");
                        }
                        continue;
                    }
                };
                let now = sample(memory);
                if now.low() != watch.last.low() {
                    log_transition(&now, watch.usual());
                }
                let (next, pressure) = look(watch, now, bounds);
                watch = next;
                if let Some(pressure) = pressure {
                    on_pressure(pressure.message());
                    return;
                }
            }
        })
        .map(|_| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    const BOUNDS: Bounds = Bounds {
        window: Duration::from_secs(30),
        slowdown: 10.0,
    };

    /// Drives the watch through looks a second apart; each decode step adds [`ROWS`] tokens
    /// (the long streams of a crawling engine), unless the test sets `tokens`. The engine
    /// holds [`VICTIM_KV`] unless the test sets `kv`.
    struct Drive {
        watch: Watch,
        t: Instant,
        steps: u64,
        nanos: u64,
        tokens: u64,
        kv: u64,
        looks: usize,
    }

    /// Rows in the crawling engine's batch (the H100 run's).
    const ROWS: u64 = 23;
    /// The KV the H100 run's victim held while the device was full (5.5 GiB).
    const VICTIM_KV: u64 = 5_907_447_808;

    impl Drive {
        fn new() -> Drive {
            let t = Instant::now();
            let first = Sample {
                at: t,
                memory: free(40 * GIB),
                decode_steps: 0,
                decode_nanos: 0,
                running_tokens: 0,
                kv_bytes: 0,
            };
            Drive {
                watch: Watch::new(first),
                t,
                steps: 0,
                nanos: 0,
                tokens: 0,
                kv: VICTIM_KV,
                looks: 0,
            }
        }

        /// `n` looks a second apart with `free` bytes free and `steps` steps of `ms` each.
        fn looks(&mut self, n: usize, free_bytes: u64, steps: u64, ms: u64) -> Option<Pressure> {
            for _ in 0..n {
                self.t += Duration::from_secs(1);
                self.steps += steps;
                self.nanos += steps * ms * 1_000_000;
                self.tokens += steps * ROWS;
                self.looks += 1;
                let now = Sample {
                    at: self.t,
                    memory: free(free_bytes),
                    decode_steps: self.steps,
                    decode_nanos: self.nanos,
                    running_tokens: self.tokens,
                    kv_bytes: self.kv,
                };
                let (next, pressure) = look(self.watch, now, BOUNDS);
                self.watch = next;
                if pressure.is_some() {
                    return pressure;
                }
            }
            None
        }

        /// A healthy engine: 10 s of 50 steps a second at 20 ms each, 40 GiB free.
        fn healthy() -> Drive {
            let mut d = Drive::new();
            assert_eq!(d.looks(10, 40 * GIB, 50, 20), None);
            assert_eq!(d.watch.usual(), Some(Duration::from_millis(20)));
            d
        }
    }

    fn free(bytes: u64) -> DeviceMemory {
        DeviceMemory {
            free: bytes,
            total: 80 * GIB,
        }
    }

    #[test]
    fn the_bound_is_a_hundredth_of_the_device_at_least_256_mib() {
        assert_eq!(low_free_bound(80 * GIB), 80 * GIB / 100);
        assert_eq!(low_free_bound(4 * GIB), LOW_FREE_FLOOR);
        assert_eq!(low_free_bound(0), 256 * MIB);
    }

    #[test]
    fn the_held_bound_is_a_32nd_of_the_device_above_the_bystanders_budget() {
        assert_eq!(held_bound(80 * GIB), 2560 * MIB);
        // An H100 as NVML reports it: 81559 MiB.
        let h100 = 81559 * MIB;
        assert_eq!(held_bound(h100) >> 20, 2548);
        // The H100 run's bystander could not reach it with its whole budget; the victim held
        // more than twice it.
        assert!(2 * GIB < held_bound(h100) && VICTIM_KV > 2 * held_bound(h100));
    }

    #[test]
    fn a_full_device_with_crawling_steps_fires_after_the_window() {
        let mut d = Drive::healthy();
        // The crawl of the H100 run: 0 MiB free, a step every few seconds.
        let fired = d.looks(60, 0, 1, 0).or_else(|| d.looks(60, 0, 0, 0));
        assert_eq!(fired, None, "steps of 0 ms are no crawl");
        let mut d = Drive::healthy();
        let mut fired = None;
        for _ in 0..40 {
            // One step of 2 s every other look.
            fired = d.looks(1, 0, 1, 2_000).or_else(|| d.looks(1, 0, 0, 0));
            if fired.is_some() {
                break;
            }
        }
        let p = fired.expect("the crawl fires");
        // The window starts at the first full look (look 11); it fires at the first look at
        // least 30 s later.
        assert_eq!(d.looks, 41, "{p:?}");
        assert_eq!(
            (p.free, p.step, p.usual),
            (0, Duration::from_secs(2), Duration::from_millis(20))
        );
        assert!(
            p.lasted >= BOUNDS.window && p.steps >= MIN_SLOW_STEPS,
            "{p:?}"
        );
        let m = p.message();
        assert!(
            m.starts_with("out of memory: the device has 0 MiB free (under 819 MiB for 30 s)")
                && m.contains(
                    "take 100× their usual time (2000.0 ms against 20.0 ms per √row, 15 steps"
                )
                && m.contains("it holds 5633 MiB of KV (at least 2560 MiB, 1/32 of the device"),
            "{m}"
        );
    }

    #[test]
    fn a_full_device_with_steps_of_normal_speed_never_fires() {
        let mut d = Drive::healthy();
        // The engine's own buffers fill the device; its steps get a little slower as it grows.
        assert_eq!(d.looks(600, 100 * MIB, 50, 40), None);
        assert_eq!(d.looks(600, 0, 30, 60), None);
    }

    #[test]
    fn slow_steps_with_memory_free_never_fire() {
        let mut d = Drive::healthy();
        assert_eq!(d.looks(600, 2 * GIB, 1, 5_000), None);
    }

    #[test]
    fn the_full_device_must_last_the_window() {
        let mut d = Drive::healthy();
        // 29 s full and crawling, a look with memory free, 29 s again: never 30 s in a row.
        for _ in 0..10 {
            assert_eq!(d.looks(29, 0, 1, 3_000), None);
            assert_eq!(d.looks(1, 40 * GIB, 0, 0), None);
        }
        // And one that lasts fires.
        assert!(d.looks(40, 0, 1, 3_000).is_some());
    }

    #[test]
    fn one_slow_step_is_no_crawl() {
        let mut d = Drive::healthy();
        // The step that ends at the first full look is before the window.
        assert_eq!(d.looks(1, 0, 1, 40_000), None);
        assert_eq!(d.looks(100, 0, 0, 0), None);
        assert_eq!(d.looks(1, 0, 1, 40_000), None, "one step in the window");
        assert!(d.looks(1, 0, 1, 40_000).is_some(), "a second one");
    }

    #[test]
    fn the_watch_recovers_when_memory_comes_back() {
        let mut d = Drive::healthy();
        assert_eq!(d.looks(20, 0, 1, 2_000), None);
        // The other process exits: memory free, steps fast again; the usual time was not
        // learned from the crawl.
        assert_eq!(d.looks(60, 40 * GIB, 50, 20), None);
        assert_eq!(d.watch.usual(), Some(Duration::from_millis(20)));
        // A later short squeeze does not fire either: the window starts again.
        assert_eq!(d.looks(20, 0, 1, 2_000), None);
    }

    #[test]
    fn without_a_usual_time_it_never_fires() {
        let mut d = Drive::new();
        // Full from the start: nothing learned.
        assert_eq!(d.looks(600, 0, 1, 10_000), None);
        assert_eq!(d.watch.usual(), None);
        // Too few steps with memory free to learn from.
        let mut d = Drive::new();
        assert_eq!(d.looks(1, 40 * GIB, MIN_USUAL_STEPS - 1, 20), None);
        assert_eq!(d.watch.usual(), None);
        assert_eq!(d.looks(600, 0, 1, 10_000), None);
    }

    #[test]
    fn a_bystander_whose_requests_come_and_go_never_fires() {
        let mut d = Drive::healthy();
        // The H100 run's bystander: one short request after another, each crawling for about
        // 8 s; its tokens grow with each, and fall back at its end.
        for _ in 0..100 {
            d.tokens = 0;
            assert_eq!(d.looks(8, 0, 1, 4_000), None);
        }
    }

    #[test]
    fn a_crawling_bystander_holding_little_kv_never_fires() {
        let mut d = Drive::healthy();
        // The H100 run's bystander as the watch saw it: one request crawling through the whole
        // window, its tokens growing at each step, tens of MiB of KV. The three other signals
        // hold; restarting it would free nothing.
        d.kv = 40 * MIB;
        assert_eq!(d.looks(600, 0, 1, 200), None);
        // Just under the bound, still nothing; once it holds the bound, it fires.
        d.kv = held_bound(80 * GIB) - 1;
        assert_eq!(d.looks(60, 0, 1, 200), None);
        d.kv = held_bound(80 * GIB);
        let p = d
            .looks(1, 0, 1, 200)
            .expect("it holds a 32nd of the device");
        assert_eq!((p.held, p.held_bound), (2560 * MIB, 2560 * MIB));
        assert!(p.lasted >= Duration::from_secs(600), "{p:?}");
    }

    #[test]
    fn a_crawl_waits_for_its_kv_to_grow() {
        let mut d = Drive::healthy();
        // Steps that add no token (the test holds the count): full and slow, but not growing.
        let held = d.tokens;
        for _ in 0..60 {
            assert_eq!(d.looks(1, 0, 1, 3_000), None);
            d.tokens = held;
        }
        d.tokens = held + 1;
        let p = d.looks(1, 0, 1, 3_000).expect("it grew");
        assert_eq!(p.tokens_gained, 1);
        assert!(p.lasted >= Duration::from_secs(60), "{p:?}");
    }

    #[test]
    fn an_idle_engine_never_fires() {
        let mut d = Drive::healthy();
        assert_eq!(d.looks(3600, 0, 0, 0), None);
    }

    #[test]
    fn the_usual_time_is_a_mean_then_a_moving_average() {
        let ms = |u: Usual| u.learned().map(|d| (d.as_secs_f64() * 1e3).round() as u64);
        let u = Usual::NONE.learn(MIN_USUAL_STEPS / 2, Some(Duration::from_millis(10)));
        assert_eq!(ms(u), None);
        let u = u.learn(MIN_USUAL_STEPS / 2, Some(Duration::from_millis(30)));
        assert_eq!(ms(u), Some(20));
        // Then each look moves it a twentieth of the way.
        let u = u.learn(100, Some(Duration::from_millis(120)));
        assert_eq!(ms(u), Some(25));
        assert_eq!(u.learn(0, None), u);
    }
}
