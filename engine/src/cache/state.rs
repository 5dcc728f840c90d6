//! The cache of a recurrent layer: a fixed-size state per sequence (a short convolution's
//! last inputs, a linear-attention or SSM recurrence), as mlx-lm's `ArraysCache`.
//!
//! A state has no positions: it cannot be cut to a shorter prefix or rolled back, only
//! replaced. Each of the layer's arrays ("slots") is `[B, ...]`, one row per sequence, so rows
//! join and leave the batch by concatenation and gather like the KV layouts do.
//!
//! Left padding: a prefill group pads its prompts on the left to one length. A recurrence must
//! not absorb the padding, so while a row has padding ahead, [`StateCache::mask`] marks its real
//! positions and the layer holds its state still over the others; the padding is consumed by
//! the first forward pass ([`StateCache::update`]). Decode rows never carry padding.
use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use super::row_arrays::{self, Kind};

#[derive(Debug)]
pub struct StateCache {
    /// The layer's arrays, each `[B, ...]`; `None` until the first forward pass writes them
    /// (the layer then starts from zeros, as mlx-lm does).
    slots: Vec<Option<Array>>,
    /// Per row, the padding positions still ahead of the next forward pass.
    padding: Vec<i32>,
    /// Per row, the tokens the state has absorbed.
    lengths: Vec<usize>,
}

impl StateCache {
    /// An empty state of `slots` arrays for rows that will be written with `padding` on the
    /// left (one entry per row).
    pub fn new(slots: usize, padding: Vec<i32>) -> Self {
        Self {
            slots: vec![None; slots],
            lengths: vec![0; padding.len()],
            padding,
        }
    }

    /// One row holding `slots` (each `[1, ...]`) after `length` tokens (a prefix-cache hit).
    pub fn from_row(slots: Vec<Array>, length: usize) -> Self {
        Self {
            slots: slots.into_iter().map(Some).collect(),
            padding: vec![0],
            lengths: vec![length],
        }
    }

    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Tokens row `r` has absorbed.
    pub fn row_len(&self, r: usize) -> usize {
        self.lengths[r]
    }

    /// Slot `i` as last written, `[B, ...]`; `None` before the first forward pass.
    pub fn slot(&self, i: usize) -> Option<&Array> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    /// The `[B, queries]` mask of the next forward pass (true: a real token), or `None` when no
    /// row has padding ahead.
    pub fn mask(&self, queries: i32) -> Result<Option<Array>, Exception> {
        if self.padding.iter().all(|&p| p <= 0) {
            return Ok(None);
        }
        // The same mask for every state layer of the pass ([`row_arrays`]).
        let mut key = vec![queries];
        key.extend_from_slice(&self.padding);
        row_arrays::shared(Kind::StateMask, &key, || {
            let rows = self.padding.len() as i32;
            let pos = Array::arange::<_, i32>(None, queries, None)?.reshape(&[1, queries])?;
            let pad = row_arrays::host_i32(Kind::StatePadding, &self.padding, &[rows, 1])?;
            pos.ge(&pad)
        })
        .map(Some)
    }

    /// Replaces every slot after a forward pass over `queries` positions: the padding ahead is
    /// consumed and each row absorbed the rest.
    pub fn update(&mut self, slots: Vec<Array>, queries: usize) -> Result<(), Exception> {
        if slots.len() != self.slots.len() {
            return Err(Exception::custom(format!(
                "a state of {} arrays updated with {}",
                self.slots.len(),
                slots.len()
            )));
        }
        self.slots = slots.into_iter().map(Some).collect();
        for (p, len) in self.padding.iter_mut().zip(&mut self.lengths) {
            let pad = (*p).clamp(0, queries as i32) as usize;
            *len += queries - pad;
            *p -= pad as i32;
        }
        Ok(())
    }

    /// Keeps rows `keep`, in that order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.len() == self.rows() && keep.iter().enumerate().all(|(i, &r)| i == r) {
            return Ok(());
        }
        let idx = Array::from_slice(
            &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
            &[keep.len() as i32],
        );
        for slot in self.slots.iter_mut().flatten() {
            *slot = slot.take_axis(&idx, 0)?;
        }
        self.padding = keep.iter().map(|&r| self.padding[r]).collect();
        self.lengths = keep.iter().map(|&r| self.lengths[r]).collect();
        Ok(())
    }

    /// Appends the rows of `other`; a side not written yet joins as zeros (a fresh state).
    pub fn extend(&mut self, other: StateCache) -> Result<(), Exception> {
        if other.rows() == 0 {
            return Ok(());
        }
        if self.rows() == 0 {
            *self = other;
            return Ok(());
        }
        if self.slots.len() != other.slots.len() {
            return Err(Exception::custom(format!(
                "cannot join states of {} and {} arrays",
                self.slots.len(),
                other.slots.len()
            )));
        }
        let (a_rows, b_rows) = (self.rows() as i32, other.rows() as i32);
        for (mine, theirs) in self.slots.iter_mut().zip(other.slots) {
            *mine = match (mine.take(), theirs) {
                (None, None) => None,
                (Some(a), None) => {
                    Some(concatenate(&[a.clone(), zeros_like_rows(&a, b_rows)?], 0)?)
                }
                (None, Some(b)) => Some(concatenate(&[zeros_like_rows(&b, a_rows)?, b], 0)?),
                (Some(a), Some(b)) => Some(concatenate(&[a, b], 0)?),
            };
        }
        self.padding.extend(other.padding);
        self.lengths.extend(other.lengths);
        Ok(())
    }

    /// A copy of row `r`'s arrays (`[1, ...]` each) that holds no reference to the batch's,
    /// or `None` before the first write.
    pub fn row_copy(&self, r: usize) -> Result<Option<Vec<Array>>, Exception> {
        let r = r as i32;
        let idx = Array::from_slice(&[r], &[1]);
        self.slots
            .iter()
            .map(|s| match s {
                Some(a) => Ok(Some(a.take_axis(&idx, 0)?)),
                None => Ok(None),
            })
            .collect::<Result<Option<Vec<_>>, Exception>>()
    }

    pub fn nbytes(&self) -> usize {
        self.slots.iter().flatten().map(Array::nbytes).sum()
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.slots.iter().flatten().collect()
    }
}

/// Zeros shaped like `a` but with `rows` rows.
fn zeros_like_rows(a: &Array, rows: i32) -> Result<Array, Exception> {
    let mut shape = a.shape().to_vec();
    shape[0] = rows;
    mlx_rs::ops::zeros_dtype(&shape, a.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(a: &Array) -> Vec<i32> {
        a.as_type::<i32>().unwrap().as_slice::<i32>().to_vec()
    }

    #[test]
    fn padding_is_masked_then_consumed_and_lengths_count_real_tokens() {
        let mut s = StateCache::new(1, vec![2, 0]);
        let mask = s.mask(3).unwrap().expect("padding ahead");
        assert_eq!(mask.shape(), &[2, 3]);
        assert_eq!(ints(&mask), vec![0, 0, 1, 1, 1, 1]);
        s.update(vec![Array::from_slice(&[1.0f32, 2.0], &[2, 1])], 3)
            .unwrap();
        assert_eq!((s.row_len(0), s.row_len(1)), (1, 3));
        assert!(s.mask(1).unwrap().is_none());
        s.update(vec![Array::from_slice(&[3.0f32, 4.0], &[2, 1])], 1)
            .unwrap();
        assert_eq!((s.row_len(0), s.row_len(1)), (2, 4));
    }

    #[test]
    fn rows_join_as_zeros_before_their_first_write_and_leave_by_gather() {
        let mut a = StateCache::new(1, vec![0]);
        a.update(vec![Array::from_slice(&[5.0f32, 6.0], &[1, 2])], 2)
            .unwrap();
        a.extend(StateCache::new(1, vec![0, 0])).unwrap();
        assert_eq!(a.rows(), 3);
        let slot = a.slot(0).unwrap();
        assert_eq!(slot.shape(), &[3, 2]);
        assert_eq!(ints(slot), vec![5, 6, 0, 0, 0, 0]);
        a.filter(&[0]).unwrap();
        assert_eq!(ints(a.slot(0).unwrap()), vec![5, 6]);
        assert_eq!(a.row_len(0), 2);
        let copy = a.row_copy(0).unwrap().expect("written");
        assert_eq!(ints(&copy[0]), vec![5, 6]);
        assert!(StateCache::new(2, vec![0]).row_copy(0).unwrap().is_none());
    }

    #[test]
    fn a_state_updated_with_the_wrong_number_of_arrays_is_an_error() {
        let mut s = StateCache::new(2, vec![0]);
        assert!(s.update(vec![Array::from_int(1)], 1).is_err());
    }
}
