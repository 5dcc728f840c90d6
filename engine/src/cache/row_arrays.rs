//! The per-row arrays of a batched layout (rotary offsets, the padding mask), made once per
//! forward pass and shared by every layer, instead of once per layer.
//!
//! Every layer of a batch holds its own cache, and all of them describe the same rows: the
//! same padding, the same offsets, so the same mask. Built layer by layer, a decode step of
//! rows at different positions (prompts of different lengths: the usual served batch) made
//! two or three arrays from host data per layer. On CUDA each such array is an allocation of
//! unified memory, and its release can synchronise with the device once MLX's buffer cache is
//! at its limit: on an H100 the 1B shape's decode step of 32 such rows took 5.0 ms against
//! 3.5 ms for rows of one length (BENCHMARKS.md, session 42), the difference almost all host
//! time. Here each array is made once for the values it stands for and reused while a later
//! call asks for the same values: the host-made arrays (a row's shift, its padding) change
//! only when rows join or leave, and what a step derives from them (its offsets, its mask)
//! is computed on the device once per step.
//!
//! The memo is per thread (a model runs its passes on one thread) and keyed by the values
//! themselves, so a layer can never be given another layout's array: at worst two layouts
//! used in turn (a draft model's batch, a sliding-window layer beside a global one) each make
//! their own. It keeps the last few arrays of each kind ([`KEPT`]), none larger than
//! [`MAX_KEPT_ELEMENTS`].
use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::Array;

/// Arrays kept per kind: enough for the layouts one pass uses in turn (a model with windowed
/// and global layers asks for two masks a step; a draft model's batch adds its own).
const KEPT: usize = 4;

/// The most elements an array may have to be kept: a decode step's mask of 128 rows over 32k
/// positions (4 MB of booleans). A larger one (a padded prefill group's mask over a long
/// context) is made for each call, as before: the memo holds what it keeps past the pass,
/// outside the KV budget, so it keeps at most `KEPT` such arrays of each kind.
const MAX_KEPT_ELEMENTS: usize = 1 << 22;

/// What an array stands for; its key holds the values it is made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `[B]` int32 made on the host: each row's logical length subtracted from the layout's
    /// write position (its padding and holes, less its evicted positions).
    Shift,
    /// `[B]` int32: each row's rotary offset (write position less shift).
    Offsets,
    /// `[B, 1, 1, 1]` int32 made on the host: each row's left padding.
    Padding,
    /// A `[B, 1, L, T]` boolean attention mask.
    Mask,
    /// `[B, 1]` int32 made on the host: a recurrent state's padding ahead of each row.
    StatePadding,
    /// A recurrent state's `[B, L]` mask.
    StateMask,
}

thread_local! {
    static MEMO: RefCell<Vec<(Kind, Vec<i32>, Array)>> = const { RefCell::new(Vec::new()) };
}

/// The array of `kind` for `key` (every value it is made from): the one made last for them
/// on this thread, or `make`'s, kept for the next call.
pub(crate) fn shared(
    kind: Kind,
    key: &[i32],
    make: impl FnOnce() -> Result<Array, Exception>,
) -> Result<Array, Exception> {
    let found = MEMO.with(|m| {
        m.borrow()
            .iter()
            .find(|(k, values, _)| *k == kind && values == key)
            .map(|(_, _, a)| a.clone())
    });
    if let Some(a) = found {
        return Ok(a);
    }
    let a = make()?;
    if a.size() > MAX_KEPT_ELEMENTS {
        return Ok(a);
    }
    MEMO.with(|m| {
        let mut m = m.borrow_mut();
        if m.iter().filter(|(k, _, _)| *k == kind).count() >= KEPT {
            let oldest = m
                .iter()
                .position(|(k, _, _)| *k == kind)
                .expect("counted above");
            m.remove(oldest);
        }
        m.push((kind, key.to_vec(), a.clone()));
    });
    Ok(a)
}

/// `values` as an int32 array of `shape`, made on the host once for as long as they are
/// asked for (see [`shared`]).
pub(crate) fn host_i32(kind: Kind, values: &[i32], shape: &[i32]) -> Result<Array, Exception> {
    let mut key = shape.to_vec();
    key.push(-1);
    key.extend_from_slice(values);
    shared(kind, &key, || Ok(Array::from_slice(values, shape)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where an array's data lies (one array, however many handles).
    fn data(a: &Array) -> *const i32 {
        a.as_slice::<i32>().as_ptr()
    }

    #[test]
    fn the_same_values_give_the_same_array_and_other_values_another() {
        let a = host_i32(Kind::Padding, &[0, 3], &[2, 1, 1, 1]).unwrap();
        let b = host_i32(Kind::Padding, &[0, 3], &[2, 1, 1, 1]).unwrap();
        assert_eq!(data(&a), data(&b), "one array for the same values");
        let c = host_i32(Kind::Padding, &[0, 4], &[2, 1, 1, 1]).unwrap();
        assert_ne!(data(&a), data(&c));
        assert_eq!(c.as_slice::<i32>(), &[0, 4]);
        // Same values, another shape or kind: not the same array.
        let d = host_i32(Kind::Padding, &[0, 3], &[2]).unwrap();
        assert_eq!(d.shape(), &[2]);
        let e = host_i32(Kind::Shift, &[0, 3], &[2, 1, 1, 1]).unwrap();
        assert_ne!(data(&a), data(&e));
    }

    #[test]
    fn an_array_past_the_bound_is_made_each_time() {
        let big = || {
            shared(Kind::Mask, &[1, 2, 3], || {
                Array::zeros::<bool>(&[1, 1, 1, MAX_KEPT_ELEMENTS as i32 + 1])
            })
            .unwrap()
        };
        let bool_data = |a: &Array| a.as_slice::<bool>().as_ptr();
        let (a, b) = (big(), big());
        assert_ne!(bool_data(&a), bool_data(&b), "not kept");
        let small = || {
            shared(Kind::Mask, &[1, 2, 4], || {
                Array::zeros::<bool>(&[1, 1, 1, 8])
            })
            .unwrap()
        };
        let (a, b) = (small(), small());
        assert_eq!(bool_data(&a), bool_data(&b), "kept");
    }

    #[test]
    fn each_kind_keeps_its_last_few_arrays() {
        let first = host_i32(Kind::StatePadding, &[1], &[1, 1]).unwrap();
        for v in 2..=KEPT as i32 {
            host_i32(Kind::StatePadding, &[v], &[1, 1]).unwrap();
        }
        let again = host_i32(Kind::StatePadding, &[1], &[1, 1]).unwrap();
        assert_eq!(data(&first), data(&again), "still kept");
        for v in 10..10 + KEPT as i32 {
            host_i32(Kind::StatePadding, &[v], &[1, 1]).unwrap();
        }
        let made = host_i32(Kind::StatePadding, &[1], &[1, 1]).unwrap();
        assert_ne!(data(&first), data(&made), "dropped, made again");
        assert_eq!(made.as_slice::<i32>(), &[1]);
    }
}
