//! A served LoRA update whose `x @ A` comes out of the base product itself: on CUDA, by
//! default (`MLXD_LORA_WIDENED=0` turns it off, to measure the two kernels it replaces).
//!
//! On CUDA a decode pass's update is two custom-kernel nodes a site ([`super::lora_kernel`]):
//! a decode step over adapters on every projection of a 16-layer model makes 128 of them, and
//! each costs the host ~12 µs in MLX's custom-kernel path where a plain node costs ~4
//! (BENCHMARKS.md, sessions 46 and 49): four mixed adapters step at 5.5 ms against the base's
//! 3.6–4.1, and issue 25 asks for 0.8× the base. Here a site's matrix is widened by the
//! side-by-side `A` of every loaded adapter, `W' = [W; Aᵀ]` (`[out + C, in]`, `A` in the
//! weight's dtype), so one product gives `[x @ Wᵀ, x @ A]` and a single kernel
//! ([`super::lora_kernel::widened_update`]) masks `x @ A` per row, multiplies it by `B` and
//! adds it to the base columns: one node a site instead of two, and the shrink's work rides
//! on the product the step makes anyway (`C` is a few dozen columns beside thousands). The
//! kernel can also do the node that follows the site ([`Epilogue`]: the block's residual add
//! after an o or down projection, SwiGLU after a stacked gate/up), so that of a Llama layer's
//! four adapted sites only q/k/v's adds a node to the base's step. On an H100 a site costs
//! 45–50 µs against 56–68, and 32 greedy streams over four adapters run at 0.80–0.84× the base
//! against 0.59–0.63× with the two kernels (BENCHMARKS.md, sessions 50 and 51).
//!
//! **The base's weights are held once.** The pass that builds `W'` puts a view of its first
//! `out` rows in the layer's [`MatrixCell`](crate::models::layers::MatrixCell) in place of the layer's own matrix (a stacked
//! product's layers take views of those rows, [`crate::models::stacked`]), so the old buffer
//! is freed and what the adapters add is their `Aᵀ` rows: ~21 MB for four rank-8 adapters on
//! every projection of a 1B model. A load or unload of an adapter drops the widened matrices;
//! the next pass builds them again from the layers' rows, one group at a time (the copy of a
//! group is the most held twice).
//!
//! What it changes: `A` and `x @ A` are rounded to the base's dtype (bfloat16 or float16)
//! where the two kernels keep float32 factors' `x @ A` in float32 — vLLM's LoRA runs in the
//! model's dtype too; the update is a small addition to `y`, rounded to `y`'s dtype after.
//! Passes of more than [`MAX_ROWS`] rows, quantized bases, layers with a bias, DoRA adapters
//! and training keep the two-kernel or matmul paths.
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use crate::models::layers::Matrix;

/// The environment variable that turns the widened product off (`0`); on otherwise, on CUDA.
pub const WIDENED_ENV: &str = "MLXD_LORA_WIDENED";

/// The most rows (tokens) a pass may have to take this path: the widened expand's.
const MAX_ROWS: i64 = 256;

#[cfg(test)]
thread_local! {
    /// A unit test's way to take this path on the CPU (its update then runs as ops).
    static FORCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Takes the widened path on this thread whatever the switch and device (unit tests).
#[cfg(test)]
pub(crate) fn force(on: bool) {
    FORCED.with(|f| f.set(on));
}

/// Whether MLX's default device is a CUDA GPU and `MLXD_LORA_WIDENED` is not `0`.
fn available() -> bool {
    #[cfg(test)]
    if FORCED.with(|f| f.get()) {
        return true;
    }
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::cuda_kernel::wanted(WIDENED_ENV))
}

/// Whether a site with `matrix` takes the widened product for input `x` (the switch and the
/// device aside): a dense float16 or bfloat16 matrix of `x`'s dtype, and `x` `[B, L, in]` of
/// at most [`MAX_ROWS`] rows.
pub fn fits(x: (&[i32], Dtype), matrix: &Matrix) -> bool {
    let Matrix::Dense(w) = matrix else {
        return false;
    };
    let (xs, xd) = x;
    let &[b, l, _] = xs else {
        return false;
    };
    let rows = i64::from(b) * i64::from(l);
    matches!(xd, Dtype::Float16 | Dtype::Bfloat16)
        && w.dtype() == xd
        && (1..=MAX_ROWS).contains(&rows)
}

/// [`fits`] where the switch is on and the device is a CUDA GPU.
pub fn applies(x: &Array, matrix: &Matrix) -> bool {
    available() && fits((x.shape(), x.dtype()), matrix)
}

/// What a widened site's kernel does with the site's output before writing it: each folds a
/// node the step would make next into the expand, which on CUDA costs the host as much as a
/// plain node (BENCHMARKS.md, session 51).
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    /// Writes it: the layer's output.
    None,
    /// Adds it to `residual` `[B, L, out]` (the layer's input's dtype) and writes the sum: a
    /// block's attention or MLP output projection, whose output the block adds to its residual
    /// stream (`residual + output`, each rounded as the two ops round).
    Residual(&'a Array),
    /// `silu(gate) · up` of its halves `[B, L, out / 2]`: a gated MLP's stacked gate and up
    /// projections, as the compiled SwiGLU ([`crate::models::layers::swiglu`]) gives it.
    SwiGlu,
}

/// A pass's output through a widened product, and whether the pass built the widened matrix:
/// the product's [`MatrixCell`](crate::models::layers::MatrixCell) then holds a view of its base rows, and views of the old
/// matrix held elsewhere (a stacked product's layers) must follow for its buffer to go.
pub struct WidenedPass {
    pub output: Array,
    pub rebuilt: bool,
}

/// A site's (or a stacked group's) widened matrix and the `B` its update multiplies by.
pub struct Widened {
    /// `[out + C, in]`: the base's rows, then `Aᵀ` in the base's dtype.
    matrix: Array,
    /// `[C, out]`, the scale folded in (as [`super::group::GroupFactors::b`]).
    b: Array,
}

impl Widened {
    /// `weight` (`[out, in]`) widened by `a` (`[in, C]`, every loaded adapter's side by side)
    /// and `b` (`[C, out]`), computed now, and its first `out` rows: a view of the widened
    /// buffer, for the layer to hold in place of `weight` (which can then be freed).
    pub fn new(weight: &Array, a: &Array, b: Array) -> Result<(Self, Array), Exception> {
        let matrix = concatenate(&[weight, &a.t().as_dtype(weight.dtype())?], 0)?;
        let base = matrix.index(..weight.shape()[0]);
        mlx_rs::transforms::eval([&matrix, &base])?;
        Ok((Self { matrix, b }, base))
    }

    /// The widened matrix `[out + C, in]`.
    #[cfg(test)]
    pub fn matrix(&self) -> &Array {
        &self.matrix
    }

    /// The site's output for `x` (`[B, L, in]`): the base product plus each row's update,
    /// `mask` (`[Bm, 1, W]` for `layers` blocks of `W` columns) keeping each row's own
    /// adapter's columns, then `epilogue`.
    pub fn output(
        &self,
        x: &Array,
        mask: (&Array, i32),
        epilogue: Epilogue<'_>,
    ) -> Result<Array, Exception> {
        let yw = Matrix::Dense(self.matrix.clone()).matmul_t(x)?;
        if super::lora_kernel::serves_widened(&yw, &self.b, mask, epilogue) {
            return super::lora_kernel::widened_update(&yw, &self.b, mask, epilogue);
        }
        // The same update and epilogue as ops (off CUDA, where the kernel does not run: the
        // unit tests; or a residual whose shape the kernel does not take).
        let n = self.b.shape()[1];
        let y = yw.index((.., .., ..n));
        let h = super::group::masked(yw.index((.., .., n..)), Some(mask))?;
        let out = super::group::add_served_update(y, &h, &self.b, x.dtype())?;
        match epilogue {
            Epilogue::None => Ok(out),
            Epilogue::Residual(r) => r.add(&out),
            Epilogue::SwiGlu => {
                let halves = out.split_equal(2, -1)?;
                crate::models::layers::swiglu(&halves[0], &halves[1])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::group::add_served;
    use crate::models::test_arrays::{max_abs_diff, normal};

    /// A two-layer Llama of bfloat16 random weights (hidden 64, MLP 128, 4 heads over 2 KV
    /// heads, tied embeddings) and two LoRA adapters of rank 4 on every projection, written to
    /// `dir` (`model`, `a0`, `a1`).
    fn tiny_llama_with_adapters(dir: &std::path::Path, factors: Dtype) {
        let (hidden, mlp, kv, vocab) = (64, 128, 32, 96);
        let model = dir.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let config = serde_json::json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "intermediate_size": mlp, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "tie_word_embeddings": true, "vocab_size": vocab,
            "torch_dtype": "bfloat16"
        });
        std::fs::write(model.join("config.json"), config.to_string()).unwrap();
        let scaled = |shape: &[i32], seed: u64, scale: f32, dtype: Dtype| {
            normal(shape, seed)
                .multiply(Array::from_f32(scale))
                .unwrap()
                .as_dtype(dtype)
                .unwrap()
        };
        let bf = |shape: &[i32], seed: u64, scale: f32| scaled(shape, seed, scale, BF);
        let projections = [
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", kv, hidden),
            ("self_attn.v_proj", kv, hidden),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", mlp, hidden),
            ("mlp.up_proj", mlp, hidden),
            ("mlp.down_proj", hidden, mlp),
        ];
        let ones = |n: i32| Array::ones::<f32>(&[n]).unwrap().as_dtype(BF).unwrap();
        let mut weights = vec![
            (
                "model.embed_tokens.weight".to_string(),
                bf(&[vocab, hidden], 1, 1.0),
            ),
            ("model.norm.weight".to_string(), ones(hidden)),
        ];
        let mut seed = 10;
        for layer in 0..2 {
            let p = format!("model.layers.{layer}");
            weights.push((format!("{p}.input_layernorm.weight"), ones(hidden)));
            weights.push((format!("{p}.post_attention_layernorm.weight"), ones(hidden)));
            for (name, out, inp) in projections {
                seed += 1;
                weights.push((format!("{p}.{name}.weight"), bf(&[out, inp], seed, 0.15)));
            }
        }
        Array::save_safetensors(weights, None, model.join("model.safetensors")).unwrap();
        for adapter in 0..2 {
            let path = dir.join(format!("a{adapter}"));
            std::fs::create_dir_all(&path).unwrap();
            let config =
                r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 2.0}}"#;
            std::fs::write(path.join("adapter_config.json"), config).unwrap();
            let mut tensors = Vec::new();
            for layer in 0..2 {
                for (name, out, inp) in projections {
                    seed += 2;
                    let p = format!("model.layers.{layer}.{name}");
                    tensors.push((format!("{p}.lora_a"), scaled(&[inp, 4], seed, 0.2, factors)));
                    tensors.push((
                        format!("{p}.lora_b"),
                        scaled(&[4, out], seed + 1, 0.2, factors),
                    ));
                }
            }
            Array::save_safetensors(tensors, None, path.join("adapters.safetensors")).unwrap();
        }
    }

    /// The logits of a prefill and a decode step over rows of two adapters and the base,
    /// through the widened product or not, and how many groups of sites it widened.
    fn tiny_llama_logits(factors: Dtype, widened: bool) -> ([Array; 2], usize) {
        let dir = tempfile::tempdir().unwrap();
        tiny_llama_with_adapters(dir.path(), factors);
        let model = crate::models::load(&dir.path().join("model")).unwrap();
        let table = model.adapters().expect("a model loaded whole has a table");
        let ids = [
            table.load("a0", &dir.path().join("a0")).unwrap(),
            table.load("a1", &dir.path().join("a1")).unwrap(),
        ];
        let rows = [Some(ids[0]), Some(ids[1]), None, Some(ids[0])];
        let prompt = Array::from_slice(
            &[1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 4, 8, 12, 16],
            &[4, 4],
        );
        let next = Array::from_slice(&[20, 21, 22, 23], &[4, 1]);
        force(widened);
        let _s = table.select(&rows).unwrap();
        let mut caches = model.new_dense_caches();
        let first = model.forward(&prompt, &mut caches).unwrap();
        let step = model.forward(&next, &mut caches).unwrap();
        mlx_rs::transforms::eval([&first, &step]).unwrap();
        force(false);
        ([first, step], table.widened_groups())
    }

    /// A whole model through the widened product (forced on the CPU, where its update runs as
    /// ops) gives the logits the two-product path gives: exactly with factors in the base's
    /// dtype (both round `x @ A` to it), to the rounding of `A` and `x @ A` to bfloat16 with
    /// float32 factors; a base row's exactly. The blocks' residual adds and the MLPs' SwiGLU are
    /// taken into the sites, and the layers' matrices become views of the widened ones on the
    /// first pass.
    #[test]
    fn a_model_gives_the_same_logits_through_the_widened_product() {
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        // With float32 factors the bound is this small model's sensitivity to rounding them:
        // the two-product path itself moves its logits by 1.06 of 27 (4%) when its factors are
        // rounded to bfloat16 first; the widened path differs from it by at most 1.31 of 27.
        for (factors, most) in [(BF, 0.0), (Dtype::Float32, 0.08)] {
            let (plain, none) = tiny_llama_logits(factors, false);
            let (wide, widened) = tiny_llama_logits(factors, true);
            assert_eq!(
                (none, widened),
                (0, 2 * 4),
                "q/k/v, o, gate/up, down in two layers"
            );
            for (got, want) in wide.iter().zip(&plain) {
                assert_eq!(got.shape(), want.shape());
                for row in 0..4 {
                    let r = Array::from_int(row);
                    let (got, want) = (
                        f32(&got.take_axis(&r, 0).unwrap()),
                        f32(&want.take_axis(&r, 0).unwrap()),
                    );
                    let size = want.abs().unwrap().max(None).unwrap().item_exact::<f32>();
                    let diff = max_abs_diff(&got, &want);
                    let most = if row == 2 { 0.0 } else { most };
                    assert!(
                        diff <= most * size,
                        "{factors:?} row {row}: logits differ by {diff} (largest {size})"
                    );
                }
            }
        }
    }

    const BF: Dtype = Dtype::Bfloat16;

    #[test]
    fn decode_sized_dense_passes_of_the_weights_dtype_fit() {
        let w = Matrix::Dense(normal(&[48, 16], 1).as_dtype(BF).unwrap());
        assert!(fits((&[32, 1, 16], BF), &w));
        assert!(fits((&[1, 1, 16], BF), &w));
        assert!(fits((&[2, 128, 16], BF), &w));
        // A prefill pass of many tokens, another dtype, float32, an input not [B, L, in].
        assert!(!fits((&[4, 512, 16], BF), &w));
        assert!(!fits((&[32, 1, 16], Dtype::Float16), &w));
        let w32 = Matrix::Dense(normal(&[48, 16], 1));
        assert!(!fits((&[32, 1, 16], Dtype::Float32), &w32));
        assert!(!fits((&[32, 16], BF), &w));
    }

    /// The widened product's update equals the two-product update of the same factors: exactly
    /// in float32, and to the base dtype's rounding of `x @ A` in bfloat16.
    #[test]
    fn the_widened_output_is_the_base_product_plus_each_rows_update() {
        let (rows, k, n, rank, adapters, layers) = (5, 32, 24, 4, 2, 2);
        let c = rank * adapters * layers;
        let x = normal(&[rows, 1, k], 2);
        let w = normal(&[n, k], 3);
        let a = normal(&[k, c], 4).multiply(Array::from_f32(0.3)).unwrap();
        let b = normal(&[c, n], 5).multiply(Array::from_f32(0.3)).unwrap();
        // Rows 0 and 3 take adapter 0, rows 1 and 4 adapter 1, row 2 none (a base row).
        let width = rank * adapters;
        let mut m = vec![0.0f32; (rows * width) as usize];
        for r in 0..rows {
            let slot = [Some(0), Some(1), None, Some(0), Some(1)][r as usize];
            if let Some(s) = slot {
                let start = (r * width + s * rank) as usize;
                m[start..start + rank as usize].fill(1.0);
            }
        }
        let mask = Array::from_slice(&m, &[rows, 1, width]);
        let want = |x: &Array, w: &Array| {
            let y = x.matmul(w.t()).unwrap();
            add_served(x, &a, &b, Some((&mask, layers)), y).unwrap()
        };
        let (widened, base_rows) = Widened::new(&w, &a, b.clone()).unwrap();
        let got = widened.output(&x, (&mask, layers), Epilogue::None).unwrap();
        assert_eq!(got.shape(), &[rows, 1, n]);
        assert_eq!(
            max_abs_diff(&base_rows, &w),
            0.0,
            "the base rows are the weight"
        );
        let start = |a: &Array| a.as_slice::<f32>().as_ptr();
        assert_eq!(
            start(&base_rows),
            start(&widened.matrix),
            "a view, not a copy"
        );
        assert!(max_abs_diff(&got, &want(&x, &w)) < 1e-4);
        let base = x.matmul(w.t()).unwrap();
        assert!(
            max_abs_diff(&got.index(2), &base.index(2)) < 1e-6,
            "a base row is the base product"
        );

        let (xb, wb) = (x.as_dtype(BF).unwrap(), w.as_dtype(BF).unwrap());
        let got = Widened::new(&wb, &a, b.clone())
            .unwrap()
            .0
            .output(&xb, (&mask, layers), Epilogue::None)
            .unwrap();
        assert_eq!(got.dtype(), BF);
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        let want = f32(&want(&xb, &wb));
        let scale = want.abs().unwrap().max(None).unwrap().item_exact::<f32>();
        assert!(max_abs_diff(&f32(&got), &want) <= scale * 2e-2);
    }
}
