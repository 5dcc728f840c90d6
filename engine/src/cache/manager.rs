//! The cache manager: the one owner of the KV budget and the prefix cache, on the MLX thread.
use mlx_rs::error::Exception;

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
        }
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

    /// The longest cached prefix of `prompt`, leaving at least its last token to run.
    pub fn lookup(&mut self, prompt: &[u32]) -> Result<Option<PrefixHit>, Exception> {
        if !self.prefix.enabled() || prompt.len() < 2 {
            return Ok(None);
        }
        let layout = self.layout;
        let Some(hit) = self.prefix.lookup(prompt, prompt.len() - 1) else {
            return Ok(None);
        };
        let n = hit.matched as i32;
        let whole = hit.matched == hit.entry_len;
        let layers = hit
            .payload
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
                if let Some(q) = layout.at(hit.matched) {
                    row.quantize(q)?;
                }
                Ok(row)
            })
            .collect::<Result<_, Exception>>()?;
        Ok(Some(PrefixHit {
            tokens: hit.matched,
            layers,
        }))
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
