//! DeepSeek-V2 (and V2-Lite, Coder-V2): the low-rank query and KV projections of multi-head
//! latent attention, expanded to per-head keys and values before attending (mlx-lm 0.32.2's
//! `deepseek_v2.py` caches the expanded keys and values, not the latent), DeepSeek's YaRN
//! rotary embedding, and the softmax router (`greedy` or `group_limited_greedy`).
use mlx_rs::error::Exception;
use mlx_rs::{fast, Array};
use serde_json::Value;

use super::attention::SelfAttention;
use super::layers::{Linear, Queries};
use super::mla::{
    build_deepseek, drop_unused, stack_experts, unquantized, DeepseekConfig, FamilyParts,
    LatentProjections,
};
use super::moe::{lowest_groups, Router};
use super::params::{Parameters, Params};
use super::rope::{rope_kind, yarn, ScaledRope};
use super::scalar::{scale_by, weak_scalar};
use super::switch::top_k_of_negated;
use super::{CausalLm, Feature};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = DeepseekConfig::from_json(config)?;
    let topk = TopkMethod::from_config(&c)?;
    check_scoring(&c)?;
    // Fail on the rope before reading any weight.
    rope_from_config(&c)?;
    stack_experts(w, &c)?;
    drop_unused(w, &c, false);
    let scale = c.softmax_scale()? as f32;
    let attention = |w: &mut Weights, i: usize| {
        ExpandedAttention::load(w, &format!("model.layers.{i}.self_attn"), &c, scale)
    };
    let router = |w: &mut Weights, i: usize| {
        MoeGate::load(w, &format!("model.layers.{i}.mlp.gate"), &c, topk)
    };
    let key_dim = c.q_head_dim();
    let refusals = vec![(
        Feature::KvQuantization,
        format!(
            "DeepSeek-V2's cached keys ({key_dim} features per head) and values ({} per head) \
             differ in size, which the quantized-cache attention does not support",
            c.v_head_dim
        ),
    )];
    build_deepseek(
        config,
        &c,
        w,
        FamilyParts {
            attention: &attention,
            router: &router,
            cast_back: false,
            kv_elements_per_token_per_layer: (c.num_attention_heads * (key_dim + c.v_head_dim))
                as usize,
            head_dim: c.v_head_dim,
            refusals,
        },
    )
}

/// mlx-lm builds DeepSeek-V2's YaRN rotary embedding from `rope_scaling` whatever its type
/// says, so a config needs one; a type other than YaRN is refused rather than reinterpreted.
fn rope_from_config(c: &DeepseekConfig) -> Result<ScaledRope, LoadError> {
    let scaling = c
        .rope_scaling
        .as_ref()
        .filter(|s| !s.is_null())
        .ok_or_else(|| {
            LoadError::Config("DeepSeek-V2 needs rope_scaling (its YaRN rotary embedding)".into())
        })?;
    match rope_kind(scaling) {
        "yarn" | "deepseek_yarn" | "default" => {
            yarn(c.qk_rope_head_dim, c.rope_theta, true, scaling)
        }
        other => Err(LoadError::Config(format!(
            "DeepSeek-V2: unsupported rope_scaling type {other:?} (supported: yarn)"
        ))),
    }
}

/// mlx-lm's `DeepseekV2Attention`: per-head keys are the position-free part expanded from the
/// latent by `kv_b_proj` next to the shared rotary key (repeated over heads), values the rest
/// of `kv_b_proj`'s output; both are cached per head.
struct ExpandedAttention {
    inputs: LatentProjections,
    kv_b_proj: Linear,
    o_proj: Linear,
    rope: ScaledRope,
    scale: f32,
}

impl ExpandedAttention {
    fn load(
        w: &mut Weights,
        prefix: &str,
        c: &DeepseekConfig,
        scale: f32,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            inputs: LatentProjections::load(w, prefix, c)?,
            kv_b_proj: Linear::load(w, &format!("{prefix}.kv_b_proj"), false)?,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), c.attention_bias)?,
            rope: rope_from_config(c)?,
            scale,
        })
    }
}

impl SelfAttention for ExpandedAttention {
    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let heads = self.inputs.heads;
        let inputs = self.inputs.forward(x)?;
        let kv = self
            .kv_b_proj
            .forward(&self.inputs.kv_a_layernorm.forward(&inputs.compressed_kv)?)?
            .reshape(&[b, l, heads, -1])?
            .transpose_axes(&[0, 2, 1, 3])?;
        let mut kv = kv
            .split_at_indices(&[self.inputs.qk_nope_head_dim], -1)?
            .into_iter();
        let missing = || Exception::custom("split gave fewer parts than asked");
        let (k_nope, values) = (
            kv.next().ok_or_else(missing)?,
            kv.next().ok_or_else(missing)?,
        );
        let q_pe = self.rope.apply(cache, &inputs.q_pe)?;
        let k_pe = self.rope.apply(cache, &inputs.k_pe)?;
        let k_pe = Array::repeat_axis::<f32>(k_pe, heads, 1)?;
        let keys = mlx_rs::ops::concatenate(&[k_nope, k_pe], -1)?;
        let (keys, values) = cache.update_and_fetch(&keys, &values)?;
        let (keys, values) = (
            unquantized(keys, "DeepSeek-V2")?,
            unquantized(values, "DeepSeek-V2")?,
        );
        let queries = mlx_rs::ops::concatenate(&[inputs.q_nope, q_pe], -1)?;
        let mask = cache.mask(l, None)?;
        let out = fast::scaled_dot_product_attention(
            &queries,
            &keys,
            &values,
            self.scale,
            mask.as_sdpa(),
            None,
        )?;
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&which.pick(out))
    }
}

impl Parameters for ExpandedAttention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.inputs).add(&self.kv_b_proj).add(&self.o_proj);
    }
}

/// How the router picks experts from its softmax scores.
#[derive(Debug, Clone, Copy)]
enum TopkMethod {
    /// The `k` best experts overall.
    Greedy,
    /// The `k` best experts of the `topk_group` groups whose best expert scores highest.
    GroupLimited { n_group: i32, topk_group: i32 },
}

impl TopkMethod {
    fn from_config(c: &DeepseekConfig) -> Result<Self, LoadError> {
        // mlx-lm's default spelling is "gready"; anything but group-limited is greedy there,
        // here only the spellings that mean it.
        match c.topk_method.as_deref().unwrap_or("gready") {
            "greedy" | "gready" => Ok(TopkMethod::Greedy),
            "group_limited_greedy" => {
                let (Some(n_group), Some(topk_group)) = (c.n_group, c.topk_group) else {
                    return Err(LoadError::Config(
                        "DeepSeek-V2: group_limited_greedy needs n_group and topk_group".into(),
                    ));
                };
                let experts = c.n_routed_experts.unwrap_or(0);
                if n_group < 1 || experts % n_group != 0 || !(1..=n_group).contains(&topk_group) {
                    return Err(LoadError::Config(format!(
                        "DeepSeek-V2: n_group {n_group} and topk_group {topk_group} do not \
                         split {experts} experts"
                    )));
                }
                Ok(TopkMethod::GroupLimited {
                    n_group,
                    topk_group,
                })
            }
            other => Err(LoadError::Config(format!(
                "DeepSeek-V2: unsupported topk_method {other:?} (supported: greedy, \
                 group_limited_greedy)"
            ))),
        }
    }
}

/// mlx-lm's DeepSeek-V2 router always scores with a softmax and never renormalises the chosen
/// weights; configs that ask otherwise are refused rather than served differently.
fn check_scoring(c: &DeepseekConfig) -> Result<(), LoadError> {
    if c.n_routed_experts.is_none() {
        return Ok(());
    }
    if let Some(f) = c.scoring_func.as_deref().filter(|f| *f != "softmax") {
        return Err(LoadError::Config(format!(
            "DeepSeek-V2: unsupported scoring_func {f:?} (supported: softmax)"
        )));
    }
    if c.norm_topk_prob == Some(true) {
        return Err(LoadError::Config(
            "DeepSeek-V2: norm_topk_prob true is not supported (mlx-lm does not renormalise)"
                .into(),
        ));
    }
    Ok(())
}

/// mlx-lm's DeepSeek-V2 `MoEGate`: a precise softmax over the experts in the activations'
/// dtype, optionally zeroing all but the best groups, the `k` best experts, their scores times
/// `routed_scaling_factor`.
struct MoeGate {
    weight: Array,
    top_k: i32,
    method: TopkMethod,
    routed_scaling_factor: f32,
}

impl MoeGate {
    fn load(
        w: &mut Weights,
        prefix: &str,
        c: &DeepseekConfig,
        method: TopkMethod,
    ) -> Result<Self, LoadError> {
        Ok(Self {
            weight: w.take(&format!("{prefix}.weight"))?,
            top_k: c.experts_per_token(None)?,
            method,
            routed_scaling_factor: c.routed_scaling_factor,
        })
    }
}

/// Zeroes the scores `[B, L, experts]` of every group outside the `topk_group` whose best
/// expert scores highest.
fn limit_groups(scores: &Array, n_group: i32, topk_group: i32) -> Result<Array, Exception> {
    let (b, l) = (scores.shape()[0], scores.shape()[1]);
    let grouped = scores.reshape(&[b, l, n_group, -1])?;
    let dropped = n_group - topk_group;
    if dropped == 0 {
        return grouped.reshape(&[b, l, -1]);
    }
    let group_scores = grouped.max_axis(-1, true)?;
    let group_idx = lowest_groups(&group_scores, dropped)?;
    let zero = weak_scalar(scores, 0.0)?;
    grouped
        .put_along_axis(&group_idx, &zero, -2)?
        .reshape(&[b, l, -1])
}

impl Router for MoeGate {
    fn route(&self, x: &Array) -> Result<(Array, Array), Exception> {
        let gates = x.matmul(self.weight.t())?;
        let mut scores = mlx_rs::ops::softmax_axis(&gates, -1, true)?;
        if let TopkMethod::GroupLimited {
            n_group,
            topk_group,
        } = self.method
        {
            scores = limit_groups(&scores, n_group, topk_group)?;
        }
        let inds = top_k_of_negated(&scores, self.top_k)?;
        let weights = scores.take_along_axis(&inds, -1)?;
        Ok((inds, scale_by(&weights, self.routed_scaling_factor)?))
    }
}

impl Parameters for MoeGate {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight);
    }
}
