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
//! With LoRA adapters loaded at start, each row count is visited three times: base rows, rows
//! of one adapter, and rows spread over the first [`MIXED_ADAPTERS`] adapters (the adapted
//! projections' own products have shapes of their own).
//!
//! The sweep runs on a throwaway executor of its own, as the warm-up does
//! ([`super::warm_up`]): its KV (one token per row) and counters never touch the engine's.
use std::collections::HashMap;
use std::time::Instant;

use mlx_rs::error::Exception;
use tokio::sync::mpsc;

use super::executor::Executor;
use super::request::{GenerateRequest, TokenEvent};
use super::sampling_params::SamplingParams;
use super::scheduler::SchedulerLimits;
use super::warm_up::MIXED_ADAPTERS;
use super::RuntimeStats;
use crate::adapters::AdapterId;
use crate::cache::{CacheManager, KvLayout, KvSpace};
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

/// The passes still to run, largest row count first, each row count once per kind of pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Passes {
    rows: usize,
    kinds: usize,
    kind: usize,
}

impl Passes {
    /// `kinds` passes per row count (1 without adapters: base rows only).
    pub fn up_to(max_rows: usize, kinds: usize) -> Self {
        Self {
            rows: max_rows,
            kinds: kinds.max(1),
            kind: 0,
        }
    }

    /// The next pass: its row count and kind (0: base rows, 1: one adapter, 2: mixed); `None`
    /// once one row was visited by every kind.
    pub fn take(&mut self) -> Option<(usize, usize)> {
        if self.rows == 0 {
            return None;
        }
        let pass = (self.rows, self.kind);
        self.kind += 1;
        if self.kind == self.kinds {
            self.kind = 0;
            self.rows -= 1;
        }
        Some(pass)
    }
}

/// The sweep and its throwaway executor.
pub struct IdleSweep<'m> {
    executor: Box<Executor<'m>>,
    work: mpsc::UnboundedSender<GenerateRequest>,
    incoming: mpsc::UnboundedReceiver<GenerateRequest>,
    /// The current pass's rows' event channels (kept so that they are not cancelled).
    events: Vec<mpsc::UnboundedReceiver<TokenEvent>>,
    passes_left: Passes,
    /// Adapters loaded at start, in id order (the passes of kinds 1 and 2 use them).
    adapters: Vec<AdapterId>,
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
        adapter_spaces: &HashMap<AdapterId, KvSpace>,
    ) -> Self {
        let mut adapters: Vec<AdapterId> = adapter_spaces.keys().copied().collect();
        adapters.sort_by_key(|id| id.0);
        let kinds = if adapters.is_empty() { 1 } else { 3 };
        let passes_left = Passes::up_to(scheduler.max_batch_size, kinds);
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
        )
        .with_adapter_spaces(adapter_spaces.clone());
        let (work, incoming) = mpsc::unbounded_channel();
        Self {
            executor: Box::new(executor),
            work,
            incoming,
            events: Vec::new(),
            passes_left,
            adapters,
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
        let Some((rows, kind)) = self.passes_left.take() else {
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
                adapter: self.adapter_of(kind, row),
            };
            if self.work.send(request).is_err() {
                return Err(Exception::custom("the idle sweep's own channel closed"));
            }
        }
        self.passes += 1;
        self.executor.step_once(&mut self.incoming)?;
        Ok(true)
    }

    /// The adapter of row `row` of a pass of `kind`.
    fn adapter_of(&self, kind: usize, row: usize) -> Option<AdapterId> {
        let mixed = self.adapters.len().min(MIXED_ADAPTERS);
        match kind {
            1 => self.adapters.first().copied(),
            2 if mixed > 0 => Some(self.adapters[row % mixed]),
            _ => None,
        }
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
        let mut passes = Passes::up_to(4, 1);
        let visited: Vec<(usize, usize)> = std::iter::from_fn(|| passes.take()).collect();
        assert_eq!(visited, [(4, 0), (3, 0), (2, 0), (1, 0)]);
        assert_eq!(passes.take(), None);
        assert_eq!(Passes::up_to(0, 1).take(), None);
    }

    #[test]
    fn with_adapters_each_row_count_is_visited_by_each_kind_of_pass() {
        let mut passes = Passes::up_to(2, 3);
        let visited: Vec<(usize, usize)> = std::iter::from_fn(|| passes.take()).collect();
        assert_eq!(visited, [(2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2)]);
    }
}
