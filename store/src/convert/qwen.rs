//! The `qwen2`, `qwen3` and `qwen3moe` GGUF architectures (Qwen2/2.5, Qwen3, Qwen3-MoE):
//! hyper-parameters, tensor names and the mlx-lm `config.json`.
//!
//! llama.cpp writes the Hugging Face tensors under its own names and otherwise unchanged: these
//! architectures use NEOX-style rotary embeddings, so Q and K are not permuted as for `llama`.
//! Qwen2 adds biases to Q, K and V; Qwen3 normalises each query and key head (`attn_q_norm`,
//! `attn_k_norm`); Qwen3-MoE replaces the MLP of every layer with a router (`ffn_gate_inp`)
//! and experts stacked into `[experts, out, in]` tensors (`ffn_{gate,up,down}_exps`), which is
//! mlx-lm's own `switch_mlp` layout. llama.cpp always renormalises the chosen experts'
//! weights for `qwen3moe` (`norm_topk_prob`), and builds every layer sparse.
use serde_json::json;

use super::arch::{
    f32_json, linear_rope_scaling, ArchPlan, Common, Meta, Param, TensorRole, TensorTable,
};
use super::gguf::GgufFile;
use super::ConvertError;

/// Which of the three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    Qwen2,
    Qwen3,
    Qwen3Moe,
}

impl Variant {
    pub fn from_arch(arch: &str) -> Option<Self> {
        match arch {
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            "qwen3moe" => Some(Self::Qwen3Moe),
            _ => None,
        }
    }

    fn arch(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3moe",
        }
    }
}

/// The experts of a Qwen3-MoE layer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Experts {
    count: usize,
    used: usize,
    ffn: usize,
}

/// llama.cpp's `expert_gating_func` value for softmax, the only router Qwen3-MoE has.
const GATING_SOFTMAX: u64 = 1;

fn experts(m: &Meta) -> Result<Experts, ConvertError> {
    let count = m.usize("expert_count")?;
    let used = m.usize("expert_used_count")?;
    if used > count {
        return Err(ConvertError::Unsupported(format!(
            "{} {used} is more than {} {count}",
            m.key("expert_used_count"),
            m.key("expert_count")
        )));
    }
    if let Some(n) = m.opt_u64("expert_shared_count")? {
        if n != 0 {
            return Err(ConvertError::Unsupported(format!(
                "{} {n}: shared experts are not part of Qwen3-MoE",
                m.key("expert_shared_count")
            )));
        }
    }
    if let Some(f) = m.opt_u64("expert_gating_func")? {
        if f != GATING_SOFTMAX {
            return Err(ConvertError::Unsupported(format!(
                "{} {f}: Qwen3-MoE routes with a softmax (1)",
                m.key("expert_gating_func")
            )));
        }
    }
    Ok(Experts {
        count,
        used,
        ffn: m.usize("expert_feed_forward_length")?,
    })
}

/// Reads the hyper-parameters and lays out the tensors of `variant`.
pub fn plan(g: &GgufFile, variant: Variant) -> Result<ArchPlan, ConvertError> {
    let m = Meta {
        g,
        arch: variant.arch(),
    };
    let c = Common::read(&m)?;
    c.require_full_rotary(&m)?;
    if variant == Variant::Qwen2 && c.head_dim * c.n_heads != c.hidden_size {
        return Err(ConvertError::Unsupported(format!(
            "qwen2.attention.key_length {} is not embedding_length / head_count ({}), which mlx-lm's Qwen2 assumes",
            c.head_dim,
            c.hidden_size / c.n_heads
        )));
    }
    let experts = match variant {
        Variant::Qwen3Moe => Some(experts(&m)?),
        _ => None,
    };
    let rope_scaling = linear_rope_scaling(&m, true)?;

    let (architecture, model_type) = match variant {
        Variant::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Variant::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        Variant::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
    };
    let mut config = c.config(architecture, model_type);
    // mlx-lm's Qwen2 derives the head dimension; Qwen3's reads it.
    if variant != Variant::Qwen2 {
        config.insert("head_dim".into(), json!(c.head_dim));
    }
    if let Some(factor) = rope_scaling {
        config.insert(
            "rope_scaling".into(),
            json!({"type": "linear", "factor": f32_json(factor)}),
        );
    }
    config.insert("hidden_act".into(), json!("silu"));
    if let Some(e) = experts {
        config.insert("num_experts".into(), json!(e.count));
        config.insert("num_experts_per_tok".into(), json!(e.used));
        config.insert("moe_intermediate_size".into(), json!(e.ffn));
        config.insert("decoder_sparse_step".into(), json!(1));
        config.insert("mlp_only_layers".into(), json!([]));
        config.insert("norm_topk_prob".into(), json!(true));
    }

    Ok(ArchPlan {
        config,
        tensors: tensors(&c, variant, experts),
        context_length: c.context_length,
    })
}

fn tensors(c: &Common, variant: Variant, experts: Option<Experts>) -> TensorTable {
    let (h, v, q, kv) = (c.hidden_size, c.vocab_size, c.q_rows(), c.kv_rows());
    let mut t = TensorTable::new(variant.arch());
    t.embedding_and_head(v, h);
    for l in 0..c.n_layers {
        let blk = |s: &str| format!("blk.{l}.{s}");
        let m = |s: &str| format!("model.layers.{l}.{s}");
        t.weight(&blk("attn_norm"), m("input_layernorm"), vec![h]);
        t.weight(&blk("ffn_norm"), m("post_attention_layernorm"), vec![h]);
        t.weight(&blk("attn_q"), m("self_attn.q_proj"), vec![q, h]);
        t.weight(&blk("attn_k"), m("self_attn.k_proj"), vec![kv, h]);
        t.weight(&blk("attn_v"), m("self_attn.v_proj"), vec![kv, h]);
        t.weight(&blk("attn_output"), m("self_attn.o_proj"), vec![h, q]);
        match variant {
            Variant::Qwen2 => {
                for (part, module, rows) in [
                    ("attn_q", "self_attn.q_proj", q),
                    ("attn_k", "self_attn.k_proj", kv),
                    ("attn_v", "self_attn.v_proj", kv),
                ] {
                    t.add(
                        &blk(part),
                        TensorRole::plain(m(module), Param::Bias, vec![rows]),
                        true,
                    );
                }
            }
            Variant::Qwen3 | Variant::Qwen3Moe => {
                t.weight(&blk("attn_q_norm"), m("self_attn.q_norm"), vec![c.head_dim]);
                t.weight(&blk("attn_k_norm"), m("self_attn.k_norm"), vec![c.head_dim]);
            }
        }
        match experts {
            None => {
                let ff = c.intermediate_size;
                t.weight(&blk("ffn_gate"), m("mlp.gate_proj"), vec![ff, h]);
                t.weight(&blk("ffn_up"), m("mlp.up_proj"), vec![ff, h]);
                t.weight(&blk("ffn_down"), m("mlp.down_proj"), vec![h, ff]);
            }
            Some(e) => {
                t.weight(&blk("ffn_gate_inp"), m("mlp.gate"), vec![e.count, h]);
                t.weight(
                    &blk("ffn_gate_exps"),
                    m("mlp.switch_mlp.gate_proj"),
                    vec![e.count, e.ffn, h],
                );
                t.weight(
                    &blk("ffn_up_exps"),
                    m("mlp.switch_mlp.up_proj"),
                    vec![e.count, e.ffn, h],
                );
                t.weight(
                    &blk("ffn_down_exps"),
                    m("mlp.switch_mlp.down_proj"),
                    vec![e.count, h, e.ffn],
                );
            }
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::super::arch::tests::{hparams, open};
    use super::super::arch::TensorMap;
    use super::*;

    fn moe() -> super::super::gguf::tests::GgufBuilder {
        let mut b = hparams("qwen3moe", 2);
        b.kv_u32("qwen3moe.expert_count", 4)
            .kv_u32("qwen3moe.expert_used_count", 2)
            .kv_u32("qwen3moe.expert_feed_forward_length", 32);
        b
    }

    #[test]
    fn qwen3_moe_experts_are_mlx_lm_s_switch_mlp() {
        let (_d, g) = open(&moe());
        let p = plan(&g, Variant::Qwen3Moe).unwrap();
        let c = &p.config;
        assert_eq!(c["architectures"], json!(["Qwen3MoeForCausalLM"]));
        assert_eq!(c["model_type"], "qwen3_moe");
        assert_eq!(
            (
                &c["num_experts"],
                &c["num_experts_per_tok"],
                &c["moe_intermediate_size"]
            ),
            (&json!(4), &json!(2), &json!(32))
        );
        assert_eq!(c["norm_topk_prob"], true);
        assert_eq!(c["mlp_only_layers"], json!([]));
        assert_eq!(c["head_dim"], 16);
        let t = &p.tensors;
        let role = |n: &str| t.role(n).unwrap().unwrap();
        let gate = role("blk.1.ffn_gate_exps.weight");
        assert_eq!(gate.module, "model.layers.1.mlp.switch_mlp.gate_proj");
        assert_eq!(gate.shape, vec![4, 32, 64]);
        assert_eq!(role("blk.1.ffn_down_exps.weight").shape, vec![4, 64, 32]);
        let router = role("blk.0.ffn_gate_inp.weight");
        assert_eq!(
            (router.module.as_str(), router.shape),
            ("model.layers.0.mlp.gate", vec![4, 64])
        );
        assert_eq!(
            role("blk.0.attn_k_norm.weight").module,
            "model.layers.0.self_attn.k_norm"
        );
        for bad in [
            "blk.0.ffn_gate_shexp.weight",
            "blk.0.ffn_gate_up_exps.weight",
            "blk.0.ffn_gate.weight",
            "blk.2.attn_q.weight",
        ] {
            let e = t.role(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains("qwen3moe"), "{e}");
        }
        let required = t.required();
        assert!(required.contains(&"blk.1.ffn_up_exps.weight".to_string()));
        assert!(!required.contains(&"output.weight".to_string()));
        assert_eq!(required.len(), 2 + 2 * 12);
    }

    #[test]
    fn qwen3_moe_routers_other_than_softmax_and_shared_experts_are_refused() {
        let mut b = moe();
        b.kv_u32("qwen3moe.expert_gating_func", 2);
        let (_d, g) = open(&b);
        let e = plan(&g, Variant::Qwen3Moe).unwrap_err().to_string();
        assert!(e.contains("qwen3moe.expert_gating_func 2"), "{e}");
        let mut b = moe();
        b.kv_u32("qwen3moe.expert_shared_count", 1);
        let (_d, g) = open(&b);
        let e = plan(&g, Variant::Qwen3Moe).unwrap_err().to_string();
        assert!(e.contains("qwen3moe.expert_shared_count 1"), "{e}");
    }

    #[test]
    fn qwen2_has_qkv_biases_and_no_head_dim_of_its_own() {
        let (_d, g) = open(&hparams("qwen2", 1));
        let p = plan(&g, Variant::Qwen2).unwrap();
        assert!(p.config.get("head_dim").is_none());
        assert_eq!(p.config["rope_theta"], json!(1_000_000.0));
        let bias = p.tensors.role("blk.0.attn_k.bias").unwrap().unwrap();
        assert_eq!(bias.output_name(), "model.layers.0.self_attn.k_proj.bias");
        assert_eq!(bias.shape, vec![32]);
        assert!(p.tensors.role("blk.0.attn_output.bias").is_err());
        assert!(p.tensors.role("blk.0.attn_q_norm.weight").is_err());
        assert!(p
            .tensors
            .required()
            .contains(&"blk.0.attn_v.bias".to_string()));

        let mut b = hparams("qwen2", 1);
        b.kv_u32("qwen2.attention.key_length", 32);
        let (_d, g) = open(&b);
        let e = plan(&g, Variant::Qwen2).unwrap_err().to_string();
        assert!(e.contains("qwen2.attention.key_length 32"), "{e}");
    }

    #[test]
    fn qwen3_reads_its_head_dimension_and_refuses_partial_rotation() {
        let mut b = hparams("qwen3", 1);
        b.kv_u32("qwen3.attention.key_length", 32)
            .kv_u32("qwen3.attention.value_length", 32);
        let (_d, g) = open(&b);
        let p = plan(&g, Variant::Qwen3).unwrap();
        assert_eq!(p.config["head_dim"], 32);
        let q = p.tensors.role("blk.0.attn_q.weight").unwrap().unwrap();
        assert_eq!((q.shape, q.unpermute_heads), (vec![128, 64], None));
        assert_eq!(
            p.tensors
                .role("blk.0.attn_q_norm.weight")
                .unwrap()
                .unwrap()
                .shape,
            vec![32]
        );
        let mut b = hparams("qwen3", 1);
        b.kv_u32("qwen3.rope.dimension_count", 8);
        let (_d, g) = open(&b);
        let e = plan(&g, Variant::Qwen3).unwrap_err().to_string();
        assert!(e.contains("qwen3.rope.dimension_count 8"), "{e}");
    }
}
