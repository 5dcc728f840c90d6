//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head RMS-normalised queries and
//! keys) with a softmax router over the experts, optionally renormalising the top-k weights
//! (`norm_topk_prob`). Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`
//! stride, keep a dense MLP.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::layers::{Linear, Rope};
use super::moe_decoder::{
    self, linear_parameters, parse_config, refuse_rope_scaling, AttentionSpec, DecoderSpec,
    FeedForward, Mlp, Multipliers, QkNorm,
};
use super::switch::{
    stack_experts, top_k_tail, SwitchActivation, SwitchGlu, HF_EXPERT_PROJECTIONS,
};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Qwen3-MoE";

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

/// The sparse block: softmax router, top-k experts (ids as `argpartition(g, -k)[..., -k:]`),
/// weights optionally renormalised over the k.
struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
}

impl FeedForward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let gates = softmax_axis(self.gate.forward(x)?, -1, true)?;
        let inds = top_k_tail(&gates, self.top_k)?;
        let mut scores = gates.take_along_axis(&inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        let y = self.switch_mlp.forward(x, &inds)?;
        let dtype = y.dtype();
        y.multiply(scores.expand_dims(-1)?)?
            .sum_axis(-2, None)?
            .as_dtype(dtype)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.gate);
        out.extend(self.switch_mlp.parameters());
        out
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    refuse_rope_scaling(FAMILY, config)?;
    if c.decoder_sparse_step == 0 {
        return Err(LoadError::Config(format!(
            "{FAMILY}: decoder_sparse_step must be at least 1"
        )));
    }
    if c.tie_word_embeddings {
        w.discard("lm_head.weight");
    }
    for layer in (0..c.num_hidden_layers).filter(|&l| c.is_sparse(l)) {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            c.num_experts as usize,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings,
        eps: c.rms_norm_eps,
        tied_embeddings: c.tie_word_embeddings,
        rope: Rope {
            dims: c.head_dim,
            traditional: false,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        attention: AttentionSpec {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            qkv_bias: false,
            o_bias: false,
            qk_norm: QkNorm::PerHead,
            scale: (c.head_dim as f32).powf(-0.5),
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers::default(),
    };
    moe_decoder::build(w, spec, |w, layer, p| {
        let mlp = format!("{p}.mlp");
        Ok(if c.is_sparse(layer) {
            Box::new(SparseMoe {
                gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
                switch_mlp: SwitchGlu::load(
                    w,
                    &format!("{mlp}.switch_mlp"),
                    false,
                    SwitchActivation::SwiGlu,
                )?,
                top_k: c.num_experts_per_tok,
                norm_topk_prob: c.norm_topk_prob,
            }) as Box<dyn FeedForward>
        } else {
            Box::new(Mlp::load(w, &mlp)?)
        })
    })
}
