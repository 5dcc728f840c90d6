//! The adapter update of linear layers computed as one product
//! ([`crate::models::stacked::Stacked`]: a layer's q/k/v, an MLP's gate/up), in one product
//! pair instead of a pair per layer.
//!
//! The layers' `A` factors sit side by side (`[in, Σr]`: they read the same input) and their
//! `B` factors on the diagonal of one block matrix (`[Σr, Σout]`, zeros off the blocks), so
//! `(x @ A) @ B` is each layer's own update laid out as the stacked product's columns. The
//! zeros add nothing: each output is its own layer's sum over its own rank, exactly as the
//! layer's own pair computes it. A pass that mixes rows of different adapters masks `x @ A`
//! per row as one layer does ([`super::table`]'s module comment), the mask repeated for each
//! layer's block (every layer's side-by-side factors have the same columns: every loaded
//! adapter's rank, zeros where an adapter leaves a layer alone).
//!
//! The table ([`super::AdapterTable::group_update`]) builds these factors on a group's first
//! pass with an adapter (and, for passes that mix rows, once over every loaded adapter) and
//! keeps them until adapters are loaded or unloaded; DoRA and training passes go layer by
//! layer.
use mlx_rs::error::Exception;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

/// What a stacked product of layers gets from the adapters this pass.
pub enum GroupUpdate {
    /// No update: no row's adapter changes these layers (or no row has an adapter).
    None,
    /// One update for the stacked product ([`GroupFactors::add_to`]).
    Update(GroupFactors),
    /// Each layer adds its own (DoRA's rescale, a training step's factors).
    PerLayer,
}

/// A group's factors for this pass's adapter(s).
#[derive(Clone)]
pub struct GroupFactors {
    /// `[in, layers · R]`.
    pub(super) a: Array,
    /// `[layers · R, Σout]`, block diagonal.
    pub(super) b: Array,
    /// A pass of rows of different adapters: its per-row mask `[B, 1, R]` and the number of
    /// layers, whose blocks of `R` columns each take it.
    pub(super) mask: Option<(Array, i32)>,
}

impl GroupFactors {
    /// `y` (the stacked product, biases added) plus every layer's update for input `x`, in
    /// the order and dtypes a layer's own update takes ([`add_served`], which a single
    /// layer's update goes through too).
    pub fn add_to(&self, x: &Array, y: Array) -> Result<Array, Exception> {
        if let Some((mask, _)) = &self.mask {
            let rows = mask.shape()[0];
            if x.ndim() != 3 || x.shape()[0] != rows {
                return Err(Exception::custom(format!(
                    "linear layers with adapters got input {:?} in a pass of {rows} rows of \
                     different adapters; rows must be the first axis of a [B, L, in] input",
                    x.shape()
                )));
            }
        }
        add_served(
            x,
            &self.a,
            &self.b,
            self.mask.as_ref().map(|(m, l)| (m, *l)),
            y,
        )
    }
}

/// `y` plus a served LoRA update for input `x`: `((x @ a) * mask) @ b`, the scale in `b`, the
/// mask (`[B, 1, W]` over `x` `[B, L, in]`, repeated for `layers` blocks of `W` columns)
/// keeping each row's own adapter's columns. On CUDA, for decode-sized passes, two kernels
/// ([`super::lora_kernel`]); elsewhere the matmuls, masked, then [`add_served_update`].
pub(crate) fn add_served(
    x: &Array,
    a: &Array,
    b: &Array,
    mask: Option<(&Array, i32)>,
    y: Array,
) -> Result<Array, Exception> {
    if super::lora_kernel::serves(x, a, b, &y, mask) {
        return super::lora_kernel::add_update(x, a, b, &y, mask);
    }
    let h = masked(x.matmul(a)?, mask)?;
    add_served_update(y, &h, b, x.dtype())
}

/// `h` (`x @ A`, `[B, L, layers · W]`) times the per-row mask (`[B, 1, W]`, repeated for each
/// of `layers` blocks of `W` columns); `h` as it is without one.
pub(super) fn masked(h: Array, mask: Option<(&Array, i32)>) -> Result<Array, Exception> {
    match mask {
        None => Ok(h),
        // One layer's block: the mask broadcasts as it is (no reshapes, which are graph nodes
        // a decode step pays for on the host).
        Some((mask, 1)) => h.multiply(mask),
        Some((mask, layers)) => {
            let s = h.shape().to_vec();
            let (rows, width) = (mask.shape()[0], mask.shape()[2]);
            let by_layer = h.reshape(&[s[0], s[1], layers, width])?;
            by_layer
                .multiply(mask.reshape(&[rows, 1, 1, width])?)?
                .reshape(&s)
        }
    }
}

/// `y + h @ b` for a served LoRA update (the scale folded into `b`) on a layer whose input has
/// `dtype`: one `addmm` where `h`, `b` and `y` all have `dtype` (rounded once where mlx-lm
/// rounds `h @ b` first); otherwise `h @ b` in the factors' dtype, cast to `dtype` and added
/// as mlx-lm's `(scale * z).astype(x.dtype)`, the cast and the sum one compiled kernel (float32
/// factors, as `mlx_lm.lora` writes them, on a bf16 or f16 base: two launches were three).
pub(super) fn add_served_update(
    y: Array,
    h: &Array,
    b: &Array,
    dtype: Dtype,
) -> Result<Array, Exception> {
    if h.dtype() == dtype && b.dtype() == dtype && y.dtype() == dtype {
        mlx_rs::ops::addmm(&y, h, b, 1.0, 1.0)
    } else if y.dtype() == dtype {
        crate::models::kept::call_one(cast_and_add, true, &[y, h.matmul(b)?])
    } else {
        y.add(&h.matmul(b)?.as_dtype(dtype)?)
    }
}

/// `args[0] + args[1]` cast to `args[0]`'s dtype (compiled by [`add_served_update`]).
fn cast_and_add(args: &[Array]) -> Result<Vec<Array>, Exception> {
    Ok(vec![args[0].add(&args[1].as_dtype(args[0].dtype())?)?])
}

/// The layers' `A` factors `[in, r_j]` side by side, in `dtype`.
pub(super) fn side_by_side(a: &[Array], dtype: Dtype) -> Result<Array, Exception> {
    let parts = a
        .iter()
        .map(|a| a.as_dtype(dtype))
        .collect::<Result<Vec<_>, _>>()?;
    concatenate(&parts, 1)
}

/// The layers' `B` factors `[r_j, out_j]` on the diagonal of one `[Σr, Σout]` matrix, zeros
/// elsewhere, in `dtype`.
pub(super) fn block_diagonal(b: &[Array], dtype: Dtype) -> Result<Array, Exception> {
    let outs: Vec<i32> = b.iter().map(|b| b.shape()[1]).collect();
    let total: i32 = outs.iter().sum();
    let mut rows = Vec::with_capacity(b.len());
    let mut before = 0;
    for (block, out) in b.iter().zip(&outs) {
        let r = block.shape()[0];
        let mut row = Vec::with_capacity(3);
        if before > 0 {
            row.push(zeros_dtype(&[r, before], dtype)?);
        }
        row.push(block.as_dtype(dtype)?);
        let after = total - before - out;
        if after > 0 {
            row.push(zeros_dtype(&[r, after], dtype)?);
        }
        rows.push(concatenate(&row, 1)?);
        before += out;
    }
    concatenate(&rows, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::test_arrays::{max_abs_diff, normal};

    #[test]
    fn the_block_diagonal_holds_each_block_and_zeros_elsewhere() {
        let b1 = normal(&[2, 3], 1);
        let b2 = normal(&[2, 4], 2);
        let d = block_diagonal(&[b1.clone(), b2.clone()], Dtype::Float32).unwrap();
        assert_eq!(d.shape(), &[4, 7]);
        use mlx_rs::ops::indexing::IndexOp;
        assert_eq!(max_abs_diff(&d.index((0..2, 0..3)), &b1), 0.0);
        assert_eq!(max_abs_diff(&d.index((2..4, 3..7)), &b2), 0.0);
        let off = d.index((0..2, 3..7)).abs().unwrap().sum(None).unwrap();
        let off2 = d.index((2..4, 0..3)).abs().unwrap().sum(None).unwrap();
        assert_eq!(off.item_exact::<f32>() + off2.item_exact::<f32>(), 0.0);
    }

    /// Float32 factors on a float16 layer: the product, then the cast and the sum as one
    /// compiled kernel, equal to casting and adding op by op.
    #[test]
    fn a_float32_update_on_a_float16_layer_is_cast_and_added_in_one_kernel() {
        let h = normal(&[2, 3, 4], 11);
        let b = normal(&[4, 8], 12);
        let y = normal(&[2, 3, 8], 13).as_dtype(Dtype::Float16).unwrap();
        mlx_rs::transforms::eval([&h, &b, &y]).unwrap();
        let out = add_served_update(y.clone(), &h, &b, Dtype::Float16).unwrap();
        assert_eq!(out.dtype(), Dtype::Float16);
        let counts = crate::graph_ops::op_counts(&out);
        assert_eq!(
            counts.computing(),
            2,
            "a product and one kernel: {counts:?}"
        );
        let plain = y
            .add(h.matmul(&b).unwrap().as_dtype(Dtype::Float16).unwrap())
            .unwrap();
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        assert_eq!(max_abs_diff(&f32(&out), &f32(&plain)), 0.0);
    }

    /// Two layers' updates from one product pair equal each layer's own pair, for a pass of
    /// one adapter and for rows of different adapters (masked per row).
    #[test]
    fn the_group_update_is_each_layers_own() {
        let x = normal(&[3, 2, 16], 3);
        let (a1, b1) = (normal(&[16, 4], 4), normal(&[4, 8], 5));
        let (a2, b2) = (normal(&[16, 4], 6), normal(&[4, 6], 7));
        let y = normal(&[3, 2, 14], 8);
        let own = |a: &Array, b: &Array, mask: Option<&Array>| {
            let h = x.matmul(a).unwrap();
            let h = match mask {
                Some(m) => h.multiply(m).unwrap(),
                None => h,
            };
            h.matmul(b).unwrap()
        };
        let group = |mask: Option<(Array, i32)>| GroupFactors {
            a: side_by_side(&[a1.clone(), a2.clone()], Dtype::Float32).unwrap(),
            b: block_diagonal(&[b1.clone(), b2.clone()], Dtype::Float32).unwrap(),
            mask,
        };
        let expect = |mask: Option<&Array>| {
            let u = concatenate(&[own(&a1, &b1, mask), own(&a2, &b2, mask)], -1).unwrap();
            y.add(&u).unwrap()
        };
        let got = group(None).add_to(&x, y.clone()).unwrap();
        assert!(max_abs_diff(&got, &expect(None)) < 1e-5);
        // Row 0 takes the first two columns, row 1 the last two, row 2 none (a base row).
        let mask = Array::from_slice(
            &[
                1.0f32, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0,
            ],
            &[3, 1, 4],
        );
        let got = group(Some((mask.clone(), 2)))
            .add_to(&x, y.clone())
            .unwrap();
        assert!(max_abs_diff(&got, &expect(Some(&mask))) < 1e-5);
        use mlx_rs::ops::indexing::IndexOp;
        assert_eq!(
            max_abs_diff(&got.index(2), &y.index(2)),
            0.0,
            "a base row is unchanged"
        );
    }
}
