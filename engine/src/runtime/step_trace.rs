//! Where a pipelined decode step's host time goes, as one `trace` event per step under target
//! `mlxd_engine::step` (`RUST_LOG=mlxd_engine::step=trace`): building the model's graph,
//! building the sampler's, queueing both (`async_eval`), and waiting for the previous step's
//! tokens (the device's share the host could not hide). Comparing greedy and sampled runs
//! separates what sampling costs on each side. When the target is off, no clock is read.
//!
//! A step's prefill passes give one `prefill step` event ([`PrefillTrace`]): how many passes,
//! rows and prompt tokens, the padded tokens the passes computed (padding is what a group of
//! prompts of different lengths pays for sharing a pass), how many passes needed a mask array
//! and per-row offsets (`padded_passes`; the others ran the plain kernels), the host's time
//! building and queueing them (`build_us`; of it, building the model's graphs, `graph_us`,
//! and `async_eval`, `async_eval_us`: a prefix hit's short pass costs the host several
//! decode steps, BENCHMARKS.md) and the wait for the device.
use std::time::{Duration, Instant};

/// The marks of one step, `None` unless the trace is on.
pub struct StepClock(Option<Marks>);

struct Marks {
    start: Instant,
    forward: Option<Instant>,
    sampler: Option<Instant>,
    queued: Option<Instant>,
    /// Reading back the previous step's tokens: started, done.
    read: Option<(Instant, Option<Instant>)>,
}

impl StepClock {
    pub fn start() -> Self {
        let on = tracing::enabled!(target: "mlxd_engine::step", tracing::Level::TRACE);
        StepClock(on.then(|| Marks {
            start: Instant::now(),
            forward: None,
            sampler: None,
            queued: None,
            read: None,
        }))
    }

    /// The model's graph for this step is built.
    pub fn forward_built(&mut self) {
        if let Some(m) = &mut self.0 {
            m.forward = Some(Instant::now());
        }
    }

    /// The sampler's graph is built.
    pub fn sampler_built(&mut self) {
        if let Some(m) = &mut self.0 {
            m.sampler = Some(Instant::now());
        }
    }

    /// `async_eval` returned.
    pub fn queued(&mut self) {
        if let Some(m) = &mut self.0 {
            m.queued = Some(Instant::now());
        }
    }

    /// Reading back the previous step's tokens starts.
    pub fn reading(&mut self) {
        if let Some(m) = &mut self.0 {
            m.read = Some((Instant::now(), None));
        }
    }

    /// The previous step's tokens are on the host.
    pub fn read(&mut self) {
        if let Some((_, done)) = self.0.as_mut().and_then(|m| m.read.as_mut()) {
            *done = Some(Instant::now());
        }
    }

    /// Emits the step's event: `rows` decoding, `joined` of them new, `sampled` of them not
    /// greedy.
    pub fn finish(self, rows: usize, joined: usize, sampled: usize) {
        let Some(m) = self.0 else {
            return;
        };
        let end = Instant::now();
        let us = |from: Instant, to: Option<Instant>| {
            to.map_or(0, |t| t.saturating_duration_since(from).as_micros() as u64)
        };
        // Up to the forward pass: leaving and joining rows, their caches.
        let (forward_from, forward) = match m.forward {
            Some(f) => (f, us(m.start, Some(f))),
            None => (m.start, 0),
        };
        let sampler = us(forward_from, m.sampler);
        let async_eval = m.sampler.map_or(0, |s| us(s, m.queued));
        let wait = m.read.map_or(0, |(from, to)| us(from, to));
        tracing::trace!(
            target: "mlxd_engine::step",
            rows,
            joined,
            sampled,
            build_forward_us = forward,
            build_sampler_us = sampler,
            async_eval_us = async_eval,
            wait_tokens_us = wait,
            total_us = end.saturating_duration_since(m.start).as_micros() as u64,
            "decode step"
        );
    }

    /// Whether the trace is on (so callers skip work done only for it).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }
}

/// The marks of one step's prefill passes, `None` unless the trace is on.
pub struct PrefillTrace(Option<PrefillMarks>);

struct PrefillMarks {
    start: Instant,
    built: Instant,
    /// Building the passes' model graphs.
    graph: Duration,
    /// Queueing them (`async_eval`).
    queue: Duration,
    passes: usize,
    rows: usize,
    tokens: usize,
    padded: usize,
    padded_passes: usize,
}

impl PrefillTrace {
    pub fn start() -> Self {
        let on = tracing::enabled!(target: "mlxd_engine::step", tracing::Level::TRACE);
        let now = Instant::now();
        PrefillTrace(on.then_some(PrefillMarks {
            start: now,
            built: now,
            graph: Duration::ZERO,
            queue: Duration::ZERO,
            passes: 0,
            rows: 0,
            tokens: 0,
            padded: 0,
            padded_passes: 0,
        }))
    }

    /// A pass of `rows` prompts holding `tokens` prompt tokens, computed as `padded` (rows ×
    /// the longest).
    pub fn pass(&mut self, rows: usize, tokens: usize, padded: usize) {
        if let Some(m) = &mut self.0 {
            m.passes += 1;
            m.rows += rows;
            m.tokens += tokens;
            m.padded += padded;
            m.padded_passes += usize::from(padded > tokens);
        }
    }

    /// Runs `build` (a pass's model graph), its time counted as `graph_us`.
    pub fn graph<R>(&mut self, build: impl FnOnce() -> R) -> R {
        Self::timed(&mut self.0, |m| &mut m.graph, build)
    }

    /// Runs `queue` (a pass's `async_eval`), its time counted as `async_eval_us`.
    pub fn queue<R>(&mut self, queue: impl FnOnce() -> R) -> R {
        Self::timed(&mut self.0, |m| &mut m.queue, queue)
    }

    /// `f`'s result, its time added to the part `part` picks; no clock read when off.
    fn timed<R>(
        marks: &mut Option<PrefillMarks>,
        part: impl FnOnce(&mut PrefillMarks) -> &mut Duration,
        f: impl FnOnce() -> R,
    ) -> R {
        let Some(m) = marks else {
            return f();
        };
        let started = Instant::now();
        let result = f();
        *part(m) += started.elapsed();
        result
    }

    /// The last pass so far is built and queued.
    pub fn built(&mut self) {
        if let Some(m) = &mut self.0 {
            m.built = Instant::now();
        }
    }

    /// Emits the event once the passes are computed: `budget_tokens` is what the step's
    /// passes took of its budget.
    pub fn finish(self, budget_tokens: usize) {
        let Some(m) = self.0 else {
            return;
        };
        let end = Instant::now();
        tracing::trace!(
            target: "mlxd_engine::step",
            passes = m.passes,
            rows = m.rows,
            tokens = m.tokens,
            padded_tokens = m.padded,
            padded_passes = m.padded_passes,
            budget_tokens,
            build_us = m.built.saturating_duration_since(m.start).as_micros() as u64,
            graph_us = m.graph.as_micros() as u64,
            async_eval_us = m.queue.as_micros() as u64,
            wait_us = end.saturating_duration_since(m.built).as_micros() as u64,
            "prefill step"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// Collects what the subscriber writes.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("not poisoned").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn step_under(filter: &str) -> (bool, String) {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let on = tracing::subscriber::with_default(subscriber, || {
            let mut clock = StepClock::start();
            let on = clock.is_on();
            clock.forward_built();
            clock.sampler_built();
            std::thread::sleep(std::time::Duration::from_millis(2));
            clock.queued();
            clock.reading();
            clock.read();
            clock.finish(32, 1, 30);
            on
        });
        let text = String::from_utf8(lines.0.lock().expect("not poisoned").clone()).unwrap();
        (on, text)
    }

    #[test]
    fn a_step_reports_its_parts_when_the_target_is_on() {
        let (on, text) = step_under("mlxd_engine::step=trace");
        assert!(on);
        for field in [
            "decode step",
            "rows=32",
            "joined=1",
            "sampled=30",
            "build_forward_us=",
            "build_sampler_us=",
            "wait_tokens_us=",
        ] {
            assert!(text.contains(field), "{field} missing from {text:?}");
        }
        let async_eval: u64 = text
            .split("async_eval_us=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("an async_eval_us value");
        assert!(async_eval >= 2000, "the 2 ms between marks: {text}");
    }

    #[test]
    fn a_prefill_step_reports_its_passes_and_their_padding() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "mlxd_engine::step=trace",
            ))
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let mut trace = PrefillTrace::start();
            // A chunk of one prompt, then a group of three padded to 40 tokens each.
            let graph = trace.graph(|| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                7
            });
            assert_eq!(graph, 7, "the part's result comes back");
            trace.queue(|| std::thread::sleep(std::time::Duration::from_millis(1)));
            trace.pass(1, 64, 64);
            trace.built();
            trace.pass(3, 100, 120);
            trace.built();
            trace.finish(184);
        });
        let text = String::from_utf8(lines.0.lock().expect("not poisoned").clone()).unwrap();
        for field in [
            "prefill step",
            "passes=2",
            "rows=4",
            "tokens=164",
            "padded_tokens=184",
            "padded_passes=1",
            "budget_tokens=184",
            "build_us=",
            "wait_us=",
        ] {
            assert!(text.contains(field), "{field} missing from {text:?}");
        }
        let value = |name: &str| -> u64 {
            text.split(&format!(" {name}="))
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {text:?}"))
        };
        assert!(value("graph_us") >= 2000, "the 2 ms graph: {text}");
        assert!(value("async_eval_us") >= 1000, "the 1 ms queue: {text}");
        assert!(
            value("build_us") >= value("graph_us") + value("async_eval_us"),
            "both within the build: {text}"
        );
    }

    #[test]
    fn nothing_is_timed_or_written_when_the_target_is_off() {
        let (on, text) = step_under("mlxd_engine=debug");
        assert!(!on);
        assert!(text.is_empty(), "{text:?}");
    }
}
