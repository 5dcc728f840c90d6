//! The dense layout: the key/value cache of one layer of one sequence.
//!
//! It grows in steps of 256 positions, like mlx-lm's `KVCache`, and returns the filled prefix,
//! so attention sees exactly the shapes mlx-lm gives it (that keeps outputs bit-identical).
//! The runtime batches sequences in [`BatchKv`](super::BatchKv); this layout serves the
//! serial reference path that parity tests compare against mlx-lm's `generate_step`.
use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::stored::{write_positions, Stored};

#[derive(Debug, Default)]
pub struct DenseKv {
    keys: Option<Stored>,
    values: Option<Stored>,
    offset: i32,
}

impl DenseKv {
    pub fn new() -> Self {
        Self::default()
    }

    /// Positions filled so far.
    pub fn offset(&self) -> usize {
        self.offset as usize
    }

    /// Bytes held by the buffers (including the unfilled tail of the last step).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, Stored::nbytes)
            + self.values.as_ref().map_or(0, Stored::nbytes)
    }

    /// Appends `[B, kv_heads, L, head_dim]` keys and values; returns all keys and values so far.
    pub fn update_and_fetch(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Stored, Stored), Exception> {
        let prev = self.offset;
        let k = write_positions(&mut self.keys, prev, &Stored::Plain(keys.clone()))?;
        let v = write_positions(&mut self.values, prev, &Stored::Plain(values.clone()))?;
        self.offset += keys.shape()[2];
        Ok((k, v))
    }

    /// Drops the last `n` positions (at most all of them).
    pub fn trim(&mut self, n: usize) {
        self.offset -= (n as i32).min(self.offset);
    }

    /// The arrays to evaluate to materialise the cache (after a prefill chunk).
    pub fn state(&self) -> Vec<&Array> {
        self.keys
            .iter()
            .chain(self.values.iter())
            .flat_map(Stored::arrays)
            .collect()
    }
}
