//! SmolLM3: the Llama decoder in which some layers use no positional embedding at all (NoPE):
//! `no_rope_layers[i]` is 1 where layer `i` applies RoPE and 0 where it does not; without the
//! list, every `no_rope_layer_interval`-th layer (the 4th, 8th, …) is a NoPE layer.
use serde::Deserialize;
use serde_json::Value;

use super::attention::{QkNorm, Reach};
use super::config::parse_config;
use super::llama;
use super::mlp::GatedMlp;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "SmolLM3";

/// The fields of config.json that mlx-lm's `smollm3.ModelArgs` (Llama's plus the NoPE layout)
/// reads.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    llama: llama::Config,
    layer_types: Option<Vec<String>>,
    #[serde(default = "default_no_rope_interval")]
    no_rope_layer_interval: usize,
    no_rope_layers: Option<Vec<u8>>,
}

fn default_no_rope_interval() -> usize {
    4
}

impl Config {
    /// Whether each layer applies RoPE, from the explicit list or the interval.
    fn rope_layers(&self) -> Result<Vec<bool>, LoadError> {
        match &self.no_rope_layers {
            Some(list) if list.len() != self.llama.num_hidden_layers => {
                Err(LoadError::Config(format!(
                    "no_rope_layers has {} entries for {} layers",
                    list.len(),
                    self.llama.num_hidden_layers
                )))
            }
            Some(list) => Ok(list.iter().map(|&use_rope| use_rope != 0).collect()),
            None if self.no_rope_layer_interval == 0 => Err(LoadError::Config(
                "no_rope_layer_interval must be positive".into(),
            )),
            None => Ok((0..self.llama.num_hidden_layers)
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

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    c.check_full_attention()?;
    let l = &c.llama;
    let mut shaped = l.shaped(config, l.attention_bias, QkNorm::None)?;
    let reach = c.rope_layers()?.into_iter().map(|rotary| {
        if rotary {
            Reach::GlobalRope
        } else {
            Reach::GlobalNoPe
        }
    });
    shaped.reach = Some(reach.collect());
    shaped.build(w, |w, _, p| {
        GatedMlp::load(w, &format!("{p}.mlp"), l.mlp_bias)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Config {
        let mut base = serde_json::json!({
            "model_type": "smollm3", "hidden_size": 64, "num_hidden_layers": 8,
            "intermediate_size": 128, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
            "vocab_size": 10,
        });
        if let (Some(base), Some(extra)) = (base.as_object_mut(), extra.as_object()) {
            base.extend(extra.clone());
        }
        parse_config(FAMILY, &base).expect("config")
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
