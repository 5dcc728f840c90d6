//! OLMo 2: a Llama-shaped decoder whose norms sit after each sublayer instead of before it
//! (`post_attention_layernorm` on the attention output, `post_feedforward_layernorm` on the
//! MLP output, none on the inputs), and whose queries and keys are RMS-normalised over the
//! whole projection (all heads at once) before the heads are split.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{
    check_heads, discard_rotary_inv_freq, implied_head_dim, load_lm_head, logits, model_info,
    parse_config, GatedMlp, KvShape, Params, Projections,
};
use super::layers::{attend_with, split_heads, AttnOpts, Matrix, RmsNorm, Rope};
use super::llama::rope_from_config;
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `olmo2.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: Option<i32>,
    head_dim: Option<i32>,
    rms_norm_eps: f32,
    vocab_size: usize,
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_true() -> bool {
    true
}

struct Block {
    attn: Projections,
    /// RMS norms over all query (key) heads together, `[heads * head_dim]`.
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    mlp: GatedMlp,
    post_attention_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

impl Block {
    fn load(w: &mut Weights, i: usize, c: &Config) -> Result<Self, LoadError> {
        let p = format!("model.layers.{i}");
        let norm =
            |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), c.rms_norm_eps);
        Ok(Self {
            attn: Projections::load(
                w,
                &format!("{p}.self_attn"),
                c.attention_bias,
                c.attention_bias,
            )?,
            q_norm: norm(w, "self_attn.q_norm")?,
            k_norm: norm(w, "self_attn.k_norm")?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), c.mlp_bias)?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        })
    }
}

pub struct Olmo2 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(config)?;
    let kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
    check_heads(c.num_attention_heads, kv_heads)?;
    let head_dim = match c.head_dim {
        Some(d) => d,
        None => implied_head_dim(c.hidden_size, c.num_attention_heads)?,
    };
    let rope = rope_from_config(
        head_dim,
        c.rope_theta,
        c.rope_traditional,
        c.rope_scaling.as_ref(),
    )?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        layers.push(Block::load(w, i, &c)?);
        discard_rotary_inv_freq(w, i);
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let lm_head = load_lm_head(w, c.tie_word_embeddings)?;
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(4096),
        KvShape {
            layers: c.num_hidden_layers,
            kv_heads,
            head_dim,
        },
        &embed_tokens,
    );
    let mut model = Olmo2 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        heads: c.num_attention_heads,
        kv_heads,
        scale: (head_dim as f32).powf(-0.5),
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Olmo2 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            p.projections(&b.attn);
            p.mlp(&b.mlp);
            for n in [
                &b.q_norm,
                &b.k_norm,
                &b.post_attention_layernorm,
                &b.post_feedforward_layernorm,
            ] {
                p.array(&n.weight);
            }
        }
        p.array(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (q, k, v) = b.attn.qkv(x)?;
        let (q, k) = (b.q_norm.forward(&q)?, b.k_norm.forward(&k)?);
        let opts = AttnOpts {
            rope: Some(&self.rope),
            scale: self.scale,
            window: None,
            sinks: None,
            softcap: None,
        };
        let out = attend_with(
            &split_heads(&q, self.heads)?,
            &split_heads(&k, self.kv_heads)?,
            &split_heads(&v, self.kv_heads)?,
            &opts,
            cache,
        )?;
        b.attn.o_proj.forward(&out)
    }
}

impl CausalLm for Olmo2 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = b
                .post_attention_layernorm
                .forward(&self.attention(b, &h, cache)?)?;
            let hh = h.add(&r)?;
            let r = b.post_feedforward_layernorm.forward(&b.mlp.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        let h = self.norm.forward(&h)?;
        logits(&h, self.lm_head.as_ref(), &self.embed_tokens)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
