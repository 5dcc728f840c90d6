//! Gemma 2 (`Gemma2ForCausalLM`), and the blocks the Gemma family shares (Gemma 3 reuses
//! them): RMS norms that scale by `1 + weight`, a GELU-gated MLP, and an embedding scaled by
//! `sqrt(hidden_size)` in the model's dtype.
//!
//! As mlx-lm 0.32.2's `gemma2.py` computes it: sandwich norms around attention and MLP,
//! queries scaled by `query_pre_attn_scalar^-0.5`, attention logits and final logits
//! soft-capped. mlx-lm gives every Gemma 2 layer full attention (its Gemma 2 reads no
//! `sliding_window`), and so does this file: greedy outputs match mlx-lm's, which for
//! sequences longer than the checkpoint's window differ from the Hugging Face model's.
use mlx_rs::error::Exception;
use mlx_rs::ops::tanh;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::{attend_with, split_heads, AttnOpts, Linear, Matrix, Rope};
use super::llama::kv_dtype_bytes;
use super::switch::matrix_parameters;
use super::{eos_ids, CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The Python float `v` as a scalar of `x`'s dtype: how MLX types a weak scalar operand.
pub(crate) fn scalar_like(x: &Array, v: f32) -> Result<Array, Exception> {
    Array::from_f32(v).as_dtype(x.dtype())
}

/// `nn.gelu_approx` op for op, every constant in `x`'s dtype (mlx-rs's own version promotes a
/// bfloat16 input to float32 through its float32 constants, which mlx-lm never does).
pub(crate) fn gelu_approx(x: &Array) -> Result<Array, Exception> {
    let s = |v: f32| scalar_like(x, v);
    let cubic = s(0.044715)?.multiply(x.power(&s(3.0)?)?)?;
    let inner = s((2.0 / std::f64::consts::PI).sqrt() as f32)?.multiply(x.add(&cubic)?)?;
    let gate = s(1.0)?.add(&tanh(&inner)?)?;
    s(0.5)?.multiply(x)?.multiply(&gate)
}

/// Refuses an activation other than the tanh-approximated GELU that mlx-lm's Gemma files
/// hard-code (the configs name it under `hidden_activation` or `hidden_act`).
pub(crate) fn check_activation(config: &Value) -> Result<(), LoadError> {
    for key in ["hidden_activation", "hidden_act"] {
        match config.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "gelu_pytorch_tanh" => {}
            Some(other) => {
                return Err(LoadError::Config(format!(
                    "Gemma: unsupported {key} {other} (only gelu_pytorch_tanh)"
                )))
            }
        }
    }
    Ok(())
}

/// Gemma's RMS norm: `rms_norm(x, 1 + weight)`. The shifted scale is computed once at load,
/// in the weight's dtype, exactly as mlx-lm computes it on every call.
#[derive(Debug)]
pub(crate) struct GemmaNorm {
    scale: Array,
    eps: f32,
}

impl GemmaNorm {
    pub(crate) fn load(w: &mut Weights, prefix: &str, eps: f32) -> Result<Self, LoadError> {
        let weight = w.take(&format!("{prefix}.weight"))?;
        let scale = weight.add(&scalar_like(&weight, 1.0)?)?;
        Ok(Self { scale, eps })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array, Exception> {
        mlx_rs::fast::rms_norm(x, Some(&self.scale), self.eps)
    }

    pub(crate) fn parameters(&self) -> Vec<&Array> {
        vec![&self.scale]
    }
}

/// `down(gelu_approx(gate(x)) * up(x))`, no biases.
#[derive(Debug)]
pub(crate) struct GeluMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl GeluMlp {
    pub(crate) fn load(w: &mut Weights, prefix: &str) -> Result<Self, LoadError> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), false)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), false)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), false)?,
        })
    }

    pub(crate) fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let gated = gelu_approx(&self.gate_proj.forward(x)?)?.multiply(self.up_proj.forward(x)?)?;
        self.down_proj.forward(&gated)
    }

    pub(crate) fn parameters(&self) -> Vec<&Array> {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
            .into_iter()
            .flat_map(linear_parameters)
            .collect()
    }
}

/// The arrays a [`Linear`] holds.
pub(crate) fn linear_parameters(l: &Linear) -> Vec<&Array> {
    let mut out = matrix_parameters(&l.matrix);
    out.extend(l.bias.iter());
    out
}

/// The four projections of a Gemma attention layer (no biases).
#[derive(Debug)]
pub(crate) struct Projections {
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
}

impl Projections {
    pub(crate) fn load(w: &mut Weights, prefix: &str) -> Result<Self, LoadError> {
        let mut load = |name: &str| Linear::load(w, &format!("{prefix}.{name}"), false);
        Ok(Self {
            q_proj: load("q_proj")?,
            k_proj: load("k_proj")?,
            v_proj: load("v_proj")?,
            o_proj: load("o_proj")?,
        })
    }

    pub(crate) fn parameters(&self) -> Vec<&Array> {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .into_iter()
            .flat_map(linear_parameters)
            .collect()
    }
}

/// Bytes per token of a cache that keeps every position of every layer, keys and values.
pub(crate) fn full_kv_bytes_per_token(
    layers: usize,
    kv_heads: i32,
    head_dim: i32,
    dtype_bytes: usize,
) -> usize {
    2 * layers * (kv_heads * head_dim) as usize * dtype_bytes
}

/// mlx-lm's `ModelArgs` for Gemma 2, with its defaults.
#[derive(Debug, Clone, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    head_dim: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_attn_softcap")]
    attn_logit_softcapping: f32,
    #[serde(default = "default_final_softcap")]
    final_logit_softcapping: f32,
    #[serde(default = "default_query_pre_attn_scalar")]
    query_pre_attn_scalar: f32,
    max_position_embeddings: Option<usize>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_attn_softcap() -> f32 {
    50.0
}

fn default_final_softcap() -> f32 {
    30.0
}

fn default_query_pre_attn_scalar() -> f32 {
    144.0
}

struct Block {
    proj: Projections,
    mlp: GeluMlp,
    input_layernorm: GemmaNorm,
    post_attention_layernorm: GemmaNorm,
    pre_feedforward_layernorm: GemmaNorm,
    post_feedforward_layernorm: GemmaNorm,
}

pub struct Gemma2 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: GemmaNorm,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    /// `query_pre_attn_scalar^-0.5`.
    scale: f32,
    attn_softcap: f32,
    final_softcap: f32,
    /// `sqrt(hidden_size)`, the embedding's scale.
    embed_scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config =
        serde_json::from_value(config.clone()).map_err(|e| LoadError::Config(e.to_string()))?;
    check_activation(config)?;
    if c.rope_scaling.as_ref().is_some_and(|s| !s.is_null()) {
        return Err(LoadError::Config(
            "Gemma 2: rope_scaling is not supported (mlx-lm's Gemma 2 has none)".into(),
        ));
    }
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let norm = |w: &mut Weights, name: &str| {
            GemmaNorm::load(w, &format!("{p}.{name}"), c.rms_norm_eps)
        };
        layers.push(Block {
            proj: Projections::load(w, &format!("{p}.self_attn"))?,
            mlp: GeluMlp::load(w, &format!("{p}.mlp"))?,
            input_layernorm: norm(w, "input_layernorm")?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = GemmaNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let dtype_bytes = kv_dtype_bytes(&embed_tokens);
    let info = ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(8192),
        weight_bytes: 0,
        kv_bytes_per_token: full_kv_bytes_per_token(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            dtype_bytes,
        ),
        kv_dtype_bytes: dtype_bytes,
        head_dim: c.head_dim as usize,
        eos_token_ids: eos_ids(config),
    };
    let mut model = Gemma2 {
        embed_tokens,
        layers,
        norm,
        rope: Rope {
            dims: c.head_dim,
            traditional: c.rope_traditional,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        scale: (1.0 / f64::from(c.query_pre_attn_scalar).sqrt()) as f32,
        attn_softcap: c.attn_logit_softcapping,
        final_softcap: c.final_logit_softcapping,
        embed_scale: f64::from(c.hidden_size).sqrt() as f32,
        info,
    };
    let params = model.parameters();
    let bytes = crate::loader::materialize(&params, w.reporter())?;
    model.info.weight_bytes = bytes;
    Ok(Box::new(model))
}

impl Gemma2 {
    fn parameters(&self) -> Vec<&Array> {
        let mut out = matrix_parameters(&self.embed_tokens);
        for b in &self.layers {
            out.extend(b.proj.parameters());
            out.extend(b.mlp.parameters());
            for n in [
                &b.input_layernorm,
                &b.post_attention_layernorm,
                &b.pre_feedforward_layernorm,
                &b.post_feedforward_layernorm,
            ] {
                out.extend(n.parameters());
            }
        }
        out.extend(self.norm.parameters());
        out
    }

    fn attention(
        &self,
        p: &Projections,
        x: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let q = split_heads(&p.q_proj.forward(x)?, self.heads)?;
        let k = split_heads(&p.k_proj.forward(x)?, self.kv_heads)?;
        let v = split_heads(&p.v_proj.forward(x)?, self.kv_heads)?;
        let opts = AttnOpts {
            softcap: Some(self.attn_softcap),
            ..AttnOpts::rotary(&self.rope, self.scale)
        };
        p.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

/// `tanh(x / cap) * cap`, the constant in `x`'s dtype.
pub(crate) fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    let c = scalar_like(x, cap)?;
    tanh(&x.divide(&c)?)?.multiply(&c)
}

impl CausalLm for Gemma2 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let h = self.embed_tokens.rows(tokens)?;
        let mut h = h.multiply(&scalar_like(&h, self.embed_scale)?)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = self.attention(&b.proj, &b.input_layernorm.forward(&h)?, cache)?;
            let mid = h.add(&b.post_attention_layernorm.forward(&r)?)?;
            let r = b.mlp.forward(&b.pre_feedforward_layernorm.forward(&mid)?)?;
            h = mid.add(&b.post_feedforward_layernorm.forward(&r)?)?;
        }
        let logits = self.embed_tokens.matmul_t(&self.norm.forward(&h)?)?;
        softcap(&logits, self.final_softcap)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
