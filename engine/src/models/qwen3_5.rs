//! Qwen3.5's text model, as mlx-lm's `qwen3_5.py` and `qwen3_5_moe.py`: Qwen3-Next's hybrid of
//! gated delta-nets and gated attention ([`Hybrid`]) with the delta-net's input projections
//! split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), rotary settings in
//! `rope_parameters`, and either a dense SwiGLU MLP in every layer or (with `num_experts`) the
//! sparse block with a shared expert in every layer.
//!
//! The checkpoints are the multimodal model's (`Qwen3_5ForConditionalGeneration`, the text
//! settings in `text_config`); as mlx-lm, the vision tower is dropped and every weight lives
//! under `language_model.`. A flat config (no `text_config`) is the text settings themselves.
use serde::Deserialize;
use serde_json::Value;

use super::config::parse_config;
use super::gated_delta::{DeltaShape, ProjectionLayout};
use super::mlp::GatedMlp;
use super::qwen3_next::{
    convert_hf_layout, default_full_attention_interval, has_unconverted_conv, rotary_dims,
    sparse_block, GatedAttentionShape, Hybrid,
};
use super::rope::initialize_rope;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen3.5";

/// The text settings, with the defaults of mlx-lm's `TextModelArgs`.
#[derive(Debug, Deserialize)]
struct TextConfig {
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "defaults::rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default = "defaults::vocab_size")]
    vocab_size: usize,
    #[serde(default = "defaults::num_key_value_heads")]
    num_key_value_heads: i32,
    #[serde(default = "defaults::max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default = "defaults::linear_num_value_heads")]
    linear_num_value_heads: i32,
    #[serde(default = "defaults::linear_num_key_heads")]
    linear_num_key_heads: i32,
    #[serde(default = "defaults::linear_key_head_dim")]
    linear_key_head_dim: i32,
    #[serde(default = "defaults::linear_value_head_dim")]
    linear_value_head_dim: i32,
    #[serde(default = "defaults::linear_conv_kernel_dim")]
    linear_conv_kernel_dim: i32,
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i32,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    head_dim: Option<i32>,
    #[serde(default = "default_full_attention_interval")]
    full_attention_interval: usize,
    #[serde(default)]
    num_experts: i32,
    #[serde(default)]
    num_experts_per_tok: i32,
    #[serde(default = "defaults::norm_topk_prob")]
    norm_topk_prob: bool,
    /// Absent: mlx-lm's default parameters; `null`: the top-level fields below apply.
    #[serde(default = "defaults::rope_parameters")]
    rope_parameters: Option<Value>,
    #[serde(default = "defaults::partial_rotary_factor")]
    partial_rotary_factor: f32,
    #[serde(default = "defaults::rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_scaling: Option<Value>,
}

/// mlx-lm's `TextModelArgs` defaults.
mod defaults {
    use serde_json::{json, Value};

    pub fn num_hidden_layers() -> usize {
        32
    }
    pub fn num_attention_heads() -> i32 {
        32
    }
    pub fn rms_norm_eps() -> f32 {
        1e-6
    }
    pub fn vocab_size() -> usize {
        151_936
    }
    pub fn num_key_value_heads() -> i32 {
        8
    }
    pub fn max_position_embeddings() -> usize {
        131_072
    }
    pub fn linear_num_value_heads() -> i32 {
        64
    }
    pub fn linear_num_key_heads() -> i32 {
        16
    }
    pub fn linear_key_head_dim() -> i32 {
        192
    }
    pub fn linear_value_head_dim() -> i32 {
        128
    }
    pub fn linear_conv_kernel_dim() -> i32 {
        4
    }
    pub fn hidden_size() -> i32 {
        4096
    }
    pub fn norm_topk_prob() -> bool {
        true
    }
    pub fn partial_rotary_factor() -> f32 {
        0.25
    }
    pub fn rope_theta() -> f32 {
        100_000.0
    }
    pub fn rope_parameters() -> Option<Value> {
        Some(json!({
            "type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": 100000,
            "partial_rotary_factor": 0.25,
        }))
    }
}

impl TextConfig {
    /// mlx-lm's `__post_init__`: the head size from the hidden size when absent, and the
    /// rotary settings from a non-empty `rope_parameters` (its `rope_type` read as `type`).
    /// Returns `(head_dim, partial_rotary_factor, rope_theta, rope_scaling)`.
    fn resolve(&self) -> Result<(i32, f32, f32, Option<Value>), LoadError> {
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.num_attention_heads > 0 => self.hidden_size / self.num_attention_heads,
            None => {
                return Err(LoadError::Config(format!(
                    "{FAMILY}: num_attention_heads {} must be positive",
                    self.num_attention_heads
                )))
            }
        };
        let params = self
            .rope_parameters
            .as_ref()
            .filter(|p| p.as_object().is_some_and(|o| !o.is_empty()));
        let Some(params) = params else {
            return Ok((
                head_dim,
                self.partial_rotary_factor,
                self.rope_theta,
                self.rope_scaling.clone(),
            ));
        };
        let mut scaling = params.clone();
        if let Some(o) = scaling.as_object_mut() {
            if !o.contains_key("type") {
                if let Some(kind) = o.remove("rope_type") {
                    o.insert("type".into(), kind);
                }
            }
        }
        let number = |key: &str, default: f64| -> Result<f32, LoadError> {
            match params.get(key) {
                None | Some(Value::Null) => Ok(default as f32),
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    LoadError::Config(format!("{FAMILY}: rope_parameters.{key} is not a number"))
                }),
            }
        };
        Ok((
            head_dim,
            number("partial_rotary_factor", 0.25)?,
            number("rope_theta", 100_000.0)?,
            Some(scaling),
        ))
    }
}

/// The text settings: `text_config`, or the whole config when it has none.
fn text_config(config: &Value) -> Result<&Value, LoadError> {
    match config.get("text_config") {
        None => Ok(config),
        Some(t) if t.is_object() => Ok(t),
        Some(_) => Err(LoadError::Config(format!(
            "{FAMILY}: text_config is not an object"
        ))),
    }
}

/// mlx-lm's `Model.sanitize` (and `qwen3_5_moe`'s): the vision tower dropped, every weight
/// moved under `language_model.` (`model.language_model.` → `language_model.model.`), fused
/// expert stacks split, then a Hugging Face checkpoint converted (norms shifted only when its
/// convolutions are unconverted, as mlx-lm decides).
fn sanitize(w: &mut Weights, num_layers: usize) -> Result<(), LoadError> {
    w.nest_language_model(|name| {
        name.starts_with("vision_tower") || name.starts_with("model.visual")
    });
    for layer in 0..num_layers {
        let mlp = format!("language_model.model.layers.{layer}.mlp");
        let Some(gate_up) = w.remove_raw(&format!("{mlp}.experts.gate_up_proj")) else {
            continue;
        };
        let rows = gate_up.shape()[gate_up.ndim() - 2];
        let halves = gate_up.split_at_indices(&[rows / 2], -2)?;
        w.insert(
            format!("{mlp}.switch_mlp.gate_proj.weight"),
            halves[0].clone(),
        );
        w.insert(
            format!("{mlp}.switch_mlp.up_proj.weight"),
            halves[1].clone(),
        );
        let down = w
            .remove_raw(&format!("{mlp}.experts.down_proj"))
            .ok_or_else(|| LoadError::MissingTensors(vec![format!("{mlp}.experts.down_proj")]))?;
        w.insert(format!("{mlp}.switch_mlp.down_proj.weight"), down);
    }
    let shift_norms = has_unconverted_conv(w);
    convert_hf_layout(w, shift_norms)
}

/// `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration` and their
/// text-only `ForCausalLM` names.
pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: TextConfig = parse_config(FAMILY, text_config(config)?)?;
    let (head_dim, partial_rotary_factor, rope_theta, rope_scaling) = c.resolve()?;
    sanitize(w, c.num_hidden_layers)?;
    let rope = initialize_rope(
        rotary_dims(head_dim, partial_rotary_factor),
        rope_theta,
        false,
        rope_scaling.as_ref(),
    )?;
    let sparse = c.num_experts > 0;
    if sparse && (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts) {
        return Err(LoadError::Config(format!(
            "{FAMILY}: num_experts_per_tok {} must be between 1 and num_experts {}",
            c.num_experts_per_tok, c.num_experts
        )));
    }
    Hybrid {
        family: FAMILY,
        config,
        prefix: "language_model.",
        num_layers: c.num_hidden_layers,
        full_attention_interval: c.full_attention_interval,
        rms_norm_eps: c.rms_norm_eps,
        attention: GatedAttentionShape {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim,
            bias: c.attention_bias,
            eps: c.rms_norm_eps,
        },
        rope,
        delta: DeltaShape {
            key_heads: c.linear_num_key_heads,
            value_heads: c.linear_num_value_heads,
            key_dim: c.linear_key_head_dim,
            value_dim: c.linear_value_head_dim,
            conv_kernel: c.linear_conv_kernel_dim,
            eps: c.rms_norm_eps,
        },
        layout: ProjectionLayout::Split,
        tie_word_embeddings: c.tie_word_embeddings,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    }
    .build(w, |w, _, p| {
        let mlp = format!("{p}.mlp");
        if sparse {
            sparse_block(w, &mlp, c.num_experts_per_tok, c.norm_topk_prob)
        } else {
            Ok(Box::new(GatedMlp::load(w, &mlp, false)?))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn resolved(text: Value) -> (i32, f32, f32, Option<Value>) {
        let c: TextConfig = parse_config(FAMILY, &text).unwrap();
        c.resolve().unwrap()
    }

    #[test]
    fn rotary_settings_come_from_rope_parameters_unless_it_is_null() {
        let base = json!({"hidden_size": 64, "num_attention_heads": 4});
        let (head_dim, factor, theta, scaling) = resolved(base.clone());
        assert_eq!((head_dim, factor, theta), (16, 0.25, 100_000.0));
        assert_eq!(scaling.unwrap()["type"], "default");

        let mut given = base.clone();
        given["rope_parameters"] =
            json!({"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5});
        given["rope_theta"] = json!(1.0);
        let (_, factor, theta, scaling) = resolved(given);
        assert_eq!((factor, theta), (0.5, 5e6));
        assert_eq!(scaling.unwrap()["type"], "default");

        let mut null = base;
        null["rope_parameters"] = Value::Null;
        null["rope_theta"] = json!(1000.0);
        null["partial_rotary_factor"] = json!(1.0);
        assert_eq!(resolved(null), (16, 1.0, 1000.0, None));
    }
}
