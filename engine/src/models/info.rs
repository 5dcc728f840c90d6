//! The [`ModelInfo`] every family reports, built one way: the config's architecture and
//! end-of-sequence ids, the sizes the family reads, and the KV bytes from what its cache
//! really stores per token.
use mlx_rs::Dtype;
use serde_json::Value;

use super::layers::Matrix;
use super::{eos_ids, ModelInfo};

/// What one sequence's cache holds per token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvShape {
    pub layers: usize,
    /// Elements all layers together cache per token, keys and values.
    pub elements_per_token: usize,
    /// The head size a KV quantization group must divide.
    pub head_dim: i32,
}

impl KvShape {
    /// `layers` layers that each cache `elements_per_layer` per token.
    pub fn uniform(layers: usize, elements_per_layer: usize, head_dim: i32) -> Self {
        Self {
            layers,
            elements_per_token: layers * elements_per_layer,
            head_dim,
        }
    }

    /// Layers of their own `(kv_heads, head_dim)` each, caching keys and values. A KV
    /// quantization group must divide every layer's head width, so the head size reported is
    /// their greatest common divisor.
    pub fn per_layer(shapes: impl IntoIterator<Item = (i32, i32)>) -> Self {
        let (mut layers, mut elements_per_token, mut head_dim) = (0, 0, 0);
        for (kv_heads, dim) in shapes {
            layers += 1;
            elements_per_token += 2 * (kv_heads * dim) as usize;
            head_dim = gcd(head_dim, dim);
        }
        Self {
            layers,
            elements_per_token,
            head_dim,
        }
    }

    /// Every layer caches keys and values of `kv_heads` heads of `head_dim`. Windowed layers
    /// count as global ones: an upper bound, since the batch keeps only their last window
    /// (and a little more), so admission never over-commits.
    pub fn heads(layers: usize, kv_heads: i32, head_dim: i32) -> Self {
        Self::uniform(layers, 2 * (kv_heads * head_dim) as usize, head_dim)
    }
}

fn gcd(a: i32, b: i32) -> i32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The dtype of activations: what the embedding `embed` gives (its weight's, or its scales'
/// when it is quantized).
pub fn activation_dtype(embed: &Matrix) -> Dtype {
    match embed {
        Matrix::Dense(w) => w.dtype(),
        Matrix::Quantized(q) => q.scales.dtype(),
    }
}

/// Bytes per element of activations (and so of the KV cache): the embedding's dtype, or its
/// scales' when it is quantized.
pub fn kv_dtype_bytes(embed: &Matrix) -> usize {
    dtype_bytes(activation_dtype(embed))
}

/// Bytes per element of activations of `dtype` (and so of the KV cache).
pub fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float32 => 4,
        _ => 2,
    }
}

/// The [`ModelInfo`] of a model whose activations have the dtype of `embed_tokens`;
/// `weight_bytes` is filled after materializing.
pub(crate) fn model_info(
    config: &Value,
    vocab_size: usize,
    context_length: usize,
    kv: KvShape,
    embed_tokens: &Matrix,
) -> ModelInfo {
    model_info_in(
        config,
        vocab_size,
        context_length,
        kv,
        activation_dtype(embed_tokens),
    )
}

/// [`model_info`] of a model whose activations are `activation` (a pipeline stage may hold
/// no embedding to read it from).
pub(crate) fn model_info_in(
    config: &Value,
    vocab_size: usize,
    context_length: usize,
    kv: KvShape,
    activation: Dtype,
) -> ModelInfo {
    let dtype_bytes = dtype_bytes(activation);
    ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size,
        num_layers: kv.layers,
        context_length,
        weight_bytes: 0,
        kv_bytes_per_token: kv.elements_per_token * dtype_bytes,
        kv_dtype_bytes: dtype_bytes,
        head_dim: kv.head_dim as usize,
        state_bytes_per_sequence: 0,
        eos_token_ids: eos_ids(config),
    }
}
