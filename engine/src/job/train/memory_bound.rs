//! A training run's bound on MLX's memory limit: each batch width's working set is measured
//! on its first step, and MLX's limit is set just above the largest of them.
//!
//! **Decision: bound the run by MLX's memory limit, set from what its first steps used.**
//! MLX's CUDA backend keeps every buffer a queued kernel uses alive until the GPU has finished
//! that kernel's command buffer (a completion handler releases them), and the host may queue
//! up to 10 command buffers ahead of the GPU. Once a width's graph is compiled, the host runs
//! further ahead each step, so more dead but unreleased buffers are alive at once: on an H100
//! the step's peak rose from 7.89 GB at the first step to 12.08 GB by the eleventh while active
//! memory between steps stayed at 2.2 GB (mlx-lm's trainer on the same model: 7.92 to
//! 8.89 GB). MLX's `eval` waits for queued work whenever active memory exceeds its memory
//! limit, and the allocator does not fail at the limit (it trims its cache), so a limit just
//! above a step's working set bounds the peak by holding the host back.
//!
//! A width's working set is its first step's peak: MLX traces and compiles the step then, and
//! the host does not run ahead of the GPU. That step runs with the limit lifted to MLX's own
//! (the one in force when the run began), so that a narrower width's bound does not throttle
//! the measurement. The limit only ever rises (the largest first-step peak so far) and never
//! above MLX's own; nothing is restored at the end, since the job's process exits.
//! `MLXD_TRAIN_MEMORY_LIMIT=off` leaves MLX's limit alone (A/B runs).
use std::collections::BTreeMap;

use super::memory::gb;
use super::JobError;

/// The environment variable that switches the bound ([`MemoryBound::from_env`]).
pub const MEMORY_LIMIT_ENV: &str = "MLXD_TRAIN_MEMORY_LIMIT";

/// The limit's margin over the largest first-step peak. Above 1, so that a step's own work
/// (whose peak varies a little between steps of one width: the order buffers are freed in, the
/// cache's reuse) is not made to wait op by op, while the host's run-ahead, which added up to
/// 53 % to the first step's peak on an H100, is cut to at most this; mlx-lm's trainer peaked
/// at 1.12 times its first step there. At 1.10 the H100 run's peak was 8.71 GB against
/// mlx-lm's 8.58 (24 iterations, 1B, batch 4 × 512) at the unbounded run's speed, so 1.05.
pub const MARGIN: f64 = 1.05;

/// Whether a run bounds MLX's memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryBound {
    /// The largest first-step peak times [`MARGIN`] (the default).
    Auto,
    /// MLX's limit as it is (for comparison).
    Off,
}

impl MemoryBound {
    /// `MLXD_TRAIN_MEMORY_LIMIT`: unset or `auto` bounds, `off` does not; anything else is
    /// refused rather than guessed.
    pub fn from_env() -> Result<Self, JobError> {
        match std::env::var(MEMORY_LIMIT_ENV).as_deref() {
            Err(_) | Ok("auto") => Ok(Self::Auto),
            Ok("off") => Ok(Self::Off),
            Ok(other) => Err(JobError::Input(format!(
                "{MEMORY_LIMIT_ENV}={other:?}: expected auto (bound MLX's memory limit by the \
                 first steps' peaks, the default) or off (leave MLX's limit as it is)"
            ))),
        }
    }
}

/// The limit for a run whose widths' first steps peaked at `first_step_peaks` (bytes), with
/// MLX's limit `start_limit` when the run began: the largest peak times [`MARGIN`], rounded
/// up, at most `start_limit`; `None` before any width is measured.
pub fn limit_for(
    first_step_peaks: impl IntoIterator<Item = usize>,
    start_limit: usize,
) -> Option<usize> {
    let largest = first_step_peaks.into_iter().max()?;
    let bound = (largest as f64 * MARGIN).ceil();
    Some(if bound >= start_limit as f64 {
        start_limit
    } else {
        bound as usize
    })
}

/// A run's bound: the widths measured and MLX's limit when the run began. It owns MLX's
/// memory limit while the run lasts.
pub(super) struct MemoryBounder {
    bound: MemoryBound,
    start_limit: usize,
    /// Per batch width, its first step's peak.
    first_step_peaks: BTreeMap<i32, usize>,
}

impl MemoryBounder {
    /// Reads MLX's limit before anything changes it.
    pub fn new(bound: MemoryBound) -> Result<Self, JobError> {
        let start_limit = mlx_rs::memory::memory_limit().map_err(mlx)?;
        tracing::info!(
            bound = ?bound,
            mlx_limit_gb = gb(start_limit),
            "memory bound ({MEMORY_LIMIT_ENV})"
        );
        Ok(Self {
            bound,
            start_limit,
            first_step_peaks: BTreeMap::new(),
        })
    }

    /// Whether a step of `width` is the first of its width that this bound measures.
    fn measures(&self, width: i32) -> bool {
        self.bound == MemoryBound::Auto && !self.first_step_peaks.contains_key(&width)
    }

    /// Called before a step of `width`: lifts the limit to MLX's own for a width's first step.
    pub fn before_step(&self, width: i32) -> Result<(), JobError> {
        if self.measures(width) && !self.first_step_peaks.is_empty() {
            mlx_rs::memory::set_memory_limit(self.start_limit).map_err(mlx)?;
        }
        Ok(())
    }

    /// Called after a step of `width` of `iteration`, with the peak since the step began:
    /// after a width's first step, sets the limit and logs it.
    pub fn after_step(&mut self, iteration: u64, width: i32, peak: usize) -> Result<(), JobError> {
        if !self.measures(width) {
            return Ok(());
        }
        self.first_step_peaks.insert(width, peak);
        let limit = limit_for(self.first_step_peaks.values().copied(), self.start_limit)
            .expect("a width was just measured");
        mlx_rs::memory::set_memory_limit(limit).map_err(mlx)?;
        tracing::info!(
            iteration,
            width,
            first_step_peak_gb = gb(peak),
            limit_gb = gb(limit),
            mlx_limit_gb = gb(self.start_limit),
            "memory limit after a new batch width's first step"
        );
        Ok(())
    }
}

fn mlx(e: mlx_rs::error::Exception) -> JobError {
    JobError::Mlx(format!("MLX's memory limit: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: usize = 1_000_000_000;

    #[test]
    fn the_limit_is_the_largest_first_step_peak_with_the_margin() {
        assert_eq!(limit_for([], 80 * GB), None);
        let of_ten = (10.0 * GB as f64 * MARGIN) as usize;
        assert_eq!(limit_for([10 * GB], 80 * GB), Some(of_ten));
        // Rounded up: never under the peak times the margin.
        let odd = 7_890_000_001usize;
        let limit = limit_for([odd], 80 * GB).unwrap();
        assert!(limit as f64 >= odd as f64 * MARGIN && (limit as f64) < odd as f64 * MARGIN + 2.0);
        // A narrower width measured later does not lower it.
        assert_eq!(limit_for([10 * GB, 4 * GB], 80 * GB), Some(of_ten));
        assert_eq!(limit_for([4 * GB, 10 * GB], 80 * GB), Some(of_ten));
    }

    #[test]
    fn the_limit_never_exceeds_mlx_s_own() {
        assert_eq!(limit_for([78 * GB], 80 * GB), Some(80 * GB));
        assert_eq!(limit_for([90 * GB], 80 * GB), Some(80 * GB));
    }
}
