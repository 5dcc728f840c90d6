//! KV caches: one layer-cache abstraction with its layouts, and the manager that owns the
//! KV budget and the prefix cache.
//!
//! A model's attention sees a [`LayerCache`] and asks it three things: the rotary offset of the
//! new positions, to append keys and values and fetch everything held, and the attention mask.
//! Each layout answers them its own way:
//! - [`DenseKv`]: one sequence, as mlx-lm's `KVCache` (the serial reference path);
//! - [`BatchKv`]: many sequences in one buffer, left-padded, with per-row offsets and masks,
//!   as mlx-lm's `BatchKVCache` (the runtime's decode batch and prefill groups), holding its
//!   keys and values plain or quantized ([`Stored`], `--kv-bits`), and bounded by the window
//!   for a sliding-window layer.
//!
//! - [`StateCache`]: a recurrent layer's fixed-size state per sequence (convolution window,
//!   linear-attention or SSM state), as mlx-lm's `ArraysCache`, in either path.
//!
//! Which one a layer needs is its [`LayerKind`], reported by the model.
//!
//! A sequence's KV outside the batch (prefix cache, SSD tier, checkpoints) is a [`SeqKv`], kept
//! in the [`KvSpace`] of the adapter it was computed with (the base model's, without one).
mod batched;
mod budget;
mod dense;
mod manager;
mod prefix;
mod row_arrays;
mod seq_kv;
mod space;
pub mod ssd;
mod state;
pub(crate) mod stored;

pub use batched::{BatchKv, WINDOW_SLACK};
pub use budget::{
    context_held, device_headroom, kv_budget_within, BudgetSource, DeviceMemory, KvBudget,
    Reservation,
};
pub use dense::DenseKv;
pub use manager::{CacheManager, PrefixHit};
pub use prefix::{PrefixCache, PrefixLookup};
pub use seq_kv::{SeqKv, SeqLayer};
pub use space::KvSpace;
pub use state::StateCache;
pub use stored::{KvLayout, KvQuant, Stored};

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use crate::rotary::Rope;

/// Positions a cache buffer grows by (mlx-lm's `KVCache.step`).
pub(crate) const STEP: i32 = 256;

/// What one layer of a model keeps between forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Keys and values per position; with a window, a query reads at most that many keys
    /// (itself included) and the cache keeps only what the window can still reach.
    Attention { window: Option<usize> },
    /// A fixed-size recurrent state per sequence, of `slots` arrays.
    State { slots: usize },
}

impl LayerKind {
    /// The sliding window of an attention layer.
    pub fn window(self) -> Option<usize> {
        match self {
            LayerKind::Attention { window } => window,
            LayerKind::State { .. } => None,
        }
    }

    pub fn is_state(self) -> bool {
        matches!(self, LayerKind::State { .. })
    }

    /// An empty batched cache of this kind for rows written with `padding` on the left.
    pub fn fresh(self, padding: Vec<i32>, quant: Option<KvQuant>) -> LayerCache {
        match self {
            LayerKind::Attention { window } => {
                LayerCache::Batched(BatchKv::with_padding(padding, quant).windowed(window))
            }
            LayerKind::State { slots } => LayerCache::State(StateCache::new(slots, padding)),
        }
    }
}

/// The cache of one layer, in one of its layouts.
#[derive(Debug)]
pub enum LayerCache {
    Dense(DenseKv),
    Batched(BatchKv),
    State(StateCache),
}

/// The error of a cache operation asked of a layer of the other kind (a model bug).
fn wrong_kind(what: &str) -> Exception {
    Exception::custom(format!("{what} asked of a layer cache of the other kind"))
}

/// An attention mask that a layout computed for the queries of one forward pass.
pub enum Mask {
    /// Every query sees every key (one query, no padding).
    None,
    /// Causal over the new positions, no padding.
    Causal,
    /// A boolean `[B, 1, L, T]` mask (true = attend): padding and causality together.
    Array(Array),
}

impl Mask {
    /// The mask of the last of `queries` queries alone: the last position of a pass sees
    /// every key a causal mask lets it see, so only an explicit mask (padding, a window)
    /// stays, as its last row (`[B, 1, 1, T]`; one already that shape is every query's).
    pub fn last_query(self, queries: i32) -> Mask {
        match self {
            Mask::None | Mask::Causal => Mask::None,
            Mask::Array(a) if a.shape()[2] == 1 => Mask::Array(a),
            Mask::Array(a) => Mask::Array(a.index((.., .., queries - 1.., ..))),
        }
    }

    pub fn as_sdpa(&self) -> Option<ScaledDotProductAttentionMask<'_>> {
        match self {
            Mask::None => None,
            Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
            Mask::Array(a) => Some(ScaledDotProductAttentionMask::Array(a)),
        }
    }
}

/// The mask of `queries` new positions at the end of one sequence's `keys` positions.
fn dense_mask(keys: i32, queries: i32, window: Option<usize>) -> Result<Mask, Exception> {
    match window.map(|w| w as i32).filter(|&w| w < keys) {
        None if queries > 1 => Ok(Mask::Causal),
        None => Ok(Mask::None),
        Some(w) => {
            let k = Array::arange::<_, i32>(None, keys, None)?.reshape(&[1, 1, 1, keys])?;
            let q = Array::arange::<_, i32>(keys - queries, keys, None)?
                .reshape(&[1, 1, queries, 1])?;
            let distance = q.subtract(&k)?;
            let mask = distance
                .ge(Array::from_int(0))?
                .logical_and(&distance.lt(Array::from_int(w))?)?;
            Ok(Mask::Array(mask))
        }
    }
}

impl LayerCache {
    /// Applies the rotary embedding to `[B, heads, L, head_dim]` at the positions the new
    /// tokens will take (per row for a batch).
    pub fn rope(&self, rope: &Rope, x: &Array) -> Result<Array, Exception> {
        match self {
            LayerCache::Dense(c) => rope.forward(x, c.offset() as i32),
            LayerCache::Batched(c) => c.rope(rope, x),
            LayerCache::State(_) => Err(wrong_kind("a rotary offset")),
        }
    }

    /// Appends `[B, kv_heads, L, head_dim]` keys and values; returns all held so far, as the
    /// layout stores them.
    pub fn update_and_fetch(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Stored, Stored), Exception> {
        match self {
            LayerCache::Dense(c) => c.update_and_fetch(keys, values),
            LayerCache::Batched(c) => c.update_and_fetch(keys, values),
            LayerCache::State(_) => Err(wrong_kind("keys and values")),
        }
    }

    /// The mask for `queries` new positions, called after [`Self::update_and_fetch`]; with a
    /// `window`, each query sees at most that many keys, itself included (mlx-lm's
    /// `RotatingKVCache` with `max_size = window`, and its windowed causal mask).
    pub fn mask(&self, queries: i32, window: Option<usize>) -> Result<Mask, Exception> {
        match self {
            LayerCache::Dense(c) => dense_mask(c.offset() as i32, queries, window),
            LayerCache::Batched(c) => c.mask(queries, window),
            LayerCache::State(_) => Err(wrong_kind("an attention mask")),
        }
    }

    /// Whether the last `window` positions held are valid for every row (see
    /// [`BatchKv::whole_window`]); for one sequence, whether it holds that many.
    pub fn whole_window(&self, window: usize) -> bool {
        match self {
            LayerCache::Dense(c) => c.offset() >= window,
            LayerCache::Batched(c) => c.whole_window(window),
            LayerCache::State(_) => false,
        }
    }

    /// Drops the last `drop[r]` positions of each row `r` (speculative rollback).
    pub fn rollback(&mut self, drop: &[usize]) -> Result<(), Exception> {
        match self {
            LayerCache::Dense(c) => match drop {
                [n] if *n <= c.offset() => {
                    c.trim(*n);
                    Ok(())
                }
                _ => Err(Exception::custom(format!(
                    "rollback of {drop:?} positions in a one-sequence cache of {}",
                    c.offset()
                ))),
            },
            LayerCache::Batched(c) => c.rollback(drop),
            LayerCache::State(_) if drop.iter().all(|&n| n == 0) => Ok(()),
            LayerCache::State(_) => Err(Exception::custom(
                "a recurrent state cannot be rolled back to an earlier position",
            )),
        }
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        match self {
            LayerCache::Dense(c) => c.nbytes(),
            LayerCache::Batched(c) => c.nbytes(),
            LayerCache::State(c) => c.nbytes(),
        }
    }

    /// The arrays to evaluate to materialise the cache.
    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Dense(c) => c.state(),
            LayerCache::Batched(c) => c.state(),
            LayerCache::State(c) => c.arrays(),
        }
    }

    pub fn as_batched_mut(&mut self) -> Option<&mut BatchKv> {
        match self {
            LayerCache::Batched(c) => Some(c),
            LayerCache::Dense(_) | LayerCache::State(_) => None,
        }
    }

    /// The recurrent state of a state layer (what its forward pass reads and replaces).
    pub fn as_state_mut(&mut self) -> Result<&mut StateCache, Exception> {
        match self {
            LayerCache::State(c) => Ok(c),
            LayerCache::Dense(_) | LayerCache::Batched(_) => Err(wrong_kind("a recurrent state")),
        }
    }

    /// Keeps rows `keep` of a batched layout, in that order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        match self {
            LayerCache::Batched(c) => c.filter(keep),
            LayerCache::State(c) => c.filter(keep),
            LayerCache::Dense(_) => Err(wrong_kind("a row filter")),
        }
    }

    /// Appends the rows of `other`, a cache of the same kind.
    pub fn extend(&mut self, other: LayerCache) -> Result<(), Exception> {
        match (self, other) {
            (LayerCache::Batched(a), LayerCache::Batched(b)) => a.extend(b),
            (LayerCache::State(a), LayerCache::State(b)) => a.extend(b),
            _ => Err(wrong_kind("joining rows")),
        }
    }

    /// The rows of `parts`, caches of one kind, in one cache, in order (see
    /// [`BatchKv::join`]: each buffer copied once).
    pub fn join(parts: Vec<LayerCache>) -> Result<LayerCache, Exception> {
        let mut parts = parts.into_iter();
        let Some(first) = parts.next() else {
            return Err(Exception::custom("joining no layer caches"));
        };
        match first {
            LayerCache::Batched(first) => {
                let mut all = vec![first];
                for part in parts {
                    match part {
                        LayerCache::Batched(b) => all.push(b),
                        _ => return Err(wrong_kind("joining rows")),
                    }
                }
                Ok(LayerCache::Batched(BatchKv::join(all)?))
            }
            // A recurrent state is a few small arrays per row: joined two at a time.
            mut first => {
                for part in parts {
                    first.extend(part)?;
                }
                Ok(first)
            }
        }
    }

    /// The caches of several units of rows (one cache per layer each) as one cache per layer,
    /// their rows in order: each layer's buffers copied once ([`Self::join`]).
    pub fn join_sequences(units: Vec<Vec<LayerCache>>) -> Result<Vec<LayerCache>, Exception> {
        let mut per_layer: Vec<Vec<LayerCache>> = Vec::new();
        for layers in units {
            per_layer.resize_with(layers.len().max(per_layer.len()), Vec::new);
            for (parts, layer) in per_layer.iter_mut().zip(layers) {
                parts.push(layer);
            }
        }
        per_layer.into_iter().map(LayerCache::join).collect()
    }

    /// Whether this is one row of attention keys and values that can be cut back and written
    /// again ([`BatchKv::rewindable`]).
    pub fn rewindable(&self) -> bool {
        matches!(self, LayerCache::Batched(c) if c.rewindable())
    }

    /// Cuts a [`Self::rewindable`] row back to its first `len` positions.
    pub fn rewind(&mut self, len: usize) -> Result<(), Exception> {
        match self {
            LayerCache::Batched(c) => c.rewind(len),
            _ => Err(wrong_kind("a rewind")),
        }
    }

    /// Positions (tokens) row `r` holds.
    pub fn row_len(&self, r: usize) -> usize {
        match self {
            LayerCache::Dense(c) => c.offset(),
            LayerCache::Batched(c) => c.row_len(r),
            LayerCache::State(c) => c.row_len(r),
        }
    }

    /// A copy of row `r` for the prefix cache and the logical position it starts at (a state
    /// starts where it ends, see [`SeqKv`]); `None` before anything was written.
    pub fn row_copy(&self, r: usize) -> Result<Option<(SeqLayer, usize)>, Exception> {
        match self {
            LayerCache::Batched(c) => Ok(c
                .row_copy(r)?
                .map(|(k, v)| (SeqLayer::Kv(k, v), c.row_start(r)))),
            LayerCache::State(c) => Ok(c
                .row_copy(r)?
                .map(|arrays| (SeqLayer::State(arrays), c.row_len(r)))),
            LayerCache::Dense(_) => Err(wrong_kind("a row copy")),
        }
    }

    /// Cuts what a windowed attention layer's window no longer reaches (nothing for other
    /// kinds).
    pub fn evict_outside_window(&mut self) -> Result<(), Exception> {
        match self {
            LayerCache::Batched(c) => c.evict_outside_window(),
            LayerCache::Dense(_) | LayerCache::State(_) => Ok(()),
        }
    }
}
