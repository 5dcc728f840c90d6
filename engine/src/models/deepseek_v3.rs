//! DeepSeek-V3 (and Kimi K2, which ships as `DeepseekV3ForCausalLM`): multi-head latent
//! attention with the absorbed-weight computation of mlx-lm 0.32.2, and the sigmoid router with
//! a score-correction bias and group-limited selection (`noaux_tc`).
//!
//! The cache holds what mlx-lm's holds: on the "keys" side the normalised KV latent
//! `[B, 1, T, kv_lora_rank]`, on the "values" side the rotated shared key `[B, 1, T,
//! qk_rope_head_dim]`; per-head keys and values are never materialised for the cache. Scores
//! are the rotary part (`q_pe · k_pe`, which also carries the mask) plus the latent part, which
//! a decode step computes against the latent directly (queries pushed through `embed_q`,
//! output through `unembed_out`) and a longer pass against per-head keys and values expanded
//! from the latent.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, Array};
use serde_json::Value;

use super::attention::SelfAttention;
use super::layers::{Linear, Matrix, QuantizedMatrix, Queries};
use super::mla::{
    build_deepseek, drop_unused, mask_array, plain_deepseek_rope, stack_experts, unquantized,
    DeepseekConfig, FamilyParts, LatentProjections, MultiLinear,
};
use super::moe::{GroupSelection, SigmoidRouter};
use super::params::{Parameters, Params};
use super::rope::{rope_kind, yarn, ScaledRope};
use super::scalar::scale_by;
use super::{CausalLm, Feature};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = DeepseekConfig::from_json(config)?;
    check_router_config(&c)?;
    stack_experts(w, &c)?;
    drop_unused(w, &c, true);
    let scale = c.softmax_scale()? as f32;
    let attention = |w: &mut Weights, i: usize| {
        LatentAttention::load(w, &format!("model.layers.{i}.self_attn"), &c, scale)
    };
    let router = |w: &mut Weights, i: usize| {
        SigmoidRouter::load(
            w,
            &format!("model.layers.{i}.mlp.gate"),
            group_selection(&c)?,
        )
    };
    let refusals = vec![(
        Feature::KvQuantization,
        "DeepSeek-V3 caches the compressed KV latent and the rotary key, which mlx-lm attends \
         to with plain matmuls; a quantized latent cache is not supported"
            .to_owned(),
    )];
    build_deepseek(
        config,
        &c,
        w,
        FamilyParts {
            attention: &attention,
            router: &router,
            cast_back: true,
            kv_elements_per_token_per_layer: (c.kv_lora_rank + c.qk_rope_head_dim) as usize,
            head_dim: c.kv_lora_rank,
            refusals,
        },
    )
}

/// The rotary embedding of the `qk_rope_head_dim` features: plain, linear, or DeepSeek's YaRN,
/// as mlx-lm's `initialize_rope` gives DeepSeek-V3 (always the traditional layout). Other
/// scaling kinds are refused.
fn rope_from_config(c: &DeepseekConfig) -> Result<ScaledRope, LoadError> {
    let dims = c.qk_rope_head_dim;
    let Some(scaling) = c.rope_scaling.as_ref().filter(|s| !s.is_null()) else {
        return Ok(plain_deepseek_rope(dims, c.rope_theta, 1.0));
    };
    let rope = match rope_kind(scaling) {
        "default" => plain_deepseek_rope(dims, c.rope_theta, 1.0),
        "linear" => {
            let factor = scaling
                .get("factor")
                .and_then(Value::as_f64)
                .ok_or_else(|| LoadError::Config("linear rope_scaling has no factor".into()))?;
            plain_deepseek_rope(dims, c.rope_theta, (1.0 / factor) as f32)
        }
        "yarn" | "deepseek_yarn" => yarn(dims, c.rope_theta, true, scaling)?,
        other => {
            return Err(LoadError::Config(format!(
                "DeepSeek-V3: unsupported rope_scaling type {other:?} (supported: default, \
                 linear, yarn, deepseek_yarn)"
            )))
        }
    };
    Ok(rope)
}

/// Multi-head latent attention, as mlx-lm's `DeepseekV3Attention`.
struct LatentAttention {
    inputs: LatentProjections,
    /// Per head `[kv_lora_rank, qk_nope_head_dim]`: position-free keys from the latent (and,
    /// transposed, queries into the latent space).
    embed_q: MultiLinear,
    /// Per head `[v_head_dim, kv_lora_rank]`: values from the latent.
    unembed_out: MultiLinear,
    o_proj: Linear,
    rope: ScaledRope,
    scale: f32,
}

impl LatentAttention {
    fn load(
        w: &mut Weights,
        prefix: &str,
        c: &DeepseekConfig,
        scale: f32,
    ) -> Result<Self, LoadError> {
        let inputs = LatentProjections::load(w, prefix, c)?;
        let (embed_q, unembed_out) = match absorbed_from_kv_b(w, prefix, c)? {
            Some(pair) => pair,
            None => (
                MultiLinear::load(w, &format!("{prefix}.embed_q"))?,
                MultiLinear::load(w, &format!("{prefix}.unembed_out"))?,
            ),
        };
        Ok(Self {
            inputs,
            embed_q,
            unembed_out,
            o_proj: Linear::load(w, &format!("{prefix}.o_proj"), c.attention_bias)?,
            rope: rope_from_config(c)?,
            scale,
        })
    }
}

impl SelfAttention for LatentAttention {
    fn attend(
        &self,
        x: &Array,
        cache: &mut LayerCache,
        which: Queries,
    ) -> Result<Array, Exception> {
        let (b, l) = (x.shape()[0], x.shape()[1]);
        let inputs = self.inputs.forward(x)?;
        let kv_latent = self
            .inputs
            .kv_a_layernorm
            .forward(&inputs.compressed_kv)?
            .expand_dims(1)?;
        let q_pe = self.rope.apply(cache, &inputs.q_pe)?;
        let k_pe = self.rope.apply(cache, &inputs.k_pe)?;
        let (kv_latent, k_pe) = cache.update_and_fetch(&kv_latent, &k_pe)?;
        let (kv_latent, k_pe) = (
            unquantized(kv_latent, "DeepSeek-V3")?,
            unquantized(k_pe, "DeepSeek-V3")?,
        );
        let t = kv_latent.shape()[2];
        let mask = mask_array(cache.mask(l, None)?, l, t)?;
        let pe_scores = rotary_scores(&q_pe, &k_pe, self.scale, mask.as_ref())?;
        let out = if l == 1 {
            let q = self.embed_q.forward(&inputs.q_nope, true)?;
            let latent_out = fast::scaled_dot_product_attention(
                &q, &kv_latent, &kv_latent, self.scale, &pe_scores, None,
            )?;
            self.unembed_out.forward(&latent_out, true)?
        } else {
            let k = self.embed_q.forward(&kv_latent, false)?;
            let v = self.unembed_out.forward(&kv_latent, true)?;
            fast::scaled_dot_product_attention(
                &inputs.q_nope,
                &k,
                &v,
                self.scale,
                &pe_scores,
                None,
            )?
        };
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?;
        self.o_proj.forward(&which.pick(out))
    }
}

impl Parameters for LatentAttention {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.inputs)
            .add(&self.embed_q)
            .add(&self.unembed_out)
            .add(&self.o_proj);
    }
}

/// The rotary part of the attention logits, `(q_pe * scale) @ k_pe^T` `[B, heads, L, T]`, with
/// masked positions at the dtype's lowest value: passed to the fused attention as an additive
/// mask, it both adds these logits and hides what the mask hides.
fn rotary_scores(
    q_pe: &Array,
    k_pe: &Array,
    scale: f32,
    mask: Option<&Array>,
) -> Result<Array, Exception> {
    let scores = scale_by(q_pe, scale)?.matmul(k_pe.swap_axes(-1, -2)?)?;
    match mask {
        None => Ok(scores),
        Some(m) => {
            let dtype = scores.dtype();
            let lowest = dtype
                .finfo_min()
                .map_err(|e| Exception::custom(format!("no lowest value for {dtype:?}: {e}")))?;
            let lowest = Array::from_f32(lowest as f32).as_dtype(dtype)?;
            mlx_rs::ops::select(m, &scores, &lowest)
        }
    }
}

/// mlx-lm's `sanitize` for checkpoints that carry `kv_b_proj` (`[heads * (nope + v), latent]`,
/// Hugging Face's layout) instead of the absorbed per-head matrices: splits it into `embed_q`
/// (the key part, transposed per head) and `unembed_out` (the value part). A quantized
/// `kv_b_proj` is dequantized, split and quantized again with the bits and group size its
/// shapes imply, as mlx-lm does.
fn absorbed_from_kv_b(
    w: &mut Weights,
    prefix: &str,
    c: &DeepseekConfig,
) -> Result<Option<(MultiLinear, MultiLinear)>, LoadError> {
    let name = format!("{prefix}.kv_b_proj");
    let Some(weight) = w.remove_raw(&format!("{name}.weight")) else {
        return Ok(None);
    };
    let scales = w.remove_raw(&format!("{name}.scales"));
    let quant = match &scales {
        None => None,
        Some(scales) => {
            let biases = w
                .remove_raw(&format!("{name}.biases"))
                .ok_or_else(|| LoadError::MissingTensors(vec![format!("{name}.biases")]))?;
            let (bits, group_size) = implied_quantization(&name, &weight, scales, c.kv_lora_rank)?;
            Some((biases, bits, group_size))
        }
    };
    let full = match (&scales, &quant) {
        (Some(scales), Some((biases, bits, group_size))) => {
            mlx_rs::ops::dequantize(&weight, scales, biases, *group_size, *bits)?
        }
        _ => weight,
    };
    let head_dim = c.qk_nope_head_dim + c.v_head_dim;
    let full = full.reshape(&[c.num_attention_heads, head_dim, -1])?;
    let nope = c.qk_nope_head_dim;
    let wk = full
        .index((.., ..nope, ..))
        .swap_axes(-1, -2)?
        .contiguous()?;
    let wv = full.index((.., nope.., ..)).contiguous()?;
    let matrix = |m: Array| -> Result<Matrix, LoadError> {
        match &quant {
            None => Ok(Matrix::Dense(m)),
            Some((_, bits, group_size)) => {
                let (weight, scales, biases) = mlx_rs::ops::quantize(&m, *group_size, *bits)?;
                Ok(Matrix::Quantized(QuantizedMatrix {
                    weight,
                    scales,
                    biases: Some(biases),
                    group_size: *group_size,
                    bits: *bits,
                    mode: super::quant::QuantMode::Affine,
                }))
            }
        }
    };
    Ok(Some((
        MultiLinear {
            weight: matrix(wk)?,
        },
        MultiLinear {
            weight: matrix(wv)?,
        },
    )))
}

/// Bits and group size of a quantized `[out, in]` matrix whose `in` is `columns`, from its
/// packed shapes (as mlx-lm infers them for `kv_b_proj`).
fn implied_quantization(
    name: &str,
    weight: &Array,
    scales: &Array,
    columns: i32,
) -> Result<(i32, i32), LoadError> {
    let packed = weight.shape().last().copied().unwrap_or(0);
    let groups = scales.shape().last().copied().unwrap_or(0);
    let bits = packed * 32 / columns;
    if groups <= 0 || columns % groups != 0 || !(1..=8).contains(&bits) {
        return Err(LoadError::Config(format!(
            "{name}: cannot infer its quantization from packed width {packed} and {groups} \
             groups over {columns} columns"
        )));
    }
    Ok((bits, columns / groups))
}

/// Checks what mlx-lm's DeepSeek-V3 router supports: `noaux_tc` with sigmoid scores.
fn check_router_config(c: &DeepseekConfig) -> Result<(), LoadError> {
    if c.n_routed_experts.is_none() {
        return Ok(());
    }
    let method = c.topk_method.as_deref().unwrap_or("noaux_tc");
    if method != "noaux_tc" {
        return Err(LoadError::Config(format!(
            "DeepSeek-V3: unsupported topk_method {method:?} (supported: noaux_tc)"
        )));
    }
    let scoring = c.scoring_func.as_deref().unwrap_or("sigmoid");
    if scoring != "sigmoid" {
        return Err(LoadError::Config(format!(
            "DeepSeek-V3: unsupported scoring_func {scoring:?} (supported: sigmoid)"
        )));
    }
    Ok(())
}

/// The selection settings of DeepSeek-V3's router (mlx-lm's `MoEGate`, see
/// [`SigmoidRouter`]), refused when the groups do not split the experts evenly or are too
/// small for its group scores (each group's best two).
fn group_selection(c: &DeepseekConfig) -> Result<GroupSelection, LoadError> {
    let experts = c.n_routed_experts.unwrap_or(0);
    let n_group = c.n_group.unwrap_or(1);
    let topk_group = c.topk_group.unwrap_or(1);
    if n_group < 1 || experts % n_group != 0 || !(1..=n_group).contains(&topk_group) {
        return Err(LoadError::Config(format!(
            "DeepSeek-V3: n_group {n_group} and topk_group {topk_group} do not split \
             {experts} experts"
        )));
    }
    if n_group > 1 && experts / n_group < 2 {
        return Err(LoadError::Config(format!(
            "DeepSeek-V3: groups of {} experts; group scores take each group's best two",
            experts / n_group
        )));
    }
    Ok(GroupSelection {
        top_k: c.experts_per_token(Some(1))?,
        n_group,
        topk_group,
        routed_scaling_factor: c.routed_scaling_factor,
        norm_topk_prob: c.norm_topk_prob.unwrap_or(true),
    })
}
