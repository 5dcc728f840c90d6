//! The dense layout: the key/value cache of one layer of one sequence.
//!
//! It grows in steps of 256 positions, like mlx-lm's `KVCache`, and returns the filled prefix,
//! so attention sees exactly the shapes mlx-lm gives it (that keeps outputs bit-identical).
//! The runtime batches sequences in [`BatchKv`](super::BatchKv); this layout serves the
//! serial reference path that parity tests compare against mlx-lm's `generate_step`.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;

use super::STEP;

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
        let l = keys.shape()[2];
        let capacity = self.keys.as_ref().map_or(0, |k| k.shape()[2]);
        if self.keys.is_none() || prev + l > capacity {
            let ks = keys.shape();
            let vs = values.shape();
            let steps = (STEP + l - 1) / STEP;
            let new_k = zeros_dtype(&[ks[0], ks[1], steps * STEP, ks[3]], keys.dtype())?;
            let new_v = zeros_dtype(&[vs[0], vs[1], steps * STEP, vs[3]], values.dtype())?;
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % STEP != 0 {
                        k = k.index((Ellipsis, ..prev, ..));
                        v = v.index((Ellipsis, ..prev, ..));
                    }
                    self.keys = Some(concatenate(&[k, new_k], 2)?);
                    self.values = Some(concatenate(&[v, new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += l;
        let end = self.offset;
        let (k_buf, v_buf) = match (self.keys.as_mut(), self.values.as_mut()) {
            (Some(k), Some(v)) => (k, v),
            _ => unreachable!("buffers were allocated above"),
        };
        k_buf.try_index_mut((Ellipsis, prev..end, ..), keys)?;
        v_buf.try_index_mut((Ellipsis, prev..end, ..), values)?;
        if end < k_buf.shape()[2] {
            Ok((
                k_buf.index((Ellipsis, ..end, ..)),
                v_buf.index((Ellipsis, ..end, ..)),
            ))
        } else {
            Ok((k_buf.clone(), v_buf.clone()))
        }
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
