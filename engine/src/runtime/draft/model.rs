//! Drafting with a smaller model that shares the main model's tokenizer.
//!
//! The draft model keeps its own batched KV cache, row for row with the decode batch: rows join
//! with their prompt prefilled into it (all but the last token, like the main cache), leave
//! with the batch's filter, and roll back with the main cache after each verification. A
//! proposal runs `q + 1` greedy steps for every row, feeding each draft back: the last step
//! only writes the `q`-th draft into the cache, so that after any verification the draft cache
//! holds exactly the accepted tokens and every row's next proposal starts from one token.
use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{Array, Dtype};

use crate::cache::LayerCache;
use crate::models::CausalLm;

pub struct ModelDrafter {
    model: Box<dyn CausalLm>,
    /// One per layer, a row per batch row; empty while the batch is.
    caches: Vec<LayerCache>,
    prefill_chunk: usize,
}

impl ModelDrafter {
    pub fn new(model: Box<dyn CausalLm>, prefill_chunk: usize) -> Self {
        Self {
            model,
            caches: Vec::new(),
            prefill_chunk: prefill_chunk.max(1),
        }
    }

    pub fn model(&self) -> &dyn CausalLm {
        self.model.as_ref()
    }

    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(LayerCache::nbytes).sum()
    }

    /// Rows leave: keeps rows `keep`, in order.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), Exception> {
        if keep.is_empty() {
            self.caches.clear();
            return Ok(());
        }
        for cache in &mut self.caches {
            cache.filter(keep)?;
        }
        Ok(())
    }

    /// Rows join after the current ones: each one's `context` (everything but its last token)
    /// is prefilled into a new row of the draft cache.
    pub fn join(&mut self, contexts: &[&[u32]]) -> Result<(), Exception> {
        let kinds = self.model.layer_kinds();
        if self.caches.is_empty() {
            self.caches = kinds.iter().map(|k| k.fresh(Vec::new(), None)).collect();
        }
        for context in contexts {
            let mut row: Vec<LayerCache> = kinds.iter().map(|k| k.fresh(vec![0], None)).collect();
            for chunk in context.chunks(self.prefill_chunk) {
                let input = Array::from_slice(chunk, &[1, chunk.len() as i32]);
                let _ = self.model.forward(&input, &mut row)?;
                for cache in &mut row {
                    cache.evict_outside_window()?;
                }
                mlx_rs::transforms::eval(row.iter().flat_map(LayerCache::state))?;
            }
            for (cache, layer) in self.caches.iter_mut().zip(row) {
                cache.extend(layer)?;
            }
        }
        Ok(())
    }

    /// `q` greedy drafts per row after each row's `last` token (`[B]` u32, not yet in either
    /// cache), as a lazy `[B, q]` array; the cache then holds `last` and all `q` drafts.
    pub fn propose(&mut self, last: &Array, q: usize) -> Result<Array, Exception> {
        let b = last.shape()[0];
        let mut input = last.reshape(&[b, 1])?;
        let mut drafts = Vec::with_capacity(q);
        for step in 0..=q {
            let logits = self.model.forward(&input, &mut self.caches)?;
            if step == q {
                break;
            }
            let next =
                argmax_axis(logits.index((.., -1, ..)), -1, true)?.as_dtype(Dtype::Uint32)?;
            drafts.push(next.clone());
            input = next;
        }
        concatenate(&drafts, 1)
    }

    /// Drops the last `drop[r]` positions of each row, with the main cache.
    pub fn rollback(&mut self, drop: &[usize]) -> Result<(), Exception> {
        for cache in &mut self.caches {
            cache.rollback(drop)?;
        }
        Ok(())
    }

    /// The cache arrays, to evaluate with the step.
    pub fn state(&self) -> Vec<&Array> {
        self.caches.iter().flat_map(LayerCache::state).collect()
    }
}
