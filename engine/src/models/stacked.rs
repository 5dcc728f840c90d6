//! Linear layers that read the same input, computed as one product: a layer's query, key and
//! value projections, an MLP's gate and up projections.
//!
//! At load their matrices are stacked row-wise into one (`[q_out + k_out + v_out, in]`, or the
//! packed weights, scales and biases of a quantized matrix alike), and each layer keeps a view
//! of its own rows, which shares the stacked buffer: the weights are held once, and everything
//! that reads a layer's own matrix (an adapter's DoRA rescale, the parameter list, the memory
//! figures) reads the same values as before. A pass computes `x @ Wᵀ` once, adds the stacked
//! bias and the layers' adapter update (one product pair for the stack,
//! [`crate::adapters::group`]) and splits the result along its last axis (views, no copy). A
//! pass that needs each layer's own update (DoRA, a training step) splits first and lets each
//! layer finish its part ([`Linear::finish`]), as it would after its own product. An expert
//! block's gate and up stacks stack the same way along their rows (`super::switch`).
//!
//! **Decision: serving stacks, training does not.** A decode step of a small model is made of
//! many small products, and on CUDA each one that MLX hands to cuBLAS (every product of more
//! than one row) is a captured sub-graph of its own. Issue 21's H100 runs put mlxd's decode step
//! at 4.6–5.1 ms for 8 to 64 rows of the 1B shape, against 1.9 ms for one row (where MLX takes
//! its own matrix-vector kernel) and ~0.7 ms for reading the weights once, which points at a
//! cost per product rather than per byte; stacking bore it out on an H100 (2026-12-06,
//! `scripts/bench/switch_ab.sh <out> MLXD_STACKED_PROJECTIONS 1 0`): decode 22% faster at 8
//! rows, 19% at 32, 8% at 64 (BENCHMARKS.md). Stacking cuts a Llama layer's seven
//! products to four, and a narrow product (a 512-wide key projection covers a few of an H100's
//! 132 multiprocessors) becomes part of a wide one. A training pass differentiates through the
//! split, whose gradient is a zero-filled array per part, so a training job's process turns
//! stacking off ([`set_enabled`], called by `crate::job::train::configure_process`).
//! `MLXD_STACKED_PROJECTIONS=0` turns it off for a serving engine, to measure both ways.
//!
//! Layers stack only when their matrices are alike (all dense of one dtype, or all quantized
//! with the same bits, group size and mode); otherwise each keeps its own product.
use std::sync::atomic::{AtomicBool, Ordering};

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use super::layers::{Linear, Matrix, MatrixCell, QuantizedMatrix};
use super::params::parameters_of;
use crate::adapters::widened::Epilogue;
use crate::adapters::{AdapterTable, GroupUpdate, LoraSite};

/// The environment variable that turns stacking off (`0`) or on (`1`, the default).
pub const STACKED_PROJECTIONS_ENV: &str = "MLXD_STACKED_PROJECTIONS";

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Whether models loaded from now on stack their projections; set once at a process's start,
/// before it loads a model (a process-wide setting).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Applies [`STACKED_PROJECTIONS_ENV`] when set; a value other than `0` or `1` is an error
/// naming it (the engine refuses to start rather than guess).
pub fn stacked_projections_from_env() -> Result<(), String> {
    if let Ok(value) = std::env::var(STACKED_PROJECTIONS_ENV) {
        set_enabled(parse_switch(&value)?);
    }
    Ok(())
}

/// [`STACKED_PROJECTIONS_ENV`]'s value as on or off.
fn parse_switch(value: &str) -> Result<bool, String> {
    match value.trim() {
        "1" => Ok(true),
        "0" => Ok(false),
        _ => Err(format!(
            "{STACKED_PROJECTIONS_ENV}={value:?}: expected 1 (projections that read the same \
             input are one product, the default) or 0 (one product each)"
        )),
    }
}

/// The stacked matrix of some linear layers and where each one's output ends.
#[derive(Debug)]
pub struct Stacked {
    /// Replaceable as a layer's is ([`MatrixCell`]): a widened product swaps in a view.
    matrix: MatrixCell,
    /// Their biases end to end, when every layer has one (each layer then keeps a view).
    bias: Option<Array>,
    /// The split points of the product's last axis: each layer's end but the last's.
    ends: Vec<i32>,
}

impl Stacked {
    /// Stacks `layers` (in order) and gives each a view of its rows; `None`, with the layers
    /// left as they were, when stacking is off, there are fewer than two, their matrices
    /// differ in kind (see the module comment), or some have a bias and others none.
    pub fn of(layers: &mut [&mut Linear]) -> Result<Option<Stacked>, Exception> {
        if !enabled() || layers.len() < 2 {
            return Ok(None);
        }
        let biased = layers.iter().filter(|l| l.bias.is_some()).count();
        if biased != 0 && biased != layers.len() {
            return Ok(None);
        }
        let matrices: Vec<Matrix> = layers.iter().map(|l| l.matrix.get()).collect();
        let Some(matrix) = stack(&matrices.iter().collect::<Vec<_>>())? else {
            return Ok(None);
        };
        let mut ends = Vec::with_capacity(layers.len());
        let mut end = 0;
        for m in &matrices {
            end += rows_of(m.weight());
            ends.push(end);
        }
        ends.pop();
        drop(matrices);
        let views = split_rows(&matrix, &ends)?;
        for (layer, view) in layers.iter_mut().zip(views) {
            layer.matrix.replace(view);
        }
        let bias = if biased == 0 {
            None
        } else {
            let biases: Vec<&Array> = layers.iter().filter_map(|l| l.bias.as_ref()).collect();
            let bias = concatenate(&biases, 0)?;
            for (layer, view) in layers.iter_mut().zip(bias.split_at_indices(&ends, 0)?) {
                layer.bias = Some(view);
            }
            Some(bias)
        };
        Ok(Some(Stacked {
            matrix: MatrixCell::new(matrix),
            bias,
            ends,
        }))
    }

    /// Each layer's output for input `x`, from one product: `layers` are the ones stacked, in
    /// the same order. The adapters' update of the layers is one product pair as well
    /// ([`crate::adapters::group`]) unless this pass needs each layer's own (DoRA, training).
    pub fn forward(&self, x: &Array, layers: &[&Linear]) -> Result<Vec<Array>, Exception> {
        if let Some(parts) = self.forward_joined(x, layers, &self.ends)? {
            return Ok(parts);
        }
        let parts = self
            .matrix
            .with(|m| m.matmul_t(x))?
            .split_at_indices(&self.ends, -1)?;
        layers
            .iter()
            .zip(parts)
            .map(|(layer, y)| layer.finish(x, y))
            .collect()
    }

    /// The stacked output for input `x`, its bias and this pass's adapter update added, split
    /// at `ends` (some of [`Self::ends`]: neighbouring layers may stay joined, such as queries
    /// and keys that rotate together); `None` when this pass needs each layer's own output
    /// (a DoRA adapter, a training step), which [`Self::forward`] then gives.
    pub fn forward_joined(
        &self,
        x: &Array,
        layers: &[&Linear],
        ends: &[i32],
    ) -> Result<Option<Vec<Array>>, Exception> {
        if layers.len() != self.ends.len() + 1 {
            return Err(Exception::custom(format!(
                "a stacked product of {} layers was asked for {}",
                self.ends.len() + 1,
                layers.len()
            )));
        }
        let rows = AdapterRows::of(layers);
        // The adapters' `x @ A` as more columns of the product itself, where this pass takes
        // it (`crate::adapters::widened`; bias-free stacks), before any factors are built
        // for the two-product update it replaces.
        if let Some(y) = self.widened(x, layers, &rows, Epilogue::None)? {
            return Ok(Some(y.split_at_indices(ends, -1)?));
        }
        let update = match &rows {
            AdapterRows::Base => GroupUpdate::None,
            AdapterRows::Group(table, indices) => table.group_update(indices)?,
            AdapterRows::Apart => GroupUpdate::PerLayer,
        };
        let y = self.matrix.with(|m| m.matmul_t(x))?;
        let y = match update {
            GroupUpdate::PerLayer => return Ok(None),
            GroupUpdate::None => self.with_bias(y)?,
            GroupUpdate::Update(factors) => factors.add_to(x, self.with_bias(y)?)?,
        };
        Ok(Some(y.split_at_indices(ends, -1)?))
    }

    /// `silu(gate) · up` of a stacked gate and up projection (`layers`, in that order) for
    /// `x`, when this pass takes a widened product (which then does the activation in the
    /// site's kernel, [`Epilogue::SwiGlu`]); `None`: the caller projects and activates.
    pub fn widened_swiglu(
        &self,
        x: &Array,
        layers: &[&Linear],
    ) -> Result<Option<Array>, Exception> {
        if layers.len() != 2 || self.ends.len() != 1 {
            return Ok(None);
        }
        self.widened(x, layers, &AdapterRows::of(layers), Epilogue::SwiGlu)
    }

    /// The stacked output for `x` through the layers' widened product, then `epilogue`, when
    /// this pass takes one (a row's adapter changes a layer, bias-free stacks).
    fn widened(
        &self,
        x: &Array,
        layers: &[&Linear],
        rows: &AdapterRows<'_>,
        epilogue: Epilogue<'_>,
    ) -> Result<Option<Array>, Exception> {
        let (AdapterRows::Group(table, indices), None) = (rows, &self.bias) else {
            return Ok(None);
        };
        let Some(pass) = table.widened_group(indices, &self.matrix, x, epilogue)? else {
            return Ok(None);
        };
        if pass.rebuilt {
            // The stacked matrix is now a view of the widened one: the layers' views of the
            // old buffer follow, which lets it go.
            self.point_layers_at_stack(layers)?;
        }
        Ok(Some(pass.output))
    }

    /// Gives each of `layers` (the ones stacked, in order) a view of its rows of the stacked
    /// matrix as it is now.
    fn point_layers_at_stack(&self, layers: &[&Linear]) -> Result<(), Exception> {
        let views = split_rows(&self.matrix.get(), &self.ends)?;
        mlx_rs::transforms::eval(
            views
                .iter()
                .flat_map(parameters_of)
                .collect::<Vec<_>>()
                .iter(),
        )?;
        for (layer, view) in layers.iter().zip(views) {
            layer.matrix.replace(view);
        }
        Ok(())
    }

    /// Where each layer's output ends in the stacked product, but the last's.
    pub fn ends(&self) -> &[i32] {
        &self.ends
    }

    fn with_bias(&self, y: Array) -> Result<Array, Exception> {
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }
}

/// What a pass's rows ask of some stacked layers' adapter sites.
enum AdapterRows<'s> {
    /// No row's adapter changes any of the layers (the base's passes, every pass of a model
    /// without adapters): nothing more is built or allocated.
    Base,
    /// Some row's adapter does, and the layers are sites of one table: their indices there.
    Group(&'s AdapterTable, Vec<usize>),
    /// Some row's adapter does, but the layers are not one group (a layer without a site).
    Apart,
}

impl<'s> AdapterRows<'s> {
    fn of(layers: &[&'s Linear]) -> Self {
        if !layers
            .iter()
            .any(|l| l.lora.as_ref().is_some_and(LoraSite::engaged))
        {
            return AdapterRows::Base;
        }
        let sites: Option<Vec<&LoraSite>> = layers.iter().map(|l| l.lora.as_ref()).collect();
        match sites.as_deref().and_then(LoraSite::group) {
            Some((table, indices)) => AdapterRows::Group(table, indices),
            None => AdapterRows::Apart,
        }
    }
}

/// A matrix's output rows: its second-to-last axis (`[out, in]`, or an expert stack's
/// `[E, out, in]`).
pub(crate) fn rows_of(weight: &Array) -> i32 {
    weight.shape()[weight.ndim().saturating_sub(2)]
}

/// Whether two arrays have the same shape but for their rows (the second-to-last axis).
fn same_but_rows(a: &Array, b: &Array) -> bool {
    let (a, b) = (a.shape(), b.shape());
    a.len() >= 2
        && a.len() == b.len()
        && a.iter()
            .zip(b)
            .enumerate()
            .all(|(i, (x, y))| i == a.len() - 2 || x == y)
}

/// The outputs of `layers` for input `x`: one product when they are `stacked` (in this
/// order), each layer's own otherwise.
pub fn project<const N: usize>(
    stacked: Option<&Stacked>,
    x: &Array,
    layers: [&Linear; N],
) -> Result<[Array; N], Exception> {
    let outputs = match stacked {
        Some(s) => s.forward(x, &layers)?,
        None => layers
            .iter()
            .map(|l| l.forward(x))
            .collect::<Result<_, _>>()?,
    };
    outputs.try_into().map_err(|v: Vec<Array>| {
        Exception::custom(format!("{N} linear layers gave {} outputs", v.len()))
    })
}

/// The matrices (or expert stacks) stacked along their rows, or `None` when they are not
/// alike.
pub(crate) fn stack(matrices: &[&Matrix]) -> Result<Option<Matrix>, Exception> {
    let rows = |arrays: Vec<&Array>| concatenate(&arrays, -2);
    match matrices[0] {
        Matrix::Dense(first) => {
            let mut weights = Vec::with_capacity(matrices.len());
            for m in matrices {
                match m {
                    Matrix::Dense(w) if w.dtype() == first.dtype() && same_but_rows(w, first) => {
                        weights.push(w)
                    }
                    _ => return Ok(None),
                }
            }
            Ok(Some(Matrix::Dense(rows(weights)?)))
        }
        Matrix::Quantized(first) => {
            let mut parts = Vec::with_capacity(matrices.len());
            for m in matrices {
                match m {
                    Matrix::Quantized(q) if alike(q, first) => parts.push(q),
                    _ => return Ok(None),
                }
            }
            let biases = match first.biases {
                Some(_) => Some(rows(
                    parts.iter().filter_map(|q| q.biases.as_ref()).collect(),
                )?),
                None => None,
            };
            Ok(Some(Matrix::Quantized(QuantizedMatrix {
                weight: rows(parts.iter().map(|q| &q.weight).collect())?,
                scales: rows(parts.iter().map(|q| &q.scales).collect())?,
                biases,
                group_size: first.group_size,
                bits: first.bits,
                mode: first.mode,
            })))
        }
    }
}

/// Whether two quantized matrices pack alike, so that their rows may share one product.
fn alike(q: &QuantizedMatrix, first: &QuantizedMatrix) -> bool {
    q.bits == first.bits
        && q.group_size == first.group_size
        && q.mode == first.mode
        && q.biases.is_some() == first.biases.is_some()
        && q.weight.dtype() == first.weight.dtype()
        && q.scales.dtype() == first.scales.dtype()
        && same_but_rows(&q.weight, &first.weight)
        && same_but_rows(&q.scales, &first.scales)
}

/// The stacked matrix cut back into each layer's rows (views of its buffers).
pub(crate) fn split_rows(matrix: &Matrix, ends: &[i32]) -> Result<Vec<Matrix>, Exception> {
    match matrix {
        Matrix::Dense(w) => Ok(w
            .split_at_indices(ends, -2)?
            .into_iter()
            .map(Matrix::Dense)
            .collect()),
        Matrix::Quantized(q) => {
            let weights = q.weight.split_at_indices(ends, -2)?;
            let scales = q.scales.split_at_indices(ends, -2)?;
            let mut biases = match &q.biases {
                Some(b) => b
                    .split_at_indices(ends, -2)?
                    .into_iter()
                    .map(Some)
                    .collect(),
                None => vec![None; weights.len()],
            };
            Ok(weights
                .into_iter()
                .zip(scales)
                .zip(biases.drain(..))
                .map(|((weight, scales), biases)| {
                    Matrix::Quantized(QuantizedMatrix {
                        weight,
                        scales,
                        biases,
                        group_size: q.group_size,
                        bits: q.bits,
                        mode: q.mode,
                    })
                })
                .collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph_ops::op_counts;
    use crate::models::quant::QuantMode;
    use crate::models::test_arrays::{max_abs_diff, normal};

    fn dense(rows: i32, inputs: i32, seed: u64, bias: bool) -> Linear {
        Linear::new(
            Matrix::Dense(normal(&[rows, inputs], seed)),
            bias.then(|| normal(&[rows], seed + 100)),
            None,
        )
    }

    fn quantized(rows: i32, inputs: i32, seed: u64, bits: i32) -> Linear {
        let (weight, scales, biases) =
            mlx_rs::ops::quantize(normal(&[rows, inputs], seed), 64, bits).unwrap();
        Linear::new(
            Matrix::Quantized(QuantizedMatrix {
                weight,
                scales,
                biases: Some(biases),
                group_size: 64,
                bits,
                mode: QuantMode::Affine,
            }),
            None,
            None,
        )
    }

    /// Each layer's own output before stacking, then the stacked product's parts and each
    /// layer's output after: all equal, element for element.
    fn stacks_exactly(mut layers: Vec<Linear>, x: &Array) -> Stacked {
        let alone: Vec<Array> = layers.iter().map(|l| l.forward(x).unwrap()).collect();
        let stacked = {
            let mut refs: Vec<&mut Linear> = layers.iter_mut().collect();
            Stacked::of(&mut refs)
                .unwrap()
                .expect("alike matrices stack")
        };
        let refs: Vec<&Linear> = layers.iter().collect();
        let parts = stacked.forward(x, &refs).unwrap();
        assert_eq!(parts.len(), alone.len());
        for (i, (part, own)) in parts.iter().zip(&alone).enumerate() {
            assert_eq!(part.shape(), own.shape(), "layer {i}");
            assert_eq!(max_abs_diff(part, own), 0.0, "layer {i}: stacked product");
            let after = layers[i].forward(x).unwrap();
            assert_eq!(max_abs_diff(&after, own), 0.0, "layer {i}: its own view");
        }
        stacked
    }

    #[test]
    fn dense_layers_give_their_own_outputs_from_one_product() {
        // A Llama-like q/k/v: 4 query heads over 2 KV heads of 16, biased (Qwen-style).
        let x = normal(&[2, 3, 64], 1);
        let layers = vec![
            dense(64, 64, 2, true),
            dense(32, 64, 3, true),
            dense(32, 64, 4, true),
        ];
        stacks_exactly(layers, &x);
        // One row, as a decode step of one sequence.
        let x = normal(&[1, 1, 64], 5);
        stacks_exactly(vec![dense(128, 64, 6, false), dense(128, 64, 7, false)], &x);
    }

    #[test]
    fn quantized_layers_give_their_own_outputs_from_one_product() {
        let x = normal(&[2, 3, 128], 8);
        let layers = vec![
            quantized(64, 128, 9, 4),
            quantized(32, 128, 10, 4),
            quantized(32, 128, 11, 4),
        ];
        stacks_exactly(layers, &x);
    }

    #[test]
    fn the_stacked_layers_build_one_product() {
        let x = normal(&[4, 1, 64], 22);
        x.eval().unwrap();
        let mut layers = [
            dense(64, 64, 23, true),
            dense(32, 64, 24, true),
            dense(32, 64, 25, true),
        ];
        for l in &layers {
            mlx_rs::transforms::eval([l.matrix.get().weight()]).unwrap();
        }
        let alone: Vec<Array> = layers.iter().map(|l| l.forward(&x).unwrap()).collect();
        let products: usize = alone.iter().map(|y| op_counts(y).products()).sum();
        assert_eq!(products, 3);
        let [q, k, v] = &mut layers;
        let stacked = Stacked::of(&mut [q, k, v]).unwrap().unwrap();
        let parts = stacked
            .forward(&x, &[&layers[0], &layers[1], &layers[2]])
            .unwrap();
        let out = concatenate(&parts, -1).unwrap();
        let counts = op_counts(&out);
        assert_eq!(counts.products(), 1, "{counts:?}");
    }

    #[test]
    fn the_weights_are_held_once() {
        let mut layers = [dense(64, 64, 13, false), dense(32, 64, 14, false)];
        let [q, k] = &mut layers;
        let stacked = Stacked::of(&mut [q, k]).unwrap().unwrap();
        let Matrix::Dense(all) = &stacked.matrix.get() else {
            panic!("dense layers stack dense")
        };
        mlx_rs::transforms::eval([all]).unwrap();
        let base = all.as_slice::<f32>().as_ptr();
        for (layer, offset) in layers.iter().zip([0usize, 64 * 64]) {
            let Matrix::Dense(view) = &layer.matrix.get() else {
                panic!("a dense layer keeps a dense view")
            };
            mlx_rs::transforms::eval([view]).unwrap();
            let at = view.as_slice::<f32>().as_ptr();
            assert_eq!(
                at,
                base.wrapping_add(offset),
                "a view of the stacked buffer"
            );
        }
    }

    #[test]
    fn unlike_matrices_keep_their_own_products() {
        let mut mixed = [dense(64, 128, 15, false), quantized(64, 128, 16, 4)];
        let [a, b] = &mut mixed;
        assert!(Stacked::of(&mut [a, b]).unwrap().is_none());
        assert!(
            matches!(mixed[1].matrix.get(), Matrix::Quantized(_)),
            "left as it was"
        );
        let mut bits = [quantized(64, 128, 17, 4), quantized(64, 128, 18, 8)];
        let [a, b] = &mut bits;
        assert!(Stacked::of(&mut [a, b]).unwrap().is_none());
        let mut widths = [dense(64, 128, 19, false), dense(64, 64, 20, false)];
        let [a, b] = &mut widths;
        assert!(Stacked::of(&mut [a, b]).unwrap().is_none());
        let mut one = [dense(64, 128, 21, false)];
        let [a] = &mut one;
        assert!(Stacked::of(&mut [a]).unwrap().is_none());
    }

    #[test]
    fn the_switch_takes_0_or_1_and_names_itself_otherwise() {
        assert_eq!(parse_switch("1"), Ok(true));
        assert_eq!(parse_switch(" 0\n"), Ok(false));
        let err = parse_switch("yes").unwrap_err();
        assert!(
            err.contains(STACKED_PROJECTIONS_ENV) && err.contains("\"yes\""),
            "{err}"
        );
    }
}
