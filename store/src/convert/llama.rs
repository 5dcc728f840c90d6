//! The `llama` GGUF architecture (Llama, SmolLM, Mistral-style checkpoints): hyper-parameters,
//! tensor names, and the Hugging Face / mlx-lm `config.json`.
use serde_json::{json, Value};

pub use super::arch::TensorRole;
use super::arch::{Param, TensorMap};
use super::gguf::{GgmlType, GgufFile};
use super::ConvertError;

/// The tensor in which llama.cpp stores Llama 3.1+ rope scaling: one factor per rotary
/// frequency. It becomes config.json's `rope_scaling`, not a weight.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// Llama 3's rope scaling, as config.json writes it: `(factor, low_freq_factor,
/// high_freq_factor, original_max_position_embeddings)`.
type Llama3Rope = (f64, f64, f64, f64);

/// llama.cpp's `rope_freqs` for Llama 3 rope scaling (convert_hf_to_gguf.py's formula).
fn llama3_factors(
    head_dim: usize,
    base: f64,
    (factor, low, high, old_len): Llama3Rope,
) -> Vec<f64> {
    let (low_wavelen, high_wavelen) = (old_len / low, old_len / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_len / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// The `rope_scaling` that reproduces the GGUF's [`ROPE_FREQS`] tensor, if it has one. The
/// factor is the tensor's largest entry; the other parameters are those of every Llama 3.1 /
/// 3.2 release (low 1, high 4, original context 8192, which convert_hf_to_gguf.py also
/// assumes). A tensor those do not reproduce is an error rather than a guess.
fn rope_freqs_scaling(
    g: &GgufFile,
    head_dim: usize,
    base: f64,
) -> Result<Option<Value>, ConvertError> {
    let Some(info) = g.tensors.iter().find(|t| t.name == ROPE_FREQS) else {
        return Ok(None);
    };
    if info.ggml_type != GgmlType::F32 || info.dims != [head_dim as u64 / 2] {
        return Err(ConvertError::Unsupported(format!(
            "{ROPE_FREQS} is {:?} {:?}; expected F32 [{}] (one factor per rotary frequency)",
            info.ggml_type,
            info.dims,
            head_dim / 2
        )));
    }
    let got: Vec<f64> = g
        .tensor_data(info)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    if let Some(bad) = got.iter().find(|f| !f.is_finite() || **f <= 0.0) {
        return Err(ConvertError::Unsupported(format!(
            "{ROPE_FREQS} holds {bad}; rope factors are positive numbers"
        )));
    }
    let factor = got.iter().copied().fold(f64::MIN, f64::max);
    let params = (factor, 1.0, 4.0, 8192.0);
    let want = llama3_factors(head_dim, base, params);
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| ((g - w) / w).abs())
        .fold(0.0, f64::max);
    if worst > 1e-5 {
        return Err(ConvertError::Unsupported(format!(
            "{ROPE_FREQS} does not match Llama 3 rope scaling with factor {factor}, low_freq_factor 1, high_freq_factor 4, original context 8192 (relative difference {worst:.2e})"
        )));
    }
    if factor == 1.0 && got.iter().all(|&f| f == 1.0) {
        return Ok(None);
    }
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": params.1,
        "high_freq_factor": params.2,
        "original_max_position_embeddings": params.3,
    })))
}

/// Hyper-parameters read from `llama.*` metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaParams {
    pub n_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub context_length: usize,
    pub vocab_size: usize,
    /// `rope_scaling` for config.json: linear when the file asks for it, Llama 3 when it
    /// carries [`ROPE_FREQS`].
    pub rope_scaling: Option<Value>,
}

fn usize_key(g: &GgufFile, key: &str) -> Result<usize, ConvertError> {
    let v = g.u64(key)?;
    usize::try_from(v)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| ConvertError::Unsupported(format!("{key} is {v}; it must be positive")))
}

impl LlamaParams {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ConvertError> {
        let hidden_size = usize_key(g, "llama.embedding_length")?;
        let n_heads = usize_key(g, "llama.attention.head_count")?;
        let n_kv_heads = match g.opt_u64("llama.attention.head_count_kv")? {
            Some(_) => usize_key(g, "llama.attention.head_count_kv")?,
            None => n_heads,
        };
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(ConvertError::Unsupported(format!(
                "llama.attention.head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
            )));
        }
        let head_dim = match g.opt_u64("llama.attention.key_length")? {
            Some(_) => usize_key(g, "llama.attention.key_length")?,
            None => {
                if !hidden_size.is_multiple_of(n_heads) {
                    return Err(ConvertError::Unsupported(format!(
                        "llama.embedding_length {hidden_size} is not a multiple of head_count {n_heads}"
                    )));
                }
                hidden_size / n_heads
            }
        };
        if let Some(v) = g.opt_u64("llama.attention.value_length")? {
            if v as usize != head_dim {
                return Err(ConvertError::Unsupported(format!(
                    "llama.attention.value_length {v} differs from the key length {head_dim}"
                )));
            }
        }
        if let Some(rot) = g.opt_u64("llama.rope.dimension_count")? {
            if rot as usize != head_dim {
                return Err(ConvertError::Unsupported(format!(
                    "llama.rope.dimension_count {rot} differs from the head dimension {head_dim} (partial rotary embeddings are not supported)"
                )));
            }
        }
        let rope_theta = match g.get("llama.rope.freq_base") {
            Some(_) => g.f64("llama.rope.freq_base")?,
            // The Llama default.
            None => 10000.0,
        };
        let rope_scaling = match g.get("llama.rope.scaling.type") {
            None => None,
            Some(_) => match g.str("llama.rope.scaling.type")? {
                "none" => None,
                "linear" => {
                    let factor = g.f64("llama.rope.scaling.factor")?;
                    Some(json!({"type": "linear", "factor": factor}))
                }
                other => {
                    return Err(ConvertError::Unsupported(format!(
                        "llama.rope.scaling.type {other:?} (supported: none, linear)"
                    )))
                }
            },
        };
        let rope_scaling = match (rope_scaling, rope_freqs_scaling(g, head_dim, rope_theta)?) {
            (Some(_), Some(_)) => {
                return Err(ConvertError::Unsupported(format!(
                    "both llama.rope.scaling.type and {ROPE_FREQS} scale the rotary embeddings"
                )))
            }
            (a, b) => a.or(b),
        };
        let tokens = g.array("tokenizer.ggml.tokens")?.len();
        let vocab_size = match g.opt_u64("llama.vocab_size")? {
            Some(v) => v as usize,
            None => tokens,
        };
        if vocab_size != tokens {
            return Err(ConvertError::Unsupported(format!(
                "llama.vocab_size {vocab_size} differs from the {tokens} tokens in tokenizer.ggml.tokens"
            )));
        }
        Ok(Self {
            n_layers: usize_key(g, "llama.block_count")?,
            hidden_size,
            intermediate_size: usize_key(g, "llama.feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_norm_eps: g.f64("llama.attention.layer_norm_rms_epsilon")?,
            rope_theta,
            context_length: usize_key(g, "llama.context_length")?,
            vocab_size,
            rope_scaling,
        })
    }

    /// The tensors a checkpoint must hold: `(GGUF name, role)`. `output.weight` is optional
    /// (absent when the embeddings are tied) and is not listed.
    pub fn required_tensors(&self) -> Vec<String> {
        let mut names = vec![
            "token_embd.weight".to_string(),
            "output_norm.weight".to_string(),
        ];
        for l in 0..self.n_layers {
            for t in [
                "attn_norm",
                "attn_q",
                "attn_k",
                "attn_v",
                "attn_output",
                "ffn_norm",
                "ffn_gate",
                "ffn_up",
                "ffn_down",
            ] {
                names.push(format!("blk.{l}.{t}.weight"));
            }
        }
        names
    }
}

/// Maps a GGUF tensor name onto its Hugging Face module, or errors naming the tensor.
pub fn tensor_role(p: &LlamaParams, name: &str) -> Result<TensorRole, ConvertError> {
    let unknown = || ConvertError::UnknownTensor {
        name: name.to_string(),
        arch: "llama".into(),
    };
    let base = name.strip_suffix(".weight").ok_or_else(unknown)?;
    let (h, v, q_rows, kv_rows) = (
        p.hidden_size,
        p.vocab_size,
        p.n_heads * p.head_dim,
        p.n_kv_heads * p.head_dim,
    );
    let role = |module: String, shape: Vec<usize>, unpermute_heads: Option<usize>| TensorRole {
        unpermute_heads,
        ..TensorRole::plain(module, Param::Weight, shape)
    };
    Ok(match base {
        "token_embd" => role("model.embed_tokens".into(), vec![v, h], None),
        "output_norm" => role("model.norm".into(), vec![h], None),
        "output" => role("lm_head".into(), vec![v, h], None),
        _ => {
            let rest = base.strip_prefix("blk.").ok_or_else(unknown)?;
            let (layer, part) = rest.split_once('.').ok_or_else(unknown)?;
            let layer: usize = layer.parse().map_err(|_| unknown())?;
            if layer >= p.n_layers || layer.to_string() != rest[..rest.len() - part.len() - 1] {
                return Err(unknown());
            }
            let m = |s: &str| format!("model.layers.{layer}.{s}");
            match part {
                "attn_norm" => role(m("input_layernorm"), vec![h], None),
                "ffn_norm" => role(m("post_attention_layernorm"), vec![h], None),
                "attn_q" => role(m("self_attn.q_proj"), vec![q_rows, h], Some(p.n_heads)),
                "attn_k" => role(m("self_attn.k_proj"), vec![kv_rows, h], Some(p.n_kv_heads)),
                "attn_v" => role(m("self_attn.v_proj"), vec![kv_rows, h], None),
                "attn_output" => role(m("self_attn.o_proj"), vec![h, q_rows], None),
                "ffn_gate" => role(m("mlp.gate_proj"), vec![p.intermediate_size, h], None),
                "ffn_up" => role(m("mlp.up_proj"), vec![p.intermediate_size, h], None),
                "ffn_down" => role(m("mlp.down_proj"), vec![h, p.intermediate_size], None),
                _ => return Err(unknown()),
            }
        }
    })
}

impl TensorMap for LlamaParams {
    fn role(&self, name: &str) -> Result<Option<TensorRole>, ConvertError> {
        if name == ROPE_FREQS {
            // Read into config.json's rope_scaling by `LlamaParams::from_gguf`.
            return Ok(None);
        }
        tensor_role(self, name).map(Some)
    }

    fn required(&self) -> Vec<String> {
        self.required_tensors()
    }
}

/// Token ids that config.json repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

/// config.json in the form Hugging Face and mlx-lm read.
pub fn config_json(
    p: &LlamaParams,
    tie_word_embeddings: bool,
    ids: SpecialIds,
    quantization: Option<Value>,
    float_dtype: super::FloatDtype,
) -> Value {
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads,
        "num_key_value_heads": p.n_kv_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "max_position_embeddings": p.context_length,
        "vocab_size": p.vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": float_dtype.torch_name(),
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
    });
    let obj = c.as_object_mut().expect("built as an object");
    if let Some(s) = &p.rope_scaling {
        obj.insert("rope_scaling".into(), s.clone());
    }
    if let Some(q) = quantization {
        obj.insert("quantization".into(), q.clone());
        // mlx-lm writes both keys; transformers-style readers look for the second.
        obj.insert("quantization_config".into(), q);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> LlamaParams {
        LlamaParams {
            n_layers: 2,
            hidden_size: 64,
            intermediate_size: 96,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            context_length: 128,
            vocab_size: 100,
            rope_scaling: None,
        }
    }

    #[test]
    fn maps_names() {
        let p = params();
        let r = tensor_role(&p, "blk.1.attn_k.weight").unwrap();
        assert_eq!(r.module, "model.layers.1.self_attn.k_proj");
        assert_eq!(r.shape, vec![32, 64]);
        assert_eq!(r.unpermute_heads, Some(2));
        let r = tensor_role(&p, "blk.0.ffn_down.weight").unwrap();
        assert_eq!(r.module, "model.layers.0.mlp.down_proj");
        assert_eq!(r.shape, vec![64, 96]);
        assert_eq!(tensor_role(&p, "output.weight").unwrap().module, "lm_head");
        for bad in [
            "blk.2.attn_q.weight",
            "blk.01.attn_q.weight",
            "blk.0.attn_q.bias",
            "rope_freqs.weight",
            "blk.0.attn_qkv.weight",
        ] {
            let e = tensor_role(&p, bad).unwrap_err();
            assert!(e.to_string().contains(bad), "{e}");
        }
        assert_eq!(p.required_tensors().len(), 2 + 2 * 9);
    }
}
