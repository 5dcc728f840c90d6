//! EXAONE 4 (`Exaone4ForCausalLM`), as mlx-lm's `exaone4.py`: RMS-normalised query and key
//! heads, norms after each sub-layer only (no pre-norm), and with a `sliding_window_pattern`
//! such as `"LLLG"` a hybrid stack: `L` layers attend within a sliding window with RoPE,
//! `G` layers attend to everything with no positional embedding. Without a pattern every
//! layer is global and rotary.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense2_blocks::{
    decoder_info, initialize_rope, parse_config, AttnProjections, GatedMlp, Params, ScaledRope,
};
use super::layers::{attend_with, AttnOpts, Matrix, RmsNorm};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields mlx-lm's `exaone4.ModelArgs` reads.
#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: i32,
    max_position_embeddings: usize,
    rope_theta: f32,
    head_dim: i32,
    tie_word_embeddings: bool,
    rope_scaling: Option<Value>,
    sliding_window: Option<usize>,
    sliding_window_pattern: Option<Value>,
}

/// How one layer attends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reach {
    /// Within the last `window` positions, with RoPE (`L` in the pattern).
    Local(usize),
    /// Everything, without positional embedding (`G` in the pattern).
    GlobalNoPe,
    /// Everything, with RoPE (every layer when there is no pattern).
    GlobalRope,
}

/// Each layer's reach from `sliding_window_pattern`, repeated over the layers as mlx-lm does.
fn layer_reach(c: &Config) -> Result<Vec<Reach>, LoadError> {
    let pattern = match &c.sliding_window_pattern {
        None | Some(Value::Null) => return Ok(vec![Reach::GlobalRope; c.num_hidden_layers]),
        Some(Value::String(p)) if !p.is_empty() => p.as_bytes(),
        Some(other) => {
            return Err(LoadError::Config(format!(
                "EXAONE 4 sliding_window_pattern {other} is not a string of L and G"
            )))
        }
    };
    // mlx-lm needs at least one layer of each kind to build its two masks.
    if !pattern.contains(&b'L') || !pattern.contains(&b'G') {
        return Err(LoadError::Config(format!(
            "EXAONE 4 sliding_window_pattern {:?} needs both an L and a G layer",
            String::from_utf8_lossy(pattern)
        )));
    }
    let window = c.sliding_window.filter(|&w| w > 0).ok_or_else(|| {
        LoadError::Config("EXAONE 4 has local layers but no sliding_window".into())
    })?;
    Ok((0..c.num_hidden_layers)
        .map(|i| match pattern[i % pattern.len()] {
            b'L' => Reach::Local(window),
            _ => Reach::GlobalNoPe,
        })
        .collect())
}

struct Block {
    reach: Reach,
    attn: AttnProjections,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    mlp: GatedMlp,
    post_attention_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
}

pub struct Exaone4 {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: ScaledRope,
    scale: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("EXAONE 4", config)?;
    let reach = layer_reach(&c)?;
    let rope = initialize_rope(c.head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?;
    let eps = c.rms_norm_eps;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (i, reach) in reach.into_iter().enumerate() {
        let p = format!("model.layers.{i}");
        let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), eps);
        layers.push(Block {
            reach,
            attn: AttnProjections::load(
                w,
                &format!("{p}.self_attn"),
                c.num_attention_heads,
                c.num_key_value_heads,
                false,
                false,
            )?,
            q_norm: norm(w, "self_attn.q_norm")?,
            k_norm: norm(w, "self_attn.k_norm")?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), false)?,
            post_attention_layernorm: norm(w, "post_attention_layernorm")?,
            post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        });
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", eps)?;
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(Matrix::load(w, "lm_head")?)
    };
    let info = decoder_info(
        config,
        c.vocab_size,
        c.num_hidden_layers,
        c.max_position_embeddings,
        c.num_key_value_heads,
        c.head_dim,
        &embed_tokens,
    );
    let mut model = Exaone4 {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        scale: (c.head_dim as f32).powf(-0.5),
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Exaone4 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            p.attention(&b.attn);
            p.gated_mlp(&b.mlp);
            for n in [
                &b.q_norm,
                &b.k_norm,
                &b.post_attention_layernorm,
                &b.post_feedforward_layernorm,
            ] {
                p.rms(n);
            }
        }
        p.rms(&self.norm);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(&self, b: &Block, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let (q, k, v) = b.attn.project(x)?;
        let (mut q, mut k) = (b.q_norm.forward(&q)?, b.k_norm.forward(&k)?);
        let (rope, window) = match b.reach {
            Reach::Local(window) => (Some(&self.rope.rope), Some(window)),
            Reach::GlobalRope => (Some(&self.rope.rope), None),
            Reach::GlobalNoPe => (None, None),
        };
        if rope.is_some() {
            q = self.rope.prescale(&q)?;
            k = self.rope.prescale(&k)?;
        }
        let opts = AttnOpts {
            rope,
            scale: self.scale,
            window,
            sinks: None,
            softcap: None,
        };
        b.attn
            .o_proj
            .forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl CausalLm for Exaone4 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let attended = self.attention(b, &h, cache)?;
            h = h.add(&b.post_attention_layernorm.forward(&attended)?)?;
            let mlp = b.mlp.forward(&h)?;
            h = h.add(&b.post_feedforward_layernorm.forward(&mlp)?)?;
        }
        let h = self.norm.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.matmul_t(&h),
            None => self.embed_tokens.matmul_t(&h),
        }
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
