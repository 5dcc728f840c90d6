//! Pipeline parallelism: the decoder's layers divided among the ranks, the residual stream
//! passed from rank to rank with MLX's `send`/`recv`, as mlx-lm's `PipelineMixin` does.
//!
//! The split is mlx-lm's: layers are dealt in reverse, so the highest rank runs the first
//! layers (it embeds the tokens) and rank 0 the last ones; with a remainder the low ranks take
//! one layer more. Rank `r` receives the hidden states from rank `r + 1`, runs its layers and
//! sends the result to rank `r - 1`. Rank 0's output is then shared with every rank (an
//! `all_gather` of which rank 0's rows are kept), and every rank applies the final norm and
//! the output head to it, so that logits and sampled tokens are the same on every rank.
//! That is why every rank keeps the final norm and the head, as mlx-lm's `sharded_load` does
//! (sharing the hidden states costs `B·L·hidden` per pass where sharing logits would cost
//! `B·L·vocab`); the embedding stays on the first stage only, unless it is the (tied) head.
//!
//! The ranks' KV caches hold their own layers only. Their byte accounting must still agree,
//! since the scheduler's admissions and the prefix cache's evictions follow it: each rank
//! reports the KV bytes per token of the largest stage ([`Stage::largest`]), and sizes its
//! prefix cache in proportion to its own layers ([`Stage::prefix_budget`]).
use std::ops::Range;

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::Group;
use crate::loader::{LoadError, Weights};

/// The layers one rank of a pipeline runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub rank: usize,
    pub size: usize,
    /// Its layers, by their index in the whole model.
    pub layers: Range<usize>,
    /// The most layers any rank runs.
    pub largest: usize,
}

impl Stage {
    /// Rank `rank` of `size`'s share of `num_layers` (mlx-lm's `pipeline` split). Every rank
    /// needs a layer: fewer layers than ranks fail, naming both.
    pub fn of(num_layers: usize, rank: usize, size: usize) -> Result<Stage, LoadError> {
        if size == 0 || rank >= size {
            return Err(LoadError::Config(format!(
                "pipeline rank {rank} of a group of {size}"
            )));
        }
        if num_layers < size {
            return Err(LoadError::Config(format!(
                "pipeline parallelism over {size} ranks needs a layer per rank, but the model \
                 has {num_layers} layers; use {num_layers} ranks or fewer"
            )));
        }
        let (base, extra) = (num_layers / size, num_layers % size);
        let count = |r: usize| base + usize::from(r < extra);
        let start: usize = (rank + 1..size).map(count).sum();
        Ok(Stage {
            rank,
            size,
            layers: start..start + count(rank),
            largest: count(0),
        })
    }

    /// Whether this rank embeds the tokens (it runs layer 0).
    pub fn is_first(&self) -> bool {
        self.layers.start == 0
    }

    /// Whether this rank's output is the model's last hidden state.
    pub fn is_last(&self) -> bool {
        self.rank == 0
    }

    /// This rank's prefix-cache budget for a group given `bytes`: in proportion to its layers,
    /// counted in whole per-layer shares so that every rank evicts the same entries (an entry
    /// holds the same bytes per layer on every rank).
    pub fn prefix_budget(&self, bytes: u64) -> u64 {
        bytes / self.largest as u64 * self.layers.len() as u64
    }

    /// Drops the checkpoint's tensors of the layers other ranks run (named
    /// `<prefix>model.layers.<i>.…`), before they are read.
    pub fn discard_other_layers(&self, w: &mut Weights, prefix: &str) {
        let layers = format!("{prefix}model.layers.");
        for name in w.names() {
            let Some(rest) = name.strip_prefix(&layers) else {
                continue;
            };
            let index = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
            if index.is_some_and(|i| !self.layers.contains(&i)) {
                w.discard(&name);
            }
        }
    }
}

/// A rank's link to its neighbours in the pipeline: what it receives, sends and shares.
pub struct StageLink {
    pub stage: Stage,
    group: Group,
    /// The residual stream's width and dtype (what the previous rank sends).
    hidden: i32,
    dtype: Dtype,
}

impl StageLink {
    /// The link of `group`'s rank, running `stage`, for a model whose residual stream is
    /// `hidden` wide in `dtype` (the embeddings' output dtype, as mlx-lm's `recv_like` of the
    /// embedded tokens assumes).
    pub fn new(group: Group, stage: Stage, hidden: i32, dtype: Dtype) -> StageLink {
        StageLink {
            stage,
            group,
            hidden,
            dtype,
        }
    }

    /// The hidden states `[B, L, hidden]` of `tokens` `[B, L]` from the rank before this one.
    pub fn receive(&self, tokens: &Array) -> Result<Array, Exception> {
        let shape = tokens.shape();
        self.group.recv(
            &[shape[0], shape[1], self.hidden],
            self.dtype,
            self.stage.rank + 1,
        )
    }

    /// This rank's output `h` passed on, and the model's last hidden state returned (the same
    /// on every rank). The send is queued for evaluation at once: a pass whose caches alone are
    /// evaluated (a queued prefill) must still send, or the next rank would wait for ever.
    pub fn pass_on(&self, h: Array) -> Result<Array, Exception> {
        let rows = h.shape()[0];
        let h = if self.stage.is_last() {
            h
        } else {
            let sent = self
                .group
                .send(&h.as_dtype(self.dtype)?, self.stage.rank - 1)?;
            mlx_rs::transforms::async_eval([&sent])?;
            sent
        };
        Ok(self.group.all_gather(&h)?.index(..rows))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(num_layers: usize, size: usize) -> Vec<Range<usize>> {
        (0..size)
            .map(|r| Stage::of(num_layers, r, size).unwrap().layers)
            .collect()
    }

    #[test]
    fn layers_are_dealt_in_reverse_with_the_remainder_to_the_low_ranks() {
        // mlx-lm's `PipelineMixin.pipeline`: rank 0 runs the last layers.
        assert_eq!(split(4, 2), vec![2..4, 0..2]);
        assert_eq!(split(3, 2), vec![1..3, 0..1]);
        assert_eq!(split(10, 4), vec![7..10, 4..7, 2..4, 0..2]);
        let last = Stage::of(3, 0, 2).unwrap();
        assert!(last.is_last() && !last.is_first() && last.largest == 2);
        let first = Stage::of(3, 1, 2).unwrap();
        assert!(first.is_first() && !first.is_last() && first.largest == 2);
    }

    #[test]
    fn fewer_layers_than_ranks_fail_naming_both() {
        let err = Stage::of(2, 0, 3).unwrap_err().to_string();
        assert!(err.contains("3 ranks") && err.contains("2 layers"), "{err}");
    }

    #[test]
    fn prefix_budgets_evict_alike_on_every_rank() {
        // 3 layers on 2 ranks: rank 0 holds 2 layers' KV per entry, rank 1 one; an entry of
        // `e` bytes per layer fits on rank 0 exactly when it fits on rank 1.
        let (big, small) = (Stage::of(3, 0, 2).unwrap(), Stage::of(3, 1, 2).unwrap());
        let budget = 1001;
        assert_eq!(big.prefix_budget(budget), 1000);
        assert_eq!(small.prefix_budget(budget), 500);
        for e in [499u64, 500, 501] {
            assert_eq!(
                2 * e <= big.prefix_budget(budget),
                e <= small.prefix_budget(budget)
            );
        }
    }
}
