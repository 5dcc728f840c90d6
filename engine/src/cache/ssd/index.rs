//! What the SSD tier holds: one record per file (its tokens, size and when it was last
//! used), the longest-prefix lookup over them, and the size cap's eviction, oldest first.
//! Pure: the writer applies the deletions it returns.

use crate::cache::prefix::common_prefix;
use crate::cache::seq_kv::dominates;
use crate::cache::KvSpace;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    /// The file's name in the tier's directory.
    pub name: String,
    /// Whose KV it holds (the base model's or an adapter's): it serves only that space.
    pub space: KvSpace,
    pub tokens: Vec<u32>,
    /// Per layer, the logical position of its first held position (see
    /// [`SeqKv`](crate::cache::SeqKv)).
    pub starts: Vec<usize>,
    pub bytes: u64,
    /// Last written or restored, on the tier's clock (file modification times at start-up).
    pub used: u64,
}

#[derive(Debug, Default)]
pub struct Index {
    entries: Vec<IndexEntry>,
    /// Bytes the files may take; `None` is unlimited.
    cap: Option<u64>,
    bytes: u64,
}

impl Index {
    pub fn new(cap: Option<u64>) -> Self {
        Self {
            entries: Vec::new(),
            cap,
            bytes: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn entries(&self) -> &[IndexEntry] {
        &self.entries
    }

    /// True when an entry of `space` already holds `tokens` with layers starting at `starts`
    /// (it or a longer sequence that starts with them, and whose layers start no later):
    /// writing them again would add nothing.
    pub fn covers(&self, space: KvSpace, tokens: &[u32], starts: &[usize]) -> bool {
        self.entries.iter().any(|e| {
            e.space == space && e.tokens.starts_with(tokens) && dominates(&e.starts, starts)
        })
    }

    /// The entry of `space` sharing the longest prefix with `tokens`, the match capped at
    /// `max_match`, among those that can restore it (`usable(starts, matched)`); ties go to
    /// the shorter file (less to read).
    pub fn lookup_where(
        &self,
        space: KvSpace,
        tokens: &[u32],
        max_match: usize,
        usable: impl Fn(&[usize], usize) -> bool,
    ) -> Option<(&IndexEntry, usize)> {
        self.entries
            .iter()
            .filter(|e| e.space == space)
            .map(|e| (e, common_prefix(&e.tokens, tokens).min(max_match)))
            .filter(|&(e, m)| m > 0 && usable(&e.starts, m))
            .max_by_key(|&(e, m)| (m, std::cmp::Reverse(e.tokens.len())))
    }

    /// [`Self::lookup_where`] over every entry of the base space.
    pub fn lookup(&self, tokens: &[u32], max_match: usize) -> Option<(&IndexEntry, usize)> {
        self.lookup_where(KvSpace::BASE, tokens, max_match, |_, _| true)
    }

    /// Marks `name` used at `now` (a restore), so the cap evicts it later.
    pub fn touch(&mut self, name: &str, now: u64) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.name == name) {
            e.used = e.used.max(now);
        }
    }

    /// Adds a written file. Entries whose tokens are a prefix of the new one are redundant
    /// when the new one's layers start no later (a windowed entry that evicted more cannot
    /// replace them), and the oldest are evicted while the files exceed the cap (never the
    /// new one: a file larger than the cap is evicted at once). Returns the names of the
    /// files to delete.
    pub fn insert(&mut self, entry: IndexEntry) -> Vec<String> {
        let mut removed = Vec::new();
        self.entries.retain(|e| {
            let redundant = e.name == entry.name
                || (e.space == entry.space
                    && entry.tokens.starts_with(&e.tokens)
                    && dominates(&entry.starts, &e.starts));
            if redundant && e.name != entry.name {
                removed.push(e.name.clone());
            }
            !redundant
        });
        let fits = self.cap.is_none_or(|cap| entry.bytes <= cap);
        let name = entry.name.clone();
        self.entries.push(entry);
        if !fits {
            self.remove(&name);
            removed.push(name);
        }
        self.recount();
        removed.extend(self.evict_over_cap());
        removed
    }

    /// Forgets `name` (deleted, or found invalid).
    pub fn remove(&mut self, name: &str) -> Option<IndexEntry> {
        let i = self.entries.iter().position(|e| e.name == name)?;
        let e = self.entries.swap_remove(i);
        self.recount();
        Some(e)
    }

    /// Oldest-first eviction down to the cap; returns the evicted names.
    fn evict_over_cap(&mut self) -> Vec<String> {
        let Some(cap) = self.cap else {
            return Vec::new();
        };
        let mut evicted = Vec::new();
        while self.bytes > cap {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            evicted.push(self.entries.swap_remove(oldest).name);
            self.recount();
        }
        evicted
    }

    fn recount(&mut self) {
        self.bytes = self.entries.iter().map(|e| e.bytes).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, tokens: &[u32], bytes: u64, used: u64) -> IndexEntry {
        windowed(name, tokens, 0, bytes, used)
    }

    /// An entry of one global layer and one windowed layer that starts at `start`.
    fn windowed(name: &str, tokens: &[u32], start: usize, bytes: u64, used: u64) -> IndexEntry {
        IndexEntry {
            name: name.into(),
            space: KvSpace::BASE,
            tokens: tokens.to_vec(),
            starts: vec![0, start],
            bytes,
            used,
        }
    }

    #[test]
    fn a_windowed_entry_replaces_and_covers_only_what_it_can_restore() {
        let mut ix = Index::new(None);
        let long: Vec<u32> = (0..40).collect();
        ix.insert(windowed("short", &long[..12], 2, 10, 1));
        // The longer entry evicted more: the shorter one still serves early branches.
        assert!(ix.insert(windowed("long", &long, 30, 10, 2)).is_empty());
        assert_eq!(ix.len(), 2);
        assert!(!ix.covers(KvSpace::BASE, &long[..20], &[0, 5]));
        assert!(ix.covers(KvSpace::BASE, &long[..20], &[0, 30]));
        // Usable from start + window - 1 (window 8 here).
        let usable = |starts: &[usize], m: usize| starts[1] == 0 || starts[1] + 8 <= m + 1;
        let mut prompt = long[..12].to_vec();
        prompt.push(99);
        let base = KvSpace::BASE;
        let (e, m) = ix.lookup_where(base, &prompt, 12, usable).unwrap();
        assert_eq!((e.name.as_str(), m), ("short", 12));
        let (e, m) = ix.lookup_where(base, &long, 39, usable).unwrap();
        assert_eq!((e.name.as_str(), m), ("long", 39));
        let mut branch = long[..35].to_vec();
        branch.push(99);
        assert_eq!(
            ix.lookup_where(base, &branch, 35, usable).unwrap().0.name,
            "short",
            "the long entry cannot restore 35 positions"
        );
        // One that starts no later replaces both.
        let removed = ix.insert(windowed("whole", &long, 0, 10, 3));
        assert_eq!(removed.len(), 2);
    }

    #[test]
    fn finds_the_longest_prefix_capped() {
        let mut ix = Index::new(None);
        ix.insert(entry("a", &[1, 2, 3], 10, 1));
        ix.insert(entry("b", &[1, 2, 9, 9], 10, 2));
        let (e, m) = ix.lookup(&[1, 2, 3, 4], 3).unwrap();
        assert_eq!((e.name.as_str(), m), ("a", 3));
        let (e, m) = ix.lookup(&[1, 2, 3], 2).unwrap();
        // Both match two tokens: the shorter file wins.
        assert_eq!((e.name.as_str(), m), ("a", 2));
        assert!(ix.lookup(&[5], 1).is_none());
        assert!(ix.covers(KvSpace::BASE, &[1, 2], &[0, 0]));
        assert!(!ix.covers(KvSpace::BASE, &[1, 2, 3, 4], &[0, 0]));
    }

    #[test]
    fn an_adapters_entries_serve_and_replace_only_its_own_space() {
        let adapter = KvSpace([3; 32]);
        let mut ix = Index::new(None);
        ix.insert(entry("base", &[1, 2], 10, 1));
        let in_adapter = |name: &str, tokens: &[u32], used| IndexEntry {
            space: adapter,
            ..entry(name, tokens, 10, used)
        };
        // A longer adapter entry leaves the base's shorter one.
        assert!(ix.insert(in_adapter("a", &[1, 2, 3], 2)).is_empty());
        assert_eq!(ix.len(), 2);
        assert!(!ix.covers(adapter, &[1, 2, 3, 4], &[0, 0]));
        assert!(ix.covers(adapter, &[1, 2], &[0, 0]));
        assert!(!ix.covers(KvSpace::BASE, &[1, 2, 3], &[0, 0]));
        let any = |_: &[usize], _: usize| true;
        let (e, m) = ix.lookup_where(adapter, &[1, 2, 3, 4], 3, any).unwrap();
        assert_eq!((e.name.as_str(), m), ("a", 3));
        let (e, m) = ix.lookup(&[1, 2, 3, 4], 3).unwrap();
        assert_eq!((e.name.as_str(), m), ("base", 2));
        assert!(ix.lookup_where(KvSpace([4; 32]), &[1, 2], 1, any).is_none());
    }

    #[test]
    fn a_longer_entry_makes_its_prefixes_redundant() {
        let mut ix = Index::new(None);
        ix.insert(entry("turn1", &[1, 2], 10, 1));
        ix.insert(entry("other", &[5], 10, 2));
        let removed = ix.insert(entry("turn2", &[1, 2, 3], 20, 3));
        assert_eq!(removed, vec!["turn1".to_string()]);
        assert_eq!((ix.len(), ix.bytes()), (2, 30));
        // The same name again replaces the record without deleting the file.
        assert!(ix.insert(entry("turn2", &[1, 2, 3], 25, 4)).is_empty());
        assert_eq!((ix.len(), ix.bytes()), (2, 35));
    }

    #[test]
    fn the_cap_evicts_the_oldest_first() {
        let mut ix = Index::new(Some(30));
        ix.insert(entry("old", &[1], 10, 1));
        ix.insert(entry("mid", &[2], 10, 2));
        ix.insert(entry("new", &[3], 10, 3));
        ix.touch("old", 4); // restored: now the most recent
        assert_eq!(ix.insert(entry("newest", &[4], 10, 5)), vec!["mid"]);
        assert_eq!(
            ix.insert(entry("big", &[5], 25, 6)),
            vec!["new", "old", "newest"]
        );
        assert_eq!(ix.bytes(), 25);
        // Larger than the cap: deleted at once, the rest kept.
        assert_eq!(ix.insert(entry("huge", &[6], 31, 7)), vec!["huge"]);
        assert_eq!(ix.len(), 1);
    }
}
