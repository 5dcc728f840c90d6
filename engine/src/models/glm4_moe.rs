//! GLM-4.5 MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6): attention with partial
//! rotary embedding, q/k/v biases and optional per-head QK norm; after `first_k_dense_replace`
//! dense layers, MoE layers with shared experts and DeepSeek-V3's router (sigmoid scores, a
//! per-expert `e_score_correction_bias` that steers the choice but not the weights, top-k
//! within the best `topk_group` of `n_group` groups, weights renormalised and scaled by
//! `routed_scaling_factor`).
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{topk_axis, Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, flatten, sigmoid, unflatten};
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::layers::Rope;
use super::moe_decoder::{
    self, parse_config, refuse_rope_scaling, AttentionSpec, DecoderSpec, FeedForward, Mlp,
    Multipliers, QkNorm,
};
use super::switch::{
    stack_experts, top_k_of_negated, weighted_sum, SwitchActivation, SwitchGlu,
    HF_EXPERT_PROJECTIONS,
};
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

/// The router (`MoEGate`): a plain weight `[E, D]` (never quantized by mlx-lm) and the score
/// correction bias `[E]` (kept in float32).
struct Router {
    weight: Array,
    e_score_correction_bias: Array,
    top_k: i32,
    n_group: i32,
    topk_group: i32,
    routed_scaling_factor: f32,
    norm_topk_prob: bool,
}

impl Router {
    /// Expert ids `[..., k]` and their weights `[..., k]` (float32), as mlx-lm's
    /// `group_expert_select`.
    fn select(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let gates = x.matmul(self.weight.t())?;
        let probs = sigmoid(gates.as_dtype(Dtype::Float32)?)?;
        let mut biased = probs.add(&self.e_score_correction_bias)?;
        if self.n_group > 1 {
            biased = self.keep_best_groups(&biased)?;
        }
        let inds = top_k_of_negated(&biased, self.top_k)?;
        let mut scores = probs.take_along_axis(&inds, -1)?;
        if self.top_k > 1 && self.norm_topk_prob {
            scores = scores.divide(scores.sum_axis(-1, true)?)?;
        }
        let factor = Array::from_f32(self.routed_scaling_factor).as_dtype(scores.dtype())?;
        Ok((inds, scores.multiply(factor)?))
    }

    /// Zeroes the scores of all but the `topk_group` groups whose two best experts score
    /// highest.
    fn keep_best_groups(&self, scores: &Array) -> Result<Array, Exception> {
        let grouped = unflatten(scores, -1, &[self.n_group, -1])?;
        let group_scores = topk_axis(&grouped, 2, -1)?.sum_axis(-1, true)?;
        let dropped = self.n_group - self.topk_group;
        let worst =
            argpartition_axis(&group_scores, dropped - 1, -2)?.index((Ellipsis, ..dropped, ..));
        let zero = Array::from_f32(0.0).as_dtype(grouped.dtype())?;
        flatten(grouped.put_along_axis(&worst, &zero, -2)?, -2, -1)
    }
}

/// A MoE layer: routed experts plus the always-on shared experts.
struct Moe {
    gate: Router,
    switch_mlp: SwitchGlu,
    shared_experts: Option<Mlp>,
}

impl FeedForward for Moe {
    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        let (inds, scores) = self.gate.select(x)?;
        let y = self.switch_mlp.forward(x, &inds)?;
        let dtype = y.dtype();
        let y = weighted_sum(&y, &scores)?.as_dtype(dtype)?;
        match &self.shared_experts {
            Some(shared) => y.add(shared.forward(x)?),
            None => Ok(y),
        }
    }

    fn parameters(&self) -> Vec<&Array> {
        let mut out = vec![&self.gate.weight, &self.gate.e_score_correction_bias];
        out.extend(self.switch_mlp.parameters());
        if let Some(shared) = &self.shared_experts {
            out.extend(shared.parameters());
        }
        out
    }
}

fn load_moe(w: &mut Weights, c: &Config, mlp: &str) -> Result<Moe, LoadError> {
    let gate = Router {
        weight: w.take(&format!("{mlp}.gate.weight"))?,
        e_score_correction_bias: w.take(&format!("{mlp}.gate.e_score_correction_bias"))?,
        top_k: c.num_experts_per_tok,
        n_group: c.n_group,
        topk_group: c.topk_group,
        routed_scaling_factor: c.routed_scaling_factor,
        norm_topk_prob: c.norm_topk_prob,
    };
    let shared_experts = c
        .n_shared_experts
        .map(|_| Mlp::load(w, &format!("{mlp}.shared_experts")))
        .transpose()?;
    Ok(Moe {
        gate,
        switch_mlp: SwitchGlu::load(
            w,
            &format!("{mlp}.switch_mlp"),
            false,
            SwitchActivation::SwiGlu,
        )?,
        shared_experts,
    })
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
    let spec = DecoderSpec {
        config,
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings,
        eps: c.rms_norm_eps,
        // mlx-lm's GLM-4.5 always has its own lm_head.
        tied_embeddings: false,
        rope: Rope {
            dims: rotary_dims,
            traditional: false,
            base: c.rope_theta,
            scale: 1.0,
            freqs: None,
        },
        attention: AttentionSpec {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            qkv_bias: c.attention_bias,
            o_bias: false,
            qk_norm: if c.use_qk_norm {
                QkNorm::PerHead
            } else {
                QkNorm::None
            },
            scale: (c.head_dim as f32).powf(-0.5),
            eps: c.rms_norm_eps,
        },
        multipliers: Multipliers::default(),
    };
    moe_decoder::build(w, spec, |w, layer, p| {
        let mlp = format!("{p}.mlp");
        Ok(match c.routed_experts(layer) {
            Some(_) => Box::new(load_moe(w, &c, &mlp)?) as Box<dyn FeedForward>,
            None => Box::new(Mlp::load(w, &mlp)?),
        })
    })
}
