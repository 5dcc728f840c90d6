//! The gated delta-net layer of Qwen3-Next and Qwen3.5 (mlx-lm's `Qwen3NextGatedDeltaNet`,
//! `qwen3_5.GatedDeltaNet` and `gated_delta.py`): a linear-attention layer whose per-sequence
//! state is the last `kernel - 1` inputs of a depthwise causal convolution and a recurrent
//! `[Hv, Dv, Dk]` matrix per value head, updated by the gated delta rule.
//!
//! The recurrence runs as mlx-lm runs it off Apple GPUs (`gated_delta_ops`): one compiled
//! step per position, looped over the sequence in the graph. The state it leaves is float32
//! whatever the activations' dtype. Left padding (a prefill group's shorter rows): the padded
//! positions are zeroed before the convolution and the recurrence holds the state still over
//! them, so a padded row ends exactly where it would alone.
use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::fast;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::ops::{concatenate, conv1d, logaddexp, select, sigmoid, stack, zeros_dtype};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{Array, Dtype};

use super::layers::Linear;
use super::params::{Parameters, Params};
use super::scalar::{scale_by, weak_scalar};
use crate::cache::{LayerCache, LayerKind};
use crate::loader::{LoadError, Weights};

/// The arrays a delta-net layer keeps per sequence: the convolution's window, the recurrence.
pub(crate) const STATE_SLOTS: usize = 2;

/// What a delta-net layer keeps between passes (its [`LayerKind`]).
pub(crate) const KIND: LayerKind = LayerKind::State { slots: STATE_SLOTS };

/// The sizes of a delta-net layer (`linear_*` in the configs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeltaShape {
    pub key_heads: i32,
    pub value_heads: i32,
    pub key_dim: i32,
    pub value_dim: i32,
    pub conv_kernel: i32,
    /// The epsilon of the gated output norm (`rms_norm_eps`).
    pub eps: f32,
}

impl DeltaShape {
    /// Refuses sizes mlx-lm's layer cannot run: value heads must be whole groups of key heads,
    /// and the convolution must keep at least one past input.
    pub fn check(&self, family: &str) -> Result<(), LoadError> {
        let DeltaShape {
            key_heads,
            value_heads,
            key_dim,
            value_dim,
            conv_kernel,
            ..
        } = *self;
        if key_heads <= 0 || value_heads <= 0 || value_heads % key_heads != 0 {
            return Err(LoadError::Config(format!(
                "{family}: linear_num_value_heads {value_heads} must be a positive multiple of \
                 linear_num_key_heads {key_heads}"
            )));
        }
        if key_dim <= 0 || value_dim <= 0 {
            return Err(LoadError::Config(format!(
                "{family}: linear key and value head dims must be positive (got {key_dim} and \
                 {value_dim})"
            )));
        }
        if conv_kernel < 2 {
            return Err(LoadError::Config(format!(
                "{family}: linear_conv_kernel_dim {conv_kernel} must be at least 2"
            )));
        }
        Ok(())
    }

    /// Width of all key heads together.
    fn keys(&self) -> i32 {
        self.key_heads * self.key_dim
    }

    /// Width of all value heads together.
    fn values(&self) -> i32 {
        self.value_heads * self.value_dim
    }

    /// Channels of the convolution: queries, keys and values.
    fn conv_dim(&self) -> i32 {
        2 * self.keys() + self.values()
    }

    /// Bytes one sequence's state takes in one layer: the convolution window in the
    /// activations' dtype (`act_bytes` per element) and the float32 recurrence.
    pub fn state_bytes(&self, act_bytes: usize) -> usize {
        let conv = ((self.conv_kernel - 1) * self.conv_dim()) as usize * act_bytes;
        let recurrent = (self.value_heads * self.value_dim * self.key_dim) as usize * 4;
        conv + recurrent
    }
}

/// How a checkpoint lays out the input projections.
pub(crate) enum InProjections {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key head.
    Interleaved { qkvz: Linear, ba: Linear },
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
}

/// Which [`InProjections`] layout to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProjectionLayout {
    Interleaved,
    Split,
}

/// The projected inputs of one pass: the convolution's input `[B, S, conv_dim]`, the output
/// gate `z` `[B, S, Hv, Dv]`, and the per-head `b` (write strength) and `a` (decay) `[B, S,
/// Hv]`.
struct Projected {
    qkv: Array,
    z: Array,
    b: Array,
    a: Array,
}

impl InProjections {
    fn load(w: &mut Weights, prefix: &str, layout: ProjectionLayout) -> Result<Self, LoadError> {
        let linear =
            |w: &mut Weights, name: &str| Linear::load(w, &format!("{prefix}.{name}"), false);
        Ok(match layout {
            ProjectionLayout::Interleaved => InProjections::Interleaved {
                qkvz: linear(w, "in_proj_qkvz")?,
                ba: linear(w, "in_proj_ba")?,
            },
            ProjectionLayout::Split => InProjections::Split {
                qkv: linear(w, "in_proj_qkv")?,
                z: linear(w, "in_proj_z")?,
                b: linear(w, "in_proj_b")?,
                a: linear(w, "in_proj_a")?,
            },
        })
    }

    fn project(&self, x: &Array, s: &DeltaShape) -> Result<Projected, Exception> {
        let (bsz, len) = (x.shape()[0], x.shape()[1]);
        match self {
            InProjections::Split { qkv, z, b, a } => Ok(Projected {
                qkv: qkv.forward(x)?,
                z: z.forward(x)?
                    .reshape(&[bsz, len, s.value_heads, s.value_dim])?,
                b: b.forward(x)?,
                a: a.forward(x)?,
            }),
            InProjections::Interleaved { qkvz, ba } => {
                // mlx-lm's `fix_query_key_value_ordering`: per key head, its queries, keys,
                // and the values and gates of its group of value heads.
                let (nk, dk, dv) = (s.key_heads, s.key_dim, s.value_dim);
                let group = s.value_heads / nk;
                let mixed = qkvz.forward(x)?.reshape(&[bsz, len, nk, -1])?;
                let parts = mixed.split_at_indices(&[dk, 2 * dk, 2 * dk + group * dv], -1)?;
                let flat = |a: &Array| a.reshape(&[bsz, len, -1]);
                let qkv = concatenate(&[flat(&parts[0])?, flat(&parts[1])?, flat(&parts[2])?], -1)?;
                let z = parts[3].reshape(&[bsz, len, -1, dv])?;
                let mixed_ba = ba.forward(x)?.reshape(&[bsz, len, nk, -1])?;
                let ba = mixed_ba.split_at_indices(&[group], -1)?;
                Ok(Projected {
                    qkv,
                    z,
                    b: ba[0].reshape(&[bsz, len, s.value_heads])?,
                    a: ba[1].reshape(&[bsz, len, s.value_heads])?,
                })
            }
        }
    }
}

impl Parameters for InProjections {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        match self {
            InProjections::Interleaved { qkvz, ba } => p.add(qkvz).add(ba),
            InProjections::Split { qkv, z, b, a } => p.add(qkv).add(z).add(b).add(a),
        };
    }
}

/// One gated delta-net layer.
pub(crate) struct GatedDeltaNet {
    shape: DeltaShape,
    proj: InProjections,
    /// The depthwise convolution's weight `[conv_dim, kernel, 1]` (no bias).
    conv1d: Array,
    dt_bias: Array,
    a_log: Array,
    /// The gated RMS norm's weight `[Dv]`.
    norm: Array,
    out_proj: Linear,
}

impl GatedDeltaNet {
    /// Loads the layer at `prefix` (`<layer>.linear_attn`).
    pub fn load(
        w: &mut Weights,
        prefix: &str,
        shape: DeltaShape,
        layout: ProjectionLayout,
    ) -> Result<Self, LoadError> {
        let conv_name = format!("{prefix}.conv1d.weight");
        // A missing weight is reported by the loader with every other missing one.
        let present = w.contains(&conv_name);
        let conv1d = w.take(&conv_name)?;
        if present {
            let expected = [shape.conv_dim(), shape.conv_kernel, 1];
            crate::loader::expect_shape(&conv_name, &conv1d, &expected)?;
        }
        Ok(Self {
            proj: InProjections::load(w, prefix, layout)?,
            conv1d,
            dt_bias: w.take(&format!("{prefix}.dt_bias"))?,
            a_log: w.take(&format!("{prefix}.A_log"))?,
            norm: w.take(&format!("{prefix}.norm.weight"))?,
            out_proj: Linear::load(w, &format!("{prefix}.out_proj"), false)?,
            shape,
        })
    }

    /// The layer over `x` `[B, S, D]` (normalised hidden states), reading and replacing the
    /// state in `cache`.
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array, Exception> {
        let state = cache.as_state_mut()?;
        let s = &self.shape;
        let (bsz, len) = (x.shape()[0], x.shape()[1]);
        let mask = state.mask(len)?;
        let Projected { mut qkv, z, b, a } = self.proj.project(x, s)?;

        let conv_state = match state.slot(0) {
            Some(c) => c.clone(),
            None => zeros_dtype(&[bsz, s.conv_kernel - 1, s.conv_dim()], x.dtype())?,
        };
        if let Some(m) = &mask {
            qkv = select(m.expand_dims(-1)?, &qkv, weak_scalar(&qkv, 0.0)?)?;
        }
        let conv_input = concatenate(&[conv_state, qkv], 1)?;
        let total = conv_input.shape()[1];
        let next_conv = conv_input
            .index((.., (total - (s.conv_kernel - 1)).., ..))
            .contiguous()?;
        let conv_out = silu(&conv1d(&conv_input, &self.conv1d, 1, 0, 1, s.conv_dim())?)?;

        let parts = conv_out.split_at_indices(&[s.keys(), 2 * s.keys()], -1)?;
        let q = parts[0].reshape(&[bsz, len, s.key_heads, s.key_dim])?;
        let k = parts[1].reshape(&[bsz, len, s.key_heads, s.key_dim])?;
        let v = parts[2].reshape(&[bsz, len, s.value_heads, s.value_dim])?;
        let (q, k) = normalize_qk(&q, &k, s.key_dim)?;

        // mlx-lm's `gated_delta_update`: write strengths, decays, and a zero state to start.
        let recurrent = match state.slot(1) {
            Some(r) => r.clone(),
            None => zeros_dtype(
                &[bsz, s.value_heads, s.value_dim, s.key_dim],
                Dtype::Float32,
            )?,
        };
        let inputs = DeltaInputs {
            beta: sigmoid(&b)?,
            g: compute_g(&self.a_log, &a, &self.dt_bias)?,
            q,
            k,
            v,
        };
        let (out, recurrent) = if super::delta_kernel::serves(&inputs.g, s.key_dim) {
            let DeltaInputs { q, k, v, g, beta } = &inputs;
            super::delta_kernel::run(q, k, v, g, beta, &recurrent, mask.as_ref())?
        } else {
            gated_delta_ops(&inputs, recurrent, mask.as_ref())?
        };
        state.update(vec![next_conv, recurrent], len as usize)?;

        let normed = fast::rms_norm(&out, Some(&self.norm), s.eps)?;
        let gated = precise_swiglu(&out, &z, &normed)?;
        self.out_proj.forward(&gated.reshape(&[bsz, len, -1])?)
    }
}

impl Parameters for GatedDeltaNet {
    fn push_params<'a>(&'a self, p: &mut Params<'a>) {
        p.add(&self.proj)
            .add(&self.conv1d)
            .add(&self.dt_bias)
            .add(&self.a_log)
            .add(&self.norm)
            .add(&self.out_proj);
    }
}

/// `x * sigmoid(x)`, as `nn.silu`.
fn silu(x: &Array) -> Result<Array, Exception> {
    x.multiply(sigmoid(x)?)
}

/// mlx-lm's `precise_swiglu(h, gate, x)`: `silu(gate) * x` in float32, cast to `h`'s dtype;
/// compiled into one kernel (shapeless), as mlx-lm compiles it.
fn precise_swiglu(h: &Array, gate: &Array, x: &Array) -> Result<Array, Exception> {
    let args = [h.clone(), gate.clone(), x.clone()];
    single(Compiled::call(|c| &mut c.swiglu, &args)?)
}

fn precise_swiglu_ops(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let [h, gate, x] = args else {
        return Err(Exception::custom("precise_swiglu: expected 3 inputs"));
    };
    let g = gate.as_dtype(Dtype::Float32)?;
    Ok(vec![silu(&g)?
        .multiply(x.as_dtype(Dtype::Float32)?)?
        .as_dtype(h.dtype())?])
}

/// mlx-lm's `normalize_qk`: L2-normalised queries and keys (through `rms_norm` with the eps
/// rescaled), the readout scale `Dk^-0.5` folded into the queries.
fn normalize_qk(q: &Array, k: &Array, key_dim: i32) -> Result<(Array, Array), Exception> {
    let inv_scale = f64::from(key_dim).powf(-0.5);
    let rms_eps = (1e-6 * inv_scale * inv_scale) as f32;
    let q = scale_by(
        &fast::rms_norm(q, None, rms_eps)?,
        (inv_scale * inv_scale) as f32,
    )?;
    let k = scale_by(&fast::rms_norm(k, None, rms_eps)?, inv_scale as f32)?;
    Ok((q, k))
}

/// mlx-lm's `compute_g`: the per-step decay `exp(-exp(A_log) * softplus(a + dt_bias))` in
/// float32, compiled (shapeless) as mlx-lm compiles it.
fn compute_g(a_log: &Array, a: &Array, dt_bias: &Array) -> Result<Array, Exception> {
    let args = [a_log.clone(), a.clone(), dt_bias.clone()];
    single(Compiled::call(|c| &mut c.decay, &args)?)
}

fn compute_g_ops(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let [a_log, a, dt_bias] = args else {
        return Err(Exception::custom("compute_g: expected 3 inputs"));
    };
    let x = a.add(dt_bias)?;
    let softplus = logaddexp(&x, weak_scalar(&x, 0.0)?)?;
    Ok(vec![a_log
        .as_dtype(Dtype::Float32)?
        .exp()?
        .negative()?
        .multiply(softplus)?
        .exp()?])
}

/// The one output of a compiled function.
fn single(mut out: Vec<Array>) -> Result<Array, Exception> {
    match (out.pop(), out.is_empty()) {
        (Some(a), true) => Ok(a),
        _ => Err(Exception::custom(
            "a compiled function gave other than one output",
        )),
    }
}

type CompiledFn = Box<dyn for<'a> FnMut(&'a [Array]) -> Result<Vec<Array>, Exception>>;

/// The layer's compiled functions, kept per thread (the model runs on one thread) for the
/// thread's life: MLX caches a compiled graph per compiled function and input shapes, so a
/// function compiled anew for every pass would be traced again every decode step.
struct Compiled {
    step: CompiledFn,
    decay: CompiledFn,
    swiglu: CompiledFn,
}

thread_local! {
    static COMPILED: RefCell<Option<Compiled>> = const { RefCell::new(None) };
}

impl Compiled {
    fn new() -> Self {
        Self {
            step: Box::new(compile(delta_step, false)),
            decay: Box::new(compile(compute_g_ops, true)),
            swiglu: Box::new(compile(precise_swiglu_ops, true)),
        }
    }

    /// Calls the function `pick` chooses on `args`.
    fn call(
        pick: impl FnOnce(&mut Compiled) -> &mut CompiledFn,
        args: &[Array],
    ) -> Result<Vec<Array>, Exception> {
        COMPILED.with(|cell| {
            let mut compiled = cell.borrow_mut();
            let f = pick(compiled.get_or_insert_with(Compiled::new));
            f(args)
        })
    }
}

/// The recurrence's inputs over one pass: `q`, `k` `[B, T, Hk, Dk]` (normalised), `v`
/// `[B, T, Hv, Dv]`, the decays `g` `[B, T, Hv]` (or `[B, T, Hv, Dk]`) and the write strengths
/// `beta` `[B, T, Hv]`.
struct DeltaInputs {
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
}

/// mlx-lm's `gated_delta_ops`: key heads repeated over their value heads, then one compiled
/// step per position from `state` `[B, Hv, Dv, Dk]`, holding it still where the `[B, T]`
/// `mask` is false. Returns the outputs `[B, T, Hv, Dv]` and the new state.
fn gated_delta_ops(
    x: &DeltaInputs,
    mut state: Array,
    mask: Option<&Array>,
) -> Result<(Array, Array), Exception> {
    let DeltaInputs { q, k, v, g, beta } = x;
    let steps = q.shape()[1];
    let repeat = v.shape()[2] / q.shape()[2];
    let (q, k) = if repeat > 1 {
        (
            Array::repeat_axis::<f32>(q.clone(), repeat, -2)?,
            Array::repeat_axis::<f32>(k.clone(), repeat, -2)?,
        )
    } else {
        (q.clone(), k.clone())
    };
    let mut ys = Vec::with_capacity(steps as usize);
    for t in 0..steps {
        let at = |x: &Array| x.index((.., t));
        let mut args = vec![at(&q), at(&k), at(v), at(g), at(beta), state];
        if let Some(m) = mask {
            args.push(at(m));
        }
        let mut out = Compiled::call(|c| &mut c.step, &args)?;
        state = out
            .pop()
            .ok_or_else(|| Exception::custom("delta step: no state"))?;
        ys.push(
            out.pop()
                .ok_or_else(|| Exception::custom("delta step: no output"))?,
        );
    }
    Ok((stack(&ys, 1)?, state))
}

/// mlx-lm's `_gated_delta_step_ops`, one position: `q`, `k` `[B, H, Dk]`, `v` `[B, H, Dv]`,
/// `g` `[B, H]` (or `[B, H, Dk]`), `beta` `[B, H]`, `state` `[B, H, Dv, Dk]`, and optionally the
/// `[B]` mask (a masked row keeps its state). Returns `[y, state]`.
fn delta_step(args: &[Array]) -> Result<Vec<Array>, Exception> {
    let [q, k, v, g, beta, old, rest @ ..] = args else {
        return Err(Exception::custom("delta step: expected at least 6 inputs"));
    };
    let decay = if g.ndim() == 2 {
        g.expand_dims(-1)?.expand_dims(-1)?
    } else {
        g.expand_dims(-2)?
    };
    let state = old.multiply(decay)?;
    let key = k.expand_dims(-2)?;
    let kv_mem = state.multiply(&key)?.sum_axis(-1, None)?;
    let delta = v.subtract(kv_mem)?.multiply(beta.expand_dims(-1)?)?;
    let state = state.add(key.multiply(delta.expand_dims(-1)?)?)?;
    let y = state.multiply(q.expand_dims(-2)?)?.sum_axis(-1, None)?;
    let state = match rest.first() {
        Some(mask) => select(mask.reshape(&[-1, 1, 1, 1])?, &state, old)?,
        None => state,
    };
    Ok(vec![y.as_dtype(q.dtype())?, state])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::test_arrays::{max_abs_diff, normal};

    fn floats(a: &Array) -> Vec<f32> {
        a.as_type::<f32>().unwrap().as_slice::<f32>().to_vec()
    }

    /// The delta rule written out scalar by scalar (one batch row, one key head per value
    /// head): `S = g S; S += k (beta (v - S k))^T; y = S q`.
    fn naive(x: &DeltaInputs, (t, h, d): (usize, usize, usize)) -> (Vec<f32>, Vec<f32>) {
        let (q, k, v, g, beta) = (
            floats(&x.q),
            floats(&x.k),
            floats(&x.v),
            floats(&x.g),
            floats(&x.beta),
        );
        let mut s = vec![0.0f32; h * d * d];
        let mut y = vec![0.0f32; t * h * d];
        for step in 0..t {
            for head in 0..h {
                let gi = g[step * h + head];
                let bi = beta[step * h + head];
                let kv = |i: usize| k[(step * h + head) * d + i];
                for r in 0..d {
                    let row = &mut s[(head * d + r) * d..(head * d + r + 1) * d];
                    row.iter_mut().for_each(|x| *x *= gi);
                    let mem: f32 = (0..d).map(|i| row[i] * kv(i)).sum();
                    let delta = (v[(step * h + head) * d + r] - mem) * bi;
                    (0..d).for_each(|i| row[i] += kv(i) * delta);
                    y[(step * h + head) * d + r] =
                        (0..d).map(|i| row[i] * q[(step * h + head) * d + i]).sum();
                }
            }
        }
        (y, s)
    }

    #[test]
    fn the_step_loop_computes_the_delta_rule() {
        let (t, h, d) = (5, 2, 4);
        let x = DeltaInputs {
            q: normal(&[1, t, h, d], 1),
            k: normal(&[1, t, h, d], 2),
            v: normal(&[1, t, h, d], 3),
            g: sigmoid(normal(&[1, t, h], 4)).unwrap(),
            beta: sigmoid(normal(&[1, t, h], 5)).unwrap(),
        };
        let state = zeros_dtype(&[1, h, d, d], Dtype::Float32).unwrap();
        let (y, s) = gated_delta_ops(&x, state, None).unwrap();
        let (ny, ns) = naive(&x, (t as usize, h as usize, d as usize));
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max)
        };
        assert_eq!(y.shape(), &[1, t, h, d]);
        assert!(diff(&floats(&y), &ny) < 1e-4);
        assert!(diff(&floats(&s), &ns) < 1e-4);
    }

    #[test]
    fn masked_positions_leave_the_state_unchanged() {
        // Two padded positions (random inputs) ahead of three real ones end in the state the
        // three real ones reach alone, bit for bit.
        let (h, d) = (2, 4);
        let alone = DeltaInputs {
            q: normal(&[1, 3, h, d], 1),
            k: normal(&[1, 3, h, d], 2),
            v: normal(&[1, 3, h, d], 3),
            g: sigmoid(normal(&[1, 3, h], 4)).unwrap(),
            beta: sigmoid(normal(&[1, 3, h], 5)).unwrap(),
        };
        let pad = |x: &Array, seed: u64| {
            let mut shape = x.shape().to_vec();
            shape[1] = 2;
            concatenate(&[normal(&shape, seed), x.clone()], 1).unwrap()
        };
        let padded = DeltaInputs {
            q: pad(&alone.q, 11),
            k: pad(&alone.k, 12),
            v: pad(&alone.v, 13),
            g: pad(&alone.g, 14),
            beta: pad(&alone.beta, 15),
        };
        let zeros = || zeros_dtype(&[1, h, d, d], Dtype::Float32).unwrap();
        let mask = Array::from_slice(&[false, false, true, true, true], &[1, 5]);
        let (_, with_padding) = gated_delta_ops(&padded, zeros(), Some(&mask)).unwrap();
        let (_, without) = gated_delta_ops(&alone, zeros(), None).unwrap();
        assert_eq!(max_abs_diff(&with_padding, &without), 0.0);
        let (_, unmasked) = gated_delta_ops(&padded, zeros(), None).unwrap();
        assert!(max_abs_diff(&unmasked, &without) > 0.0);
    }

    #[test]
    fn state_bytes_count_the_window_and_the_float32_recurrence() {
        let s = DeltaShape {
            key_heads: 2,
            value_heads: 4,
            key_dim: 16,
            value_dim: 8,
            conv_kernel: 4,
            eps: 1e-6,
        };
        // conv_dim = 2 * 32 + 32 = 96; 3 * 96 * 2 bytes + 4 * 8 * 16 * 4 bytes.
        assert_eq!(s.state_bytes(2), 576 + 2048);
        assert!(DeltaShape {
            value_heads: 3,
            ..s
        }
        .check("test")
        .is_err());
        assert!(DeltaShape {
            conv_kernel: 1,
            ..s
        }
        .check("test")
        .is_err());
        assert!(s.check("test").is_ok());
    }
}
