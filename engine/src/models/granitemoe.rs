//! Granite-MoE (`GraniteMoeForCausalLM`, Granite 3.x MoE): Granite's scalar multipliers
//! (embeddings, residual branches, attention scale, logits divisor) around a Mixtral-style
//! router that softmaxes, in float32, over the k largest logits.
use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::config::parse_config;
use super::granite::GraniteArgs;
use super::layers::Linear;
use super::moe::{RoutedExperts, Router};
use super::params::{Parameters, Params};
use super::switch::top_k_tail;
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "Granite-MoE";

/// Granite's fields and the experts'.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    granite: GraniteArgs,
    num_experts_per_tok: i32,
}

/// The router: the top-k logits (`argpartition(l, -k)[..., -k:]`), softmaxed in float32.
struct TopKSoftmaxF32 {
    layer: Linear,
    top_k: i32,
}

impl Router for TopKSoftmaxF32 {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let logits = self.layer.forward(x)?;
        let inds = top_k_tail(&logits, self.top_k)?;
        let top = logits
            .take_along_axis(&inds, -1)?
            .as_dtype(Dtype::Float32)?;
        Ok((inds, softmax_axis(top, -1, None)?))
    }
}

impl Parameters for TopKSoftmaxF32 {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.layer);
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
    split_fused_experts(w, c.granite.num_hidden_layers)?;
    c.granite.shaped(config)?.build(w, |w, _, p| {
        let moe = format!("{p}.block_sparse_moe");
        let router = TopKSoftmaxF32 {
            layer: Linear::load(w, &format!("{moe}.router.layer"), false)?,
            top_k: c.num_experts_per_tok,
        };
        // The weighted sum is cast back to the activations' dtype.
        Ok(RoutedExperts::load(w, &moe, router, false)?.cast_back())
    })
}
