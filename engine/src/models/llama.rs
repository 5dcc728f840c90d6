//! The Llama family: Llama 2/3.x, SmolLM, Mistral, and Qwen2/2.5 (biases on q/k/v).
use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::layers::{attend, split_heads, swiglu, Linear, Matrix, RmsNorm, Rope};
use super::{eos_ids, CausalLm, ModelInfo};
use crate::cache::LayerCache;
use crate::loader::{LoadError, Weights};

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

fn default_rope_theta() -> f32 {
    10000.0
}

fn default_true() -> bool {
    true
}

impl Config {
    pub fn from_json(config: &Value) -> Result<Self, LoadError> {
        serde_json::from_value(config.clone()).map_err(|e| LoadError::Config(e.to_string()))
    }

    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}

/// Builds the rotary embedding a config asks for: plain or linear scaling, or Llama 3's
/// frequency smoothing. Other schemes are refused rather than silently ignored.
pub fn rope_from_config(
    dims: i32,
    base: f32,
    traditional: bool,
    scaling: Option<&Value>,
) -> Result<Rope, LoadError> {
    let plain = |scale: f32| Rope {
        dims,
        traditional,
        base,
        scale,
        freqs: None,
    };
    let Some(scaling) = scaling.filter(|s| !s.is_null()) else {
        return Ok(plain(1.0));
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str, default: f64| {
        scaling.get(key).and_then(Value::as_f64).unwrap_or(default) as f32
    };
    match kind {
        "default" => Ok(plain(1.0)),
        "linear" => Ok(plain(1.0 / num("factor", 1.0))),
        "llama3" => {
            let factor = num("factor", 1.0);
            let low = num("low_freq_factor", 1.0);
            let high = num("high_freq_factor", 4.0);
            let old_len = num("original_max_position_embeddings", 8192.0);
            let low_wavelen = old_len / low;
            let high_wavelen = old_len / high;
            let freqs: Vec<f32> = (0..dims / 2)
                .map(|i| {
                    let freq = base.powf((2 * i) as f32 / dims as f32);
                    let wavelen = 2.0 * std::f32::consts::PI * freq;
                    let scaled = if wavelen > low_wavelen {
                        freq * factor
                    } else {
                        freq
                    };
                    if wavelen > high_wavelen && wavelen < low_wavelen {
                        let smooth = (old_len / wavelen - low) / (high - low);
                        scaled / ((1.0 - smooth) / factor + smooth)
                    } else {
                        scaled
                    }
                })
                .collect();
            Ok(Rope {
                dims,
                traditional,
                base,
                scale: 1.0,
                freqs: Some(Array::from_slice(&freqs, &[dims / 2])),
            })
        }
        other => Err(LoadError::Config(format!(
            "unsupported rope_scaling type {other:?}"
        ))),
    }
}

pub(crate) struct Attention {
    /// Qwen3 normalises each query and key head before RoPE.
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    heads: i32,
    kv_heads: i32,
    scale: f32,
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> Result<Self, LoadError> {
        Ok(Self {
            gate_proj: Linear::load(w, &format!("{prefix}.gate_proj"), bias)?,
            up_proj: Linear::load(w, &format!("{prefix}.up_proj"), bias)?,
            down_proj: Linear::load(w, &format!("{prefix}.down_proj"), bias)?,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array, Exception> {
        self.down_proj.forward(&swiglu(
            &self.gate_proj.forward(x)?,
            &self.up_proj.forward(x)?,
        )?)
    }
}

struct Block {
    attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

pub struct Llama {
    embed_tokens: Matrix,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Matrix>,
    rope: Rope,
    info: ModelInfo,
}

pub fn build(config: &Value, w: &mut Weights) -> Result<Box<dyn CausalLm>, LoadError> {
    let c = Config::from_json(config)?;
    // Qwen2 puts biases on q/k/v (not o) without saying so in its config.
    let qkv_bias = c.attention_bias || c.model_type == "qwen2";
    build_decoder(
        config,
        &c,
        w,
        Variant {
            qkv_bias,
            qk_norm: false,
        },
    )
}

/// What distinguishes the members of the family that share this decoder.
pub(crate) struct Variant {
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

pub(crate) fn build_decoder(
    config: &Value,
    c: &Config,
    w: &mut Weights,
    variant: Variant,
) -> Result<Box<dyn CausalLm>, LoadError> {
    let Variant { qkv_bias, qk_norm } = variant;
    let rope = rope_from_config(
        c.head_dim(),
        c.rope_theta,
        c.rope_traditional,
        c.rope_scaling.as_ref(),
    )?;
    let head_dim = c.head_dim();
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        layers.push(Block {
            attn: Attention {
                q_norm: qk_norm
                    .then(|| RmsNorm::load(w, &format!("{p}.self_attn.q_norm"), c.rms_norm_eps))
                    .transpose()?,
                k_norm: qk_norm
                    .then(|| RmsNorm::load(w, &format!("{p}.self_attn.k_norm"), c.rms_norm_eps))
                    .transpose()?,
                q_proj: Linear::load(w, &format!("{p}.self_attn.q_proj"), qkv_bias)?,
                k_proj: Linear::load(w, &format!("{p}.self_attn.k_proj"), qkv_bias)?,
                v_proj: Linear::load(w, &format!("{p}.self_attn.v_proj"), qkv_bias)?,
                o_proj: Linear::load(w, &format!("{p}.self_attn.o_proj"), c.attention_bias)?,
                heads: c.num_attention_heads,
                kv_heads: c.kv_heads(),
                scale: (head_dim as f32).powf(-0.5),
            },
            mlp: Mlp::load(w, &format!("{p}.mlp"), c.mlp_bias)?,
            input_layernorm: RmsNorm::load(w, &format!("{p}.input_layernorm"), c.rms_norm_eps)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                &format!("{p}.post_attention_layernorm"),
                c.rms_norm_eps,
            )?,
        });
        // Precomputed rotary frequencies are recomputed from the config, as mlx-lm does.
        w.discard(&format!("{p}.self_attn.rotary_emb.inv_freq"));
    }
    let embed_tokens = Matrix::load(w, "model.embed_tokens")?;
    let norm = RmsNorm::load(w, "model.norm", c.rms_norm_eps)?;
    let lm_head = if c.tie_word_embeddings {
        // A tied checkpoint may still carry a copy of the embedding as lm_head; it is unused.
        for suffix in ["weight", "scales", "biases"] {
            w.discard(&format!("lm_head.{suffix}"));
        }
        None
    } else {
        Some(Matrix::load(w, "lm_head")?)
    };
    let dtype_bytes = kv_dtype_bytes(&embed_tokens);
    let info = ModelInfo {
        architecture: config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        vocab_size: c.vocab_size,
        num_layers: c.num_hidden_layers,
        context_length: c.max_position_embeddings.unwrap_or(4096),
        weight_bytes: 0,
        kv_bytes_per_token: 2
            * c.num_hidden_layers
            * (c.kv_heads() * head_dim) as usize
            * dtype_bytes,
        eos_token_ids: eos_ids(config),
        kv_dtype_bytes: dtype_bytes,
        head_dim: head_dim as usize,
    };
    let mut model = Llama {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope,
        info,
    };
    model.info.weight_bytes = model.materialize(w.reporter())?;
    Ok(Box::new(model))
}

/// Bytes per element of activations (and so of the KV cache): the dtype of the norms' scale.
pub fn kv_dtype_bytes(embed: &Matrix) -> usize {
    let dtype = match embed {
        Matrix::Dense(w) => w.dtype(),
        Matrix::Quantized { scales, .. } => scales.dtype(),
    };
    match dtype {
        Dtype::Float32 => 4,
        _ => 2,
    }
}

impl Llama {
    fn parameters(&self) -> Vec<&Array> {
        let mut out = Vec::new();
        fn push_matrix<'a>(m: &'a Matrix, out: &mut Vec<&'a Array>) {
            match m {
                Matrix::Dense(w) => out.push(w),
                Matrix::Quantized {
                    weight,
                    scales,
                    biases,
                    ..
                } => {
                    out.push(weight);
                    out.push(scales);
                    out.extend(biases.iter());
                }
            }
        }
        fn push_linear<'a>(l: &'a Linear, out: &mut Vec<&'a Array>) {
            push_matrix(&l.matrix, out);
            out.extend(l.bias.iter());
        }
        push_matrix(&self.embed_tokens, &mut out);
        for b in &self.layers {
            for l in [
                &b.attn.q_proj,
                &b.attn.k_proj,
                &b.attn.v_proj,
                &b.attn.o_proj,
            ] {
                push_linear(l, &mut out);
            }
            for l in [&b.mlp.gate_proj, &b.mlp.up_proj, &b.mlp.down_proj] {
                push_linear(l, &mut out);
            }
            out.extend(b.attn.q_norm.iter().map(|n| &n.weight));
            out.extend(b.attn.k_norm.iter().map(|n| &n.weight));
            out.push(&b.input_layernorm.weight);
            out.push(&b.post_attention_layernorm.weight);
        }
        out.push(&self.norm.weight);
        if let Some(h) = &self.lm_head {
            push_matrix(h, &mut out);
        }
        out
    }

    /// Evaluates every parameter (reading it from disk now), reporting the bytes read;
    /// returns the bytes held.
    fn materialize(
        &self,
        reporter: Option<&crate::loader::LoadReporter>,
    ) -> Result<usize, LoadError> {
        crate::loader::materialize(&self.parameters(), reporter)
    }
}

impl Attention {
    fn forward(&self, x: &Array, rope: &Rope, cache: &mut LayerCache) -> Result<Array, Exception> {
        let mut q = split_heads(&self.q_proj.forward(x)?, self.heads)?;
        let mut k = split_heads(&self.k_proj.forward(x)?, self.kv_heads)?;
        if let Some(norm) = &self.q_norm {
            q = norm.forward(&q)?;
        }
        if let Some(norm) = &self.k_norm {
            k = norm.forward(&k)?;
        }
        let v = split_heads(&self.v_proj.forward(x)?, self.kv_heads)?;
        let out = attend(&q, &k, &v, rope, self.scale, cache)?;
        self.o_proj.forward(&out)
    }
}

impl CausalLm for Llama {
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array, Exception> {
        let mut h = self.embed_tokens.rows(tokens)?;
        for (block, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let r = block
                .attn
                .forward(&block.input_layernorm.forward(&h)?, &self.rope, cache)?;
            let hh = h.add(&r)?;
            let r = block
                .mlp
                .forward(&block.post_attention_layernorm.forward(&hh)?)?;
            h = hh.add(&r)?;
        }
        let h = self.norm.forward(&h)?;
        match &self.lm_head {
            Some(head) => head.matmul_t(&h),
            None => self.embed_tokens.matmul_t(&h),
        }
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }
}
