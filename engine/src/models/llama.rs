//! The Llama family: Llama 2/3.x, SmolLM, Mistral, and Qwen2/2.5 (biases on q/k/v); and the
//! Llama-shaped decoder ([`LlamaShaped`]) that most families are, differing only in settings
//! and their feed-forward parts.
use serde::Deserialize;
use serde_json::Value;

use super::attention::{Attention, AttentionShape, QkNorm, Reach};
use super::config::{
    check_heads, default_rope_theta, default_true, implied_head_dim, parse_config,
};
use super::decoder::{load_stack, load_stack_layers, Decoder, Head, Sizes, Stack};
use super::info::KvShape;
use super::mlp::{FeedForward, GatedMlp};
use super::rope::ScaledRope;
use super::CausalLm;
use crate::distributed::pipeline::{Stage, StageLink};
use crate::distributed::shard::check_heads as check_rank_heads;
use crate::distributed::summed::Summed;
use crate::distributed::{Group, ShardPlan, Split};
use crate::loader::{LoadError, Weights};

pub use super::rope::rope_from_config;

/// The fields of config.json that mlx-lm's `llama.ModelArgs` reads (OLMo 2's, OLMoE's and
/// SmolLM3's `ModelArgs` read the same ones, and more).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<Value>,
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
}

impl Config {
    /// The Llama decoder this config describes, its attention with biases on q/k/v when
    /// `qkv_bias` (on o when `attention_bias`) and queries and keys normalised as `qk_norm`
    /// says. The head count and size are checked; the head size is `head_dim`, else
    /// `hidden_size / num_attention_heads`.
    pub(crate) fn shaped<'a>(
        &self,
        config: &'a Value,
        qkv_bias: bool,
        qk_norm: QkNorm,
    ) -> Result<LlamaShaped<'a>, LoadError> {
        let kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        check_heads(self.num_attention_heads, kv_heads)?;
        let head_dim = match self.head_dim {
            Some(d) => d,
            None => implied_head_dim(self.hidden_size, self.num_attention_heads)?,
        };
        Ok(LlamaShaped {
            config,
            stack: Stack::llama_like(
                self.num_hidden_layers,
                self.rms_norm_eps,
                Head::tied_if(self.tie_word_embeddings),
            ),
            attention: AttentionShape {
                qkv_bias,
                o_bias: self.attention_bias,
                qk_norm,
                ..AttentionShape::new(
                    self.num_attention_heads,
                    kv_heads,
                    head_dim,
                    self.rms_norm_eps,
                )
            },
            rope: ScaledRope::unscaled(rope_from_config(
                head_dim,
                self.rope_theta,
                self.rope_traditional,
                self.rope_scaling.as_ref(),
            )?),
            reach: None,
            head_dim,
            vocab_size: self.vocab_size,
            context_length: self.max_position_embeddings.unwrap_or(4096),
        })
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, None)
}

/// [`build`] for one stage of a pipeline over `group` (`crate::distributed::pipeline`).
pub fn build_stage(
    config: &Value,
    w: &mut Weights,
    group: Group,
) -> Result<Box<dyn CausalLm>, LoadError> {
    build_in(config, w, Some(group))
}

fn build_in(
    config: &Value,
    w: &mut Weights,
    pipeline: Option<Group>,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Llama", config)?;
    // Qwen2 puts biases on q/k/v (not o) without saying so in its config.
    let qkv_bias = c.attention_bias || c.model_type == "qwen2";
    let mut shaped = c.shaped(config, qkv_bias, QkNorm::None)?;
    let mlp = |w: &mut Weights, _, p: &str| GatedMlp::load(w, &format!("{p}.mlp"), c.mlp_bias);
    match pipeline {
        Some(group) => shaped.build_stage(w, group, mlp),
        None => {
            let group = shard(w, &mut shaped.attention)?;
            shaped.build_sharded(w, group, mlp)
        }
    }
}

/// Tensor parallelism for the Llama-shaped decoder with a gated MLP (mlx-lm's `shard()`), when
/// the load is for a group: q/k/v and gate/up are split by column (each rank its own heads and
/// its share of the MLP's features), o and down by row (partial sums that
/// [`LlamaShaped::build_sharded`] completes with an `all_sum`); `attention` becomes this
/// rank's heads. Embeddings, norms and the output head stay whole on every rank. A rank count
/// that does not divide the query and KV heads fails the load, naming both.
pub(crate) fn shard(
    w: &mut Weights,
    attention: &mut AttentionShape,
) -> Result<Option<Group>, LoadError> {
    shard_with(w, attention, &[])
}

/// [`shard`], splitting the layers `more` names as well (a family's other feed-forward parts).
pub(crate) fn shard_with(
    w: &mut Weights,
    attention: &mut AttentionShape,
    more: &[(&str, Split)],
) -> Result<Option<Group>, LoadError> {
    let Some(group) = w.group().cloned() else {
        return Ok(None);
    };
    check_rank_heads(attention.heads, attention.kv_heads, group.size())?;
    let n = group.size() as i32;
    attention.heads /= n;
    attention.kv_heads /= n;
    let mut plan = ShardPlan::for_group(&group);
    for (suffix, split) in more {
        plan = plan.split(suffix, *split);
    }
    w.shard_by(
        plan.split("self_attn.q_proj", Split::Column)
            .split("self_attn.k_proj", Split::Column)
            .split("self_attn.v_proj", Split::Column)
            .split("self_attn.o_proj", Split::Row)
            .split("mlp.gate_proj", Split::Column)
            .split("mlp.up_proj", Split::Column)
            .split("mlp.down_proj", Split::Row),
    );
    Ok(Some(group))
}

/// A Llama-shaped decoder: the same [`Attention`] in every layer (global and rotary unless
/// `reach` says otherwise), the feed-forward part the family loads per layer, and the blocks
/// and ends `stack` describes.
pub(crate) struct LlamaShaped<'a> {
    pub config: &'a Value,
    pub stack: Stack<'a>,
    pub attention: AttentionShape,
    pub rope: ScaledRope,
    /// Each layer's reach (`None`: every layer global and rotary).
    pub reach: Option<Vec<Reach>>,
    pub head_dim: i32,
    pub vocab_size: usize,
    pub context_length: usize,
}

impl LlamaShaped<'_> {
    /// Loads the decoder, layer `i`'s feed-forward part from `feed_forward(w, i, prefix)` with
    /// `prefix` the layer's (`model.layers.<i>`).
    pub fn build<F: FeedForward + 'static>(
        self,
        w: &mut Weights,
        feed_forward: impl FnMut(&mut Weights, usize, &str) -> Result<F, LoadError>,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        self.build_sharded(w, None, feed_forward)
    }

    /// [`Self::build`] for one rank of a tensor-parallel `group` (after [`shard`]): each
    /// block's attention and feed-forward outputs are partial sums, completed by an
    /// `all_sum` over the group.
    pub fn build_sharded<F: FeedForward + 'static>(
        self,
        w: &mut Weights,
        group: Option<Group>,
        mut feed_forward: impl FnMut(&mut Weights, usize, &str) -> Result<F, LoadError>,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        let (trunk, layers) = load_stack(
            w,
            &self.stack,
            |w, i, p| Ok(Summed::new(self.load_attention(w, i, p)?, group.clone())),
            |w, i, p| Ok(Summed::new(feed_forward(w, i, p)?, group.clone())),
        )?;
        let sizes = self.sizes(self.stack.num_layers);
        Decoder::new(self.config, trunk, layers, sizes).finish(w)
    }

    /// [`Self::build`] for one stage of a pipeline over `group`
    /// (`crate::distributed::pipeline`): this rank's layers (the others' tensors are dropped
    /// unread) and the ends: the final norm and the head on every rank (each computes the
    /// logits), the embedding on the first stage, or on every rank when it is the head.
    /// The KV bytes per token reported are the largest stage's, on every rank.
    pub fn build_stage<F: FeedForward + 'static>(
        self,
        w: &mut Weights,
        group: Group,
        feed_forward: impl FnMut(&mut Weights, usize, &str) -> Result<F, LoadError>,
    ) -> Result<Box<dyn CausalLm>, LoadError> {
        let stage = Stage::of(self.stack.num_layers, group.rank(), group.size())?;
        let hidden = self
            .config
            .get("hidden_size")
            .and_then(Value::as_i64)
            .ok_or_else(|| LoadError::Config("config.json has no hidden_size".into()))?;
        stage.discard_other_layers(w, self.stack.prefix);
        let (trunk, layers) = load_stack_layers(
            w,
            &self.stack,
            stage.layers.clone(),
            stage.is_first(),
            |w, i, p| self.load_attention(w, i, p),
            feed_forward,
        )?;
        let dtype = trunk.activation_dtype();
        let sizes = self.sizes(stage.largest);
        let link = StageLink::new(group, stage, hidden as i32, dtype);
        Decoder::new(self.config, trunk, layers, sizes)
            .in_pipeline(link)
            .finish(w)
    }

    /// Layer `i`'s attention, at `prefix` (`model.layers.<i>`).
    fn load_attention(
        &self,
        w: &mut Weights,
        i: usize,
        prefix: &str,
    ) -> Result<Attention, LoadError> {
        let reach = self.reach.as_ref().and_then(|r| r.get(i).copied());
        Attention::load(
            w,
            &format!("{prefix}.self_attn"),
            &self.attention,
            &self.rope,
            reach.unwrap_or(Reach::GlobalRope),
        )
    }

    /// The sizes reported for a cache of `layers` layers.
    fn sizes(&self, layers: usize) -> Sizes {
        Sizes {
            vocab_size: self.vocab_size,
            context_length: self.context_length,
            kv: KvShape::heads(layers, self.attention.kv_heads, self.head_dim),
        }
    }
}
