//! The dense layout: the key/value cache of one layer of one sequence.
//!
//! It grows in steps of 256 positions, like mlx-lm's `KVCache`, and returns the filled prefix,
//! so attention sees exactly the shapes mlx-lm gives it (that keeps outputs bit-identical).
//! The runtime batches sequences in [`BatchKv`](super::BatchKv); this layout serves the
//! serial reference path that parity tests compare against mlx-lm's `generate_step`.
use mlx_rs::error::Exception;
use mlx_rs::Array;

#[derive(Debug, Default)]
pub struct DenseKv {
    keys: Option<Array>,
    values: Option<Array>,
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
        self.keys.as_ref().map_or(0, Array::nbytes) + self.values.as_ref().map_or(0, Array::nbytes)
    }

    /// Appends `[B, kv_heads, L, head_dim]` keys and values; returns all keys and values so far.
    pub fn update_and_fetch(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), Exception> {
        let prev = self.offset;
        let fetched = super::write_positions(&mut self.keys, &mut self.values, prev, keys, values)?;
        self.offset += keys.shape()[2];
        Ok(fetched)
    }

    /// Drops the last `n` positions (at most all of them).
    pub fn trim(&mut self, n: usize) {
        self.offset -= (n as i32).min(self.offset);
    }

    /// The arrays to evaluate to materialise the cache (after a prefill chunk).
    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }
}
