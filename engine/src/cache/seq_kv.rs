//! One sequence's KV outside the batch: what the prefix cache keeps, the SSD tier writes, a
//! generation checkpoint saves and a hit restores.
//!
//! A layer that attends within a sliding window keeps only the positions its window can still
//! reach (see [`BatchKv`](super::BatchKv)), so its copy starts at a logical position `start`
//! of its own; every other layer's copy starts at 0. Two rules follow, both on starts alone:
//! - an entry serves a prompt sharing `n` tokens with it only if each windowed layer holds
//!   what the query at position `n` reads ([`serves`]);
//! - a longer entry makes a shorter one it extends redundant only if it serves every prompt
//!   the shorter one serves ([`dominates`]): a longer windowed entry has cut positions that a
//!   prompt branching early still needs.
//!
//! A recurrent layer's state stands for all its tokens and cannot be cut: its copy "starts"
//! where it ends, at the entry's length, so by the same two rules an entry holding a state
//! serves exactly its own length and no longer entry makes it redundant.
use mlx_rs::Array;

use super::{LayerKind, Stored};

/// One layer of a sequence's cache.
#[derive(Debug, Clone)]
pub enum SeqLayer {
    /// Keys and values, `[1, kv_heads, positions, head_dim]`.
    Kv(Stored, Stored),
    /// A recurrent layer's arrays, `[1, ...]` each.
    State(Vec<Array>),
}

impl SeqLayer {
    pub fn nbytes(&self) -> usize {
        match self {
            SeqLayer::Kv(k, v) => k.nbytes() + v.nbytes(),
            SeqLayer::State(s) => s.iter().map(Array::nbytes).sum(),
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            SeqLayer::Kv(k, v) => k.arrays().into_iter().chain(v.arrays()).collect(),
            SeqLayer::State(s) => s.iter().collect(),
        }
    }

    /// The keys and values of an attention layer.
    pub fn kv(&self) -> Option<(&Stored, &Stored)> {
        match self {
            SeqLayer::Kv(k, v) => Some((k, v)),
            SeqLayer::State(_) => None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct SeqKv {
    pub layers: Vec<SeqLayer>,
    /// Per layer, the logical position of the first one held: the layer holds positions
    /// `start..tokens`. 0 except for windowed layers that evicted positions, and for
    /// recurrent layers, whose state starts at the entry's length.
    pub starts: Vec<usize>,
}

impl SeqKv {
    pub fn new(layers: Vec<SeqLayer>, starts: Vec<usize>) -> Self {
        debug_assert_eq!(layers.len(), starts.len());
        Self { layers, starts }
    }

    /// Bytes of every array held.
    pub fn nbytes(&self) -> u64 {
        self.layers.iter().map(|l| l.nbytes() as u64).sum()
    }

    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flat_map(SeqLayer::arrays)
    }

    /// Whether every layer holds keys and values (no recurrent state).
    pub fn is_kv_only(&self) -> bool {
        self.layers.iter().all(|l| l.kv().is_some())
    }

    /// Whether this entry can restore the first `n` positions of a prompt (see [`serves`]).
    pub fn serves(&self, n: usize, kinds: &[LayerKind]) -> bool {
        serves(&self.starts, kinds, n)
    }

    /// Whether this entry serves every prompt `other` serves (see [`dominates`]).
    pub fn dominates(&self, other: &SeqKv) -> bool {
        dominates(&self.starts, &other.starts)
    }
}

/// Every layer's keys and values held from position 0 (a cache without windows, or one that
/// evicted nothing).
impl From<Vec<(Stored, Stored)>> for SeqKv {
    fn from(layers: Vec<(Stored, Stored)>) -> Self {
        let starts = vec![0; layers.len()];
        let layers = layers
            .into_iter()
            .map(|(k, v)| SeqLayer::Kv(k, v))
            .collect();
        Self { layers, starts }
    }
}

/// Whether an entry whose layers start at `starts` can restore the first `n` positions of a
/// prompt, for a model whose layers are `kinds`: a windowed layer that starts later than 0
/// must still hold the `window - 1` positions before `n` that the query at `n` reads, besides
/// itself; a recurrent layer's state serves only the length it stands for. A layer without a
/// window that starts later than 0 (another model's entry) cannot.
pub fn serves(starts: &[usize], kinds: &[LayerKind], n: usize) -> bool {
    starts
        .iter()
        .enumerate()
        .all(|(layer, &start)| match kinds.get(layer) {
            Some(LayerKind::State { .. }) => start == n,
            Some(LayerKind::Attention { window: Some(w) }) => start == 0 || start + w <= n + 1,
            Some(LayerKind::Attention { window: None }) | None => start == 0,
        })
}

/// Whether an entry starting at `a` serves every prompt that one starting at `b` does, given
/// that `a` holds `b`'s tokens (it extends them): each of its layers starts no later.
pub fn dominates(a: &[usize], b: &[usize]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x <= y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_windowed_layer_serves_from_its_start_plus_the_window() {
        let kinds = [
            LayerKind::Attention { window: None },
            LayerKind::Attention { window: Some(8) },
        ];
        assert!(serves(&[0, 0], &kinds, 3));
        // Start 20, window 8: the query at 27 reads 20..=27.
        assert!(serves(&[0, 20], &kinds, 27));
        assert!(!serves(&[0, 20], &kinds, 26));
        // A global layer that evicted positions serves nothing.
        assert!(!serves(&[5, 0], &kinds, 100));
    }

    #[test]
    fn a_state_serves_exactly_its_length_and_a_longer_one_does_not_replace_it() {
        let kinds = [
            LayerKind::State { slots: 1 },
            LayerKind::Attention { window: None },
        ];
        assert!(serves(&[12, 0], &kinds, 12));
        assert!(!serves(&[12, 0], &kinds, 11));
        assert!(!serves(&[12, 0], &kinds, 13));
        assert!(!dominates(&[20, 0], &[12, 0]));
    }

    #[test]
    fn only_an_entry_starting_no_later_dominates() {
        assert!(dominates(&[0, 10], &[0, 10]));
        assert!(dominates(&[0, 10], &[0, 12]));
        assert!(!dominates(&[0, 12], &[0, 10]));
        assert!(!dominates(&[0], &[0, 0]));
    }
}
