//! The `gemma3` GGUF architecture (Gemma 3's text decoder): hyper-parameters, tensor names and
//! the mlx-lm `config.json` (`Gemma3ForCausalLM`, model type `gemma3_text`).
//!
//! Gemma's RMSNorm scales by `1 + w`; llama.cpp's converter adds the 1 to every norm weight
//! (`*norm.weight`, the per-head Q/K norms included) and scales by the stored value, so each
//! norm here is written as `stored - 1`, which mlx-lm adds 1 back to. What the file does not
//! carry, llama.cpp's loader fixes for the architecture and so does this mapping: local layers
//! use RoPE base 10000 without scaling, every 6th layer is global (no sliding window at all
//! when `attention.sliding_window` is absent or 0), and queries are scaled by
//! `head_dim^-0.5`, or `(embedding_length / head_count)^-0.5` for the 62-layer 27B model.
//! A final logit soft-capping, which mlx-lm's Gemma 3 does not apply, is refused.
use serde_json::json;

use super::arch::{
    f32_json, linear_rope_scaling, ArchPlan, Common, Meta, Param, TensorRole, TensorTable,
};
use super::gguf::GgufFile;
use super::ConvertError;

/// llama.cpp's fixed pattern: layers `i` with `i % 6 == 5` attend globally.
const SLIDING_WINDOW_PATTERN: usize = 6;
/// llama.cpp's RoPE base for the local layers.
const LOCAL_ROPE_BASE: f32 = 10_000.0;
/// The layer count by which llama.cpp recognises Gemma 3 27B.
const LAYERS_27B: usize = 62;

pub fn plan(g: &GgufFile) -> Result<ArchPlan, ConvertError> {
    let m = Meta { g, arch: "gemma3" };
    let c = Common::read(&m)?;
    c.require_full_rotary(&m)?;
    if let Some(cap) = m.opt_f32("final_logit_softcapping")? {
        if cap != 0.0 {
            return Err(ConvertError::Unsupported(format!(
                "gemma3.final_logit_softcapping {cap}: mlx-lm's Gemma 3 applies no logit soft-capping"
            )));
        }
    }
    if let Some(cap) = m.opt_f32("attn_logit_softcapping")? {
        if cap != 0.0 {
            return Err(ConvertError::Unsupported(format!(
                "gemma3.attn_logit_softcapping {cap}: Gemma 3 has no attention soft-capping"
            )));
        }
    }
    let rope_scaling = linear_rope_scaling(&m, true)?;
    let window = m.opt_u64("attention.sliding_window")?.filter(|&w| w > 0);
    let query_pre_attn_scalar = if c.n_layers == LAYERS_27B {
        c.hidden_size / c.n_heads
    } else {
        c.head_dim
    };

    let mut config = c.config("Gemma3ForCausalLM", "gemma3_text");
    config.insert("head_dim".into(), json!(c.head_dim));
    config.insert("rope_local_base_freq".into(), f32_json(LOCAL_ROPE_BASE));
    config.insert("query_pre_attn_scalar".into(), json!(query_pre_attn_scalar));
    match window {
        Some(w) => {
            config.insert("sliding_window".into(), json!(w));
            config.insert(
                "sliding_window_pattern".into(),
                json!(SLIDING_WINDOW_PATTERN),
            );
        }
        None => {
            // Every layer global: the window is never used, so it spans the whole context.
            config.insert("sliding_window".into(), json!(c.context_length));
            config.insert("sliding_window_pattern".into(), json!(1));
        }
    }
    if let Some(factor) = rope_scaling {
        config.insert(
            "rope_scaling".into(),
            json!({"rope_type": "linear", "factor": f32_json(factor)}),
        );
    }
    config.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));

    Ok(ArchPlan {
        config,
        tensors: tensors(&c),
        context_length: c.context_length,
    })
}

/// A Gemma norm: llama.cpp stored `1 + w`.
fn norm(module: String, n: usize) -> TensorRole {
    TensorRole {
        shift: 1.0,
        ..TensorRole::plain(module, Param::Weight, vec![n])
    }
}

fn tensors(c: &Common) -> TensorTable {
    let (h, v, q, kv, ff) = (
        c.hidden_size,
        c.vocab_size,
        c.q_rows(),
        c.kv_rows(),
        c.intermediate_size,
    );
    let mut t = TensorTable::new("gemma3");
    t.weight("token_embd", "model.embed_tokens".into(), vec![v, h]);
    t.add("output_norm", norm("model.norm".into(), h), true);
    t.add(
        "output",
        TensorRole::plain("lm_head".into(), Param::Weight, vec![v, h]),
        false,
    );
    for l in 0..c.n_layers {
        let blk = |s: &str| format!("blk.{l}.{s}");
        let m = |s: &str| format!("model.layers.{l}.{s}");
        for (part, module, n) in [
            ("attn_norm", "input_layernorm", h),
            ("post_attention_norm", "post_attention_layernorm", h),
            ("ffn_norm", "pre_feedforward_layernorm", h),
            ("post_ffw_norm", "post_feedforward_layernorm", h),
            ("attn_q_norm", "self_attn.q_norm", c.head_dim),
            ("attn_k_norm", "self_attn.k_norm", c.head_dim),
        ] {
            t.add(&blk(part), norm(m(module), n), true);
        }
        t.weight(&blk("attn_q"), m("self_attn.q_proj"), vec![q, h]);
        t.weight(&blk("attn_k"), m("self_attn.k_proj"), vec![kv, h]);
        t.weight(&blk("attn_v"), m("self_attn.v_proj"), vec![kv, h]);
        t.weight(&blk("attn_output"), m("self_attn.o_proj"), vec![h, q]);
        t.weight(&blk("ffn_gate"), m("mlp.gate_proj"), vec![ff, h]);
        t.weight(&blk("ffn_up"), m("mlp.up_proj"), vec![ff, h]);
        t.weight(&blk("ffn_down"), m("mlp.down_proj"), vec![h, ff]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::super::arch::tests::{hparams, open};
    use super::super::arch::TensorMap;
    use super::*;

    #[test]
    fn norms_are_shifted_and_llama_cpp_s_fixed_settings_written() {
        let mut b = hparams("gemma3", 6);
        b.kv_u32("gemma3.attention.sliding_window", 8)
            .kv_str("gemma3.rope.scaling.type", "linear")
            .kv_f32("gemma3.rope.scaling.factor", 8.0);
        let (_d, g) = open(&b);
        let p = plan(&g).unwrap();
        let c = &p.config;
        assert_eq!(c["model_type"], "gemma3_text");
        assert_eq!(c["query_pre_attn_scalar"], 16);
        assert_eq!(
            (&c["sliding_window"], &c["sliding_window_pattern"]),
            (&json!(8), &json!(6))
        );
        assert_eq!(c["rope_local_base_freq"], json!(10000.0));
        assert_eq!(
            c["rope_scaling"],
            json!({"rope_type": "linear", "factor": 8.0})
        );
        let t = &p.tensors;
        for (gguf, module) in [
            ("output_norm", "model.norm"),
            ("blk.5.attn_norm", "model.layers.5.input_layernorm"),
            (
                "blk.5.post_attention_norm",
                "model.layers.5.post_attention_layernorm",
            ),
            ("blk.5.ffn_norm", "model.layers.5.pre_feedforward_layernorm"),
            (
                "blk.5.post_ffw_norm",
                "model.layers.5.post_feedforward_layernorm",
            ),
            ("blk.5.attn_q_norm", "model.layers.5.self_attn.q_norm"),
        ] {
            let r = t.role(&format!("{gguf}.weight")).unwrap().unwrap();
            assert_eq!((r.module.as_str(), r.shift), (module, 1.0), "{gguf}");
        }
        assert_eq!(t.role("blk.0.attn_q.weight").unwrap().unwrap().shift, 0.0);
        assert_eq!(t.role("token_embd.weight").unwrap().unwrap().shift, 0.0);
        assert!(t.role("blk.6.attn_q.weight").is_err());
    }

    #[test]
    fn no_window_means_every_layer_global_and_27b_scales_queries_by_the_width() {
        let mut b = hparams("gemma3", 62);
        b.kv_u32("gemma3.attention.key_length", 32)
            .kv_u32("gemma3.attention.value_length", 32);
        let (_d, g) = open(&b);
        let c = plan(&g).unwrap().config;
        assert_eq!(c["sliding_window_pattern"], 1);
        assert_eq!(c["sliding_window"], 256);
        // embedding_length / head_count = 16, not the head dimension 32.
        assert_eq!(c["query_pre_attn_scalar"], 16);
        assert_eq!(c["head_dim"], 32);
    }

    #[test]
    fn logit_soft_capping_is_refused() {
        let mut b = hparams("gemma3", 6);
        b.kv_f32("gemma3.final_logit_softcapping", 30.0);
        let (_d, g) = open(&b);
        let e = plan(&g).unwrap_err().to_string();
        assert!(e.contains("gemma3.final_logit_softcapping 30"), "{e}");
    }
}
