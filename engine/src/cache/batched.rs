//! The batched layout: one layer's keys and values for many sequences in one buffer.
//!
//! As in mlx-lm's `BatchKVCache`, rows are aligned on the right: every row has been written up
//! to the same position `idx`, and row `r` holds valid positions `left_padding[r]..idx`. A
//! row's logical length (its rotary offset) is `idx - left_padding[r]`. Rows that join later
//! are padded on the left to line up; rows that leave are taken out, and padding that every
//! remaining row shares is cut off so it never grows without bound.
//!
//! A speculative rollback in which rows drop different numbers of positions leaves *holes*
//! instead of moving data: the positions a row rejected, below the common end, stay in the
//! buffer and the mask hides them from then on. A row's logical length (its rotary offset) is
//! its valid positions, padding and holes excluded. Moving every row that dropped more to the
//! right instead (a gather over the whole buffer) cost 15–75 ms a step for the 8B shape at
//! batch 8 on the H200, several decode steps' worth; the holes cost a mask array. A row whose
//! holes pass [`MAX_HOLES`] is compacted by that gather once.
//!
//! With no padding and no holes (one row, or rows of equal length) the layout computes exactly
//! what [`DenseKv`](super::DenseKv) does: an integer rotary offset and no mask array.
//!
//! A layer that attends within a sliding window (`window`) keeps its memory bounded: positions
//! its queries can no longer reach are cut from the front of the buffer, and each row counts
//! the valid positions it lost (`evicted`), so that its logical length (its rotary offset) is
//! `evicted` plus the valid positions held. The window mask works in logical positions, which
//! a cut does not change (it shifts every buffer position of a row alike). A row always keeps
//! its last `window +` [`WINDOW_SLACK`] valid positions: a speculative rollback may drop up to
//! `MAX_NUM_DRAFT + 1` of them (a draft model's cache writes that many before it rolls back)
//! and the queries that follow must still see a whole window. Cuts are amortised: a cut
//! happens before a write only once every row can lose at least `window + WINDOW_SLACK`
//! positions (so the buffer holds between one and two such spans), and copies what stays into
//! a buffer sized for the next span, so a step pays no slicing most of the time and the memory
//! of the cut positions is freed at once. A cut keeps holes below the kept span where a row
//! needs them rather than compacting first (no gather): a row with holes simply keeps a few
//! more buffer positions, bounded by [`MAX_HOLES`]. mlx-lm's `RotatingKVCache` rotates in
//! place instead; the positional layout keeps rows aligned, the prefix cache's row copies in
//! order, and rollback a matter of offsets.
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;

use super::row_arrays::{self, Kind};
use super::stored::{write_positions, KvQuant, Stored};
use super::Mask;
use crate::rotary::Rope;
use crate::runtime::draft::MAX_NUM_DRAFT;

#[derive(Debug, Default)]
pub struct BatchKv {
    /// `[B, kv_heads, capacity, head_dim]` (or its quantized form); `None` until written.
    keys: Option<Stored>,
    values: Option<Stored>,
    /// How new keys and values are stored.
    quant: Option<KvQuant>,
    /// Positions written in every row (the same for all).
    idx: i32,
    /// Padding positions at the start of each row; one entry per row.
    left_padding: Vec<i32>,
    /// Positions below `idx` that each row rejected in a speculative rollback, ascending; one
    /// entry per row.
    holes: Vec<Vec<i32>>,
    /// The sliding window of the layer (the most keys one query sees): positions beyond its
    /// reach are cut (see the module comment). `None` keeps every position.
    window: Option<usize>,
    /// Valid positions each row lost to window cuts, before its first held one; one entry
    /// per row.
    evicted: Vec<usize>,
}

/// Holes one row may collect before the cache compacts it (see the module comment).
pub const MAX_HOLES: usize = 64;

/// Valid positions a windowed row keeps beyond its window: what one speculative rollback may
/// drop (a draft model's cache writes its last token and up to `MAX_NUM_DRAFT` drafts before
/// rolling back).
pub const WINDOW_SLACK: usize = MAX_NUM_DRAFT + 1;

impl BatchKv {
    /// An empty cache for rows that will be written with the given left padding (a prefill
    /// group whose prompts were padded on the left to one length).
    pub fn with_padding(left_padding: Vec<i32>, quant: Option<KvQuant>) -> Self {
        Self {
            keys: None,
            values: None,
            quant,
            idx: 0,
            holes: vec![Vec::new(); left_padding.len()],
            evicted: vec![0; left_padding.len()],
            left_padding,
            window: None,
        }
    }

    /// One row that holds `keys`/`values` `[1, kv_heads, n, head_dim]` at logical positions
    /// `start..start + n` (a prefix-cache hit; `start` > 0 for a windowed layer that evicted).
    pub fn from_row(keys: Stored, values: Stored, start: usize, quant: Option<KvQuant>) -> Self {
        let n = keys.positions();
        Self {
            keys: Some(keys),
            values: Some(values),
            quant,
            idx: n,
            left_padding: vec![0],
            holes: vec![Vec::new()],
            window: None,
            evicted: vec![start],
        }
    }

    /// This cache for a layer that attends within `window` keys (`None`: every key), which
    /// it then keeps bounded (see the module comment).
    pub fn windowed(mut self, window: Option<usize>) -> Self {
        self.window = window;
        self
    }

    /// The sliding window this cache is bounded by.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    pub fn rows(&self) -> usize {
        self.left_padding.len()
    }

    /// How new keys and values are stored.
    pub fn quant(&self) -> Option<KvQuant> {
        self.quant
    }

    /// The longest row's valid positions.
    pub fn longest_row(&self) -> usize {
        (0..self.rows()).map(|r| self.row_len(r)).max().unwrap_or(0)
    }

    /// Stores everything held, and every later write, quantized with `quant`
    /// (`--quantized-kv-start`: a cache converts when its longest row passes the start).
    pub fn quantize(&mut self, quant: KvQuant) -> Result<(), Exception> {
        if self.quant.is_some() {
            return Ok(());
        }
        let idx = self.idx;
        for side in [&mut self.keys, &mut self.values] {
            *side = side
                .take()
                .map(|s| s.prefix(idx)?.quantized(quant))
                .transpose()?;
        }
        self.quant = Some(quant);
        Ok(())
    }

    /// Row `r`'s logical length: the valid positions it held, evicted ones included (its
    /// rotary offset, and how many of its tokens the cache stands for).
    pub fn row_len(&self, r: usize) -> usize {
        self.evicted[r] + self.held(r)
    }

    /// Valid positions row `r` holds in the buffer.
    fn held(&self, r: usize) -> usize {
        (self.idx - self.left_padding[r]) as usize - self.holes[r].len()
    }

    /// The logical position of row `r`'s first held position (what [`Self::row_copy`]
    /// starts at): 0 unless a window cut evicted positions.
    pub fn row_start(&self, r: usize) -> usize {
        self.evicted[r]
    }

    /// Whether every row's last `window` positions are all valid (no padding, no holes):
    /// then a one-query pass may attend to exactly those, with no mask, as mlx-lm's rotating
    /// cache does once full.
    pub fn whole_window(&self, window: usize) -> bool {
        let start = self.idx - window as i32;
        start >= 0
            && self.left_padding.iter().all(|&p| p <= start)
            && self
                .holes
                .iter()
                .all(|h| h.last().is_none_or(|&last| last < start))
    }

    fn unpadded(&self) -> bool {
        self.left_padding.iter().all(|&p| p == 0) && self.holes.iter().all(Vec::is_empty)
    }

    /// Rotary embedding at each row's own offset; an integer offset when all rows agree.
    pub fn rope(&self, rope: &Rope, x: &Array) -> Result<Array, Exception> {
        let first = if self.rows() == 0 { 0 } else { self.row_len(0) };
        if (1..self.rows()).all(|r| self.row_len(r) == first) {
            return rope.forward(x, first as i32);
        }
        rope.forward_per_row(x, &self.offsets()?)
    }

    /// Each row's rotary offset `[B]` (its logical length), the same array for every layer
    /// of a pass ([`row_arrays`]): the write position less each row's shift, which is made on
    /// the host only when rows join, leave or roll back.
    fn offsets(&self) -> Result<Array, Exception> {
        // Row r's logical length is `idx - shift[r]`.
        let shift: Vec<i32> = (0..self.rows())
            .map(|r| self.idx - self.row_len(r) as i32)
            .collect();
        let mut key = shift.clone();
        key.push(self.idx);
        row_arrays::shared(Kind::Offsets, &key, || {
            let shift = row_arrays::host_i32(Kind::Shift, &shift, &[shift.len() as i32])?;
            Array::from_int(self.idx).subtract(&shift)
        })
    }

    /// Appends `[B, kv_heads, L, head_dim]` at position `idx` of every row; returns the keys and
    /// values of positions `0..idx` (padding included: the mask hides it).
    pub fn update_and_fetch(
        &mut self,
        keys: &Array,
        values: &Array,
    ) -> Result<(Stored, Stored), Exception> {
        // Before the write, so that the new queries still see the window before them.
        self.evict_outside_window()?;
        let prev = self.idx;
        let k = write_positions(&mut self.keys, prev, &Stored::new(keys, self.quant)?)?;
        let v = write_positions(&mut self.values, prev, &Stored::new(values, self.quant)?)?;
        self.idx += keys.shape()[2];
        Ok((k, v))
    }

    /// The mask for `queries` new positions (the last `queries` of `0..idx`): padding hidden,
    /// causal among the new positions, and with a `window` each query sees at most that many
    /// keys, itself included (a sliding-window layer). No array when nothing needs hiding.
    pub fn mask(&self, queries: i32, window: Option<usize>) -> Result<Mask, Exception> {
        if let Some(kept) = self.window {
            if window.is_none_or(|w| w > kept) {
                return Err(Exception::custom(format!(
                    "a layer attending over {} reads a cache bounded by a window of {kept}: the \
                     model's layer windows disagree with its attention",
                    window.map_or("every key".to_owned(), |w| format!("{w} keys"))
                )));
            }
        }
        let t = self.idx;
        let window = window.map(|w| w as i32).filter(|&w| w < t);
        let has_holes = self.holes.iter().any(|h| !h.is_empty());
        if self.unpadded() && window.is_none() {
            return Ok(if queries > 1 {
                Mask::Causal
            } else {
                Mask::None
            });
        }
        if let (Some(w), true) = (window, has_holes) {
            return Ok(Mask::Array(self.windowed_over_holes(queries, w)));
        }
        if !has_holes {
            // The same mask for every layer of the pass ([`row_arrays`]).
            let mut key = vec![t, queries, window.unwrap_or(-1)];
            key.extend_from_slice(&self.left_padding);
            return row_arrays::shared(Kind::Mask, &key, || {
                self.padding_mask(queries, window, false)
            })
            .map(Mask::Array);
        }
        self.padding_mask(queries, window, true).map(Mask::Array)
    }

    /// [`Self::mask`]'s array where padding, holes (`has_holes`: some row has any) or a window
    /// need one.
    fn padding_mask(
        &self,
        queries: i32,
        window: Option<i32>,
        has_holes: bool,
    ) -> Result<Array, Exception> {
        let t = self.idx;
        let b = self.rows() as i32;
        let keys = Array::arange::<_, i32>(None, t, None)?.reshape(&[1, 1, 1, t])?;
        let mut mask = if !has_holes {
            let padding = row_arrays::host_i32(Kind::Padding, &self.left_padding, &[b, 1, 1, 1])?;
            keys.ge(&padding)?
        } else {
            Array::from_slice(&self.visible(), &[b, 1, 1, t])
        };
        let first = t - queries;
        let query_pos = Array::arange::<_, i32>(first, t, None)?.reshape(&[1, 1, queries, 1])?;
        if queries > 1 {
            // A padding query (in a prefill group) sees itself, so that no row of the mask is
            // empty: an all-masked softmax would give NaN, and NaN times a zero weight is NaN.
            mask = mask
                .logical_or(&keys.eq(&query_pos)?)?
                .logical_and(&keys.le(&query_pos)?)?;
        }
        if let Some(w) = window {
            // Without holes a row's buffer positions and logical positions differ by its
            // padding alone, so the distance between a query and a key is the same in both.
            mask = mask.logical_and(&query_pos.subtract(&keys)?.lt(Array::from_int(w))?)?;
        }
        Ok(mask)
    }

    /// The windowed mask of a cache with holes, built on the host: the window counts a row's
    /// valid positions only (its logical positions), which holes make differ from buffer
    /// positions row by row.
    fn windowed_over_holes(&self, queries: i32, window: i32) -> Array {
        let t = self.idx as usize;
        let l = queries as usize;
        let visible = self.visible();
        let mut mask = vec![false; self.rows() * l * t];
        for (r, row_visible) in visible.chunks(t).enumerate() {
            // Logical position of each buffer position (meaningful where visible).
            let mut logical = Vec::with_capacity(t);
            let mut n = 0i32;
            for &v in row_visible {
                logical.push(n);
                n += i32::from(v);
            }
            for i in 0..l {
                let q = t - l + i;
                let row = &mut mask[(r * l + i) * t..(r * l + i + 1) * t];
                for (p, cell) in row.iter_mut().enumerate().take(q + 1) {
                    *cell = (row_visible[p] && logical[q] - logical[p] < window) || p == q;
                }
            }
        }
        Array::from_slice(&mask, &[self.rows() as i32, 1, queries, t as i32])
    }

    /// Row by row, whether each position `0..idx` is attended to: not padding, not a hole.
    fn visible(&self) -> Vec<bool> {
        let t = self.idx as usize;
        let mut v = vec![false; self.rows() * t];
        for (r, row) in v.chunks_mut(t).enumerate() {
            row[self.left_padding[r] as usize..].fill(true);
            for &h in &self.holes[r] {
                row[h as usize] = false;
            }
        }
        v
    }

    /// Keeps rows `keep` (in that order) and cuts the padding they all share.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.len() != self.rows() || keep.iter().enumerate().any(|(i, &r)| i != r) {
            let idx = Array::from_slice(
                &keep.iter().map(|&r| r as i32).collect::<Vec<_>>(),
                &[keep.len() as i32],
            );
            for side in [&mut self.keys, &mut self.values] {
                *side = side
                    .take()
                    .map(|s| s.map(|a| a.take_axis(&idx, 0)))
                    .transpose()?;
            }
            self.left_padding = keep.iter().map(|&r| self.left_padding[r]).collect();
            self.holes = keep.iter().map(|&r| self.holes[r].clone()).collect();
            self.evicted = keep.iter().map(|&r| self.evicted[r]).collect();
        }
        self.cut_shared_padding()
    }

    /// Cuts the padding positions that every row has at its start.
    fn cut_shared_padding(&mut self) -> Result<(), Exception> {
        let shared = self.left_padding.iter().copied().min().unwrap_or(0);
        if shared > 0 {
            for side in [&mut self.keys, &mut self.values] {
                *side = side
                    .take()
                    .map(|s| s.map(|a| Ok(a.index((Ellipsis, shared.., ..)))))
                    .transpose()?;
            }
            self.idx -= shared;
            for p in &mut self.left_padding {
                *p -= shared;
            }
            for h in self.holes.iter_mut().flatten() {
                *h -= shared;
            }
        }
        Ok(())
    }

    /// Appends the rows of `other` after this cache's rows, padding whichever side is shorter
    /// on the left so that both end at the same position.
    pub fn extend(&mut self, other: BatchKv) -> Result<(), Exception> {
        let this = std::mem::take(self);
        *self = Self::join(vec![this, other])?;
        Ok(())
    }

    /// The rows of `parts` in one cache, in order, each padded on the left to end where the
    /// longest ends; plain parts joining a quantized one are quantized (one buffer, one
    /// layout). Every buffer is copied once (one concatenation per component), so that
    /// joining many caches costs their bytes once: joining them two at a time copied the
    /// growing result once per part.
    ///
    /// A part with no rows adds none, but its quantization still applies to the rest (an
    /// emptied quantized batch stays quantized).
    pub fn join(parts: Vec<BatchKv>) -> Result<BatchKv, Exception> {
        let quant = parts.iter().find_map(|p| p.quant);
        let (mut parts, empty): (Vec<BatchKv>, Vec<BatchKv>) =
            parts.into_iter().partition(|p| p.rows() > 0);
        if parts.is_empty() {
            return Ok(empty.into_iter().next().unwrap_or_default());
        }
        if let Some(q) = quant {
            for part in &mut parts {
                part.quantize(q)?;
            }
        }
        if parts.len() <= 1 {
            return Ok(parts.pop().unwrap_or_default());
        }
        let window = parts[0].window;
        if let Some(other) = parts.iter().find(|p| p.window != window) {
            return Err(Exception::custom(format!(
                "cannot join KV caches bounded by different windows ({:?} and {:?})",
                window, other.window
            )));
        }
        let template = parts.iter().find_map(|p| match (&p.keys, &p.values) {
            (Some(k), Some(v)) => Some((k.clone(), v.clone())),
            _ => None,
        });
        let mut joined = BatchKv {
            keys: None,
            values: None,
            quant,
            idx: 0,
            left_padding: Vec::new(),
            holes: Vec::new(),
            window,
            evicted: Vec::new(),
        };
        let Some(template) = template else {
            // Nothing written in any part yet (one-token prompts): positions agree at 0.
            for part in parts {
                joined.left_padding.extend(part.left_padding);
                joined.holes.extend(part.holes);
                joined.evicted.extend(part.evicted);
            }
            return Ok(joined);
        };
        let end = parts.iter().map(|p| p.idx).max().unwrap_or(0);
        let (mut keys, mut values) = (Vec::with_capacity(parts.len()), Vec::new());
        for part in parts {
            let (k, v, padding, holes) = part.aligned(end, &template)?;
            keys.push(k);
            values.push(v);
            joined.left_padding.extend(padding);
            joined.holes.extend(holes);
            joined.evicted.extend(part.evicted);
        }
        joined.keys = Some(Stored::concat(&keys, 0)?);
        joined.values = Some(Stored::concat(&values, 0)?);
        joined.idx = end;
        Ok(joined)
    }

    /// Whether this is one row whose positions can be cut back to any length and written
    /// again ([`Self::rewind`]): nothing evicted by a window, no padding, no holes.
    pub fn rewindable(&self) -> bool {
        self.rows() == 1
            && self.window.is_none()
            && self.evicted[0] == 0
            && self.left_padding[0] == 0
            && self.holes[0].is_empty()
    }

    /// Cuts a [`Self::rewindable`] row back to its first `len` positions, so that a pass
    /// writes the positions after them again (a prefix hit prefilled beside other prompts
    /// re-feeds a few cached tokens to share their pass's length).
    pub fn rewind(&mut self, len: usize) -> Result<(), Exception> {
        if !self.rewindable() || len > self.held(0) {
            return Err(Exception::custom(format!(
                "cannot rewind a cache of {} rows holding {} positions to {len}",
                self.rows(),
                self.longest_row()
            )));
        }
        self.trim(self.held(0) - len);
        Ok(())
    }

    /// This cache's keys, values, padding and holes cut to `idx` and padded on the left to
    /// `end`. A cache with nothing written yet becomes all padding, shaped like `template`.
    #[allow(clippy::type_complexity)]
    fn aligned(
        &self,
        end: i32,
        template: &(Stored, Stored),
    ) -> Result<(Stored, Stored, Vec<i32>, Vec<Vec<i32>>), Exception> {
        let pad = end - self.idx;
        let rows = self.rows() as i32;
        let padding = self.left_padding.iter().map(|p| p + pad).collect();
        let holes = self
            .holes
            .iter()
            .map(|row| row.iter().map(|h| h + pad).collect())
            .collect();
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok((
                template.0.zeros(rows, end)?,
                template.1.zeros(rows, end)?,
                padding,
                holes,
            ));
        };
        let mut k = k.prefix(self.idx)?;
        let mut v = v.prefix(self.idx)?;
        if pad > 0 {
            k = Stored::concat(&[k.zeros(rows, pad)?, k], 2)?;
            v = Stored::concat(&[v.zeros(rows, pad)?, v], 2)?;
        }
        Ok((k, v, padding, holes))
    }

    /// Row `r`'s valid positions, ascending.
    fn valid_positions(&self, r: usize) -> Vec<i32> {
        let holes = &self.holes[r];
        (self.left_padding[r]..self.idx)
            .filter(|p| holes.binary_search(p).is_err())
            .collect()
    }

    /// A copy of row `r`'s valid keys and values, `[1, kv_heads, held, head_dim]`, that holds
    /// no reference to the batch buffer (so the buffer can still be updated in place). They
    /// stand for logical positions [`Self::row_start`]`..`[`Self::row_len`]: a windowed
    /// layer's copy holds what its window may still read, and a little more.
    pub fn row_copy(&self, r: usize) -> Result<Option<(Stored, Stored)>, Exception> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Ok(None);
        };
        if !self.holes[r].is_empty() {
            let valid = self.valid_positions(r);
            let idx = Array::from_slice(&valid, &[valid.len() as i32]);
            let r = r as i32;
            let copy = |a: &Array| a.index((r..r + 1, .., .., ..)).take_axis(&idx, 2);
            return Ok(Some((k.map(copy)?, v.map(copy)?)));
        }
        let (r, start, end) = (r as i32, self.left_padding[r], self.idx);
        let copy = |a: &Array| a.index((r..r + 1, .., start..end, ..)).contiguous();
        Ok(Some((k.map(copy)?, v.map(copy)?)))
    }

    /// Cuts the positions no query can reach any more from the front of a windowed cache,
    /// once every row can lose at least `window + WINDOW_SLACK` of them, and copies what
    /// stays into a buffer with room for that many more (see the module comment). Runs before
    /// every write, and after each prefill chunk so that a prompt's cache is bounded while it
    /// waits to join the batch.
    pub fn evict_outside_window(&mut self) -> Result<(), Exception> {
        let Some(window) = self.window else {
            return Ok(());
        };
        let keep = (window + WINDOW_SLACK) as i32;
        if self.idx < 2 * keep || self.keys.is_none() {
            return Ok(());
        }
        let cut = (0..self.rows())
            .map(|r| self.first_kept(r, keep))
            .min()
            .unwrap_or(0);
        if cut < keep {
            return Ok(());
        }
        self.cut_front(cut, keep)
    }

    /// The buffer position from which row `r` holds its last `keep` valid positions, or its
    /// first position past its padding when it holds fewer.
    fn first_kept(&self, r: usize, keep: i32) -> i32 {
        let mut from = self.idx - keep;
        // Each hole inside the span pushes its start one position further back.
        for &hole in self.holes[r].iter().rev() {
            if hole < from {
                break;
            }
            from -= 1;
        }
        from.max(self.left_padding[r])
    }

    /// Cuts buffer positions `..cut` of every row, counting the valid ones among them as
    /// evicted, and copies the rest into a new buffer with room for `spare` more positions
    /// (a copy, not a view, so the cut positions' memory is freed).
    fn cut_front(&mut self, cut: i32, spare: i32) -> Result<(), Exception> {
        for r in 0..self.rows() {
            let holes_cut = self.holes[r].partition_point(|&h| h < cut);
            let past_padding = (cut - self.left_padding[r]).max(0) as usize;
            self.evicted[r] += past_padding - holes_cut;
            self.left_padding[r] = (self.left_padding[r] - cut).max(0);
            self.holes[r].drain(..holes_cut);
            for h in &mut self.holes[r] {
                *h -= cut;
            }
        }
        let (end, rows) = (self.idx, self.rows() as i32);
        for side in [&mut self.keys, &mut self.values] {
            *side = side
                .take()
                .map(|s| {
                    let kept = s.map(|a| Ok(a.index((Ellipsis, cut..end, ..))))?;
                    let room = kept.zeros(rows, spare)?;
                    Stored::concat(&[kept, room], 2)
                })
                .transpose()?;
        }
        self.idx = end - cut;
        Ok(())
    }

    /// Drops the last `n` positions of every row.
    pub fn trim(&mut self, n: usize) {
        let max = self.idx - self.left_padding.iter().copied().max().unwrap_or(0);
        self.idx -= (n as i32).min(max);
        let idx = self.idx;
        for row in &mut self.holes {
            row.retain(|&h| h < idx);
        }
    }

    /// Drops the last `drop[r]` positions of each row `r` (speculative rollback: each row
    /// rejected its own number of drafts). Rows must still end at one position: every row is
    /// cut to the end of the row that drops the least, and the positions another row rejected
    /// below that end become its holes (see the module comment). With equal counts it is a
    /// plain trim.
    pub fn rollback(&mut self, drop: &[usize]) -> Result<(), Exception> {
        if drop.len() != self.rows() {
            return Err(Exception::custom(format!(
                "rollback of {} rows in a cache of {}",
                drop.len(),
                self.rows()
            )));
        }
        for (r, &d) in drop.iter().enumerate() {
            if d > self.held(r) {
                return Err(Exception::custom(format!(
                    "rollback of {d} positions in a row that holds {}",
                    self.held(r)
                )));
            }
        }
        let least = drop.iter().copied().min().unwrap_or(0);
        if drop.iter().all(|&d| d == least) {
            self.trim(least);
            return Ok(());
        }
        let end = self.idx - least as i32;
        for (r, &d) in drop.iter().enumerate() {
            self.holes[r].extend(self.idx - d as i32..end);
        }
        self.idx = end;
        if self.holes.iter().any(|h| h.len() > MAX_HOLES) {
            self.compact()?;
        }
        Ok(())
    }

    /// Moves every row's valid positions to the end of the buffer, in order, so that no row
    /// has holes (one gather over the positions axis); what moves out becomes padding.
    fn compact(&mut self) -> Result<(), Exception> {
        let t = self.idx;
        let b = self.rows();
        let mut source = Vec::with_capacity(b * t as usize);
        let mut padding = Vec::with_capacity(b);
        for r in 0..b {
            let valid = self.valid_positions(r);
            let pad = t - valid.len() as i32;
            // Padding positions read position 0: the mask hides them.
            source.extend(std::iter::repeat_n(0, pad as usize));
            source.extend(valid);
            padding.push(pad);
        }
        let source = Array::from_slice(&source, &[b as i32, 1, t, 1]);
        for side in [&mut self.keys, &mut self.values] {
            *side = side
                .take()
                .map(|s| s.prefix(t)?.map(|a| a.take_along_axis(&source, 2)))
                .transpose()?;
        }
        self.left_padding = padding;
        self.holes = vec![Vec::new(); b];
        self.cut_shared_padding()
    }

    /// Bytes held by the buffers (padding and spare capacity included).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, Stored::nbytes)
            + self.values.as_ref().map_or(0, Stored::nbytes)
    }

    pub fn state(&self) -> Vec<&Array> {
        self.keys
            .iter()
            .chain(self.values.iter())
            .flat_map(Stored::arrays)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[rows, 1, len, 32]` keys whose every element encodes (row, position, dimension).
    fn positions(rows: i32, from: i32, len: i32) -> Array {
        let v: Vec<f32> = (0..rows)
            .flat_map(|r| {
                (from..from + len)
                    .flat_map(move |p| (0..32).map(move |d| (r * 100 + p) as f32 + d as f32 / 64.0))
            })
            .collect();
        Array::from_slice(&v, &[rows, 1, len, 32])
    }

    fn row_values(s: &Stored) -> Vec<Vec<f32>> {
        s.arrays()
            .iter()
            .map(|a| {
                a.as_dtype(mlx_rs::Dtype::Float32)
                    .unwrap()
                    .as_slice::<f32>()
                    .to_vec()
            })
            .collect()
    }

    /// Rolls a three-row cache back by a different count per row and checks each row holds
    /// exactly what a cache that never saw the dropped positions holds, in both stored forms.
    fn rollback_keeps_each_rows_prefix(quant: Option<KvQuant>) {
        let mut cache = BatchKv::with_padding(vec![0, 0, 0], quant);
        let k = positions(3, 0, 6);
        cache.update_and_fetch(&k, &k).unwrap();
        cache.rollback(&[0, 3, 1]).unwrap();
        assert_eq!(
            (cache.row_len(0), cache.row_len(1), cache.row_len(2)),
            (6, 3, 5)
        );
        for (r, keep) in [(0usize, 6), (1, 3), (2, 5)] {
            let mut fresh = BatchKv::with_padding(vec![0], quant);
            let k = positions(3, 0, keep).index((r as i32..r as i32 + 1, .., .., ..));
            fresh.update_and_fetch(&k, &k).unwrap();
            let (got, _) = cache.row_copy(r).unwrap().unwrap();
            let (want, _) = fresh.row_copy(0).unwrap().unwrap();
            assert_eq!(row_values(&got), row_values(&want), "row {r}");
        }
        // Writing after the rollback appends at each row's own end.
        let next = positions(3, 10, 1);
        cache.update_and_fetch(&next, &next).unwrap();
        let (row1, _) = cache.row_copy(1).unwrap().unwrap();
        assert_eq!(row1.positions(), 4);
        // Equal counts are a plain trim; more than a row holds is refused.
        cache.rollback(&[1, 1, 1]).unwrap();
        assert_eq!(cache.row_len(1), 3);
        assert!(cache.rollback(&[0, 9, 0]).is_err());
        assert!(cache.rollback(&[0, 0]).is_err());
    }

    #[test]
    fn rollback_of_the_dense_layout_trims_its_one_row() {
        let mut cache = super::super::LayerCache::Dense(super::super::DenseKv::new());
        let k = positions(1, 0, 6);
        cache.update_and_fetch(&k, &k).unwrap();
        cache.rollback(&[2]).unwrap();
        let (held, _) = cache
            .update_and_fetch(&positions(1, 4, 1), &positions(1, 4, 1))
            .unwrap();
        assert_eq!(held.positions(), 5);
        assert_eq!(
            row_values(&held),
            row_values(&Stored::Plain(positions(1, 0, 5)))
        );
        assert!(cache.rollback(&[1, 1]).is_err());
        assert!(cache.rollback(&[9]).is_err());
    }

    #[test]
    fn a_plain_cache_quantizes_in_place_and_joins_a_quantized_one() {
        let q = KvQuant {
            bits: 8,
            group_size: 32,
        };
        let mut plain = BatchKv::with_padding(vec![0, 0], None);
        let k = positions(2, 0, 5);
        plain.update_and_fetch(&k, &k).unwrap();
        let mut quantized = BatchKv::with_padding(vec![0], Some(q));
        let k1 = positions(1, 0, 3);
        quantized.update_and_fetch(&k1, &k1).unwrap();
        // A quantized row joining a plain batch converts the batch.
        plain.extend(quantized).unwrap();
        assert_eq!(plain.quant(), Some(q));
        assert_eq!(plain.longest_row(), 5);
        let (row0, _) = plain.row_copy(0).unwrap().unwrap();
        let expected = Stored::new(&positions(2, 0, 5).index((0..1, .., .., ..)), Some(q)).unwrap();
        assert_eq!(row_values(&row0), row_values(&expected));
        // Later writes are quantized too, and a plain cache joining it is converted.
        let next = positions(3, 5, 1);
        let (all, _) = plain.update_and_fetch(&next, &next).unwrap();
        assert!(all.is_quantized());
        let mut late = BatchKv::with_padding(vec![0], None);
        late.update_and_fetch(&k1, &k1).unwrap();
        plain.extend(late).unwrap();
        assert_eq!(plain.rows(), 4);
    }

    /// One row holding positions `0..len` of [`positions`]'s row `row`.
    fn one_row(row: i32, len: i32, quant: Option<KvQuant>) -> BatchKv {
        let mut cache = BatchKv::with_padding(vec![0], quant);
        let k = positions(row + 1, 0, len).index((row..row + 1, .., .., ..));
        cache.update_and_fetch(&k, &k).unwrap();
        cache
    }

    #[test]
    fn joining_many_at_once_equals_joining_two_at_a_time() {
        let q = KvQuant {
            bits: 8,
            group_size: 32,
        };
        let parts = || {
            let mut two = BatchKv::with_padding(vec![0, 0], None);
            let k = positions(2, 0, 4);
            two.update_and_fetch(&k, &k).unwrap();
            two.rollback(&[0, 1]).unwrap();
            vec![
                one_row(0, 7, None),
                BatchKv::with_padding(Vec::new(), None),
                two,
                one_row(3, 2, Some(q)),
                one_row(4, 9, None),
            ]
        };
        let mut pairwise = BatchKv::default();
        for part in parts() {
            let mut acc = std::mem::take(&mut pairwise);
            let (quant, rows) = (part.quant(), part.rows());
            if acc.rows() == 0 && rows > 0 {
                acc = part;
            } else if rows > 0 {
                // The old two-at-a-time rule: pad the shorter side, concatenate the rows.
                let end = acc.idx.max(part.idx);
                let (mut a, mut b) = (acc, part);
                if let Some(q) = a.quant.or(quant) {
                    a.quantize(q).unwrap();
                    b.quantize(q).unwrap();
                }
                // Every part here holds keys: the template (for parts with none) is unused.
                let template = (a.keys.clone().unwrap(), a.values.clone().unwrap());
                let (k1, v1, p1, h1) = a.aligned(end, &template).unwrap();
                let (k2, v2, p2, h2) = b.aligned(end, &template).unwrap();
                a.keys = Some(Stored::concat(&[k1, k2], 0).unwrap());
                a.values = Some(Stored::concat(&[v1, v2], 0).unwrap());
                a.left_padding = p1.into_iter().chain(p2).collect();
                a.holes = h1.into_iter().chain(h2).collect();
                a.evicted.extend(b.evicted);
                a.idx = end;
                acc = a;
            }
            pairwise = acc;
        }
        let joined = BatchKv::join(parts()).unwrap();
        assert_eq!(joined.rows(), 5);
        assert_eq!(
            joined.quant(),
            Some(q),
            "one quantized part quantizes the rest"
        );
        assert_eq!(joined.left_padding, pairwise.left_padding);
        assert_eq!(joined.holes, pairwise.holes);
        assert_eq!(joined.idx, 9);
        assert_eq!(
            (0..5).map(|r| joined.row_len(r)).collect::<Vec<_>>(),
            vec![7, 4, 3, 2, 9]
        );
        for r in 0..5 {
            let (got, _) = joined.row_copy(r).unwrap().unwrap();
            let (want, _) = pairwise.row_copy(r).unwrap().unwrap();
            assert_eq!(row_values(&got), row_values(&want), "row {r}");
        }
        // Caches bounded by different windows do not join.
        let windowed = one_row(0, 3, None).windowed(Some(4));
        assert!(BatchKv::join(vec![one_row(0, 3, None), windowed]).is_err());
    }

    #[test]
    fn a_rewound_row_is_written_again_from_where_it_was_cut() {
        let mut cache = one_row(0, 8, None);
        assert!(cache.rewindable());
        cache.rewind(5).unwrap();
        assert_eq!(cache.row_len(0), 5);
        // Positions 5.. written again (other values) replace what was there.
        let again = positions(1, 50, 2);
        let (held, _) = cache.update_and_fetch(&again, &again).unwrap();
        let want = Stored::Plain(
            mlx_rs::ops::concatenate(&[positions(1, 0, 5), positions(1, 50, 2)], 2).unwrap(),
        );
        assert_eq!(row_values(&held), row_values(&want));
        assert!(cache.rewind(9).is_err(), "past what the row holds");
        // Two rows, a windowed row or a padded one cannot be cut back.
        let two = BatchKv::join(vec![one_row(0, 3, None), one_row(1, 4, None)]).unwrap();
        assert!(!two.rewindable());
        assert!(!one_row(0, 3, None).windowed(Some(8)).rewindable());
        let mut padded = BatchKv::with_padding(vec![2], None);
        let k = positions(1, 0, 4);
        padded.update_and_fetch(&k, &k).unwrap();
        assert!(!padded.rewindable());
    }

    fn mask_rows(mask: &Mask) -> Vec<Vec<bool>> {
        let Mask::Array(m) = mask else {
            panic!("expected a mask array");
        };
        let t = *m.shape().last().unwrap() as usize;
        m.as_slice::<bool>()
            .chunks(t)
            .map(<[bool]>::to_vec)
            .collect()
    }

    #[test]
    fn rejected_positions_become_holes_that_the_mask_hides_and_the_rotary_offset_skips() {
        let mut cache = BatchKv::with_padding(vec![0, 0], None);
        let k = positions(2, 0, 6);
        cache.update_and_fetch(&k, &k).unwrap();
        cache.rollback(&[0, 2]).unwrap();
        assert_eq!(cache.idx, 6, "nothing moved");
        assert_eq!(cache.holes, vec![vec![], vec![4, 5]]);
        let next = positions(2, 6, 1);
        cache.update_and_fetch(&next, &next).unwrap();
        let t = [true; 7];
        let mut row1 = t;
        row1[4] = false;
        row1[5] = false;
        assert_eq!(
            mask_rows(&cache.mask(1, None).unwrap()),
            vec![t.to_vec(), row1.to_vec()]
        );
        // Row 1's next token is its fifth: logical length 5, not the buffer's 7.
        assert_eq!((cache.row_len(0), cache.row_len(1)), (7, 5));
        // Its copy for the prefix cache holds its valid positions only, in order.
        let (got, _) = cache.row_copy(1).unwrap().unwrap();
        let want = concatenate(&[
            positions(2, 0, 4).index((1..2, .., .., ..)),
            positions(2, 6, 1).index((1..2, .., .., ..)),
        ]);
        assert_eq!(row_values(&got), row_values(&Stored::Plain(want)));
    }

    /// Two layers' caches of the same rows (one row shorter: padded) give one mask array and
    /// one offsets array per step, with the values each layer's own would have; the next
    /// step's are new arrays.
    #[test]
    fn the_layers_of_a_padded_batch_share_the_steps_mask_and_offsets() {
        let layer = || {
            let mut c = one_row(0, 5, None);
            c.extend(one_row(1, 4, None)).unwrap();
            c
        };
        let (mut first, mut second) = (layer(), layer());
        let step = |c: &mut BatchKv, p: i32| {
            let next = positions(2, p, 1);
            c.update_and_fetch(&next, &next).unwrap();
            let Mask::Array(m) = c.mask(1, None).unwrap() else {
                panic!("a padded batch needs a mask");
            };
            let o = c.offsets().unwrap();
            mlx_rs::transforms::eval([&m, &o]).unwrap();
            (m, o)
        };
        let data = |a: &Array| match a.dtype() {
            mlx_rs::Dtype::Bool => a.as_slice::<bool>().as_ptr() as usize,
            _ => a.as_slice::<i32>().as_ptr() as usize,
        };
        let (m1, o1) = step(&mut first, 5);
        let (m2, o2) = step(&mut second, 5);
        assert_eq!(
            (data(&m1), data(&o1)),
            (data(&m2), data(&o2)),
            "one array each"
        );
        assert_eq!(o1.as_slice::<i32>(), &[6, 5]);
        assert_eq!(
            m1.as_slice::<bool>(),
            &[true, true, true, true, true, true, false, true, true, true, true, true]
        );
        let (m3, o3) = step(&mut first, 6);
        assert_ne!(data(&m1), data(&m3), "the next step's mask is its own");
        assert_eq!(o3.as_slice::<i32>(), &[7, 6]);
    }

    fn concatenate(parts: &[Array]) -> Array {
        mlx_rs::ops::concatenate(parts, 2).unwrap()
    }

    #[test]
    fn a_row_with_too_many_holes_is_compacted_and_keeps_its_values() {
        let mut cache = BatchKv::with_padding(vec![0, 0], None);
        let k = positions(2, 0, 2);
        cache.update_and_fetch(&k, &k).unwrap();
        // Each round writes two positions; row 0 keeps both, row 1 rejects the second.
        let mut kept1 = vec![positions(2, 0, 2).index((1..2, .., .., ..))];
        for round in 0..MAX_HOLES as i32 + 1 {
            let from = 2 + 2 * round;
            let step = positions(2, from, 2);
            cache.update_and_fetch(&step, &step).unwrap();
            cache.rollback(&[0, 1]).unwrap();
            kept1.push(positions(2, from, 1).index((1..2, .., .., ..)));
        }
        assert!(cache.holes.iter().all(Vec::is_empty), "compacted");
        assert_eq!(cache.row_len(1), 2 + MAX_HOLES + 1);
        assert_eq!(cache.row_len(0), 2 + 2 * (MAX_HOLES + 1));
        let (got, _) = cache.row_copy(1).unwrap().unwrap();
        let want = Stored::Plain(concatenate(&kept1));
        assert_eq!(row_values(&got), row_values(&want));
        let (row0, _) = cache.row_copy(0).unwrap().unwrap();
        let all0 = positions(2, 0, 2 + 2 * (MAX_HOLES as i32 + 1)).index((0..1, .., .., ..));
        assert_eq!(row_values(&row0), row_values(&Stored::Plain(all0)));
    }

    /// A windowed cache driven with known contents: each row's history is the value of the
    /// key at each of its logical positions (`id * 10_000 + position`, exact in f32), and
    /// every write checks what each new query sees against the history alone.
    struct Driven {
        cache: BatchKv,
        window: usize,
        ids: Vec<usize>,
        history: Vec<Vec<f32>>,
    }

    fn code(id: usize, position: usize) -> f32 {
        (id * 10_000 + position) as f32
    }

    impl Driven {
        /// A prefill group: row `r` is padded by `padding[r]` to `len` positions.
        fn prefill(ids: Vec<usize>, padding: Vec<i32>, len: usize, window: usize) -> Self {
            let mut d = Self {
                cache: BatchKv::with_padding(padding.clone(), None).windowed(Some(window)),
                window,
                history: vec![Vec::new(); ids.len()],
                ids,
            };
            let queries: Vec<usize> = padding.iter().map(|&p| len - p as usize).collect();
            d.write(len, &queries);
            d
        }

        /// Writes `l` new positions in every row.
        fn step(&mut self, l: usize) {
            self.write(l, &vec![l; self.ids.len()]);
        }

        /// Writes `l` positions per row, the last `valid[r]` of them valid (padding before).
        fn write(&mut self, l: usize, valid: &[usize]) {
            let rows = self.ids.len();
            let mut data = Vec::with_capacity(rows * l * 32);
            let mut before = Vec::with_capacity(rows);
            for ((history, &id), &valid) in self.history.iter_mut().zip(&self.ids).zip(valid) {
                let len = history.len();
                before.push(len);
                let pad = l - valid;
                for i in 0..l {
                    let v = if i < pad {
                        -1.0
                    } else {
                        code(id, len + i - pad)
                    };
                    if i >= pad {
                        history.push(v);
                    }
                    data.extend(std::iter::repeat_n(v, 32));
                }
            }
            let k = Array::from_slice(&data, &[rows as i32, 1, l as i32, 32]);
            let (keys, _) = self.cache.update_and_fetch(&k, &k).unwrap();
            let mask = self.cache.mask(l as i32, Some(self.window)).unwrap();
            self.check_visible(&keys, &mask, l, valid, &before);
            self.check_copies();
        }

        /// What each valid query attends to equals the last `window` positions of its row's
        /// history up to itself.
        fn check_visible(
            &self,
            keys: &Stored,
            mask: &Mask,
            l: usize,
            valid: &[usize],
            before: &[usize],
        ) {
            let Stored::Plain(keys) = keys else {
                panic!("plain keys")
            };
            let t = keys.shape()[2] as usize;
            // A fresh array (the fetch is a view of the buffer).
            let values: Vec<f32> = keys
                .add(Array::from_f32(0.0))
                .unwrap()
                .as_slice::<f32>()
                .to_vec();
            let mask: Option<Vec<bool>> = match mask {
                Mask::Array(m) => {
                    let shape = m.shape().to_vec();
                    let m = mlx_rs::ops::broadcast_to(
                        m,
                        &[self.ids.len() as i32, 1, shape[2], shape[3]],
                    )
                    .unwrap()
                    .logical_and(Array::from_bool(true))
                    .unwrap();
                    Some(m.as_slice::<bool>().to_vec())
                }
                _ => None,
            };
            for r in 0..self.ids.len() {
                for i in l - valid[r]..l {
                    let p = before[r] + i - (l - valid[r]);
                    let from = (p + 1).saturating_sub(self.window);
                    let want = &self.history[r][from..=p];
                    let seen: Vec<f32> = (0..t)
                        .filter(|&j| match &mask {
                            Some(m) => m[(r * l + i) * t + j],
                            None => j + l <= t + i,
                        })
                        .map(|j| values[(r * t + j) * 32])
                        .collect();
                    assert_eq!(seen, want, "row {r}, query at {p}");
                }
            }
        }

        /// Each row's copy is its history from its start; its logical length is the history's.
        fn check_copies(&self) {
            for r in 0..self.ids.len() {
                assert_eq!(self.cache.row_len(r), self.history[r].len(), "row {r}");
                let start = self.cache.row_start(r);
                let (copy, _) = self.cache.row_copy(r).unwrap().unwrap();
                let got: Vec<f32> = row_values(&copy)[0].iter().step_by(32).copied().collect();
                assert_eq!(got, self.history[r][start..], "row {r} from {start}");
                assert!(
                    self.history[r].len() - start >= self.window.min(self.history[r].len()),
                    "row {r} holds less than its window"
                );
            }
        }

        fn rollback(&mut self, drop: &[usize]) {
            self.cache.rollback(drop).unwrap();
            for (h, &d) in self.history.iter_mut().zip(drop) {
                h.truncate(h.len() - d);
            }
            self.check_copies();
        }

        fn filter(&mut self, keep: &[usize]) {
            self.cache.filter(keep).unwrap();
            self.ids = keep.iter().map(|&r| self.ids[r]).collect();
            self.history = keep.iter().map(|&r| self.history[r].clone()).collect();
            self.check_copies();
        }

        fn extend(&mut self, other: Driven) {
            self.cache.extend(other.cache).unwrap();
            self.ids.extend(other.ids);
            self.history.extend(other.history);
            self.check_copies();
        }
    }

    #[test]
    fn a_window_cut_keeps_each_rows_last_span_and_offsets_with_padding() {
        let window = 4;
        let keep = window + WINDOW_SLACK;
        let mut d = Driven::prefill(vec![0, 1, 2], vec![0, 3, 7], 10, window);
        for step in 0..6 * keep {
            d.step(1);
            assert!(
                d.cache.idx as usize <= 2 * keep,
                "step {step}: {} positions",
                d.cache.idx
            );
        }
        assert!(d.cache.row_start(2) > 0, "positions were evicted");
        // The buffer stays one size once cuts begin: two spans of positions.
        let bytes = d.cache.nbytes();
        assert_eq!(bytes, 2 * 3 * 2 * keep * 32 * 4);
        for _ in 0..3 * keep {
            d.step(1);
            assert_eq!(d.cache.nbytes(), bytes);
        }
    }

    #[test]
    fn a_window_cut_keeps_holes_and_a_rollback_after_it_leaves_what_the_row_kept() {
        let window = 4;
        let keep = window + WINDOW_SLACK;
        let mut d = Driven::prefill(vec![0, 1, 2], vec![0, 0, 0], 3, window);
        let drops = [[0, 3, 1], [2, 0, 3], [1, 1, 1], [3, 2, 0]];
        for round in 0..8 * keep {
            // Four queries at once (a verification pass), then each row rejects its own
            // count: holes, cuts and compactions interleave.
            d.step(4);
            d.rollback(&drops[round % drops.len()]);
            assert!((d.cache.idx as usize) < 2 * keep + 4 + MAX_HOLES);
        }
        assert!(d.cache.row_start(1) > 0, "positions were evicted");
        // A rollback of a whole pass right after a cut still leaves the window.
        d.step(MAX_NUM_DRAFT + 1);
        d.rollback(&[MAX_NUM_DRAFT + 1, MAX_NUM_DRAFT, 0]);
        d.step(1);
        // A draft model's cache: one position per pass, up to `MAX_NUM_DRAFT + 1` of them
        // (cuts between them), then a rollback of all of them.
        for round in 0..4 * keep {
            for _ in 0..=MAX_NUM_DRAFT {
                d.step(1);
            }
            let drop = MAX_NUM_DRAFT + 1 - round % 3;
            d.rollback(&[drop, MAX_NUM_DRAFT + 1, round % 5]);
        }
    }

    #[test]
    fn extend_and_filter_carry_each_rows_evicted_positions() {
        let window = 3;
        let keep = window + WINDOW_SLACK;
        let mut long = Driven::prefill(vec![0], vec![0], 5, window);
        for _ in 0..3 * keep {
            long.step(1);
        }
        assert!(long.cache.row_start(0) > 0);
        // A short row joins a long one (padded on the left), then a long one joins them.
        long.extend(Driven::prefill(vec![1], vec![0], 4, window));
        for _ in 0..keep {
            long.step(1);
        }
        let mut other = Driven::prefill(vec![2, 3], vec![2, 0], 6, window);
        for _ in 0..5 * keep {
            other.step(1);
        }
        long.extend(other);
        long.step(1);
        long.filter(&[3, 1]);
        for _ in 0..3 * keep {
            long.step(1);
        }
        long.filter(&[1]);
        long.step(2);
    }

    #[test]
    fn a_hit_row_continues_from_its_start() {
        let window = 4;
        let mut d = Driven::prefill(vec![7], vec![0], 60, window);
        d.cache.evict_outside_window().unwrap();
        let start = d.cache.row_start(0);
        assert!(start > 0);
        let (k, v) = d.cache.row_copy(0).unwrap().unwrap();
        let history = d.history[0].clone();
        let mut hit = Driven {
            cache: BatchKv::from_row(k, v, start, None).windowed(Some(window)),
            window,
            ids: vec![7],
            history: vec![history],
        };
        hit.check_copies();
        for _ in 0..40 {
            hit.step(1);
        }
    }

    #[test]
    fn a_windowed_cache_refuses_a_wider_attention() {
        let mut cache = BatchKv::with_padding(vec![0], None).windowed(Some(4));
        let k = positions(1, 0, 2);
        cache.update_and_fetch(&k, &k).unwrap();
        assert!(cache.mask(1, Some(4)).is_ok());
        assert!(cache.mask(1, Some(3)).is_ok());
        assert!(cache.mask(1, Some(5)).is_err());
        assert!(cache.mask(1, None).is_err());
        let other = BatchKv::with_padding(vec![0], None);
        let mut other = other;
        other.update_and_fetch(&k, &k).unwrap();
        assert!(cache.extend(other).is_err());
    }

    #[test]
    fn rollback_per_row_plain() {
        rollback_keeps_each_rows_prefix(None);
    }

    #[test]
    fn rollback_per_row_quantized() {
        rollback_keeps_each_rows_prefix(Some(KvQuant {
            bits: 8,
            group_size: 32,
        }));
    }
}
