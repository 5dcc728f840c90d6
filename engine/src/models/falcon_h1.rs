//! Falcon-H1 (TII): each layer runs a Mamba-2 mixer and rotary attention side by side on the
//! same normalised input and adds both to the residual, then a SwiGLU MLP. So each layer keeps
//! two caches, a state and keys/values: the model's cache slots are `[state, kv]` per layer.
//!
//! The µP multipliers are folded into the weights as mlx-lm's `sanitize` does, when the
//! checkpoint is in Hugging Face layout (its convolution kernels `[channels, 1, kernel]`); a
//! checkpoint converted by mlx-lm has them folded already. A tied head scales the logits by
//! `lm_head_multiplier / embedding_multiplier`.
use mlx_rs::error::Exception;
use mlx_rs::Array;
use serde::Deserialize;
use serde_json::Value;

use super::attention::AttnProjections;
use super::config::{check_heads, parse_config};
use super::decoder::{EndScalars, Head, NormKind, Trunk};
use super::info::{model_info_in, KvShape};
use super::layers::{attend_with, AttnOpts, RmsNorm};
use super::mamba2::{Mamba2Mixer, MixerNorm, MixerShape};
use super::mlp::{FeedForward, GatedMlp};
use super::params::{Parameters, Params};
use super::rope::{rope_from_config, ScaledRope};
use super::{CausalLm, ModelInfo};
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

/// The fields of config.json that mlx-lm's `falcon_h1.ModelArgs` reads, with its defaults.
#[derive(Debug, Deserialize)]
struct Config {
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "one")]
    attention_in_multiplier: f32,
    #[serde(default = "attention_out_multiplier")]
    attention_out_multiplier: f32,
    #[serde(default = "embedding_multiplier")]
    embedding_multiplier: f64,
    #[serde(default = "head_dim")]
    head_dim: i32,
    #[serde(default = "lm_head_multiplier")]
    lm_head_multiplier: f64,
    #[serde(default = "yes")]
    mamba_conv_bias: bool,
    #[serde(default = "mamba_d_conv")]
    mamba_d_conv: i32,
    #[serde(default = "head_dim")]
    mamba_d_head: i32,
    #[serde(default = "mamba_d_ssm")]
    mamba_d_ssm: i32,
    #[serde(default = "mamba_d_state")]
    mamba_d_state: i32,
    #[serde(default = "one_group")]
    mamba_n_groups: i32,
    #[serde(default = "mamba_n_heads")]
    mamba_n_heads: i32,
    #[serde(default)]
    mamba_norm_before_gate: bool,
    #[serde(default)]
    mamba_proj_bias: bool,
    #[serde(default)]
    mamba_rms_norm: bool,
    #[serde(default = "max_position_embeddings")]
    max_position_embeddings: usize,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default = "mlp_multipliers")]
    mlp_multipliers: Vec<f32>,
    #[serde(default = "num_attention_heads")]
    num_attention_heads: i32,
    #[serde(default = "num_hidden_layers")]
    num_hidden_layers: usize,
    #[serde(default = "num_key_value_heads")]
    num_key_value_heads: i32,
    #[serde(default)]
    projectors_bias: bool,
    #[serde(default = "rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default)]
    rope_traditional: bool,
    rope_scaling: Option<Value>,
    #[serde(default = "rope_theta")]
    rope_theta: f32,
    #[serde(default = "ssm_in_multiplier")]
    ssm_in_multiplier: f32,
    #[serde(default = "ssm_multipliers")]
    ssm_multipliers: Vec<f32>,
    #[serde(default = "ssm_out_multiplier")]
    ssm_out_multiplier: f32,
    #[serde(default = "vocab_size")]
    vocab_size: usize,
    #[serde(default = "yes")]
    tie_word_embeddings: bool,
}

fn one() -> f32 {
    1.0
}
fn yes() -> bool {
    true
}
fn one_group() -> i32 {
    1
}
fn attention_out_multiplier() -> f32 {
    0.9375
}
fn embedding_multiplier() -> f64 {
    5.656854249492381
}
fn head_dim() -> i32 {
    64
}
fn lm_head_multiplier() -> f64 {
    0.0390625
}
fn mamba_d_conv() -> i32 {
    4
}
fn mamba_d_ssm() -> i32 {
    1536
}
fn mamba_d_state() -> i32 {
    128
}
fn mamba_n_heads() -> i32 {
    24
}
fn max_position_embeddings() -> usize {
    131072
}
fn mlp_multipliers() -> Vec<f32> {
    vec![0.883_883_5, 0.5859375]
}
fn num_attention_heads() -> i32 {
    8
}
fn num_hidden_layers() -> usize {
    36
}
fn num_key_value_heads() -> i32 {
    2
}
fn rms_norm_eps() -> f32 {
    1e-5
}
fn rope_theta() -> f32 {
    1e11
}
fn ssm_in_multiplier() -> f32 {
    1.25
}
fn ssm_multipliers() -> Vec<f32> {
    vec![0.353_553_4, 0.25, 0.353_553_4, 0.5, 0.353_553_4]
}
fn ssm_out_multiplier() -> f32 {
    0.235_702_26
}
fn vocab_size() -> usize {
    32784
}

/// Multiplies the weight `name` by `factor` (`[rows]` per output row, or one scalar).
fn fold(w: &mut Weights, name: &str, factor: &Array) -> Result<(), LoadError> {
    if let Some(a) = w.remove_raw(name) {
        let folded = a
            .multiply(factor.as_dtype(a.dtype()).map_err(LoadError::from)?)
            .map_err(LoadError::from)?;
        w.insert(name.to_owned(), folded);
    }
    Ok(())
}

/// mlx-lm's `sanitize` for a Hugging Face checkpoint: every µP multiplier folded into the
/// weight it scales, convolution kernels moved to MLX's layout (done by the mixer's load).
fn fold_multipliers(w: &mut Weights, c: &Config) -> Result<(), LoadError> {
    let scalar = |m: f32| Array::from_f32(m);
    let m = &c.mlp_multipliers;
    let s = &c.ssm_multipliers;
    if m.len() != 2 || s.len() != 5 {
        return Err(LoadError::Config(format!(
            "Falcon-H1 mlp_multipliers has {} values (2 expected) and ssm_multipliers {} (5)",
            m.len(),
            s.len()
        )));
    }
    // One multiplier per output row of `in_proj`: gate and SSM input (d_ssm each), B and C
    // (groups × state each), the time steps (one per head).
    let groups_state = c.mamba_n_groups * c.mamba_d_state;
    let sizes = [
        c.mamba_d_ssm,
        c.mamba_d_ssm,
        groups_state,
        groups_state,
        c.mamba_n_heads,
    ];
    let mup: Vec<f32> = sizes
        .iter()
        .zip(s)
        .flat_map(|(&n, &f)| std::iter::repeat_n(f * c.ssm_in_multiplier, n as usize))
        .collect();
    let mup = Array::from_slice(&mup, &[mup.len() as i32, 1]);
    fold(
        w,
        "model.embed_tokens.weight",
        &scalar(c.embedding_multiplier as f32),
    )?;
    fold(w, "lm_head.weight", &scalar(c.lm_head_multiplier as f32))?;
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        fold(
            w,
            &format!("{a}.q_proj.weight"),
            &scalar(c.attention_in_multiplier),
        )?;
        fold(
            w,
            &format!("{a}.k_proj.weight"),
            &scalar(c.attention_in_multiplier),
        )?;
        fold(
            w,
            &format!("{a}.o_proj.weight"),
            &scalar(c.attention_out_multiplier),
        )?;
        fold(
            w,
            &format!("{p}.mamba.out_proj.weight"),
            &scalar(c.ssm_out_multiplier),
        )?;
        fold(w, &format!("{p}.mamba.in_proj.weight"), &mup)?;
        let f = format!("{p}.feed_forward");
        fold(w, &format!("{f}.gate_proj.weight"), &scalar(m[0]))?;
        fold(w, &format!("{f}.down_proj.weight"), &scalar(m[1]))?;
    }
    Ok(())
}

struct Layer {
    input_layernorm: RmsNorm,
    mamba: Mamba2Mixer,
    attn: AttnProjections,
    rope: ScaledRope,
    scale: f32,
    pre_ff_layernorm: RmsNorm,
    feed_forward: GatedMlp,
}

impl Layer {
    /// `caches` is this layer's `[state, kv]`.
    fn forward(&self, h: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let [state, kv] = caches else {
            return Err(Exception::custom(format!(
                "a Falcon-H1 layer got {} caches, not 2",
                caches.len()
            )));
        };
        let x = self.input_layernorm.forward(h)?;
        let mamba = self.mamba.forward(&x, state)?;
        let (q, k, v) = self.attn.project(&x)?;
        let opts = AttnOpts::rotary(&self.rope.rope, self.scale);
        let attn = self
            .attn
            .o_proj
            .forward(&attend_with(&q, &k, &v, &opts, kv)?)?;
        let h = h.add(&mamba)?.add(&attn)?;
        h.add(
            &self
                .feed_forward
                .forward(&self.pre_ff_layernorm.forward(&h)?)?,
        )
    }
}

impl Parameters for Layer {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.input_layernorm)
            .add(&self.mamba)
            .add(&self.attn)
            .add(&self.pre_ff_layernorm)
            .add(&self.feed_forward);
    }
}

struct FalconH1 {
    trunk: Trunk,
    layers: Vec<Layer>,
    info: ModelInfo,
}

impl CausalLm for FalconH1 {
    fn hidden(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.trunk.embed(tokens)?;
        for (layer, pair) in self.layers.iter().zip(caches.chunks_mut(2)) {
            h = layer.forward(&h, pair)?;
        }
        Ok(h)
    }

    fn head(&self, hidden: &Array) -> Result<Array, Exception> {
        self.trunk.logits(hidden)
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn layer_kinds(&self) -> Vec<LayerKind> {
        self.layers
            .iter()
            .flat_map(|_| {
                [
                    LayerKind::State { slots: 2 },
                    LayerKind::Attention { window: None },
                ]
            })
            .collect()
    }
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c: Config = parse_config("Falcon-H1", config)?;
    check_heads(c.num_attention_heads, c.num_key_value_heads)?;
    if c.num_hidden_layers == 0 {
        return Err(LoadError::Config("Falcon-H1 with no layers".into()));
    }
    // Hugging Face layout keeps the multipliers apart (mlx-lm's `sanitize` test).
    let conv = w.remove_raw("model.layers.0.mamba.conv1d.weight");
    let hf_layout = conv
        .as_ref()
        .is_some_and(|a| a.ndim() == 3 && a.shape()[2] > a.shape()[1]);
    if let Some(a) = conv {
        w.insert("model.layers.0.mamba.conv1d.weight".into(), a);
    }
    if hf_layout {
        fold_multipliers(w, &c)?;
    }
    let shape = MixerShape {
        heads: c.mamba_n_heads,
        head_dim: c.mamba_d_head,
        groups: c.mamba_n_groups,
        state_size: c.mamba_d_state,
        conv_kernel: c.mamba_d_conv,
        time_step_limit: (0.0, f32::INFINITY),
        norm_eps: c.rms_norm_eps,
        norm: match (c.mamba_rms_norm, c.mamba_norm_before_gate) {
            (false, _) => MixerNorm::GateOnly,
            (true, true) => MixerNorm::NormThenGate,
            (true, false) => MixerNorm::GateThenNorm {
                group_size: c.mamba_d_ssm,
            },
        },
        cast_d: false,
        in_proj_bias: c.mamba_proj_bias,
        out_proj_bias: c.projectors_bias,
        conv_bias: c.mamba_conv_bias,
    };
    if c.mamba_n_heads * c.mamba_d_head != c.mamba_d_ssm {
        return Err(LoadError::Config(format!(
            "Falcon-H1 mamba_n_heads {} × mamba_d_head {} is not mamba_d_ssm {}",
            c.mamba_n_heads, c.mamba_d_head, c.mamba_d_ssm
        )));
    }
    let rope = ScaledRope::unscaled(rope_from_config(
        c.head_dim,
        c.rope_theta,
        c.rope_traditional,
        c.rope_scaling.as_ref(),
    )?);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        layers.push(Layer {
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), c.rms_norm_eps)?,
            mamba: Mamba2Mixer::load(w, &format!("{p}.mamba"), shape, "Falcon-H1")?,
            attn: AttnProjections::load(
                w,
                &format!("{p}.self_attn"),
                c.num_attention_heads,
                c.num_key_value_heads,
                c.attention_bias,
                c.attention_bias,
            )?,
            rope: rope.clone(),
            scale: (c.head_dim as f32).powf(-0.5),
            pre_ff_layernorm: RmsNorm::load(w, &format!("{p}.pre_ff_layernorm"), c.rms_norm_eps)?,
            feed_forward: GatedMlp::load(w, &format!("{p}.feed_forward"), c.mlp_bias)?,
        });
    }
    let head = if c.tie_word_embeddings {
        Head::TiedStrict
    } else {
        Head::Own
    };
    let scalars = EndScalars {
        logits_scale: c
            .tie_word_embeddings
            .then(|| (c.lm_head_multiplier / c.embedding_multiplier) as f32),
        ..EndScalars::default()
    };
    let trunk = Trunk::load_with_norm(
        w,
        "",
        "final_layernorm",
        NormKind::Rms {
            eps: c.rms_norm_eps,
        },
        head,
    )?
    .with_scalars(scalars);
    let n = c.num_hidden_layers;
    let kv = KvShape {
        layers: 2 * n,
        elements_per_token: n * 2 * (c.num_key_value_heads * c.head_dim) as usize,
        head_dim: c.head_dim,
    };
    let mut info = model_info_in(
        config,
        c.vocab_size,
        c.max_position_embeddings,
        kv,
        trunk.activation_dtype(),
    );
    info.state_bytes_per_sequence = n * shape.state_bytes(info.kv_dtype_bytes);
    let mut model = FalconH1 {
        trunk,
        layers,
        info,
    };
    let mut p = Params::default();
    model.trunk.push_params_around(&model.layers, &mut p);
    model.info.weight_bytes = p.materialize(w.reporter())?;
    Ok(Box::new(model))
}
