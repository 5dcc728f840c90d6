//! Gemma 4's text decoder: `Gemma4ForCausalLM` (model_type `gemma4_text`) and the text half
//! of `Gemma4ForConditionalGeneration` (model_type `gemma4`), as mlx-lm 0.32.2's
//! `gemma4_text.py` computes it.
//!
//! Beyond Gemma 3: plain RMS norms (no `1 + weight`), values RMS-normalised without a scale,
//! attention at scale 1, wider heads on global layers (`global_head_dim`) with "proportional"
//! RoPE that rotates only part of each head, keys doubling as values on global layers
//! (`attention_k_eq_v`), a learned scalar per layer, per-layer input embeddings gated into
//! each layer (`hidden_size_per_layer_input`), a mixture-of-experts branch beside the MLP
//! (`enable_moe_block`), and the last `num_kv_shared_layers` layers reusing the keys and values
//! of the last earlier layer of their type.
//!
//! KV sharing: mlx-lm gives shared layers no cache and hands them the source layer's fetched
//! keys and values. Here every layer owns a cache (the runtime's layout) and a shared layer
//! appends the source layer's new keys and values to its own: the caches hold the same
//! positions, so attention sees the same keys, values, mask and query positions as mlx-lm's,
//! at the cost of storing the shared layers' KV twice (counted in `kv_bytes_per_token`).
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::take_along_axis;
use mlx_rs::ops::{concatenate, softmax_axis, unflatten};
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::prerotated_opts;
use super::config::{parse_config, sliding_layers};
use super::gemma2::{check_activation, complete_text_config, softcap};
use super::info::{model_info, KvShape};
use super::layers::gelu_approx;
use super::layers::{attend_with, Linear, Matrix, RmsNorm, Rope};
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::scalar::scale_by;
use super::switch::{top_k_tail, weighted_sum, SwitchActivation, SwitchGlu};
use super::{CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

/// mlx-lm's `gemma4_text.ModelArgs`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
struct Config {
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i32,
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::intermediate_size")]
    intermediate_size: i32,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::head_dim")]
    head_dim: i32,
    /// Head width of global layers; `None` or 0: `head_dim`.
    #[serde(default = "defaults::global_head_dim")]
    global_head_dim: Option<i32>,
    #[serde(default = "defaults::rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::vocab_size")]
    vocab_size_per_layer_input: usize,
    #[serde(default = "defaults::num_key_value_heads")]
    num_key_value_heads: i32,
    num_global_key_value_heads: Option<i32>,
    #[serde(default = "defaults::num_kv_shared_layers")]
    num_kv_shared_layers: usize,
    /// Width of each layer's slice of the per-layer input embedding; `None` or 0: none.
    #[serde(default = "defaults::hidden_size_per_layer_input")]
    hidden_size_per_layer_input: Option<i32>,
    #[serde(default)]
    rope_traditional: bool,
    rope_parameters: Option<Value>,
    #[serde(default = "defaults::sliding_window")]
    sliding_window: usize,
    #[serde(default = "defaults::sliding_window_pattern")]
    sliding_window_pattern: usize,
    #[serde(default = "defaults::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default)]
    attention_k_eq_v: bool,
    #[serde(default = "defaults::final_logit_softcapping")]
    final_logit_softcapping: Option<f32>,
    #[serde(default = "defaults::yes")]
    use_double_wide_mlp: bool,
    #[serde(default)]
    enable_moe_block: bool,
    num_experts: Option<i32>,
    top_k_experts: Option<i32>,
    moe_intermediate_size: Option<i32>,
    layer_types: Option<Vec<String>>,
    #[serde(default = "defaults::yes")]
    tie_word_embeddings: bool,
}

/// The defaults of mlx-lm's `gemma4_text.ModelArgs`.
mod defaults {
    pub fn hidden_size() -> i32 {
        1536
    }
    pub fn num_hidden_layers() -> usize {
        35
    }
    pub fn intermediate_size() -> i32 {
        6144
    }
    pub fn num_attention_heads() -> i32 {
        8
    }
    pub fn head_dim() -> i32 {
        256
    }
    pub fn global_head_dim() -> Option<i32> {
        Some(512)
    }
    pub fn rms_norm_eps() -> f32 {
        1e-6
    }
    pub fn vocab_size() -> usize {
        262144
    }
    pub fn num_key_value_heads() -> i32 {
        1
    }
    pub fn num_kv_shared_layers() -> usize {
        20
    }
    pub fn hidden_size_per_layer_input() -> Option<i32> {
        Some(256)
    }
    pub fn sliding_window() -> usize {
        512
    }
    pub fn sliding_window_pattern() -> usize {
        5
    }
    pub fn max_position_embeddings() -> usize {
        131072
    }
    pub fn final_logit_softcapping() -> Option<f32> {
        Some(30.0)
    }
    pub fn yes() -> bool {
        true
    }
}

/// The RoPE settings mlx-lm assumes when a config has no `rope_parameters`.
fn default_rope_parameters() -> Value {
    serde_json::json!({
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional"
        },
        "sliding_attention": {
            "partial_rotary_factor": 1.0,
            "rope_theta": 10000.0,
            "rope_type": "default"
        }
    })
}

/// What one layer is, derived from the config as mlx-lm derives it.
#[derive(Debug, Clone, Copy)]
struct LayerShape {
    sliding: bool,
    head_dim: i32,
    kv_heads: i32,
    /// Global layers with `attention_k_eq_v`: the key projection doubles as the values.
    keys_are_values: bool,
    /// For a KV-shared layer, the layer whose keys and values it reuses.
    kv_source: Option<usize>,
    /// KV-shared layers' MLPs are twice as wide with `use_double_wide_mlp`.
    mlp_width: i32,
}

impl Config {
    fn from_json(text: &Value) -> Result<Self, LoadError> {
        check_activation(text)?;
        let c: Config = parse_config("Gemma 4", text)?;
        if c.sliding_window_pattern == 0 {
            return Err(LoadError::Config(
                "Gemma 4: sliding_window_pattern must be at least 1".into(),
            ));
        }
        if c.num_kv_shared_layers > c.num_hidden_layers {
            return Err(LoadError::Config(format!(
                "Gemma 4: num_kv_shared_layers {} exceeds num_hidden_layers {}",
                c.num_kv_shared_layers, c.num_hidden_layers
            )));
        }
        Ok(c)
    }

    /// `layer_types`, or mlx-lm's default: `sliding_window_pattern - 1` sliding layers then a
    /// global one, repeated. Returns whether each layer slides.
    fn sliding_layers(&self) -> Result<Vec<bool>, LoadError> {
        let types: Vec<String> = match &self.layer_types {
            Some(t) => t.clone(),
            None => (0..self.num_hidden_layers)
                .map(|i| {
                    if (i + 1).is_multiple_of(self.sliding_window_pattern) {
                        "full_attention".to_owned()
                    } else {
                        "sliding_attention".to_owned()
                    }
                })
                .collect(),
        };
        sliding_layers("Gemma 4", &types, self.num_hidden_layers)
    }

    fn layer_shapes(&self) -> Result<Vec<LayerShape>, LoadError> {
        let sliding = self.sliding_layers()?;
        let first_shared = self.num_hidden_layers - self.num_kv_shared_layers;
        let mut shapes = Vec::with_capacity(sliding.len());
        for (i, &is_sliding) in sliding.iter().enumerate() {
            let keys_are_values = self.attention_k_eq_v && !is_sliding;
            let kv_heads = match self.num_global_key_value_heads {
                Some(n) if keys_are_values => n,
                _ => self.num_key_value_heads,
            };
            let head_dim = match self.global_head_dim {
                Some(d) if d > 0 && !is_sliding => d,
                _ => self.head_dim,
            };
            // mlx-lm's test is `i >= first_shared > 0`: with no unshared layer, none shares.
            let shared = first_shared > 0 && i >= first_shared;
            let kv_source = if shared {
                let source = (0..first_shared).rev().find(|&j| sliding[j] == is_sliding);
                Some(source.ok_or_else(|| {
                    LoadError::Config(format!(
                        "Gemma 4: KV-shared layer {i} has no earlier layer of its type"
                    ))
                })?)
            } else {
                None
            };
            let double = self.use_double_wide_mlp && shared;
            shapes.push(LayerShape {
                sliding: is_sliding,
                head_dim,
                kv_heads,
                keys_are_values,
                kv_source,
                mlp_width: self.intermediate_size * if double { 2 } else { 1 },
            });
        }
        Ok(shapes)
    }

    fn per_layer_input_width(&self) -> Option<i32> {
        self.hidden_size_per_layer_input.filter(|&w| w > 0)
    }
}

/// One layer type's rotary embedding from its `rope_parameters` entry, as mlx-lm's
/// `initialize_rope` builds it for Gemma 4 (default, linear or proportional).
fn rope_for(params: &Value, dims: i32, traditional: bool) -> Result<Rope, LoadError> {
    let number = |key: &str| params.get(key).and_then(Value::as_f64);
    let base = number("rope_theta").unwrap_or(10000.0);
    let kind = params
        .get("type")
        .or_else(|| params.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let plain = |scale: f32| Rope {
        dims,
        traditional,
        base: base as f32,
        scale,
        freqs: None,
    };
    match kind {
        "default" => Ok(plain(1.0)),
        "linear" => {
            let factor = number("factor").ok_or_else(|| {
                LoadError::Config("Gemma 4: linear rope_parameters without a factor".into())
            })?;
            Ok(plain((1.0 / factor) as f32))
        }
        "proportional" => {
            let rotated = (f64::from(dims) * number("partial_rotary_factor").unwrap_or(1.0)) as i32;
            if rotated > dims {
                return Err(LoadError::Config(format!(
                    "Gemma 4: partial rotation of {rotated} dimensions exceeds {dims}"
                )));
            }
            let freqs = proportional_freqs(dims, rotated, base, number("factor").unwrap_or(1.0))?;
            mlx_rs::transforms::eval([&freqs])?;
            Ok(Rope {
                freqs: Some(freqs),
                ..plain(1.0)
            })
        }
        other => Err(LoadError::Config(format!(
            "Gemma 4: unsupported rope type {other:?}"
        ))),
    }
}

/// mlx-lm's `ProportionalRoPE` periods: the first `rotated` dimensions at
/// `factor * base^(2i / dims)`, the rest infinite (not rotated), in float32 MLX ops.
fn proportional_freqs(dims: i32, rotated: i32, base: f64, factor: f64) -> Result<Array, Exception> {
    let exponents = Array::arange::<_, f32>(0, rotated, 2)?.divide(Array::from_f32(dims as f32))?;
    let periods =
        Array::from_f32(factor as f32).multiply(Array::from_f32(base as f32).power(&exponents)?)?;
    let still = Array::full::<f32>(&[(dims - rotated) / 2], Array::from_f32(f32::INFINITY))?;
    concatenate(&[periods, still], 0)
}

/// The router of the mixture-of-experts branch: RMS-normalised input (scaled by
/// `scale / sqrt(hidden)`), logits, softmax over the top k, times a learned per-expert scale.
struct Router {
    /// `scale * hidden_size^-0.5`, computed once as mlx-lm computes it per call.
    norm_scale: Array,
    eps: f32,
    proj: Linear,
    per_expert_scale: Array,
    top_k: i32,
}

impl Router {
    fn forward(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let x = mlx_rs::fast::rms_norm(x, Some(&self.norm_scale), self.eps)?;
        let scores = self.proj.forward(&x)?;
        let indices = top_k_tail(&scores, self.top_k)?;
        let weights = softmax_axis(&take_along_axis(&scores, &indices, -1)?, -1, false)?;
        let weights = weights.multiply(self.per_expert_scale.take_axis(&indices, 0)?)?;
        Ok((indices, weights))
    }
}

/// The mixture-of-experts branch beside the dense MLP, with its own norms.
struct MoeBranch {
    router: Router,
    experts: SwitchGlu,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_1: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
}

/// The per-layer input gate: `norm(projection(gelu_approx(gate(h)) * input))` added to `h`.
struct PerLayerGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

/// The model-level half of the per-layer inputs: a token embedding of every layer's slice,
/// and a projection of the scaled embedding mixed into it.
struct PerLayerInputs {
    embed: Matrix,
    projection: Linear,
    norm: RmsNorm,
    width: i32,
}

struct Layer {
    shape: LayerShape,
    q_proj: Linear,
    /// `None` on KV-shared layers.
    k_proj: Option<Linear>,
    /// `None` on KV-shared layers and where keys double as values.
    v_proj: Option<Linear>,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: Option<RmsNorm>,
    mlp: GatedMlp,
    moe: Option<MoeBranch>,
    per_layer: Option<PerLayerGate>,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: Array,
}

pub struct Gemma4 {
    embed_tokens: Matrix,
    per_layer_inputs: Option<PerLayerInputs>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    /// `[sliding, global]`.
    ropes: [Rope; 2],
    heads: i32,
    window: usize,
    eps: f32,
    hidden_size: i32,
    final_softcap: Option<f32>,
    /// Per layer, whether a later KV-shared layer reuses its new keys and values.
    is_kv_source: Vec<bool>,
    info: ModelInfo,
}

/// `Gemma4ForCausalLM`.
pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = Config::from_json(config)?;
    sanitize_text(&c, w);
    build_text(config, &c, w, "")
}

/// `Gemma4ForConditionalGeneration`: the text model of a multimodal checkpoint, configured by
/// its `text_config` (with mlx-lm's `gemma4.ModelArgs` overrides), the other towers dropped.
pub fn build_conditional(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let mut text = config
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    complete_text_config(config, &mut text, 262_144, 1);
    let c = Config::from_json(&text)?;
    sanitize_multimodal(w);
    sanitize_text(&c, w);
    build_text(config, &c, w, "language_model.")
}

/// mlx-lm's `gemma4.Model.sanitize`: a Hugging Face checkpoint's `model.language_model.*`
/// becomes `language_model.model.*`, and the vision and audio towers are dropped.
fn sanitize_multimodal(w: &mut Weights) {
    const DROPPED: [&str; 6] = [
        "vision_tower",
        "multi_modal_projector",
        "audio_tower",
        "embed_audio",
        "embed_vision",
        "vision_embedder",
    ];
    for name in w.names() {
        let Some(rest) = name.strip_prefix("model.") else {
            continue;
        };
        if DROPPED.iter().any(|d| rest.starts_with(d)) {
            w.discard(&name);
            continue;
        }
        let renamed = match rest.strip_prefix("language_model.") {
            Some(inner) => format!("language_model.model.{inner}"),
            None => rest.to_owned(),
        };
        if let Some(a) = w.remove_raw(&name) {
            w.insert(renamed, a);
        }
    }
}

/// mlx-lm's `gemma4_text.Model.sanitize`: rotary tables and activation-range statistics are
/// dropped, as are KV-shared layers' key/value projections; a Hugging Face expert stack
/// (`experts.gate_up_proj`, `experts.down_proj`) becomes `experts.switch_glu.*`.
fn sanitize_text(c: &Config, w: &mut Weights) {
    const DROPPED: [&str; 5] = [
        "self_attn.rotary_emb",
        "input_max",
        "input_min",
        "output_max",
        "output_min",
    ];
    let first_shared = c.num_hidden_layers - c.num_kv_shared_layers;
    for name in w.names() {
        if DROPPED.iter().any(|d| name.contains(d)) {
            w.discard(&name);
            continue;
        }
        let kv_part = [
            ".self_attn.k_proj",
            ".self_attn.v_proj",
            ".self_attn.k_norm",
        ]
        .iter()
        .any(|p| name.contains(p));
        if kv_part && layer_index(&name).is_some_and(|i| i >= first_shared) {
            w.discard(&name);
            continue;
        }
        if let Some(base) = name.strip_suffix(".experts.gate_up_proj") {
            if let Some(Ok(halves)) = w.remove_raw(&name).map(|a| a.split_equal(2, -2)) {
                let mut halves = halves.into_iter();
                if let (Some(gate), Some(up)) = (halves.next(), halves.next()) {
                    w.insert(format!("{base}.experts.switch_glu.gate_proj.weight"), gate);
                    w.insert(format!("{base}.experts.switch_glu.up_proj.weight"), up);
                }
            }
        } else if let Some(base) = name.strip_suffix(".experts.down_proj") {
            if let Some(a) = w.remove_raw(&name) {
                w.insert(format!("{base}.experts.switch_glu.down_proj.weight"), a);
            }
        }
    }
}

/// The `N` of `...layers.N....`.
fn layer_index(name: &str) -> Option<usize> {
    let rest = name.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

fn build_text(
    config: &Value,
    c: &Config,
    w: &mut Weights,
    prefix: &str,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let shapes = c.layer_shapes()?;
    let eps = c.rms_norm_eps;
    let m = format!("{prefix}model");
    let mut layers = Vec::with_capacity(shapes.len());
    for (i, shape) in shapes.iter().enumerate() {
        layers.push(load_layer(c, w, &format!("{m}.layers.{i}"), *shape)?);
    }
    let embed_tokens = Matrix::load(w, &format!("{m}.embed_tokens"))?;
    let per_layer_inputs = match c.per_layer_input_width() {
        Some(width) => Some(PerLayerInputs {
            embed: matrix_with_rows(
                Matrix::load(w, &format!("{m}.embed_tokens_per_layer"))?,
                c.vocab_size_per_layer_input as i32,
                &m,
            )?,
            projection: Linear::load(w, &format!("{m}.per_layer_model_projection"), false)?,
            norm: RmsNorm::load(w, &format!("{m}.per_layer_projection_norm"), eps)?,
            width,
        }),
        None => None,
    };
    let norm = RmsNorm::load(w, &format!("{m}.norm"), eps)?;
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(Matrix::load(w, &format!("{prefix}lm_head"))?)
    };
    let rope_parameters = c
        .rope_parameters
        .clone()
        .unwrap_or_else(default_rope_parameters);
    let empty = serde_json::json!({});
    let params = |key: &str| rope_parameters.get(key).unwrap_or(&empty).clone();
    let global_dim = shapes
        .iter()
        .find(|s| !s.sliding)
        .map_or(c.head_dim, |s| s.head_dim);
    let ropes = [
        rope_for(&params("sliding_attention"), c.head_dim, c.rope_traditional)?,
        rope_for(&params("full_attention"), global_dim, c.rope_traditional)?,
    ];
    let mut is_kv_source = vec![false; shapes.len()];
    for s in &shapes {
        if let Some(j) = s.kv_source {
            is_kv_source[j] = true;
        }
    }
    let info = model_info(
        config,
        c.vocab_size,
        c.max_position_embeddings,
        KvShape::per_layer(shapes.iter().map(|s| (s.kv_heads, s.head_dim))),
        &embed_tokens,
    );
    let mut model = Gemma4 {
        embed_tokens,
        per_layer_inputs,
        layers,
        norm,
        lm_head,
        ropes,
        heads: c.num_attention_heads,
        window: c.sliding_window,
        eps,
        hidden_size: c.hidden_size,
        final_softcap: c.final_logit_softcapping,
        is_kv_source,
        info,
    };
    model.info.weight_bytes = Params::default().add(&model).materialize(w.reporter())?;
    Ok(Box::new(model))
}

fn load_layer(c: &Config, w: &mut Weights, p: &str, shape: LayerShape) -> Result<Layer, LoadError> {
    let eps = c.rms_norm_eps;
    let linear = |w: &mut Weights, name: &str| Linear::load(w, &format!("{p}.{name}"), false);
    let norm = |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), eps);
    let owns_kv = shape.kv_source.is_none();
    let moe = if c.enable_moe_block {
        Some(load_moe(c, w, p)?)
    } else {
        None
    };
    let per_layer = match c.per_layer_input_width() {
        Some(_) => Some(PerLayerGate {
            gate: linear(w, "per_layer_input_gate")?,
            projection: linear(w, "per_layer_projection")?,
            norm: norm(w, "post_per_layer_input_norm")?,
        }),
        None => None,
    };
    Ok(Layer {
        shape,
        q_proj: linear(w, "self_attn.q_proj")?,
        k_proj: owns_kv.then(|| linear(w, "self_attn.k_proj")).transpose()?,
        v_proj: (owns_kv && !shape.keys_are_values)
            .then(|| linear(w, "self_attn.v_proj"))
            .transpose()?,
        o_proj: linear(w, "self_attn.o_proj")?,
        q_norm: norm(w, "self_attn.q_norm")?,
        k_norm: owns_kv.then(|| norm(w, "self_attn.k_norm")).transpose()?,
        mlp: GatedMlp::new(
            [
                with_rows(linear(w, "mlp.gate_proj")?, shape.mlp_width, p)?,
                with_rows(linear(w, "mlp.up_proj")?, shape.mlp_width, p)?,
                linear(w, "mlp.down_proj")?,
            ],
            SwitchActivation::GeluGlu,
        )?,
        moe,
        per_layer,
        input_layernorm: norm(w, "input_layernorm")?,
        post_attention_layernorm: norm(w, "post_attention_layernorm")?,
        pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
        post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
        layer_scalar: w.take(&format!("{p}.layer_scalar"))?,
    })
}

fn load_moe(c: &Config, w: &mut Weights, p: &str) -> Result<MoeBranch, LoadError> {
    let (Some(_), Some(top_k), Some(_)) = (c.num_experts, c.top_k_experts, c.moe_intermediate_size)
    else {
        return Err(LoadError::Config(
            "Gemma 4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
                .into(),
        ));
    };
    let scale = w.take(&format!("{p}.router.scale"))?;
    let root = (1.0 / f64::from(c.hidden_size).sqrt()) as f32;
    let norm_scale = scale_by(&scale, root)?;
    let norm =
        |w: &mut Weights, name: &str| RmsNorm::load(w, &format!("{p}.{name}"), c.rms_norm_eps);
    Ok(MoeBranch {
        router: Router {
            norm_scale,
            eps: c.rms_norm_eps,
            proj: Linear::load(w, &format!("{p}.router.proj"), false)?,
            per_expert_scale: w.take(&format!("{p}.router.per_expert_scale"))?,
            top_k,
        },
        experts: SwitchGlu::load(
            w,
            &format!("{p}.experts.switch_glu"),
            false,
            SwitchActivation::GeluGlu,
        )?,
        pre_feedforward_layernorm_2: norm(w, "pre_feedforward_layernorm_2")?,
        post_feedforward_layernorm_1: norm(w, "post_feedforward_layernorm_1")?,
        post_feedforward_layernorm_2: norm(w, "post_feedforward_layernorm_2")?,
    })
}

/// `m` unchanged if it has `rows` output rows (packed or not, a matrix keeps its rows);
/// otherwise a shape error, as mlx-lm's strict load gives (double-wide MLPs of KV-shared
/// layers, the per-layer embedding's vocabulary).
fn matrix_with_rows(m: Matrix, rows: i32, at: &str) -> Result<Matrix, LoadError> {
    match m.weight().shape().first() {
        Some(&r) if r == rows => Ok(m),
        _ => Err(LoadError::Shape {
            name: format!("{at} (rows)"),
            found: m.weight().shape().to_vec(),
            expected: vec![rows, -1],
        }),
    }
}

fn with_rows(l: Linear, rows: i32, at: &str) -> Result<Linear, LoadError> {
    Ok(Linear::new(
        matrix_with_rows(l.matrix.into_inner(), rows, at)?,
        l.bias,
        l.lora,
    ))
}

/// `[B, L, heads * d]` → `[B, L, heads, d]`.
fn heads_last(x: &Array, heads: i32, d: i32) -> Result<Array, Exception> {
    let s = x.shape();
    x.reshape(&[s[0], s[1], heads, d])
}

impl Parameters for Gemma4 {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.embed_tokens);
        if let Some(inputs) = &self.per_layer_inputs {
            p.add(&inputs.embed)
                .add(&inputs.projection)
                .add(&inputs.norm);
        }
        for l in &self.layers {
            p.add(&l.q_proj)
                .add(&l.k_proj)
                .add(&l.v_proj)
                .add(&l.o_proj)
                .add(&l.mlp)
                .add(&l.q_norm)
                .add(&l.input_layernorm)
                .add(&l.post_attention_layernorm)
                .add(&l.pre_feedforward_layernorm)
                .add(&l.post_feedforward_layernorm)
                .add(&l.k_norm);
            if let Some(m) = &l.moe {
                p.add(&m.router.norm_scale)
                    .add(&m.router.proj)
                    .add(&m.router.per_expert_scale)
                    .add(&m.experts)
                    .add(&m.pre_feedforward_layernorm_2)
                    .add(&m.post_feedforward_layernorm_1)
                    .add(&m.post_feedforward_layernorm_2);
            }
            if let Some(g) = &l.per_layer {
                p.add(&g.gate).add(&g.projection).add(&g.norm);
            }
            p.add(&l.layer_scalar);
        }
        p.add(&self.norm).add(&self.lm_head);
    }
}

impl Gemma4 {
    /// Each layer's per-layer input `[B, L, width]`: its slice of the per-layer embedding of
    /// `tokens`, mixed with a projection of the scaled embedding `h`.
    fn per_layer_inputs(&self, tokens: &Array, h: &Array) -> Result<Vec<Option<Array>>, Exception> {
        let Some(p) = &self.per_layer_inputs else {
            return Ok(vec![None; self.layers.len()]);
        };
        let n = self.layers.len() as i32;
        let split = |x: Array| unflatten(x, -1, &[n, p.width]);
        let embedded = p.embed.rows(tokens)?;
        let embedded = split(scale_by(&embedded, (f64::from(p.width)).sqrt() as f32)?)?;
        let projected = p.projection.forward(h)?;
        let root = (1.0 / f64::from(self.hidden_size).sqrt()) as f32;
        let projected = split(scale_by(&projected, root)?)?;
        let projected = p.norm.forward(&projected)?;
        let mixed = projected.add(&embedded)?;
        let mixed = scale_by(&mixed, std::f32::consts::FRAC_1_SQRT_2)?;
        (0..n)
            .map(|i| mixed.take_axis(Array::from_int(i), 2).map(Some))
            .collect()
    }

    /// One layer's attention. Returns its output and, for a layer that owns its KV, the new
    /// keys (normed, rotated) and values (normed) that KV-shared layers reuse.
    fn attention(
        &self,
        l: &Layer,
        x: &Array,
        shared: Option<&(Array, Array)>,
        cache: &mut LayerCache,
    ) -> Result<(Array, Option<(Array, Array)>), Exception> {
        let s = l.shape;
        let rope = &self.ropes[usize::from(!s.sliding)];
        let q = l
            .q_norm
            .forward(&heads_last(&l.q_proj.forward(x)?, self.heads, s.head_dim)?)?;
        let (k, v, own) = match (shared, &l.k_proj, &l.k_norm) {
            (Some((k, v)), _, _) => (k.clone(), v.clone(), false),
            (None, Some(k_proj), Some(k_norm)) => {
                let raw_k = heads_last(&k_proj.forward(x)?, s.kv_heads, s.head_dim)?;
                let raw_v = match &l.v_proj {
                    Some(v_proj) => heads_last(&v_proj.forward(x)?, s.kv_heads, s.head_dim)?,
                    None => raw_k.clone(),
                };
                let k = k_norm.forward(&raw_k)?.transpose_axes(&[0, 2, 1, 3])?;
                let k = cache.rope(rope, &k)?;
                let v = mlx_rs::fast::rms_norm(&raw_v, None, self.eps)?
                    .transpose_axes(&[0, 2, 1, 3])?;
                (k, v, true)
            }
            _ => {
                return Err(Exception::custom(
                    "Gemma 4: a KV-shared layer ran without its source layer's keys",
                ))
            }
        };
        let q = cache.rope(rope, &q.transpose_axes(&[0, 2, 1, 3])?)?;
        let opts = prerotated_opts(1.0, s.sliding.then_some(self.window));
        let out = l.o_proj.forward(&attend_with(&q, &k, &v, &opts, cache)?)?;
        Ok((out, own.then_some((k, v))))
    }

    fn feed_forward(&self, l: &Layer, h: &Array) -> Result<Array, Exception> {
        let dense = l.mlp.forward(&l.pre_feedforward_layernorm.forward(h)?)?;
        let Some(m) = &l.moe else {
            return Ok(dense);
        };
        let dense = m.post_feedforward_layernorm_1.forward(&dense)?;
        let (indices, weights) = m.router.forward(h)?;
        let routed = m
            .experts
            .forward(&m.pre_feedforward_layernorm_2.forward(h)?, &indices)?;
        let routed = m
            .post_feedforward_layernorm_2
            .forward(&weighted_sum(&routed, &weights)?)?;
        dense.add(&routed)
    }
}

impl CausalLm for Gemma4 {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let h = self.embed_tokens.rows(tokens)?;
        let root = (f64::from(self.hidden_size)).sqrt() as f32;
        let mut h = scale_by(&h, root)?;
        let per_layer = self.per_layer_inputs(tokens, &h)?;
        let mut kv: Vec<Option<(Array, Array)>> = vec![None; self.layers.len()];
        for (i, ((l, cache), input)) in self
            .layers
            .iter()
            .zip(caches.iter_mut())
            .zip(per_layer)
            .enumerate()
        {
            let shared = l.shape.kv_source.and_then(|j| kv[j].as_ref());
            let (r, new_kv) = self.attention(l, &l.input_layernorm.forward(&h)?, shared, cache)?;
            if self.is_kv_source[i] {
                kv[i] = new_kv;
            }
            let mid = h.add(&l.post_attention_layernorm.forward(&r)?)?;
            let r = self.feed_forward(l, &mid)?;
            h = mid.add(&l.post_feedforward_layernorm.forward(&r)?)?;
            if let (Some(g), Some(input)) = (&l.per_layer, input) {
                let gate = gelu_approx(&g.gate.forward(&h)?)?.multiply(&input)?;
                h = h.add(&g.norm.forward(&g.projection.forward(&gate)?)?)?;
            }
            h = h.multiply(&l.layer_scalar)?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        let h = self.norm.forward(hidden)?;
        let logits = match &self.lm_head {
            Some(head) => head.matmul_t(&h)?,
            None => self.embed_tokens.matmul_t(&h)?,
        };
        match self.final_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    fn layer_windows(&self) -> Vec<Option<usize>> {
        self.layers
            .iter()
            .map(|l| l.shape.sliding.then_some(self.window))
            .collect()
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
