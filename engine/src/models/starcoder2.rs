//! StarCoder2: a pre-norm decoder with LayerNorms (weight and bias), biases on every
//! projection, and a two-matrix GELU MLP (`c_fc` then `c_proj`).
//!
//! Two config fields are read the way mlx-lm 0.32.2 reads them, which is what greedy parity
//! means here: the MLP uses the exact (erf) GELU whatever `hidden_act` names among the GELU
//! variants (checkpoints say `gelu_pytorch_tanh`), and `sliding_window` is not applied —
//! mlx-lm attends over the whole context, so a window here would change outputs past it.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{
    check_heads, gelu_exact, implied_head_dim, load_lm_head, logits, model_info, parse_config,
    KvShape, Params, Projections,
};
use super::layers::{attend_with, split_heads, AttnOpts, LayerNorm, Linear, Matrix, Rope};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `starcoder2.ModelArgs` reads, plus those checked
/// for values it would not honour.
#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    #[serde(default = "default_norm_epsilon")]
    norm_epsilon: f32,
    #[serde(default = "default_vocab_size")]
    vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    max_position_embeddings: Option<usize>,
    /// mlx-lm always builds the biases; a checkpoint without them is refused.
    #[serde(default = "default_true")]
    use_bias: bool,
    hidden_act: Option<String>,
}

fn default_norm_epsilon() -> f32 {
    1e-5
}

fn default_vocab_size() -> usize {
    49152
}

fn default_rope_theta() -> f32 {
    100000.0
}

fn default_true() -> bool {
    true
}

impl Config {
    fn check_supported(&self) -> Result<(), LoadError> {
        if !self.use_bias {
            return Err(LoadError::Config(
                "StarCoder2 with use_bias=false is not supported".into(),
            ));
        }
        match self.hidden_act.as_deref() {
            None => Ok(()),
            Some(act) if act.starts_with("gelu") => Ok(()),
            Some(act) => Err(LoadError::Config(format!(
                "StarCoder2 hidden_act {act:?} is not supported (GELU only)"
            ))),
        }
    }
}

struct Mlp {
    c_fc: Linear,
    c_proj: Linear,
}

impl Mlp {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        self.c_proj.forward(&gelu_exact(&self.c_fc.forward(x)?)?)
    }
}

struct Block {
    attn: Projections,
    mlp: Mlp,
    input_layernorm: LayerNorm,
    post_attention_layernorm: LayerNorm,
}

impl Block {
    fn load(w: &mut Weights, i: usize, eps: f32) -> Result<Self, LoadError> {
        let p = format!("model.layers.{i}");
        Ok(Self {
            attn: Projections::load(w, &format!("{p}.self_attn"), true, true)?,
            mlp: Mlp {
                c_fc: Linear::load(w, &format!("{p}.mlp.c_fc"), true)?,
                c_proj: Linear::load(w, &format!("{p}.mlp.c_proj"), true)?,
            },
            input_layernorm: LayerNorm::load(w, &format!("{p}.input_layernorm"), eps, true)?,
            post_attention_layernorm: LayerNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                eps,
                true,
            )?,
        })
    }
}

pub struct Starcoder2 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: LayerNorm,
    lm_head: Option<Matrix>,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(config)?;
    c.check_supported()?;
    check_heads(c.num_attention_heads, c.num_key_value_heads)?;
    let head_dim = implied_head_dim(c.hidden_size, c.num_attention_heads)?;
    let rope = Rope {
        dims: head_dim,
        traditional: false,
        base: c.rope_theta,
        scale: 1.0,
        freqs: None,
    };
    let layers = (0..c.num_hidden_layers)
        .map(|i| Block::load(w, i, c.norm_epsilon))
        .collect::<Result<Vec<_>, _>>()?;
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = LayerNorm::load(w, "model.norm", c.norm_epsilon, true)?;
    let lm_head = load_lm_head(w, c.tie_word_embeddings)?;
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(4096),
        KvShape {
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads,
            head_dim,
        },
        &embed_tokens,
    );
    let mut model = Starcoder2 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        scale: (head_dim as f32).powf(-0.5),
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

/// The weight and bias of a LayerNorm.
fn push_layer_norm<'a>(p: &mut Params<'a>, n: &'a LayerNorm) {
    if let Some(weight) = &n.weight {
        p.array(weight);
    }
    if let Some(bias) = &n.bias {
        p.array(bias);
    }
}

impl Starcoder2 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            p.projections(&b.attn);
            p.linear(&b.mlp.c_fc);
            p.linear(&b.mlp.c_proj);
            push_layer_norm(&mut p, &b.input_layernorm);
            push_layer_norm(&mut p, &b.post_attention_layernorm);
        }
        push_layer_norm(&mut p, &self.norm);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (q, k, v) = b.attn.qkv(x)?;
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

impl CausalLm for Starcoder2 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = self.attention(b, &b.input_layernorm.forward(&h)?, cache)?;
            let hh = h.add(&r)?;
            let r = b.mlp.forward(&b.post_attention_layernorm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        let h = self.norm.forward(&h)?;
        logits(&h, self.lm_head.as_ref(), &self.embed_tokens)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
