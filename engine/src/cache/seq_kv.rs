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
use mlx_rs::Array;

use super::Stored;

#[derive(Debug, Clone, Default)]
pub struct SeqKv {
    /// Keys and values per layer, `[1, kv_heads, positions, head_dim]`.
    pub layers: Vec<(Stored, Stored)>,
    /// Per layer, the logical position of the first one held: the layer holds positions
    /// `start..tokens`. 0 except for windowed layers that evicted positions.
    pub starts: Vec<usize>,
}

impl SeqKv {
    pub fn new(layers: Vec<(Stored, Stored)>, starts: Vec<usize>) -> Self {
        debug_assert_eq!(layers.len(), starts.len());
        Self { layers, starts }
    }

    /// Bytes of every array held.
    pub fn nbytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|(k, v)| (k.nbytes() + v.nbytes()) as u64)
            .sum()
    }

    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.layers
            .iter()
            .flat_map(|(k, v)| k.arrays().into_iter().chain(v.arrays()))
    }

    /// Whether this entry can restore the first `n` positions of a prompt (see [`serves`]).
    pub fn serves(&self, n: usize, windows: &[Option<usize>]) -> bool {
        serves(&self.starts, windows, n)
    }

    /// Whether this entry serves every prompt `other` serves (see [`dominates`]).
    pub fn dominates(&self, other: &SeqKv) -> bool {
        dominates(&self.starts, &other.starts)
    }
}

/// Every layer held from position 0 (a cache without windows, or one that evicted nothing).
impl From<Vec<(Stored, Stored)>> for SeqKv {
    fn from(layers: Vec<(Stored, Stored)>) -> Self {
        let starts = vec![0; layers.len()];
        Self { layers, starts }
    }
}

/// Whether an entry whose layers start at `starts` can restore the first `n` positions of a
/// prompt, for a model whose layers attend within `windows`: a layer that starts later than 0
/// must still hold the `window - 1` positions before `n` that the query at `n` reads, besides
/// itself. A layer without a window that starts later than 0 (another model's entry) cannot.
pub fn serves(starts: &[usize], windows: &[Option<usize>], n: usize) -> bool {
    starts.iter().enumerate().all(|(layer, &start)| {
        start == 0
            || windows
                .get(layer)
                .copied()
                .flatten()
                .is_some_and(|w| start + w <= n + 1)
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
        let windows = [None, Some(8)];
        assert!(serves(&[0, 0], &windows, 3));
        // Start 20, window 8: the query at 27 reads 20..=27.
        assert!(serves(&[0, 20], &windows, 27));
        assert!(!serves(&[0, 20], &windows, 26));
        // A global layer that evicted positions serves nothing.
        assert!(!serves(&[5, 0], &windows, 100));
    }

    #[test]
    fn only_an_entry_starting_no_later_dominates() {
        assert!(dominates(&[0, 10], &[0, 10]));
        assert!(dominates(&[0, 10], &[0, 12]));
        assert!(!dominates(&[0, 12], &[0, 10]));
        assert!(!dominates(&[0], &[0, 0]));
    }
}
