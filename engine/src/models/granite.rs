//! IBM Granite 3.x (dense): the Llama decoder with four scalar knobs that μP-style training
//! left in the architecture: the embedding is multiplied by `embedding_multiplier`, the
//! attention scale is `attention_multiplier` (not `1/sqrt(head_dim)`), each residual branch is
//! multiplied by `residual_multiplier` before it is added, and the logits are divided by
//! `logits_scaling`.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{
    check_heads, discard_rotary_inv_freq, divided, implied_head_dim, load_lm_head, logits,
    model_info, parse_config, scaled, KvShape, LlamaStyleBlock, Params,
};
use super::layers::{attend_with, split_heads, AttnOpts, Matrix, RmsNorm, Rope};
use super::llama::rope_from_config;
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `granite.ModelArgs` reads (all but `rope_scaling`
/// and `tie_word_embeddings` are required there too).
#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    logits_scaling: f32,
    attention_multiplier: f32,
    embedding_multiplier: f32,
    residual_multiplier: f32,
    max_position_embeddings: usize,
    attention_bias: bool,
    mlp_bias: bool,
    rope_theta: f32,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

fn default_true() -> bool {
    true
}

pub struct Granite {
    embed_tokens: Matrix,
    layers: Vec<LlamaStyleBlock>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    attention_multiplier: f32,
    embedding_multiplier: f32,
    residual_multiplier: f32,
    logits_scaling: f32,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(config)?;
    check_heads(c.num_attention_heads, c.num_key_value_heads)?;
    let head_dim = implied_head_dim(c.hidden_size, c.num_attention_heads)?;
    if c.logits_scaling == 0.0 {
        return Err(LoadError::Config(
            "Granite logits_scaling must not be 0".into(),
        ));
    }
    // mlx-lm builds Granite's rotary embedding non-traditional whatever the config says.
    let rope = rope_from_config(head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        layers.push(LlamaStyleBlock::load(
            w,
            i,
            c.attention_bias,
            c.mlp_bias,
            c.rms_norm_eps,
        )?);
        discard_rotary_inv_freq(w, i);
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let lm_head = load_lm_head(w, c.tie_word_embeddings)?;
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings,
        KvShape {
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads,
            head_dim,
        },
        &embed_tokens,
    );
    let mut model = Granite {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        attention_multiplier: c.attention_multiplier,
        embedding_multiplier: c.embedding_multiplier,
        residual_multiplier: c.residual_multiplier,
        logits_scaling: c.logits_scaling,
        info,
    };
    model.info.weight_bytes = model.params().materialize(w.reporter())?;
    Ok(Box::new(model))
}

impl Granite {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for b in &self.layers {
            b.push_params(&mut p);
        }
        p.array(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(
        &self,
        block: &LlamaStyleBlock,
        x: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let (q, k, v) = block.attn.qkv(x)?;
        let opts = AttnOpts {
            rope: Some(&self.rope),
            scale: self.attention_multiplier,
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
        block.attn.o_proj.forward(&out)
    }
}

impl CausalLm for Granite {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = scaled(&self.embed_tokens.rows(tokens)?, self.embedding_multiplier)?;
        for (block, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = self.attention(block, &block.input_layernorm.forward(&h)?, cache)?;
            let hh = h.add(&scaled(&r, self.residual_multiplier)?)?;
            let r = block
                .mlp
                .forward(&block.post_attention_layernorm.forward(&hh)?)?;
            h = hh.add(&scaled(&r, self.residual_multiplier)?)?;
        }
        let h = self.norm.forward(&h)?;
        divided(
            &logits(&h, self.lm_head.as_ref(), &self.embed_tokens)?,
            self.logits_scaling,
        )
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
