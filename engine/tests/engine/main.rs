//! The engine's integration tests, as one test binary: each engine test binary links MLX, and
//! compiling and linking one per file cost CI more than running them. Each former test file is
//! a module here; `cargo test -p mlxd-engine --test engine <module>::` runs one of them.
//!
//! Shared helpers (tiny models, the reference implementations, a real engine process, the
//! batched runtime driven directly) are in [`common`].
mod common;

mod adapter_admin;
mod adapter_cache;
mod adapters;
mod constrained_batch;
mod families;
mod fuzz_headers;
mod gguf_kquants;
mod loader_errors;
mod parity_tiny;
mod runtime_batch;
mod smollm2;
mod speculative;
mod ssd_tier;
mod train;
