//! One model across several processes (an engine group), through MLX distributed: every rank
//! is an `mlxd-engine` holding its shard of the weights (tensor parallelism), rank 0 serves
//! the socket and decides each iteration, the others run the same iterations
//! ([`replica`]). The group and its collectives are MLX's ([`group`]), with the backend and
//! environment `mlx.launch` uses (`ring`: `MLX_RANK`, `MLX_HOSTFILE`); nothing else travels
//! between the ranks.
//!
//! - [`group`]: the MLX group and collectives from Rust;
//! - [`pipeline`]: the layers divided among the ranks, activations sent from rank to rank;
//! - [`shard`]: which tensors a family divides and how;
//! - [`shard_read`]: a rank's part of a tensor read from its file, not the whole;
//! - [`summed`]: the `all_sum` that completes a row-split branch;
//! - [`wire`]: the per-iteration message and its broadcast;
//! - [`replica`]: rank 0's and the other ranks' side of the lockstep;
//! - [`watchdog`]: a rank's steps bounded in time, so that a hung rank ends the group.
pub mod group;
pub mod pipeline;
pub mod replica;
pub mod shard;
pub mod shard_read;
pub(crate) mod summed;
pub mod watchdog;
pub mod wire;

use std::time::Duration;

pub use group::{Group, GroupError, BACKENDS};
pub use shard::{Piece, ShardPlan, Split};

use crate::loader::LoadError;

/// How long a rank waits for the rest of its group to connect before its load fails.
pub const GROUP_INIT_TIMEOUT: Duration = Duration::from_secs(60);

/// The architectures whose files divide their weights among a tensor-parallel group (their
/// `shard` functions); any other fails the load of a group before a weight is read.
pub const TENSOR_PARALLEL: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
];

/// Refuses `architecture` for a group of `ranks` unless its file can divide it.
pub fn check_architecture(architecture: &str, ranks: usize) -> Result<(), LoadError> {
    if TENSOR_PARALLEL.contains(&architecture) {
        return Ok(());
    }
    Err(LoadError::Config(format!(
        "{architecture} cannot be divided among {ranks} ranks: tensor parallelism is built for \
         {} only",
        TENSOR_PARALLEL.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_families_with_a_shard_function_form_a_group() {
        for arch in TENSOR_PARALLEL {
            assert!(check_architecture(arch, 2).is_ok(), "{arch}");
        }
        for arch in [
            "Gemma3ForCausalLM",
            "DeepseekV3ForCausalLM",
            "Qwen3NextForCausalLM",
        ] {
            let message = check_architecture(arch, 2).unwrap_err().to_string();
            assert!(
                message.contains(arch) && message.contains("2 ranks"),
                "{message}"
            );
        }
    }
}
