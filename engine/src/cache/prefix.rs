//! The prefix cache: the KV of earlier sequences, keyed by their token ids, reused by any later
//! prompt that starts with the same tokens (a multi-turn chat, a shared system prompt, the same
//! tool schemas).
//!
//! Generic over what it stores so that the policy (longest-prefix match, least-recently-used
//! eviction under a byte budget, dropping entries made redundant by a longer one) is tested
//! without MLX; the engine stores per-layer key/value arrays.
//!
//! Each entry lives in a [`KvSpace`] (the base model's, or one adapter's): a lookup sees only
//! its own space's entries, and an entry makes redundant only entries of its space, while the
//! byte budget and its eviction are shared by all spaces.

use std::time::Instant;

use super::KvSpace;

/// What a lookup found: the first `matched` tokens of the prompt are held by `payload`, whose
/// entry covers `entry_len` tokens (`matched <= entry_len`).
#[derive(Debug)]
pub struct PrefixLookup<'a, T> {
    pub matched: usize,
    pub entry_len: usize,
    pub payload: &'a T,
}

#[derive(Debug)]
struct Entry<T> {
    space: KvSpace,
    tokens: Vec<u32>,
    payload: T,
    bytes: u64,
    last_used: u64,
    /// When it was stored or last matched (for demotion to the SSD tier).
    used_at: Instant,
}

#[derive(Debug)]
pub struct PrefixCache<T> {
    entries: Vec<Entry<T>>,
    budget: u64,
    bytes: u64,
    clock: u64,
    /// Entries evicted for the budget so far.
    evictions: u64,
}

impl<T> PrefixCache<T> {
    /// A cache that holds at most `budget` bytes; 0 disables it.
    pub fn new(budget: u64) -> Self {
        Self {
            entries: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
            evictions: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries evicted to stay within the budget since the cache was made (entries made
    /// redundant by a longer one, or demoted, or cleared, are not counted).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The base space's entry sharing the longest prefix with `tokens`, the match capped at
    /// `max_match` (a prompt's last token must still be run to produce logits). Marks it
    /// recently used.
    pub fn lookup(&mut self, tokens: &[u32], max_match: usize) -> Option<PrefixLookup<'_, T>> {
        self.lookup_where(KvSpace::BASE, tokens, max_match, |_, _| true)
    }

    /// [`Self::lookup`] in `space`, among the entries whose payload can restore the matched
    /// tokens (`usable(payload, matched)`; a windowed entry cannot restore a prefix that ends
    /// before its window's span).
    pub fn lookup_where(
        &mut self,
        space: KvSpace,
        tokens: &[u32],
        max_match: usize,
        usable: impl Fn(&T, usize) -> bool,
    ) -> Option<PrefixLookup<'_, T>> {
        let (best, matched) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.space == space)
            .map(|(i, e)| (i, common_prefix(&e.tokens, tokens).min(max_match)))
            .filter(|&(i, m)| m > 0 && usable(&self.entries[i].payload, m))
            .max_by_key(|&(i, m)| (m, std::cmp::Reverse(self.entries[i].tokens.len())))?;
        self.clock += 1;
        let entry = &mut self.entries[best];
        entry.last_used = self.clock;
        entry.used_at = Instant::now();
        Some(PrefixLookup {
            matched,
            entry_len: entry.tokens.len(),
            payload: &entry.payload,
        })
    }

    /// Stores `payload` as the base space's cache of `tokens`. Entries that are prefixes of
    /// `tokens` become redundant and are dropped; if an entry already covers `tokens`, nothing
    /// is added. The least recently used entries (of any space) are evicted to stay within the
    /// budget. Returns how many entries were removed.
    pub fn insert(&mut self, tokens: Vec<u32>, payload: T, bytes: u64) -> usize {
        self.insert_with(KvSpace::BASE, tokens, payload, bytes, |_, _| true)
    }

    /// [`Self::insert`] in `space`, where a longer entry makes a shorter one redundant only if
    /// `dominates(longer, shorter)`: it can restore every prefix the shorter one can (a
    /// windowed entry evicted positions that a prompt branching early still needs).
    pub fn insert_with(
        &mut self,
        space: KvSpace,
        tokens: Vec<u32>,
        payload: T,
        bytes: u64,
        dominates: impl Fn(&T, &T) -> bool,
    ) -> usize {
        if !self.enabled() || tokens.is_empty() || bytes > self.budget {
            return 0;
        }
        self.clock += 1;
        if let Some(cover) = self.entries.iter_mut().find(|e| {
            e.space == space
                && e.tokens.len() >= tokens.len()
                && e.tokens.starts_with(&tokens)
                && dominates(&e.payload, &payload)
        }) {
            cover.last_used = self.clock;
            cover.used_at = Instant::now();
            return 0;
        }
        let before = self.entries.len();
        self.entries.retain(|e| {
            !(e.space == space && tokens.starts_with(&e.tokens) && dominates(&payload, &e.payload))
        });
        self.entries.push(Entry {
            space,
            tokens,
            payload,
            bytes,
            last_used: self.clock,
            used_at: Instant::now(),
        });
        self.recount();
        while self.bytes > self.budget {
            let lru = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
                .expect("over budget means at least one entry");
            self.entries.swap_remove(lru);
            self.evictions += 1;
            self.recount();
        }
        before + 1 - self.entries.len()
    }

    /// Removes the entries last used before `cutoff` and hands them back with their spaces
    /// (demotion to the SSD tier).
    pub fn remove_unused_since(&mut self, cutoff: Instant) -> Vec<(KvSpace, Vec<u32>, T)> {
        let (old, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| e.used_at < cutoff);
        self.entries = kept;
        self.recount();
        old.into_iter()
            .map(|e| (e.space, e.tokens, e.payload))
            .collect()
    }

    /// Drops every entry (after an out-of-memory error, say).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    fn recount(&mut self) {
        self.bytes = self.entries.iter().map(|e| e.bytes).sum();
    }
}

/// How many tokens `a` and `b` share from the start (also the SSD index's match).
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_shared_prefix() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3], "short", 10);
        c.insert(vec![1, 2, 9, 9], "other", 10);
        c.insert(vec![7, 8], "unrelated", 10);
        let hit = c.lookup(&[1, 2, 3, 4, 5], 4).unwrap();
        assert_eq!((hit.matched, *hit.payload), (3, "short"));
        let hit = c.lookup(&[1, 2, 9, 1], 3).unwrap();
        assert_eq!((hit.matched, *hit.payload), (3, "other"));
        assert!(c.lookup(&[5, 5], 1).is_none());
    }

    #[test]
    fn caps_the_match_so_the_last_prompt_token_is_run() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2, 3, 4], "turn", 10);
        let hit = c.lookup(&[1, 2, 3], 2).unwrap();
        assert_eq!((hit.matched, hit.entry_len), (2, 4));
    }

    #[test]
    fn a_longer_entry_replaces_its_prefixes() {
        let mut c = PrefixCache::new(1000);
        c.insert(vec![1, 2], "turn 1", 10);
        assert_eq!(c.insert(vec![1, 2, 3, 4], "turn 2", 20), 1);
        assert_eq!(c.len(), 1);
        assert_eq!(c.bytes(), 20);
        // Already covered: nothing added.
        assert_eq!(c.insert(vec![1, 2, 3], "part", 5), 0);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn evicts_least_recently_used_within_the_budget() {
        let mut c = PrefixCache::new(25);
        c.insert(vec![1], "a", 10);
        c.insert(vec![2], "b", 10);
        c.lookup(&[1, 0], 1).unwrap(); // a is now more recent than b
        assert_eq!(c.insert(vec![3], "c", 10), 1);
        assert!(c.lookup(&[2, 0], 1).is_none());
        assert!(c.lookup(&[1, 0], 1).is_some());
        assert_eq!(c.bytes(), 20);
        assert_eq!(c.evictions(), 1);
        // A longer entry replacing its own prefix is not an eviction.
        c.insert(vec![1, 5], "a2", 10);
        assert_eq!((c.len(), c.evictions()), (2, 1));
    }

    #[test]
    fn a_longer_entry_that_does_not_dominate_keeps_its_prefix() {
        // Payloads are the start of a windowed layer; an entry serves a match of at least
        // its start.
        let dominates = |a: &usize, b: &usize| a <= b;
        let mut c = PrefixCache::new(1000);
        c.insert_with(KvSpace::BASE, vec![1, 2, 3], 1, 10, dominates);
        c.insert_with(KvSpace::BASE, vec![1, 2, 3, 4, 5, 6], 5, 10, dominates);
        assert_eq!(c.len(), 2, "the longer entry starts later: both kept");
        let usable = |start: &usize, m: usize| *start <= m;
        let base = KvSpace::BASE;
        let hit = c.lookup_where(base, &[1, 2, 3, 9], 3, usable).unwrap();
        assert_eq!((hit.matched, *hit.payload), (3, 1));
        let hit = c
            .lookup_where(base, &[1, 2, 3, 4, 5, 9], 5, usable)
            .unwrap();
        assert_eq!((hit.matched, *hit.payload), (5, 5));
        assert!(c
            .lookup_where(base, &[1, 2, 9], 2, |s, m| *s + 2 <= m)
            .is_none());
        // One that starts no later replaces both.
        c.insert_with(base, vec![1, 2, 3, 4, 5, 6, 7], 0, 10, dominates);
        assert_eq!(c.len(), 1);
        // And a shorter entry it dominates adds nothing.
        assert_eq!(c.insert_with(base, vec![1, 2], 1, 10, dominates), 0);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn entries_unused_since_a_cutoff_are_handed_back() {
        let mut c = PrefixCache::new(100);
        let before = Instant::now();
        c.insert(vec![1], "a", 10);
        c.insert(vec![2], "b", 10);
        assert!(c.remove_unused_since(before).is_empty());
        let later = Instant::now() + std::time::Duration::from_secs(3600);
        let mut gone = c.remove_unused_since(later);
        gone.sort();
        let base = KvSpace::BASE;
        assert_eq!(gone, vec![(base, vec![1], "a"), (base, vec![2], "b")]);
        assert_eq!((c.len(), c.bytes()), (0, 0));
    }

    #[test]
    fn each_space_sees_only_its_own_entries_and_all_share_the_budget() {
        let adapter = KvSpace([7; 32]);
        let any = |_: &&str, _: usize| true;
        let keep_both = |_: &&str, _: &&str| true;
        let mut c = PrefixCache::new(25);
        c.insert(vec![1, 2, 3], "base", 10);
        // The same tokens under an adapter: a new entry, not covered by the base's.
        assert_eq!(
            c.insert_with(adapter, vec![1, 2], "adapter", 10, keep_both),
            0
        );
        assert_eq!(c.len(), 2);
        let hit = c.lookup_where(adapter, &[1, 2, 3, 4], 3, any).unwrap();
        assert_eq!((hit.matched, *hit.payload), (2, "adapter"));
        let hit = c.lookup(&[1, 2, 3, 4], 3).unwrap();
        assert_eq!((hit.matched, *hit.payload), (3, "base"));
        assert!(c
            .lookup_where(KvSpace([8; 32]), &[1, 2, 3], 2, any)
            .is_none());
        // A longer base entry drops the shorter base one only.
        assert_eq!(c.insert(vec![1, 2, 3, 4], "base 2", 10), 1);
        assert!(c.lookup_where(adapter, &[1, 2, 9], 2, any).is_some());
        // One budget: an adapter entry evicts the least recently used, whatever its space.
        c.insert_with(adapter, vec![5], "adapter 2", 10, keep_both);
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 20);
    }

    #[test]
    fn disabled_or_oversized_stores_nothing() {
        let mut off = PrefixCache::new(0);
        off.insert(vec![1], "a", 1);
        assert!(off.is_empty());
        let mut small = PrefixCache::new(5);
        small.insert(vec![1], "a", 6);
        assert!(small.is_empty());
    }
}
