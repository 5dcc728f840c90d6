//! The MoE families load Hugging Face's checkpoint layouts as mlx-lm's `sanitize` does: one
//! tensor per expert (`experts.{e}.{gate,up,down}_proj`, Mixtral's `w1/w2/w3`), Granite-MoE's
//! fused `input_linear`/`output_linear`, and GLM-4.5's multi-token-prediction layer (dropped).
//! Each test rewrites a family's tiny model (`scripts/gen_family_models.py`, already in mlx-lm's
//! stacked form) into the Hugging Face layout and checks greedy tokens against mlx-lm's.
use crate::common;

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

/// How a family names its per-expert tensors.
enum Layout {
    /// `<moe>.experts.{e}.<name>.weight`, with mlx-lm's projection → the checkpoint's name.
    PerExpert(&'static [(&'static str, &'static str)]),
    /// Granite-MoE: `input_linear` = gate and up stacked along the output axis,
    /// `output_linear` = down.
    Fused,
}

const HF: &[(&str, &str)] = &[
    ("gate_proj", "gate_proj"),
    ("up_proj", "up_proj"),
    ("down_proj", "down_proj"),
];
const MIXTRAL: &[(&str, &str)] = &[("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")];

/// The tensors of `dir` with every `switch_mlp` stack rewritten in `layout`.
fn rewrite(dir: &Path, layout: &Layout) -> HashMap<String, Array> {
    let stacked = Array::load_safetensors(dir.join("model.safetensors")).expect("safetensors");
    let mut out = HashMap::new();
    for (name, array) in stacked {
        let Some((moe, rest)) = name.split_once(".switch_mlp.") else {
            out.insert(name, array);
            continue;
        };
        let proj = rest.trim_end_matches(".weight");
        match layout {
            Layout::PerExpert(names) => {
                let hf = names
                    .iter()
                    .find(|(m, _)| *m == proj)
                    .map(|(_, h)| *h)
                    .expect("a known projection");
                for e in 0..array.shape()[0] {
                    out.insert(format!("{moe}.experts.{e}.{hf}.weight"), array.index(e));
                }
            }
            Layout::Fused => match proj {
                "down_proj" => {
                    out.insert(format!("{moe}.output_linear.weight"), array);
                }
                // Joined when both halves are seen (below).
                _ => {
                    out.insert(name, array);
                }
            },
        }
    }
    if matches!(layout, Layout::Fused) {
        super::fuse_gate_up(&mut out, |moe| format!("{moe}.input_linear.weight"));
    }
    out
}

/// Writes the rewritten checkpoint (plus `extra` tensors) next to the family's config and
/// checks that the engine's greedy tokens still equal mlx-lm's.
fn check(family: &str, layout: Layout, extra: &[(&str, Array)]) {
    let dir = common::tiny_model(&format!("family-{family}"));
    let mut tensors = rewrite(&dir, &layout);
    for (name, a) in extra {
        tensors.insert((*name).to_owned(), a.clone());
    }
    super::check_checkpoint(family, &dir, &tensors);
}

#[test]
fn qwen3_moe_per_expert_checkpoint() {
    check("qwen3_moe", Layout::PerExpert(HF), &[]);
}

#[test]
fn qwen2_moe_per_expert_checkpoint() {
    check("qwen2_moe", Layout::PerExpert(HF), &[]);
}

#[test]
fn mixtral_per_expert_checkpoint() {
    check("mixtral", Layout::PerExpert(MIXTRAL), &[]);
}

#[test]
fn olmoe_per_expert_checkpoint() {
    check("olmoe", Layout::PerExpert(HF), &[]);
}

#[test]
fn granitemoe_fused_checkpoint() {
    check("granitemoe", Layout::Fused, &[]);
}

#[test]
fn glm4_moe_per_expert_checkpoint_with_an_mtp_layer() {
    // The fixture has 3 decoder layers; layer 3 is the multi-token-prediction head.
    let mtp = Array::from_slice(&[1.0f32; 4], &[4]);
    check(
        "glm4_moe",
        Layout::PerExpert(HF),
        &[
            ("model.layers.3.eh_proj.weight", mtp.clone()),
            ("model.layers.3.mlp.experts.0.up_proj.weight", mtp),
        ],
    );
}
