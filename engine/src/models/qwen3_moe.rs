//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head RMS-normalised queries and
//! keys) with a softmax router over the experts, optionally renormalising the top-k weights
//! (`norm_topk_prob`). Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`
//! stride, keep a dense MLP.
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttentionShape, QkNorm};
use super::config::parse_config;
use super::decoder::{Head, Stack};
use super::layers::Linear;
use super::llama::LlamaShaped;
use super::mlp::{FeedForward, GatedMlp};
use super::moe::{RoutedExperts, SoftmaxRouter};
use super::rope::{refuse_rope_scaling, ScaledRope};
use super::switch::{stack_layer_experts, top_k_tail};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen3-MoE";

/// Tensor parallelism for Qwen3-MoE (mlx-lm's `shard()`): the Llama split
/// ([`super::llama::shard_with`]) and each expert's own matrices divided the same way (gate
/// and up by column, down by row over the expert's hidden features), so every rank runs every
/// expert on its share and the block's output is a partial sum; the router stays whole.
fn shard(
    w: &mut Weights,
    attention: &mut AttentionShape,
) -> Result<Option<crate::distributed::Group>, LoadError> {
    use crate::distributed::Split;
    super::llama::shard_with(
        w,
        attention,
        &[
            ("mlp.switch_mlp.gate_proj", Split::Column),
            ("mlp.switch_mlp.up_proj", Split::Column),
            ("mlp.switch_mlp.down_proj", Split::Row),
        ],
    )
}

#[derive(Debug, Deserialize)]
struct Config {
    num_hidden_layers: usize,
    num_attention_heads: i32,
    num_experts: i32,
    num_experts_per_tok: i32,
    decoder_sparse_step: usize,
    mlp_only_layers: Vec<usize>,
    rms_norm_eps: f32,
    vocab_size: usize,
    num_key_value_heads: i32,
    head_dim: i32,
    rope_theta: f32,
    tie_word_embeddings: bool,
    max_position_embeddings: usize,
    norm_topk_prob: bool,
}

impl Config {
    /// mlx-lm's rule: a sparse block where the layer is not MLP-only and falls on the stride.
    fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// The sparse block: a softmax router whose top-k ids are `argpartition(g, -k)[..., -k:]`,
/// weights optionally renormalised over the k; the weighted sum is cast back to the experts'
/// dtype.
fn load_sparse(w: &mut Weights, c: &Config, mlp: &str) -> Result<Box<dyn FeedForward>, LoadError> {
    let router = SoftmaxRouter {
        gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
        top_k: c.num_experts_per_tok,
        select: top_k_tail,
        renormalize: c.norm_topk_prob,
    };
    Ok(Box::new(
        RoutedExperts::load(w, mlp, router, false)?.cast_back(),
    ))
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, None)
}

/// [`build`] for one stage of a pipeline over `group` (`crate::distributed::pipeline`): this
/// rank's layers only, their experts stacked as for one engine.
pub fn build_stage(
    config: &Value,
    w: &mut Weights,
    group: crate::distributed::Group,
) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, Some(group))
}

fn build_in(
    config: &Value,
    w: &mut Weights,
    pipeline: Option<crate::distributed::Group>,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    if c.decoder_sparse_step == 0 {
        return Err(LoadError::Config(format!(
            "{FAMILY}: decoder_sparse_step must be at least 1"
        )));
    }
    stack_layer_experts(
        w,
        (0..c.num_hidden_layers).filter(|&l| c.is_sparse(l)),
        c.num_experts as usize,
    )?;
    let mut shaped = LlamaShaped {
        config,
        stack: Stack::llama_like(
            c.num_hidden_layers,
            c.rms_norm_eps,
            Head::tied_if(c.tie_word_embeddings),
        ),
        attention: AttentionShape {
            qk_norm: QkNorm::PerHead,
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
            )
        },
        rope: ScaledRope::plain(c.head_dim, c.rope_theta, false),
        reach: None,
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    };
    let feed_forward = |w: &mut Weights, layer, p: &str| -> Result<Box<dyn FeedForward>, _> {
        let mlp = format!("{p}.mlp");
        if c.is_sparse(layer) {
            load_sparse(w, &c, &mlp)
        } else {
            Ok(Box::new(GatedMlp::load(w, &mlp, false)?))
        }
    };
    match pipeline {
        Some(group) => shaped.build_stage(w, group, feed_forward),
        None => {
            let group = shard(w, &mut shaped.attention)?;
            shaped.build_sharded(w, group, feed_forward)
        }
    }
}
