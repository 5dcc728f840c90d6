//! GLM-4 (`Glm4ForCausalLM`, GLM-4-0414): a Llama-like decoder with a fused gate/up
//! projection, "sandwich" norms (each sub-layer's output is normalised again before the
//! residual add), biased q/k/v, and rotary embedding on only part of each head (traditional
//! pairing by default), as mlx-lm's `glm4.py`.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense2_blocks::{decoder_info, parse_config, AttnProjections, Params};
use super::layers::{attend_with, swiglu, AttnOpts, Linear, Matrix, RmsNorm, Rope};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `glm4.ModelArgs` reads, with its defaults.
#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    attention_bias: bool,
    head_dim: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: i32,
    partial_rotary_factor: f32,
    rope_theta: f32,
    #[serde(default = "default_true")]
    rope_traditional: bool,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
}

fn default_true() -> bool {
    true
}

fn default_context() -> usize {
    32768
}

/// `down(swiglu(gate, up))` where gate and up are the two halves of one matrix's output.
struct FusedMlp {
    gate_up_proj: Linear,
    down_proj: Linear,
}

impl FusedMlp {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let halves = self.gate_up_proj.forward(x)?.split_equal(2, -1)?;
        self.down_proj.forward(&swiglu(&halves[0], &halves[1])?)
    }
}

struct Block {
    attn: AttnProjections,
    mlp: FusedMlp,
    input_layernorm: RmsNorm,
    post_self_attn_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    post_mlp_layernorm: RmsNorm,
}

pub struct Glm4 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("GLM-4", config)?;
    // `int(head_dim * partial_rotary_factor)`: Python truncates toward zero.
    let rotary_dims = (c.head_dim as f32 * c.partial_rotary_factor) as i32;
    if rotary_dims <= 0 || rotary_dims > c.head_dim || rotary_dims % 2 != 0 {
        return Err(LoadError::Config(format!(
            "GLM-4 partial_rotary_factor {} gives {rotary_dims} rotary dimensions of a {}-wide head",
            c.partial_rotary_factor, c.head_dim
        )));
    }
    let eps = c.rms_norm_eps;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), eps);
        layers.push(Block {
            attn: AttnProjections::load(
                w,
                &format!("{p}.self_attn"),
                c.num_attention_heads,
                c.num_key_value_heads,
                c.attention_bias,
                false,
            )?,
            mlp: FusedMlp {
                gate_up_proj: Linear::load(w, &format!("{p}.mlp.gate_up_proj"), false)?,
                down_proj: Linear::load(w, &format!("{p}.mlp.down_proj"), false)?,
            },
            input_layernorm: norm(w, "input_layernorm")?,
            post_self_attn_layernorm: norm(w, "post_self_attn_layernorm")?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            post_mlp_layernorm: norm(w, "post_mlp_layernorm")?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", eps)?;
    // mlx-lm's GLM-4 always has its own output matrix.
    let lm_head = Matrix::load(w, "lm_head")?;
    let info = decoder_info(
        config,
        c.vocab_size,
        c.num_hidden_layers,
        c.max_position_embeddings,
        c.num_key_value_heads,
        c.head_dim,
        &embed_tokens,
    );
    let mut model = Glm4 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope: Rope {
            dims: rotary_dims,
            traditional: c.rope_traditional,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        scale: (c.head_dim as f32).powf(-0.5),
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Glm4 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            p.attention(&b.attn);
            p.linear(&b.mlp.gate_up_proj);
            p.linear(&b.mlp.down_proj);
            for n in [
                &b.input_layernorm,
                &b.post_self_attn_layernorm,
                &b.post_attention_layernorm,
                &b.post_mlp_layernorm,
            ] {
                p.rms(n);
            }
        }
        p.rms(&self.norm);
        p.matrix(&self.lm_head);
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (q, k, v) = b.attn.project(x)?;
        let opts = AttnOpts {
            rope: Some(&self.rope),
            scale: self.scale,
            window: None,
            sinks: None,
            softcap: None,
        };
        b.attn
            .o_proj
            .forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl CausalLm for Glm4 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let attended = self.attention(b, &b.input_layernorm.forward(&h)?, cache)?;
            h = h.add(&b.post_self_attn_layernorm.forward(&attended)?)?;
            let mlp = b.mlp.forward(&b.post_attention_layernorm.forward(&h)?)?;
            h = b.post_mlp_layernorm.forward(&mlp)?.add(&h)?;
        }
        self.lm_head.matmul_t(&self.norm.forward(&h)?)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
