//! OLMo 2: a Llama-shaped decoder whose norms sit after each sublayer instead of before it
//! (`post_attention_layernorm` on the attention output, `post_feedforward_layernorm` on the
//! MLP output, none on the inputs), and whose queries and keys are RMS-normalised over the
//! whole projection (all heads at once) before the heads are split.
use serde_json::Value;

use super::attention::QkNorm;
use super::config::parse_config;
use super::decoder::NormPlacement;
use super::llama::Config;
use super::mlp::GatedMlp;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    // mlx-lm's `olmo2.ModelArgs` reads the fields Llama's does.
    let c: Config = parse_config("OLMo 2", config)?;
    let mut shaped = c.shaped(config, c.attention_bias, QkNorm::Whole)?;
    shaped.stack.placement = NormPlacement::Post;
    shaped.build(w, |w, _, p| {
        GatedMlp::load(w, &format!("{p}.mlp"), c.mlp_bias)
    })
}
