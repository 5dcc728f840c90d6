//! Mamba-2: the selective state-space mixer (SSD) that Mamba-2, Nemotron-H and Falcon-H1
//! share, the pre-norm backbone those checkpoints name `backbone.*`, and the plain Mamba-2
//! model (`Mamba2ForCausalLM`), as mlx-lm 0.32.2's `ssm.py` and `mamba2.py` compute them.
//!
//! A mixer keeps two arrays per sequence ([`LayerKind::State`]): the last `conv_kernel - 1`
//! inputs of its depthwise convolution, and the SSM state `[heads, head_dim, state_size]` in
//! float32. A forward pass over `L` tokens runs the chunked matrix form of the recurrence
//! (chunks of 256 tokens, no loop over tokens), prefill and decode alike, as mlx-lm does on
//! every device but Apple's GPU.
use mlx_rs::error::Exception;
use mlx_rs::nn::softplus;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{
    concatenate, conv1d, expand_dims, maximum, minimum, repeat_axis, select, tril, unflatten,
    zeros_dtype,
};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::info::{model_info, KvShape};
use super::layers::{silu, Linear, Matrix, RmsNorm};
use super::params::{Parameters, Params};
use super::CausalLm;
use super::ModelInfo;
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

/// Tokens per chunk of the matrix form (mlx-lm's `ssm_attn` step).
const CHUNK: i32 = 256;

/// How a family's Mamba-2 mixers are shaped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MixerShape {
    pub heads: i32,
    pub head_dim: i32,
    pub groups: i32,
    pub state_size: i32,
    pub conv_kernel: i32,
    /// `(min, max)` of the time step after softplus.
    pub time_step_limit: (f32, f32),
    pub norm_eps: f32,
    /// How the SSM output is gated and normalised.
    pub norm: MixerNorm,
    /// Casts `D` to the activations' dtype before the skip connection (Nemotron-H).
    pub cast_d: bool,
    pub in_proj_bias: bool,
    pub out_proj_bias: bool,
    pub conv_bias: bool,
}

/// How a mixer gates its SSM output `y` by `silu(gate)` and normalises it (RMS norm with the
/// mixer's `norm.weight`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MixerNorm {
    /// Gate, then normalise each group of `group_size` features (the whole output when it is
    /// `heads * head_dim`: Mamba-2; each of `n_groups` groups: Nemotron-H).
    GateThenNorm { group_size: i32 },
    /// Normalise the whole output, then gate (Falcon-H1's `mamba_norm_before_gate`).
    NormThenGate,
    /// Gate only, no norm (Falcon-H1 without `mamba_rms_norm`).
    GateOnly,
}

impl MixerShape {
    fn inner(&self) -> i32 {
        self.heads * self.head_dim
    }

    fn conv_dim(&self) -> i32 {
        self.inner() + 2 * self.groups * self.state_size
    }

    /// Bytes of one sequence's state: the convolution's window in the activations' dtype,
    /// the SSM state in float32.
    pub fn state_bytes(&self, dtype_bytes: usize) -> usize {
        let conv = ((self.conv_kernel - 1) * self.conv_dim()) as usize * dtype_bytes;
        let ssm = (self.heads * self.head_dim * self.state_size) as usize * 4;
        conv + ssm
    }

    fn check(&self, family: &str) -> Result<(), LoadError> {
        if self.groups <= 0 || self.heads % self.groups != 0 {
            return Err(LoadError::Config(format!(
                "{family}: {} SSM heads do not divide into {} groups",
                self.heads, self.groups
            )));
        }
        if self.conv_kernel < 2 {
            return Err(LoadError::Config(format!(
                "{family}: conv_kernel {} leaves no convolution state (at least 2)",
                self.conv_kernel
            )));
        }
        if let MixerNorm::GateThenNorm { group_size } = self.norm {
            if group_size <= 0 || self.inner() % group_size != 0 {
                return Err(LoadError::Config(format!(
                    "{family}: the gated norm's groups of {group_size} do not divide {} features",
                    self.inner()
                )));
            }
        }
        Ok(())
    }
}

/// The Mamba-2 mixer: `in_proj` gives the gate, the convolution's input (SSM input, `B`,
/// `C`) and the time step; the SSM output is gated by `silu(gate)`, normalised and projected.
pub(crate) struct Mamba2Mixer {
    in_proj: Linear,
    /// `[conv_dim, kernel, 1]`, MLX's layout of a depthwise kernel.
    conv_weight: Array,
    conv_bias: Option<Array>,
    dt_bias: Array,
    a_log: Array,
    d: Array,
    /// `None` for [`MixerNorm::GateOnly`].
    norm_weight: Option<Array>,
    out_proj: Linear,
    shape: MixerShape,
}

impl Mamba2Mixer {
    /// Loads the mixer under `prefix` (`...mixer`).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: MixerShape,
        family: &str,
    ) -> Result<Self, LoadError> {
        shape.check(family)?;
        let name = format!("{prefix}.conv1d.weight");
        let mut conv_weight = w.take(&name)?;
        // Hugging Face stores `[conv_dim, 1, kernel]` (mlx-lm's `sanitize` moves the axis).
        if conv_weight.ndim() == 3 && conv_weight.shape()[2] != 1 {
            conv_weight = conv_weight.move_axis(2, 1)?;
        }
        crate::loader::expect_shape(
            &name,
            &conv_weight,
            &[shape.conv_dim(), shape.conv_kernel, 1],
        )?;
        let conv_bias = if shape.conv_bias {
            Some(w.take(&format!("{prefix}.conv1d.bias"))?)
        } else {
            None
        };
        Ok(Self {
            in_proj: Linear::load(w, &format!("{prefix}.in_proj"), shape.in_proj_bias)?,
            conv_weight,
            conv_bias,
            dt_bias: w.take(&format!("{prefix}.dt_bias"))?,
            a_log: w.take(&format!("{prefix}.A_log"))?,
            d: w.take(&format!("{prefix}.D"))?,
            norm_weight: match shape.norm {
                MixerNorm::GateOnly => None,
                _ => Some(w.take(&format!("{prefix}.norm.weight"))?),
            },
            out_proj: Linear::load(w, &format!("{prefix}.out_proj"), shape.out_proj_bias)?,
            shape,
        })
    }

    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let s = &self.shape;
        let state = cache.as_state_mut()?;
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let (inner, conv_dim) = (s.inner(), s.conv_dim());
        let projected = self.in_proj.forward(x)?;
        let gate = projected.index((.., .., ..inner));
        let mut conv_input = projected.index((.., .., inner..inner + conv_dim));
        let dt = projected.index((.., .., inner + conv_dim..));
        let mask = state.mask(l)?;
        if let Some(mask) = &mask {
            let zero = Array::from_f32(0.0).as_dtype(conv_input.dtype())?;
            conv_input = select(&expand_dims(mask, -1)?, &conv_input, &zero)?;
        }
        let keep = s.conv_kernel - 1;
        let past = match state.slot(0) {
            Some(p) => p.clone(),
            None => zeros_dtype(&[b, keep, conv_dim], conv_input.dtype())?,
        };
        let padded = concatenate(&[past, conv_input], 1)?;
        let total = padded.shape()[1];
        let conv_state = padded.index((.., total - keep.., ..));
        let mut conv = conv1d(&padded, &self.conv_weight, 1, 0, 1, conv_dim)?;
        if let Some(bias) = &self.conv_bias {
            conv = conv.add(bias)?;
        }
        let conv = silu(&conv)?;
        let grouped = s.groups * s.state_size;
        let hs = conv
            .index((.., .., ..inner))
            .reshape(&[b, l, s.heads, s.head_dim])?;
        let bm = conv.index((.., .., inner..inner + grouped)).reshape(&[
            b,
            l,
            s.groups,
            s.state_size,
        ])?;
        let cm =
            conv.index((.., .., inner + grouped..))
                .reshape(&[b, l, s.groups, s.state_size])?;
        let d = if s.cast_d {
            self.d.as_dtype(hs.dtype())?
        } else {
            self.d.clone()
        };
        let ssm = Ssm {
            a_log: &self.a_log,
            d: &d,
            dt_bias: &self.dt_bias,
            time_step_limit: s.time_step_limit,
        };
        let (y, ssm_state) = ssm.run(&hs, &bm, &cm, &dt, state.slot(1), mask.as_ref())?;
        state.update(vec![conv_state, ssm_state], l as usize)?;
        let y = y.reshape(&[b, l, inner])?;
        self.out_proj.forward(&self.gated_norm(&y, &gate)?)
    }

    /// `y` gated by `silu(gate)` and normalised as the shape's [`MixerNorm`] says.
    fn gated_norm(&self, y: &Array, gate: &Array) -> Result<Array, Exception> {
        let s = &self.shape;
        let weight = self.norm_weight.as_ref();
        match s.norm {
            MixerNorm::GateOnly => silu(gate)?.multiply(y),
            MixerNorm::NormThenGate => {
                silu(gate)?.multiply(mlx_rs::fast::rms_norm(y, weight, s.norm_eps)?)
            }
            MixerNorm::GateThenNorm { group_size } => {
                let y = silu(gate)?.multiply(y)?;
                if group_size == s.inner() {
                    return mlx_rs::fast::rms_norm(&y, weight, s.norm_eps);
                }
                let grouped = unflatten(&y, -1, &[-1, group_size])?;
                let normed =
                    mlx_rs::fast::rms_norm(&grouped, None, s.norm_eps)?.flatten(-2, None)?;
                match weight {
                    Some(w) => w.multiply(normed),
                    None => Ok(normed),
                }
            }
        }
    }
}

impl Parameters for Mamba2Mixer {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.in_proj)
            .add(&self.conv_weight)
            .add(&self.conv_bias)
            .add(&self.dt_bias)
            .add(&self.a_log)
            .add(&self.d)
            .add(&self.norm_weight)
            .add(&self.out_proj);
    }
}

/// The SSM's parameters for one pass.
struct Ssm<'a> {
    a_log: &'a Array,
    d: &'a Array,
    dt_bias: &'a Array,
    time_step_limit: (f32, f32),
}

impl Ssm<'_> {
    /// The SSD forward pass over `x` `[B, L, heads, head_dim]` with input and output mixing
    /// `b`, `c` `[B, L, groups, state]` and time steps `dt` `[B, L, heads]`, from `state`
    /// (none: zeros); positions where `mask` `[B, L]` is false neither decay nor feed the
    /// state. Returns the output in `x`'s dtype and the new float32 state.
    fn run(
        &self,
        x: &Array,
        b: &Array,
        c: &Array,
        dt: &Array,
        state: Option<&Array>,
        mask: Option<&Array>,
    ) -> Result<(Array, Array), Exception> {
        let (batch, l, heads) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let dt = self.time_steps(dt)?;
        let a = self.a_log.exp()?.negative()?.as_dtype(dt.dtype())?;
        let mut dt_a = dt.multiply(a.reshape(&[1, 1, heads])?)?;
        if let Some(mask) = mask {
            dt_a = dt_a.multiply(expand_dims(mask, -1)?)?;
        }
        let dtx = dt.reshape(&[batch, l, heads, 1])?.multiply(x)?;
        let mut state = state.cloned();
        let mut ys = Vec::new();
        let mut start = 0;
        while start < l {
            let end = (start + CHUNK).min(l);
            let (y, next) = self.chunk(
                x.dtype(),
                &dtx.index((.., start..end)),
                &dt_a.index((.., start..end)),
                &b.index((.., start..end)),
                &c.index((.., start..end)),
                state.as_ref(),
                mask.map(|m| m.index((.., start..end))).as_ref(),
            )?;
            ys.push(y);
            state = Some(next);
            start = end;
        }
        let y = concatenate(&ys, 1)?.add(x.multiply(self.d.reshape(&[1, 1, heads, 1])?)?)?;
        let state = state.ok_or_else(|| Exception::custom("an SSM pass over no tokens"))?;
        Ok((y, state))
    }

    /// `clip(softplus(dt + dt_bias), min, max)` in float32.
    fn time_steps(&self, dt: &Array) -> Result<Array, Exception> {
        let dt = softplus(dt.as_dtype(Dtype::Float32)?.add(self.dt_bias)?)?;
        let (lo, hi) = self.time_step_limit;
        minimum(maximum(&dt, Array::from_f32(lo))?, Array::from_f32(hi))
    }

    /// One chunk of the matrix form: the causal "attention" of the chunk's positions through
    /// the decays between them, plus the incoming state's contribution.
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        dtype: Dtype,
        dtx: &Array,
        dt_a: &Array,
        b: &Array,
        c: &Array,
        state: Option<&Array>,
        mask: Option<&Array>,
    ) -> Result<(Array, Array), Exception> {
        let (batch, s, heads, head_dim) = (
            dtx.shape()[0],
            dtx.shape()[1],
            dtx.shape()[2],
            dtx.shape()[3],
        );
        let (groups, n) = (b.shape()[2], b.shape()[3]);
        let repeats = heads / groups;
        let bt = b.transpose_axes(&[0, 2, 3, 1])?;
        let cb = c.swap_axes(1, 2)?.matmul(&bt)?;
        let cb = repeat_axis::<f32>(cb, repeats, 1)?;
        let decay = segsum(&dt_a.swap_axes(1, 2)?, mask)?.exp()?;
        let surrogate = tril(cb.multiply(&decay)?, 0)?;
        let mut y = surrogate.matmul(dtx.swap_axes(1, 2)?)?.swap_axes(1, 2)?;
        let last = decay
            .index((.., .., -1.., ..))
            .transpose_axes(&[0, 3, 1, 2])?;
        let bh = repeat_axis::<f32>(bt, repeats, 1)?.swap_axes(2, 3)?;
        let weighted = dtx.multiply(&last)?.swap_axes(1, 2)?.swap_axes(2, 3)?;
        let mut next = weighted.matmul(&bh)?;
        if let Some(state) = state {
            let decayed = dt_a.cumsum(-2, None, None)?.exp()?;
            let through = decayed.index((.., -1, ..)).reshape(&[batch, heads, 1, 1])?;
            next = next.add(through.multiply(state)?)?;
            let c6 = c.reshape(&[batch, s, groups, 1, n, 1])?;
            let y_prev = state
                .reshape(&[batch, 1, groups, repeats, head_dim, n])?
                .matmul(&c6)?
                .squeeze_axes(&[-1])?
                .flatten(2, 3)?;
            y = y.add(expand_dims(&decayed, -1)?.multiply(&y_prev)?)?;
        }
        Ok((y.as_dtype(dtype)?, next))
    }
}

/// `out[..., i, j] = sum(x[..., j + 1 ..= i])` for `j <= i` over the last axis of `x`
/// `[B, H, L]` (0 above the diagonal); with `mask` `[B, L]`, masked positions contribute
/// nothing and pairs involving one are `-inf` (no decay through padding).
fn segsum(x: &Array, mask: Option<&Array>) -> Result<Array, Exception> {
    let l = x.shape()[x.ndim() - 1];
    let mask = mask.map(|m| expand_dims(m, 1)).transpose()?;
    let x = match &mask {
        Some(m) => x.multiply(m)?,
        None => x.clone(),
    };
    let x = repeat_axis::<f32>(expand_dims(&x, -1)?, l, -1)?;
    let x = tril(x, -1)?;
    let sums = x.cumsum(-2, None, None)?;
    match &mask {
        Some(m) => {
            let both = expand_dims(m, -2)?.multiply(expand_dims(m, -1)?)?;
            let neg_inf = Array::from_f32(f32::NEG_INFINITY);
            select(&both, &sums, &neg_inf)
        }
        None => Ok(sums),
    }
}

/// One block of a backbone: a pre-norm residual around a mixer or an MLP.
pub(crate) trait BackboneBlock: Parameters + Send {
    /// The cache the block keeps; `None` for a block without one (an MLP).
    fn kind(&self) -> Option<LayerKind>;
    /// The block's output `[B, L, D]`; `cache` is the block's own when it keeps one.
    fn forward(&self, h: &Array, cache: Option<&mut LayerCache>) -> Result<Array, Exception>;
}

/// A cache the model did not hand to a block that keeps one (a model bug).
pub(crate) fn missing_cache() -> Exception {
    Exception::custom("a block that keeps a cache was run without one")
}

/// `backbone.embeddings`, the blocks, `backbone.norm_f` and the head: the models whose
/// checkpoints name their trunk `backbone` (Mamba-2, Nemotron-H). Only blocks that keep a
/// cache get one, so the model's layers (its caches) are fewer than its blocks when some are
/// MLPs.
pub(crate) struct Backbone {
    embeddings: Matrix,
    blocks: Vec<Box<dyn BackboneBlock>>,
    norm_f: RmsNorm,
    lm_head: Option<Matrix>,
    info: ModelInfo,
}

impl Backbone {
    /// Loads the ends around `blocks`; the head is `lm_head` unless `tied`.
    pub fn load(
        w: &mut Weights,
        config: &Value,
        blocks: Vec<Box<dyn BackboneBlock>>,
        norm_eps: f32,
        tied: bool,
        sizes: BackboneSizes,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        let embeddings = Matrix::load(w, "backbone.embeddings")?;
        let norm_f = RmsNorm::load(w, "backbone.norm_f", norm_eps)?;
        let lm_head = if tied {
            None
        } else {
            Some(Matrix::load(w, "lm_head")?)
        };
        let layers = blocks.iter().filter(|b| b.kind().is_some()).count();
        let kv = KvShape {
            layers,
            elements_per_token: sizes.kv_elements_per_token,
            head_dim: sizes.head_dim,
        };
        let mut info = model_info(
            config,
            sizes.vocab_size,
            sizes.context_length,
            kv,
            &embeddings,
        );
        info.state_bytes_per_sequence = sizes
            .mixer
            .map_or(0, |m| m.state_bytes(info.kv_dtype_bytes))
            * sizes.mixers;
        let mut model = Self {
            embeddings,
            blocks,
            norm_f,
            lm_head,
            info,
        };
        let mut p = Params::default();
        p.add(&model.embeddings)
            .add(&model.blocks)
            .add(&model.norm_f)
            .add(&model.lm_head);
        model.info.weight_bytes = p.materialize(w.reporter())?;
        Ok(Box::new(model))
    }
}

/// The sizes a backbone model reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BackboneSizes {
    pub vocab_size: usize,
    pub context_length: usize,
    /// Keys and values of every attention block per token.
    pub kv_elements_per_token: usize,
    pub head_dim: i32,
    /// The mixers' shape and how many there are (for the state bytes per sequence).
    pub mixer: Option<MixerShape>,
    pub mixers: usize,
}

impl CausalLm for Backbone {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embeddings.rows(tokens)?;
        let mut caches = caches.iter_mut();
        for block in &self.blocks {
            let cache = match block.kind() {
                Some(_) => Some(caches.next().ok_or_else(missing_cache)?),
                None => None,
            };
            h = block.forward(&h, cache)?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        let h = self.norm_f.forward(hidden)?;
        self.lm_head
            .as_ref()
            .unwrap_or(&self.embeddings)
            .matmul_t(&h)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.blocks.iter().filter_map(|b| b.kind()).collect()
    }
}

/// A pre-norm residual block around a Mamba-2 mixer.
pub(crate) struct MixerBlock {
    pub norm: RmsNorm,
    pub mixer: Mamba2Mixer,
}

impl BackboneBlock for MixerBlock {
    fn kind(&self) -> Option<LayerKind> {
        Some(LayerKind::State { slots: 2 })
    }

    fn forward(&self, h: &Array, cache: Option<&mut LayerCache>) -> Result<Array, Exception> {
        let cache = cache.ok_or_else(missing_cache)?;
        h.add(self.mixer.forward(&self.norm.forward(h)?, cache)?)
    }
}

impl Parameters for MixerBlock {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.norm).add(&self.mixer);
    }
}

/// The fields of config.json that mlx-lm's `mamba2.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    num_heads: i32,
    head_dim: i32,
    vocab_size: usize,
    state_size: i32,
    ssm_state_size: Option<i32>,
    num_hidden_layers: usize,
    layer_norm_epsilon: f32,
    conv_kernel: i32,
    n_groups: i32,
    use_bias: bool,
    use_conv_bias: bool,
    tie_word_embeddings: bool,
    time_step_limit: (f32, f32),
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
}

fn default_context() -> usize {
    2056
}

/// Plain Mamba-2: every block a mixer, no attention.
pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = super::config::parse_config("Mamba-2", config)?;
    let shape = MixerShape {
        heads: c.num_heads,
        head_dim: c.head_dim,
        groups: c.n_groups,
        state_size: c.ssm_state_size.unwrap_or(c.state_size),
        conv_kernel: c.conv_kernel,
        time_step_limit: c.time_step_limit,
        norm_eps: c.layer_norm_epsilon,
        norm: MixerNorm::GateThenNorm {
            group_size: c.num_heads * c.head_dim,
        },
        cast_d: false,
        in_proj_bias: c.use_bias,
        out_proj_bias: c.use_bias,
        conv_bias: c.use_conv_bias,
    };
    let mut blocks: Vec<Box<dyn BackboneBlock>> = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("backbone.layers.{i}");
        blocks.push(Box::new(MixerBlock {
            // mlx-lm builds the block norm with RMSNorm's default epsilon.
            norm: RmsNorm::load(w, &format!("{p}.norm"), 1e-5)?,
            mixer: Mamba2Mixer::load(w, &format!("{p}.mixer"), shape, "Mamba-2")?,
        }));
    }
    if c.tie_word_embeddings {
        for suffix in ["weight", "scales", "biases"] {
            if w.contains(&format!("lm_head.{suffix}")) {
                return Err(LoadError::Config(
                    "Mamba-2 ties its head to the embeddings but the checkpoint holds an lm_head"
                        .into(),
                ));
            }
        }
    }
    let sizes = BackboneSizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        kv_elements_per_token: 0,
        head_dim: c.head_dim,
        mixer: Some(shape),
        mixers: c.num_hidden_layers,
    };
    Backbone::load(
        w,
        config,
        blocks,
        c.layer_norm_epsilon,
        c.tie_word_embeddings,
        sizes,
    )
}
