//! OLMoE (`OlmoeForCausalLM`): attention with queries and keys RMS-normalised over the whole
//! projection (before the split into heads), and in every layer a softmax router over the
//! experts, optionally renormalising the top-k weights.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::QkNorm;
use super::config::parse_config;
use super::layers::Linear;
use super::llama;
use super::mlp::FeedForward;
use super::moe::{RoutedExperts, SoftmaxRouter};
use super::params::{Parameters, Params};
use super::switch::{stack_experts, top_k_of_negated, HF_EXPERT_PROJECTIONS};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "OLMoE";

/// The fields of config.json that mlx-lm's `olmoe.ModelArgs` reads: Llama's and the
/// experts'.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(flatten)]
    llama: llama::Config,
    num_experts: usize,
    num_experts_per_tok: i32,
    #[serde(default)]
    norm_topk_prob: bool,
}

/// The sparse block (a softmax router, top-k ids as `argpartition(-p, k-1)[..., :k]`,
/// weights optionally renormalised), run over the tokens flattened to `[N, D]` as mlx-lm
/// computes it.
struct TokenRows(RoutedExperts<SoftmaxRouter>);

impl FeedForward for TokenRows {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let shape = x.shape().to_vec();
        let rows = x.reshape(&[-1, shape[shape.len() - 1]])?;
        self.0.forward(&rows)?.reshape(&shape)
    }
}

impl Parameters for TokenRows {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.0);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    let l = &c.llama;
    for layer in 0..l.num_hidden_layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            c.num_experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    l.shaped(config, l.attention_bias, QkNorm::Whole)?
        .build(w, |w, _, p| {
            let mlp = format!("{p}.mlp");
            let router = SoftmaxRouter {
                gate: Linear::load(w, &format!("{mlp}.gate"), false)?,
                top_k: c.num_experts_per_tok,
                select: top_k_of_negated,
                renormalize: c.norm_topk_prob,
            };
            Ok(TokenRows(RoutedExperts::load(w, &mlp, router, l.mlp_bias)?))
        })
}
