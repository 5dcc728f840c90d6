//! Building blocks shared by every architecture: linear layers (dense or MLX-quantized),
//! embeddings, RMS norm and attention (rotary embeddings are [`crate::rotary`]). Each computes exactly what the
//! matching `mlx.nn` layer does, op for op, so greedy outputs match mlx-lm token for token.
use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{dequantize, quantized_matmul};
use mlx_rs::Array;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::quant::{self, Packed, QuantMode};
use crate::adapters::widened::Epilogue;
use crate::adapters::LoraSite;
use crate::cache::{LayerCache, Mask, Stored};
use crate::loader::{LoadError, Weights};
/// Rotary embeddings live beside the cache (which applies them at each row's offset), outside
/// `models`, so that `cache` does not depend on `models`.
pub use crate::rotary::Rope;

pub type Result<T> = std::result::Result<T, Exception>;

/// A weight matrix `[out, in]`, dense or quantized as MLX stores it. A clone holds the same
/// arrays (MLX arrays are shared handles).
#[derive(Debug, Clone)]
pub enum Matrix {
    Dense(Array),
    Quantized(QuantizedMatrix),
}

/// A matrix packed by MLX's quantization: the packed weight, its scales, its biases (the
/// affine mode only) and how it was packed.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

impl QuantizedMatrix {
    /// The borrowed view the quantized ops take.
    pub fn packed(&self) -> Packed<'_> {
        Packed {
            weight: &self.weight,
            scales: &self.scales,
            biases: self.biases.as_ref(),
            group_size: self.group_size,
            bits: self.bits,
            mode: self.mode,
        }
    }
}

impl Matrix {
    /// Loads `<prefix>.weight`, and `.scales`/`.biases` when the checkpoint quantized it.
    pub fn load(w: &mut Weights, prefix: &str) -> std::result::Result<Self, LoadError> {
        match w.quantization_for(prefix) {
            Some(q) => Ok(Matrix::Quantized(QuantizedMatrix {
                weight: w.take(&format!("{prefix}.weight"))?,
                scales: w.take(&format!("{prefix}.scales"))?,
                biases: w.take_optional(&format!("{prefix}.biases")),
                group_size: q.group_size,
                bits: q.bits,
                mode: q.mode,
            })),
            None => Ok(Matrix::Dense(w.take(&format!("{prefix}.weight"))?)),
        }
    }

    /// The packed parts of a quantized matrix (for ops such as `gather_qmm`); `None` when dense.
    pub fn quantized_parts(&self) -> Option<Packed<'_>> {
        match self {
            Matrix::Dense(_) => None,
            Matrix::Quantized(q) => Some(q.packed()),
        }
    }

    /// The stored weight: the matrix itself, or its packed form.
    pub fn weight(&self) -> &Array {
        match self {
            Matrix::Dense(w) => w,
            Matrix::Quantized(q) => &q.weight,
        }
    }

    /// `x @ W.T`.
    pub fn matmul_t(&self, x: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(w) => x.matmul(w.t()),
            Matrix::Quantized(q) => quant::quantized_matmul(x, q.packed(), true),
        }
    }

    /// Rows `ids` of the matrix (an embedding lookup), dequantized when needed.
    pub fn rows(&self, ids: &Array) -> Result<Array> {
        match self {
            Matrix::Dense(w) => w.take_axis(ids, 0),
            Matrix::Quantized(q) => {
                let biases = q.biases.as_ref().map(|b| b.take_axis(ids, 0)).transpose()?;
                let (weight, scales) = (q.weight.take_axis(ids, 0)?, q.scales.take_axis(ids, 0)?);
                quant::dequantize(Packed {
                    weight: &weight,
                    scales: &scales,
                    biases: biases.as_ref(),
                    ..q.packed()
                })
            }
        }
    }

    /// Bytes held by the parameters.
    pub fn nbytes(&self) -> usize {
        match self {
            Matrix::Dense(w) => w.nbytes(),
            Matrix::Quantized(q) => {
                q.weight.nbytes() + q.scales.nbytes() + q.biases.as_ref().map_or(0, Array::nbytes)
            }
        }
    }
}

/// A layer's matrix, which its adapter site may replace while the model serves: a widened
/// product (`crate::adapters::widened`) computes the base rows and the adapters' `x @ A` from
/// one matrix `[W; Aᵀ]`, and the layer's own then becomes a view of its first rows, so that
/// the base's weights are held once. A stacked product's layers hold views of its rows the same
/// way ([`super::stacked`]). The lock is uncontended (a model serves from one thread); whoever
/// holds it takes no other lock.
#[derive(Debug)]
pub struct MatrixCell(Mutex<Matrix>);

impl MatrixCell {
    pub fn new(matrix: Matrix) -> Self {
        Self(Mutex::new(matrix))
    }

    /// The matrix now (the same arrays, not a copy).
    pub fn get(&self) -> Matrix {
        self.lock().clone()
    }

    /// `f` of the matrix, without cloning it; `f` must not lock an adapter table.
    pub fn with<R>(&self, f: impl FnOnce(&Matrix) -> R) -> R {
        f(&self.lock())
    }

    /// Puts `matrix` in its place; the one it replaces is dropped here.
    pub fn replace(&self, matrix: Matrix) {
        *self.lock() = matrix;
    }

    pub fn into_inner(self) -> Matrix {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock(&self) -> MutexGuard<'_, Matrix> {
        // A panic while the lock was held left a whole matrix in place (each write is one
        // assignment), so a poisoned lock's value is sound.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `nn.Linear` (optionally `nn.QuantizedLinear`), with an optional bias, and its entry in
/// the model's adapter table (`crate::adapters`): the LoRA update of the rows whose adapter
/// changes this layer is added to its output.
#[derive(Debug)]
pub struct Linear {
    pub matrix: MatrixCell,
    pub bias: Option<Array>,
    pub lora: Option<LoraSite>,
}

impl Linear {
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> std::result::Result<Self, LoadError> {
        let matrix = Matrix::load(w, prefix)?;
        let bias = if bias {
            Some(w.take(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        let lora = crate::adapters::site_for(prefix, &matrix);
        Ok(Self::new(matrix, bias, lora))
    }

    pub fn new(matrix: Matrix, bias: Option<Array>, lora: Option<LoraSite>) -> Self {
        Self {
            matrix: MatrixCell::new(matrix),
            bias,
            lora,
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let Some(out) = self.widened(x, Epilogue::None)? {
            return Ok(out);
        }
        let y = self.matrix.with(|m| m.matmul_t(x))?;
        self.finish(x, y)
    }

    /// `residual + self.forward(x)`: a block's output projection and its residual add, which a
    /// widened adapter pass does in the site's one kernel ([`Epilogue::Residual`]).
    pub fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array> {
        match self.widened(x, Epilogue::Residual(residual))? {
            Some(out) => Ok(out),
            None => residual.add(self.forward(x)?),
        }
    }

    /// The layer's output for `x` through its adapter site's widened product, then
    /// `epilogue`, when this pass takes one (bias-free layers only).
    fn widened(&self, x: &Array, epilogue: Epilogue<'_>) -> Result<Option<Array>> {
        match (&self.lora, &self.bias) {
            (Some(site), None) => Ok(site
                .widened(x, &self.matrix, epilogue)?
                .map(|pass| pass.output)),
            _ => Ok(None),
        }
    }

    /// The layer's output from its product `y` (`x @ W.T`, computed here or as part of a
    /// [`Stacked`](super::stacked::Stacked) product): the bias and the adapter update added.
    pub fn finish(&self, x: &Array, y: Array) -> Result<Array> {
        match &self.lora {
            // The site adds the bias: a DoRA update rescales the output before it.
            Some(site) if site.engaged() => {
                site.apply(x, y, &self.matrix.get(), self.bias.as_ref())
            }
            _ => match &self.bias {
                Some(b) => y.add(b),
                None => Ok(y),
            },
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

/// `gate * sigmoid(gate) * up` as one compiled kernel, as mlx-lm compiles its `swiglu` (kept,
/// see [`silu`]): the SiLU and the product were two launches per layer per step.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array> {
    super::kept::call_one(swiglu_ops, true, &[gate.clone(), up.clone()])
}

fn swiglu_ops(args: &[Array]) -> Result<Vec<Array>> {
    let (gate, up) = (&args[0], &args[1]);
    Ok(vec![gate
        .multiply(mlx_rs::ops::sigmoid(gate)?)?
        .multiply(up)?])
}

/// `nn.silu`: `x * sigmoid(x)` as one compiled kernel, as mlx-lm compiles it (kept: mlx-rs's
/// own `nn::silu` compiles anew, and so traces again, on every call).
pub fn silu(x: &Array) -> Result<Array> {
    super::kept::call_one(silu_ops, true, std::slice::from_ref(x))
}

fn silu_ops(args: &[Array]) -> Result<Vec<Array>> {
    let x = &args[0];
    Ok(vec![x.multiply(mlx_rs::ops::sigmoid(x)?)?])
}

/// What distinguishes one attention layer's core beyond its projections.
#[derive(Debug, Clone, Copy)]
pub struct AttnOpts<'a> {
    /// The rotary embedding; `None` for layers without positional embedding (NoPE).
    pub rope: Option<&'a Rope>,
    pub scale: f32,
    /// Sliding window: a query sees at most this many keys, itself included.
    pub window: Option<usize>,
    /// Attention sinks: one learned logit per query head `[heads]` that takes a share of the
    /// softmax without contributing a value (gpt-oss).
    pub sinks: Option<&'a Array>,
    /// Attention-logit soft-capping, `tanh(s / c) * c` before the mask (Gemma 2).
    pub softcap: Option<f32>,
}

impl<'a> AttnOpts<'a> {
    /// Plain rotary attention: no window, sinks or capping.
    pub fn rotary(rope: &'a Rope, scale: f32) -> Self {
        Self {
            rope: Some(rope),
            scale,
            window: None,
            sinks: None,
            softcap: None,
        }
    }
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
    attend_with(queries, keys, values, &AttnOpts::rotary(rope, scale), cache)
}

/// [`attend`] with the variations of [`AttnOpts`]: no RoPE, a sliding window (a mask over
/// the positional cache), sinks (the fused kernel's), soft-capping (unfused, as mlx-lm's
/// Gemma 2 computes it).
pub fn attend_with(
    queries: &Array,
    keys: &Array,
    values: &Array,
    opts: &AttnOpts<'_>,
    cache: &mut LayerCache,
) -> Result<Array> {
    attend_queries(queries, keys, values, opts, cache, Queries::All)
}

/// Which queries of a pass attend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Queries {
    /// Every position's: the output is `[B, L, heads * head_dim]`.
    All,
    /// The last position's alone, `[B, 1, heads * head_dim]`; every position's keys and
    /// values still enter the cache. A prefill pass that samples its prompts' first tokens
    /// reads nothing else of its last layer.
    Last,
}

impl Queries {
    /// The positions this names of `out` `[B, L, ...]`: an attention that computes every
    /// position's output hands on only the last for [`Queries::Last`].
    pub fn pick(self, out: Array) -> Array {
        match self {
            Queries::All => out,
            Queries::Last => super::last_position(&out),
        }
    }
}

/// [`attend_with`] for the `queries` [`Queries`] names.
pub(crate) fn attend_queries(
    queries: &Array,
    keys: &Array,
    values: &Array,
    opts: &AttnOpts<'_>,
    cache: &mut LayerCache,
    which: Queries,
) -> Result<Array> {
    let (queries, keys) = match opts.rope {
        Some(rope) => (cache.rope(rope, queries)?, cache.rope(rope, keys)?),
        None => (queries.clone(), keys.clone()),
    };
    let (keys, values) = cache.update_and_fetch(&keys, values)?;
    let l = queries.shape()[2];
    let (keys, values, mask) = match opts.window {
        // A decode step whose window is all valid keys attends to exactly those, with no mask
        // (as mlx-lm's full rotating cache does): a masked pass over the whole buffer costs a
        // mask array and up to twice the keys.
        Some(w) if l == 1 && cache.whole_window(w) => {
            let t = keys.positions();
            let last = |s: &Stored| s.map(|a| Ok(a.index((Ellipsis, t - w as i32.., ..))));
            (last(&keys)?, last(&values)?, Mask::None)
        }
        _ => {
            let mask = cache.mask(l, opts.window)?;
            (keys, values, mask)
        }
    };
    let (queries, mask) = if which == Queries::Last && l > 1 {
        (queries.index((.., .., l - 1.., ..)), mask.last_query(l))
    } else {
        (queries, mask)
    };
    let l = queries.shape()[2];
    let scale = opts.scale;
    let short = l <= SHORT_PASS_MAX_QUERIES;
    let plain = opts.sinks.is_none() && opts.softcap.is_none();
    let masked = matches!(mask, Mask::Array(_));
    let out = if plain && super::decode_attention::serves(&queries, &keys, &values, masked) {
        super::decode_attention::decode(&queries, &keys, &values, scale, &mask)?
    } else if plain && keys.is_quantized() && short && !cuda_backend() {
        quantized_attention(&queries, &keys, &values, scale, &mask)?
    } else {
        let (k, v) = (
            dequantized(&keys, queries.dtype())?,
            dequantized(&values, queries.dtype())?,
        );
        if let Some(cap) = opts.softcap {
            softcapped_attention(&queries, &k, &v, scale, cap, &mask)?
        } else if plain && cuda_backend() && attends_unfused(&queries, &k, unfused_max_scores()) {
            grouped_attention(&queries, &k, &v, scale, &mask)?
        } else {
            fast::scaled_dot_product_attention(&queries, &k, &v, scale, mask.as_sdpa(), opts.sinks)?
        }
    };
    let shape = out.shape().to_vec();
    out.transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[shape[0], shape[2], -1])
}

/// Unfused attention with soft-capped logits, op for op as mlx-lm's Gemma 2: scaled queries
/// grouped over their KV head, `tanh(s / cap) * cap`, the mask, a float32-accurate softmax.
/// `queries` `[B, heads, L, D]`, `keys`/`values` `[B, kv_heads, T, D]` → `[B, heads, L, D]`.
fn softcapped_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    cap: f32,
    mask: &Mask,
) -> Result<Array> {
    let q = queries.shape().to_vec();
    let (b, heads, l, d) = (q[0], q[1], q[2], q[3]);
    let kv_heads = keys.shape()[1];
    let repeats = heads / kv_heads;
    let dtype = queries.dtype();
    let q = queries
        .multiply(Array::from_f32(scale).as_dtype(dtype)?)?
        .reshape(&[b, kv_heads, repeats, l, d])?;
    let scores = q.matmul(&keys.expand_dims(2)?.swap_axes(-1, -2)?)?;
    let cap_arr = Array::from_f32(cap).as_dtype(dtype)?;
    let scores = mlx_rs::ops::tanh(&scores.divide(&cap_arr)?)?.multiply(&cap_arr)?;
    let scores = hide_masked(scores, mask)?;
    let weights = mlx_rs::ops::softmax_axis(&scores, -1, true)?;
    weights
        .matmul(&values.expand_dims(2)?)?
        .reshape(&[b, heads, l, d])
}

/// `nn.LayerNorm`, with an optional scale and bias.
#[derive(Debug)]
pub struct LayerNorm {
    pub weight: Option<Array>,
    pub bias: Option<Array>,
    pub eps: f32,
}

impl LayerNorm {
    /// Loads `<prefix>.weight` and, with `bias`, `<prefix>.bias`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        eps: f32,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: Some(w.take(&format!("{prefix}.weight"))?),
            bias: bias
                .then(|| w.take(&format!("{prefix}.bias")))
                .transpose()?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        fast::layer_norm(x, self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }

    /// The parameters, for materialization.
    pub fn parameters(&self) -> Vec<&Array> {
        self.weight.iter().chain(self.bias.iter()).collect()
    }
}

/// A scalar in `x`'s dtype: Python's float scalars are weakly typed in MLX, so mlx-lm's
/// `0.5 * x` stays in `x`'s dtype (a float32 array would promote bf16 activations).
fn weak(x: &Array, v: f32) -> Result<Array> {
    Array::from_f32(v).as_dtype(x.dtype())
}

/// `nn.gelu_approx`: the tanh approximation of GELU, op for op with every constant in `x`'s
/// dtype (mlx-rs's own version promotes a bfloat16 input through float32 constants, which
/// mlx-lm never does), compiled into one kernel as mlx-lm's (shapeless `mx.compile`).
pub fn gelu_approx(x: &Array) -> Result<Array> {
    super::kept::call_one(gelu_approx_ops, true, std::slice::from_ref(x))
}

fn gelu_approx_ops(args: &[Array]) -> Result<Vec<Array>> {
    let x = &args[0];
    let cubic = weak(x, 0.044715)?.multiply(x.power(&weak(x, 3.0)?)?)?;
    let root = (2.0 / std::f64::consts::PI).sqrt() as f32;
    let inner = weak(x, root)?.multiply(x.add(&cubic)?)?;
    let gate = weak(x, 1.0)?.add(&mlx_rs::ops::tanh(&inner)?)?;
    Ok(vec![weak(x, 0.5)?.multiply(x)?.multiply(&gate)?])
}

/// `nn.gelu`: the exact GELU, `x * (1 + erf(x / sqrt(2))) / 2` in `x`'s dtype, compiled into
/// one kernel as mlx-lm's.
pub fn gelu(x: &Array) -> Result<Array> {
    super::kept::call_one(gelu_ops, true, std::slice::from_ref(x))
}

fn gelu_ops(args: &[Array]) -> Result<Vec<Array>> {
    let x = &args[0];
    let erf = mlx_rs::ops::erf(x.divide(&weak(x, std::f32::consts::SQRT_2)?)?)?;
    Ok(vec![x
        .multiply(&weak(x, 1.0)?.add(&erf)?)?
        .divide(&weak(x, 2.0)?)?])
}

/// The most queries of a short pass: a decode step, or a speculative verification of up to
/// [`MAX_NUM_DRAFT`](crate::runtime::draft::MAX_NUM_DRAFT) drafts. Short passes over a
/// quantized cache attend through quantized matmuls (not on CUDA, below); longer ones (prefill
/// chunks) dequantize the cache once per chunk for the fused attention, which costs less than
/// unfused attention would and which MLX's CUDA backend needs (its `quantized_matmul` has no
/// kernel for a prefill chunk's shapes).
const SHORT_PASS_MAX_QUERIES: i32 = 17;

/// Whether MLX runs on its CUDA backend (Linux with the GPU as default device), which changes
/// two choices of [`attend`]:
///
/// - **Short multi-query passes attend unfused** ([`grouped_attention`]). MLX's CUDA fused
///   attention sends every pass of more than one query to cuDNN, which builds and caches an
///   execution plan per exact shape, and a verification pass's key length grows every step:
///   on the H200 (8B shape, batch 8, 2-wide passes) each new length cost 60–90 ms of plan
///   building against a 15 ms decode step, more than doubling the step.
/// - **A quantized cache is dequantized for the fused attention** instead of entering
///   quantized matmuls. MLX 0.32.4's CUDA `quantized_matmul` refuses the cache's views (a
///   prefix of a buffer with spare capacity is not contiguous: "No implementation for problem
///   shape"), and any 64-wide head at group size 64; copying each view contiguous first costs
///   what it saves (`scripts/bench/cuda_qmm_probe.py`).
fn cuda_backend() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        let gpu = mlx_rs::Device::try_default()
            .and_then(|d| d.get_type())
            .is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu));
        cfg!(target_os = "linux") && gpu
    })
}

/// Attention scores (rows × query heads × queries × keys) up to which a pass of several
/// queries attends unfused on CUDA; the default of [`set_unfused_max_scores`].
///
/// **Decision: small prefill passes attend unfused too, not only short ones.** MLX's CUDA
/// fused attention hands every pass of more than one query to cuDNN, which builds an execution
/// plan per exact shape of queries, keys and values (rows included) before the pass runs:
/// 45–65 ms on an H100 for each new `[rows, length]` (`scripts/bench/pass_shapes.py`,
/// BENCHMARKS.md), against ~20 ms for the whole 32 × 128 pass once built. A server meets new
/// shapes all the time: each burst of prompts, each group of resumed streams after a crash.
/// Below this size the unfused scores cost less than a plan's build (2^26 scores: 128 MiB in
/// bf16, well under a millisecond of matmuls on a large GPU); above it (one long prompt, a
/// prefill chunk over a long context) the fused kernel's memory and speed win and the plan's
/// build is paid once per long pass.
pub const DEFAULT_UNFUSED_MAX_SCORES: u64 = 1 << 26;

static UNFUSED_MAX_SCORES: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFAULT_UNFUSED_MAX_SCORES);

/// Sets the process's [`DEFAULT_UNFUSED_MAX_SCORES`], once at start before the model runs; 0
/// leaves only the short passes (decode-sized, speculative verification) unfused.
pub fn set_unfused_max_scores(scores: u64) {
    UNFUSED_MAX_SCORES.store(scores, std::sync::atomic::Ordering::Relaxed);
}

/// The environment variable that overrides [`DEFAULT_UNFUSED_MAX_SCORES`] (a number of scores;
/// 0 sends every pass of more than [`SHORT_PASS_MAX_QUERIES`] queries to the fused kernel), to
/// measure the two paths against each other on a GPU.
pub const UNFUSED_ATTENTION_ENV: &str = "MLXD_CUDA_UNFUSED_ATTENTION";

/// Applies [`UNFUSED_ATTENTION_ENV`] when set; a value that is not a number is an error naming
/// it (the engine refuses to start rather than guess).
pub fn unfused_attention_from_env() -> std::result::Result<(), String> {
    let Ok(value) = std::env::var(UNFUSED_ATTENTION_ENV) else {
        return Ok(());
    };
    let scores = value.trim().parse::<u64>().map_err(|_| {
        format!(
            "{UNFUSED_ATTENTION_ENV}={value:?}: expected a number of attention scores (0: only \
             short passes attend unfused on CUDA; default {DEFAULT_UNFUSED_MAX_SCORES})"
        )
    })?;
    set_unfused_max_scores(scores);
    Ok(())
}

fn unfused_max_scores() -> u64 {
    UNFUSED_MAX_SCORES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether a pass of `queries` `[B, heads, L, D]` over `keys` `[B, kv_heads, T, D]` attends
/// unfused on CUDA: several queries, and either a short pass (its key length changes every
/// step, so a plan per length would never be reused) or at most `max_scores` scores.
pub(crate) fn attends_unfused(queries: &Array, keys: &Array, max_scores: u64) -> bool {
    let q = queries.shape();
    let (rows, heads, l) = (q[0] as u64, q[1] as u64, q[2]);
    let t = keys.shape()[2] as u64;
    l > 1 && (l <= SHORT_PASS_MAX_QUERIES || rows * heads * l as u64 * t <= max_scores)
}

/// Keys or values in `dtype`, dequantized when stored quantized.
pub fn dequantized(s: &Stored, dtype: mlx_rs::Dtype) -> Result<Array> {
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

/// `scores` `[B, kv_heads, repeats, L, T]` with the positions `mask` hides set to a large
/// negative value, so that the softmax gives them no weight.
fn hide_masked(scores: Array, mask: &Mask) -> Result<Array> {
    let s = scores.shape().to_vec();
    let (l, t) = (s[3], s[4]);
    let allowed = match mask {
        Mask::None => return Ok(scores),
        Mask::Causal => {
            let key_pos = Array::arange::<_, i32>(None, t, None)?.reshape(&[1, t])?;
            let query_pos = Array::arange::<_, i32>(t - l, t, None)?.reshape(&[l, 1])?;
            key_pos.le(&query_pos)?
        }
        // [B, 1, L, T] → [B, 1, 1, L, T]
        Mask::Array(m) => m.expand_dims(2)?,
    };
    let hidden = Array::from_f32(-1e9).as_dtype(scores.dtype())?;
    mlx_rs::ops::select(&allowed, &scores, &hidden)
}

/// Unfused attention for a short pass, with the query heads of each KV head stacked into one
/// matrix: two batched matmuls over `[B, kv_heads]` and a float32-accurate softmax, the
/// shapes of which need no per-length plan. `queries` `[B, heads, L, D]`, `keys` and `values`
/// `[B, kv_heads, T, D]` → `[B, heads, L, D]`.
fn grouped_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &Mask,
) -> Result<Array> {
    let q = queries.shape().to_vec();
    let (b, heads, l, d) = (q[0], q[1], q[2], q[3]);
    let kv_heads = keys.shape()[1];
    let t = keys.shape()[2];
    let repeats = heads / kv_heads;
    let q = queries
        .multiply(Array::from_f32(scale).as_dtype(queries.dtype())?)?
        .reshape(&[b, kv_heads, repeats * l, d])?;
    let scores = q
        .matmul(&keys.swap_axes(-1, -2)?)?
        .reshape(&[b, kv_heads, repeats, l, t])?;
    let weights = mlx_rs::ops::softmax_axis(&hide_masked(scores, mask)?, -1, true)?.reshape(&[
        b,
        kv_heads,
        repeats * l,
        t,
    ])?;
    weights.matmul(values)?.reshape(&[b, heads, l, d])
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
    let (Some([kw, ks, kb]), Some([vw, vs, vb]), Some(quant)) =
        (keys.packed(), values.packed(), keys.quant())
    else {
        return Err(Exception::custom(
            "keys and values of one cache are stored differently",
        ));
    };
    let q = queries.shape().to_vec();
    let (b, heads, l, d) = (q[0], q[1], q[2], q[3]);
    let kv_heads = kw.shape()[1];
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
    let weights = mlx_rs::ops::softmax_axis(&hide_masked(scores, mask)?, -1, true)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::KvQuant;
    use crate::models::test_arrays::{max_abs_diff, normal};

    /// 8 query heads over 2 KV heads, 3 queries over 40 positions; two rows, the second with
    /// 5 positions of left padding.
    fn case() -> (Array, Array, Array, Vec<Mask>) {
        let (q, k, v) = (
            normal(&[2, 8, 3, 64], 1),
            normal(&[2, 2, 40, 64], 2),
            normal(&[2, 2, 40, 64], 3),
        );
        let keys = Array::arange::<_, i32>(None, 40, None)
            .unwrap()
            .reshape(&[1, 1, 1, 40])
            .unwrap();
        let query_pos = Array::arange::<_, i32>(37, 40, None)
            .unwrap()
            .reshape(&[1, 1, 3, 1])
            .unwrap();
        let padding = Array::from_slice(&[0, 5], &[2, 1, 1, 1]);
        let padded = keys
            .ge(&padding)
            .unwrap()
            .logical_and(keys.le(&query_pos).unwrap())
            .unwrap();
        (q, k, v, vec![Mask::Causal, Mask::Array(padded)])
    }

    #[test]
    fn swiglu_is_one_kernel_and_computes_silu_gate_times_up() {
        let gate = normal(&[2, 3, 8], 31);
        let up = normal(&[2, 3, 8], 32);
        mlx_rs::transforms::eval([&gate, &up]).unwrap();
        let y = swiglu(&gate, &up).unwrap();
        let counts = crate::graph_ops::op_counts(&y);
        assert_eq!(counts.computing(), 1, "{counts:?}");
        let plain = gate
            .multiply(mlx_rs::ops::sigmoid(&gate).unwrap())
            .unwrap()
            .multiply(&up)
            .unwrap();
        assert!(max_abs_diff(&y, &plain) < 1e-6);
    }

    #[test]
    fn passes_attend_unfused_when_short_or_small() {
        let pass = |rows, l, t| {
            (
                Array::zeros::<f32>(&[rows, 32, l, 64]).unwrap(),
                Array::zeros::<f32>(&[rows, 8, t, 64]).unwrap(),
            )
        };
        let (q, k) = pass(32, 1, 300);
        assert!(
            !attends_unfused(&q, &k, 1 << 26),
            "a decode step has its own kernel"
        );
        let (q, k) = pass(1, 17, 30_000);
        assert!(
            attends_unfused(&q, &k, 0),
            "a verification pass, however long its keys"
        );
        // A burst of 32 prompts of 128 tokens: 2^24 scores.
        let (q, k) = pass(32, 128, 128);
        assert!(attends_unfused(&q, &k, 1 << 26));
        assert!(
            !attends_unfused(&q, &k, 0),
            "0 leaves only the short passes unfused"
        );
        // One 2 048-token prompt: 2^27 scores, past the default.
        let (q, k) = pass(1, 2048, 2048);
        assert!(!attends_unfused(&q, &k, DEFAULT_UNFUSED_MAX_SCORES));
    }

    #[test]
    fn grouped_attention_matches_the_fused_kernel() {
        let (q, k, v, masks) = case();
        for mask in &masks {
            let fused = fast::scaled_dot_product_attention(&q, &k, &v, 0.125, mask.as_sdpa(), None)
                .unwrap();
            let unfused = grouped_attention(&q, &k, &v, 0.125, mask).unwrap();
            assert_eq!(unfused.shape(), fused.shape());
            let diff = max_abs_diff(&unfused, &fused);
            assert!(diff < 1e-4, "max difference {diff}");
        }
    }

    #[test]
    fn quantized_attention_matches_fused_attention_over_the_dequantized_cache() {
        let (q, k, v, masks) = case();
        let quant = KvQuant {
            bits: 8,
            group_size: 64,
        };
        let (kq, vq) = (
            Stored::new(&k, Some(quant)).unwrap(),
            Stored::new(&v, Some(quant)).unwrap(),
        );
        let (kd, vd) = (
            dequantized(&kq, q.dtype()).unwrap(),
            dequantized(&vq, q.dtype()).unwrap(),
        );
        for mask in &masks {
            let fused =
                fast::scaled_dot_product_attention(&q, &kd, &vd, 0.125, mask.as_sdpa(), None)
                    .unwrap();
            let packed = quantized_attention(&q, &kq, &vq, 0.125, mask).unwrap();
            let diff = max_abs_diff(&packed, &fused);
            assert!(diff < 1e-3, "max difference {diff}");
        }
    }
}
