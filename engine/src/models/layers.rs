//! Building blocks shared by every architecture: linear layers (dense or MLX-quantized),
//! embeddings, RMS norm, rotary embeddings and attention. Each computes exactly what the
//! matching `mlx.nn` layer does, op for op, so greedy outputs match mlx-lm token for token.
use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::Array;

use crate::cache::{LayerCache, Mask, Stored};
use crate::loader::{LoadError, Weights};

pub type Result<T> = std::result::Result<T, Exception>;

/// A weight matrix `[out, in]`, dense or quantized as MLX's affine quantization stores it.
#[derive(Debug)]
pub enum Matrix {
    Dense(Array),
    Quantized {
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        group_size: i32,
        bits: i32,
    },
}

impl Matrix {
    /// Loads `<prefix>.weight`, and `.scales`/`.biases` when the checkpoint quantized it.
    pub fn load(w: &mut Weights, prefix: &str) -> std::result::Result<Self, LoadError> {
        match w.quantization_for(prefix) {
            Some(q) => Ok(Matrix::Quantized {
                weight: w.take(&format!("{prefix}.weight"))?,
                scales: w.take(&format!("{prefix}.scales"))?,
                biases: w.take_optional(&format!("{prefix}.biases")),
                group_size: q.group_size,
                bits: q.bits,
            }),
            None => Ok(Matrix::Dense(w.take(&format!("{prefix}.weight"))?)),
        }
    }

    /// `x @ W.T`.
    pub fn matmul_t(&self, x: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(w) => x.matmul(w.t()),
            Matrix::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => quantized_matmul(x, weight, scales, biases.as_ref(), true, *group_size, *bits),
        }
    }

    /// Rows `ids` of the matrix (an embedding lookup), dequantized when needed.
    pub fn rows(&self, ids: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(w) => w.take_axis(ids, 0),
            Matrix::Quantized {
                weight,
                scales,
                biases,
                group_size,
                bits,
            } => {
                let b = biases.as_ref().map(|b| b.take_axis(ids, 0)).transpose()?;
                dequantize(
                    weight.take_axis(ids, 0)?,
                    scales.take_axis(ids, 0)?,
                    b.as_ref(),
                    *group_size,
                    *bits,
                )
            }
        }
    }

    /// Bytes held by the parameters.
    pub fn nbytes(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.nbytes(),
            Matrix::Quantized {
                weight,
                scales,
                biases,
                ..
            } => weight.nbytes() + scales.nbytes() + biases.as_ref().map_or(0, Array::nbytes),
        }
    }
}

/// `nn.Linear` (optionally `nn.QuantizedLinear`), with an optional bias.
#[derive(Debug)]
pub struct Linear {
    pub matrix: Matrix,
    pub bias: Option<Array>,
}

impl Linear {
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> std::result::Result<Self, LoadError> {
        let matrix = Matrix::load(w, prefix)?;
        let bias = if bias {
            Some(w.take(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        Ok(Self { matrix, bias })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.matrix.matmul_t(x)?;
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

/// `nn.RMSNorm`.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Array,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(w: &mut Weights, prefix: &str, eps: f32) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: w.take(&format!("{prefix}.weight"))?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        fast::rms_norm(x, Some(&self.weight), self.eps)
    }
}

/// Rotary position embedding, plain (`nn.RoPE`) or with precomputed frequencies (Llama 3).
#[derive(Debug)]
pub struct Rope {
    pub dims: i32,
    pub traditional: bool,
    pub base: f32,
    pub scale: f32,
    pub freqs: Option<Array>,
}

impl Rope {
    /// Per-row offsets `[B]` (int32) for a batch whose rows sit at different positions.
    pub fn forward_per_row(&self, x: &Array, offsets: &Array) -> Result<Array> {
        match &self.freqs {
            Some(freqs) => {
                fast::rope_dynamic(x, self.dims, self.traditional, None, 1.0, offsets, freqs)
            }
            None => fast::rope_dynamic(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                offsets,
                None,
            ),
        }
    }

    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        match &self.freqs {
            Some(freqs) => fast::rope(x, self.dims, self.traditional, None, 1.0, offset, freqs),
            None => fast::rope(
                x,
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                offset,
                None,
            ),
        }
    }
}

/// `x * sigmoid(x) * up`, as mlx-lm's `swiglu` computes it.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    mlx_rs::nn::silu(gate)?.multiply(up)
}

/// The attention core shared by the architectures: RoPE on queries and keys at the cache's
/// offsets, append to the cache, scaled dot-product attention under the mask the cache layout
/// gives (causal for several queries, padding hidden in a batch).
/// Inputs are `[B, heads, L, head_dim]`; returns `[B, L, heads * head_dim]`.
pub fn attend(
    queries: &Array,
    keys: &Array,
    values: &Array,
    rope: &Rope,
    scale: f32,
    cache: &mut LayerCache,
) -> Result<Array> {
    let queries = cache.rope(rope, queries)?;
    let keys = cache.rope(rope, keys)?;
    let (keys, values) = cache.update_and_fetch(&keys, values)?;
    let mask = cache.mask(queries.shape()[2])?;
    let l = queries.shape()[2];
    let out = match (&keys, &values) {
        (Stored::Plain(k), Stored::Plain(v)) => {
            fast::scaled_dot_product_attention(&queries, k, v, scale, mask.as_sdpa(), None)?
        }
        _ if l > QUANTIZED_ATTENTION_MAX_QUERIES || !quantized_attention_runs_here() => {
            let (k, v) = (
                dequantized(&keys, queries.dtype())?,
                dequantized(&values, queries.dtype())?,
            );
            fast::scaled_dot_product_attention(&queries, &k, &v, scale, mask.as_sdpa(), None)?
        }
        _ => quantized_attention(&queries, &keys, &values, scale, &mask)?,
    };
    let shape = out.shape().to_vec();
    out.transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[shape[0], shape[2], -1])
}

/// The most queries of one pass that attend over a quantized cache through quantized matmuls
/// (a decode step, a speculative verification of up to 16 drafts). A prefill chunk over a
/// quantized cache dequantizes it for the pass instead and runs the fused attention: MLX's
/// CUDA backend has no quantized matmul for a prefill's shapes (seen on the H200 with 8-bit
/// keys: "No implementation for problem shape 2047x4095x128"), and one dequantization per
/// chunk costs less than the unfused attention would.
const QUANTIZED_ATTENTION_MAX_QUERIES: i32 = 17;

/// Whether attention over a quantized cache may use quantized matmuls on this machine: not
/// on MLX's CUDA backend (Linux with the GPU as default device), whose 0.32.4
/// `quantized_matmul` refused even a decode step's shape on the H200 ("No implementation for
/// problem shape: 1x512x64x32"); there the cache stays quantized in memory and each pass
/// dequantizes it for the fused attention.
fn quantized_attention_runs_here() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        let gpu = mlx_rs::Device::try_default()
            .and_then(|d| d.get_type())
            .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu));
        !(cfg!(target_os = "linux") && gpu)
    })
}

/// Keys or values in `dtype`, dequantized when stored quantized.
fn dequantized(s: &Stored, dtype: mlx_rs::Dtype) -> Result<Array> {
    match s {
        Stored::Plain(a) => Ok(a.clone()),
        Stored::Quantized {
            weights,
            scales,
            biases,
            quant,
        } => dequantize(weights, scales, biases, quant.group_size, quant.bits)?.as_dtype(dtype),
    }
}

/// Attention over a quantized cache, as mlx-lm's `quantized_scaled_dot_product_attention`:
/// scores and outputs by quantized matmuls against the packed keys and values, the query heads
/// grouped over their shared KV head. `queries` `[B, heads, L, D]` → `[B, heads, L, D]`.
fn quantized_attention(
    queries: &Array,
    keys: &Stored,
    values: &Stored,
    scale: f32,
    mask: &Mask,
) -> Result<Array> {
    let (
        Stored::Quantized {
            weights: kw,
            scales: ks,
            biases: kb,
            quant,
        },
        Stored::Quantized {
            weights: vw,
            scales: vs,
            biases: vb,
            ..
        },
    ) = (keys, values)
    else {
        return Err(Exception::custom(
            "keys and values of one cache are stored differently",
        ));
    };
    let q = queries.shape().to_vec();
    let (b, heads, l, d) = (q[0], q[1], q[2], q[3]);
    let kv_heads = kw.shape()[1];
    let t = kw.shape()[2];
    let repeats = heads / kv_heads;
    // [B, kv_heads, repeats, L, D] against [B, kv_heads, 1, T, ·].
    let q = queries
        .multiply(Array::from_f32(scale).as_dtype(queries.dtype())?)?
        .reshape(&[b, kv_heads, repeats, l, d])?;
    let grouped = |a: &Array| a.expand_dims(2);
    let scores = quantized_matmul(
        &q,
        grouped(kw)?,
        grouped(ks)?,
        &grouped(kb)?,
        true,
        quant.group_size,
        quant.bits,
    )?;
    let allowed = match mask {
        Mask::None => None,
        Mask::Causal => {
            let key_pos = Array::arange::<_, i32>(None, t, None)?.reshape(&[1, t])?;
            let query_pos = Array::arange::<_, i32>(t - l, t, None)?.reshape(&[l, 1])?;
            Some(key_pos.le(&query_pos)?)
        }
        // [B, 1, L, T] → [B, 1, 1, L, T]
        Mask::Array(m) => Some(m.expand_dims(2)?),
    };
    let scores = match allowed {
        Some(allowed) => {
            let hidden = Array::from_f32(-1e9).as_dtype(scores.dtype())?;
            mlx_rs::ops::select(&allowed, &scores, &hidden)?
        }
        None => scores,
    };
    let weights = mlx_rs::ops::softmax_axis(&scores, -1, true)?;
    let out = quantized_matmul(
        &weights,
        grouped(vw)?,
        grouped(vs)?,
        &grouped(vb)?,
        false,
        quant.group_size,
        quant.bits,
    )?;
    out.reshape(&[b, heads, l, d])
}

/// `[B, L, heads * head_dim]` → `[B, heads, L, head_dim]`.
pub fn split_heads(x: &Array, heads: i32) -> Result<Array> {
    let s = x.shape();
    x.reshape(&[s[0], s[1], heads, -1])?
        .transpose_axes(&[0, 2, 1, 3])
}
