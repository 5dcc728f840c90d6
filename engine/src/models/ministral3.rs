//! Ministral 3 (`Ministral3ForCausalLM`) and the text model of Mistral 3
//! (`Mistral3ForConditionalGeneration`), as mlx-lm's `ministral3.py` and `mistral3.py`.
//!
//! Ministral 3 is the Llama decoder with rotary settings under `rope_parameters` (YaRN in the
//! released models) and Llama 4's attention temperature: queries are multiplied, after RoPE,
//! by `1 + beta * ln(1 + floor(position / original_max_position_embeddings))`. Layers may
//! alternate full and sliding-window attention (`layer_types`).
//!
//! A Mistral 3 checkpoint nests the text config under `text_config` and the text weights under
//! `language_model.`; its vision tower and projector are dropped, as mlx-lm drops them. Its
//! text model is Ministral 3, or for other text `model_type`s (Mistral Small 3.1) mlx-lm's
//! Llama, which this file also runs (the same decoder without the temperature).
use mlx_rs::error::Exception;
use mlx_rs::ops::maximum;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::{prerotated_opts, AttnProjections};
use super::config::{default_rope_theta, default_true, parse_config, sliding_layers};
use super::decoder::{load_stack, Block, Head, NormKind, Stack, Trunk};
use super::info::{model_info_in, KvShape};
use super::layers::attend_with;
use super::mlp::GatedMlp;
use super::params::{Parameters, Params};
use super::rope::{initialize_rope, ScaledRope};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// The text-model fields both `ministral3.ModelArgs` and `llama.ModelArgs` read.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(default)]
    model_type: String,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    head_dim: Option<i32>,
    hidden_size: i32,
    max_position_embeddings: Option<usize>,
    num_key_value_heads: Option<i32>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
    // Ministral 3 only.
    rope_parameters: Option<Value>,
    // Llama only.
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

impl Config {
    fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Each layer's sliding window (`None`: full attention), from `layer_types`.
    fn windows(&self) -> Result<Vec<Option<usize>>, LoadError> {
        let Some(types) = &self.layer_types else {
            return Ok(vec![None; self.num_hidden_layers]);
        };
        let sliding = sliding_layers("Ministral 3", types, self.num_hidden_layers)?;
        // mlx-lm builds the full-attention mask from the first full layer: there must be one.
        if sliding.iter().all(|&s| s) {
            return Err(LoadError::Config(
                "layer_types has no full_attention layer".into(),
            ));
        }
        let window = || {
            self.sliding_window.filter(|&w| w > 0).ok_or_else(|| {
                LoadError::Config(
                    "layer_types has sliding_attention layers but no sliding_window".into(),
                )
            })
        };
        sliding
            .into_iter()
            .map(|s| if s { window().map(Some) } else { Ok(None) })
            .collect()
    }
}

/// Llama 4's attention temperature (`llama_4_scaling_beta`, `original_max_position_embeddings`
/// of `rope_parameters`).
#[derive(Debug, Clone, Copy)]
struct Temperature {
    beta: f32,
    original_max: i32,
}

impl Temperature {
    /// `1 + beta * ln(1 + floor(position / original_max))` for the `len` new positions of each
    /// row starting at `offsets` (one offset: `[len, 1]`; one per row: `[B, 1, len, 1]`), in
    /// float32 as mlx-lm computes it, then cast to `dtype`.
    ///
    /// Positions below zero (the left padding of a batched prefill, whose rows start at a
    /// negative offset) count as zero: their outputs are never used, but `ln(0)` would make
    /// them NaN, and a NaN key or value poisons every query that masks it out (a zero weight
    /// times NaN is NaN).
    fn scales(&self, offsets: &[i32], len: i32, dtype: mlx_rs::Dtype) -> Result<Array, Exception> {
        let steps = Array::arange::<_, i32>(None, len, None)?;
        let positions = match offsets {
            [one] => steps.add(Array::from_int(*one))?,
            rows => steps
                .reshape(&[1, len])?
                .add(Array::from_slice(rows, &[rows.len() as i32, 1]))?,
        };
        let positions = maximum(&positions, Array::from_int(0))?;
        let one = Array::from_f32(1.0);
        let scaling = one.add(
            Array::from_f32(self.beta).multiply(
                one.add(
                    positions
                        .divide(Array::from_int(self.original_max))?
                        .floor()?,
                )?
                .log()?,
            )?,
        )?;
        let shape: &[i32] = match offsets {
            [_] => &[len, 1],
            rows => &[rows.len() as i32, 1, len, 1],
        };
        scaling.reshape(shape)?.as_dtype(dtype)
    }
}

/// The rotary positions the next tokens take in each row of `cache` (one value when every row
/// agrees, as the cache's own rotary embedding does).
fn row_offsets(cache: &LayerCache) -> Vec<i32> {
    match cache {
        LayerCache::Dense(c) => vec![c.offset() as i32],
        LayerCache::Batched(c) => {
            let rows: Vec<i32> = (0..c.rows()).map(|r| c.row_len(r) as i32).collect();
            match rows.first() {
                Some(&first) if rows.iter().all(|&r| r == first) => vec![first],
                _ => rows,
            }
        }
        // Never asked: every Ministral 3 layer attends.
        LayerCache::State(c) => (0..c.rows()).map(|r| c.row_len(r) as i32).collect(),
    }
}

/// The attention of one layer: RoPE (after YaRN's prescaling) applied here, then queries
/// multiplied by the pass's temperature, then attention within the layer's window.
struct TemperedAttention {
    proj: AttnProjections,
    rope: ScaledRope,
    scale: f32,
    window: Option<usize>,
}

impl TemperedAttention {
    fn forward(
        &self,
        x: &Array,
        temperature: Option<&Array>,
        cache: &mut LayerCache,
    ) -> Result<Array, Exception> {
        let (q, k, v) = self.proj.project(x)?;
        let mut q = self.rope.apply(cache, &q)?;
        let k = self.rope.apply(cache, &k)?;
        if let Some(t) = temperature {
            q = q.multiply(t)?;
        }
        let opts = prerotated_opts(self.scale, self.window);
        self.proj
            .o_proj
            .forward(&attend_with(&q, &k, &v, &opts, cache)?)
    }
}

impl Parameters for TemperedAttention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj);
    }
}

/// The decoder with its own loop: the temperature depends on the pass's positions, computed
/// once and shared by every layer (as mlx-lm computes it from the first layer's cache).
pub struct Ministral3 {
    trunk: Trunk,
    layers: Vec<Block<TemperedAttention, GatedMlp>>,
    temperature: Option<Temperature>,
    info: ModelInfo,
}

/// Which mlx-lm model runs the text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TextModel {
    Ministral3,
    Llama,
}

/// `Ministral3ForCausalLM`: a text-only checkpoint, weights under `model.` and `lm_head`.
pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Ministral 3", config)?;
    build_text(config, &c, TextModel::Ministral3, "", w)
}

/// `Mistral3ForConditionalGeneration`: the text model of a vision-language checkpoint.
pub fn build_conditional(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let mut text = config
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| LoadError::Config("Mistral 3 config has no text_config".into()))?;
    // Mistral 3 unties the head unless the text config says otherwise.
    if text.get("tie_word_embeddings").is_none() {
        text["tie_word_embeddings"] = Value::Bool(false);
    }
    let c: Config = parse_config("Mistral 3 text", &text)?;
    let kind = match c.model_type.as_str() {
        "ministral3" => TextModel::Ministral3,
        "mistral4" => {
            return Err(LoadError::Config(
                "Mistral 3 with a mistral4 text model is not supported".into(),
            ))
        }
        _ => TextModel::Llama,
    };
    nest_language_model(w);
    // The architecture, end-of-sequence ids and quantization stay those of the outer config.
    let mut merged = text;
    merged["architectures"] = config["architectures"].clone();
    if let Some(eos) = config.get("eos_token_id") {
        merged["eos_token_id"] = eos.clone();
    }
    build_text(&merged, &c, kind, "language_model.", w)
}

/// mlx-lm's `mistral3` sanitize: drops the vision tower and projector, and names every text
/// weight `language_model.…` whichever of the Hugging Face layouts it came in.
fn nest_language_model(w: &mut Weights) {
    w.nest_language_model(|name| {
        name.contains("vision_tower") || name.contains("multi_modal_projector")
    });
}

/// The text model's own sanitize: precomputed rotary frequencies and a tied head's copy go,
/// FP8 activation scales go (Ministral 3); FP8 weight scales are refused.
fn sanitize_text(
    w: &mut Weights,
    prefix: &str,
    kind: TextModel,
    tied: bool,
) -> Result<(), LoadError> {
    for name in w.names() {
        if name.contains("self_attn.rotary_emb.inv_freq") {
            w.discard(&name);
        } else if kind == TextModel::Ministral3 && name.contains("weight_scale_inv") {
            return Err(LoadError::Config(format!(
                "{name}: FP8 checkpoints are not supported; convert with mlx-lm first"
            )));
        } else if kind == TextModel::Ministral3 && name.contains("activation_scale") {
            w.discard(&name);
        }
    }
    if tied {
        w.discard(&format!("{prefix}lm_head.weight"));
    }
    Ok(())
}

/// The rotary embedding and the attention temperature of the text model.
fn positional(c: &Config, kind: TextModel) -> Result<(ScaledRope, Option<Temperature>), LoadError> {
    let head_dim = c.head_dim();
    match kind {
        TextModel::Llama => Ok((
            initialize_rope(
                head_dim,
                c.rope_theta,
                c.rope_traditional,
                c.rope_scaling.as_ref(),
            )?,
            None,
        )),
        TextModel::Ministral3 => {
            let params = c
                .rope_parameters
                .as_ref()
                .filter(|p| p.is_object())
                .ok_or_else(|| {
                    LoadError::Config("Ministral 3 config has no rope_parameters".into())
                })?;
            let number = |key: &str| {
                params.get(key).and_then(Value::as_f64).ok_or_else(|| {
                    LoadError::Config(format!("Ministral 3 rope_parameters has no numeric {key}"))
                })
            };
            let theta = number("rope_theta")? as f32;
            let temperature = Temperature {
                beta: number("llama_4_scaling_beta")? as f32,
                original_max: number("original_max_position_embeddings")? as i32,
            };
            if temperature.original_max <= 0 {
                return Err(LoadError::Config(
                    "Ministral 3 original_max_position_embeddings must be positive".into(),
                ));
            }
            let rope = initialize_rope(head_dim, theta, false, Some(params))?;
            Ok((rope, Some(temperature)))
        }
    }
}

fn build_text(
    config: &Value,
    c: &Config,
    kind: TextModel,
    prefix: &str,
    w: &mut Weights,
) -> Result<Box<dyn CausalLm>, LoadError> {
    if c.num_attention_heads <= 0 {
        return Err(LoadError::Config(
            "num_attention_heads must be positive".into(),
        ));
    }
    let windows = c.windows()?;
    let (rope, temperature) = positional(c, kind)?;
    sanitize_text(w, prefix, kind, c.tie_word_embeddings)?;
    let head_dim = c.head_dim();
    let (attention_bias, mlp_bias) = match kind {
        TextModel::Llama => (c.attention_bias, c.mlp_bias),
        TextModel::Ministral3 => (false, false),
    };
    // A tied head's copy is gone with the sanitize above; anything left would be unused.
    let head = if c.tie_word_embeddings {
        Head::TiedStrict
    } else {
        Head::Own
    };
    let stack = Stack {
        prefix,
        ..Stack::pre_norm(
            c.num_hidden_layers,
            NormKind::Rms {
                eps: c.rms_norm_eps,
            },
            head,
        )
    };
    let (trunk, layers) = load_stack(
        w,
        &stack,
        |w, i, p| {
            Ok(TemperedAttention {
                proj: AttnProjections::load(
                    w,
                    &format!("{p}.self_attn"),
                    c.num_attention_heads,
                    c.kv_heads(),
                    attention_bias,
                    attention_bias,
                )?,
                rope: rope.clone(),
                scale: (head_dim as f32).powf(-0.5),
                window: windows[i],
            })
        },
        |w, _, p| GatedMlp::load(w, &format!("{p}.mlp"), mlp_bias),
    )?;
    let mut info = model_info_in(
        config,
        c.vocab_size,
        c.max_position_embeddings.unwrap_or(4096),
        KvShape::heads(c.num_hidden_layers, c.kv_heads(), head_dim),
        trunk.activation_dtype(),
    );
    let mut p = Params::default();
    trunk.push_params_around(&layers, &mut p);
    info.weight_bytes = p.materialize(w.reporter())?;
    Ok(Box::new(Ministral3 {
        trunk,
        layers,
        temperature,
        info,
    }))
}

impl CausalLm for Ministral3 {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.trunk.embed(tokens)?;
        let temperature = match (&self.temperature, caches.first()) {
            (Some(t), Some(cache)) => {
                Some(t.scales(&row_offsets(cache), tokens.shape()[1], h.dtype())?)
            }
            _ => None,
        };
        for (b, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = b.forward_with(&h, cache, |attn, x, cache| {
                attn.forward(x, temperature.as_ref(), cache)
            })?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        self.trunk.logits(hidden)
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers.iter().map(|b| b.attn.window).collect()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
