//! The cache manager: the one owner of the KV budget and the prefix cache, on the MLX thread.
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mlx_rs::error::Exception;
use mlxd_protocol::control::PrefixStats;

use super::ssd::format::EntryKind;
use super::ssd::SsdTier;
use super::{
    BatchKv, KvBudget, KvLayout, KvSpace, LayerCache, LayerKind, PrefixCache, Reservation, SeqKv,
    SeqLayer, StateCache,
};

/// A prompt's cached prefix, as fresh one-row caches ready to prefill the rest into.
pub struct PrefixHit {
    pub tokens: usize,
    pub layers: Vec<LayerCache>,
}

pub struct CacheManager {
    budget: KvBudget,
    prefix: PrefixCache<SeqKv>,
    /// Each layer's kind (sliding window, recurrent state), which decides what an entry can
    /// restore and bounds the caches of a hit.
    kinds: Vec<LayerKind>,
    /// Bytes of the recurrent states of one sequence, whatever its length.
    state_bytes: u64,
    /// KV bytes per token unquantized and as the layout quantizes them.
    plain_bytes_per_token: u64,
    bytes_per_token: u64,
    /// How the caches this manager hands out store keys and values.
    layout: KvLayout,
    /// The SSD tier (`--ssd-cache`): every stored prefix is written behind to it, and a
    /// lookup that it matches further than memory restores from it.
    ssd: Option<SsdTier>,
    /// When idle entries were last demoted to the SSD tier.
    demoted_at: Option<Instant>,
    /// Lookups, hits and reused tokens since the manager was made ([`Self::prefix_stats`]).
    lookups: u64,
    hits: u64,
    reused_tokens: u64,
}

impl CacheManager {
    pub fn new(
        kv_budget: Option<u64>,
        prefix_budget: u64,
        plain_bytes_per_token: usize,
        bytes_per_token: usize,
        layout: KvLayout,
    ) -> Self {
        Self {
            budget: KvBudget::new(kv_budget),
            prefix: PrefixCache::new(prefix_budget),
            kinds: Vec::new(),
            state_bytes: 0,
            plain_bytes_per_token: plain_bytes_per_token as u64,
            bytes_per_token: bytes_per_token as u64,
            layout,
            ssd: None,
            demoted_at: None,
            lookups: 0,
            hits: 0,
            reused_tokens: 0,
        }
    }

    /// This manager for a model whose layers are `kinds` (a manager without them treats every
    /// layer as global attention), whose recurrent layers hold `state_bytes` per sequence.
    pub fn with_layers(mut self, kinds: Vec<LayerKind>, state_bytes: usize) -> Self {
        self.kinds = kinds;
        self.state_bytes = state_bytes as u64;
        self
    }

    /// The layer kinds this manager was made for.
    pub fn kinds(&self) -> &[LayerKind] {
        &self.kinds
    }

    /// Bytes of the recurrent states of one sequence.
    pub fn state_bytes(&self) -> u64 {
        self.state_bytes
    }

    /// This manager with the SSD tier `ssd`.
    pub fn with_ssd(mut self, ssd: Option<SsdTier>) -> Self {
        self.ssd = ssd;
        self
    }

    /// Hands the SSD tier over (to the manager that replaces this one after a failure).
    pub fn take_ssd(&mut self) -> Option<SsdTier> {
        self.ssd.take()
    }

    /// Generated tokens between two checkpoints of a running sequence, when configured.
    pub fn checkpoint_every(&self) -> Option<usize> {
        self.ssd.as_ref()?.config().checkpoint_every
    }

    /// How long the MLX thread may sleep while idle before [`Self::demote_idle`] is due.
    pub fn housekeeping_interval(&self) -> Option<Duration> {
        let idle = self.ssd.as_ref()?.config().demote_idle?;
        Some((idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(1)))
    }

    /// Moves prefix-cache entries unused for `--ssd-demote-idle` out of memory (writing the
    /// ones no file covers yet). Runs at most once per housekeeping interval.
    pub fn demote_idle(&mut self) -> Result<(), Exception> {
        let (Some(ssd), Some(every)) = (&self.ssd, self.housekeeping_interval()) else {
            return Ok(());
        };
        let now = Instant::now();
        if self
            .demoted_at
            .is_some_and(|t| now.duration_since(t) < every)
        {
            return Ok(());
        }
        self.demoted_at = Some(now);
        let idle = ssd.config().demote_idle.expect("checked above");
        let Some(cutoff) = now.checked_sub(idle) else {
            return Ok(());
        };
        for (space, tokens, kv) in self.prefix.remove_unused_since(cutoff) {
            ssd.queue_kv(space, &tokens, &kv, EntryKind::Prefix)?;
            ssd.counters().demoted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(tokens = tokens.len(), "prefix demoted to the SSD tier");
        }
        Ok(())
    }

    /// Queues a running sequence's KV (the cache of `tokens` in `space`, `generated` of them
    /// past its prompt) to the SSD tier, so that a resume after a crash restores it.
    pub fn checkpoint(
        &mut self,
        space: KvSpace,
        tokens: &[u32],
        kv: &SeqKv,
        generated: usize,
    ) -> Result<(), Exception> {
        let Some(ssd) = &self.ssd else {
            return Ok(());
        };
        ssd.queue_kv(
            space,
            tokens,
            kv,
            EntryKind::Checkpoint {
                generated: generated as u32,
            },
        )
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// KV bytes per token, unquantized and as stored when quantized.
    pub fn bytes_per_token(&self) -> (usize, usize) {
        (
            self.plain_bytes_per_token as usize,
            self.bytes_per_token as usize,
        )
    }

    pub fn budget(&self) -> &KvBudget {
        &self.budget
    }

    /// Cache bytes a sequence of `tokens` positions may need: its recurrent states (a fixed
    /// part) and its attention layers' keys and values.
    ///
    /// Conservative for a model with sliding-window layers: a windowed layer's cache holds at
    /// most about `2 × (window + WINDOW_SLACK)` positions however long the sequence, but the
    /// model's bytes per token count every layer at every position, so the reservation
    /// covers the windowed layers as if they were global.
    pub fn bytes_for(&self, tokens: usize) -> u64 {
        self.state_bytes
            + self
                .layout
                .bytes_for(tokens, self.plain_bytes_per_token, self.bytes_per_token)
    }

    pub fn reserve(&mut self, bytes: u64) -> Reservation {
        self.budget.reserve(bytes)
    }

    pub fn release(&mut self, reservation: Reservation) {
        self.budget.release(reservation);
    }

    pub fn prefix_budget(&self) -> u64 {
        self.prefix.budget()
    }

    pub fn prefix_bytes(&self) -> u64 {
        self.prefix.bytes()
    }

    /// The prefix cache's figures for `Stats`: what [`Self::lookup`] found, what the budget
    /// evicted, what it holds.
    pub fn prefix_stats(&self) -> PrefixStats {
        PrefixStats {
            lookups: self.lookups,
            hits: self.hits,
            reused_tokens: self.reused_tokens,
            evictions: self.prefix.evictions(),
            entries: self.prefix.len() as u64,
            bytes: self.prefix.bytes(),
        }
    }

    /// The longest cached prefix of `prompt` in `space` (the adapter it runs with) that an
    /// entry can restore, leaving at least its last token to run: from memory, or restored
    /// from the SSD tier when a file there matches further. An entry whose windowed layers
    /// evicted positions the prompt's next query reads is a miss for this prompt (the next
    /// best entry may serve).
    pub fn lookup(
        &mut self,
        space: KvSpace,
        prompt: &[u32],
    ) -> Result<Option<PrefixHit>, Exception> {
        if !self.prefix.enabled() || prompt.len() < 2 {
            return Ok(None);
        }
        self.lookups += 1;
        let found = self.find(space, prompt)?;
        if let Some(hit) = &found {
            self.hits += 1;
            self.reused_tokens += hit.tokens as u64;
        }
        Ok(found)
    }

    /// [`Self::lookup`]'s search, for a prompt of at least two tokens.
    fn find(&mut self, space: KvSpace, prompt: &[u32]) -> Result<Option<PrefixHit>, Exception> {
        let max = prompt.len() - 1;
        let kinds = &self.kinds;
        let in_memory = self
            .prefix
            .lookup_where(space, prompt, max, |kv, n| kv.serves(n, kinds))
            .map(|h| (h.matched, h.entry_len, h.payload.clone()));
        let memory_matched = in_memory.as_ref().map_or(0, |m| m.0);
        if let Some(ssd) = &self.ssd {
            if let Some(m) = ssd
                .lookup_where(space, prompt, max, |starts, n| {
                    super::seq_kv::serves(starts, kinds, n)
                })
                .filter(|m| m.matched > memory_matched)
            {
                // The file read may have replaced the one indexed (same tokens, other
                // starts): it must still serve the match.
                if let Some(kv) = ssd.restore_kv(&m)?.filter(|kv| kv.serves(m.matched, kinds)) {
                    tracing::info!(
                        tokens = m.matched,
                        file = %m.name,
                        "prefix restored from the SSD tier"
                    );
                    let bytes = kv.nbytes();
                    self.prefix.insert_with(
                        space,
                        m.tokens.clone(),
                        kv.clone(),
                        bytes,
                        SeqKv::dominates,
                    );
                    return self.hit(&kv, m.matched, m.entry_len).map(Some);
                }
            }
        }
        match in_memory {
            Some((matched, entry_len, kv)) => self.hit(&kv, matched, entry_len).map(Some),
            None => Ok(None),
        }
    }

    /// One-row caches holding the first `matched` of an entry's `entry_len` positions: a
    /// layer that starts at `start` gives positions `start..matched`.
    fn hit(&self, entry: &SeqKv, matched: usize, entry_len: usize) -> Result<PrefixHit, Exception> {
        let layout = self.layout;
        let whole = matched == entry_len;
        let layers = entry
            .layers
            .iter()
            .zip(&entry.starts)
            .enumerate()
            .map(|(layer, (seq_layer, &start))| {
                let (k, v) = match seq_layer {
                    SeqLayer::Kv(k, v) => (k, v),
                    // `serves` held: a state stands for exactly the matched tokens.
                    SeqLayer::State(arrays) => {
                        return Ok(LayerCache::State(StateCache::from_row(
                            arrays.clone(),
                            matched,
                        )))
                    }
                };
                let n = (matched - start) as i32;
                let (k, v) = if whole {
                    (k.clone(), v.clone())
                } else {
                    (k.prefix(n)?, v.prefix(n)?)
                };
                // A quantized entry keeps writing quantized; a plain one follows the layout.
                let quant = k.quant();
                let window = self.kinds.get(layer).and_then(|k| k.window());
                let mut row = BatchKv::from_row(k, v, start, quant).windowed(window);
                if let Some(q) = layout.at(matched) {
                    row.quantize(q)?;
                }
                Ok(LayerCache::Batched(row))
            })
            .collect::<Result<_, Exception>>()?;
        Ok(PrefixHit {
            tokens: matched,
            layers,
        })
    }

    /// Keeps `kv` as the cache of `tokens` in `space`. Its copy is queued (`async_eval`), not waited
    /// for: a row leaves the batch at almost every step of a large batch, and waiting here
    /// would make each such step wait for the device instead of running one ahead. Queued,
    /// the copy is computed in stream order right after the step that was queued before it,
    /// and its graph is detached, so it holds no reference to the batch buffers it was copied
    /// from (a departing row's buffer is already replaced by the filtered one). With the SSD
    /// tier it is evaluated now: the writer thread reads its bytes.
    pub fn store(
        &mut self,
        space: KvSpace,
        tokens: Vec<u32>,
        kv: impl Into<SeqKv>,
    ) -> Result<(), Exception> {
        if !self.prefix.enabled() || tokens.is_empty() {
            return Ok(());
        }
        let kv = kv.into();
        if self.ssd.is_some() {
            mlx_rs::transforms::eval(kv.arrays())?;
        } else {
            mlx_rs::transforms::async_eval(kv.arrays())?;
        }
        let bytes = kv.nbytes();
        if let Some(ssd) = &self.ssd {
            ssd.queue_kv(space, &tokens, &kv, EntryKind::Prefix)?;
        }
        self.prefix
            .insert_with(space, tokens, kv, bytes, SeqKv::dominates);
        Ok(())
    }

    pub fn prefix_enabled(&self) -> bool {
        self.prefix.enabled()
    }

    /// Forgets every cached prefix (after an out-of-memory error).
    pub fn clear_prefixes(&mut self) {
        self.prefix.clear();
    }
}
