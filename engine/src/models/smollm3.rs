//! SmolLM3: the Llama decoder in which some layers use no positional embedding at all (NoPE):
//! `no_rope_layers[i]` is 1 where layer `i` applies RoPE and 0 where it does not; without the
//! list, every `no_rope_layer_interval`-th layer (the 4th, 8th, …) is a NoPE layer.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::dense_parts::{
    check_heads, discard_rotary_inv_freq, implied_head_dim, load_lm_head, logits, model_info,
    parse_config, KvShape, LlamaStyleBlock, Params,
};
use super::layers::{attend_with, split_heads, AttnOpts, Matrix, RmsNorm, Rope};
use super::llama::rope_from_config;
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `smollm3.ModelArgs` (Llama's plus the NoPE layout)
/// reads.
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
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_no_rope_interval")]
    no_rope_layer_interval: usize,
    no_rope_layers: Option<Vec<u8>>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_true() -> bool {
    true
}

fn default_no_rope_interval() -> usize {
    4
}

impl Config {
    /// Whether each layer applies RoPE, from the explicit list or the interval.
    fn rope_layers(&self) -> Result<Vec<bool>, LoadError> {
        match &self.no_rope_layers {
            Some(list) if list.len() != self.num_hidden_layers => Err(LoadError::Config(format!(
                "no_rope_layers has {} entries for {} layers",
                list.len(),
                self.num_hidden_layers
            ))),
            Some(list) => Ok(list.iter().map(|&use_rope| use_rope != 0).collect()),
            None if self.no_rope_layer_interval == 0 => Err(LoadError::Config(
                "no_rope_layer_interval must be positive".into(),
            )),
            None => Ok((0..self.num_hidden_layers)
                .map(|i| (i + 1) % self.no_rope_layer_interval != 0)
                .collect()),
        }
    }

    /// mlx-lm's Llama decoder would window `sliding_attention` layers; SmolLM3 checkpoints
    /// use full attention throughout, and anything else is refused rather than guessed.
    fn check_full_attention(&self) -> Result<(), LoadError> {
        let Some(types) = &self.layer_types else {
            return Ok(());
        };
        match types.iter().find(|t| *t != "full_attention") {
            Some(other) => Err(LoadError::Config(format!(
                "SmolLM3 layer type {other:?} is not supported (only full_attention)"
            ))),
            None => Ok(()),
        }
    }
}

struct Layer {
    block: LlamaStyleBlock,
    /// `false` for a NoPE layer.
    uses_rope: bool,
}

pub struct SmolLm3 {
    embed_tokens: Matrix,
    layers: Vec<Layer>,
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
    c.check_full_attention()?;
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
    let rope_layers = c.rope_layers()?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (i, uses_rope) in rope_layers.into_iter().enumerate() {
        layers.push(Layer {
            block: LlamaStyleBlock::load(w, i, c.attention_bias, c.mlp_bias, c.rms_norm_eps)?,
            uses_rope,
        });
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
    let mut model = SmolLm3 {
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

impl SmolLm3 {
    fn params(&self) -> Params<'_> {
        let mut p = Params::default();
        p.matrix(&self.embed_tokens);
        for l in &self.layers {
            l.block.push_params(&mut p);
        }
        p.array(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            p.matrix(h);
        }
        p
    }

    fn attention(
        &self,
        layer: &Layer,
        x: &Array,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let attn = &layer.block.attn;
        let (q, k, v) = attn.qkv(x)?;
        let opts = AttnOpts {
            rope: layer.uses_rope.then_some(&self.rope),
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
        attn.o_proj.forward(&out)
    }
}

impl CausalLm for SmolLm3 {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let block = &layer.block;
            let r = self.attention(layer, &block.input_layernorm.forward(&h)?, cache)?;
            let hh = h.add(&r)?;
            let r = block
                .mlp
                .forward(&block.post_attention_layernorm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        let h = self.norm.forward(&h)?;
        logits(&h, self.lm_head.as_ref(), &self.embed_tokens)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Config {
        let mut base = serde_json::json!({
            "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
            "rms_norm_eps": 1e-6, "vocab_size": 10,
        });
        if let (Some(base), Some(extra)) = (base.as_object_mut(), extra.as_object()) {
            base.extend(extra.clone());
        }
        parse_config(&base).expect("config")
    }

    #[test]
    fn every_fourth_layer_is_nope_by_default() {
        let layers = config(serde_json::json!({})).rope_layers().expect("layers");
        assert_eq!(layers, [true, true, true, false, true, true, true, false]);
    }

    #[test]
    fn an_explicit_list_wins_and_must_cover_every_layer() {
        let c = config(serde_json::json!({"no_rope_layers": [1, 0, 1, 0, 1, 0, 1, 0]}));
        assert_eq!(c.rope_layers().expect("layers")[..2], [true, false]);
        let short = config(serde_json::json!({"no_rope_layers": [1, 0]}));
        assert!(short.rope_layers().is_err());
    }

    #[test]
    fn sliding_layers_are_refused() {
        let c = config(serde_json::json!({"layer_types": ["sliding_attention"]}));
        assert!(c.check_full_attention().is_err());
    }
}
