//! MLX's memory as a training run goes: read after the load, each validation and each step,
//! so that a run's peak can be placed and memory kept from one step to the next shows
//! (issue 25).
//!
//! **Decision: every reading first waits for the stream's pending work, and takes the peak
//! since the previous reading.** MLX's CUDA backend keeps the inputs of the kernels it queued
//! until a worker thread, told by the stream, releases them after the GPU ran them; `eval`
//! returns once the outputs are ready, which may be before that release. Read then, active
//! memory counts arrays the run no longer holds, by however far the worker lagged (an H100
//! probe read 2.38 and 2.17 GB after the same first validation in two runs). Synchronizing the
//! stream first makes "active" the arrays the run still holds. The peak is reset after each
//! reading, so that a reading's peak is that of the work since the previous one (one step, one
//! validation) and the run's peak is the largest of them: a peak that rises step after step
//! (something kept) then shows apart from one step that went higher once.
use mlx_rs::Stream;

use super::JobError;

/// Reads MLX's counters for a run; it owns the peak counter (resets it) while the run lasts.
pub(super) struct MemoryProbe {
    run_peak: usize,
}

/// MLX's memory at one point of a run, in bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reading {
    /// Held by live arrays, once the stream's pending work is done.
    pub active: usize,
    /// The most held at once since the previous reading.
    pub peak: usize,
    /// Freed buffers MLX keeps for reuse (not active).
    pub cache: usize,
}

impl MemoryProbe {
    pub fn new() -> Self {
        Self { run_peak: 0 }
    }

    /// Waits for this thread's default stream, reads the counters and starts the next
    /// interval's peak.
    pub fn read(&mut self) -> Result<Reading, JobError> {
        synchronize()?;
        let mlx = |e: mlx_rs::error::Exception| JobError::Mlx(format!("reading memory: {e}"));
        let reading = Reading {
            active: mlx_rs::memory::active_memory().map_err(mlx)?,
            peak: mlx_rs::memory::peak_memory().map_err(mlx)?,
            cache: mlx_rs::memory::cache_memory().map_err(mlx)?,
        };
        mlx_rs::memory::reset_peak_memory().map_err(mlx)?;
        self.run_peak = self.run_peak.max(reading.peak);
        Ok(reading)
    }

    /// The most held at once over the run so far (the largest of the readings' peaks).
    pub fn run_peak(&self) -> usize {
        self.run_peak
    }

    /// Reads and logs the memory after `what` of `iteration` (`width`: its batch's), at info
    /// when `notable` (the load, validations, the first steps), else at debug.
    pub fn log(
        &mut self,
        what: &str,
        iteration: u64,
        width: Option<i32>,
        notable: bool,
    ) -> Result<Reading, JobError> {
        let r = self.read()?;
        macro_rules! emit {
            ($level:expr) => {
                tracing::event!(
                    $level,
                    iteration,
                    width,
                    active_gb = gb(r.active),
                    peak_gb = gb(r.peak),
                    run_peak_gb = gb(self.run_peak),
                    cache_gb = gb(r.cache),
                    "memory after {what}"
                )
            };
        }
        if notable {
            emit!(tracing::Level::INFO);
        } else {
            emit!(tracing::Level::DEBUG);
        }
        Ok(r)
    }
}

/// Bytes as GB with three decimals, as the job's memory lines give them.
pub(super) fn gb(bytes: usize) -> f64 {
    (bytes as f64 / 1e9 * 1000.0).round() / 1000.0
}

/// `mx.synchronize()` on this thread's default stream (mlx-rs does not wrap it).
fn synchronize() -> Result<(), JobError> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: the stream is a live handle held for the duration of the call.
    let status = unsafe { mlx_sys::mlx_synchronize(stream.as_ptr()) };
    if status != 0 {
        return Err(JobError::Mlx(
            "MLX could not synchronize the default stream".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading's peak covers the work since the previous reading, and the run's peak
    /// keeps the largest. (Lower bounds only: this binary's tests allocate side by side.)
    #[test]
    fn a_reading_sees_the_peak_since_the_previous_and_the_run_keeps_it() {
        let mut probe = MemoryProbe::new();
        probe.read().unwrap();
        let big = mlx_rs::ops::ones::<f32>(&[1 << 20]).unwrap();
        big.eval().unwrap();
        drop(big);
        let after_big = probe.read().unwrap();
        assert!(after_big.peak >= 4 << 20, "{after_big:?}");
        let next = probe.read().unwrap();
        assert!(probe.run_peak() >= after_big.peak.max(next.peak));
    }
}
