//! `mlxd`: the GPU-free supervisor and reverse proxy.
//!
//! [`serve`] binds nothing itself: it takes a bound listener, a [`Config`] and a
//! shutdown future, so tests drive it in-process exactly as `main` does.

pub mod accept;
pub mod auth;
pub mod catalog;
pub mod chat_page;
pub mod cli;
pub mod client;
pub mod config;
pub mod engine;
pub mod engine_event;
pub mod error;
pub mod exit;
pub mod forward;
pub mod header_timeout;
pub mod health;
pub mod jobs;
pub mod leftovers;
pub mod logs;
pub mod metrics;
pub mod ollama;
pub mod placement;
pub mod policy;
pub mod pool;
pub mod port_owner;
pub mod preload;
pub mod progress;
pub mod reload;
pub mod repl;
pub mod request;
pub mod response_body;
pub mod resume;
pub mod routing;
pub mod server;
pub mod show;

pub use config::Config;
pub use server::{serve, serve_with, Preload, ServeOptions};
