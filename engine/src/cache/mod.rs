//! Per-sequence caches. The KV cache lives here; the prompt cache and SSD tier come later.
mod kv;

pub use kv::KvCache;
