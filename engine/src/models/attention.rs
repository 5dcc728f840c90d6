//! The attention layer of the Llama lineage and the pieces its variants share: the four
//! projections, RMS norms of queries and keys (per head or over the whole projection), and
//! [`Attention`], which runs them around [`attend_with`] with a layer's rotary embedding
//! (or none) and sliding window. Families whose attention differs further (fused
//! projections, latent attention, a temperature) implement [`SelfAttention`] themselves.
use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::layers::{attend_queries, split_heads, AttnOpts, Linear, Queries, RmsNorm};
use super::params::{Parameters, Params};
use super::rope::ScaledRope;
use super::stacked::{self, Stacked};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// A block's attention half: normalised hidden states `[B, L, D]` → its output `[B, L, D]`,
/// through the layer's cache.
pub(crate) trait SelfAttention: Parameters + Send {
    /// The output of the positions `which` names: `[B, L, D]` for all, `[B, 1, D]` for the
    /// last alone (a prefill pass's last layer when only the last position's logits are
    /// read). Every position's keys and values (or state) enter the cache either way.
    fn attend(&self, x: &Array, cache: &mut LayerCache, which: Queries)
        -> Result<Array, Exception>;
    /// `residual + self.attend(x, cache, which)`, `residual` holding the same positions: the
    /// block's residual add after attention, which an output projection able to take it into
    /// its own kernel does ([`Linear::forward_add`]).
    fn attend_add(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
        residual: &Array,
    ) -> Result<Array, Exception> {
        residual.add(self.attend(x, cache, which)?)
    }
    /// The sliding window this attention keeps to, `None` for a global layer.
    fn window(&self) -> Option<usize> {
        None
    }
}

/// Options for attention over queries and keys already rotated (or never rotated): the
/// softmax scale and the layer's window, no sinks or capping.
pub(crate) fn prerotated_opts(scale: f32, window: Option<usize>) -> AttnOpts<'static> {
    AttnOpts {
        rope: None,
        scale,
        window,
        sinks: None,
        softcap: None,
    }
}

/// Query, key, value and output projections (`<prefix>.{q,k,v,o}_proj`), the first three
/// computed as one product where their matrices stack ([`Stacked`]).
pub(crate) struct AttnProjections {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub heads: i32,
    pub kv_heads: i32,
    /// The query, key and value projections' stacked matrix; `None`: three products.
    qkv: Option<Box<Stacked>>,
}

impl AttnProjections {
    /// Loads the four projections under `prefix`; `qkv_bias` and `o_bias` say which carry a
    /// bias (Qwen-style checkpoints bias q/k/v only, most bias all four or none).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        heads: i32,
        kv_heads: i32,
        qkv_bias: bool,
        o_bias: bool,
    ) -> Result<Self, LoadError> {
        Self::new(
            [
                Linear::load(w, &format!("{prefix}.q_proj"), qkv_bias)?,
                Linear::load(w, &format!("{prefix}.k_proj"), qkv_bias)?,
                Linear::load(w, &format!("{prefix}.v_proj"), qkv_bias)?,
                Linear::load(w, &format!("{prefix}.o_proj"), o_bias)?,
            ],
            heads,
            kv_heads,
        )
    }

    /// The projections `[q, k, v, o]` of a layer with `heads` query and `kv_heads` key and
    /// value heads, the first three stacked where they can be.
    pub fn new(
        [mut q_proj, mut k_proj, mut v_proj, o_proj]: [Linear; 4],
        heads: i32,
        kv_heads: i32,
    ) -> Result<Self, LoadError> {
        let qkv = Stacked::of(&mut [&mut q_proj, &mut k_proj, &mut v_proj])?.map(Box::new);
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            heads,
            kv_heads,
            qkv,
        })
    }

    /// Queries, keys and values `[B, L, heads * head_dim]`, before heads are split.
    pub fn qkv(&self, x: &Array) -> Result<(Array, Array, Array), Exception> {
        let layers = [&self.q_proj, &self.k_proj, &self.v_proj];
        let [q, k, v] = stacked::project(self.qkv.as_deref(), x, layers)?;
        Ok((q, k, v))
    }

    /// Queries and keys side by side `[B, L, (heads + kv_heads) · head_dim]`, and values
    /// `[B, L, kv_heads · head_dim]`, from the stacked product with the queries and keys left
    /// joined, so that one RoPE call rotates both; `None` when the projections are not stacked,
    /// query and key heads differ in width, or this pass needs each projection's own output
    /// ([`Stacked::forward_joined`]).
    pub fn qk_v(&self, x: &Array) -> Result<Option<(Array, Array)>, Exception> {
        let Some(stacked) = &self.qkv else {
            return Ok(None);
        };
        let &[q_end, k_end] = stacked.ends() else {
            return Ok(None);
        };
        if q_end * self.kv_heads != (k_end - q_end) * self.heads {
            return Ok(None);
        }
        let layers = [&self.q_proj, &self.k_proj, &self.v_proj];
        let Some(parts) = stacked.forward_joined(x, &layers, &[k_end])? else {
            return Ok(None);
        };
        let [qk, v]: [Array; 2] = parts
            .try_into()
            .map_err(|_| Exception::custom("a q+k/v split gave other than 2 parts"))?;
        Ok(Some((qk, v)))
    }

    /// Queries, keys and values of `x` `[B, L, hidden]`, each `[B, heads, L, head_dim]`.
    pub fn project(&self, x: &Array) -> Result<(Array, Array, Array), Exception> {
        let (q, k, v) = self.qkv(x)?;
        self.split(&q, &k, &v)
    }

    /// `[B, L, heads * head_dim]` queries, keys and values split into their heads.
    pub fn split(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
    ) -> Result<(Array, Array, Array), Exception> {
        Ok((
            split_heads(q, self.heads)?,
            split_heads(k, self.kv_heads)?,
            split_heads(v, self.kv_heads)?,
        ))
    }
}

impl Parameters for AttnProjections {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.q_proj)
            .add(&self.k_proj)
            .add(&self.v_proj)
            .add(&self.o_proj);
    }
}

/// Where a family RMS-normalises queries and keys, if it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QkNorm {
    None,
    /// Each head on its own (`[head_dim]` weights: Qwen3, Qwen3-MoE, GLM-4.5, EXAONE 4).
    PerHead,
    /// The whole projection before the split into heads (`[heads * head_dim]`: OLMo 2,
    /// OLMoE).
    Whole,
}

/// How a family's attention layers are shaped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub heads: i32,
    pub kv_heads: i32,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    /// The epsilon of the query and key norms.
    pub eps: f32,
    /// The softmax scale (usually `head_dim^-0.5`).
    pub scale: f32,
}

impl AttentionShape {
    /// `heads` query heads over `kv_heads` KV heads of `head_dim`: no biases, no query/key
    /// norms, the softmax scale `head_dim^-0.5` (RMS norms of `eps` if a family adds them).
    pub fn new(heads: i32, kv_heads: i32, head_dim: i32, eps: f32) -> Self {
        Self {
            heads,
            kv_heads,
            qkv_bias: false,
            o_bias: false,
            qk_norm: QkNorm::None,
            eps,
            scale: (head_dim as f32).powf(-0.5),
        }
    }
}

/// How far one layer attends, and whether it rotates its queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Within the last `window` positions (itself included), with RoPE.
    Local(usize),
    /// Everything, with RoPE.
    GlobalRope,
    /// Everything, without positional embedding (NoPE).
    GlobalNoPe,
}

impl Reach {
    pub fn rotary(self) -> bool {
        self != Reach::GlobalNoPe
    }

    /// The sliding window, `None` for a global layer.
    pub fn window(self) -> Option<usize> {
        match self {
            Reach::Local(window) => Some(window),
            Reach::GlobalRope | Reach::GlobalNoPe => None,
        }
    }
}

/// Projections, optional query/key norms, then rotary attention over the cache.
pub(crate) struct Attention {
    proj: AttnProjections,
    /// `(q_norm, k_norm)` where [`QkNorm`] asks for them.
    norms: Option<(RmsNorm, RmsNorm)>,
    qk_norm: QkNorm,
    /// `None` for a layer without positional embedding (NoPE).
    rope: Option<ScaledRope>,
    scale: f32,
    /// The most keys a query sees (itself included), for a sliding-window layer.
    window: Option<usize>,
}

impl Attention {
    /// Loads `<prefix>.{q,k,v,o}_proj` and, when the shape asks, `<prefix>.{q,k}_norm`; the
    /// layer attends as `reach` says, rotating with `rope` unless it is a NoPE layer.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: &AttentionShape,
        rope: &ScaledRope,
        reach: Reach,
    ) -> Result<Self, LoadError> {
        let norms = match shape.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead | QkNorm::Whole => Some((
                RmsNorm::load(w, &format!("{prefix}.q_norm"), shape.eps)?,
                RmsNorm::load(w, &format!("{prefix}.k_norm"), shape.eps)?,
            )),
        };
        Ok(Self {
            proj: AttnProjections::load(
                w,
                prefix,
                shape.heads,
                shape.kv_heads,
                shape.qkv_bias,
                shape.o_bias,
            )?,
            norms,
            qk_norm: shape.qk_norm,
            rope: reach.rotary().then(|| rope.clone()),
            scale: shape.scale,
            window: reach.window(),
        })
    }

    /// The norms, when they apply at `stage`.
    fn norms_at(&self, stage: QkNorm) -> Option<&(RmsNorm, RmsNorm)> {
        self.norms.as_ref().filter(|_| self.qk_norm == stage)
    }
}

impl SelfAttention for Attention {
    fn window(&self) -> Option<usize> {
        self.window
    }

    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        self.proj.o_proj.forward(&self.attended(x, cache, which)?)
    }

    fn attend_add(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
        residual: &Array,
    ) -> Result<Array, Exception> {
        self.proj
            .o_proj
            .forward_add(&self.attended(x, cache, which)?, residual)
    }
}

impl Attention {
    /// The heads' attention output of the positions `which` names, the output projection's
    /// input: `[B, L, heads · d]`, or `[B, 1, heads · d]` for the last alone.
    fn attended(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        if let (None, Some(rope)) = (&self.norms, &self.rope) {
            if let Some((qk, v)) = self.proj.qk_v(x)? {
                // One rotation of queries and keys together: each head is rotated alike at
                // the cache's positions, whichever projection it came from.
                let heads = self.proj.heads;
                let qk = rope.prescale(&split_heads(&qk, heads + self.proj.kv_heads)?)?;
                let qk = cache.rope(&rope.rope, &qk)?;
                let parts = qk.split_at_indices(&[heads], 1)?;
                let v = split_heads(&v, self.proj.kv_heads)?;
                let opts = prerotated_opts(self.scale, self.window);
                return attend_queries(&parts[0], &parts[1], &v, &opts, cache, which);
            }
        }
        let (mut q, mut k, v) = self.proj.qkv(x)?;
        if let Some((qn, kn)) = self.norms_at(QkNorm::Whole) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let (mut q, mut k, v) = self.proj.split(&q, &k, &v)?;
        if let Some((qn, kn)) = self.norms_at(QkNorm::PerHead) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(rope) = &self.rope {
            q = rope.prescale(&q)?;
            k = rope.prescale(&k)?;
        }
        let opts = AttnOpts {
            rope: self.rope.as_ref().map(|r| &r.rope),
            ..prerotated_opts(self.scale, self.window)
        };
        attend_queries(&q, &k, &v, &opts, cache, which)
    }
}

impl Parameters for Attention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj);
        if let Some((qn, kn)) = &self.norms {
            p.add(qn).add(kn);
        }
    }
}
