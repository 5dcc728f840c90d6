//! The hook an engine group's ranks run the executor through (`crate::distributed::replica`):
//! every rank runs the same iterations on the same inputs, which rank 0 decides and
//! broadcasts, so that their forward passes (and the collectives inside them) match one for
//! one and their tokens are identical.
//!
//! An iteration's outcome depends on the requests queued before it, on which clients are
//! still listening, and on the measured prefill speed (which sizes chunks); [`Lockstep`]
//! supplies all three at the top of each iteration, and nothing else the executor does
//! depends on the rank.
use mlx_rs::error::Exception;

use super::request::GenerateRequest;

/// One iteration's inputs.
#[derive(Debug, Default)]
pub struct Turn {
    /// Requests to queue, in arrival order.
    pub arrived: Vec<GenerateRequest>,
    /// The prefill speed the iteration sizes its chunks by (rank 0's measure).
    pub prefill_speed: Option<f64>,
}

/// What the executor's loop asks before each iteration in an engine group.
pub trait Lockstep: Send {
    /// Blocks until the next iteration's inputs are agreed; `None` ends the loop. `idle`: the
    /// executor holds no work (rank 0 then waits for a request); `prefill_speed`: this rank's
    /// own measure so far. Cancelled requests' event receivers are dropped before it returns,
    /// on every rank alike.
    fn next_turn(&mut self, idle: bool, prefill_speed: Option<f64>) -> Option<Turn>;

    /// The loop stopped on an MLX error (every request it held has been failed with it): the
    /// ranks can no longer agree, so the group must end.
    fn failed(&mut self, error: Exception);
}
