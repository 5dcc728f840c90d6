//! The cache manager: the one owner of the KV budget and the prefix cache, on the MLX thread.
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mlx_rs::error::Exception;

use super::ssd::format::EntryKind;
use super::ssd::SsdTier;
use super::{BatchKv, KvBudget, KvLayout, PrefixCache, Reservation, Stored};

/// One layer's keys and values `[1, kv_heads, n, head_dim]` for a cached prefix.
type LayerKv = (Stored, Stored);

/// A prompt's cached prefix, as fresh one-row caches ready to prefill the rest into.
pub struct PrefixHit {
    pub tokens: usize,
    pub layers: Vec<BatchKv>,
}

pub struct CacheManager {
    budget: KvBudget,
    prefix: PrefixCache<Vec<LayerKv>>,
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
            plain_bytes_per_token: plain_bytes_per_token as u64,
            bytes_per_token: bytes_per_token as u64,
            layout,
            ssd: None,
            demoted_at: None,
        }
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
        for (tokens, layers) in self.prefix.remove_unused_since(cutoff) {
            ssd.queue(&tokens, &layers, EntryKind::Prefix)?;
            ssd.counters().demoted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(tokens = tokens.len(), "prefix demoted to the SSD tier");
        }
        Ok(())
    }

    /// Queues a running sequence's KV (the cache of `tokens`, `generated` of them past its
    /// prompt) to the SSD tier, so that a resume after a crash restores it.
    pub fn checkpoint(
        &mut self,
        tokens: &[u32],
        layers: &[LayerKv],
        generated: usize,
    ) -> Result<(), Exception> {
        let Some(ssd) = &self.ssd else {
            return Ok(());
        };
        ssd.queue(
            tokens,
            layers,
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

    /// KV bytes a sequence of `tokens` positions may need.
    pub fn bytes_for(&self, tokens: usize) -> u64 {
        self.layout
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

    /// The longest cached prefix of `prompt`, leaving at least its last token to run: from
    /// memory, or restored from the SSD tier when a file there matches further.
    pub fn lookup(&mut self, prompt: &[u32]) -> Result<Option<PrefixHit>, Exception> {
        if !self.prefix.enabled() || prompt.len() < 2 {
            return Ok(None);
        }
        let max = prompt.len() - 1;
        let in_memory = self
            .prefix
            .lookup(prompt, max)
            .map(|h| (h.matched, h.entry_len, h.payload.clone()));
        let memory_matched = in_memory.as_ref().map_or(0, |m| m.0);
        if let Some(ssd) = &self.ssd {
            if let Some(m) = ssd
                .lookup(prompt, max)
                .filter(|m| m.matched > memory_matched)
            {
                if let Some(layers) = ssd.restore(&m)? {
                    tracing::info!(
                        tokens = m.matched,
                        file = %m.name,
                        "prefix restored from the SSD tier"
                    );
                    let bytes = layers
                        .iter()
                        .map(|(k, v)| (k.nbytes() + v.nbytes()) as u64)
                        .sum();
                    self.prefix.insert(m.tokens.clone(), layers.clone(), bytes);
                    return self.hit(&layers, m.matched, m.entry_len).map(Some);
                }
            }
        }
        match in_memory {
            Some((matched, entry_len, layers)) => self.hit(&layers, matched, entry_len).map(Some),
            None => Ok(None),
        }
    }

    /// One-row caches holding the first `matched` of an entry's `entry_len` positions.
    fn hit(
        &self,
        payload: &[LayerKv],
        matched: usize,
        entry_len: usize,
    ) -> Result<PrefixHit, Exception> {
        let layout = self.layout;
        let n = matched as i32;
        let whole = matched == entry_len;
        let layers = payload
            .iter()
            .map(|(k, v)| {
                let (k, v) = if whole {
                    (k.clone(), v.clone())
                } else {
                    (k.prefix(n)?, v.prefix(n)?)
                };
                // A quantized entry keeps writing quantized; a plain one follows the layout.
                let quant = match &k {
                    Stored::Quantized { quant, .. } => Some(*quant),
                    Stored::Plain(_) => None,
                };
                let mut row = BatchKv::from_row(k, v, quant);
                if let Some(q) = layout.at(matched) {
                    row.quantize(q)?;
                }
                Ok(row)
            })
            .collect::<Result<_, Exception>>()?;
        Ok(PrefixHit {
            tokens: matched,
            layers,
        })
    }

    /// Keeps `layers` as the cache of `tokens` (evaluated now, so that they hold no reference
    /// to the batch buffers they were copied from).
    pub fn store(&mut self, tokens: Vec<u32>, layers: Vec<LayerKv>) -> Result<(), Exception> {
        if !self.prefix.enabled() || tokens.is_empty() {
            return Ok(());
        }
        mlx_rs::transforms::eval(
            layers
                .iter()
                .flat_map(|(k, v)| k.arrays().into_iter().chain(v.arrays())),
        )?;
        let bytes = layers
            .iter()
            .map(|(k, v)| (k.nbytes() + v.nbytes()) as u64)
            .sum();
        if let Some(ssd) = &self.ssd {
            ssd.queue(&tokens, &layers, EntryKind::Prefix)?;
        }
        self.prefix.insert(tokens, layers, bytes);
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
