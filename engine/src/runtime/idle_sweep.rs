//! A sweep of the decode row counts, run while the engine has nothing else to do (CUDA).
//!
//! cuBLAS chooses an algorithm the first time it meets a matrix shape: 3–4 ms per new shape
//! on an H100, against 0.1 ms for the product itself (`scripts/bench/shape_cost.py`,
//! 2026-12-05). A decode step at a row count the process has not run before therefore costs
//! ~20 ms more on a 1B model (five projection shapes), and a server's first bursts meet many
//! row counts: rows join and finish one by one. A warm-up that visited them all before `Ready`
//! would delay every start — and every cold restart's resumed streams — by seconds, so the
//! executor runs this sweep between requests instead: for each row count from the largest
//! batch down to one, one pass of that many one-token prompts, whose projections have a
//! decode step's shapes. One pass per idle turn: a request that arrives waits for one pass at
//! most (a few milliseconds once cuBLAS has chosen), and then the sweep waits behind it.
//!
//! The sweep runs on a throwaway executor of its own, as the warm-up does
//! ([`super::warm_up`]): its KV (one token per row) and counters never touch the engine's.
use std::time::Instant;

use mlx_rs::error::Exception;
use tokio::sync::mpsc;

use super::executor::Executor;
use super::request::{GenerateRequest, TokenEvent};
use super::sampling_params::SamplingParams;
use super::scheduler::SchedulerLimits;
use super::RuntimeStats;
use crate::cache::{CacheManager, KvLayout};
use crate::models::{CausalLm, ModelInfo};

/// `MLXD_IDLE_SWEEP`: `1` runs the sweep on any device (tests), `0` never; unset, on CUDA.
pub const IDLE_SWEEP_ENV: &str = "MLXD_IDLE_SWEEP";

/// Whether this process sweeps while idle: [`IDLE_SWEEP_ENV`], else on CUDA only (MLX's other
/// backends choose no algorithm per shape).
pub fn enabled() -> Result<bool, String> {
    match std::env::var(IDLE_SWEEP_ENV).as_deref() {
        Err(_) => Ok(crate::models::layers::cuda_backend()),
        Ok("1") => Ok(true),
        Ok("0") => Ok(false),
        Ok(other) => Err(format!(
            "{IDLE_SWEEP_ENV}={other:?}: expected 1 (sweep while idle) or 0 (never); unset \
             sweeps on CUDA"
        )),
    }
}

/// The row counts still to visit, largest first: the next pass's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCounts {
    next: usize,
}

impl RowCounts {
    pub fn up_to(max_rows: usize) -> Self {
        Self { next: max_rows }
    }

    /// The next pass's row count; `None` once one row was visited.
    pub fn take(&mut self) -> Option<usize> {
        let rows = self.next;
        self.next = rows.saturating_sub(1);
        (rows > 0).then_some(rows)
    }
}

/// The sweep and its throwaway executor.
pub struct IdleSweep<'m> {
    executor: Box<Executor<'m>>,
    work: mpsc::UnboundedSender<GenerateRequest>,
    incoming: mpsc::UnboundedReceiver<GenerateRequest>,
    /// The current pass's rows' event channels (kept so that they are not cancelled).
    events: Vec<mpsc::UnboundedReceiver<TokenEvent>>,
    rows: RowCounts,
    vocab: usize,
    passes: usize,
    started: Instant,
}

impl<'m> IdleSweep<'m> {
    pub fn new(
        model: &'m dyn CausalLm,
        info: &ModelInfo,
        scheduler: SchedulerLimits,
        plain_bytes_per_token: usize,
        layout: KvLayout,
    ) -> Self {
        let rows = RowCounts::up_to(scheduler.max_batch_size);
        let caches = CacheManager::new(
            None,
            0,
            plain_bytes_per_token,
            info.kv_bytes_per_token,
            layout,
        );
        let executor = Executor::new(
            model,
            info.clone(),
            scheduler,
            caches,
            std::sync::Arc::new(RuntimeStats::default()),
            None,
            None,
        );
        let (work, incoming) = mpsc::unbounded_channel();
        Self {
            executor: Box::new(executor),
            work,
            incoming,
            events: Vec::new(),
            rows,
            vocab: info.vocab_size.max(1),
            passes: 0,
            started: Instant::now(),
        }
    }

    /// Runs one piece of the sweep (a pass, or the end of one); false once it is done.
    pub fn step(&mut self) -> Result<bool, Exception> {
        if self.executor.has_work() {
            self.executor.step_once(&mut self.incoming)?;
            return Ok(true);
        }
        self.fail_on_error()?;
        let Some(rows) = self.rows.take() else {
            tracing::info!(
                passes = self.passes,
                ms = self.started.elapsed().as_millis() as u64,
                "swept the decode row counts while idle"
            );
            return Ok(false);
        };
        self.events.clear();
        for row in 0..rows {
            let (tx, rx) = mpsc::unbounded_channel();
            self.events.push(rx);
            // Distinct one-token prompts: each row its own (the throwaway has no prefix cache).
            let token = ((row * 7919 + rows) % self.vocab) as u32;
            let request = GenerateRequest {
                prompt: vec![token],
                sampling: SamplingParams::default(),
                max_tokens: 1,
                stop_token_ids: Vec::new(),
                sample_offset: 0,
                events: tx,
                constraint: None,
                logprobs: None,
                adapter: None,
            };
            if self.work.send(request).is_err() {
                return Err(Exception::custom("the idle sweep's own channel closed"));
            }
        }
        self.passes += 1;
        self.executor.step_once(&mut self.incoming)?;
        Ok(true)
    }

    /// A row of the pass before that failed fails the sweep with its error.
    fn fail_on_error(&mut self) -> Result<(), Exception> {
        for rx in &mut self.events {
            while let Ok(event) = rx.try_recv() {
                if let TokenEvent::Failed(e) = event {
                    return Err(Exception::custom(format!("idle sweep: {e}")));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_counts_go_from_the_largest_batch_down_to_one_row() {
        let mut counts = RowCounts::up_to(4);
        let visited: Vec<usize> = std::iter::from_fn(|| counts.take()).collect();
        assert_eq!(visited, [4, 3, 2, 1]);
        assert_eq!(counts.take(), None);
        assert_eq!(RowCounts::up_to(0).take(), None);
    }
}
