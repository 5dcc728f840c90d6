//! Qwen3-Next and Qwen3.5 load Hugging Face's checkpoint layout as mlx-lm's `sanitize`
//! converts it: convolution weights `[C, 1, K]`, the residual and query/key norms stored as
//! offsets from 1, multi-token-prediction weights (dropped), and per family the experts one
//! tensor each (Qwen3-Next) or gate and up fused (`experts.gate_up_proj`, Qwen3.5-MoE), and
//! the multimodal names (`model.language_model.`, a vision tower that is dropped) of Qwen3.5.
//! Each test rewrites a family's tiny model (`scripts/gen_family_models.py`, in mlx-lm's
//! converted form) into that layout and checks greedy tokens against mlx-lm's.
use crate::common;

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

/// The norms a Hugging Face checkpoint of these families stores as `weight - 1`.
const SHIFTED: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// How the experts are laid out.
#[derive(Clone, Copy, PartialEq)]
enum Experts {
    /// `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-Next).
    PerExpert,
    /// `experts.gate_up_proj` `[E, 2I, D]` and `experts.down_proj` (Qwen3.5-MoE).
    Fused,
    /// A dense model.
    None,
}

/// The converted tensors of `dir` in the Hugging Face layout.
fn rewrite(dir: &Path, experts: Experts, multimodal: bool) -> HashMap<String, Array> {
    let converted = Array::load_safetensors(dir.join("model.safetensors")).expect("safetensors");
    let mut out: HashMap<String, Array> = HashMap::new();
    for (name, mut a) in converted {
        if name.contains("conv1d.weight") {
            a = a.swap_axes(1, 2).expect("swap");
        }
        if SHIFTED.iter().any(|s| name.ends_with(s)) {
            a = a.subtract(Array::from_f32(1.0)).expect("shift");
        }
        let name = if multimodal {
            match name.strip_prefix("language_model.model") {
                Some(rest) => format!("model.language_model{rest}"),
                None => name.trim_start_matches("language_model.").to_owned(),
            }
        } else {
            name
        };
        match (experts, name.split_once(".switch_mlp.")) {
            (Experts::PerExpert, Some((moe, rest))) => {
                let proj = rest.trim_end_matches(".weight");
                for e in 0..a.shape()[0] {
                    out.insert(format!("{moe}.experts.{e}.{proj}.weight"), a.index(e));
                }
            }
            (Experts::Fused, Some((moe, "down_proj.weight"))) => {
                out.insert(format!("{moe}.experts.down_proj"), a);
            }
            _ => {
                out.insert(name, a);
            }
        }
    }
    if experts == Experts::Fused {
        super::fuse_gate_up(&mut out, |moe| format!("{moe}.experts.gate_up_proj"));
    }
    out
}

/// Writes the rewritten checkpoint (plus `extra` tensors, which the load must drop) next to
/// the family's config and checks the long prompt's greedy tokens against mlx-lm's.
fn check(family: &str, experts: Experts, multimodal: bool, extra: &[&str]) {
    let dir = common::tiny_model(&format!("family-{family}"));
    let mut tensors = rewrite(&dir, experts, multimodal);
    for name in extra {
        tensors.insert((*name).to_owned(), Array::from_slice(&[1.0f32; 4], &[4]));
    }
    super::check_checkpoint(family, &dir, &tensors);
}

#[test]
fn qwen3_next_hugging_face_checkpoint() {
    check("qwen3_next", Experts::PerExpert, false, &["mtp.fc.weight"]);
}

#[test]
fn qwen3_5_hugging_face_checkpoint() {
    check(
        "qwen3_5",
        Experts::None,
        true,
        &["model.visual.blocks.0.norm1.weight", "mtp.norm.weight"],
    );
}

#[test]
fn qwen3_5_moe_hugging_face_checkpoint() {
    check(
        "qwen3_5_moe",
        Experts::Fused,
        true,
        &["model.visual.merger.ln_q.weight"],
    );
}
