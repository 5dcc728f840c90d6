//! Nemotron-H (NVIDIA): a hybrid stack whose blocks are, by `hybrid_override_pattern`,
//! Mamba-2 mixers (`M`), attention without positional embedding (`*`) or squared-ReLU MLPs
//! (`-`), each a pre-norm residual (see [`super::mamba2`]). Only mixers and attention keep a
//! cache, so the model's layers are those blocks. Its gated norm normalises each of the
//! mixer's `n_groups` groups on its own, and `D` is cast to the activations' dtype.
//!
//! Mixture-of-experts blocks (`E`, Nemotron 3) are refused by name at load.
use mlx_rs::error::Exception;
use mlx_rs::nn::relu;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::{prerotated_opts, AttnProjections};
use super::config::{check_heads, parse_config};
use super::layers::{attend_with, Linear, RmsNorm};
use super::mamba2::{
    missing_cache, Backbone, BackboneBlock, BackboneSizes, Mamba2Mixer, MixerBlock, MixerNorm,
    MixerShape,
};
use super::params::{Parameters, Params};
use super::CausalLm;
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `nemotron_h.ModelArgs` reads for the blocks built
/// here.
#[derive(Debug, Deserialize)]
struct Config {
    vocab_size: usize,
    hidden_size: i32,
    max_position_embeddings: usize,
    num_attention_heads: i32,
    num_key_value_heads: i32,
    attention_bias: bool,
    mamba_num_heads: i32,
    mamba_head_dim: i32,
    mamba_proj_bias: bool,
    ssm_state_size: i32,
    conv_kernel: i32,
    n_groups: i32,
    mlp_bias: bool,
    layer_norm_epsilon: f32,
    use_conv_bias: bool,
    hybrid_override_pattern: Option<PatternField>,
    layers_block_type: Option<Vec<String>>,
    layer_types: Option<Vec<String>>,
    head_dim: Option<i32>,
    time_step_limit: Option<(f32, f32)>,
}

/// `hybrid_override_pattern` as a string (`"M-M*"`) or a list of one-character strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PatternField {
    Text(String),
    List(Vec<String>),
}

/// One block of the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockType {
    Mamba,
    Attention,
    Mlp,
}

impl Config {
    /// The stack's block types, from `hybrid_override_pattern` or the block-type list (the
    /// names transformers uses, old and new).
    fn blocks(&self) -> Result<Vec<BlockType>, LoadError> {
        let chars: Vec<String> =
            match (
                &self.hybrid_override_pattern,
                self.layers_block_type
                    .as_ref()
                    .or(self.layer_types.as_ref()),
            ) {
                (Some(PatternField::Text(s)), _) => s.chars().map(String::from).collect(),
                (Some(PatternField::List(l)), _) => l.clone(),
                (None, Some(types)) => types
                    .iter()
                    .map(|t| match t.as_str() {
                        "full_attention" | "attention" => Ok("*".to_owned()),
                        "linear_attention" | "mamba" | "conv" => Ok("M".to_owned()),
                        "mlp" => Ok("-".to_owned()),
                        "moe" => Ok("E".to_owned()),
                        other => Err(LoadError::Config(format!(
                            "Nemotron-H block type {other:?} is not one of full_attention, \
                         linear_attention, mlp, moe"
                        ))),
                    })
                    .collect::<Result<_, _>>()?,
                (None, None) => return Err(LoadError::Config(
                    "Nemotron-H config has neither hybrid_override_pattern nor layers_block_type"
                        .into(),
                )),
            };
        chars
            .iter()
            .map(|c| match c.as_str() {
                "M" => Ok(BlockType::Mamba),
                "*" => Ok(BlockType::Attention),
                "-" => Ok(BlockType::Mlp),
                "E" => Err(LoadError::Config(
                    "Nemotron-H mixture-of-experts blocks (`E`) are not supported yet".into(),
                )),
                other => Err(LoadError::Config(format!(
                    "Nemotron-H block {other:?} in hybrid_override_pattern is not M, *, - or E"
                ))),
            })
            .collect()
    }
}

/// Attention without positional embedding, over the layer's KV cache.
struct NopeAttention {
    proj: AttnProjections,
    scale: f32,
}

/// `down(relu(up(x))²)`.
struct Relu2Mlp {
    up_proj: Linear,
    down_proj: Linear,
}

enum Mixer {
    Attention(NopeAttention),
    Mlp(Relu2Mlp),
}

/// A pre-norm residual block around attention or an MLP.
struct Block {
    norm: RmsNorm,
    mixer: Mixer,
}

impl BackboneBlock for Block {
    fn kind(&self) -> Option<LayerKind> {
        match self.mixer {
            Mixer::Attention(_) => Some(LayerKind::Attention { window: None }),
            Mixer::Mlp(_) => None,
        }
    }

    fn forward(&self, h: &Array, cache: Option<&mut LayerCache>) -> Result<Array, Exception> {
        let x = self.norm.forward(h)?;
        let r = match &self.mixer {
            Mixer::Attention(a) => {
                let cache = cache.ok_or_else(missing_cache)?;
                let (q, k, v) = a.proj.project(&x)?;
                let out = attend_with(&q, &k, &v, &prerotated_opts(a.scale, None), cache)?;
                a.proj.o_proj.forward(&out)?
            }
            Mixer::Mlp(m) => {
                let up = relu(m.up_proj.forward(&x)?)?;
                m.down_proj.forward(&up.square()?)?
            }
        };
        h.add(&r)
    }
}

impl Parameters for Block {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match &self.mixer {
            Mixer::Attention(a) => p.add(&a.proj),
            Mixer::Mlp(m) => p.add(&m.up_proj).add(&m.down_proj),
        };
        p.add(&self.norm);
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Nemotron-H", config)?;
    let blocks = c.blocks()?;
    check_heads(c.num_attention_heads, c.num_key_value_heads)?;
    let head_dim = c
        .head_dim
        .unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
    let inner = c.mamba_num_heads * c.mamba_head_dim;
    let shape = MixerShape {
        heads: c.mamba_num_heads,
        head_dim: c.mamba_head_dim,
        groups: c.n_groups,
        state_size: c.ssm_state_size,
        conv_kernel: c.conv_kernel,
        time_step_limit: c.time_step_limit.unwrap_or((0.0, f32::INFINITY)),
        norm_eps: c.layer_norm_epsilon,
        norm: MixerNorm::GateThenNorm {
            group_size: if c.n_groups > 0 {
                inner / c.n_groups
            } else {
                0
            },
        },
        cast_d: true,
        in_proj_bias: c.mamba_proj_bias,
        out_proj_bias: c.mamba_proj_bias,
        conv_bias: c.use_conv_bias,
    };
    let mut built: Vec<Box<dyn BackboneBlock>> = Vec::with_capacity(blocks.len());
    for (i, kind) in blocks.iter().enumerate() {
        let p = format!("backbone.layers.{i}");
        let norm = RmsNorm::load(w, &format!("{p}.norm"), c.layer_norm_epsilon)?;
        let m = format!("{p}.mixer");
        built.push(match kind {
            BlockType::Mamba => Box::new(MixerBlock {
                norm,
                mixer: Mamba2Mixer::load(w, &m, shape, "Nemotron-H")?,
            }),
            BlockType::Attention => Box::new(Block {
                norm,
                mixer: Mixer::Attention(NopeAttention {
                    proj: AttnProjections::load(
                        w,
                        &m,
                        c.num_attention_heads,
                        c.num_key_value_heads,
                        c.attention_bias,
                        c.attention_bias,
                    )?,
                    scale: (head_dim as f32).powf(-0.5),
                }),
            }),
            BlockType::Mlp => Box::new(Block {
                norm,
                mixer: Mixer::Mlp(Relu2Mlp {
                    up_proj: Linear::load(w, &format!("{m}.up_proj"), c.mlp_bias)?,
                    down_proj: Linear::load(w, &format!("{m}.down_proj"), c.mlp_bias)?,
                }),
            }),
        });
    }
    let attention = blocks
        .iter()
        .filter(|&&b| b == BlockType::Attention)
        .count();
    let mixers = blocks.iter().filter(|&&b| b == BlockType::Mamba).count();
    let sizes = BackboneSizes {
        vocab_size: c.vocab_size,
        context_length: c.max_position_embeddings,
        kv_elements_per_token: attention * 2 * (c.num_key_value_heads * head_dim) as usize,
        head_dim,
        mixer: Some(shape),
        mixers,
    };
    // Multi-token-prediction layers, which mlx-lm's `sanitize` drops.
    for name in w.names() {
        if name.starts_with("mtp.") {
            w.discard(&name);
        }
    }
    // mlx-lm's Nemotron-H always has its own head.
    Backbone::load(w, config, built, c.layer_norm_epsilon, false, sizes)
}
