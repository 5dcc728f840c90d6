//! `mlxd-engine`: everything that touches MLX. One OS thread owns the model and its caches;
//! the HTTP side talks to it through the channels in [`work`].
pub mod chat_template;
pub mod detokenizer;
pub mod mlx_runtime;
pub mod sampling;
pub mod server;
pub mod tokenizer;
pub mod work;
