//! LoRA on expert stacks (mlx-lm's `LoRASwitchLinear`): the factors of a `SwitchLinear`
//! `[E, out, in]` are one low-rank pair per expert, `lora_a` `[E, r, in]` and `lora_b`
//! `[E, out, r]`, and each `(token, expert)` pair the router chose takes its expert's pair:
//! `y + scale * gather_mm(gather_mm(x, Aᵀ[e]), Bᵀ[e])`, two gathered matmuls over all pairs
//! of the pass, as the experts' own projection is one. A served adapter's `lora_b` carries its
//! scale since the load (as at linear sites), so the update needs no multiply.
//!
//! In a pass whose rows take different adapters, every adapter's factors at a site are
//! stacked behind a zero entry (no adapter) into `[(n + 1)·E, r_max, in]` and
//! `[(n + 1)·E, out, r_max]`, and each pair gathers the entry `slot · E + expert` of its row's
//! adapter slot ([`PairAdapters`]): rows of several adapters and base rows share the same two
//! gathered matmuls. The slots follow the pairs through the sort by expert that large chunks
//! take ([`PairAdapters::permuted`]).
use mlx_rs::error::Exception;
use mlx_rs::ops::{concatenate, gather_mm, stack, zeros_dtype};
use mlx_rs::{Array, Dtype};

/// Per `(token, expert)` pair of a pass that mixes rows: its row's adapter slot (0: none,
/// `i + 1`: the `i`-th loaded adapter), shaped as the expert ids. (No scale: a served
/// adapter's `B` carries its own.)
#[derive(Debug, Clone)]
pub struct PairAdapters {
    slots: Array,
}

impl PairAdapters {
    /// The pairs of expert ids `indices` `[B, ..., k]` whose rows (the first axis) take the
    /// adapter slots `slots` `[B]`.
    pub(super) fn of_rows(slots: &Array, rows: i32, indices: &Array) -> Result<Self, Exception> {
        let shape = indices.shape();
        if shape.len() < 2 || shape[0] != rows {
            return Err(Exception::custom(format!(
                "an expert stack with adapters got expert ids {shape:?} in a pass of {rows} \
                 rows of different adapters; rows must be the first axis of the ids"
            )));
        }
        let mut per_row = vec![1; shape.len()];
        per_row[0] = rows;
        let slots = slots.as_dtype(Dtype::Uint32)?.reshape(&per_row)?;
        Ok(Self {
            slots: mlx_rs::ops::broadcast_to(slots, shape)?,
        })
    }

    /// The pairs in the order `order` (indices into the flattened pairs): the order of the
    /// rows a sort by expert gathers.
    pub fn permuted(&self, order: &Array) -> Result<Self, Exception> {
        Ok(Self {
            slots: self.slots.flatten(None, None)?.take_axis(order, 0)?,
        })
    }
}

/// `gather_mm(gather_mm(x, Aᵀ[idx]), Bᵀ[idx])` for `a` `[E, r, in]`, `b` `[E, out, r]`, as
/// `LoRASwitchLinear` computes it (before its scale, which a served adapter's `b` carries).
pub(super) fn low_rank(
    x: &Array,
    a: &Array,
    b: &Array,
    indices: &Array,
    sorted: bool,
) -> Result<Array, Exception> {
    let z = gather_mm(x, a.swap_axes(-1, -2)?, None, indices, sorted)?;
    gather_mm(&z, b.swap_axes(-1, -2)?, None, indices, sorted)
}

/// The update of a pass that mixes rows: each pair's entry `slot · E + expert` of the stacked
/// factors (`a` `[(n + 1)·E, r, in]`, `b` `[(n + 1)·E, out, r]`, each adapter's `b` carrying
/// its scale). `x` and `indices` are as the experts' projection takes them.
pub(super) fn mixed_update(
    x: &Array,
    a: &Array,
    b: &Array,
    experts: i32,
    indices: &Array,
    pairs: &PairAdapters,
) -> Result<Array, Exception> {
    let entries = pairs
        .slots
        .multiply(Array::from_int(experts).as_dtype(Dtype::Uint32)?)?
        .add(indices.as_dtype(Dtype::Uint32)?)?;
    // Sorted by expert, the entries of several adapters are not sorted.
    low_rank(x, a, b, &entries, false)
}

/// Every adapter's factors at an expert stack of `experts` experts (`None`: the adapter leaves
/// it alone), behind a zero entry, ranks padded with zeros to the largest, in one dtype (the
/// widest of theirs when they differ): `[(n + 1)·E, r_max, in]` and `[(n + 1)·E, out, r_max]`.
pub(super) fn stacked(
    factors: &[Option<(&Array, &Array)>],
    experts: i32,
    in_dims: i32,
    out_dims: i32,
) -> Result<(Array, Array), Exception> {
    let present: Vec<&(&Array, &Array)> = factors.iter().flatten().collect();
    let rank = present.iter().map(|(a, _)| a.shape()[1]).max().unwrap_or(1);
    let dtype = match present.first() {
        Some((a, _)) if present.iter().all(|(x, _)| x.dtype() == a.dtype()) => a.dtype(),
        _ => Dtype::Float32,
    };
    let zero_a = || zeros_dtype(&[experts, rank, in_dims], dtype);
    let zero_b = || zeros_dtype(&[experts, out_dims, rank], dtype);
    let mut a_parts = vec![zero_a()?];
    let mut b_parts = vec![zero_b()?];
    for f in factors {
        match f {
            None => {
                a_parts.push(zero_a()?);
                b_parts.push(zero_b()?);
            }
            Some((a, b)) => {
                let r = a.shape()[1];
                let (mut a, mut b) = (a.as_dtype(dtype)?, b.as_dtype(dtype)?);
                if r < rank {
                    let pad_a = zeros_dtype(&[experts, rank - r, in_dims], dtype)?;
                    let pad_b = zeros_dtype(&[experts, out_dims, rank - r], dtype)?;
                    a = concatenate(&[a, pad_a], 1)?;
                    b = concatenate(&[b, pad_b], 2)?;
                }
                a_parts.push(a);
                b_parts.push(b);
            }
        }
    }
    let n = a_parts.len() as i32;
    let a = stack(&a_parts, 0)?.reshape(&[n * experts, rank, in_dims])?;
    let b = stack(&b_parts, 0)?.reshape(&[n * experts, out_dims, rank])?;
    Ok((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    fn normal(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, Some(&key)).unwrap()
    }

    fn max_abs_diff(a: &Array, b: &Array) -> f32 {
        let d = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap();
        d.item_exact::<f32>()
    }

    const E: i32 = 4;
    const IN: i32 = 8;
    const OUT: i32 = 6;

    /// Pair by pair with plain matmuls: `scale * x @ A[e].T @ B[e].T`.
    fn by_hand(x: &Array, a: &Array, b: &Array, e: i32, scale: f32) -> Array {
        let z = x.matmul(a.index(e).t()).unwrap();
        z.matmul(b.index(e).t())
            .unwrap()
            .multiply(Array::from_f32(scale))
            .unwrap()
    }

    #[test]
    fn mixed_rows_take_their_adapters_experts_and_base_rows_nothing() {
        // Two adapters of different ranks; rows: adapter 2, none, adapter 1.
        // Two adapters of different ranks, scales 2 and 0.5 (carried by `b`, as loaded);
        // rows: adapter 2, none, adapter 1.
        let (a1, b1) = (normal(&[E, 2, IN], 1), normal(&[E, OUT, 2], 2));
        let (a2, b2) = (normal(&[E, 3, IN], 3), normal(&[E, OUT, 3], 4));
        let scaled = |b: &Array, s: f32| b.multiply(Array::from_f32(s)).unwrap();
        let (sb1, sb2) = (scaled(&b1, 2.0), scaled(&b2, 0.5));
        let (a, b) = stacked(&[Some((&a1, &sb1)), Some((&a2, &sb2))], E, IN, OUT).unwrap();
        assert_eq!(a.shape(), &[3 * E, 3, IN]);
        let slots = Array::from_slice(&[2i32, 0, 1], &[3]);
        // Three rows of one token, two experts each: x [3, 1, 1, 1, IN], ids [3, 1, 2].
        let x = normal(&[3, 1, 1, 1, IN], 5);
        let ids = Array::from_slice(&[1u32, 3, 0, 2, 3, 1], &[3, 1, 2]);
        let pairs = PairAdapters::of_rows(&slots, 3, &ids).unwrap();
        let y = mixed_update(&x, &a, &b, E, &ids, &pairs).unwrap();
        assert_eq!(y.shape(), &[3, 1, 2, 1, OUT]);
        let row = |r: i32| x.index(r).reshape(&[1, IN]).unwrap();
        let expect = [
            (0, 0, by_hand(&row(0), &a2, &b2, 1, 0.5)),
            (0, 1, by_hand(&row(0), &a2, &b2, 3, 0.5)),
            (2, 0, by_hand(&row(2), &a1, &b1, 3, 2.0)),
            (2, 1, by_hand(&row(2), &a1, &b1, 1, 2.0)),
        ];
        for (r, k, want) in expect {
            let got = y.index((r, 0, k)).reshape(&[1, OUT]).unwrap();
            assert!(max_abs_diff(&got, &want) < 1e-4, "row {r}, expert {k}");
        }
        let base = y.index(1);
        assert!(max_abs_diff(&base, &mlx_rs::ops::zeros_like(&base).unwrap()) == 0.0);
        // The same pairs sorted by expert, as a large chunk takes them.
        let order = mlx_rs::ops::argsort_axis(ids.flatten(None, None).unwrap(), -1).unwrap();
        let sorted_ids = ids
            .flatten(None, None)
            .unwrap()
            .take_axis(&order, 0)
            .unwrap();
        let token = order
            .floor_divide(Array::from_int(2).as_dtype(order.dtype()).unwrap())
            .unwrap();
        let xs = x
            .reshape(&[3, 1, IN])
            .unwrap()
            .take_axis(&token, 0)
            .unwrap();
        let permuted = pairs.permuted(&order).unwrap();
        let ys = mixed_update(&xs, &a, &b, E, &sorted_ids, &permuted).unwrap();
        let back = ys
            .take_axis(mlx_rs::ops::argsort_axis(&order, -1).unwrap(), 0)
            .unwrap();
        let diff = max_abs_diff(&back.reshape(&[-1]).unwrap(), &y.reshape(&[-1]).unwrap());
        assert!(diff < 1e-5, "sorted and unsorted pairs differ by {diff}");
    }

    #[test]
    fn rows_must_be_the_first_axis_of_the_ids() {
        let slots = Array::from_slice(&[1i32, 0], &[2]);
        let ids = Array::from_slice(&[0u32, 1, 2, 3, 0, 1], &[3, 2]);
        let err = PairAdapters::of_rows(&slots, 2, &ids).unwrap_err();
        assert!(err.to_string().contains("first axis"), "{err}");
    }
}
