//! Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE): Qwen2's attention (biases on q/k/v) and in
//! every layer a softmax router over the experts plus a shared expert whose output is gated by
//! `sigmoid(shared_expert_gate(x))`. As in mlx-lm, every layer is sparse and the model always
//! has its own `lm_head`.
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttentionShape;
use super::config::{floored_head_dim, parse_config};
use super::decoder::{Head, Stack};
use super::layers::Linear;
use super::llama::LlamaShaped;
use super::mlp::GatedMlp;
use super::moe::{RoutedExperts, SharedExperts, SoftmaxRouter};
use super::rope::{refuse_rope_scaling, ScaledRope};
use super::switch::{stack_experts, top_k_of_negated, HF_EXPERT_PROJECTIONS};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen2-MoE";

#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_experts_per_tok: i32,
    num_experts: usize,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: Option<i32>,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default)]
    rope_traditional: bool,
    max_position_embeddings: Option<usize>,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
}

fn one() -> usize {
    1
}

fn default_rope_theta() -> f32 {
    1_000_000.0
}

/// The sparse block: a softmax router (top-k ids as `argpartition(-g, k-1)[..., :k]`, their
/// unnormalised probabilities) plus the shared expert, gated by
/// `sigmoid(shared_expert_gate(x))`.
fn load_sparse(
    w: &mut Weights,
    mlp: &str,
    top_k: i32,
) -> Result<RoutedExperts<SoftmaxRouter>, LoadError> {
    let router = SoftmaxRouter {
        gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
        top_k,
        select: top_k_of_negated,
        renormalize: false,
    };
    let shared = SharedExperts::Gated {
        mlp: GatedMlp::load(w, &format!("{mlp}.shared_expert"), false)?,
        gate: Linear::load(w, &format!("{mlp}.shared_expert_gate"), false)?,
    };
    Ok(RoutedExperts::load(w, mlp, router, false)?.with_shared(shared))
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    // mlx-lm makes every layer sparse; a checkpoint with dense layers would not load there.
    if c.decoder_sparse_step != 1 || !c.mlp_only_layers.is_empty() {
        return Err(LoadError::Config(format!(
            "{FAMILY}: dense layers (decoder_sparse_step {}, mlp_only_layers {:?}) are not \
             supported",
            c.decoder_sparse_step, c.mlp_only_layers
        )));
    }
    for layer in 0..c.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            c.num_experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    let head_dim = floored_head_dim(c.hidden_size, c.num_attention_heads)?;
    LlamaShaped {
        config,
        stack: Stack::llama_like(c.num_hidden_layers, c.rms_norm_eps, Head::Own),
        attention: AttentionShape {
            qkv_bias: true,
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads.unwrap_or(c.num_attention_heads),
                head_dim,
                c.rms_norm_eps,
            )
        },
        rope: ScaledRope::plain(head_dim, c.rope_theta, c.rope_traditional),
        reach: None,
        head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings.unwrap_or(4096),
    }
    .build(w, |w, _, p| {
        load_sparse(w, &format!("{p}.mlp"), c.num_experts_per_tok)
    })
}
