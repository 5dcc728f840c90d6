//! Keys or values as a cache holds them: plain `[B, kv_heads, T, head_dim]` arrays, or quantized
//! along `head_dim` with MLX's affine quantization (packed weights, scales and biases that
//! share the leading `[B, kv_heads, T]` dimensions).
//!
//! The cache layouts move positions and rows around (grow, slice, pad, take rows, copy a row)
//! without caring which of the two they hold: every such operation applies to each component
//! alike along the same axes. Only attention reads them differently (see
//! [`attention`](crate::models::layers::attend)).
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp, TryIndexMutOp};
use mlx_rs::ops::{concatenate, quantize, zeros_dtype};
use mlx_rs::Array;

/// Affine quantization of the KV cache (`--kv-bits`, `--kv-group-size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuant {
    pub bits: i32,
    pub group_size: i32,
}

impl KvQuant {
    /// KV bytes per element of `head_dim` next to `dtype_bytes` unquantized: packed bits plus
    /// one scale and one bias (in the model's dtype) per group.
    pub fn bytes_per_element(&self, dtype_bytes: usize) -> f64 {
        self.bits as f64 / 8.0 + 2.0 * dtype_bytes as f64 / self.group_size as f64
    }
}

/// How a sequence's KV is stored as it grows (`--kv-bits`, `--quantized-kv-start`): plain
/// while its longest row holds at most `start` positions, quantized after that, as mlx-lm's
/// `maybe_quantize_kv_cache` converts a cache once its offset passes the start. `start` 0
/// quantizes from the first position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvLayout {
    pub quant: Option<KvQuant>,
    pub start: usize,
}

impl KvLayout {
    /// How a cache whose longest row holds `len` positions stores its keys and values.
    pub fn at(&self, len: usize) -> Option<KvQuant> {
        self.quant.filter(|_| self.start == 0 || len > self.start)
    }

    /// KV bytes a sequence of `tokens` positions may need, at `plain` and `quantized` bytes
    /// per token: the positions before the start plain, the rest quantized (an upper bound,
    /// since a batch quantizes every row once one row passes the start).
    pub fn bytes_for(&self, tokens: usize, plain: u64, quantized: u64) -> u64 {
        match self.quant {
            None => tokens as u64 * plain,
            Some(_) => {
                let before = tokens.min(self.start) as u64;
                before * plain + (tokens as u64 - before) * quantized
            }
        }
    }
}

#[derive(Debug, Clone)]
pub enum Stored {
    Plain(Array),
    Quantized {
        weights: Array,
        scales: Array,
        biases: Array,
        quant: KvQuant,
    },
}

impl Stored {
    /// `x` `[B, kv_heads, L, head_dim]` as the cache keeps it.
    pub fn new(x: &Array, quant: Option<KvQuant>) -> Result<Self, Exception> {
        match quant {
            None => Ok(Stored::Plain(x.clone())),
            Some(quant) => {
                let (weights, scales, biases) = quantize(x, quant.group_size, quant.bits)?;
                Ok(Stored::Quantized {
                    weights,
                    scales,
                    biases,
                    quant,
                })
            }
        }
    }

    /// This, stored quantized with `quant` (a plain copy is quantized; a quantized one kept).
    pub fn quantized(&self, quant: KvQuant) -> Result<Self, Exception> {
        match self {
            Stored::Plain(a) => Stored::new(a, Some(quant)),
            Stored::Quantized { .. } => Ok(self.clone()),
        }
    }

    pub fn is_quantized(&self) -> bool {
        matches!(self, Stored::Quantized { .. })
    }

    /// The quantization, when stored quantized.
    pub fn quant(&self) -> Option<KvQuant> {
        match self {
            Stored::Quantized { quant, .. } => Some(*quant),
            Stored::Plain(_) => None,
        }
    }

    /// Packed weights, scales and biases, when stored quantized.
    pub fn packed(&self) -> Option<[&Array; 3]> {
        match self {
            Stored::Quantized {
                weights,
                scales,
                biases,
                ..
            } => Some([weights, scales, biases]),
            Stored::Plain(_) => None,
        }
    }

    /// Positions held (axis 2).
    pub fn positions(&self) -> i32 {
        self.first().shape()[2]
    }

    fn first(&self) -> &Array {
        match self {
            Stored::Plain(a) => a,
            Stored::Quantized { weights, .. } => weights,
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Stored::Plain(a) => vec![a],
            Stored::Quantized {
                weights,
                scales,
                biases,
                ..
            } => vec![weights, scales, biases],
        }
    }

    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// The same operation on every component.
    pub fn map(&self, f: impl Fn(&Array) -> Result<Array, Exception>) -> Result<Self, Exception> {
        Ok(match self {
            Stored::Plain(a) => Stored::Plain(f(a)?),
            Stored::Quantized {
                weights,
                scales,
                biases,
                quant,
            } => Stored::Quantized {
                weights: f(weights)?,
                scales: f(scales)?,
                biases: f(biases)?,
                quant: *quant,
            },
        })
    }

    /// Positions `..n`.
    pub fn prefix(&self, n: i32) -> Result<Self, Exception> {
        self.map(|a| Ok(a.index((Ellipsis, ..n, ..))))
    }

    /// Zeros shaped like this, with `rows` rows and `positions` positions.
    pub fn zeros(&self, rows: i32, positions: i32) -> Result<Self, Exception> {
        self.map(|a| {
            let s = a.shape();
            zeros_dtype(&[rows, s[1], positions, s[3]], a.dtype())
        })
    }

    /// `parts` (all of one kind) joined along `axis`.
    pub fn concat(parts: &[Stored], axis: i32) -> Result<Self, Exception> {
        let component = |i: usize| -> Result<Array, Exception> {
            let arrays: Vec<Array> = parts.iter().map(|p| p.arrays()[i].clone()).collect();
            concatenate(&arrays, axis)
        };
        match &parts[0] {
            Stored::Plain(_) => Ok(Stored::Plain(component(0)?)),
            Stored::Quantized { quant, .. } => {
                if parts
                    .iter()
                    .any(|p| !matches!(p, Stored::Quantized { quant: q, .. } if q == quant))
                {
                    return Err(Exception::custom(
                        "cannot join KV caches stored with different quantization",
                    ));
                }
                Ok(Stored::Quantized {
                    weights: component(0)?,
                    scales: component(1)?,
                    biases: component(2)?,
                    quant: *quant,
                })
            }
        }
    }

    /// Writes `new` at positions `start..start + new.positions()`.
    fn write(&mut self, start: i32, new: &Stored) -> Result<(), Exception> {
        let end = start + new.positions();
        match (self, new) {
            (Stored::Plain(a), Stored::Plain(n)) => a.try_index_mut((Ellipsis, start..end, ..), n),
            (
                Stored::Quantized {
                    weights,
                    scales,
                    biases,
                    ..
                },
                Stored::Quantized {
                    weights: w,
                    scales: s,
                    biases: b,
                    ..
                },
            ) => {
                weights.try_index_mut((Ellipsis, start..end, ..), w)?;
                scales.try_index_mut((Ellipsis, start..end, ..), s)?;
                biases.try_index_mut((Ellipsis, start..end, ..), b)
            }
            _ => Err(Exception::custom(
                "cannot write quantized and plain KV into one buffer",
            )),
        }
    }
}

/// The positions a buffer is allocated with to hold `needed`: whole [`STEP`](super::STEP)s,
/// as mlx-lm's caches grow, **plus one**.
///
/// **Decision: a buffer's length is never a multiple of 256.** MLX's CUDA attention sends a
/// decode step to cuDNN when its keys are a slice of a buffer whose length is a multiple of
/// 256 (the shape mlx-lm's cache makes), and cuDNN builds an execution plan for each new pair
/// of row count and buffer length before the step runs: 50–400 ms on an H100 against a
/// 0.1–0.3 ms attention call (`scripts/bench/sdpa_shapes.py`, BENCHMARKS.md). A server's
/// decode meets a new pair whenever a stream joins or leaves or a buffer grows. Off those
/// lengths the step runs MLX's own vector kernel, which builds nothing and ran as fast or
/// faster at every measured shape. One spare position per buffer costs 1/256 of its memory.
pub(crate) fn capacity_for(needed: i32) -> i32 {
    let step = super::STEP;
    ((needed - 2).max(0) / step + 1) * step + 1
}

/// Writes `new` at positions `prev..prev + L` of `buf`, growing it to
/// [`capacity_for`] `prev + L`; returns positions `..prev + L`. The one write path of every
/// layout.
pub fn write_positions(
    buf: &mut Option<Stored>,
    prev: i32,
    new: &Stored,
) -> Result<Stored, Exception> {
    let l = new.positions();
    let capacity = buf.as_ref().map_or(0, Stored::positions);
    if buf.is_none() || prev + l > capacity {
        let kept = if buf.is_some() { prev.min(capacity) } else { 0 };
        let grown = new.zeros(new.first().shape()[0], capacity_for(prev + l) - kept)?;
        *buf = Some(match buf.take() {
            Some(old) => {
                let old = if prev < capacity {
                    old.prefix(prev)?
                } else {
                    old
                };
                Stored::concat(&[old, grown], 2)?
            }
            None => grown,
        });
    }
    let end = prev + l;
    let held = buf.as_mut().expect("allocated above");
    held.write(prev, new)?;
    if end < held.positions() {
        held.prefix(end)
    } else {
        Ok(held.clone())
    }
}

/// 8 bits in groups of 64, for tests.
#[cfg(test)]
pub(crate) const Q8: KvQuant = KvQuant {
    bits: 8,
    group_size: 64,
};

#[cfg(test)]
mod tests {
    use super::*;

    use super::Q8;

    #[test]
    fn buffers_grow_by_steps_and_are_never_a_multiple_of_256_long() {
        assert_eq!(capacity_for(1), 257);
        assert_eq!(capacity_for(257), 257);
        assert_eq!(capacity_for(258), 513);
        assert_eq!(capacity_for(513), 513);
        assert_eq!(capacity_for(514), 769);
        for needed in 1..2000 {
            let c = capacity_for(needed);
            assert!(
                c >= needed && c - needed <= super::super::STEP,
                "{needed} -> {c}"
            );
            assert_ne!(c % 256, 0, "{needed} -> {c}");
        }
    }

    #[test]
    fn the_layout_quantizes_past_its_start() {
        let plain = KvLayout::default();
        assert_eq!(plain.at(1_000_000), None);
        let from_zero = KvLayout {
            quant: Some(Q8),
            start: 0,
        };
        assert_eq!(from_zero.at(0), Some(Q8));
        let later = KvLayout {
            quant: Some(Q8),
            start: 256,
        };
        assert_eq!(later.at(256), None);
        assert_eq!(later.at(257), Some(Q8));
    }

    #[test]
    fn reservations_count_plain_bytes_before_the_start() {
        let layout = KvLayout {
            quant: Some(Q8),
            start: 100,
        };
        assert_eq!(layout.bytes_for(50, 10, 3), 500);
        assert_eq!(layout.bytes_for(150, 10, 3), 1000 + 150);
        assert_eq!(KvLayout::default().bytes_for(150, 10, 3), 1500);
        let from_zero = KvLayout {
            quant: Some(Q8),
            start: 0,
        };
        assert_eq!(from_zero.bytes_for(150, 10, 3), 450);
    }
}
