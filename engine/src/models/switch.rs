//! Mixture-of-experts building blocks shared by the MoE families: mlx-lm's `SwitchLinear`
//! (dense or quantized stacks of expert matrices), `SwitchGLU`, the routers' top-k selection
//! and the sanitize step that stacks Hugging Face per-expert tensors.
//!
//! Performance: routing stays on the device (top-k by `argpartition` + `take_along_axis`, no
//! host sync), and each projection is one `gather_mm`/`gather_qmm` over all selected experts of
//! all tokens per step, never a loop over experts. With many routed tokens (a prefill chunk:
//! `indices.size >= 64`) the tokens are first sorted by expert, as mlx-lm does, so that each
//! expert's matrix is read once per chunk rather than once per token.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::ops::{argpartition_axis, argsort_axis, flatten, gather_mm, unflatten};
use mlx_rs::Array;

use super::layers::gelu_approx;
use super::layers::{swiglu, Linear, Matrix};
use super::params::{parameters_of, Parameters, Params};
use super::quant;
use super::scalar::weak_scalar;
use crate::adapters::{LoraSite, PairAdapters};
use crate::loader::{LoadError, Weights};

pub type Result<T> = std::result::Result<T, Exception>;

/// mlx-lm's `SwitchLinear` / `QuantizedSwitchLinear`: one `[out, in]` matrix per expert,
/// stacked `[E, out, in]`, with an optional bias `[E, out]`, and its entry in the model's
/// adapter table (LoRA per expert, mlx-lm's `LoRASwitchLinear`: `crate::adapters::experts`).
#[derive(Debug)]
pub struct SwitchLinear {
    pub weight: Matrix,
    pub bias: Option<Array>,
    pub lora: Option<LoraSite>,
}

impl SwitchLinear {
    /// Loads `<prefix>.weight` (and `.scales`/`.biases` when quantized, with the layer's own
    /// quantization settings), and `<prefix>.bias` when `bias`.
    pub fn load(w: &mut Weights, prefix: &str, bias: bool) -> std::result::Result<Self, LoadError> {
        let Linear { matrix, bias, lora } = Linear::load(w, prefix, bias)?;
        Ok(Self {
            weight: matrix.into_inner(),
            bias,
            lora,
        })
    }

    /// `x` `[..., 1, in]` against the experts `indices` `[...]` selects → `[..., 1, out]`.
    /// `sorted` says the indices are sorted (lets MLX read each expert once). `pairs`: each
    /// pair's adapter when the pass mixes rows of different adapters
    /// ([`LoraSite::pair_adapters`]), in the order of `indices`.
    pub fn forward(
        &self,
        x: &Array,
        indices: &Array,
        sorted: bool,
        pairs: Option<&PairAdapters>,
    ) -> Result<Array> {
        let y = with_expert_bias(
            gather(x, &self.weight, indices, sorted)?,
            self.bias.as_ref(),
            indices,
        )?;
        self.adapted(x, y, indices, sorted, pairs)
    }

    /// `y` (the experts' product, bias added, computed here or as part of a stacked gather)
    /// with the adapters' update of the pairs added.
    fn adapted(
        &self,
        x: &Array,
        y: Array,
        indices: &Array,
        sorted: bool,
        pairs: Option<&PairAdapters>,
    ) -> Result<Array> {
        match &self.lora {
            Some(site) => site.apply_experts(x, y, indices, sorted, pairs),
            None => Ok(y),
        }
    }

    /// The parameters, for materialization.
    pub fn parameters(&self) -> Vec<Array> {
        parameters_of(self)
    }
}

impl Parameters for SwitchLinear {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.weight).add(&self.bias);
    }
}

/// `x` `[..., 1, in]` against the experts `indices` select of `weight` `[E, out, in]`.
fn gather(x: &Array, weight: &Matrix, indices: &Array, sorted: bool) -> Result<Array> {
    match weight {
        Matrix::Dense(w) => gather_mm(x, w.swap_axes(-1, -2)?, None, indices, sorted),
        Matrix::Quantized(q) => quant::gather_qmm(x, q.packed(), indices, true, sorted),
    }
}

/// `y` plus the selected experts' bias `[E, out]`, when there is one.
fn with_expert_bias(y: Array, bias: Option<&Array>, indices: &Array) -> Result<Array> {
    match bias {
        Some(b) => y.add(b.take_axis(indices, 0)?.expand_dims(-2)?),
        None => Ok(y),
    }
}

/// An expert block's gate and up stacks computed as one gather (`super::stacked`, for
/// expert stacks): `[E, gate_out + up_out, in]`, each projection keeping a view of its rows.
#[derive(Debug)]
struct StackedExperts {
    weight: Matrix,
    /// The biases `[E, gate_out + up_out]`, when both have one.
    bias: Option<Array>,
    /// Where the gate's outputs end.
    gate_end: i32,
}

impl StackedExperts {
    /// Stacks `gate` and `up`; `None`, with both left as they were, when stacking is off or
    /// they are not alike (or one has a bias and the other none).
    fn of(gate: &mut SwitchLinear, up: &mut SwitchLinear) -> Result<Option<Self>> {
        if !super::stacked::enabled() || gate.bias.is_some() != up.bias.is_some() {
            return Ok(None);
        }
        let Some(weight) = super::stacked::stack(&[&gate.weight, &up.weight])? else {
            return Ok(None);
        };
        let gate_end = super::stacked::rows_of(gate.weight.weight());
        let mut views = super::stacked::split_rows(&weight, &[gate_end])?.into_iter();
        let (Some(g), Some(u)) = (views.next(), views.next()) else {
            return Err(Exception::custom(
                "a stacked gate/up split gave other than 2",
            ));
        };
        gate.weight = g;
        up.weight = u;
        let bias = match (&gate.bias, &up.bias) {
            (Some(g), Some(u)) => {
                let bias = mlx_rs::ops::concatenate(&[g, u], -1)?;
                let mut parts = bias.split_at_indices(&[gate_end], -1)?.into_iter();
                gate.bias = parts.next();
                up.bias = parts.next();
                Some(bias)
            }
            _ => None,
        };
        Ok(Some(Self {
            weight,
            bias,
            gate_end,
        }))
    }
}

/// The arrays a [`Matrix`] holds.
pub fn matrix_parameters(m: &Matrix) -> Vec<Array> {
    parameters_of(m)
}

/// The gated activation between the up/gate projections and the down projection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SwitchActivation {
    /// `silu(gate) * up` (mlx-lm's `SwiGLU`).
    SwiGlu,
    /// gpt-oss's clamped variant (mlx-lm's `SwigluOAI`):
    /// `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`.
    ClampedSwiGlu { alpha: f32, limit: f32 },
    /// `gelu_approx(gate) * up` (Gemma 4's experts).
    GeluGlu,
}

impl SwitchActivation {
    /// The gated activation of `up` and `gate` (each `[..., hidden]`).
    pub(crate) fn apply(self, up: &Array, gate: &Array) -> Result<Array> {
        match self {
            SwitchActivation::SwiGlu => swiglu(gate, up),
            SwitchActivation::ClampedSwiGlu { alpha, limit }
                if (alpha, limit) == (GPT_OSS_ALPHA, GPT_OSS_LIMIT) =>
            {
                // One fused kernel, as mlx-lm compiles its `swiglu`: the eight element-wise
                // ops cost a launch each per layer per step otherwise. The constants live in
                // the compiled function, kept for the thread (traced once per dtype).
                super::kept::call_one(gpt_oss_swiglu_ops, true, &[up.clone(), gate.clone()])
            }
            SwitchActivation::ClampedSwiGlu { alpha, limit } => {
                clamped_swiglu(up, gate, alpha, limit)
            }
            SwitchActivation::GeluGlu => gelu_approx(gate)?.multiply(up),
        }
    }
}

/// [`clamped_swiglu`] with gpt-oss's constants, over `[up, gate]`.
fn gpt_oss_swiglu_ops(args: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![clamped_swiglu(
        &args[0],
        &args[1],
        GPT_OSS_ALPHA,
        GPT_OSS_LIMIT,
    )?])
}

/// gpt-oss's `alpha` and `limit` (mlx-lm's `SwigluOAI` defaults).
const GPT_OSS_ALPHA: f32 = 1.702;
const GPT_OSS_LIMIT: f32 = 7.0;

/// `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`.
fn clamped_swiglu(up: &Array, gate: &Array, alpha: f32, limit: f32) -> Result<Array> {
    let scalar = |v: f32| weak_scalar(gate, v);
    let g = mlx_rs::ops::minimum(gate, scalar(limit)?)?;
    let u = mlx_rs::ops::clip(up, (&scalar(-limit)?, &scalar(limit)?))?;
    let glu = g.multiply(mlx_rs::ops::sigmoid(g.multiply(scalar(alpha)?)?)?)?;
    u.add(scalar(1.0)?)?.multiply(glu)
}

/// mlx-lm's `SwitchGLU`: per token, the selected experts' `down(act(up(x), gate(x)))`.
#[derive(Debug)]
pub struct SwitchGlu {
    pub gate_proj: SwitchLinear,
    pub up_proj: SwitchLinear,
    pub down_proj: SwitchLinear,
    pub activation: SwitchActivation,
    /// The gate and up stacks as one ([`StackedExperts`]); `None`: two gathers.
    gate_up: Option<Box<StackedExperts>>,
}

/// mlx-lm sorts the routed tokens by expert from this many `(token, expert)` pairs on.
const SORT_FROM_PAIRS: usize = 64;

impl SwitchGlu {
    /// Loads `<prefix>.{gate,up,down}_proj`.
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        bias: bool,
        activation: SwitchActivation,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self::new(
            [
                SwitchLinear::load(w, &format!("{prefix}.gate_proj"), bias)?,
                SwitchLinear::load(w, &format!("{prefix}.up_proj"), bias)?,
                SwitchLinear::load(w, &format!("{prefix}.down_proj"), bias)?,
            ],
            activation,
        )?)
    }

    /// The block of expert stacks `[gate, up, down]` gated by `activation`, gate and up
    /// stacked where they can be (one gather for both).
    pub fn new(
        [mut gate_proj, mut up_proj, down_proj]: [SwitchLinear; 3],
        activation: SwitchActivation,
    ) -> Result<Self> {
        let gate_up = StackedExperts::of(&mut gate_proj, &mut up_proj)?.map(Box::new);
        Ok(Self {
            gate_proj,
            up_proj,
            down_proj,
            activation,
            gate_up,
        })
    }

    /// `x` `[..., D]`, `indices` `[..., k]` (uint32 expert ids) → `[..., k, D]`.
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let x = x.expand_dims_axes(&[-2, -3])?;
        // As mlx-lm: the ids carry no gradient (a training step whose router is adapted
        // differentiates through the block; the gathers cannot through their indices).
        let indices = &mlx_rs::stop_gradient(indices)?;
        // Rows of different adapters: each pair's adapter, taken before the sort.
        let pairs = match &self.gate_proj.lora {
            Some(site) => site.pair_adapters(indices)?,
            None => None,
        };
        if indices.size() >= SORT_FROM_PAIRS {
            let (x, idx, order, inv_order) = gather_sort(&x, indices)?;
            let pairs = pairs.map(|p| p.permuted(&order)).transpose()?;
            let y = self.project(&x, &idx, true, pairs.as_ref())?;
            scatter_unsort(&y, &inv_order, indices.shape())?.squeeze_axes(&[-2])
        } else {
            self.project(&x, indices, false, pairs.as_ref())?
                .squeeze_axes(&[-2])
        }
    }

    fn project(
        &self,
        x: &Array,
        idx: &Array,
        sorted: bool,
        pairs: Option<&PairAdapters>,
    ) -> Result<Array> {
        let (up, gate) = match &self.gate_up {
            Some(s) => {
                let y = gather(x, &s.weight, idx, sorted)?;
                let y = with_expert_bias(y, s.bias.as_ref(), idx)?;
                let mut parts = y.split_at_indices(&[s.gate_end], -1)?.into_iter();
                let (Some(gate), Some(up)) = (parts.next(), parts.next()) else {
                    return Err(Exception::custom(
                        "a stacked gate/up gather gave other than 2",
                    ));
                };
                (
                    self.up_proj.adapted(x, up, idx, sorted, pairs)?,
                    self.gate_proj.adapted(x, gate, idx, sorted, pairs)?,
                )
            }
            None => (
                self.up_proj.forward(x, idx, sorted, pairs)?,
                self.gate_proj.forward(x, idx, sorted, pairs)?,
            ),
        };
        self.down_proj
            .forward(&self.activation.apply(&up, &gate)?, idx, sorted, pairs)
    }

    /// The parameters, for materialization.
    pub fn parameters(&self) -> Vec<Array> {
        parameters_of(self)
    }
}

impl Parameters for SwitchGlu {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.gate_proj)
            .add(&self.up_proj)
            .add(&self.down_proj);
    }
}

/// mlx-lm's `_gather_sort`: one row of `x` per `(token, expert)` pair, ordered by expert.
/// `x` `[..., 1, 1, D]`, `indices` `[..., k]` → (`[N, 1, D]`, sorted ids `[N]`, the order
/// (pair of each sorted row), its inverse).
fn gather_sort(x: &Array, indices: &Array) -> Result<(Array, Array, Array, Array)> {
    let k = *indices.shape().last().unwrap_or(&1);
    let flat = indices.flatten(None, None)?;
    let order = argsort_axis(&flat, -1)?;
    let inv_order = argsort_axis(&order, -1)?;
    let token_of_pair = order.floor_divide(Array::from_int(k).as_dtype(order.dtype())?)?;
    let rows = flatten(x, 0, -3)?.take_axis(&token_of_pair, 0)?;
    let sorted = flat.take_axis(&order, 0)?;
    Ok((rows, sorted, order, inv_order))
}

/// mlx-lm's `_scatter_unsort`: rows back in token order, reshaped to `[..., k, 1, D]`.
fn scatter_unsort(x: &Array, inv_order: &Array, shape: &[i32]) -> Result<Array> {
    unflatten(x.take_axis(inv_order, 0)?, 0, shape)
}

/// The `k` largest of `scores` along the last axis as mlx-lm's routers mostly write it,
/// `argpartition(-scores, kth=k-1)[..., :k]`. The order of the `k` ids (which fixes the
/// order of the weighted sum over experts) depends on the formula, so each family uses the
/// one its mlx-lm file uses. The ids carry no gradient (`stop_gradient`, as every mlx-lm
/// router writes it): a training step differentiates through the router's gathers.
pub fn top_k_of_negated(scores: &Array, k: i32) -> Result<Array> {
    mlx_rs::stop_gradient(argpartition_axis(scores.negative()?, k - 1, -1)?.index((Ellipsis, ..k)))
}

/// The `k` largest of `scores` as `argpartition(scores, kth=-k)[..., -k:]` (Qwen3-MoE,
/// Granite-MoE), without gradient as [`top_k_of_negated`].
pub fn top_k_tail(scores: &Array, k: i32) -> Result<Array> {
    let n = *scores.shape().last().unwrap_or(&0);
    mlx_rs::stop_gradient(argpartition_axis(scores, n - k, -1)?.index((Ellipsis, (n - k)..)))
}

/// `(y * scores[..., None]).sum(axis=-2)`: the experts' outputs `[..., k, D]` weighted by their
/// router scores `[..., k]`, in the dtype the product promotes to.
pub fn weighted_sum(y: &Array, scores: &Array) -> Result<Array> {
    y.multiply(scores.expand_dims(-1)?)?.sum_axis(-2, None)
}

/// Hugging Face names of the per-expert projections → mlx-lm's `switch_mlp` names.
pub const HF_EXPERT_PROJECTIONS: [(&str, &str); 3] = [
    ("gate_proj", "gate_proj"),
    ("up_proj", "up_proj"),
    ("down_proj", "down_proj"),
];

/// Mixtral's per-expert names (`w1` gate, `w2` down, `w3` up).
pub const MIXTRAL_EXPERT_PROJECTIONS: [(&str, &str); 3] =
    [("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")];

/// [`stack_experts`] over `model.layers.{l}.mlp` of each of `layers` (a family's sparse
/// layers), in the Qwen-style names (`experts.{e}.{gate,up,down}_proj`).
pub fn stack_layer_experts(
    w: &mut Weights,
    layers: impl IntoIterator<Item = usize>,
    num_experts: usize,
) -> std::result::Result<(), LoadError> {
    for layer in layers {
        stack_experts(
            w,
            &format!("model.layers.{layer}.mlp"),
            num_experts,
            &HF_EXPERT_PROJECTIONS,
        )?;
    }
    Ok(())
}

/// The sanitize step of mlx-lm's MoE families: when a checkpoint holds one tensor per expert
/// (`<moe>.experts.{e}.<hf>.{weight,scales,biases}`, as Hugging Face ships them), stacks them
/// into `<moe>.switch_mlp.<mlx>.<suffix>` `[E, ...]`. Checkpoints converted by mlx-lm (all of
/// mlx-community's) already hold the stacked form and are left alone. A partial set of
/// experts is reported as missing tensors.
pub fn stack_experts(
    w: &mut Weights,
    moe: &str,
    num_experts: usize,
    projections: &[(&str, &str)],
) -> std::result::Result<(), LoadError> {
    for (hf, mlx) in projections {
        for suffix in ["weight", "scales", "biases"] {
            if !w.contains(&format!("{moe}.experts.0.{hf}.{suffix}")) {
                continue;
            }
            let names: Vec<String> = (0..num_experts)
                .map(|e| format!("{moe}.experts.{e}.{hf}.{suffix}"))
                .collect();
            let absent: Vec<String> = names.iter().filter(|n| !w.contains(n)).cloned().collect();
            if !absent.is_empty() {
                return Err(LoadError::MissingTensors(absent));
            }
            let parts: Vec<Array> = names.iter().filter_map(|n| w.remove_raw(n)).collect();
            let stacked = mlx_rs::ops::stack(&parts, 0)?;
            w.insert(format!("{moe}.switch_mlp.{mlx}.{suffix}"), stacked);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::QuantizedMatrix;
    use crate::models::test_arrays::{max_abs_diff, normal};

    const EXPERTS: i32 = 4;
    const DIM: i32 = 64;
    const HIDDEN: i32 = 32;

    fn dense_glu(seed: u64) -> SwitchGlu {
        let linear = |out: i32, inp: i32, s: u64| SwitchLinear {
            weight: Matrix::Dense(normal(&[EXPERTS, out, inp], s)),
            bias: None,
            lora: None,
        };
        let parts = [
            linear(HIDDEN, DIM, seed),
            linear(HIDDEN, DIM, seed + 1),
            linear(DIM, HIDDEN, seed + 2),
        ];
        SwitchGlu::new(parts, SwitchActivation::SwiGlu).unwrap()
    }

    /// [`dense_glu`] with gate and up left as two gathers.
    fn unstacked_glu(seed: u64) -> SwitchGlu {
        let mut glu = dense_glu(seed);
        let stacked = glu.gate_up.take().expect("dense stacks of one shape stack");
        let [gate, up]: [Array; 2] = match &stacked.weight {
            Matrix::Dense(w) => w
                .split_at_indices(&[HIDDEN], 1)
                .unwrap()
                .try_into()
                .unwrap(),
            Matrix::Quantized(_) => panic!("dense expected"),
        };
        // Each its own copy, as loaded before stacking.
        glu.gate_proj.weight = Matrix::Dense(gate.multiply(Array::from_f32(1.0)).unwrap());
        glu.up_proj.weight = Matrix::Dense(up.multiply(Array::from_f32(1.0)).unwrap());
        glu
    }

    #[test]
    fn stacked_gate_and_up_give_the_two_gathers_outputs() {
        for (tokens, k) in [(3, 2), (40, 2)] {
            let x = normal(&[1, tokens, DIM], 40);
            let ids: Vec<u32> = (0..tokens * k)
                .map(|i| ((i * 5 + i / k) % EXPERTS) as u32)
                .collect();
            let indices = Array::from_slice(&ids, &[1, tokens, k]);
            let glu = dense_glu(11);
            mlx_rs::transforms::eval(glu.parameters().iter()).unwrap();
            let stacked = glu.forward(&x, &indices).unwrap();
            let counts = crate::graph_ops::op_counts(&stacked);
            let gathers = counts.by_primitive.get("GatherMM").copied().unwrap_or(0);
            assert_eq!(gathers, 2, "gate/up as one gather, then down: {counts:?}");
            let two = unstacked_glu(11).forward(&x, &indices).unwrap();
            assert_eq!(
                max_abs_diff(&stacked, &two),
                0.0,
                "{tokens} tokens × top-{k}"
            );
        }
    }

    fn dense(l: &SwitchLinear) -> &Array {
        match &l.weight {
            Matrix::Dense(w) => w,
            Matrix::Quantized { .. } => panic!("dense expected"),
        }
    }

    /// Token by token and expert by expert, with plain matmuls.
    fn per_expert_loop(glu: &SwitchGlu, x: &Array, ids: &[u32], k: usize) -> Vec<Array> {
        let d = *x.shape().last().unwrap();
        let rows = x.reshape(&[-1, d]).unwrap();
        let mut out = Vec::new();
        for (pair, &e) in ids.iter().enumerate() {
            let xr = rows.index(((pair / k) as i32)..((pair / k) as i32 + 1));
            let pick = |l: &SwitchLinear| dense(l).index(e as i32);
            let up = xr.matmul(pick(&glu.up_proj).t()).unwrap();
            let gate = xr.matmul(pick(&glu.gate_proj).t()).unwrap();
            let h = swiglu(&gate, &up).unwrap();
            out.push(h.matmul(pick(&glu.down_proj).t()).unwrap());
        }
        out
    }

    fn check_against_loop(tokens: i32, k: i32) {
        let glu = dense_glu(10);
        let x = normal(&[1, tokens, DIM], 20);
        let ids: Vec<u32> = (0..tokens * k)
            .map(|i| ((i * 7 + i / k) % EXPERTS) as u32)
            .collect();
        let indices = Array::from_slice(&ids, &[1, tokens, k]);
        let y = glu.forward(&x, &indices).unwrap();
        assert_eq!(y.shape(), &[1, tokens, k, DIM]);
        let flat = y.reshape(&[-1, DIM]).unwrap();
        for (pair, expected) in per_expert_loop(&glu, &x, &ids, k as usize)
            .iter()
            .enumerate()
        {
            let got = flat.index((pair as i32)..(pair as i32 + 1));
            let diff = max_abs_diff(&got, expected);
            assert!(diff < 1e-4, "pair {pair}: max difference {diff}");
        }
    }

    #[test]
    fn switch_glu_matches_a_loop_over_experts_unsorted() {
        // 3 tokens × top-2: below the sorting threshold.
        check_against_loop(3, 2);
    }

    #[test]
    fn switch_glu_matches_a_loop_over_experts_sorted() {
        // 40 tokens × top-2 = 80 pairs: sorted by expert, then unsorted back.
        check_against_loop(40, 2);
    }

    #[test]
    fn quantized_experts_match_their_dequantized_stack() {
        let w = normal(&[EXPERTS, HIDDEN, DIM], 30);
        let (wq, scales, biases) = mlx_rs::ops::quantize(&w, 64, 4).unwrap();
        let back = mlx_rs::ops::dequantize(&wq, &scales, &biases, 64, 4).unwrap();
        let quantized = SwitchLinear {
            weight: Matrix::Quantized(QuantizedMatrix {
                weight: wq,
                scales,
                biases: Some(biases),
                group_size: 64,
                bits: 4,
                mode: quant::QuantMode::Affine,
            }),
            bias: Some(normal(&[EXPERTS, HIDDEN], 31)),
            lora: None,
        };
        let dense = SwitchLinear {
            weight: Matrix::Dense(back),
            bias: quantized.bias.clone(),
            lora: None,
        };
        let x = normal(&[5, 1, 1, DIM], 32);
        let ids = Array::from_slice(&[0u32, 3, 1, 2, 2, 0, 3, 1, 1, 1], &[5, 2]);
        let a = quantized.forward(&x, &ids, false, None).unwrap();
        let b = dense.forward(&x, &ids, false, None).unwrap();
        assert_eq!(a.shape(), &[5, 2, 1, HIDDEN]);
        assert!(max_abs_diff(&a, &b) < 1e-3);
    }

    #[test]
    fn top_k_selections_pick_the_largest() {
        let scores = Array::from_slice(&[0.1f32, 0.7, 0.05, 0.15, 0.3, 0.2, 0.4, 0.1], &[2, 4]);
        for ids in [
            top_k_of_negated(&scores, 2).unwrap(),
            top_k_tail(&scores, 2).unwrap(),
        ] {
            // Flattening copies the strided slice into contiguous memory.
            let flat = ids.flatten(None, None).unwrap();
            let mut rows: Vec<Vec<u32>> = flat
                .as_slice::<u32>()
                .chunks(2)
                .map(|r| r.to_vec())
                .collect();
            rows.iter_mut().for_each(|r| r.sort());
            assert_eq!(rows, vec![vec![1, 3], vec![0, 2]]);
        }
    }

    fn write(dir: &std::path::Path, tensors: &[(String, Array)]) {
        Array::save_safetensors(
            tensors.iter().map(|(n, a)| (n.as_str(), a)),
            None,
            dir.join("model.safetensors"),
        )
        .unwrap();
    }

    #[test]
    fn per_expert_tensors_are_stacked_into_the_switch_form() {
        let dir = tempfile::tempdir().unwrap();
        let experts: Vec<Array> = (0..EXPERTS as u64)
            .map(|e| normal(&[HIDDEN, DIM], 40 + e))
            .collect();
        let moe = "model.layers.0.block_sparse_moe";
        let tensors: Vec<(String, Array)> = experts
            .iter()
            .enumerate()
            .map(|(e, a)| (format!("{moe}.experts.{e}.w1.weight"), a.clone()))
            .collect();
        write(dir.path(), &tensors);
        let mut w = Weights::open(dir.path(), &serde_json::json!({})).unwrap();
        stack_experts(&mut w, moe, EXPERTS as usize, &MIXTRAL_EXPERT_PROJECTIONS).unwrap();
        let stacked = w
            .take(&format!("{moe}.switch_mlp.gate_proj.weight"))
            .unwrap();
        assert_eq!(stacked.shape(), &[EXPERTS, HIDDEN, DIM]);
        for (e, a) in experts.iter().enumerate() {
            assert_eq!(max_abs_diff(&stacked.index(e as i32), a), 0.0);
        }
        w.finish().unwrap();
    }

    #[test]
    fn a_partial_set_of_experts_is_reported_missing() {
        let dir = tempfile::tempdir().unwrap();
        let moe = "model.layers.0.mlp";
        let tensors = vec![(
            format!("{moe}.experts.0.up_proj.weight"),
            normal(&[HIDDEN, DIM], 50),
        )];
        write(dir.path(), &tensors);
        let mut w = Weights::open(dir.path(), &serde_json::json!({})).unwrap();
        let err = stack_experts(&mut w, moe, 2, &HF_EXPERT_PROJECTIONS).unwrap_err();
        assert!(
            err.to_string().contains("experts.1.up_proj.weight"),
            "{err}"
        );
    }
}
