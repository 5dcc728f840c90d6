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
//! - the engine's steps crawl: the decode steps ([`RuntimeStats::decode_steps`], the batch's
//!   forward pass without the prefill that may follow it, timed per square root of its rows)
//!   or the prefill steps ([`RuntimeStats::prefill_steps`], one step's prefill passes, timed
//!   per prefilled token), whichever ran in the window (at least [`MIN_SLOW_STEPS`] of them),
//!   take on average at least `memory_watch_slowdown` times
//!   (default [`DEFAULT_MEMORY_WATCH_SLOWDOWN`](crate::runtime::DEFAULT_MEMORY_WATCH_SLOWDOWN))
//!   their usual time, learned while the device had memory free. Alone it is no fault either:
//!   a large batch of long contexts is slower, but not by that much. Both measures, because a
//!   device may fill before the engine decodes at all: in the H100 run of BENCHMARKS-soak.md
//!   section 6c, 64 prompts of ~6 000 tokens filled the device 15 s into their prefill, which
//!   then crawled for 203-208 s before the first token; a watch of decode steps alone had no
//!   usual time and nothing to judge. When both ran, either crawling is enough. An engine
//!   that prefills beside running streams at every step has neither measure timed (see
//!   [`RuntimeStats::prefill_steps`]) and is not judged until one of them runs alone;
//! - this engine presses on the memory: the tokens its admitted sequences hold, their KV
//!   positions ([`RuntimeStats::running_tokens`], a prompt's as it is prefilled), grew over
//!   the window and never fell between two looks. Every engine on a thrashing GPU crawls (the
//!   H100 run's bystander engine, with a small budget, took 7.6 s for requests of 0.04-0.2 s),
//!   but restarting smaller helps only the one whose demand outgrew the device: a bystander
//!   restarted while nothing is free would fail its load. A bystander's requests come and go,
//!   so its tokens fall at each one's end; the crawling engine's long streams, and its long
//!   prompts as they are prefilled, only grow. (An engine whose streams end within every
//!   window while it crawls is therefore not caught; the H100 run's streams lasted minutes.)
//! - this engine holds memory that a smaller restart gives back: its KV
//!   ([`RuntimeStats::kv_bytes`]: the batch, prefills in progress and the prefix cache) is at
//!   least [`held_bound`], a [`HELD_SHARE`]th of the device, when the watch fires. The third
//!   signal alone did not tell a bystander from the engine that fills the device: in the
//!   H100 run of 2026-12-05 (`scripts/soak/gpu_oom.py`) one of the bystander's 16-token
//!   requests crawled for 34 s, its tokens grew the whole window, and the watch restarted it,
//!   which freed nothing, while the victim beside it held 5.5 GiB of KV. See [`HELD_SHARE`]
//!   for the figures.
//!
//! Each measure's usual time is learned from its own steps between two looks with memory
//! free: decode steps from [`MIN_USUAL_STEPS`] of them, prefill steps from
//! [`MIN_USUAL_PREFILLS`]. Until one is learned the watch never fires; a measure not yet
//! learned is not judged; an idle engine, which finishes no step, never fires. Where the
//! device fills before either is learned the watch cannot judge the engine (it logs so), and
//! there is no other baseline to take: the warm-up (`crate::runtime::warm_up`) runs its passes
//! through the same executor, but with counters of its own, before this watch starts, and its
//! 48-token prompts would teach a time per token above a long prompt's (a short pass pays the
//! weights' reading and the kernels' launches for few tokens; by how much was not measured),
//! and on CUDA one of kernels compiling. The first steps of a GPU compile kernels and are
//! slower, which only makes the watch less eager; the executor leaves out of the prefill
//! measure a step with a pass shape new to the process, which mostly compiles.
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

/// Prefill steps with memory free before the usual time per prefilled token counts: fewer
/// than decode steps, since a prefill step is larger (up to 16 384 tokens on a GPU,
/// `crate::runtime::DEFAULT_GPU_PREFILL_STEP_TOKENS`: the 64 prompts of ~6 000 tokens of
/// section 6c are some 24 such steps in all) and a device that fills during the first
/// prompts leaves few of them with memory free.
pub const MIN_USUAL_PREFILLS: u64 = 4;

/// How much of a usual time each look with new steps of its measure replaces, once learned:
/// it follows the batch, the contexts and the prompts as they change, over tens of seconds.
pub const USUAL_WEIGHT: f64 = 0.05;

/// Steps of a measure a window must hold before their average is judged: one slow step is no
/// crawl.
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
    /// How many times their usual time the decode or prefill steps must take on average.
    pub slowdown: f64,
}

/// What a step's time is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Decode steps, per square root of their rows ([`RuntimeStats::decode_nanos`]).
    Decode,
    /// Prefill steps, per prefilled token ([`RuntimeStats::prefill_nanos`]).
    Prefill,
}

/// One look at the engine: the device's memory, the decode and prefill steps' counters, the
/// running sequences' tokens and the KV it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at: Instant,
    pub memory: DeviceMemory,
    pub decode_steps: u64,
    pub decode_nanos: u64,
    /// Prefill steps timed, the tokens their passes ran and their time
    /// ([`RuntimeStats::prefill_steps`]).
    pub prefill_steps: u64,
    pub prefill_tokens: u64,
    pub prefill_nanos: u64,
    pub running_tokens: u64,
    /// KV bytes held ([`RuntimeStats::kv_bytes`]).
    pub kv_bytes: u64,
}

/// The steps of one measure between two looks.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ran {
    steps: u64,
    /// Prefilled tokens (prefill steps only).
    tokens: u64,
    /// Their average time per unit of the measure (`None` without one).
    each: Option<Duration>,
}

impl Sample {
    fn low(&self) -> bool {
        self.memory.free < low_free_bound(self.memory.total)
    }

    /// The steps of `measure` since `earlier`.
    fn ran_since(&self, earlier: &Sample, measure: Measure) -> Ran {
        let (steps, units, nanos) = match measure {
            Measure::Decode => {
                let steps = self.decode_steps.saturating_sub(earlier.decode_steps);
                let nanos = self.decode_nanos.saturating_sub(earlier.decode_nanos);
                (steps, steps, nanos)
            }
            Measure::Prefill => (
                self.prefill_steps.saturating_sub(earlier.prefill_steps),
                self.prefill_tokens.saturating_sub(earlier.prefill_tokens),
                self.prefill_nanos.saturating_sub(earlier.prefill_nanos),
            ),
        };
        Ran {
            steps,
            tokens: if measure == Measure::Prefill {
                units
            } else {
                0
            },
            each: (steps > 0 && units > 0).then(|| Duration::from_nanos(nanos / units)),
        }
    }
}

/// A measure's usual time per unit, learned while the device had memory free.
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
    /// `min` steps, then a moving average ([`USUAL_WEIGHT`] per look).
    fn learn(self, steps: u64, each: Option<Duration>, min: u64) -> Usual {
        let Some(each) = each else {
            return self;
        };
        let each = each.as_secs_f64();
        let seconds = if self.steps < min {
            (self.seconds * self.steps as f64 + each * steps as f64) / (self.steps + steps) as f64
        } else {
            self.seconds + USUAL_WEIGHT * (each - self.seconds)
        };
        Usual {
            steps: self.steps + steps,
            seconds,
        }
    }

    /// The usual time, once `min` steps taught it.
    fn learned(&self, min: u64) -> Option<Duration> {
        (self.steps >= min).then(|| Duration::from_secs_f64(self.seconds))
    }
}

/// What the watch remembers between looks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watch {
    last: Sample,
    usual: Usual,
    usual_prefill: Usual,
    /// The first look of the current run of looks with the device full, once a usual time is
    /// known; moved up when the steps since were of normal speed or the running tokens fell.
    full_since: Option<Sample>,
}

impl Watch {
    pub fn new(first: Sample) -> Watch {
        Watch {
            last: first,
            usual: Usual::NONE,
            usual_prefill: Usual::NONE,
            full_since: None,
        }
    }

    /// The usual decode step time (per √row), once learned.
    pub fn usual(&self) -> Option<Duration> {
        self.usual.learned(MIN_USUAL_STEPS)
    }

    /// The usual prefill time per prefilled token, once learned.
    pub fn usual_prefill(&self) -> Option<Duration> {
        self.usual_prefill.learned(MIN_USUAL_PREFILLS)
    }

    fn usual_of(&self, measure: Measure) -> Option<Duration> {
        match measure {
            Measure::Decode => self.usual(),
            Measure::Prefill => self.usual_prefill(),
        }
    }

    /// Whether some usual time is known: the watch can judge.
    fn judges(&self) -> bool {
        self.usual().is_some() || self.usual_prefill().is_some()
    }
}

/// How the steps of one measure ran over a window, against their usual time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Crawl {
    pub measure: Measure,
    /// The steps' average time per unit of the measure (per √row, per prefilled token) over
    /// the window, and the usual one.
    pub each: Duration,
    pub usual: Duration,
    pub steps: u64,
    /// The tokens the prefill steps ran (0 for decode steps).
    pub tokens: u64,
}

impl Crawl {
    /// How many times its usual time the measure took.
    pub fn times(&self) -> f64 {
        self.each.as_secs_f64() / self.usual.as_secs_f64().max(1e-12)
    }

    /// What the fatal message says of it.
    fn describe(&self) -> String {
        let times = self.times();
        match self.measure {
            Measure::Decode => format!(
                "its decode steps take {times:.0}× their usual time ({:.1} ms against {:.1} ms \
                 per √row, {} steps; memory_watch)",
                self.each.as_secs_f64() * 1e3,
                self.usual.as_secs_f64() * 1e3,
                self.steps,
            ),
            Measure::Prefill => format!(
                "its prefill passes take {times:.0}× their usual time ({:.1} µs against {:.1} \
                 µs per prefilled token, {} tokens in {} steps; memory_watch)",
                self.each.as_secs_f64() * 1e6,
                self.usual.as_secs_f64() * 1e6,
                self.tokens,
                self.steps,
            ),
        }
    }
}

/// Why the watch fired: the figures its message names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    pub free: u64,
    pub bound: u64,
    /// The measure that crawled (the one furthest over its usual time, if both did).
    pub crawl: Crawl,
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
        format!(
            "out of memory: the device has {} MiB free (under {} MiB for {} s) and {} while its \
             sequences gained {} tokens of KV and it holds {} MiB of KV (at least {} MiB, \
             1/{HELD_SHARE} of the device, which a smaller restart gives back): most likely \
             another process holds the GPU's memory and the driver pages this engine's buffers \
             out instead of failing an allocation",
            self.free >> 20,
            self.bound >> 20,
            self.lasted.as_secs(),
            self.crawl.describe(),
            self.tokens_gained,
            self.held >> 20,
            self.held_bound >> 20,
        )
    }
}

/// One look at `now`: what to remember, and the pressure when the device has been full, the
/// decode or the prefill steps `bounds.slowdown` times their usual time and the running
/// tokens growing for `bounds.window`, and the engine now holds at least [`held_bound`] of KV.
pub fn look(watch: Watch, now: Sample, bounds: Bounds) -> (Watch, Option<Pressure>) {
    let mut next = Watch { last: now, ..watch };
    if !now.low() {
        next.full_since = None;
        // Only steps between two looks with memory free teach the usual times.
        if !watch.last.low() {
            let decode = now.ran_since(&watch.last, Measure::Decode);
            next.usual = watch
                .usual
                .learn(decode.steps, decode.each, MIN_USUAL_STEPS);
            let prefill = now.ran_since(&watch.last, Measure::Prefill);
            next.usual_prefill =
                watch
                    .usual_prefill
                    .learn(prefill.steps, prefill.each, MIN_USUAL_PREFILLS);
        }
        return (next, None);
    }
    let Some(since) = watch.full_since.filter(|_| watch.judges()) else {
        // Without a usual time, never; else the window starts now.
        next.full_since = watch.judges().then_some(now);
        return (next, None);
    };
    if now.running_tokens < watch.last.running_tokens {
        // Sequences ended: not an engine whose demand outgrows the device (or not only).
        next.full_since = Some(now);
        return (next, None);
    }
    let lasted = now.at.saturating_duration_since(since.at);
    if lasted < bounds.window {
        return (next, None);
    }
    // Each measure that has a usual time and ran enough steps in the window.
    let judged: Vec<Crawl> = [Measure::Decode, Measure::Prefill]
        .into_iter()
        .filter_map(|measure| {
            let usual = watch.usual_of(measure)?;
            let ran = now.ran_since(&since, measure);
            let each = ran.each.filter(|_| ran.steps >= MIN_SLOW_STEPS)?;
            Some(Crawl {
                measure,
                each,
                usual,
                steps: ran.steps,
                tokens: ran.tokens,
            })
        })
        .collect();
    if judged.is_empty() {
        // Nothing to judge yet: waits for steps.
        return (next, None);
    }
    let Some(crawl) = judged
        .into_iter()
        .filter(|c| c.times() >= bounds.slowdown)
        .max_by(|a, b| a.times().total_cmp(&b.times()))
    else {
        // Full, but the steps keep their speed: the window starts over.
        next.full_since = Some(now);
        return (next, None);
    };
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
        crawl,
        lasted,
        tokens_gained: now.running_tokens - since.running_tokens,
        held: now.kv_bytes,
        held_bound,
    };
    (next, Some(pressure))
}

/// Says when the device fills up or has memory free again, so that a log shows what the
/// watch judged (once per change: a device at the bound says it at most once a look).
fn log_transition(now: &Sample, watch: &Watch) {
    let free_mib = now.memory.free >> 20;
    if !now.low() {
        tracing::info!(free_mib, "the device has memory free again");
        return;
    }
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e3);
    let us = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6);
    let usual_step_ms = ms(watch.usual());
    let usual_prefill_us_per_token = us(watch.usual_prefill());
    let judged = match (watch.usual(), watch.usual_prefill()) {
        (Some(_), Some(_)) => "decode steps, prefill passes",
        (Some(_), None) => "decode steps",
        (None, Some(_)) => "prefill passes",
        (None, None) => {
            tracing::warn!(
                free_mib,
                "the device's memory is full before this engine's usual decode step or prefill \
                 time was learned: the memory-pressure watch cannot judge its steps"
            );
            return;
        }
    };
    tracing::warn!(
        free_mib,
        usual_step_ms,
        usual_prefill_us_per_token,
        "the device's memory is full: watching this engine's {judged} and tokens"
    );
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
        prefill_steps: stats.prefill_steps.load(Ordering::Relaxed),
        prefill_tokens: stats.prefill_tokens.load(Ordering::Relaxed),
        prefill_nanos: stats.prefill_nanos.load(Ordering::Relaxed),
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
                    log_transition(&now, &watch);
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
    /// (the long streams of a crawling engine), and each prefill step the tokens it ran, unless
    /// the test sets `tokens`. The engine holds [`VICTIM_KV`] unless the test sets `kv`.
    struct Drive {
        watch: Watch,
        t: Instant,
        steps: u64,
        nanos: u64,
        prefill_steps: u64,
        prefill_tokens: u64,
        prefill_nanos: u64,
        tokens: u64,
        kv: u64,
        looks: usize,
    }

    /// Prefill steps of one look: how many, the tokens each ran and the milliseconds each took.
    #[derive(Clone, Copy)]
    struct Prefills {
        steps: u64,
        tokens: u64,
        ms: u64,
    }

    const NO_PREFILL: Prefills = Prefills {
        steps: 0,
        tokens: 0,
        ms: 0,
    };

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
                prefill_steps: 0,
                prefill_tokens: 0,
                prefill_nanos: 0,
                running_tokens: 0,
                kv_bytes: 0,
            };
            Drive {
                watch: Watch::new(first),
                t,
                steps: 0,
                nanos: 0,
                prefill_steps: 0,
                prefill_tokens: 0,
                prefill_nanos: 0,
                tokens: 0,
                kv: VICTIM_KV,
                looks: 0,
            }
        }

        /// `n` looks a second apart with `free` bytes free and `steps` decode steps of `ms`
        /// each.
        fn looks(&mut self, n: usize, free_bytes: u64, steps: u64, ms: u64) -> Option<Pressure> {
            self.mixed(n, free_bytes, steps, ms, NO_PREFILL)
        }

        /// `n` looks a second apart with `free` bytes free and `p` prefill steps each.
        fn prefills(&mut self, n: usize, free_bytes: u64, p: Prefills) -> Option<Pressure> {
            self.mixed(n, free_bytes, 0, 0, p)
        }

        /// `n` looks a second apart with `free` bytes free, `steps` decode steps of `ms` each
        /// and `p` prefill steps.
        fn mixed(
            &mut self,
            n: usize,
            free_bytes: u64,
            steps: u64,
            ms: u64,
            p: Prefills,
        ) -> Option<Pressure> {
            for _ in 0..n {
                self.t += Duration::from_secs(1);
                self.steps += steps;
                self.nanos += steps * ms * 1_000_000;
                self.prefill_steps += p.steps;
                self.prefill_tokens += p.steps * p.tokens;
                self.prefill_nanos += p.steps * p.ms * 1_000_000;
                self.tokens += steps * ROWS + p.steps * p.tokens;
                self.looks += 1;
                let now = Sample {
                    at: self.t,
                    memory: free(free_bytes),
                    decode_steps: self.steps,
                    decode_nanos: self.nanos,
                    prefill_steps: self.prefill_steps,
                    prefill_tokens: self.prefill_tokens,
                    prefill_nanos: self.prefill_nanos,
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

        /// An engine handed long prompts on a free device, before any decode step (the H100
        /// run of section 6c): 5 s of [`PREFILL`] steps, 40 GiB free.
        fn prefilling() -> Drive {
            let mut d = Drive::new();
            assert_eq!(d.prefills(5, 40 * GIB, PREFILL), None);
            assert_eq!(d.watch.usual_prefill(), Some(Duration::from_micros(10)));
            assert_eq!(d.watch.usual(), None, "no decode step yet");
            d
        }
    }

    /// The healthy engine's prefill: two steps a second, each of 8 000 tokens in 80 ms (10 µs
    /// a token).
    const PREFILL: Prefills = Prefills {
        steps: 2,
        tokens: 8000,
        ms: 80,
    };

    /// [`PREFILL`]'s steps, each taking `times` as long.
    fn prefill_slower(times: u64) -> Prefills {
        Prefills {
            ms: PREFILL.ms * times,
            ..PREFILL
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
            (p.free, p.crawl.measure, p.crawl.each, p.crawl.usual),
            (
                0,
                Measure::Decode,
                Duration::from_secs(2),
                Duration::from_millis(20)
            )
        );
        assert!(
            p.lasted >= BOUNDS.window && p.crawl.steps >= MIN_SLOW_STEPS,
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
        let ms = |u: Usual| {
            u.learned(MIN_USUAL_STEPS)
                .map(|d| (d.as_secs_f64() * 1e3).round() as u64)
        };
        let min = MIN_USUAL_STEPS;
        let u = Usual::NONE.learn(min / 2, Some(Duration::from_millis(10)), min);
        assert_eq!(ms(u), None);
        let u = u.learn(min / 2, Some(Duration::from_millis(30)), min);
        assert_eq!(ms(u), Some(20));
        // Then each look moves it a twentieth of the way.
        let u = u.learn(100, Some(Duration::from_millis(120)), min);
        assert_eq!(ms(u), Some(25));
        assert_eq!(u.learn(0, None, min), u);
    }

    #[test]
    fn a_full_device_with_crawling_prefill_fires_before_any_decode_step() {
        // The H100 run of section 6c: the device fills while the prompts prefill, before the
        // first decode step; each prefill step then takes 50× its usual time.
        let mut d = Drive::prefilling();
        let crawl = Prefills {
            steps: 1,
            ..prefill_slower(50)
        };
        let p = d.prefills(60, 0, crawl).expect("the prefill crawl fires");
        // The window starts at the first full look (look 6); it fires at the first look at
        // least 30 s later.
        assert_eq!(d.looks, 36, "{p:?}");
        assert_eq!(
            (p.crawl.measure, p.crawl.each, p.crawl.usual),
            (
                Measure::Prefill,
                Duration::from_micros(500),
                Duration::from_micros(10)
            )
        );
        assert_eq!((p.crawl.steps, p.crawl.tokens), (30, 30 * 8000));
        assert_eq!(p.tokens_gained, 30 * 8000);
        let m = p.message();
        assert!(
            m.starts_with("out of memory: the device has 0 MiB free (under 819 MiB for 30 s)")
                && m.contains(
                    "its prefill passes take 50× their usual time (500.0 µs against 10.0 µs per \
                     prefilled token, 240000 tokens in 30 steps; memory_watch)"
                )
                && m.contains("it holds 5633 MiB of KV"),
            "{m}"
        );
    }

    #[test]
    fn a_full_device_with_prefill_of_normal_speed_never_fires() {
        let mut d = Drive::prefilling();
        // The engine's own buffers fill the device; its prefill keeps its speed, or slows a few
        // times (longer contexts, shorter passes).
        assert_eq!(d.prefills(600, 100 * MIB, PREFILL), None);
        assert_eq!(d.prefills(600, 0, prefill_slower(3)), None);
        // Just under the factor, still nothing.
        assert_eq!(d.prefills(600, 0, prefill_slower(9)), None);
    }

    #[test]
    fn without_a_usual_prefill_time_a_prefill_crawl_never_fires() {
        // Full from the start: nothing learned.
        let mut d = Drive::new();
        assert_eq!(d.prefills(600, 0, prefill_slower(100)), None);
        assert_eq!(d.watch.usual_prefill(), None);
        // Too few prefill steps with memory free to learn from.
        let mut d = Drive::new();
        let few = Prefills {
            steps: MIN_USUAL_PREFILLS - 1,
            ..PREFILL
        };
        assert_eq!(d.prefills(1, 40 * GIB, few), None);
        assert_eq!(d.watch.usual_prefill(), None);
        assert_eq!(d.prefills(600, 0, prefill_slower(100)), None);
        // A usual decode step time does not judge prefill steps: with no decode step in the
        // window there is nothing to judge.
        let mut d = Drive::healthy();
        assert_eq!(d.watch.usual_prefill(), None);
        assert_eq!(d.prefills(600, 0, prefill_slower(100)), None);
    }

    #[test]
    fn a_bystander_whose_prompts_come_and_go_never_fires() {
        let mut d = Drive::prefilling();
        // One request after another, each prefilling at 50× its usual time for 8 s and then
        // gone: the tokens grow with each, and fall back at its end.
        for _ in 0..100 {
            d.tokens = 0;
            assert_eq!(d.prefills(8, 0, prefill_slower(50)), None);
        }
    }

    #[test]
    fn either_measure_crawling_is_enough() {
        // Both usual times learned: decode steps and prefill steps with memory free.
        let learned = || {
            let mut d = Drive::healthy();
            assert_eq!(d.prefills(5, 40 * GIB, PREFILL), None);
            assert!(d.watch.usual().is_some() && d.watch.usual_prefill().is_some());
            d
        };
        // Decode steps of normal speed beside prefill steps 50× slower.
        let mut d = learned();
        let p = d
            .mixed(60, 0, 20, 20, prefill_slower(50))
            .expect("the prefill crawls");
        assert_eq!(p.crawl.measure, Measure::Prefill);
        // Decode steps 50× slower beside prefill steps of normal speed.
        let mut d = learned();
        let p = d
            .mixed(60, 0, 1, 1_000, PREFILL)
            .expect("the decode steps crawl");
        assert_eq!(p.crawl.measure, Measure::Decode);
        // Both of normal speed: nothing.
        let mut d = learned();
        assert_eq!(d.mixed(600, 0, 20, 20, PREFILL), None);
    }
}
