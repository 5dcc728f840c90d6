//! GLM-4.5 MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6): attention with partial
//! rotary embedding, q/k/v biases and optional per-head QK norm; after `first_k_dense_replace`
//! dense layers, MoE layers with shared experts and DeepSeek-V3's router (sigmoid scores, a
//! per-expert `e_score_correction_bias` that steers the choice but not the weights, top-k
//! within the best `topk_group` of `n_group` groups, weights renormalised and scaled by
//! `routed_scaling_factor`).
use serde::Deserialize;
use serde_json::Value;

use super::attention::{AttentionShape, QkNorm};
use super::config::parse_config;
use super::decoder::{Head, Stack};
use super::llama::LlamaShaped;
use super::mlp::{FeedForward, GatedMlp};
use super::moe::{GroupSelection, RoutedExperts, SharedExperts, SigmoidRouter};
use super::rope::{refuse_rope_scaling, ScaledRope};
use super::switch::{stack_experts, HF_EXPERT_PROJECTIONS};
use super::CausalLm;
use crate::loader::{LoadError, Weights};

const FAMILY: &str = "GLM-4.5 MoE";

#[derive(Debug, Deserialize)]
struct Config {
    vocab_size: usize,
    max_position_embeddings: usize,
    norm_topk_prob: bool,
    num_attention_heads: i32,
    n_group: i32,
    head_dim: i32,
    topk_group: i32,
    n_shared_experts: Option<i32>,
    n_routed_experts: Option<i32>,
    routed_scaling_factor: f32,
    num_experts_per_tok: i32,
    first_k_dense_replace: usize,
    num_hidden_layers: usize,
    num_key_value_heads: i32,
    rms_norm_eps: f32,
    rope_theta: f32,
    use_qk_norm: bool,
    attention_bias: bool,
    partial_rotary_factor: f64,
    #[serde(default = "default_scoring_func")]
    scoring_func: String,
    #[serde(default = "default_topk_method")]
    topk_method: String,
}

fn default_scoring_func() -> String {
    "sigmoid".into()
}

fn default_topk_method() -> String {
    "noaux_tc".into()
}

impl Config {
    /// The routed experts of layer `layer`, when it is a MoE layer.
    fn routed_experts(&self, layer: usize) -> Option<i32> {
        self.n_routed_experts
            .filter(|_| layer >= self.first_k_dense_replace)
    }

    /// Refuses what mlx-lm's implementation does not compute (it asserts `noaux_tc` and always
    /// scores with a sigmoid) and group settings its grouped top-k cannot follow.
    fn validate(&self) -> Result<(), LoadError> {
        let refuse = |what: String| Err(LoadError::Config(format!("{FAMILY}: {what}")));
        if self.topk_method != "noaux_tc" {
            return refuse(format!(
                "topk_method {:?} is not supported",
                self.topk_method
            ));
        }
        if self.scoring_func != "sigmoid" {
            return refuse(format!(
                "scoring_func {:?} is not supported",
                self.scoring_func
            ));
        }
        if let Some(experts) = self.n_routed_experts {
            if self.n_group > 1
                && (experts % self.n_group != 0
                    || experts / self.n_group < 2
                    || !(1..=self.n_group).contains(&self.topk_group))
            {
                return refuse(format!(
                    "{experts} experts cannot form n_group {} with topk_group {}",
                    self.n_group, self.topk_group
                ));
            }
            if !(1..=experts).contains(&self.num_experts_per_tok) {
                return refuse(format!(
                    "num_experts_per_tok {} with {experts} experts",
                    self.num_experts_per_tok
                ));
            }
        }
        Ok(())
    }
}

/// A MoE layer: DeepSeek-V3's router (`MoEGate`: sigmoid scores, correction bias, grouped
/// top-k) over the routed experts, the weighted sum cast back to the experts' dtype, plus the
/// always-on shared experts.
fn load_moe(w: &mut Weights, c: &Config, mlp: &str) -> Result<Box<dyn FeedForward>, LoadError> {
    let selection = GroupSelection {
        top_k: c.num_experts_per_tok,
        n_group: c.n_group,
        topk_group: c.topk_group,
        routed_scaling_factor: c.routed_scaling_factor,
        norm_topk_prob: c.norm_topk_prob,
    };
    let router = SigmoidRouter::load(w, &format!("{mlp}.gate"), selection)?;
    let shared = match c.n_shared_experts {
        Some(_) => {
            SharedExperts::Plain(GatedMlp::load(w, &format!("{mlp}.shared_experts"), false)?)
        }
        None => SharedExperts::None,
    };
    let moe = RoutedExperts::load(w, mlp, router, false)?;
    Ok(Box::new(moe.with_shared(shared).cast_back()))
}

/// mlx-lm's sanitize: per-expert tensors stacked, and the multi-token-prediction layer(s)
/// stored after the last decoder layer (`model.layers.<num_hidden_layers>...`) dropped.
fn sanitize(w: &mut Weights, c: &Config) -> Result<(), LoadError> {
    for layer in 0..c.num_hidden_layers {
        if let Some(experts) = c.routed_experts(layer) {
            let moe = format!("model.layers.{layer}.mlp");
            stack_experts(w, &moe, experts as usize, &HF_EXPERT_PROJECTIONS)?;
        }
    }
    let mtp = format!("model.layers.{}.", c.num_hidden_layers);
    for name in w.names() {
        if name.starts_with(&mtp) {
            w.discard(&name);
        }
    }
    Ok(())
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config(FAMILY, config)?;
    c.validate()?;
    refuse_rope_scaling(FAMILY, config)?;
    sanitize(w, &c)?;
    let rotary_dims = (c.head_dim as f64 * c.partial_rotary_factor) as i32;
    LlamaShaped {
        config,
        // mlx-lm's GLM-4.5 always has its own lm_head.
        stack: Stack::llama_like(c.num_hidden_layers, c.rms_norm_eps, Head::Own),
        attention: AttentionShape {
            qkv_bias: c.attention_bias,
            qk_norm: if c.use_qk_norm {
                QkNorm::PerHead
            } else {
                QkNorm::None
            },
            ..AttentionShape::new(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.rms_norm_eps,
            )
        },
        rope: ScaledRope::plain(rotary_dims, c.rope_theta, false),
        reach: None,
        head_dim: c.head_dim,
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
    }
    .build(w, |w, layer, p| {
        let mlp = format!("{p}.mlp");
        match c.routed_experts(layer) {
            Some(_) => load_moe(w, &c, &mlp),
            None => Ok(Box::new(GatedMlp::load(w, &mlp, false)?)),
        }
    })
}
