//! The decoder the mixture-of-experts families share: pre-norm blocks of rotary attention and a
//! feed-forward part (dense SwiGLU or a family's MoE block), RMS norms, an embedding and a
//! language-model head (tied or not), with Granite's optional multipliers. Each family file
//! parses its config, picks the attention options and builds its own feed-forward parts.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde_json::Value;

use super::layers::{attend_with, split_heads, swiglu, AttnOpts, Linear, Matrix, RmsNorm, Rope};
use super::llama::kv_dtype_bytes;
use super::switch::{matrix_parameters, scale_by};
use super::{eos_ids, CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

pub type Result<T> = std::result::Result<T, Exception>;

/// A block's feed-forward part: a dense MLP or a family's mixture of experts.
pub trait FeedForward: Send {
    /// `x` `[B, L, D]` → `[B, L, D]`.
    fn forward(&self, x: &Array) -> Result<Array>;
    /// The parameters, for materialization.
    fn parameters(&self) -> Vec<&Array>;
}

/// The parameters of a [`Linear`].
pub fn linear_parameters(l: &Linear) -> Vec<&Array> {
    let mut out = matrix_parameters(&l.matrix);
    out.extend(l.bias.iter());
    out
}

/// The dense SwiGLU MLP (`down(silu(gate(x)) * up(x))`), bias-free as in every MoE family.
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn load(w: &mut Weights, prefix: &str) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), false)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), false)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), false)?,
        })
    }
}

impl FeedForward for Mlp {
    fn forward(&self, x: &Array) -> Result<Array> {
        self.down_proj.forward(&swiglu(
            &self.gate_proj.forward(x)?,
            &self.up_proj.forward(x)?,
        )?)
    }

    fn parameters(&self) -> Vec<&Array> {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .into_iter()
            .flat_map(linear_parameters)
            .collect()
    }
}

/// Where a family RMS-normalises queries and keys, if it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Each head on its own (`[head_dim]` weights: Qwen3-MoE, GLM-4.5).
    PerHead,
    /// The whole projection before the split into heads (`[heads * head_dim]`: OLMoE).
    Full,
}

/// How a family's attention layers are shaped.
#[derive(Debug, Clone, Copy)]
pub struct AttentionSpec {
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    pub scale: f32,
    pub eps: f32,
}

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    norms: Option<(RmsNorm, RmsNorm)>,
    spec: AttentionSpec,
}

impl Attention {
    fn load(
        w: &mut Weights,
        prefix: &str,
        spec: AttentionSpec,
    ) -> std::result::Result<Self, LoadError> {
        let norms = match spec.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead | QkNorm::Full => Some((
                RmsNorm::load(w, &format!("{prefix}.q_norm"), spec.eps)?,
                RmsNorm::load(w, &format!("{prefix}.k_norm"), spec.eps)?,
            )),
        };
        Ok(Self {
            q_proj: Linear::load(w, &format!("{prefix}.q_proj"), spec.qkv_bias)?,
            k_proj: Linear::load(w, &format!("{prefix}.k_proj"), spec.qkv_bias)?,
            v_proj: Linear::load(w, &format!("{prefix}.v_proj"), spec.qkv_bias)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), spec.o_bias)?,
            norms,
            spec,
        })
    }

    fn forward(&self, x: &Array, rope: &Rope, cache: &mut LayerCache) -> Result<Array> {
        let (mut q, mut k) = (self.q_proj.forward(x)?, self.k_proj.forward(x)?);
        let v = self.v_proj.forward(x)?;
        if let (QkNorm::Full, Some((qn, kn))) = (self.spec.qk_norm, &self.norms) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let mut q = split_heads(&q, self.spec.heads)?;
        let mut k = split_heads(&k, self.spec.kv_heads)?;
        if let (QkNorm::PerHead, Some((qn, kn))) = (self.spec.qk_norm, &self.norms) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let v = split_heads(&v, self.spec.kv_heads)?;
        let out = attend_with(&q, &k, &v, &AttnOpts::rotary(rope, self.spec.scale), cache)?;
        self.o_proj.forward(&out)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .into_iter()
            .flat_map(linear_parameters)
            .collect();
        if let Some((qn, kn)) = &self.norms {
            out.extend([&qn.weight, &kn.weight]);
        }
        out
    }
}

struct Block {
    attn: Attention,
    ffn: Box<dyn FeedForward>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

/// Granite's scalar multipliers (all absent elsewhere). Each is applied in the activations'
/// dtype, as MLX applies a Python float.
#[derive(Debug, Clone, Copy, Default)]
pub struct Multipliers {
    /// Scales the token embeddings.
    pub embedding: Option<f32>,
    /// Scales each block's attention and feed-forward outputs before the residual add.
    pub residual: Option<f32>,
    /// Divides the logits.
    pub logits_divisor: Option<f32>,
}

/// What the shared decoder needs besides the per-layer parts.
pub struct DecoderSpec<'a> {
    pub config: &'a Value,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub context_length: usize,
    pub eps: f32,
    /// Logits from the embedding matrix (no `lm_head` of its own).
    pub tied_embeddings: bool,
    pub rope: Rope,
    pub attention: AttentionSpec,
    pub multipliers: Multipliers,
}

pub struct MoeDecoder {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: Rope,
    multipliers: Multipliers,
    info: ModelInfo,
}

/// Builds the decoder; `feed_forward(w, layer, prefix)` loads layer `layer`'s feed-forward part
/// from `<prefix>` (`model.layers.<i>`).
pub fn build(
    w: &mut Weights,
    spec: DecoderSpec<'_>,
    mut feed_forward: impl FnMut(
        &mut Weights,
        usize,
        &str,
    ) -> std::result::Result<Box<dyn FeedForward>, LoadError>,
) -> std::result::Result<Box<dyn CausalLm>, LoadError> {
    let mut layers = Vec::with_capacity(spec.num_layers);
    for i in 0..spec.num_layers {
        let p = format!("model.layers.{i}");
        layers.push(Block {
            attn: Attention::load(w, &format!("{p}.self_attn"), spec.attention)?,
            ffn: feed_forward(w, i, &p)?,
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), spec.eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                spec.eps,
            )?,
        });
        // Precomputed rotary frequencies are recomputed from the config, as mlx-lm does.
        w.discard(&format!("{p}.self_attn.rotary_emb.inv_freq"));
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", spec.eps)?;
    let lm_head = if spec.tied_embeddings {
        // A tied checkpoint may still carry a copy of the embedding as lm_head; it is unused.
        for suffix in ["weight", "scales", "biases"] {
            w.discard(&format!("lm_head.{suffix}"));
        }
        None
    } else {
        Some(Matrix::load(w, "lm_head")?)
    };
    let dtype_bytes = kv_dtype_bytes(&embed_tokens);
    let a = spec.attention;
    let info = ModelInfo {
        architecture: spec.config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size: spec.vocab_size,
        num_layers: spec.num_layers,
        context_length: spec.context_length,
        weight_bytes: 0,
        // Every layer caches keys and values of `kv_heads * head_dim` per token.
        kv_bytes_per_token: 2 * spec.num_layers * (a.kv_heads * a.head_dim) as usize * dtype_bytes,
        kv_dtype_bytes: dtype_bytes,
        head_dim: a.head_dim as usize,
        eos_token_ids: eos_ids(spec.config),
    };
    let mut model = MoeDecoder {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope: spec.rope,
        multipliers: spec.multipliers,
        info,
    };
    model.info.weight_bytes = crate::loader::materialize(&model.parameters(), w.reporter())?;
    Ok(Box::new(model))
}

impl MoeDecoder {
    fn parameters(&self) -> Vec<&Array> {
        let mut out = matrix_parameters(&self.embed_tokens);
        for b in &self.layers {
            out.extend(b.attn.parameters());
            out.extend(b.ffn.parameters());
            out.push(&b.input_layernorm.weight);
            out.push(&b.post_attention_layernorm.weight);
        }
        out.push(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            out.extend(matrix_parameters(h));
        }
        out
    }

    /// `x` plus the block output `r`, scaled by the residual multiplier when there is one.
    fn residual(&self, x: &Array, r: &Array) -> Result<Array> {
        match self.multipliers.residual {
            Some(m) => x.add(scale_by(r, m)?),
            None => x.add(r),
        }
    }
}

impl CausalLm for MoeDecoder {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        let mut h = self.embed_tokens.rows(tokens)?;
        if let Some(m) = self.multipliers.embedding {
            h = scale_by(&h, m)?;
        }
        for (block, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = block
                .attn
                .forward(&block.input_layernorm.forward(&h)?, &self.rope, cache)?;
            let hh = self.residual(&h, &r)?;
            let r = block
                .ffn
                .forward(&block.post_attention_layernorm.forward(&hh)?)?;
            h = self.residual(&hh, &r)?;
        }
        let h = self.norm.forward(&h)?;
        let logits = match &self.lm_head {
            Some(head) => head.matmul_t(&h)?,
            None => self.embed_tokens.matmul_t(&h)?,
        };
        match self.multipliers.logits_divisor {
            Some(d) => logits.divide(Array::from_f32(d).as_dtype(logits.dtype())?),
            None => Ok(logits),
        }
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}

/// Refuses a `rope_scaling` that the family's mlx-lm implementation does not apply (it builds
/// a plain `nn.RoPE`): serving it unscaled would silently differ from the checkpoint's
/// training, and scaling it would differ from mlx-lm. `null` or a `default` type is fine.
pub fn refuse_rope_scaling(family: &str, config: &Value) -> std::result::Result<(), LoadError> {
    let Some(scaling) = config.get("rope_scaling").filter(|s| !s.is_null()) else {
        return Ok(());
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str);
    if kind == Some("default") {
        return Ok(());
    }
    Err(LoadError::Config(format!(
        "{family}: rope_scaling {scaling} is not supported (mlx-lm applies no RoPE scaling to \
         this architecture)"
    )))
}

/// Parses a family's config struct, naming the family in the error.
pub fn parse_config<T: serde::de::DeserializeOwned>(
    family: &str,
    config: &Value,
) -> std::result::Result<T, LoadError> {
    serde_json::from_value(config.clone())
        .map_err(|e| LoadError::Config(format!("{family} config: {e}")))
}
