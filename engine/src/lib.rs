//! `mlxd-engine`: everything that touches MLX. One OS thread owns the model and its caches;
//! the HTTP side talks to it through the channels in [`runtime::request`].
pub mod adapters;
pub mod app;
pub mod cache;
pub mod chat_template;
pub mod constraint;
pub mod detokenizer;
pub mod device;
pub mod distributed;
pub mod fault;
pub mod job;
pub mod kernel_cache;
pub mod loader;
pub mod models;
pub mod rotary;
pub mod runtime;
pub mod server;
pub mod tokenizer;
