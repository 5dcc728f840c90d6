//! DeepSeek checkpoints in the layouts mlx-lm's `sanitize` rewrites, against mlx-lm loading the
//! same directory: Hugging Face's per-expert matrices, DeepSeek-V3's `kv_b_proj` (dense, and
//! quantized, which mlx-lm dequantizes, splits and quantizes again), its rotary `inv_freq`
//! tensors and multi-token-prediction layer. `scripts/deepseek_hf_layout.py` makes each layout
//! from the family model `scripts/gen_family_models.py` generated.
use crate::common;

use std::path::Path;
use std::process::Command;

use mlxd_engine::models;
use mlxd_engine::runtime::reference::greedy;

const PROMPT: &[u32] = &[5, 17, 42, 99, 7, 8, 9, 100, 101, 200];
const MAX_TOKENS: usize = 24;

fn rewrite(family: &str, out: &Path, quantize: bool) {
    let root = common::workspace_root();
    let src = common::tiny_model(&format!("family-{family}"));
    let mut cmd = Command::new(root.join(".venv/bin/python"));
    cmd.arg(root.join("scripts/deepseek_hf_layout.py"))
        .arg(&src)
        .arg(out);
    if quantize {
        cmd.arg("--quantize");
    }
    let status = cmd.status().expect("run .venv/bin/python");
    assert!(
        status.success(),
        "deepseek_hf_layout.py failed for {family}"
    );
}

fn check(family: &str, quantize: bool) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("model");
    rewrite(family, &dir, quantize);
    let model = models::load(&dir)
        .unwrap_or_else(|e| panic!("{family} in Hugging Face's layout does not load: {e}"));
    let ours = greedy(model.as_ref(), PROMPT, MAX_TOKENS, &[]).expect("generate");
    let reference = common::mlx_lm_greedy(&dir, MAX_TOKENS, PROMPT);
    assert_eq!(
        ours, reference,
        "{family} (quantized kv_b_proj: {quantize}): greedy tokens differ from mlx-lm"
    );
}

#[test]
fn deepseek_v3_hugging_face_layout_matches_mlx_lm() {
    check("deepseek_v3", false);
}

#[test]
fn deepseek_v3_quantized_kv_b_proj_matches_mlx_lm() {
    check("deepseek_v3", true);
}

#[test]
fn deepseek_v2_per_expert_layout_matches_mlx_lm() {
    check("deepseek_v2", false);
}

/// A quantized KV cache is refused at load, naming the option and the family, for both
/// generations (V3 caches the latent; V2's keys and values differ in size).
#[test]
fn deepseek_refuses_kv_quantization_by_name() {
    for family in ["deepseek_v3", "deepseek_v2"] {
        let limits = mlxd_engine::runtime::RuntimeLimits {
            kv_quant: Some(mlxd_engine::cache::KvQuant {
                bits: 8,
                group_size: 32,
            }),
            ..Default::default()
        };
        let dir = common::tiny_model(&format!("family-{family}"));
        let err = match mlxd_engine::runtime::Runtime::start(dir, limits, None) {
            Ok(runtime) => {
                runtime.join();
                panic!("{family} loaded with a quantized KV cache");
            }
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("kv_bits") && err.contains("DeepSeek"),
            "{family}: the refusal does not name the option and family: {err}"
        );
    }
}
