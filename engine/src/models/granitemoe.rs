//! Granite-MoE (`GraniteMoeForCausalLM`, Granite 3.x MoE): Granite's scalar multipliers
//! (embeddings, residual branches, attention scale, logits divisor) around a Mixtral-style
//! router that softmaxes, in float32, over the k largest logits.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::layers::Linear;
use super::llama::rope_from_config;
use super::moe_decoder::{
    self, linear_parameters, parse_config, AttentionSpec, DecoderSpec, FeedForward, Multipliers,
    QkNorm,
};
use super::switch::{top_k_tail, weighted_sum, SwitchActivation, SwitchGlu};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Granite-MoE";

#[derive(Debug, Deserialize)]
struct Config {
    hidden_size: i32,
    num_hidden_layers: usize,
    num_attention_heads: i32,
    rms_norm_eps: f32,
    vocab_size: usize,
    logits_scaling: f32,
    attention_multiplier: f32,
    embedding_multiplier: f32,
    residual_multiplier: f32,
    max_position_embeddings: usize,
    num_key_value_heads: i32,
    attention_bias: bool,
    rope_theta: f32,
    num_experts_per_tok: i32,
    rope_scaling: Option<Value>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
}

fn default_true() -> bool {
    true
}

/// The sparse block: top-k router logits, softmaxed in float32; the weighted sum is cast back
/// to the activations' dtype.
struct SparseMoe {
    router: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
}

impl FeedForward for SparseMoe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let logits = self.router.forward(x)?;
        let inds = top_k_tail(&logits, self.top_k)?;
        let top = logits
            .take_along_axis(&inds, -1)?
            .as_dtype(Dtype::Float32)?;
        let gates = softmax_axis(top, -1, None)?;
        let y = self.switch_mlp.forward(x, &inds)?;
        let dtype = y.dtype();
        weighted_sum(&y, &gates)?.as_dtype(dtype)
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = linear_parameters(&self.router);
        out.extend(self.switch_mlp.parameters());
        out
    }
}

/// Hugging Face's Granite-MoE checkpoints fuse each layer's expert gate and up projections
/// (`input_linear` `[E, 2I, D]`) and name the down projection `output_linear`; mlx-lm splits
/// and renames them into its `switch_mlp` form.
fn split_fused_experts(w: &mut Weights, layers: usize) -> Result<(), LoadError> {
    for layer in 0..layers {
        let moe = format!("model.layers.{layer}.block_sparse_moe");
        let Some(fused) = w.remove_raw(&format!("{moe}.input_linear.weight")) else {
            continue;
        };
        let halves = fused.split_equal(2, 1)?;
        let [gate, up] = <[Array; 2]>::try_from(halves)
            .map_err(|_| LoadError::Config(format!("{moe}.input_linear does not split")))?;
        w.insert(format!("{moe}.switch_mlp.gate_proj.weight"), gate);
        w.insert(format!("{moe}.switch_mlp.up_proj.weight"), up);
        if let Some(down) = w.remove_raw(&format!("{moe}.output_linear.weight")) {
            w.insert(format!("{moe}.switch_mlp.down_proj.weight"), down);
        }
    }
    Ok(())
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    split_fused_experts(w, c.num_hidden_layers)?;
    let head_dim = c.hidden_size / c.num_attention_heads;
    let rope = rope_from_config(head_dim, c.rope_theta, false, c.rope_scaling.as_ref())?;
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings,
        eps: c.rms_norm_eps,
        tied_embeddings: c.tie_word_embeddings,
        rope,
        attention: AttentionSpec {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim,
            qkv_bias: c.attention_bias,
            o_bias: c.attention_bias,
            qk_norm: QkNorm::None,
            scale: c.attention_multiplier,
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers {
            embedding: Some(c.embedding_multiplier),
            residual: Some(c.residual_multiplier),
            logits_divisor: Some(c.logits_scaling),
        },
    };
    moe_decoder::build(w, spec, |w, _, p| {
        let moe = format!("{p}.block_sparse_moe");
        Ok(Box::new(SparseMoe {
            router: Linear::load(w, &format!("{moe}.router.layer"), false)?,
            switch_mlp: SwitchGlu::load(
                w,
                &format!("{moe}.switch_mlp"),
                false,
                SwitchActivation::SwiGlu,
            )?,
            top_k: c.num_experts_per_tok,
        }) as Box<dyn FeedForward>)
    })
}
