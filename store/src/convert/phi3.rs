//! The `phi3` GGUF architecture (Phi-3, Phi-3.5, Phi-4 and Phi-4-mini): hyper-parameters,
//! tensor names and the mlx-lm `config.json` (`Phi3ForCausalLM`).
//!
//! llama.cpp keeps Phi-3's fused projections as they are: `attn_qkv` is `qkv_proj` (queries,
//! keys, values stacked by rows) and `ffn_up` is `gate_up_proj` (gate rows, then up rows), which
//! is also mlx-lm's layout. `rope.dimension_count` below the head dimension is Phi-4-mini's
//! partial rotary embedding. The long-context `longrope` scaling travels as two F32 tensors,
//! `rope_factors_long` and `rope_factors_short`, with `rope.scaling.original_context_length`;
//! they become config.json's `rope_scaling` again, and the file's `rope.scaling.attn_factor`
//! must be the one mlx-lm derives from the context lengths. llama.cpp turns Phi-3's sliding
//! window off (and mlx-lm's Phi-3 has none), so `attention.sliding_window` is not carried over.
use serde_json::json;

use super::arch::{f32_json, f32_vector, ArchPlan, Common, Meta, TensorTable};
use super::gguf::GgufFile;
use super::ConvertError;

pub const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
pub const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

/// The rotary dimensions and the factor mlx-lm multiplies the head dimension by to get them.
fn partial_rotary(m: &Meta, c: &Common) -> Result<(usize, Option<f64>), ConvertError> {
    let rot = c.rotary_dims.unwrap_or(c.head_dim);
    if rot == c.head_dim {
        return Ok((rot, None));
    }
    let factor = rot as f64 / c.head_dim as f64;
    // mlx-lm computes `int(head_dim * partial_rotary_factor)`, which must give `rot` back.
    if rot > c.head_dim || !rot.is_multiple_of(2) || (c.head_dim as f64 * factor) as usize != rot {
        return Err(ConvertError::Unsupported(format!(
            "{} {rot} is not an even number of rotary dimensions within the head dimension {}",
            m.key("rope.dimension_count"),
            c.head_dim
        )));
    }
    Ok((rot, Some(factor)))
}

/// mlx-lm's `SuScaledRoPE` attention factor for a context of `max` positions extended from
/// `original` (llama.cpp's converter writes the same formula as `rope.scaling.attn_factor`).
fn su_scale(max: usize, original: usize) -> f64 {
    let factor = max as f64 / original as f64;
    if factor <= 1.0 {
        1.0
    } else {
        (1.0 + factor.ln() / (original as f64).ln()).sqrt()
    }
}

/// `rope_scaling` from the factor tensors, or `None` when the file has neither.
fn longrope(
    m: &Meta,
    c: &Common,
    rot: usize,
    original: Option<usize>,
) -> Result<Option<serde_json::Value>, ConvertError> {
    let long = f32_vector(m.g, ROPE_FACTORS_LONG, rot / 2)?;
    let short = f32_vector(m.g, ROPE_FACTORS_SHORT, rot / 2)?;
    let (long, short) = match (long, short) {
        (None, None) => return Ok(None),
        (Some(l), Some(s)) => (l, s),
        _ => {
            return Err(ConvertError::Unsupported(format!(
                "only one of {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT} is present"
            )))
        }
    };
    let original = original
        .ok_or_else(|| ConvertError::MissingKey(m.key("rope.scaling.original_context_length")))?;
    let want = su_scale(c.context_length, original);
    if let Some(got) = m.opt_f32("rope.scaling.attn_factor")? {
        if ((got as f64 - want) / want).abs() > 1e-6 {
            return Err(ConvertError::Unsupported(format!(
                "{} {got} is not the LongRoPE attention factor {want} of context {} over {original}",
                m.key("rope.scaling.attn_factor"),
                c.context_length
            )));
        }
    }
    let values = |v: Vec<f32>| v.into_iter().map(f32_json).collect::<Vec<_>>();
    Ok(Some(json!({
        "type": "longrope",
        "long_factor": values(long),
        "short_factor": values(short),
    })))
}

pub fn plan(g: &GgufFile) -> Result<ArchPlan, ConvertError> {
    let m = Meta { g, arch: "phi3" };
    let c = Common::read(&m)?;
    if c.head_dim * c.n_heads != c.hidden_size {
        return Err(ConvertError::Unsupported(format!(
            "phi3.attention.key_length {} is not embedding_length / head_count ({}), which mlx-lm's Phi-3 assumes",
            c.head_dim,
            c.hidden_size / c.n_heads
        )));
    }
    if let Some(kind) = m.opt_str("rope.scaling.type")? {
        if kind != "none" {
            return Err(ConvertError::Unsupported(format!(
                "phi3.rope.scaling.type {kind:?} is not supported (Phi-3's long-context scaling comes as {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT})"
            )));
        }
    }
    let (rot, partial) = partial_rotary(&m, &c)?;
    let original = m.opt_usize("rope.scaling.original_context_length")?;
    let rope_scaling = longrope(&m, &c, rot, original)?;

    let mut config = c.config("Phi3ForCausalLM", "phi3");
    // llama.cpp reads a missing original context as the training context.
    config.insert(
        "original_max_position_embeddings".into(),
        json!(original.unwrap_or(c.context_length)),
    );
    if let Some(f) = partial {
        config.insert("partial_rotary_factor".into(), json!(f));
    }
    config.insert(
        "rope_scaling".into(),
        rope_scaling.clone().unwrap_or(json!(null)),
    );
    config.insert("hidden_act".into(), json!("silu"));

    let mut tensors = tensors(&c);
    if rope_scaling.is_some() {
        tensors.metadata(ROPE_FACTORS_LONG);
        tensors.metadata(ROPE_FACTORS_SHORT);
    }
    Ok(ArchPlan {
        config,
        tensors,
        context_length: c.context_length,
    })
}

fn tensors(c: &Common) -> TensorTable {
    let (h, v, q, ff) = (c.hidden_size, c.vocab_size, c.q_rows(), c.intermediate_size);
    let qkv = q + 2 * c.kv_rows();
    let mut t = TensorTable::new("phi3");
    t.embedding_and_head(v, h);
    for l in 0..c.n_layers {
        let blk = |s: &str| format!("blk.{l}.{s}");
        let m = |s: &str| format!("model.layers.{l}.{s}");
        t.weight(&blk("attn_norm"), m("input_layernorm"), vec![h]);
        t.weight(&blk("ffn_norm"), m("post_attention_layernorm"), vec![h]);
        t.weight(&blk("attn_qkv"), m("self_attn.qkv_proj"), vec![qkv, h]);
        t.weight(&blk("attn_output"), m("self_attn.o_proj"), vec![h, q]);
        t.weight(&blk("ffn_up"), m("mlp.gate_up_proj"), vec![2 * ff, h]);
        t.weight(&blk("ffn_down"), m("mlp.down_proj"), vec![h, ff]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::super::arch::tests::{hparams, hparams_with_context, open};
    use super::super::arch::TensorMap;
    use super::super::gguf::tests::GgufBuilder;
    use super::*;

    fn factors(b: &mut GgufBuilder, name: &str, v: &[f32]) {
        let bytes = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        b.tensor(name, &[v.len() as u64], 0, bytes);
    }

    /// Phi-4-mini's shape: 12 of 16 head dimensions rotate, LongRoPE from 4096 to 131072.
    fn longrope(attn_factor: f32) -> GgufBuilder {
        let mut b = hparams_with_context("phi3", 2, 131072);
        b.kv_u32("phi3.rope.dimension_count", 12)
            .kv_u32("phi3.rope.scaling.original_context_length", 4096)
            .kv_f32("phi3.rope.scaling.attn_factor", attn_factor);
        factors(&mut b, ROPE_FACTORS_LONG, &[1.0, 1.25, 2.1, 3.7, 6.4, 11.5]);
        factors(&mut b, ROPE_FACTORS_SHORT, &[1.0, 1.05, 1.1, 1.3, 1.8, 2.5]);
        b
    }

    #[test]
    fn fused_projections_partial_rotation_and_longrope() {
        let scale = su_scale(131072, 4096) as f32;
        let (_d, g) = open(&longrope(scale));
        let p = plan(&g).unwrap();
        let c = &p.config;
        assert_eq!(c["partial_rotary_factor"], 0.75);
        assert_eq!(c["original_max_position_embeddings"], 4096);
        assert_eq!(c["max_position_embeddings"], 131072);
        assert_eq!(c["rope_scaling"]["type"], "longrope");
        assert_eq!(
            c["rope_scaling"]["long_factor"],
            json!([1.0, 1.25, 2.1, 3.7, 6.4, 11.5])
        );
        assert_eq!(c["rope_scaling"]["short_factor"][2], json!(1.1));
        assert!(c.get("sliding_window").is_none());
        let t = &p.tensors;
        assert_eq!(t.role(ROPE_FACTORS_LONG).unwrap(), None);
        let qkv = t.role("blk.1.attn_qkv.weight").unwrap().unwrap();
        assert_eq!(
            (qkv.module.as_str(), qkv.shape),
            ("model.layers.1.self_attn.qkv_proj", vec![128, 64])
        );
        let up = t.role("blk.1.ffn_up.weight").unwrap().unwrap();
        assert_eq!(
            (up.module.as_str(), up.shape),
            ("model.layers.1.mlp.gate_up_proj", vec![256, 64])
        );
        for bad in ["blk.0.attn_q.weight", "blk.0.ffn_gate.weight"] {
            assert!(t.role(bad).unwrap_err().to_string().contains(bad));
        }
    }

    #[test]
    fn inconsistent_rope_metadata_is_refused() {
        let (_d, g) = open(&longrope(1.5));
        let e = plan(&g).unwrap_err().to_string();
        assert!(e.contains("phi3.rope.scaling.attn_factor 1.5"), "{e}");

        let mut b = hparams("phi3", 2);
        factors(&mut b, ROPE_FACTORS_LONG, &[1.0; 8]);
        let (_d, g) = open(&b);
        let e = plan(&g).unwrap_err().to_string();
        assert!(e.contains("only one of"), "{e}");

        let mut b = hparams("phi3", 2);
        b.kv_u32("phi3.rope.dimension_count", 11);
        let (_d, g) = open(&b);
        let e = plan(&g).unwrap_err().to_string();
        assert!(e.contains("phi3.rope.dimension_count 11"), "{e}");

        // Without factors nothing is scaled and the original context is the context.
        let (_d, g) = open(&hparams("phi3", 2));
        let c = plan(&g).unwrap().config;
        assert_eq!(c["rope_scaling"], json!(null));
        assert_eq!(c["original_max_position_embeddings"], 256);
        assert!(c.get("partial_rotary_factor").is_none());
    }
}
